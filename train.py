"""Train an NB-Agent with RL, as in L0: collect episodes, score, advantages, learner step, weight sync.

    torchrun --nproc_per_node=N train.py --config configs/x.yaml [section.key=value ...]
    python train.py --config configs/cpu_demo.yaml          # one process is fine on CPU
    python train.py --resume runs/NAME                      # continue a stopped run

Rank 0 runs the rollout (one asyncio loop: agent coroutines, sandboxed kernels, the tool server,
HTTP to the inference server) while the other ranks wait; every rank takes its share of the batch
for the FSDP2 learner step; rank 0 exports the new weights and tells the inference server(s) to
load them. Each step rank 0 sends one message to every rank: the training rows, or "stop".
SIGINT / SIGTERM finish cleanly: a checkpoint of the last completed step, then exit 0.
"""

import argparse
import asyncio
import contextlib
import dataclasses
import datetime
import os
import random
import shutil
import signal
import sys
import time
from pathlib import Path

from l0_min import config as configlib
from l0_min.envs import load_sources
from l0_min.log import fail


def expert_failure(episodes, envs, asked: int) -> str:
    """Why the SFT cold start has no expert episode, in one line: no task has an expert, or none of the experts'
    episodes solved its task (the first one's status, answer and gold; a mistake of its score() is its error)."""
    if not episodes:
        return (f"sft.episodes={asked} but no training task has an expert: every expert(task) of env "
                f"{' and env '.join(repr(name) for name in envs)} returned None (set sft.episodes=0)")
    ep = episodes[0]
    env = envs[ep.task.env]
    return (f"0 of {len(episodes)} expert episodes solved their task (sft.episodes={asked}); the first, task "
            f"{ep.task.id} of env {env.name!r}: {ep.status}, answer {ep.final_answer!r}, gold {ep.task.answers[:3]}"
            + (f", {ep.error}" if ep.error else ""))


def all_failed(episodes, step: int) -> str:
    """Why every episode of a step failed, in one line: the statuses and the first error."""
    counts = {}
    for ep in episodes:
        counts[ep.status] = counts.get(ep.status, 0) + 1
    lines = next((ep.error for ep in episodes if ep.error), "").strip().splitlines() or [""]
    first = lines[0][:200] + (f" ... {lines[-1][-200:]}" if len(lines) > 1 else "")  # what failed, and its cause
    return (f"every episode of step {step} failed and was masked ({', '.join(f'{n} {s}' for s, n in counts.items())}), "
            f"the first: {first}; stopping")


# ---------------------------------------------------------------------------------------------
# 1. configuration and data (rank 0 checks them before the slow imports: a mistake is reported in a second)

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--config", help="a YAML file of overrides (see configs/)")
ap.add_argument("--resume", metavar="RUN_DIR", help="continue the run in this folder from its last checkpoint")
ap.add_argument("overrides", nargs="*", help="section.key=value")
args = ap.parse_args()
try:
    if args.resume:
        if not (Path(args.resume) / "config.yaml").is_file():
            fail(f"--resume {args.resume}: no config.yaml there (not a run folder)")
        cfg = configlib.resolve(args.overrides, Path(args.resume) / "config.yaml")
    else:
        cfg = configlib.resolve(args.overrides, args.config)
except configlib.ConfigError as e:
    fail(str(e))

rank0 = int(os.environ.get("RANK", "0")) == 0
sft_steps = cfg.sft.steps if cfg.sft.episodes else 0  # the SFT cold start's learner steps, then RL's
last = sft_steps + cfg.run.steps
if rank0:  # each source's tasks in its environment (l0_min/envs: qa, math, files, or a module of yours)
    try:
        train_sources, weights, envs = load_sources(cfg.data.train, cfg)
    except Exception as e:
        fail(f"data.train: {e}")
    try:
        eval_sources, _, eval_envs = load_sources(cfg.data.eval if cfg.run.eval_every >= 0 else [], cfg,
                                                  limit=cfg.data.eval_limit)
    except Exception as e:
        fail(f"data.eval: {e}")
    envs |= eval_envs
    train_tasks, eval_tasks = [t for ts in train_sources for t in ts], [t for ts in eval_sources for t in ts]
