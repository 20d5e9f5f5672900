"""What a training run leaves on disk, and the numbers it prints and plots.

A run folder (`RunDir`) holds config.yaml, metrics.jsonl (one JSON object per step), trajectories/step_00001.jsonl
(one Episode.to_json() a line), checkpoints/, plots/rewards.png, viewer.html and viewer.json (l0_min.viewer).

`batch_metrics` turns one step's episodes into flat named numbers, `MetricsLogger` appends them to metrics.jsonl
(and TensorBoard / Weights & Biases), `format_step_row` prints them; `log_step` is rank 0's whole per-step record.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import sys
from collections import Counter
from pathlib import Path
from typing import NoReturn

from l0_min.envs import solved
from l0_min.config import is_number
from l0_min.episode import ANSWERED, STATUSES, Episode
from l0_min.viewer import write_viewer


class RunDir:
    """The folder layout of one run. Creating it makes the folders; files are written by their owners."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.config_yaml = self.path / "config.yaml"
        self.metrics_jsonl = self.path / "metrics.jsonl"
        self.trajectories = self.path / "trajectories"
        self.checkpoints = self.path / "checkpoints"
        self.plots = self.path / "plots"
        self.viewer_html = self.path / "viewer.html"
        if self.path.exists() and not self.path.is_dir():
            raise NotADirectoryError(f"run folder {self.path} exists and is not a folder")
        for d in (self.path, self.trajectories, self.checkpoints, self.plots):
            d.mkdir(parents=True, exist_ok=True)

    def trajectory_path(self, step: int, prefix: str = "step") -> Path:
        """trajectories/step_00001.jsonl (prefix "eval" gives eval_00001.jsonl)."""
        if not re.fullmatch(r"[A-Za-z0-9-]+", prefix):
            raise ValueError(f"trajectory file prefix must be letters, digits or '-', got {prefix!r}")
        return self.trajectories / f"{prefix}_{step:05d}.jsonl"

    def write_trajectories(self, step: int, episodes: list[Episode], prefix: str = "step",
                           append: bool = False) -> Path:
        """Write one Episode.to_json() per line; overwrites the step's file unless append=True."""
        path = self.trajectory_path(step, prefix)
        with open(path, "a" if append else "w", encoding="utf-8") as f:
            for ep in episodes:
                write_jsonl(f, ep.to_json())
        return path


def write_jsonl(f, record: dict) -> None:
    """One JSON object per line, flushed: a kill loses at most the line being written. Text that is not
    UTF-8 (an agent's lone surrogate) is written \\u-escaped (the encoder fails before writing): read back
    as the same str, but for a high surrogate then a low one, read back as the character they encode."""
    try:
        f.write(json.dumps(record, ensure_ascii=False) + "\n")
    except UnicodeEncodeError:
        f.write(json.dumps(record) + "\n")
    f.flush()


def open_jsonl(path: str | Path):
    """Open a JSONL file for appending, after cutting away a torn last line left by a kill."""
    data = Path(path).read_bytes() if Path(path).exists() else b""
    if data and not data.endswith(b"\n"):
        os.truncate(path, data.rfind(b"\n") + 1)
    return open(path, "a", encoding="utf-8")


