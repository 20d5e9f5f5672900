"""Which estimator learns long tasks? One SFT, then every arm's RL from that same checkpoint, seeds apart.

    python bench/ablate.py --config configs/cpu_long.yaml --arms grpo,reinforce++,reinforce++:chunk,reinforce++:chunk:resample --seeds 2
    python bench/ablate.py --quick            # the tiny random model: the machinery in about two minutes, no learning

An arm is an advantage estimator (grpo | rloo | reinforce++) and options: `chunk` (algo.ratio_level=chunk, ROLL's
chunk-level importance ratios), `resample` (rollout.resample=0.5: half the groups start from the first k steps of
the environment's expert) and any `section.key=value` without a colon (`reinforce++:learner.lr=5e-4`: that arm only).
The SFT run evaluates its result on the held-out tasks (the shared start, sampled and greedy), and its weights are
evaluated again once per further seed (sampled: greedy decodes the same episodes again), so the start has as many
sampled episodes as each arm (`--sft` reuses an SFT run's weights: the start is evaluated once per seed); each
(arm, seed) run trains `--steps` RL steps from the SFT weights and evaluates at its end. Every run is recorded
in <out>/results.jsonl as it ends: rerun the same command and finished runs are skipped. The table: per arm the end
score pooled over seeds (95% Wilson interval), the gain over the start with a two-proportion z-test, steps per
held-out episode, the share of them that rebuilt their context, tokens trained, minutes per run; <out>/rewards.png:
each arm's RL reward per step. RESULT lines: the best arm's gain, its steps and rebuild share.
"""

import argparse
import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from l0_min.evaluation import two_proportion_z_test, wilson_interval  # noqa: E402
from l0_min.log import read_jsonl  # noqa: E402

ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("--config", default="configs/cpu_long.yaml")
ap.add_argument("--arms", default="grpo,reinforce++,reinforce++:chunk,reinforce++:chunk:resample")
ap.add_argument("--seeds", type=int, default=2)
ap.add_argument("--steps", type=int, default=None, help="RL steps per run (default: the config's run.steps)")
ap.add_argument("--out", default=None, help="the ablation folder (default runs/ablate/<config name>)")
ap.add_argument("--sft", default=None, help="start from these weights (an SFT run's weights/step_* folder) instead of "
                "running SFT; the start is then evaluated once per seed")
ap.add_argument("--quick", action="store_true", help="the tiny random model on short budgets: the machinery only")
ap.add_argument("--target", type=float, default=0.10, help="the RL gain the RESULT line calls MET")
ap.add_argument("overrides", nargs="*", help="more section.key=value for every train.py run")
args = ap.parse_args()

QUICK = ["model.path=tiny-random", "data.eval_limit=4", "sft.episodes=4", "sft.steps=1", "rollout.batch_size=2",
         "rollout.n_samples=2", "learner.lora_rank=0", "learner.lr=1e-4", "agent.max_steps=7", "sampling.max_new_tokens=24",
         "run.eval_greedy=false"]  # fmt: skip
out = Path(args.out or ROOT / "runs" / "ablate" / (Path(args.config).stem + ("-quick" if args.quick else "")))
out.mkdir(parents=True, exist_ok=True)
common = ["--config", args.config, f"run.out_dir={out / 'runs'}", *(QUICK if args.quick else []), *args.overrides]
steps = args.steps or (1 if args.quick else None)


def arm_overrides(arm: str) -> list[str]:
    """'reinforce++:chunk:resample' -> its settings; 'reinforce++:learner.lr=1e-3' -> the estimator and that setting."""
    estimator, *options = arm.split(":")
    settings = [o for o in options if "=" in o]
    if estimator not in ("grpo", "rloo", "reinforce++") or set(options) - {"chunk", "resample", *settings}:
        sys.exit(f"ablate.py: arm {arm!r}: expected grpo | rloo | reinforce++, then :chunk, :resample and/or "
                 ":section.key=value")
    return ([f"algo.advantage={estimator}"] + ["algo.ratio_level=chunk"] * ("chunk" in options)
            + ["rollout.resample=0.5"] * ("resample" in options) + settings)


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


