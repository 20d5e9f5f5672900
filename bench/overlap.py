"""Rollout/training overlap: how much faster `rollout.overlap=1` makes a training step than 0, in one run.

    python bench/overlap.py            # full: 16 episodes and 8 timed steps per setting, a 4-layer model
    python bench/overlap.py --quick    # the same measurement, smaller: 4 episodes, 2 steps, 2 layers

The loop is train.py's, built from the same pieces: `collect.Batches` (with `ahead` = the overlap),
`episode.training_rows`, the FSDP2 `Learner` (its step runs in a thread, as on rank 0 of train.py, so
the event loop and its episodes go on), `Learner.export_hf` and the client's `update_weights_from_disk`.
As on a GPU node, the rollout side waits on a remote inference server while the learner computes:
the server is the scripted stand-in (bench/scripted_policy.py) with a per-token latency, over real
HTTP, and the kernels are in-process stand-ins (bench/stand_ins.py), because on 2 cores real kernel
starts (~1 s of CPU each) would compete with the learner for the CPU, which a GPU node does not do.

First the learner's step time T and the rollout's fixed overhead are measured; then, for each target
ratio R/T in 0.5, 1, 2, the per-token latency is set so that a batch's rollout takes R, and the mean
step time of overlap 0 and of overlap 1 is measured over the same number of steps (after one warm-up
step each). Ideal: overlap 0 takes R + T + sync, overlap 1 max(R, T + sync): 2x at R = T.
"""

# ruff: noqa: E402
import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.scripted_policy import ScriptedPolicyServer
from bench.stand_ins import FakeKernels
from l0_min.collect import Batches, Services, TaskStream
from l0_min.config import Config
from l0_min.envs.qa import QA
from l0_min.episode import Task, training_rows
from l0_min.inference import InferenceClient
from l0_min.learner import Learner
from l0_min.models import save_random_llama, tiny_tokenizer

ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("--quick", action="store_true")
args = ap.parse_args()
STEPS = 2 if args.quick else 8
RATIOS = [0.5, 1.0, 2.0]

cfg = Config()
cfg.rollout.batch_size, cfg.rollout.n_samples, cfg.rollout.max_concurrency = (2, 2, 64) if args.quick else (4, 4, 64)
cfg.agent.max_steps, cfg.sampling.max_new_tokens = 2, 128
cfg.learner.lr = 1e-5
tok = tiny_tokenizer()
tmp = Path(tempfile.mkdtemp(prefix="l0_overlap_"))
model = save_random_llama(tmp / "model", tok, hidden=128 if args.quick else 192, layers=2 if args.quick else 4)
learner = Learner(model, cfg.learner, cfg.algo, total_steps=10_000)
tasks = [Task(f"t{i}", f"What is {i} plus {i}?", [str(2 * i)]) for i in range(64)]


async def run(ahead: int, latency: float, steps: int) -> dict:
    """Mean seconds per step (and of its parts) over `steps` steps after one warm-up step."""
    server = ScriptedPolicyServer(token_latency=latency)
    url = await server.start()
    kernels = FakeKernels()
    async with InferenceClient([url], cfg.inference, max_connections=64) as client:
        cfg.rollout.overlap = ahead
        svc = Services(cfg, client, kernels, kernels.tools, tok, {"qa": QA(cfg)})
        batches = Batches(svc, TaskStream(tasks), cfg.rollout, False)
        times, parts = [], {"rollout": [], "train": [], "sync": []}
        try:
            for step in range(steps + 1):
                t0 = time.perf_counter()
                batch = await batches.next(step)
                t1 = time.perf_counter()
                await asyncio.to_thread(learner.train_step, training_rows(batch.episodes, cfg.algo))
                t2 = time.perf_counter()
                folder = await asyncio.to_thread(learner.export_hf, tmp / "weights")
                await client.update_weights_from_disk(str(folder), str(step + 1))
                if step:  # the first step warms up (and has nothing collected ahead)
                    times.append(time.perf_counter() - t0)
                    parts["rollout"].append(batch.stats["rollout_seconds"])
                    parts["train"].append(t2 - t1)
                    parts["sync"].append(time.perf_counter() - t2)
        finally:
            await batches.close()
            await server.stop()
    return {"step": statistics.mean(times)} | {k: statistics.mean(v) for k, v in parts.items()}


async def main() -> None:
    base = await run(0, 0.0, 2)  # T and the rollout's fixed cost (no latency)
    tokens = 2 * 70  # the scripted episode: two actions of ~70 tokens, one after the other
    print(f"learner step T = {base['train']:.2f} s, sync {base['sync']:.2f} s, rollout without latency "
          f"{base['rollout']:.2f} s ({cfg.rollout.batch_size * cfg.rollout.n_samples} episodes per step)")
    print(f"{'R/T target':>10} {'latency ms/tok':>15} {'R s':>6} {'T s':>6} {'overlap 0 s/step':>17} "
          f"{'overlap 1 s/step':>17} {'speedup':>8} {'ideal':>6}")
    result = None
    for ratio in RATIOS:
        latency = max(0.0, (ratio * base["train"] - base["rollout"]) / tokens)
        off, on = await run(0, latency, STEPS), await run(1, latency, STEPS)
        speedup = off["step"] / on["step"]
        r, t, s = off["rollout"], off["train"], off["sync"]
        print(f"{ratio:>10.1f} {1000 * latency:>15.2f} {r:>6.2f} {t:>6.2f} {off['step']:>17.2f} {on['step']:>17.2f} "
              f"{speedup:>8.2f} {(r + t + s) / max(r, t + s):>6.2f}")
        if ratio == 1.0:
            result = speedup
    print(f"RESULT overlap_speedup_at_ratio_1={result:.2f} target >= 1.5 {'MET' if result >= 1.5 else 'SHORT'}")


asyncio.run(main())
