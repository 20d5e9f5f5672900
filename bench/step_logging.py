"""Rank 0's per-step logging (train.py's step 5d, `log.log_step`) costs as much at step 200 as at step 1.

    python bench/step_logging.py            # 200 steps of 128 episodes x 8 turns (~10 min)
    python bench/step_logging.py --quick    # 200 steps of 16 episodes x 4 turns (< 60 s)

Each step logs a synthetic batch shaped like agent episodes (a context that grows by an action and an
observation each turn, in one segment): metrics.jsonl, the step's trajectories file, the table row and the
viewer (log_step less its plot), timed at steps 196-200 each right after step 1 of a fresh run folder, in
turns, so both see the same machine load. The plot (plots/rewards.png, redrawn from metrics.jsonl every
step) is timed apart, at 1, 200 and 1,000 steps: its cost rises with the axes' first ticks and points and
then stays (a bounded start, not a growth with the run). Also printed: the bytes of one step's trajectories
file against whole per-step contexts (the format before issue 24), and what rebuilding the viewer from every
file (the per-step cost before issue 24) takes at step 200.

Last lines (timings on a shared machine vary ~10%; a cost that grew with the run would be far above 1):
    RESULT logging_step200_over_step1=<fastest of steps 196-200 / fastest of five step 1s> target <= 1.25
    RESULT plot_1000_over_200_steps=<plot at 1,000 steps / at 200> target <= 1.25
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from l0_min.episode import Episode, Step, Task  # noqa: E402
from l0_min.envs.qa import QA  # noqa: E402
from l0_min.log import MetricsLogger, RunDir, batch_metrics, format_step_row, plot_rewards  # noqa: E402
from l0_min.viewer import write_viewer  # noqa: E402

TARGET = 1.25
POOL = random.Random(1).choices(range(50_000), k=100_000)  # token ids, sliced at random offsets


def batch(step: int, n: int, turns: int, rng: random.Random) -> list[Episode]:
    """n episodes of `turns` turns: a 600-token prompt, then per turn a 150-token action and 250 tokens of
    observation appended to the context (one segment), with their text."""
    ids = lambda k: POOL[(a := rng.randrange(len(POOL) - k)) : a + k]  # noqa: E731
    eps = []
    for i in range(n):
        ctx, steps = ids(600), []
        for t in range(turns):
            action = ids(150)
            steps.append(Step(list(ctx), action, [-rng.random() for _ in action], "<think>x</think><code>y</code>",
                              "thinking " * 40, "print(web_search('q'))", "<output>" + "result " * 150 + "</output>",
                              True, True, "stop", str(step), reward=0.1, seconds=1.0))  # fmt: skip
            ctx = ctx + action + ids(250)
        ok = rng.random() < 0.5
        eps.append(Episode(Task(f"t{i // 8}", "a question " * 10, ["gold"]), steps, "gold" if ok else None,
                           "answered" if ok else "max_steps", i // 8, i % 8, float(ok), {"em": float(ok)}))
    return eps


ENVS = {"qa": QA(None)}


def log_one(run: RunDir, logger: MetricsLogger, step: int, n: int, turns: int, rng: random.Random) -> float:
    """The seconds of log_step's parts but the plot, for one step of a synthetic batch."""
    eps = batch(step, n, turns, rng)
    metrics = {"phase": "rl"} | batch_metrics(eps) | {f"train/x{k}": rng.random() for k in range(30)}
    t0 = time.perf_counter()
    logger.log(step, metrics)
    run.write_trajectories(step, eps)
    format_step_row(step, metrics, ["qa"], ENVS)
    write_viewer(run.path, run.viewer_html, 64)
    return time.perf_counter() - t0


def plot_seconds(metrics_jsonl: Path, out: Path) -> float:
    return min(timed(plot_rewards, metrics_jsonl, out) for _ in range(3))


def timed(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    n, turns, last = (16, 4, args.steps) if args.quick else (128, 8, args.steps)
    rng = random.Random(0)
    t_all = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="l0_min-bench-logging-") as tmp:
        run = RunDir(Path(tmp) / "run")
        logger = MetricsLogger(run)
        for s in range(1, last - 4):
            log_one(run, logger, s, n, turns, rng)
        first, late = [], []  # steps last-4..last of this run, each right after step 1 of a fresh run
        for i in range(5):
            fresh = RunDir(Path(tmp) / f"fresh{i}")
            with MetricsLogger(fresh) as fresh_logger:
                first.append(log_one(fresh, fresh_logger, 1, n, turns, rng))
            late.append(log_one(run, logger, last - 4 + i, n, turns, rng))
        logger.close()
        with open(Path(tmp) / "m1000.jsonl", "w") as f:  # 1,000 steps of this run's records
            lines = run.metrics_jsonl.read_text().splitlines()
            f.writelines(json.dumps({**json.loads(lines[k % len(lines)]), "step": k + 1}) + "\n" for k in range(1000))
        plots = [plot_seconds(m, Path(tmp) / "p.png") for m in (fresh.metrics_jsonl, run.metrics_jsonl, Path(tmp) / "m1000.jsonl")]
        size = run.trajectory_path(last).stat().st_size
        whole = sum(len(json.dumps(asdict(e))) + 1 for e in batch(last, n, turns, rng))
        run.viewer_html.with_suffix(".json").unlink()  # forget what the page holds: rebuilt from every file
        rebuild = timed(write_viewer, run.path, run.viewer_html, 64)
        print(f"{last} steps of {n} episodes x {turns} turns in {time.perf_counter() - t_all:.0f} s; "
              f"viewer.html {run.viewer_html.stat().st_size / 2**20:.1f} MiB")
        print(f"one step's trajectories file: {size / 2**20:.2f} MiB (whole per-step contexts: {whole / 2**20:.2f} MiB)")
        print(f"log_step less the plot, fastest of 5: step 1 of a fresh run {min(first) * 1e3:.1f} ms; steps "
              f"{last - 4}-{last} {min(late) * 1e3:.1f} ms (taken in turns)")
        print(f"the plot: {plots[0]:.2f} s at 1 step, {plots[1]:.2f} s at {last}, {plots[2]:.2f} s at 1,000")
        print(f"rebuilding the viewer from all {last} files at step {last}: {rebuild * 1e3:.0f} ms "
              f"({rebuild / min(first):.0f}x step 1's logging less the plot: the per-step cost before issue 24)")
    for name, ratio in (("logging_step200_over_step1", min(late) / min(first)), ("plot_1000_over_200_steps", plots[2] / plots[1])):
        print(f"RESULT {name}={ratio:.2f} target <= {TARGET} {'MET' if ratio <= TARGET else 'SHORT'}")


if __name__ == "__main__":
    main()
