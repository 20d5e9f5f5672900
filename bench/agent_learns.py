"""Does the real loop learn? SmolLM2-135M through SFT and RL in one environment (or a mix of them), with the
held-out evaluation (sampled and greedy) after every `--eval-every` RL steps.

    python bench/agent_learns.py                 # QA (configs/cpu_demo.yaml): 16 RL steps, eval every 4
    python bench/agent_learns.py --env math      # configs/cpu_math.yaml; --env files, --env mixed likewise
    python bench/agent_learns.py --steps 8 --eval-every 2
    python bench/agent_learns.py --quick         # the same pipeline on tiny-random, in about a minute:
                                                 # it checks the machinery, it shows no learning

It runs `train.py --config <the environment's CPU config>` (the real loop: kernels, tools, embedded server,
weight sync), then reads the run's metrics.jsonl. The learning curve is the run's plots/rewards.png (the
held-out score at every evaluation over the SFT and RL phases). RESULT lines: the RL phase's held-out gain
(last evaluation minus the post-SFT one), sampled and greedy, overall and, in a mixed run, per environment,
each with the two-sided p-value of a two-proportion z-test, and the wall time.
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from l0_min.evaluation import two_proportion_z_test  # noqa: E402

CONFIGS = {"qa": "configs/cpu_demo.yaml", "math": "configs/cpu_math.yaml", "files": "configs/cpu_files.yaml",
           "mixed": "configs/cpu_mixed.yaml"}
ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("--env", choices=CONFIGS, default="qa", help="which environment's CPU config to run")
ap.add_argument("--quick", action="store_true")
ap.add_argument("--steps", type=int, default=16, help="RL steps")
ap.add_argument("--eval-every", type=int, default=4, help="held-out evaluation every N RL steps")
ap.add_argument("--target", type=float, default=0.10, help="the RL gain the RESULT lines call MET")
ap.add_argument("--minutes", type=float, default=60, help="the wall time the RESULT line calls MET")
ap.add_argument("overrides", nargs="*", help="more section.key=value for train.py")
args = ap.parse_args()

out = ROOT / "runs" / "agent_learns"
cmd = [sys.executable, "train.py", "--config", CONFIGS[args.env], f"run.steps={args.steps}",
       f"run.eval_every={args.eval_every}", f"run.out_dir={out}", f"run.name=agent-learns-{args.env}", *args.overrides]
if args.quick:  # the pipeline only: a random tiny model, few tasks, short episodes
    cmd += ["model.path=tiny-random", "run.steps=2", "run.eval_every=1", "data.eval_limit=4", "sft.episodes=8",
            "sft.steps=2", "rollout.batch_size=2", "rollout.n_samples=2", "learner.lora_rank=0", "learner.lr=1e-4"]
t0 = time.perf_counter()
proc = subprocess.run(cmd, cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
print(proc.stdout)
if proc.returncode:
    sys.exit(f"agent_learns.py: train.py exited with {proc.returncode}")
run = Path(proc.stdout.split("run folder: ")[1].split()[0])
if not run.is_absolute():
    run = ROOT / run
records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
sft_end = max((r["step"] for r in records if r.get("phase") == "sft"), default=0)
names = [""] + sorted({k.split("/")[1] for r in records for k in r if k.count("/") == 2 and k.endswith("/score")
                       and k.startswith("eval/") and not k.startswith("eval/greedy/")})  # "": overall
curve = {}  # (step, environment, mode) -> (successes, episodes)
for r in records:
    for mode, key in (("sampled", "eval/"), ("greedy", "eval/greedy/")):
        for name in names:
            if (k := f"{key}{name + '/' if name else ''}") + "score" in r:
                curve[r["step"], name, mode] = (r[k + "successes"], r[k + "n"])
steps = sorted({s for s, _, _ in curve})
print(f"\n{'step':>5} {'phase':>6} " + " ".join(f"{(n or 'all') + ' ' + m:>16}" for n in names for m in ("sampled", "greedy")))
for step in steps:
    cells = [f"{curve[step, n, m][0] / curve[step, n, m][1]:.3f}" if (step, n, m) in curve else "-"
             for n in names for m in ("sampled", "greedy")]
    print(f"{step:>5} {'base' if step == 0 else 'SFT' if step <= sft_end else 'RL':>6} " + " ".join(f"{c:>16}" for c in cells))
for name in names:
    for mode in ("sampled", "greedy"):
        if (sft_end, name, mode) in curve and (steps[-1], name, mode) in curve:
            (ca, na), (cb, nb) = curve[sft_end, name, mode], curve[steps[-1], name, mode]
            diff, _, p = two_proportion_z_test(cb, nb, ca, na)
            tag = f"{name}_" if name else ""
            print(f"RESULT rl_gain_{tag}{mode}={diff:+.3f} ({ca / na:.3f} -> {cb / nb:.3f}, n={na}, {nb}) "
                  f"target >= {args.target} {'MET' if diff >= args.target else 'SHORT'}")
            print(f"RESULT rl_gain_{tag}{mode}_p={p:.3g} target < 0.05 {'MET' if p < 0.05 else 'SHORT'}")
minutes = (time.perf_counter() - t0) / 60
print(f"RESULT minutes={minutes:.1f} target <= {args.minutes:g} {'MET' if minutes <= args.minutes else 'SHORT'}   "
      f"(curve: {run / 'plots' / 'rewards.png'})")