def evaluation(run: Path) -> dict:
    """The held-out evaluations of a run's last evaluated step (every one there: none is left out): sampled and greedy
    (successes, n), steps per episode, rebuild share."""
    records = read_jsonl(run / "metrics.jsonl")
    last = max(r["step"] for r in records if "eval/score" in r)
    at = lambda key: [r for r in records if r["step"] == last and f"{key}score" in r]  # noqa: E731
    pooled = lambda key: [sum(r[f"{key}successes"] for r in at(key)), sum(r[f"{key}n"] for r in at(key))]  # noqa: E731
    eps = read_jsonl(run / "trajectories" / f"eval_{last:05d}.jsonl")
    return {"step": last, "sampled": pooled("eval/"), "greedy": pooled("eval/greedy/") if at("eval/greedy/") else None,
            "steps": sum(len(e["steps"]) for e in eps) / len(eps), "rebuilds": sum(e["truncations"] > 0 for e in eps) / len(eps)}


# finished runs, their evaluations read again from their own metrics (the table follows the runs, not an old reading)
results = {(r["arm"], r["seed"]): r | (evaluation(Path(r["run"])) if Path(r["run"]).exists() else {})
           for r in read_jsonl(out / "results.jsonl")} if (out / "results.jsonl").exists() else {}  # fmt: skip


def record(r: dict) -> None:
    results[r["arm"], r["seed"]] = r
    with open(out / "results.jsonl", "a") as f:
        f.write(json.dumps(r) + "\n")


t_start = time.perf_counter()
if args.sft:  # the shared start given: evaluated below like any further seed
    results["sft", 0] = {"weights": str(Path(args.sft).resolve())}
elif ("sft", 0) not in results:  # the shared start: SFT only, evaluated at its end
    t0 = time.perf_counter()
    run = train("sft", ["run.steps=0", "run.eval_every=0", "run.eval_start=false"])
    weights = sorted((run / "weights").glob("step_*"))[-1]
    record({"arm": "sft", "seed": 0, "run": str(run), "weights": str(weights), **evaluation(run),
            "minutes": (time.perf_counter() - t0) / 60})
from_start = lambda seed: [f"model.path={results['sft', 0]['weights']}", "sft.episodes=0", f"run.seed={seed}",  # noqa: E731
                            "run.eval_every=0"]  # fmt: skip


def pooled(runs: list[dict], mode: str) -> list[float] | None:
    """[successes, episodes] of `runs`' evaluations in `mode` together; None where one of them has none."""
    return None if not runs or any(r[mode] is None for r in runs) else [sum(r[mode][i] for r in runs) for i in (0, 1)]


first = 0 if args.sft else 1  # the SFT run evaluated seed 0's start
for seed in range(first, args.seeds):  # the start measured as often as each arm: the SFT weights evaluated again
    if ("start", seed) not in results:  # greedy once: the same weights decode the same episodes again
        t0 = time.perf_counter()
        run = train(f"start-s{seed}", [*from_start(seed), "run.steps=0", "run.eval_start=true",
                                       *(["run.eval_greedy=false"] * (seed > 0))])
        record({"arm": "start", "seed": seed, "run": str(run), **evaluation(run), "minutes": (time.perf_counter() - t0) / 60})
starts = [results["sft", 0]] * (not args.sft) + [results["start", s] for s in range(first, args.seeds)]
start = {"sampled": pooled(starts, "sampled"), "greedy": pooled(starts[:1], "greedy")} | {
    k: sum(r[k] for r in starts) / len(starts) for k in ("steps", "rebuilds")}
arms = args.arms.split(",")
for arm in arms:
    for seed in range(args.seeds):
        if (arm, seed) in results:
            continue
        t0 = time.perf_counter()
        run = train(re.sub(r"[^\w.]+", "-", arm.replace("+", "p")) + f"-s{seed}",
                    [*from_start(seed), "run.eval_start=false", *([f"run.steps={steps}"] if steps else []),
                     *arm_overrides(arm)])  # fmt: skip
        metrics = [m for m in read_jsonl(run / "metrics.jsonl") if m.get("phase") == "rl"]
        by_k = {}  # prefix length k -> [solved, episodes] over the run's steps
        for m in metrics:
            for key, v in m.items():
                if key.startswith("resample/k"):
                    by_k.setdefault(key.split("/")[1], [0, 0])[key.endswith("/episodes")] += v
        record({"arm": arm, "seed": seed, "run": str(run), **evaluation(run), "rewards": [m["reward"] for m in metrics],
                "tokens": sum(m.get("train/tokens", 0) for m in metrics), "minutes": (time.perf_counter() - t0) / 60,
                "resample": by_k})  # fmt: skip