def read_jsonl(path: str | Path) -> list[dict]:
    """The records of a JSONL file. A last line cut short by a kill (no newline, or not JSON) is left
    out; a bad line anywhere else is an error naming file and line."""
    lines = Path(path).read_text(encoding="utf-8", errors="replace").split("\n")
    out = []
    for i, line in enumerate(lines, 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as e:
                if i >= len(lines) - 1:  # the last line (a file ends with "\n", so split leaves "" after it)
                    break
                raise ValueError(f"{path}:{i}: not JSON: {e}") from None
    return out


def read_episodes(path: str | Path) -> list[Episode]:
    """The episodes of one trajectories/*.jsonl file (written by RunDir.write_trajectories)."""
    try:
        return [Episode.from_json(r) for r in read_jsonl(path)]
    except (TypeError, KeyError) as e:
        raise ValueError(f"{path}: not an Episode record: {e}") from None


# --------------------------------------------------------------------------- one step's numbers
def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def batch_metrics(episodes: list[Episode], envs: dict | None = None) -> dict:
    """Flat, named statistics of one RL step's episodes (pure). Rewards ("reward", "reward/<key>" of every number
    in Episode.rewards; per environment "env/<env>/..." when there are several) are means over the episodes that
    train (not `masked`); everything else counts all episodes, masked ones included: failures are what those are for.

    >>> from l0_min.episode import Step, Task
    >>> ep = Episode(Task("t", "q", ["a"]), [Step([], [1, 2], [0, 0], exec_ok=False)], status="answered",
    ...              reward=1.0, rewards={"em": 1.0})
    >>> m = batch_metrics([ep, Episode(Task("u", "q", ["b"]), masked=True, status="env_error")])
    >>> m["reward"], m["reward/em"], m["status/env_error"], m["answered_rate"], m["exec_error_rate"]
    (1.0, 1.0, 1, 0.5, 1.0)
    """
    if not episodes:
        raise ValueError("batch_metrics: no episodes (a step must collect at least one)")
    n = len(episodes)
    train = [ep for ep in episodes if not ep.masked]
    m: dict = {"episodes": n, "masked": n - len(train), "reward": _mean([ep.reward for ep in train])}

    for k in sorted({k for ep in train for k, v in ep.rewards.items() if is_number(v)}):
        m[f"reward/{k}"] = _mean([float(ep.rewards[k]) for ep in train if is_number(ep.rewards.get(k))])
    for s in list(STATUSES) + sorted({ep.status for ep in episodes} - set(STATUSES)):
        m[f"status/{s}"] = sum(ep.status == s for ep in episodes)
    m["answered_rate"] = m[f"status/{ANSWERED}"] / n

    steps = [len(ep.steps) for ep in episodes]
    tokens = [ep.n_action_tokens for ep in episodes]
    m["steps_per_ep/mean"], m["steps_per_ep/max"] = sum(steps) / n, max(steps)
    m["tokens_per_ep/mean"], m["tokens_per_ep/max"] = sum(tokens) / n, max(tokens)
    tools = sum((Counter(ep.tool_calls) for ep in episodes), Counter())
    m.update({f"tools/{tool}": tools[tool] for tool in sorted(tools)})
    ran = [s.exec_ok for ep in episodes for s in ep.steps if s.exec_ok is not None]
    m["exec_steps"], m["exec_error_rate"] = len(ran), (sum(ok is False for ok in ran) / len(ran)) if ran else None
    m["truncations"] = sum(ep.truncations for ep in episodes)
    for ep in (ep for ep in episodes if ep.prefix_steps):  # rollout.resample: started from k steps of the expert
        key = f"resample/k{ep.prefix_steps}"
        m[key + "/episodes"] = m.get(key + "/episodes", 0) + 1
        ok = solved(ep, envs[ep.task.env]) if envs else ep.rewards.get("core") == 1.0
        m[key + "/solved"] = m.get(key + "/solved", 0) + int(ok)
    versions = {ep.weight_version for ep in episodes} | {s.weight_version for ep in episodes for s in ep.steps}
    m["weight_versions"] = sorted(v for v in versions if v)
    names = sorted({ep.task.env for ep in train})
    for name in names if len(names) > 1 else ():
        mine = [ep for ep in train if ep.task.env == name]
        m[f"env/{name}/reward"] = _mean([ep.reward for ep in mine])
        for k in envs[name].metrics if envs else ():
            m[f"env/{name}/{k}"] = _mean([float(ep.rewards.get(k, 0.0)) for ep in mine])
    return m


def fail(msg: str, code: int = 2) -> NoReturn:
    """An entry script's end on bad input: one line naming the script, then exit `code`."""
    print(f"{Path(sys.argv[0]).name}: error: {msg}", file=sys.stderr, flush=True)
    sys.exit(code)


def label(metric: str) -> str:
    """How tables name a metric: short words in capitals (em -> EM), an underscore as a space.

    >>> label("em"), label("official_em"), label("correct")
    ('EM', 'official EM', 'correct')
    """
    return " ".join(w.upper() if len(w) <= 3 else w for w in metric.split("_"))


# ---------------------------------------------------------------------------------------- sinks
def _jsonable(v):
    """Plain JSON values: tensors / numpy scalars become numbers, NaN and inf become None."""
    if hasattr(v, "item") and callable(v.item) and getattr(v, "ndim", 0) == 0:
        v = v.item()
    elif hasattr(v, "tolist") and callable(v.tolist):
        v = v.tolist()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    return str(v)


class MetricsLogger(contextlib.AbstractContextManager):
    """Append one JSON line per step to metrics.jsonl (the source of truth), and mirror the numbers to TensorBoard
    and Weights & Biases where asked for; a sink that cannot start prints one warning line and is skipped."""

    def __init__(self, run_dir: RunDir | str | Path, cfg=None, config: dict | None = None):
        from l0_min.config import LogConfig

        self.run_dir = run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)
        self.cfg = cfg if cfg is not None else LogConfig()
        self.sinks = ["jsonl"]
        self._file = open_jsonl(self.run_dir.metrics_jsonl)
        self._tb = self._wandb = None
        skip = lambda key, e, hint: print(f"l0_min.log: warning: log.{key}=true but {key} {hint} "  # noqa: E731
                                          f"({type(e).__name__}: {e}); `pip install {key}` to use it. "
                                          "Logging to metrics.jsonl only.", file=sys.stderr, flush=True)
        if self.cfg.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(log_dir=str(self.run_dir.path / "tensorboard"))
                self.sinks.append("tensorboard")
            except ImportError as e:
                skip("tensorboard", e, "is not importable")
        if self.cfg.wandb:
            try:
                import wandb

                self._wandb = wandb.init(project=self.cfg.wandb_project, name=self.run_dir.path.name,
                                         dir=str(self.run_dir.path), config=config)
                self.sinks.append("wandb")
            except ImportError as e:
                skip("wandb", e, "is not importable")
            except Exception as e:  # no login, no network: the run goes on, metrics.jsonl has it all
                skip("wandb", e, "did not start: wandb.init failed")

    def log(self, step: int, metrics: dict) -> None:
        record = {"step": step, **_jsonable(metrics)}
        write_jsonl(self._file, record)
        scalars = {k: v for k, v in record.items() if k != "step" and is_number(v)}
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def __exit__(self, *exc) -> None:
        self.close()


