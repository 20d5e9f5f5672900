"""bench/ablate.py --quick: one SFT, every arm's RL from its weights, the table and RESULT lines, and a rerun that
skips the finished runs (the tiny random model: the machinery, not learning)."""

import json
import re
import subprocess
import sys

import pytest
import yaml

from tests.test_train import ROOT, _env

ARMS = "grpo,reinforce++:learner.lr=2e-4,reinforce++:chunk,reinforce++:chunk:resample"  # an arm may carry a setting


@pytest.mark.slow
def test_the_ablation_runs_every_arm_from_one_sft_start_and_resumes(tmp_path):
    cmd = [sys.executable, "bench/ablate.py", "--quick", "--config", "configs/tiny_test.yaml", "--arms", ARMS,
           "--seeds", "1", "--out", str(tmp_path)]  # fmt: skip
    p = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    results = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [r["arm"] for r in results] == ["sft", *ARMS.split(",")]
    sft = results[0]["weights"]
    for r in results[1:]:  # each arm trained from the SFT run's exported weights, with its own settings
        config = (ROOT / r["run"] / "config.yaml").read_text()  # (an absolute run path stays as it is)
        assert f"path: {sft}" in config and r["steps"] > 0 and len(r["rewards"]) == 1
        assert ("ratio_level: chunk" in config) == ("chunk" in r["arm"]) and ("resample: 0.5" in config) == ("resample" in r["arm"])
        assert yaml.safe_load(config)["learner"]["lr"] == (2e-4 if "lr=" in r["arm"] else 1e-4)  # --quick's lr: 1e-4
    assert "/reinforcepp-learner.lr-2e-4-s0-" in results[2]["run"]  # the run named after its arm, path-safe
    resampled = results[-1]["resample"]
    assert sum(n for _, n in resampled.values()) > 0  # some groups started from an expert prefix
    table = [line.split()[0] for line in p.stdout.splitlines() if line[:1].strip() and line.split()[0] in ARMS.split(",")]
    assert table == ARMS.split(",")
    assert "RESULT long_rl_gain=" in p.stdout and "RESULT long_steps_per_episode=" in p.stdout
    assert (tmp_path / "rewards.png").stat().st_size > 0
    again = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    body = lambda out: out.split("start (after SFT")[1].rsplit("\n", 2)[0]  # the table and RESULT lines, not the time
    assert again.returncode == 0 and body(again.stdout) == body(p.stdout), again.stdout[-2000:] + again.stderr[-2000:]
    assert not re.search(r"^\S+: \d+ s, ", again.stdout, re.M)  # no train.py run again: all were in results.jsonl
    # a second seed: the start is evaluated again from the SFT weights (as many episodes as the arm's), the arm's run
    more = subprocess.run([*cmd[:6], "grpo", "--seeds", "2", *cmd[-2:]], cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert more.returncode == 0, more.stdout[-3000:] + more.stderr[-3000:]
    assert re.findall(r"^(\S+): \d+ s, ", more.stdout, re.M) == ["start-s1", "grpo-s1"]
    start = json.loads((tmp_path / "results.jsonl").read_text().splitlines()[-2])
    assert start["arm"] == "start" and f"path: {sft}" in (ROOT / start["run"] / "config.yaml").read_text()
    for r in (results[0], start):  # each start evaluated once (train.py evaluated a run.steps=0 run's last step twice)
        assert (ROOT / r["run"] / "metrics.jsonl").read_text().count('"eval/score"') == 1, r["run"]
    n = results[0]["sampled"][1]
    assert f"start (after SFT, {2 * n} held-out episodes, 2 seed(s))" in more.stdout
    # --sft: an SFT run's weights reused; the start evaluated once per seed, greedy once (the same weights decode the
    # same episodes again), the arm's runs from those weights
    reuse = subprocess.run([*cmd[:6], "grpo", "--seeds", "2", "--out", str(tmp_path / "reuse"), "--sft", sft,
                            "run.eval_greedy=true"], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert reuse.returncode == 0, reuse.stdout[-3000:] + reuse.stderr[-3000:]
    assert re.findall(r"^(\S+): \d+ s, ", reuse.stdout, re.M) == ["start-s0", "start-s1", "grpo-s0", "grpo-s1"]
    runs = {(r["arm"], r["seed"]): r for r in map(json.loads, (tmp_path / "reuse" / "results.jsonl").read_text().splitlines())}
    assert all(f"path: {sft}" in (ROOT / r["run"] / "config.yaml").read_text() for r in runs.values())
    assert runs["start", 0]["greedy"] and runs["start", 1]["greedy"] is None and runs["grpo", 1]["greedy"]
    assert f"start (after SFT, {2 * n} held-out episodes, 2 seed(s)): sampled" in reuse.stdout and ", greedy " in reuse.stdout
    assert "RESULT long_rl_gain_greedy=" in reuse.stdout and "RESULT long_rl_gain_greedy=" not in p.stdout
