"""bench/ablate.py: per world one SFT start, every arm's RL from its world's start, the table and RESULT lines, and a
rerun that skips the finished runs (--quick: the tiny random model, the machinery, not learning); the table's numbers
from made-up runs (bench/ablate_table.py)."""

import json
import re
import subprocess
import sys

import pytest
import yaml

from tests.test_train import ROOT, _env

# every option of an arm: step rewards, overlap, a setting; chunk-level ratios and resampling
ARMS = "reinforce++:step:overlap:learner.lr=2e-4,grpo:chunk:resample"


@pytest.mark.slow
@pytest.mark.timeout(900)  # six train.py runs (two worlds: an SFT and two arms each), then a rerun
def test_the_ablation_gives_each_world_its_own_sft_start_its_arms_share_and_resumes(tmp_path):
    cmd = [sys.executable, "bench/ablate.py", "--quick", "--config", "configs/tiny_test.yaml", "--arms", ARMS,
           "--worlds", "0,1", "--out", str(tmp_path)]  # fmt: skip
    p = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    results = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    arms = ARMS.split(",")
    assert [(r["arm"], r["world"], r["seed"]) for r in results] == [
        (a, w, 0) for w in (0, 1) for a in ["sft", *arms]]  # one RL seed per world by default
    sft = {r["world"]: r["weights"] for r in results if r["arm"] == "sft"}
    assert len(set(sft.values())) == 2  # two starts, one SFT run each
    for r in results:  # each run in its world, each arm from its world's SFT weights, with its own settings
        config = yaml.safe_load((ROOT / r["run"] / "config.yaml").read_text())  # (an absolute path stays as it is)
        assert config["data"]["synthetic_seed"] == r["world"]
        if r["arm"] == "sft":
            continue
        assert config["model"]["path"] == sft[r["world"]] and r["steps"] > 0 and len(r["rewards"]) == 1
        first = r["arm"] == arms[0]  # step rewards, overlap and a learning rate; the other chunk ratios and resampling
        assert (config["reward"]["step_weight"], config["rollout"]["overlap"]) == ((0.4, 1) if first else (0.0, 0))
        assert config["learner"]["lr"] == (2e-4 if first else 1e-4)  # --quick's lr: 1e-4
        assert (config["algo"]["ratio_level"], config["rollout"]["resample"]) == (("token", 0.0) if first else ("chunk", 0.5))
        assert set(r["success"]) == {""} and len(r["success"][""]) == 1 and r["hops"]["hop1"][1] > 0
        assert sum(n for _, n in r["kinds"].values()) == r["hops"]["hop1"][1]  # every QA episode has its kind
        assert {"token", "chunk"} == set(r["log_ratio"]) and r["rl_minutes"] > 0 and "exec" in r
    assert "/reinforcepp-step-overlap-learner.lr-2e-4-w0-s0-" in results[1]["run"]  # named after its arm and world
    assert sum(n for _, n in results[2]["resample"].values()) > 0  # some groups started from an expert prefix
    out = p.stdout.split("starts (after SFT")[1]
    assert re.search(r"world 0: qa \d\.\d\d \(4\); .*\n  world 1: qa \d\.\d\d \(4\); ", out)
    table = re.findall(r"^(\S+) +2 +\d\.\d{3} \(.*\) +[+-]\d\.\d{3} +\S+  w0 [+-]\d\.\d\d w1 [+-]\d\.\d\d +(.*)$", out, re.M)
    header = re.search(r"^arm .* per world +(.*) collapsed$", out, re.M).group(1).split()  # QA's hop columns
    assert header[:2] == ["hop1", "hop2"] and header[-3:] == ["right", "miss", "recov"]
    assert [a for a, _ in table] == arms and all(len(cols.split()) == len(header) + 1 for _, cols in table)  # + 0/2
    assert "collapsed" in out and re.search(r"^  grpo:chunk:resample w1 s0: qa ", out, re.M)
    assert "RESULT long_qa_rl_gain=" in out and "per world w0 " in out and "RESULT long_steps_per_episode=" in out
    assert (tmp_path / "rewards.png").stat().st_size > 0
    again = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    body = lambda out: out.split("starts (after SFT")[1].rsplit("\n", 2)[0]  # the table and RESULT lines, not the time
    assert again.returncode == 0 and body(again.stdout) == body(p.stdout), again.stdout[-2000:] + again.stderr[-2000:]
    assert not re.search(r"^\S+: \d+ s, ", again.stdout, re.M)  # no train.py run again: all were in results.jsonl
    # a second seed in world 0: its start evaluated again from world 0's SFT weights (as many episodes as the arm's)
    more = subprocess.run([*cmd[:6], arms[1], "--worlds", "0", "--seeds", "2", *cmd[-2:]], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert more.returncode == 0, more.stdout[-3000:] + more.stderr[-3000:]
    assert re.findall(r"^(\S+): \d+ s, ", more.stdout, re.M) == ["start-w0-s1", "grpo-chunk-resample-w0-s1"]
    start = json.loads((tmp_path / "results.jsonl").read_text().splitlines()[-2])
    assert start["arm"] == "start" and f"path: {sft[0]}" in (ROOT / start["run"] / "config.yaml").read_text()
    for r in (results[0], start):  # each start evaluated once (train.py evaluated a run.steps=0 run's last step twice)
        assert (ROOT / r["run"] / "metrics.jsonl").read_text().count('"eval/score"') == 1, r["run"]
    assert re.search(r"world 0: qa \d\.\d\d \(8\); ", more.stdout)  # the start: 2 seeds of 4 episodes
    # --sft: an SFT run's weights reused (one world); the start evaluated once per seed, greedy once (the same weights
    # decode the same episodes again), the arm's runs from those weights
    two = subprocess.run([*cmd[:6], "grpo", "--worlds", "0,1", "--sft", sft[0]], cwd=ROOT, env=_env(), capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert two.returncode == 1 and two.stderr.strip().splitlines()[-1] == \
        "ablate.py: --sft gives one start: use it with one world (--worlds)"
    reuse = subprocess.run([*cmd[:6], "grpo", "--seeds", "2", "--out", str(tmp_path / "reuse"), "--sft", sft[0],
                            "run.eval_greedy=true"], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert reuse.returncode == 0, reuse.stdout[-3000:] + reuse.stderr[-3000:]
    assert re.findall(r"^(\S+): \d+ s, ", reuse.stdout, re.M) == ["start-w0-s0", "start-w0-s1", "grpo-w0-s0", "grpo-w0-s1"]
    runs = {(r["arm"], r["seed"]): r for r in map(json.loads, (tmp_path / "reuse" / "results.jsonl").read_text().splitlines())}
    assert all(f"path: {sft[0]}" in (ROOT / r["run"] / "config.yaml").read_text() for r in runs.values())
    assert runs["start", 0]["greedy"] and runs["start", 1]["greedy"] is None and runs["grpo", 1]["greedy"]
    assert "qa, greedy, worlds 0 pooled" in reuse.stdout and "RESULT long_rl_gain_greedy=" in reuse.stdout
    assert "RESULT long_rl_gain_greedy=" not in p.stdout


def _run(arm, world, seed, qa, files, exec_rate=0.9, minutes=1.0, ratios=(0.0, 0.0), hops=None, kinds=None):
    """A made-up run record: [successes, n] per environment of its end evaluation."""
    both = [qa[0] + files[0], qa[1] + files[1]]
    return {"arm": arm, "world": world, "seed": seed, "sampled": both, "greedy": None, "steps": 5.0, "rebuilds": 0.25,
            "envs": {"qa": {"sampled": qa, "greedy": None}, "files": {"sampled": files, "greedy": None}},
            "hops": hops or {}, "exec": exec_rate, "minutes": minutes + 2, "rl_minutes": minutes, "tokens": 100,
            "rewards": [0.1, 0.2], "success": {"qa": [0.0, 0.5], "files": [0.25, None]}, "exec_per_step": [0.9, 0.8],
            "log_ratio": {"token": ratios[0], "chunk": ratios[1]}, "kinds": kinds or {}}


def test_the_table_pools_worlds_against_their_starts_and_names_what_each_option_did(tmp_path, capsys, monkeypatch):
    """By hand: starts QA 6/64 (world 0) and 10/64 (world 7); reinforce++ ends 12/64 and 14/64 (+0.094, +0.063 a
    world; pooled 26/128 against 16/128: +0.078); its :step arm 20/64 and 22/64 (step_reward_gain: 42/128 - 26/128 =
    +0.125); the overlap arms' chunk minus token (16 vs 14 of 128, mean |log ratio| token 0.02, chunk 0.01) and
    minutes (12 with overlap, 20 without); a run whose cells ran 0.3 against its start's 0.9 collapsed. An option
    `section.key=value` against the arm without it (gamma 0.95: 28/128 against 26/128), another estimator against
    reinforce++ with the same options, on the worlds both ran (grpo:step, world 7 only: 28/64 against its start's
    10/64, +0.281, and against reinforce++:step's 22/64 there); the best arm is of those that ran every world
    (reinforce++:step's +0.203 over two worlds, not grpo:step's +0.281 in one)."""
    from bench import ablate_table
    from l0_min.evaluation import two_proportion_z_test

    plots = []  # (matplotlib's import and a figure take a second: the slow test draws one)
    monkeypatch.setattr(ablate_table, "plot", lambda runs, path, title: plots.append((sorted(runs), path)))

    arms = ["reinforce++", "reinforce++:step", "reinforce++:overlap", "reinforce++:chunk:overlap",
            "reinforce++:algo.gamma=0.95", "grpo:step"]
    start_kinds = {"arithmetic 2-hop": [1, 20], "multihop 2-hop": [5, 44]}
    results = {("sft", w, 0): _run("sft", w, 0, q, f, kinds=start_kinds) for w, q, f in ((0, [6, 64], [20, 64]),
                                                                                         (7, [10, 64], [30, 64]))}
    ends = {"reinforce++": ([12, 64], [14, 64]), "reinforce++:step": ([20, 64], [22, 64]),
            "reinforce++:overlap": ([7, 64], [7, 64]), "reinforce++:chunk:overlap": ([8, 64], [8, 64]),
            "reinforce++:algo.gamma=0.95": ([14, 64], [14, 64]), "grpo:step": ([0, 64], [28, 64])}
    for arm, (q0, q7) in ends.items():
        over = "overlap" in arm
        for w, q in ((0, q0), (7, q7))[arm == "grpo:step":]:
            results[arm, w, 0] = _run(arm, w, 0, q, [25, 64], exec_rate=0.3 if (arm, w) == ("reinforce++:step", 7) else 0.9,
                                      minutes=12 if over else 20, ratios=(0.02, 0.01) if over else (0.0, 0.0),
                                      hops={"hop1": [40, 64], "hop2": [20, 48], "em": [q[0], 64]},
                                      kinds=arm == "reinforce++" and {"arithmetic 2-hop": [0, 20], "multihop 2-hop": [q[0], 44]})
    ablate_table.report(results, arms, [0, 7], 1, 1, False, 0.10, tmp_path, "made-up")
    out = capsys.readouterr().out
    assert "  world 0: files 0.31 (64), qa 0.09 (64); 5.00 steps/ep, 25% rebuilt, cells run 0.90 (1 seed(s))" in out
    qa = out.split("qa, sampled, worlds 0,7 pooled (start 0.12, 128 episodes):")[1]
    row = next(line for line in qa.splitlines() if line.startswith("reinforce++ "))
    diff, _, p = two_proportion_z_test(26, 128, 16, 128)
    assert row.split()[1:5] == ["2", "0.203", "(0.14-0.28)", f"{diff:+.3f}"] and row.split()[5] == f"{p:.2g}"
    assert "w0 +0.09 w7 +0.06" in row
    assert row.split()[-4:] == ["0.62", "0.42", "0.20", "0/2"]  # hop1 80/128, hop2 40/96, right 26/128; none collapsed
    step_row = next(line for line in qa.splitlines() if line.startswith("reinforce++:step "))
    assert step_row.endswith("1/2") and "COLLAPSED (held-out cells run 0.30, start 0.90)" in out
    assert "  reinforce++ w7 s0: qa 0.00 0.50 | files 0.25 -; cells run 0.90 0.80" in out
    kinds = out.split("qa right by question kind, worlds and seeds pooled:\n")[1].split("\n\n")[0].splitlines()
    assert [k.split(maxsplit=1) for k in kinds] == [  # the starts' two worlds, then the one arm with kinds (26: 12 + 14)
        ["start", "arithmetic 2-hop 2/40, multihop 2-hop 10/88"],
        ["reinforce++", "arithmetic 2-hop 0/40, multihop 2-hop 26/88"]]
    d, _, p = two_proportion_z_test(42, 128, 26, 128)
    assert f"RESULT step_reward_gain={d:+.3f} (reinforce++:step minus reinforce++, qa sampled, same starts, p = {p:.2g})" in out
    d, _, p = two_proportion_z_test(16, 128, 14, 128)
    assert (f"RESULT chunk_vs_token_stale={d:+.3f} (reinforce++:chunk:overlap minus reinforce++:overlap, qa sampled, same "
            f"starts, p = {p:.2g}; mean |log ratio| token 0.02, chunk 0.01)") in out
    d, _, p = two_proportion_z_test(28, 128, 26, 128)
    assert f"algo.gamma=0.95: {d:+.3f} (reinforce++:algo.gamma=0.95 minus reinforce++, qa sampled, same starts, " \
           f"p = {p:.2g})" in out
    d, _, p = two_proportion_z_test(28, 64, 22, 64)
    assert f"grpo: {d:+.3f} (grpo:step minus reinforce++:step, qa sampled, same starts, world 7 only, p = {p:.2g})" in out
    grpo = next(line for line in qa.splitlines() if line.startswith("grpo:step "))
    d, _, p = two_proportion_z_test(28, 64, 10, 64)
    assert grpo.split()[1:6] == ["1", "0.438", "(0.32-0.56)", f"{d:+.3f}", f"{p:.2g}"] and "w7 +0.28" in grpo
    assert "RESULT long_run_minutes=12.0 (reinforce++:overlap, 2 RL steps, SFT and evaluation excluded; 20.0 without " \
           "overlap) target < 20 MET" in out
    best = two_proportion_z_test(42, 128, 16, 128)
    assert f"RESULT long_qa_rl_gain={best[0]:+.3f} (arm reinforce++:step, qa sampled, 128 held-out episodes, " \
           f"p = {best[2]:.2g}; per world w0 +0.219, w7 +0.188) target >= 0.1 MET" in out
    assert "RESULT long_files_rl_gain=" in out and plots == [(sorted(arms), tmp_path / "rewards.png")]