if cfg.rollout.overlap:  # on CPU the learner and the embedded server (started from here: it inherits this) share the
    # cores; OpenMP threads that spin while they wait take them from the other: -9% seconds a trained token on 2 cores
    # (docs/results.md, "step rewards against outcome only on QA alone"); alone the learner is 6-8% faster spinning
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch.distributed as dist  # noqa: E402

from l0_min.collect import Batches, ExpertPolicy, InferenceDown, TaskStream, run_tasks  # noqa: E402
from l0_min.envs import solved  # noqa: E402
from l0_min.episode import sft_rows, training_rows  # noqa: E402
from l0_min.evaluation import format_summary, summarize_episodes, two_proportion_z_test  # noqa: E402
from l0_min.distributed import close_distributed, from_rank0, init_distributed  # noqa: E402
from l0_min.learner import Learner, NoRoom, shard_rows  # noqa: E402
from l0_min.log import MetricsLogger, RunDir, batch_metrics, label, log_step, plot_rewards, step_header  # noqa: E402
from l0_min.models import resolve_model  # noqa: E402
from l0_min.inference import InferenceError  # noqa: E402
from l0_min.runtime import PEAK_MB, rollout_env, servers_ready, settle_gc, sync_weights  # noqa: E402
from l0_min.viewer import write_viewer  # noqa: E402

try:
    rank, world, device = init_distributed(cfg.learner.backend, cfg.learner.device)
except (RuntimeError, ValueError) as e:  # learner.device=cuda without CUDA (distributed.cuda_missing says why)
    fail(str(e))
# Small control messages go over a CPU (gloo) group with a long timeout: the other ranks wait in it
# while rank 0 collects a batch, which may take far longer than a GPU collective's watchdog allows.
control = dist.new_group(backend="gloo", timeout=datetime.timedelta(hours=6))


# rank 0 names the run folder, builds or converts a built-in model and waits for the inference servers (one on the
# learner's GPU holds its memory once loaded: the learner's memory check must see it); every rank gets both names
try:
    model_path = resolve_model(cfg.model.path) if rank0 else None
    if rank0 and cfg.inference.urls:
        asyncio.run(servers_ready(cfg))
except FileNotFoundError as e:
    fail(f"model.path: {e}")
except (InferenceError, ValueError) as e:
    fail(f"inference.urls: {e}")
run_name = Path(args.resume) if args.resume else Path(cfg.run.out_dir) / f"{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}"
run_path, model_path = map(Path, from_rank0((str(run_name), str(model_path)), control))
checkpoints = sorted((run_path / "checkpoints").glob("step_*"))
if args.resume and not checkpoints:
    fail(f"--resume {run_path}: no checkpoint in {run_path / 'checkpoints'}")

# ---------------------------------------------------------------------------------------------
# 2. the learner (all ranks); a resumed run continues from its last checkpoint; the run folder once it fits

try:
    learner = Learner(model_path, cfg.learner, cfg.algo, total_steps=cfg.run.steps, temperature=cfg.sampling.temperature)
except (ValueError, NoRoom) as e:  # a speed setting that cannot run here; a GPU without room for the learner
    fail(str(e))
run = RunDir(run_path)
start_step, position = 0, 0
if args.resume:
    position = learner.load(checkpoints[-1])["task_position"]
    start_step = learner.step
if rank0:
    configlib.save(cfg, run.config_yaml)
    print(f"run folder: {run.path}  (model {cfg.model.path}, {world} rank(s), start step {start_step})", flush=True)


def save_checkpoint(step: int, position: int) -> None:
    path = run.checkpoints / f"step_{step:05d}"
    from_rank0(None, control)  # the other ranks wait for rank 0 (evaluating, syncing) in the control group
    learner.save(path, extra={"task_position": position})
    if rank0:
        for old in sorted(run.checkpoints.glob("step_*"))[:-1]:
            shutil.rmtree(old, ignore_errors=True)
        print(f"checkpoint: {path}", flush=True)


def export_weights(step: int) -> Path:
    """Every rank (a collective): rank 0 writes the HF folder of this step's policy, in the serving dtype,
    under inference.weights_dir (a folder every server reads at the same path) or the run folder."""
    root = Path(cfg.inference.weights_dir).expanduser() / run.path.name if cfg.inference.weights_dir else run.path / "weights"
    return learner.export_hf(root / f"step_{step:05d}", dtype=cfg.model.serving_dtype(device.type == "cuda"))