# -- the table: pooled over seeds, against the shared start
print(f"\nstart (after SFT, {start['sampled'][1]} held-out episodes, {len(starts)} seed(s)): sampled {start['sampled'][0] / start['sampled'][1]:.3f}"
      + (f", greedy {start['greedy'][0] / start['greedy'][1]:.3f}" if start["greedy"] else "")
      + f"; {start['steps']:.2f} steps per episode, {start['rebuilds']:.0%} rebuilt their context")
width = max(12, *map(len, arms))  # the arm column
print(f"\n{'arm':<{width}} {'seeds':>5} {'sampled end (95% CI)':>22} {'gain':>7} {'p':>7} {'greedy end':>10} {'gain':>7} "
      f"{'p':>7} {'steps/ep':>8} {'rebuilt':>7} {'tokens':>9} {'min/run':>7}")
summary = {}
for arm in arms:
    runs = [results[arm, s] for s in range(args.seeds) if (arm, s) in results]
    cells, row = [], {}
    for mode in ("sampled", "greedy"):
        if not start[mode] or not (end := pooled(runs, mode)):
            cells += ["-"] * 3
            continue
        c, n = end
        diff, _, p = two_proportion_z_test(c, n, *start[mode])
        lo, hi = wilson_interval(c, n)
        row[mode] = (diff, p)
        cells += [f"{c / n:.3f} ({lo:.2f}-{hi:.2f})" if mode == "sampled" else f"{c / n:.3f}", f"{diff:+.3f}", f"{p:.2g}"]
    mean = lambda k: sum(r[k] for r in runs) / len(runs) if runs else math.nan
    summary[arm] = row | {"steps": mean("steps"), "rebuilds": mean("rebuilds")}
    print(f"{arm:<{width}} {len(runs):>5} {cells[0]:>22} {cells[1]:>7} {cells[2]:>7} {cells[3]:>10} {cells[4]:>7} {cells[5]:>7} "
          f"{mean('steps'):>8.2f} {mean('rebuilds'):>7.0%} {mean('tokens'):>9,.0f} {mean('minutes'):>7.1f}")
    for r in runs:
        if r.get("resample"):
            print(f"  {arm} seed {r['seed']}: solved / episodes by expert prefix length: "
                  + ", ".join(f"{k} {ok:.0f}/{n:.0f}" for k, (ok, n) in sorted(r["resample"].items())))

from matplotlib.figure import Figure  # noqa: E402  (no pyplot: no global backend)

fig = Figure(figsize=(8, 4), layout="constrained")
ax = fig.subplots()
for arm in arms:
    curves = [results[arm, s]["rewards"] for s in range(args.seeds) if (arm, s) in results]
    if curves:
        n = min(map(len, curves))
        ax.plot(range(1, n + 1), [sum(c[i] for c in curves) / len(curves) for i in range(n)], marker="o", label=arm)
ax.set(xlabel="RL step", ylabel="mean reward (over seeds)", title=f"{Path(args.config).stem}: RL from one SFT start")
ax.legend(fontsize=8)
fig.savefig(out / "rewards.png")

best = max((a for a in summary if "sampled" in summary[a]), key=lambda a: summary[a]["sampled"][0], default=None)
if best:
    diff, p = summary[best]["sampled"]
    print(f"\nRESULT long_rl_gain={diff:+.3f} (arm {best}, sampled, p = {p:.2g}) target >= {args.target} "
          f"{'MET' if diff >= args.target and p < 0.05 else 'SHORT'}")
    if greedy := max((a for a in summary if "greedy" in summary[a]), key=lambda a: summary[a]["greedy"][0], default=None):
        diff, p = summary[greedy]["greedy"]  # the policy's most likely actions: what RL sharpened, not what it samples
        print(f"RESULT long_rl_gain_greedy={diff:+.3f} (arm {greedy}, greedy, p = {p:.2g}) target >= {args.target} "
              f"{'MET' if diff >= args.target and p < 0.05 else 'SHORT'}")
    print(f"RESULT long_steps_per_episode={summary[best]['steps']:.2f} target >= 4 {'MET' if summary[best]['steps'] >= 4 else 'SHORT'}")
    print(f"RESULT long_rebuild_share={summary[best]['rebuilds']:.3f} target >= 0.10 "
          f"{'MET' if summary[best]['rebuilds'] >= 0.10 else 'SHORT'}")
print(f"\n{out / 'results.jsonl'}; {out / 'rewards.png'}; {(time.perf_counter() - t_start) / 60:.1f} min")
