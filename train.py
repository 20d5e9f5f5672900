"""Train an NB-Agent with RL, as in L0: collect episodes, score, advantages, learner step, weight sync.

    torchrun --nproc_per_node=N train.py --config configs/x.yaml [section.key=value ...]
    python train.py --config configs/cpu_demo.yaml          # one process is fine on CPU
    python train.py --resume runs/NAME                      # continue a stopped run

Rank 0 runs the rollout (one asyncio loop: agent coroutines, sandboxed kernels, the tool server,
HTTP to the inference server) while the other ranks wait; every rank takes its share of the batch
for the FSDP2 learner step; rank 0 exports the new weights and tells the inference server(s) to
load them. SIGINT / SIGTERM finish cleanly: a checkpoint of the last completed step, then exit 0.
"""

import argparse
import asyncio
import os
import shutil
import signal
import sys
import time
from pathlib import Path

from l0_min import config as configlib
from l0_min.data import load_tasks


def fail(msg: str) -> None:
    print(f"train.py: error: {msg}", file=sys.stderr, flush=True)
    sys.exit(2)


# ---------------------------------------------------------------------------------------------
# 1. configuration and run folder

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--config", help="a YAML file of overrides (see configs/)")
ap.add_argument("--resume", metavar="RUN_DIR", help="continue the run in this folder from its last checkpoint")
ap.add_argument("overrides", nargs="*", help="section.key=value")
args = ap.parse_args()
try:
    if args.resume:
        run_path = Path(args.resume)
        if not (run_path / "config.yaml").is_file():
            fail(f"--resume {run_path}: no config.yaml there (not a run folder)")
        cfg = configlib.resolve(args.overrides, base=configlib.load(run_path / "config.yaml"))
    else:
        cfg = configlib.resolve(args.overrides, args.config)
        run_path = Path(cfg.run.out_dir) / f"{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}"
except configlib.ConfigError as e:
    fail(str(e))

# the data first: a bad data spec should not wait for the model to load
if int(os.environ.get("RANK", "0")) == 0:
    try:
        train_tasks = load_tasks(cfg.data.train, cfg.data)
    except Exception as e:
        fail(f"data.train: {e}")
    try:
        eval_tasks = load_tasks(cfg.data.eval, cfg.data, limit=cfg.data.eval_limit) if cfg.run.eval_every >= 0 else []
    except Exception as e:
        fail(f"data.eval: {e}")
    if not train_tasks:
        fail(f"data.train={cfg.data.train!r} gave no tasks")

# heavy imports after the argument checks, so mistakes are reported in a second
import torch.distributed as dist  # noqa: E402

from l0_min.collect import InferenceDown, TaskStream, collect_batch, run_tasks  # noqa: E402
from l0_min.episode import training_rows  # noqa: E402
from l0_min.learner import Learner, init_distributed, shard_rows  # noqa: E402
from l0_min.log import STEP_HEADER, MetricsLogger, RunDir, batch_metrics, format_step_row, plot_rewards  # noqa: E402
from l0_min.models import resolve_model  # noqa: E402
from l0_min.runtime import rollout_env, settle_gc  # noqa: E402
from l0_min.viewer import write_viewer  # noqa: E402

rank, world, device = init_distributed(cfg.learner.backend)
run = RunDir(run_path)
try:
    model_path = resolve_model(cfg.model.path) if rank == 0 else None
except FileNotFoundError as e:
    fail(f"model.path: {e}")
obj = [str(model_path)]
dist.broadcast_object_list(obj, src=0)  # rank 0 built/converted built-in models first
model_path = Path(obj[0])

# the resumed run continues from its last checkpoint (and the weights exported with it)
checkpoints = sorted(run.checkpoints.glob("step_*"))
start_step, stream_position, ckpt = 0, 0, None
if args.resume:
    if not checkpoints:
        fail(f"--resume {run_path}: no checkpoint in {run.checkpoints}")
    ckpt = checkpoints[-1]

