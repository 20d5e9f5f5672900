"""Which estimator learns long tasks? Per world one SFT start, then every arm's RL from that world's start.

    python bench/ablate.py --config configs/cpu_long.yaml --worlds 0,7 --steps 8 \
        --arms reinforce++,reinforce++:algo.gamma=0.95,reinforce++:step,grpo:step,reinforce++:overlap,reinforce++:chunk:overlap
    python bench/ablate.py --quick            # the tiny random model: the machinery in a few minutes, no learning

A world is a `data.synthetic_seed` (new names, new pages, new files): each gets its own SFT start, which its arms
share (paired within a world, pooled across worlds), and `--seeds` RL seeds per world. An arm is an advantage
estimator (grpo | rloo | reinforce++) and options: `step` (reward.step_weight=STEP_WEIGHT: the environment's step
rewards, QA's information gain over the gold chain), `overlap` (rollout.overlap=1: batches collected while the
learner trains, so samples are one version stale), `chunk` (algo.ratio_level=chunk, ROLL's chunk-level importance
ratios), `resample` (rollout.resample=0.5: half the groups start from the first k steps of the environment's
expert) and any `section.key=value` without a colon (`reinforce++:algo.gamma=0.95`: that arm only).
Each world's SFT run evaluates its result on the held-out tasks (the start, sampled and greedy), and its weights are
evaluated again once per further seed (sampled), so the start has as many sampled episodes as each arm (`--sft`
reuses an SFT run's weights, for one world: the start is evaluated once per seed); each (arm, world, seed) run
trains `--steps` RL steps from its world's SFT weights and evaluates at its end. Every run is recorded in
<out>/results.jsonl as it ends: rerun the same command and finished runs are skipped. The table
(bench/ablate_table.py): per environment and arm the end score pooled over worlds and seeds (95% Wilson interval),
the gain over the start with a two-proportion z-test and the gain in each world, QA's per-hop success, runs that
collapsed; QA right by question kind; per arm steps per episode, rebuild share, cells that run, minutes, log-ratios,
and each run's training success per step; <out>/rewards.png. RESULT lines: the best arm's QA gain, step rewards' and
chunk ratios' effect, an overlapped run's minutes; then each `section.key=value` option against the arm without it,
and each other estimator against reinforce++ with the same options (bench/ablate_table.py's `contrasts`).
"""

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.ablate_table import evaluation, report  # noqa: E402
from l0_min.log import read_jsonl  # noqa: E402

STEP_WEIGHT = 0.4  # the `step` arms' reward.step_weight: under 0.72, so reading cannot beat answering (test_world)
FLAGS = {"chunk": ["algo.ratio_level=chunk"], "resample": ["rollout.resample=0.5"], "overlap": ["rollout.overlap=1"],
         "step": [f"reward.step_weight={STEP_WEIGHT}"]}

ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("--config", default="configs/cpu_long.yaml")
ap.add_argument("--arms", default="reinforce++,reinforce++:step,grpo:step")
ap.add_argument("--worlds", default="0", help="data.synthetic_seed values, comma-separated: each world its own SFT start")
ap.add_argument("--seeds", type=int, default=1, help="RL seeds per world")
ap.add_argument("--steps", type=int, default=None, help="RL steps per run (default: the config's run.steps)")
ap.add_argument("--out", default=None, help="the ablation folder (default runs/ablate/<config name>)")
ap.add_argument("--sft", default=None, help="start from these weights (an SFT run's weights/step_* folder) instead of "
                "running SFT (one world only); the start is then evaluated once per seed")
ap.add_argument("--quick", action="store_true", help="the tiny random model on short budgets: the machinery only")
ap.add_argument("--target", type=float, default=0.10, help="the RL gain the RESULT line calls MET")
ap.add_argument("overrides", nargs="*", help="more section.key=value for every train.py run")
args = ap.parse_args()
worlds = [int(w) for w in args.worlds.split(",")]
if args.sft and len(worlds) > 1:
    sys.exit("ablate.py: --sft gives one start: use it with one world (--worlds)")

QUICK = ["model.path=tiny-random", "data.eval_limit=4", "sft.episodes=4", "sft.steps=1", "rollout.batch_size=2",
         "rollout.n_samples=2", "learner.lora_rank=0", "learner.lr=1e-4", "agent.max_steps=7", "sampling.max_new_tokens=24",
         "run.eval_greedy=false"]  # fmt: skip
out = Path(args.out or ROOT / "runs" / "ablate" / (Path(args.config).stem + ("-quick" if args.quick else "")))
out.mkdir(parents=True, exist_ok=True)
common = ["--config", args.config, f"run.out_dir={out / 'runs'}", *(QUICK if args.quick else []), *args.overrides]
steps = args.steps or (1 if args.quick else None)


def arm_overrides(arm: str) -> list[str]:
    """'reinforce++:chunk:overlap' -> its settings; 'reinforce++:algo.gamma=0.95' -> the estimator and that setting."""
    estimator, *options = arm.split(":")
    settings = [o for o in options if "=" in o]
    if estimator not in ("grpo", "rloo", "reinforce++") or set(options) - {*FLAGS, *settings}:
        sys.exit(f"ablate.py: arm {arm!r}: expected grpo | rloo | reinforce++, then :{', :'.join(FLAGS)} and/or "
                 ":section.key=value")
    return [f"algo.advantage={estimator}"] + [s for o in options for s in FLAGS.get(o, [o])]