# ---------------------------------------------------------------------------------------------
# 3. rank 0: one event loop for the rollout services (inference, kernels, tools), torn down at the end

stop = asyncio.Event()  # a stop signal: the rollout in flight is cancelled, the last step is kept


def on_signal(signum, frame):
    if rank0:
        print(f"\n{signal.Signals(signum).name}: stopping after a checkpoint ...", flush=True)
        runner.get_loop().call_soon_threadsafe(stop.set)


resumed_weights = export_weights(start_step) if start_step else None  # the servers start from the base model
if rank0:
    runner = asyncio.Runner()
    services = contextlib.AsyncExitStack()
    stream = TaskStream(train_sources, weights, seed=cfg.run.seed, position=position)
    logger = MetricsLogger(run.path, cfg.log, config=dataclasses.asdict(cfg))
    try:
        svc = runner.run(services.enter_async_context(
            rollout_env(cfg, model_path, learner.tokenizer, train_tasks + eval_tasks, envs, log_dir=run.path)))
    except Exception as e:
        fail(f"could not start the rollout environment: {type(e).__name__}: {e}")
    settle_gc()
    if resumed_weights:
        runner.run(sync_weights(svc.policy, resumed_weights, str(start_step)))

    # overlap k >= 1: up to k batches are collected ahead while the learner trains (rank 0 runs the learner
    # step in a thread, so the event loop and its episodes go on); k = 0: strictly on-policy (the paper)
    batches = Batches(svc, stream, cfg.rollout, cfg.algo.dynamic_sampling)
    train_envs = sorted({t.env for t in train_tasks})
    header = step_header(train_envs, envs)

    async def until_stopped(coro):
        """Run `coro` unless a stop signal comes first (then it is cancelled and None returned)."""
        job, stopped = asyncio.ensure_future(coro), asyncio.ensure_future(stop.wait())
        await asyncio.wait([job, stopped], return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if not job.done():
            job.cancel()
            await asyncio.gather(job, return_exceptions=True)
            return None
        return job.result()

    evals: dict[int, dict] = {}  # step -> {(environment | "all", "sampled" | "greedy"): (successes, n, metric)}

    def evaluate(step: int) -> None:
        """The held-out tasks, scored by their environments: each one's headline metric with a 95% interval, per
        environment and, with several, overall; at the sampling temperature (run.eval_samples episodes per
        task) and, with run.eval_greedy, greedily too (not the base model before SFT: greedy is there to
        compare RL's start and end)."""
        greedy = cfg.run.eval_greedy and (step > 0 or sft_steps == 0)
        for mode in ("sampled", "greedy") if greedy else ("sampled",):
            t0, key = time.perf_counter(), "eval/" if mode == "sampled" else "eval/greedy/"
            svc_m = svc if mode == "sampled" else dataclasses.replace(
                svc, cfg=dataclasses.replace(cfg, sampling=dataclasses.replace(cfg.sampling, temperature=0.0)))
            eps = runner.run(run_tasks(svc_m, eval_tasks, cfg.run.eval_samples))
            run.write_trajectories(step, eps, prefix="eval" if mode == "sampled" else "eval-greedy")
            record = {key + "seconds": time.perf_counter() - t0}
            for name, m in summarize_episodes(eps, envs).items():
                evals.setdefault(step, {})[name, mode] = m["successes"], m["n"], label(m["metric"])
                record |= {f"{key}{'' if name == 'all' else name + '/'}{k}": v for k, v in m.items()}
                print(f"eval @ step {step} ({mode}{'' if name == 'all' else ', ' + name}): {format_summary(m)} "
                      f"({record[key + 'seconds']:.0f} s)", flush=True)
            logger.log(step, record)

    if start_step == 0 and cfg.run.eval_every >= 0 and cfg.run.eval_start:
        evaluate(0)
    if start_step >= sft_steps:
        print(header, flush=True)
else:
    runner = None


def on_every_rank(fn, *args, **kwargs):
    """A collective step (learner update, export): rank 0 runs it in a thread, so its event loop goes on
    meanwhile (episodes collected ahead, kernel starts, the tool server), the other ranks directly."""
    return runner.run(asyncio.to_thread(fn, *args, **kwargs)) if rank0 else fn(*args, **kwargs)


def learner_step(msg, sft: bool = False):
    """Every rank: rank 0's message -> this rank's share of the rows -> one learner step; its stats, or
    None after a checkpoint when the message was ("stop", exit code)."""
    kind, payload = from_rank0(msg, control)
    if kind == "stop":
        save_checkpoint(step, position)  # the tasks of a batch cut short are drawn again after a resume
        return None, payload
    return on_every_rank(learner.train_step, shard_rows(payload, rank, world), sft=sft), 0


def publish(step: int) -> int:
    """Every rank: export this step's weights; rank 0 has every inference server load them. The exit code:
    3 when the sync failed (the run checkpoints at the next message and stops with the reason)."""
    folder = on_every_rank(export_weights, step)
    if rank0:
        try:
            runner.run(sync_weights(svc.policy, folder, str(step)))
        except Exception as e:
            print(f"train.py: error: weight sync failed: {e}", file=sys.stderr, flush=True)
            return 3
    return 0


signal.signal(signal.SIGINT, on_signal)
signal.signal(signal.SIGTERM, on_signal)

# ---------------------------------------------------------------------------------------------
# 4. the SFT cold start (sft.episodes, sft.steps): expert episodes of training tasks (each environment's expert,
#    collect.ExpertPolicy) run through the real kernels and tools; the learner takes the log-likelihood of their actions

step, exit_code, stopped = start_step, 0, False
if step < sft_steps:
    if rank0:  # each source's first tasks that have an expert (of sft.kinds: meta 'kind'), sft.episodes by sft_weight
        def wanted(t) -> bool:
            try:
                return (not cfg.sft.kinds or t.meta.get("kind") in cfg.sft.kinds) and envs[t.env].expert(t) is not None
            except Exception as e:  # an environment's bug: one line, not a traceback
                fail(f"env {t.env!r}: expert() raised {type(e).__name__} on task {t.id!r}: {str(e)[:300]}")

        shares = [w if s.sft_weight == -1 else s.sft_weight for s, w in zip(cfg.data.train, weights)]
        shown = [t for ts, w in zip(train_sources, shares)
                 for t in [t for t in ts if wanted(t)][: round(cfg.sft.episodes * w / (sum(shares) or 1))]]
        expert = dataclasses.replace(svc, policy=ExpertPolicy(shown, envs, learner.tokenizer, cfg.agent.prefill))
        episodes = runner.run(run_tasks(expert, shown))
        demos = [e for e in episodes if solved(e, envs[e.task.env])]
        if not demos:  # SFT was asked for and none of it can happen: say why, rather than end without a step
            fail(expert_failure(episodes, {t.env: envs[t.env] for t in train_tasks}, cfg.sft.episodes))
        random.Random(cfg.run.seed).shuffle(demos)  # SFT batches mix the sources
        run.write_trajectories(0, demos, prefix="sft")
        print(f"SFT: {len(demos)} expert episodes of {len(shown)} tasks ({', '.join(cfg.sft.kinds) or 'all kinds'}), "
              f"{sft_steps} steps of {cfg.sft.batch_size}", flush=True)
    if step == 0:
        learner.reset_optimizer(cfg.sft.lr or cfg.learner.lr, sft_steps)
while step < sft_steps:
    t_step = time.perf_counter()
    msg = ("stop", exit_code) if rank0 and (stop.is_set() or not demos) else None
    if rank0 and msg is None:
        msg = ("rows", sft_rows([demos[(step * cfg.sft.batch_size + i) % len(demos)] for i in range(cfg.sft.batch_size)]))
    stats, code = learner_step(msg, sft=True)
    if stats is None:  # stopped: no RL steps follow
        exit_code, stopped = code, True
        break
    step += 1
    if rank0:
        logger.log(step, {"phase": "sft", "seconds": time.perf_counter() - t_step} | {f"train/{k}": v for k, v in stats.items()})
        print(f"SFT step {step}: loss {stats['loss']:.4f}  {stats['tokens']:.0f} tokens  {time.perf_counter() - t_step:.1f} s",
              flush=True)
    if step == sft_steps:  # the servers get the SFT policy; RL starts with a fresh optimizer at its own lr
        exit_code = publish(step)
        if rank0 and not exit_code:
            if cfg.run.eval_every >= 0:
                evaluate(step)
            print(header, flush=True)
        learner.reset_optimizer(cfg.learner.lr, cfg.run.steps)

# ---------------------------------------------------------------------------------------------
# 5. the RL loop

while step < last and not stopped:
    t_step = time.perf_counter()
    # 5a. rank 0 takes the next batch (episodes more than rollout.overlap versions old are dropped in it), then
    #     sends every rank its rows, or "stop" (a stop signal, a failed sync, the servers gone)
    msg = None
    if rank0:
        try:
            batch = None if stop.is_set() or exit_code else runner.run(until_stopped(batches.next(step)))
            if batch is not None and all(ep.masked for ep in batch.episodes):  # nothing to learn from, and it repeats
                print(f"train.py: error: {all_failed(batch.episodes, step + 1)}", file=sys.stderr, flush=True)
                batch, exit_code = None, 3
            msg = ("stop", exit_code) if batch is None else ("rows", training_rows(batch.episodes, cfg.algo))
        except InferenceDown as e:
            print(f"train.py: error: {e}", file=sys.stderr, flush=True)
            msg = ("stop", 3)
    # 5b. every rank: its share of the rows, one FSDP2 learner step (on rank 0 in a thread: episodes go on)
    stats, code = learner_step(msg)
    if stats is None:
        exit_code = code
        break
    step += 1
    if rank0:
        position = batch.stats["task_position"]  # where the stream stood after this batch's tasks

    # 5c. weight sync: export, then every inference server loads it and reports the version
    t_sync = time.perf_counter()
    exit_code = publish(step)
    if rank0:
        # 5d. log: metrics, trajectories, the per-step table row, plot and viewer
        metrics = {"phase": "rl"} | batch_metrics(batch.episodes, envs) | {f"train/{k}": v for k, v in stats.items()}
        metrics |= {f"rollout/{k}": v for k, v in batch.stats.items()}
        metrics |= {"rollout_seconds": batch.stats["rollout_seconds"], "sync_seconds": time.perf_counter() - t_sync,
                    "train_seconds": stats["train_seconds"], "seconds": time.perf_counter() - t_step}  # fmt: skip
        log_step(run, logger, step, metrics, batch.episodes, cfg.log.viewer_max_per_step, (train_envs, envs))
        if cfg.run.eval_every > 0 and (step - sft_steps) % cfg.run.eval_every == 0 and step < last and not exit_code:
            evaluate(step)
    if step == last or (cfg.run.save_every > 0 and step % cfg.run.save_every == 0):
        save_checkpoint(step, position)

# ---------------------------------------------------------------------------------------------
# 6. wrap up

if rank0:
    if step == last and step not in evals and not stop.is_set() and exit_code == 0 and cfg.run.eval_every >= 0:
        evaluate(step)  # (not again where the last step was evaluated: after SFT with run.steps=0, or at the start)
    for phase, a, b in (("SFT", 0, sft_steps), ("RL", sft_steps, last)):  # each phase's held-out gain, and its test
        for name, mode in [k for k in evals.get(b, {}) if k in evals.get(a, {})] if a != b else ():  # run at both
            (c1, n1, what), (c2, n2, _) = evals[b][name, mode], evals[a][name, mode]
            diff, _, p = two_proportion_z_test(c1, n1, c2, n2)
            several = any(k[0] != "all" for k in evals[b])
            print(f"{phase} phase ({mode}{', ' + name if several else ''}): held-out {what} "
                  f"{c2 / n2:.3f} -> {c1 / n1:.3f} ({diff:+.3f}), two-proportion z-test p = {p:.2g} "
                  f"(n = {n2} and {n1} episodes)", flush=True)
    runner.run(batches.close())
    runner.run(services.aclose())
    runner.close()
    logger.close()
    if run.metrics_jsonl.is_file():
        plot_rewards(run.metrics_jsonl, run.plots / "rewards.png")
        write_viewer(run.path, run.viewer_html, cfg.log.viewer_max_per_step or None)
    print(f"peak memory: {PEAK_MB[0] / 1024:.1f} GB (PSS of train.py, the inference server and the kernels, "
          "sampled every 2 s)", flush=True)
    print(f"\nrun folder: {run.path}\n  metrics: {run.metrics_jsonl}\n  plot: {run.plots / 'rewards.png'}\n  viewer: {run.viewer_html}", flush=True)
close_distributed(control, exit_code)  # the control group: the other ranks may wait here through rank 0's last evaluation
