"""bench/ablate.py's readings and its table: what a run's held-out evaluation says (per environment, QA's hops,
cells that ran), pooled over worlds and seeds against each world's start, and the RESULT lines."""

import math
from pathlib import Path

from l0_min.evaluation import two_proportion_z_test, wilson_interval
from l0_min.log import read_jsonl

HOPS = ("hop1", "hop2", "hop3", "em", "ref_missed", "ref_recovered")  # QA's per-hop success, the answer right, a
# read_page of no page (a mistyped ref) and a page read after it (envs/qa.py hop_metrics)
LABEL = {"em": "right", "ref_missed": "miss", "ref_recovered": "recov"}


def evaluation(run: Path) -> dict:
    """The held-out evaluations of a run's last evaluated step (every one there: none is left out): sampled and greedy
    [successes, n], overall and per environment; QA's hops [found, episodes] and right answers by kind; the share of
    cells that ran; steps per episode; rebuild share."""
    records = read_jsonl(run / "metrics.jsonl")
    last = max(r["step"] for r in records if "eval/score" in r)
    at = lambda key: [r for r in records if r["step"] == last and f"{key}score" in r]  # noqa: E731
    pooled = lambda key: [sum(r[f"{key}successes"] for r in at(key)), sum(r[f"{key}n"] for r in at(key))]  # noqa: E731
    eps = read_jsonl(run / "trajectories" / f"eval_{last:05d}.jsonl")
    names = sorted({e["task"]["env"] for e in eps})
    prefix = lambda name: "" if len(names) == 1 else f"{name}/"  # noqa: E731  (one environment: its numbers are "all")
    envs = {n: {"sampled": pooled(f"eval/{prefix(n)}"), "greedy": pooled(f"eval/greedy/{prefix(n)}")
                if at(f"eval/greedy/{prefix(n)}") else None} for n in names}  # fmt: skip
    hops = {h: [sum(e["rewards"].get(h) == 1.0 for e in eps if h in e["rewards"] and "hop1" in e["rewards"]),
                sum(h in e["rewards"] and "hop1" in e["rewards"] for e in eps)] for h in HOPS}
    kinds = {}  # QA's right answers by question kind and hops, [right, episodes]: where the hops do not lead to answers
    for e in (e for e in eps if "hop1" in e["rewards"]):
        m = e["task"].get("meta", {})
        kind = kinds.setdefault(f"{m.get('kind', '?')} {m.get('hops', '?')}-hop", [0, 0])
        kind[0] += e["rewards"].get("em") == 1.0
        kind[1] += 1
    ran = [s["exec_ok"] for e in eps for s in e["steps"] if s["exec_ok"] is not None]
    return {"step": last, "sampled": pooled("eval/"), "greedy": pooled("eval/greedy/") if at("eval/greedy/") else None,
            "envs": envs, "hops": {h: v for h, v in hops.items() if v[1]}, "exec": sum(ran) / len(ran) if ran else 0.0,
            "steps": sum(len(e["steps"]) for e in eps) / len(eps), "rebuilds": sum(e["truncations"] > 0 for e in eps) / len(eps),
            "kinds": kinds}


def pooled(runs: list[dict], mode: str, env: str | None = None) -> list[float] | None:
    """[successes, episodes] of `runs`' evaluations (of `env`, else all) in `mode` together; None where one has none."""
    parts = [r[mode] if env is None else r.get("envs", {}).get(env, {}).get(mode) for r in runs]
    return None if not parts or any(p is None for p in parts) else [sum(p[i] for p in parts) for i in (0, 1)]


def rate(c_n) -> str:
    return f"{c_n[0] / c_n[1]:.2f}" if c_n and c_n[1] else "-"


def base(arm: str, flag: str) -> str:
    """The arm without option `flag`: what the option is measured against."""
    return ":".join(o for o in arm.split(":") if o != flag)