def train(name: str, extra: list[str]) -> Path:
    """One train.py run; its run folder. Its output goes to <out>/<name>.log."""
    t0 = time.perf_counter()
    log = out / f"{name}.log"
    with open(log, "w") as f:
        p = subprocess.run([sys.executable, "train.py", *common, f"run.name={name}", *extra], cwd=ROOT, text=True,
                           stdout=f, stderr=subprocess.STDOUT)  # fmt: skip
    text = log.read_text()
    if p.returncode:
        sys.exit(f"ablate.py: {name}: train.py exited with {p.returncode}; the end of {log}:\n{text[-3000:]}")
    run = Path(text.split("run folder: ")[1].split()[0])
    print(f"{name}: {time.perf_counter() - t0:.0f} s, {run}", flush=True)
    return run if run.is_absolute() else ROOT / run


def rl_record(run: Path) -> dict:
    """What an arm's run did step by step: reward, training success per environment (its headline), cells that ran,
    the sampler-vs-learner log-ratios; the RL steps' minutes and tokens."""
    metrics = [m for m in read_jsonl(run / "metrics.jsonl") if m.get("phase") == "rl"]
    last = [m for m in read_jsonl(run / "metrics.jsonl") if any(k.endswith("metric") for k in m)][-1]
    heads = {k.split("/")[1] if k.count("/") == 2 else "": v for k, v in last.items()  # eval/<env>/metric, eval/metric
             if k.startswith("eval/") and k.endswith("/metric") and not k.startswith("eval/greedy/")}
    heads = {e: h for e, h in heads.items() if e or len(heads) == 1}  # several environments: each its own, not "all"
    success = {env: [m.get(f"env/{env}/{h}" if env else f"reward/{h}") for m in metrics] for env, h in heads.items()}
    mean = lambda key: sum(m.get(key, 0.0) for m in metrics) / max(len(metrics), 1)  # noqa: E731
    by_k = {}  # prefix length k -> [solved, episodes] over the run's steps
    for m in metrics:
        for key, v in m.items():
            if key.startswith("resample/k"):
                by_k.setdefault(key.split("/")[1], [0, 0])[key.endswith("/episodes")] += v
    return {"rewards": [m["reward"] for m in metrics], "success": success,
            "exec_per_step": [1 - m["exec_error_rate"] if m.get("exec_error_rate") is not None else None for m in metrics],
            "tokens": sum(m.get("train/tokens", 0) for m in metrics), "rl_minutes": sum(m["seconds"] for m in metrics) / 60,
            "log_ratio": {"token": mean("train/mismatch/abs_log_ratio_mean"),
                          "chunk": mean("train/mismatch/chunk_abs_log_ratio_mean")}, "resample": by_k}  # fmt: skip


# finished runs, their evaluations read again from their own metrics (the table follows the runs, not an old reading)
results = {(r["arm"], r.get("world", 0), r["seed"]): r | (evaluation(Path(r["run"])) if Path(r["run"]).exists() else {})
           for r in read_jsonl(out / "results.jsonl")} if (out / "results.jsonl").exists() else {}  # fmt: skip


def record(r: dict) -> None:
    results[r["arm"], r["world"], r["seed"]] = r
    with open(out / "results.jsonl", "a") as f:
        f.write(json.dumps(r) + "\n")


t_start = time.perf_counter()
arms = args.arms.split(",")
for arm in arms:
    arm_overrides(arm)  # a bad arm stops here, before any run
first = 0 if args.sft else 1  # the SFT run evaluated seed 0's start
for w in worlds:
    world = [f"data.synthetic_seed={w}"]
    if args.sft:  # the start given: evaluated below like any further seed
        results["sft", w, 0] = {"weights": str(Path(args.sft).resolve())}
    elif ("sft", w, 0) not in results:  # the world's start: SFT only, evaluated at its end
        t0 = time.perf_counter()
        run = train(f"sft-w{w}", [*world, "run.steps=0", "run.eval_every=0", "run.eval_start=false"])
        weights = sorted((run / "weights").glob("step_*"))[-1]
        record({"arm": "sft", "world": w, "seed": 0, "run": str(run), "weights": str(weights), **evaluation(run),
                "minutes": (time.perf_counter() - t0) / 60})
    from_start = [*world, f"model.path={results['sft', w, 0]['weights']}", "sft.episodes=0", "run.eval_every=0"]
    for seed in range(first, args.seeds):  # the start measured as often as each arm: the SFT weights evaluated again
        if ("start", w, seed) not in results:  # greedy once: the same weights decode the same episodes again
            t0 = time.perf_counter()
            run = train(f"start-w{w}-s{seed}", [*from_start, f"run.seed={seed}", "run.steps=0", "run.eval_start=true",
                                                *(["run.eval_greedy=false"] * (seed > 0))])  # fmt: skip
            record({"arm": "start", "world": w, "seed": seed, "run": str(run), **evaluation(run),
                    "minutes": (time.perf_counter() - t0) / 60})
    for arm in arms:
        for seed in range(args.seeds):
            if (arm, w, seed) in results:
                continue
            t0 = time.perf_counter()
            run = train(re.sub(r"[^\w.]+", "-", arm.replace("+", "p")) + f"-w{w}-s{seed}",
                        [*from_start, f"run.seed={seed}", "run.eval_start=false", *([f"run.steps={steps}"] if steps else []),
                         *arm_overrides(arm)])  # fmt: skip
            record({"arm": arm, "world": w, "seed": seed, "run": str(run), **evaluation(run), **rl_record(run),
                    "minutes": (time.perf_counter() - t0) / 60})

report(results, arms, worlds, args.seeds, first, bool(args.sft), args.target, out, Path(args.config).stem)
print(f"\n{out / 'results.jsonl'}; {out / 'rewards.png'}; {(time.perf_counter() - t_start) / 60:.1f} min")
