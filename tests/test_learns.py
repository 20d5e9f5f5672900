"""A tiny random model learns through the whole loop of train.py: the embedded server, bwrap'd kernels, the
tool socket, rewards, GRPO advantages, the learner, weight sync after every step, held-out evaluation.

The tasks (written here, in the flashrag layout) all read "Say a word. #n". For n < 42 any of four words is
right; the SFT cold start shows expert episodes of 32 of these (each word 8 times), so it teaches the format
(<think>, a <code> cell that submits) and the four words, and nothing about which word is wanted. For n >= 42
only "grape" is right: after SFT the model says grape in 4-12% of samples (the random model's own preferences
among the four words decide). The first kind is a source of SFT episodes only (`weight: 0`), the second the
RL stream (`sft_weight: 0`). The held-out evaluation asks n = 99 (never drawn in RL) 32 times at the
sampling temperature after SFT and after 12 RL steps of 32 episodes.

Why the margin cannot be chance: the two evaluations are independent samples of 32 episodes each. The test
asks for a gain of at least 0.25 in EM and a two-proportion z-test p < 0.01: if RL changed nothing, a
difference that large has a probability below 1% (an observed 0.125 -> 0.25 alone gives p ~ 0.2).

Why RL draws only the second kind: when it drew both (until 2026-11-26), a group of the first kind whose
samples differed in format rewarded whichever word the model said most (cloud, for this random model), while
a group of the second learns only when one of its samples says grape (4% of them): 3 runs in 8 never
took off (0.125 -> 0.0 in CI, 0.062 -> 0.0 here, also with 16 steps), the others did at the 11th-12th step.
With RL on the second kind only (2 runs beside a training run): 0.031 -> 0.938 and 0.094 -> 0.906 (p <= 8e-11),
the RL batches' EM above 0.5 from the 4th-6th step. lr 1e-3 collapsed the tiny model's fragile format in one
run of four, so 5e-4.
"""

import json
import re
import subprocess
import sys

import pytest

from tests.test_train import ROOT, _env

WORDS = ["apple", "brick", "cloud", "grape"]
SECRET = "grape"


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.slow
@pytest.mark.timeout(600)  # ~250 s alone on 2 cores (32 kernels start a step); 370 s beside a training run
def test_tiny_model_learns_through_the_whole_loop(tmp_path):
    def task(n, answers, kind):
        return {"id": f"{kind}-{n}", "question": f"Say a word. #{n}", "golden_answers": answers, "metadata": {"kind": kind}}

    # any word is right (the expert submits the first of them): the SFT episodes, never an RL task
    shown = _write(tmp_path / "shown.jsonl", [task(n, WORDS[n % 4:] + WORDS[: n % 4], "any") for n in range(10, 42)])
    secret = _write(tmp_path / "secret.jsonl", [task(n, [SECRET], "secret") for n in range(42, 99)])  # the RL tasks
    held = _write(tmp_path / "eval.jsonl", [task(99, [SECRET], "secret")])
    overrides = [
        f"data.train=[{{source: {shown}, weight: 0, sft_weight: 1}}, {{source: {secret}, sft_weight: 0}}]",
        f"data.eval={held}", "data.eval_limit=1", "run.eval_samples=32", "run.eval_every=0",
        "sft.episodes=32", "sft.steps=150", "sft.batch_size=8", "sft.lr=3e-3",
        "run.steps=12", "rollout.batch_size=8", "rollout.n_samples=4", "learner.lr=5e-4", "algo.advantage=grpo",
        "agent.max_steps=1", "agent.prefill=<think>", "agent.system_prompt=Answer with code.",
        "sampling.max_new_tokens=80", "kernel.pool_size=4", "tools.search=none",
        "reward.format_weight=0", "reward.exec_weight=0", "reward.has_answer_weight=0", f"run.out_dir={tmp_path / 'runs'}",
    ]  # fmt: skip
    p = subprocess.run([sys.executable, "train.py", "--config", "configs/tiny_test.yaml", *overrides], cwd=ROOT,
                       env=_env(), capture_output=True, text=True, timeout=540)  # fmt: skip
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "SFT: 32 expert episodes of 32 tasks" in p.stdout, p.stdout[-3000:]  # the first kind's, all of them
    line = next((l for l in p.stdout.splitlines() if l.startswith("RL phase (sampled)")), None)
    assert line, p.stdout[-3000:]
    before, after, p_value = map(float, re.search(r"EM ([\d.]+) -> ([\d.]+) .* p = ([\d.e+-]+)", line).groups())
    assert after - before >= 0.25 and p_value < 0.01, p.stdout[-3000:]
