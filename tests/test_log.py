"""l0_min.log: run folder layout, batch metrics (exact numbers), metrics.jsonl, sinks, plot, step table."""

import json
import sys
import types

import pytest

from l0_min.config import LogConfig
from l0_min.episode import Episode, Step, Task
from tests.fakes import qa_envs
from l0_min.log import (MetricsLogger, RunDir, batch_metrics, format_step_row, plot_rewards, step_header,
                        read_episodes, read_jsonl)


def step(n_tokens: int, exec_ok, version: str = "") -> Step:
    return Step(context_ids=[0], action_ids=[7] * n_tokens, action_logprobs=[-0.5] * n_tokens,
                think="t", code="c", exec_ok=exec_ok, weight_version=version)


def hand_made_batch() -> list[Episode]:
    e1 = Episode(Task("a", "q1", ["x"]), [step(3, True, "v3"), step(2, None, "v3")], final_answer="x",
                 status="answered", reward=1.0,
                 rewards={"answer": 1.0, "format": 1.0, "exec": 1.0, "em": 1.0, "f1": 1.0},
                 tool_calls={"web_search": 2, "notepad": 1}, truncations=1, weight_version="v3")
    e2 = Episode(Task("a", "q1", ["x"]), [step(4, False, "v2"), step(4, True, "v3"), step(2, True, "v3")],
                 final_answer="y", status="answered", reward=0.2,
                 rewards={"answer": 0.0, "format": 1.0, "exec": 0.5, "em": 0.0, "f1": 0.5},
                 tool_calls={"web_search": 1}, weight_version="v3")
    e3 = Episode(Task("b", "q2", ["z"]), [step(5, False) for _ in range(4)], status="max_steps", reward=0.1,
                 rewards={"answer": 0.0, "format": 0.5, "exec": 0.0, "em": 0.0, "f1": 0.0}, truncations=2)
    e4 = Episode(Task("b", "q2", ["z"]), [step(1, False)], status="env_error", reward=0.0,
                 tool_calls={"read_page": 1}, masked=True, error="kernel died")
    return [e1, e2, e3, e4]


def test_batch_metrics_exact_numbers():
    m = batch_metrics(hand_made_batch())
    assert m.pop("weight_versions") == ["v2", "v3"]  # v2: a step sampled before the last weight sync
    assert m == pytest.approx({
        "episodes": 4, "masked": 1,
        # rewards: means over the 3 non-masked episodes
        "reward": (1.0 + 0.2 + 0.1) / 3,
        "reward/answer": 1 / 3, "reward/em": 1 / 3, "reward/exec": 0.5, "reward/f1": 0.5,
        "reward/format": 2.5 / 3,
        # the rest counts all 4 episodes
        "status/answered": 2, "status/max_steps": 1, "status/max_tokens": 0, "status/timeout": 0,
        "status/env_error": 1, "status/inference_error": 0, "status/kernel_crashed": 0,
        "answered_rate": 0.5,
        "steps_per_ep/mean": 2.5, "steps_per_ep/max": 4,  # 2, 3, 4, 1 steps
        "tokens_per_ep/mean": 9.0, "tokens_per_ep/max": 20,  # 5, 10, 20, 1 tokens
        "tools/notepad": 1, "tools/read_page": 1, "tools/web_search": 3,
        "exec_steps": 9, "exec_error_rate": 6 / 9,  # one step of e1 ran no code
        "truncations": 3,
    }, abs=1e-12)


def test_batch_metrics_edge_cases():
    with pytest.raises(ValueError, match="no episodes"):
        batch_metrics([])
    m = batch_metrics([Episode(Task("t", "q", []), status="weird", masked=True)])
    assert m["reward"] is None and m["exec_error_rate"] is None and m["exec_steps"] == 0
    assert m["status/weird"] == 1 and m["status/answered"] == 0  # unknown statuses are counted, not dropped
    assert not any(k.startswith("reward/") for k in m)


def test_run_dir_layout_and_trajectory_round_trip(tmp_path):
    rd = RunDir(tmp_path / "runs" / "r1")
    for d in ("trajectories", "checkpoints", "plots"):
        assert (tmp_path / "runs" / "r1" / d).is_dir()
    assert rd.metrics_jsonl.name == "metrics.jsonl" and rd.viewer_html.name == "viewer.html"
    eps = hand_made_batch()
    path = rd.write_trajectories(1, eps)
    assert path == tmp_path / "runs" / "r1" / "trajectories" / "step_00001.jsonl"
    assert len(path.read_text().splitlines()) == 4
    assert read_episodes(path) == eps
    rd.write_trajectories(1, eps[:1], append=True)
    assert len(read_episodes(path)) == 5
    assert rd.write_trajectories(1, eps[:2]) == path and len(read_episodes(path)) == 2  # overwrite
    assert rd.trajectory_path(12, prefix="eval").name == "eval_00012.jsonl"
    RunDir(rd.path)  # reopening an existing run folder (resume) is fine
    (tmp_path / "file").write_text("")
    with pytest.raises(NotADirectoryError):
        RunDir(tmp_path / "file")