# ---------------------------------------------------------------------------------------------
# 2. the learner (all ranks)

learner = Learner(model_path, cfg.learner, cfg.algo, total_steps=cfg.run.steps)
if ckpt is not None:
    extra = learner.load(ckpt)
    start_step, stream_position = learner.step, extra["task_position"]
if rank == 0:
    configlib.save(cfg, run.config_yaml)
    print(f"run folder: {run.path}  (model {cfg.model.path}, {world} rank(s), start step {start_step})", flush=True)


def save_checkpoint(step: int, position: int) -> None:
    path = run.checkpoints / f"step_{step:05d}"
    learner.save(path, extra={"task_position": position})
    if rank == 0:
        for old in sorted(run.checkpoints.glob("step_*"))[:-1]:
            shutil.rmtree(old, ignore_errors=True)
        print(f"checkpoint: {path}", flush=True)


def export_weights(step: int) -> Path:
    """Rank 0 writes the HF folder of this step's policy (older ones are removed)."""
    folder = run.path / "weights" / f"step_{step:05d}"
    learner.export_hf(folder)
    if rank == 0:
        for old in (run.path / "weights").glob("step_*"):
            if old != folder:
                shutil.rmtree(old, ignore_errors=True)
    return folder


# stop signals: finish the step in flight (rank 0 cancels the rollout), checkpoint, exit 0
stop = {"requested": False}


def on_signal(signum, frame):
    stop["requested"] = True
    if rank == 0:
        print(f"\n{signal.Signals(signum).name}: stopping after a checkpoint ...", flush=True)
        task = stop.get("rollout")
        if task is not None:
            stop["loop"].call_soon_threadsafe(task.cancel)


signal.signal(signal.SIGINT, on_signal)
signal.signal(signal.SIGTERM, on_signal)

resumed_weights = export_weights(start_step) if ckpt is not None else None

# ---------------------------------------------------------------------------------------------
# 3. rank 0: data, inference, kernels, tools; the other ranks wait for batches

if rank == 0:
    stream = TaskStream(train_tasks, seed=cfg.run.seed, position=stream_position)
    logger = MetricsLogger(run.path, cfg.log, config=configlib.to_dict(cfg))
    loop = asyncio.new_event_loop()
    stop["loop"] = loop
    env_cm = rollout_env(cfg, model_path, learner.tokenizer, list(train_tasks) + list(eval_tasks), log_dir=run.path)
    try:
        env = loop.run_until_complete(env_cm.__aenter__())
    except Exception as e:
        fail(f"could not start the rollout environment: {type(e).__name__}: {e}")
    settle_gc()
    if resumed_weights is not None:
        loop.run_until_complete(env.policy.update_weights_from_disk(str(resumed_weights), str(start_step)))

    def evaluate(step: int) -> None:
        if not eval_tasks:
            return
        t0 = time.perf_counter()
        eps = loop.run_until_complete(run_tasks(env, list(eval_tasks), 1))
        run.write_trajectories(step, eps, prefix="eval")
        m = batch_metrics(eps)
        logger.log(step, {f"eval/{k}": v for k, v in m.items()} | {"eval/seconds": time.perf_counter() - t0})
        print(f"eval @ step {step}: EM {m['reward/em']:.3f}  F1 {m['reward/f1']:.3f}  answered {m['answered_rate']:.3f}  "
              f"reward {m['reward']:.3f}  (n={len(eps)}, {time.perf_counter() - t0:.0f} s)", flush=True)

    if start_step == 0 and cfg.run.eval_every >= 0:
        evaluate(0)
    print(STEP_HEADER, flush=True)

# ---------------------------------------------------------------------------------------------
# 4. the RL loop

