"""Every shipped config (configs/*.yaml, found by glob: a config added later is covered) runs two RL steps
through train.py on 2 gloo ranks. Only what needs a GPU or SGLang, and the budgets, are swapped (`swaps`); every
other setting, the ones only a GPU config uses included (KL reference, mixed precision, activation
checkpointing, LoRA, SFT), runs as written."""

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from l0_min import config as configlib
from tests.test_train import ROOT, _env, _step_metrics

CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


def swaps(cfg: configlib.Config, out_dir: Path) -> list[str]:
    """The overrides that make `cfg` run here in seconds, each for a stated reason."""
    shrink = lambda key, cap: f"{key}={min(configlib_get(cfg, key), cap)}"  # noqa: E731
    return [
        "model.path=tiny-random",  # the config's model needs a hub download and a GPU's memory
        "inference.urls=[]",  # SGLang servers -> the embedded CPU server
        "inference.worker_urls=[]",
        "inference.weights_dir=",  # a shared file system of a multi-node run -> the run folder
        "learner.device=cpu",  # learner.device: cuda stops at start-up without CUDA (tested in test_learner.py)
        "data.train=synthetic:train", "data.eval=synthetic:heldout",  # the tiny synthetic world
        "envs.qa.entities=40", "data.synthetic_tasks=64",
        # budgets: two RL steps of 2 groups x 2 episodes of 2 short turns; SFT and evaluations kept, shrunk
        "run.steps=2", f"run.out_dir={out_dir}", "rollout.batch_size=2", "rollout.n_samples=2",
        shrink("agent.max_steps", 2), shrink("sampling.max_new_tokens", 24), shrink("agent.min_action_tokens", 24),
        shrink("agent.max_context_tokens", 4096),  # tiny-random's max_position_embeddings
        shrink("rollout.max_extra_groups", 1),  # dynamic sampling: the random model's groups all score 0
        shrink("kernel.pool_size", 2), shrink("data.eval_limit", 2),
        shrink("sft.episodes", 2), shrink("sft.steps", 1), shrink("sft.batch_size", 2),
        "run.eval_samples=1",
    ]  # fmt: skip


def configlib_get(cfg, key: str):
    for name in key.split("."):  # a section's field, or a key of a mapping (envs.qa.entities)
        cfg = cfg[name] if isinstance(cfg, dict) else getattr(cfg, name)
    return cfg


def leaves(values: dict, prefix: str = "") -> dict:
    """{"envs": {"qa": {"entities": 160}}} -> {"envs.qa.entities": 160}; lists and scalars are leaves."""
    out = {}
    for k, v in values.items():
        out |= leaves(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v}
    return out


@pytest.mark.slow
@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_every_shipped_config_runs_two_rl_steps_on_two_ranks(path, tmp_path):
    cfg = configlib.resolve(config_file=path)
    over = swaps(cfg, tmp_path)
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py",
                        "--config", str(path), *over], cwd=ROOT, env=_env(), capture_output=True, text=True,
                       timeout=400)  # fmt: skip
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-4000:]
    (run_dir,) = tmp_path.iterdir()
    sft = min(cfg.sft.steps, 1) if cfg.sft.episodes else 0
    steps = _step_metrics(run_dir)
    rl = {s: m for s, m in steps.items() if m.get("phase") == "rl"}
    assert sorted(rl) == [sft + 1, sft + 2]
    # the agents acted and their action tokens reached the learner
    assert all(m["steps_per_ep/mean"] > 0 and m["train/action_tokens"] > 0 for m in rl.values()), rl
    # everything the overrides did not name ran as the config file (with its base chain) says
    ran = yaml.safe_load((run_dir / "config.yaml").read_text())
    swapped = {o.split("=")[0] for o in over}
    for key, value in leaves(dataclasses.asdict(cfg)).items():  # a top-level setting (env: math) or a section's
        if key not in swapped:
            assert configlib_get(ran, key) == value, key


@pytest.mark.slow  # train.py in a subprocess: 4 s of imports
def test_a_cuda_config_without_cuda_stops_at_start_up_with_one_line(tmp_path):
    """configs/gpu_example.yaml says learner.device: cuda. Where torch cannot use CUDA (here: a CPU build, or a
    GPU hidden by CUDA_VISIBLE_DEVICES) train.py stops before loading anything, with one line naming the cause
    (tests/test_learner.py checks each cause's wording with the detection mocked)."""
    env = dict(_env(), CUDA_VISIBLE_DEVICES="")
    p = subprocess.run([sys.executable, "train.py", "--config", "configs/gpu_example.yaml", f"run.out_dir={tmp_path}"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    errors = [line for line in p.stderr.splitlines() if line.startswith("train.py: error:")]
    assert p.returncode == 2 and len(errors) == 1, p.stderr[-2000:]
    assert errors[0].startswith("train.py: error: learner.device=cuda but torch") and "cannot use CUDA" in errors[0]
    assert not any(tmp_path.iterdir())  # no run folder: nothing was started