def contrasts(arms: list[str]) -> list[tuple[str, str, str]]:
    """(arm, the arm it is measured against, what differs): `step`, `chunk` (under overlap) or a `section.key=value`
    option against the arm without it; another estimator against reinforce++ with the same options.

    >>> contrasts(["reinforce++", "reinforce++:algo.gamma=0.95", "grpo", "reinforce++:chunk"])
    [('reinforce++:algo.gamma=0.95', 'reinforce++', 'algo.gamma=0.95'), ('grpo', 'reinforce++', 'grpo')]
    """
    out = []
    for arm in arms:
        estimator, *options = arm.split(":")
        for flag in [o for o in options if o == "step" or "=" in o or (o == "chunk" and "overlap" in options)]:
            out += [(arm, base(arm, flag), flag)] if base(arm, flag) in arms else []
        other = ":".join(["reinforce++", *options])
        out += [(arm, other, estimator)] if estimator != "reinforce++" and other in arms else []
    return out


def report(results: dict, arms: list[str], worlds: list[int], seeds: int, first: int, given_sft: bool, target: float,
           out: Path, title: str) -> None:
    """Print the tables and RESULT lines; plot each arm's RL reward per step (mean over its runs)."""
    starts = {w: [results["sft", w, 0]] * (not given_sft) + [results["start", w, s] for s in range(first, seeds)]
              for w in worlds}  # fmt: skip
    runs = {a: [results[a, w, s] for w in worlds for s in range(seeds) if (a, w, s) in results] for a in arms}
    names = sorted({n for rs in starts.values() for r in rs for n in r.get("envs", {})})
    start_exec = {w: sum(r["exec"] for r in rs) / len(rs) for w, rs in starts.items()}
    collapsed = lambda r: r["exec"] < 0.5 * start_exec[r["world"]]  # noqa: E731  (cells stop running: counted, kept)
    print("\nstarts (after SFT, sampled, each world's seeds pooled):")
    for w, rs in starts.items():
        print(f"  world {w}: " + ", ".join(f"{n} {rate(pooled(rs, 'sampled', n))} ({pooled(rs, 'sampled', n)[1]})"
                                           for n in names)
              + f"; {sum(r['steps'] for r in rs) / len(rs):.2f} steps/ep, {sum(r['rebuilds'] for r in rs) / len(rs):.0%}"
              f" rebuilt, cells run {start_exec[w]:.2f} ({len(rs)} seed(s))")
    width = max(12, *map(len, arms))
    gains = {}  # (env, mode, arm) -> (diff, p, end [c, n], per world)
    for env in [*names, *(["all"] if len(names) > 1 else [])]:
        for mode in ("sampled", "greedy"):
            key = None if env == "all" else env
            start = pooled([r for rs in starts.values() for r in rs], mode, key) if mode == "sampled" else \
                pooled([rs[0] for rs in starts.values()], mode, key)  # greedy: each world's SFT run once
            if not start:
                continue
            hop_cols = [h for h in HOPS if any(h in r.get("hops", {}) for a in arms for r in runs[a])] if env == "qa" else []
            print(f"\n{env}, {mode}, worlds {','.join(map(str, worlds))} pooled (start {rate(start)}, {start[1]} episodes):")
            print(f"{'arm':<{width}} {'runs':>4} {'end (95% CI)':>17} {'gain':>7} {'p':>7}  {'per world':<24}"
                  + "".join(f" {LABEL.get(h, h):>5}" for h in hop_cols) + " collapsed")
            for arm in arms:
                if not (end := pooled(runs[arm], mode, key)):
                    continue
                own = {w: e for w in worlds if (e := pooled([r for r in runs[arm] if r["world"] == w], mode, key))}
                at = {w: pooled(starts[w] if mode == "sampled" else starts[w][:1], mode, key) for w in own}
                diff, _, p = two_proportion_z_test(*end, *[sum(at[w][i] for w in own) for i in (0, 1)])  # its worlds' starts
                lo, hi = wilson_interval(*end)
                per = {w: two_proportion_z_test(*own[w], *at[w])[0] for w in own}
                gains[env, mode, arm] = diff, p, end, per, own
                hops = [rate([sum(r["hops"][h][i] for r in runs[arm] if h in r.get("hops", {})) for i in (0, 1)])
                        for h in hop_cols]  # fmt: skip
                print(f"{arm:<{width}} {len(runs[arm]):>4} {end[0] / end[1]:>5.3f} ({lo:.2f}-{hi:.2f}) {diff:>+7.3f} {p:>7.2g}  "
                      f"{' '.join(f'w{w} {d:+.2f}' for w, d in per.items()):<24}" + "".join(f" {h:>5}" for h in hops)
                      + f" {sum(map(collapsed, runs[arm]))}/{len(runs[arm])}")
    print("\nqa right by question kind, worlds and seeds pooled:")
    for label, rs in [("start", [r for rs in starts.values() for r in rs]), *runs.items()]:
        kinds = {}
        for k, right_n in ((k, v) for r in rs for k, v in r.get("kinds", {}).items()):
            kinds[k] = [a + b for a, b in zip(kinds.get(k, (0, 0)), right_n)]
        if kinds:
            print(f"  {label:<{width}} " + ", ".join(f"{k} {c}/{n}" for k, (c, n) in sorted(kinds.items())))
    print(f"\n{'arm':<{width}} {'steps/ep':>8} {'rebuilt':>7} {'cells run':>9} {'tokens':>9} {'min/run':>7} {'RL min':>6} "
          f"{'|log r| token':>13} {'chunk':>8}")
    mean = lambda rs, f: sum(map(f, rs)) / len(rs) if rs else math.nan  # noqa: E731
    for arm in arms:
        rs = runs[arm]
        print(f"{arm:<{width}} {mean(rs, lambda r: r['steps']):>8.2f} {mean(rs, lambda r: r['rebuilds']):>7.0%} "
              f"{mean(rs, lambda r: r['exec']):>9.2f} {mean(rs, lambda r: r.get('tokens', 0)):>9,.0f} "
              f"{mean(rs, lambda r: r['minutes']):>7.1f} {mean(rs, lambda r: r.get('rl_minutes', math.nan)):>6.1f} "
              f"{mean(rs, lambda r: r.get('log_ratio', {}).get('token', math.nan)):>13.2g} "
              f"{mean(rs, lambda r: r.get('log_ratio', {}).get('chunk', math.nan)):>8.2g}")
    print("\ntraining success per RL step (each run; its environments' headline metric):")
    for arm in arms:
        for r in runs[arm]:
            steps = " | ".join(f"{env or names[0]} " + " ".join("-" if v is None else f"{v:.2f}" for v in vs)
                               for env, vs in r.get("success", {}).items())
            print(f"  {arm} w{r['world']} s{r['seed']}: {steps}; cells run "
                  + " ".join("-" if v is None else f"{v:.2f}" for v in r.get("exec_per_step", []))
                  + (f"  COLLAPSED (held-out cells run {r['exec']:.2f}, start {start_exec[r['world']]:.2f})"
                     if collapsed(r) else ""))
            if r.get("resample"):
                print(f"    solved / episodes by expert prefix length: "
                      + ", ".join(f"{k} {ok:.0f}/{n:.0f}" for k, (ok, n) in sorted(r["resample"].items())))
    plot(runs, out / "rewards.png", title)
    results_lines(gains, runs, names, target, worlds)


