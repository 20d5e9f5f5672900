"""Rank 0's per-step logging (train.py's step 5d, `log.log_step`) stays as cheap at step 200 as at step 1.

    python bench/step_logging.py            # 200 steps of 128 episodes x 8 turns, every step timed (~10 min)
    python bench/step_logging.py --quick    # 200 steps of 16 episodes x 4 turns; steps 1-5 and 196-200 timed (< 60 s)

Each step logs a synthetic batch shaped like agent episodes (a context that grows by an action and an
observation each turn, in one segment) through `log_step`: metrics.jsonl, the step's trajectories file,
the table row, the reward plot, the viewer. The quick run fills steps 6-195 with everything but the plot
(the plot keeps no state: it reads metrics.jsonl, which the filled steps write), so step 200 finds the run
folder as a full run leaves it; their viewer appends are timed alone. Also printed: the bytes of one step's trajectories file against what
whole per-step contexts would take (the format before issue 24), and what rebuilding the viewer from
every file (the per-step cost before issue 24) takes at step 200.

Last line: RESULT logging_step200_over_step1=<ratio of the fastest of steps 196-200 to the fastest of
steps 1-5> target <= 1.25 MET|SHORT (timings on a shared machine vary ~10%; a cost that grew with the
run would show as a ratio far above 1: the rebuild's line shows how far).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import random
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from l0_min.episode import Episode, Step, Task  # noqa: E402
from l0_min.log import MetricsLogger, RunDir, batch_metrics, log_step  # noqa: E402
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    n, turns = (16, 4) if args.quick else (128, 8)
    timed = set(range(1, 6)) | set(range(args.steps - 4, args.steps + 1)) if args.quick else set(range(1, args.steps + 1))
    rng = random.Random(0)
    with tempfile.TemporaryDirectory(prefix="l0_min-bench-logging-") as tmp:
        run = RunDir(Path(tmp) / "run")
        logger = MetricsLogger(run)
        seconds: dict[int, float] = {}
        viewer: dict[int, float] = {}
        t_all = time.perf_counter()
        for step in range(1, args.steps + 1):
            eps = batch(step, n, turns, rng)
            metrics = {"phase": "rl"} | batch_metrics(eps) | {f"train/x{k}": rng.random() for k in range(30)}
            with contextlib.redirect_stdout(io.StringIO()):  # the table row
                t0 = time.perf_counter()
                if step in timed:
                    log_step(run, logger, step, metrics, eps, 64)
                else:  # everything but the plot (see the module docstring)
                    logger.log(step, metrics)
                    run.write_trajectories(step, eps)
                    t1 = time.perf_counter()
                    write_viewer(run.path, run.viewer_html, 64)
                    viewer[step] = time.perf_counter() - t1
                seconds[step] = time.perf_counter() - t0
        logger.close()
        first = min(seconds[s] for s in range(1, 6))
        last = min(seconds[s] for s in range(args.steps - 4, args.steps + 1))
        size = run.trajectory_path(args.steps).stat().st_size
        whole = sum(len(json.dumps(asdict(e))) + 1 for e in eps)
        run.viewer_html.with_suffix(".json").unlink()  # forget what the page holds: rebuilt from every file
        t0 = time.perf_counter()
        write_viewer(run.path, run.viewer_html, 64)
        rebuild = time.perf_counter() - t0
        print(f"{args.steps} steps of {n} episodes x {turns} turns in {time.perf_counter() - t_all:.0f} s; "
              f"viewer.html {run.viewer_html.stat().st_size / 2**20:.1f} MiB")
        print(f"one step's trajectories file: {size / 2**20:.2f} MiB (whole per-step contexts: {whole / 2**20:.2f} MiB)")
        print(f"log_step at steps 1-5: fastest {first * 1e3:.0f} ms; at steps {args.steps - 4}-{args.steps}: "
              f"fastest {last * 1e3:.0f} ms")
        if viewer:
            a, b = sorted(viewer)[:5], sorted(viewer)[-5:]
            print(f"viewer append alone at steps {a[0]}-{a[-1]}: fastest {min(viewer[s] for s in a) * 1e3:.1f} ms; "
                  f"at steps {b[0]}-{b[-1]}: fastest {min(viewer[s] for s in b) * 1e3:.1f} ms")
        print(f"rebuilding the viewer from all {args.steps} files at step {args.steps}: {rebuild * 1e3:.0f} ms "
              f"({(rebuild + first) / first:.1f}x step 1's logging; the per-step cost before issue 24)")
    ratio = last / first
    print(f"RESULT logging_step200_over_step1={ratio:.2f} target <= {TARGET} {'MET' if ratio <= TARGET else 'SHORT'}")


if __name__ == "__main__":
    main()