def log_step(run: RunDir, logger: MetricsLogger, step: int, metrics: dict, episodes: list[Episode],
             viewer_max_per_step: int | None = None, table: tuple = ((), {})) -> None:
    """Rank 0's record of one RL step (train.py): metrics, trajectories file, table row (`table`: the arguments of
    `step_header`), plot and viewer."""
    logger.log(step, metrics)
    run.write_trajectories(step, episodes)
    print(format_step_row(step, metrics, *table), flush=True)
    plot_rewards(run.metrics_jsonl, run.plots / "rewards.png")
    write_viewer(run.path, run.viewer_html, viewer_max_per_step or None)


# ----------------------------------------------------------------------------------------- plot
def plot_rewards(metrics_jsonl: str | Path, out_png: str | Path) -> Path:
    """Three panels against the learner step (SFT and RL phases shaded): the held-out scores with their 95%
    intervals (sampled, greedy, per environment), the training signal (SFT loss, RL reward), the RL steps' rates."""
    from matplotlib.figure import Figure  # no pyplot: no global backend, safe in any process
    from matplotlib.ticker import MaxNLocator

    records = [r for r in read_jsonl(metrics_jsonl) if is_number(r.get("step"))]
    sft = [r for r in records if r.get("phase") == "sft" and is_number(r.get("train/loss"))]
    rl = [r for r in records if r.get("phase", "rl") == "rl" and is_number(r.get("reward"))]
    fig = Figure(figsize=(13, 3.8), dpi=100, layout="constrained")
    axes = fig.subplots(1, 3)
    metric = next((r["eval/metric"] for r in reversed(records) if isinstance(r.get("eval/metric"), str)), "score")
    for ax, title in zip(axes, (f"held-out {label(metric)}", "training signal", "RL rates")):
        ax.set(title=title, xlabel="learner step")
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        for phase, rs, color in (("SFT", sft, "tab:purple"), ("RL", rl, "tab:green")):
            if rs:
                steps = [r["step"] for r in rs]
                ax.axvspan(min(steps) - 1, max(steps), color=color, alpha=0.07, label=phase)

    def line(ax, rs, key, name, **kw):
        pts = [(r["step"], r[key]) for r in rs if is_number(r.get(key))]
        if pts:
            ax.plot(*zip(*pts), label=name, marker="o" if len(pts) <= 40 else None, markersize=3, **kw)

    for key, mode, shift in (("eval/score", "sampled", -0.08), ("eval/greedy/score", "greedy", 0.08)):
        pts = [(r["step"], r[key], r.get(key + "_ci") or [r[key]] * 2) for r in records if is_number(r.get(key))]
        if pts:
            xs, ys, cis = zip(*pts)
            err = [[max(0.0, y - c[0]) for y, c in zip(ys, cis)], [max(0.0, c[1] - y) for y, c in zip(ys, cis)]]
            axes[0].errorbar([x + shift for x in xs], ys, yerr=err, fmt="o-", capsize=3, label=mode)
    for key in sorted({k for r in records for k in r if re.fullmatch(r"eval/[^/]+/score", k) and "greedy" not in k}):
        line(axes[0], records, key, key.split("/")[1] + " (sampled)", linestyle="--", linewidth=1)
    line(axes[1], sft, "train/loss", "SFT loss", color="tab:purple")
    line(axes[1], rl, "reward", "RL reward", color="tab:green", linewidth=2)
    for key, name in (("reward/format", "format"), ("reward/exec", "exec"), ("answered_rate", "answered")):
        line(axes[2], rl, key, name)
    for ax in (axes[0], axes[2]):
        ax.set_ylim(-0.03, 1.03)  # rates: a fixed scale reads at a glance
    for ax in axes:
        if not ax.lines and not ax.collections:
            ax.text(0.5, 0.5, "no data yet", ha="center", va="center", transform=ax.transAxes, color="gray")
        elif ax.get_legend_handles_labels()[0]:
            ax.legend(loc="best", fontsize=8)
    n_eval = len({r["step"] for r in records if is_number(r.get("eval/score"))})
    fig.suptitle(f"{Path(metrics_jsonl).parent.name}: {len(sft)} SFT steps, {len(rl)} RL steps, {n_eval} evaluations",
                 fontsize=11)
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png)
    return out_png