def test_a_step_record_is_bounded_by_its_own_tokens_and_reads_back_whole(tmp_path):
    """Issue 24: every step once wrote its whole context, so an episode of k steps wrote ~k^2/2 turns of ids.
    Now a step that extends its predecessor writes only its new ids: 12 turns of 100 ids (a 50-id action
    and a 50-id observation each), a context rebuild after turn 8 (segment 1 starts from a fresh 30 ids)."""
    steps, ctx = [], list(range(30))
    for i in range(12):
        if i == 8:
            ctx = list(range(500, 530))  # the rebuilt context of segment 1: written in full
        action = [1000 + i] * 50
        steps.append(Step(list(ctx), action, [-0.5] * 50, segment=int(i >= 8)))
        ctx = ctx + action + [2000 + i] * 50
    ep = Episode(Task("t", "q", ["a"]), steps)
    d = ep.to_json()
    written = sum(len(r.get("context_ids", [])) + len(r.get("context_new", [])) for r in d["steps"])
    assert written == 30 + 7 * 50 + 30 + 3 * 50  # the two segment starts whole, then each turn's observation
    assert sum(len(s.context_ids) for s in steps) == 8 * 30 + 100 * sum(range(8)) + 4 * 30 + 100 * sum(range(4))
    path = RunDir(tmp_path / "r").write_trajectories(1, [ep])
    assert read_episodes(path) == [ep]


def test_metrics_jsonl_round_trip(tmp_path):
    torch = pytest.importorskip("torch")
    rd = RunDir(tmp_path)
    logger = MetricsLogger(rd, LogConfig())
    m1 = batch_metrics(hand_made_batch())
    logger.log(1, m1)
    # written and flushed before close: a crashed run keeps every finished step
    assert json.loads(rd.metrics_jsonl.read_text().splitlines()[0]) == {"step": 1, **m1}
    logger.log(2, {"loss": torch.tensor(0.25), "kl": float("nan"), "lr": 1e-6, "note": "ok"})
    logger.close()
    records = read_jsonl(rd.metrics_jsonl)
    assert records == [{"step": 1, **m1}, {"step": 2, "loss": 0.25, "kl": None, "lr": 1e-6, "note": "ok"}]
    with MetricsLogger(rd, LogConfig()) as again:  # appends on resume
        again.log(3, {"reward": 0.5})
    with open(rd.metrics_jsonl, "a") as f:
        f.write('{"step": 4, "rew')  # torn last line of a killed run
    assert [r["step"] for r in read_jsonl(rd.metrics_jsonl)] == [1, 2, 3]


def test_missing_sinks_warn_once_and_do_not_crash(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import -> ImportError
    monkeypatch.setitem(sys.modules, "wandb", None)
    logger = MetricsLogger(RunDir(tmp_path), LogConfig(tensorboard=True, wandb=True))
    logger.log(1, {"reward": 0.5})
    logger.close()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2, err
    assert "tensorboard" in err[0].lower() and "pip install tensorboard" in err[0]
    assert "wandb" in err[1] and "pip install wandb" in err[1]
    assert logger.sinks == ["jsonl"]
    assert read_jsonl(tmp_path / "metrics.jsonl") == [{"step": 1, "reward": 0.5}]


def test_sinks_get_numeric_values(tmp_path, monkeypatch):
    calls = []

    class FakeWriter:
        def __init__(self, log_dir):
            calls.append(("tb_init", log_dir))

        def add_scalar(self, k, v, step):
            calls.append(("tb", k, v, step))

        def flush(self):
            pass

        def close(self):
            calls.append(("tb_close",))

    class FakeRun:
        def log(self, d, step):
            calls.append(("wandb", d, step))

        def finish(self):
            calls.append(("wandb_finish",))

    fake_tb = types.ModuleType("torch.utils.tensorboard")
    fake_tb.SummaryWriter = FakeWriter
    fake_wandb = types.ModuleType("wandb")
    fake_wandb.init = lambda **kw: calls.append(("wandb_init", kw["project"])) or FakeRun()
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", fake_tb)
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb)
    with MetricsLogger(RunDir(tmp_path / "r"), LogConfig(tensorboard=True, wandb=True, wandb_project="p")) as lg:
        assert lg.sinks == ["jsonl", "tensorboard", "wandb"]
        lg.log(5, {"reward": 0.5, "status/answered": 3, "weight_versions": ["v1"], "kl": None})
    assert calls == [("tb_init", str(tmp_path / "r" / "tensorboard")), ("wandb_init", "p"),
                     ("tb", "reward", 0.5, 5), ("tb", "status/answered", 3, 5),
                     ("wandb", {"reward": 0.5, "status/answered": 3}, 5), ("tb_close",), ("wandb_finish",)]


def test_plot_rewards_writes_a_png(tmp_path):
    import matplotlib.image

    rd = RunDir(tmp_path / "run")
    with MetricsLogger(rd, LogConfig()) as lg:
        for s in range(1, 9):
            lg.log(s, {"reward": 0.1 * s, "reward/answer": 0.08 * s, "reward/format": 0.1, "reward/exec": 0.05,
                       "reward/em": 0.1 * s, "reward/f1": 0.12 * s, "answered_rate": 0.9, "exec_error_rate": None})
    out = plot_rewards(rd.metrics_jsonl, rd.plots / "rewards.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    img = matplotlib.image.imread(out)
    assert img.shape[:2] == (380, 1300)
    assert img[..., :3].std() > 0.05  # not a blank canvas
    (tmp_path / "empty.jsonl").write_text("")
    assert plot_rewards(tmp_path / "empty.jsonl", tmp_path / "empty.png").stat().st_size > 1000  # "no data yet"


def test_step_row():
    m = batch_metrics(hand_made_batch()) | {"seconds": 83.456}
    envs = qa_envs(None)
    row, header = format_step_row(12, m, ["qa"], envs), step_header(["qa"], envs)
    assert header == "  step  reward     EM format   exec steps/ep  tok/ep     sec"
    assert row == "    12   0.433  0.333  0.833  0.500     2.50       9    83.5"
    assert len(row) == len(header)
    assert format_step_row(1, {}, ["qa"], envs) == "     1" + "".join(f"{'-':>{w}}" for w in (8, 7, 7, 7, 9, 8, 8))