def plot(runs: dict, path: Path, title: str) -> None:
    from matplotlib.figure import Figure  # (no pyplot: no global backend)

    fig = Figure(figsize=(8, 4), layout="constrained")
    ax = fig.subplots()
    for arm, rs in runs.items():
        if curves := [r["rewards"] for r in rs]:
            n = min(map(len, curves))
            ax.plot(range(1, n + 1), [sum(c[i] for c in curves) / len(curves) for i in range(n)], marker="o", label=arm)
    ax.set(xlabel="RL step", ylabel="mean reward (over runs)", title=f"{title}: RL from each world's SFT start")
    ax.legend(fontsize=8)
    fig.savefig(path)


def results_lines(gains: dict, runs: dict, names: list[str], target: float, worlds: list[int]) -> None:
    """RESULT lines: the best arm's gain (all environments; QA and files alone), the step rewards' and the chunk
    ratios' effect (arm against the same arm without the option, same starts, on the worlds both ran), an
    overlapped run's minutes; each other option's and estimator's (`contrasts`) alike."""
    met = lambda d, p: "MET" if d >= target and p < 0.05 else "SHORT"  # noqa: E731
    whole = "all" if len(names) > 1 else names[0]
    print()
    for key, env, mode in (("long_rl_gain", whole, "sampled"), ("long_rl_gain_greedy", whole, "greedy"),
                           ("long_qa_rl_gain", "qa", "sampled"), ("long_files_rl_gain", "files", "sampled")):
        if cands := [a for (e, m, a) in gains if (e, m) == (env, mode)]:
            best = max(cands, key=lambda a: (len(gains[env, mode, a][4]), gains[env, mode, a][0]))  # most worlds first
            diff, p, (c, n), per, _ = gains[env, mode, best]
            print(f"RESULT {key}={diff:+.3f} (arm {best}, {env} {mode}, {n:.0f} held-out episodes, p = {p:.2g}; per world "
                  f"{', '.join(f'w{w} {d:+.3f}' for w, d in per.items())}) target >= {target} {met(diff, p)}")
    if cands := [a for (e, m, a) in gains if (e, m) == (whole, "sampled")]:
        best = max(cands, key=lambda a: (len(gains[whole, "sampled", a][4]), gains[whole, "sampled", a][0]))
        s, rb = [sum(r[k] for r in runs[best]) / len(runs[best]) for k in ("steps", "rebuilds")]
        print(f"RESULT long_steps_per_episode={s:.2f} target >= 4 {'MET' if s >= 4 else 'SHORT'}")
        print(f"RESULT long_rebuild_share={rb:.3f} target >= 0.10 {'MET' if rb >= 0.10 else 'SHORT'}")
    env = "qa" if "qa" in names else whole
    named = {"step": "RESULT step_reward_gain=", "chunk": "RESULT chunk_vs_token_stale="}
    for arm, other, flag in contrasts(list(runs)):  # an option (or the estimator) against the arm without it
        if (env, "sampled", arm) not in gains or (env, "sampled", other) not in gains:
            continue
        ends = gains[env, "sampled", arm][4], gains[env, "sampled", other][4]
        if not (common := [w for w in ends[0] if w in ends[1]]):  # the worlds both ran: the same starts and tasks
            continue
        diff, _, p = two_proportion_z_test(*[sum(e[w][i] for w in common) for e in ends for i in (0, 1)])
        both = runs[arm] + runs[other]
        ratios = f"; mean |log ratio| token {_mean(both, 'token'):.2g}, chunk {_mean(both, 'chunk'):.2g}"
        only = f", world {','.join(map(str, common))} only" if len(common) < len(worlds) else ""
        print(f"{named.get(flag, f'{flag}: ')}{diff:+.3f} ({arm} minus {other}, {env} sampled, same starts{only}, "
              f"p = {p:.2g}{ratios if flag == 'chunk' else ''})")
    for arm in [a for a in runs if "overlap" in a.split(":") and runs[a] and runs.get(base(a, "overlap"))][:1]:
        on, off = (sum(r["rl_minutes"] for r in runs[a]) / len(runs[a]) for a in (arm, base(arm, "overlap")))
        print(f"RESULT long_run_minutes={on:.1f} ({arm}, {len(runs[arm][0]['rewards'])} RL steps, SFT and evaluation "
              f"excluded; {off:.1f} without overlap) target < 20 {'MET' if on < 20 else 'SHORT'}")


def _mean(runs: list[dict], level: str) -> float:
    return sum(r["log_ratio"][level] for r in runs) / len(runs) if runs else math.nan