step = start_step
exit_code = 0
while step < cfg.run.steps:
    t_step = time.perf_counter()
    # 4a. rank 0 collects and scores a batch; the batch (or a stop / error) reaches every rank
    msg = [None]
    if rank == 0:
        position_before = stream.position
        try:
            if stop["requested"]:
                raise asyncio.CancelledError
            stop["rollout"] = loop.create_task(collect_batch(env, stream, cfg.rollout, cfg.algo.dynamic_sampling))
            batch = loop.run_until_complete(stop["rollout"])
            msg = [("batch", training_rows(batch.episodes, cfg.algo))]
        except asyncio.CancelledError:
            stream.position = position_before
            msg = [("stop", position_before)]
        except InferenceDown as e:
            print(f"train.py: error: {e}", file=sys.stderr, flush=True)
            msg, exit_code = [("stop", position_before)], 3
        finally:
            stop["rollout"] = None
    dist.broadcast_object_list(msg, src=0)
    kind, payload = msg[0]
    if kind == "stop":
        save_checkpoint(step, payload)
        break

    # 4b. every rank: its share of the rows, one FSDP2 learner step
    stats = learner.train_step(shard_rows(payload, rank, world))
    step += 1

    # 4c. weight sync: export, then every inference server loads it and reports the version
    #     (skipped when a stop signal arrived during the step: the checkpoint below keeps it)
    t_sync = time.perf_counter()
    stopping = [stop["requested"]]
    dist.broadcast_object_list(stopping, src=0)
    folder = export_weights(step) if not stopping[0] else None
    if rank == 0:
        sync_error = None
        if folder is not None:
            try:
                loop.run_until_complete(env.policy.update_weights_from_disk(str(folder), str(step)))
            except Exception as e:  # checkpoint first, then stop with the reason
                sync_error, exit_code = f"weight sync to {', '.join(env.urls)} failed: {e}", 3
        sync_seconds = time.perf_counter() - t_sync

        # 4d. log: metrics, trajectories, the per-step table row, plot and viewer
        metrics = batch_metrics(batch.episodes) | {f"train/{k}": v for k, v in stats.items()}
        metrics |= {f"rollout/{k}": v for k, v in batch.stats.items()}
        metrics |= {"rollout_seconds": batch.stats["rollout_seconds"], "sync_seconds": sync_seconds,
                    "train_seconds": stats["train_seconds"], "seconds": time.perf_counter() - t_step}  # fmt: skip
        logger.log(step, metrics)
        run.write_trajectories(step, batch.episodes)
        print(format_step_row(step, metrics), flush=True)
        plot_rewards(run.metrics_jsonl, run.plots / "rewards.png")
        write_viewer(run.path, run.viewer_html, cfg.log.viewer_max_per_step or None)
        if sync_error:
            print(f"train.py: error: {sync_error}", file=sys.stderr, flush=True)
        elif cfg.run.eval_every > 0 and step % cfg.run.eval_every == 0 and step < cfg.run.steps and not stopping[0]:
            evaluate(step)
    failed = [exit_code]
    dist.broadcast_object_list(failed, src=0)
    saving = cfg.run.save_every > 0 and step % cfg.run.save_every == 0
    if saving or step == cfg.run.steps or stopping[0] or failed[0]:
        position = [stream.position if rank == 0 else 0]
        dist.broadcast_object_list(position, src=0)
        save_checkpoint(step, position[0])
    if stopping[0] or failed[0]:
        break

# ---------------------------------------------------------------------------------------------
# 5. wrap up

if rank == 0:
    if step == cfg.run.steps and not stop["requested"] and exit_code == 0 and cfg.run.eval_every >= 0:
        evaluate(step)
    loop.run_until_complete(env_cm.__aexit__(None, None, None))
    loop.close()
    logger.close()
    if run.metrics_jsonl.is_file():
        plot_rewards(run.metrics_jsonl, run.plots / "rewards.png")
        write_viewer(run.path, run.viewer_html, cfg.log.viewer_max_per_step or None)
    print(f"\nrun folder: {run.path}\n  metrics: {run.metrics_jsonl}\n  plot: {run.plots / 'rewards.png'}\n  viewer: {run.viewer_html}", flush=True)
dist.destroy_process_group()
sys.exit(exit_code)