# ----------------------------------------------------------- the per-step table train.py prints
_COLUMNS = [  # (header, metrics key, width, format); "{score}" becomes one column per environment's headline
    ("step", None, 6, "d"), ("reward", "reward", 8, ".3f"), ("{score}", None, 7, ".3f"),
    ("format", "reward/format", 7, ".3f"), ("exec", "reward/exec", 7, ".3f"),
    ("steps/ep", "steps_per_ep/mean", 9, ".2f"), ("tok/ep", "tokens_per_ep/mean", 8, ".0f"),
    ("sec", "seconds", 8, ".1f"),
]


def _columns(names: list[str], envs: dict) -> list[tuple]:
    """The table's columns for the training environments `names`: one alone shows its headline metric under
    its own label (QA: "EM"), several show each one's under its name."""
    out = []
    for h, key, w, f in _COLUMNS:
        if h != "{score}":
            out.append((h, key, w, f))
        elif len(names) == 1:
            head = envs[names[0]].metrics[0]
            out.append((label(head), f"reward/{head}", max(w, len(label(head)) + 1), f))
        else:
            out += [(n, f"env/{n}/{envs[n].metrics[0]}", max(w, len(n) + 1), f) for n in names]
    return out


def step_header(names: list[str], envs: dict) -> str:
    return "".join(f"{h:>{w}}" for h, _, w, _ in _columns(names, envs))


def format_step_row(step: int, metrics: dict, names: list[str], envs: dict) -> str:
    """One fixed-width line per RL step, aligned under `step_header`; a missing value prints '-'.

    >>> class QA: metrics = ("em", "f1")
    >>> print(step_header(["qa"], {"qa": QA()})); print(format_step_row(3, {"reward": 0.5, "reward/em": 0.25,
    ...                                                                  "seconds": 12.34}, ["qa"], {"qa": QA()}))
      step  reward     EM format   exec steps/ep  tok/ep     sec
         3   0.500  0.250      -      -        -       -    12.3
    """
    cells = [(step if key is None else metrics.get(key), w, f) for _, key, w, f in _columns(names, envs)]
    return "".join(f"{v:>{w}{f}}" if is_number(v) else f"{'-':>{w}}" for v, w, f in cells)
