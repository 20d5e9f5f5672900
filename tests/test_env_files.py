"""The files environment (l0_min/envs/files.py): its generator, grader and expert, and episodes through the
real kernels with the hidden setup cell."""

import collections
import csv
import inspect
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from l0_min import config
from l0_min.collect import setup_cells
from l0_min.envs import load_env, load_sources
from l0_min.envs.files import LONG_KINDS, expert_actions, make_tasks, normalize_path, workspace
from l0_min.episode import Episode, Task

ROOT = Path(__file__).resolve().parents[1]
EXPERT_STEPS = {"most_lines": 4, "largest_return": 4, "joined_count": 5}  # the long kinds' (a short kind's: 1)


def env_of(*overrides):
    cfg = config.resolve(["env=files", *overrides])
    return load_env("files", cfg)


def test_tasks_are_seeded_and_split_by_id():
    env = env_of()
    train, held, every = env.tasks("synthetic:train"), env.tasks("synthetic:heldout"), env.tasks("synthetic")
    assert len(every) == 256 and {t.id for t in train} | {t.id for t in held} == {t.id for t in every}
    assert not {t.id for t in train} & {t.id for t in held} and 0.1 < len(held) / 256 < 0.3  # synthetic_heldout 0.2
    assert [t.question for t in env_of().tasks("synthetic:train")] == [t.question for t in train]  # seeded
    assert every[1].id == "files0-0001"
    other = env_of("data.synthetic_seed=1").tasks("synthetic")
    assert other[0].id == "files1-0000" and [t.question for t in other] != [t.question for t in every]
    assert [t.id for t in make_tasks(0, 10)] == [t.id for t in every[:10]]  # the first k do not depend on n
    assert {t.meta["kind"] for t in every} == {"count", "sum", "where", "returns"}
    assert {t.meta["kind"] for t in env_of("data.synthetic_kinds=[sum]").tasks("synthetic:heldout", 5)} == {"sum"}
    assert len(env.tasks("synthetic:train", 7)) == 7
    with pytest.raises(ValueError, match="expected synthetic, synthetic:train or synthetic:heldout, got 'hotpotqa'"):
        env.tasks("hotpotqa")


def test_long_tasks_come_only_where_a_run_names_their_kinds_seeded_and_split_by_id():
    """The long kinds' tasks have ids of their own ("files0-L0001"): a run that names none of them (every
    config before them) gets the short tasks exactly as before; one that names them, in data.synthetic_kinds or
    a source's kinds, gets them after the short ones, with workspaces that also hold data/users.csv."""
    long_kinds = "data.synthetic_kinds=[most_lines,largest_return,joined_count]"
    every = env_of(long_kinds).tasks("synthetic")
    train, held = env_of(long_kinds).tasks("synthetic:train"), env_of(long_kinds).tasks("synthetic:heldout")
    assert len(every) == 256 and every[1].id == "files0-L0001"
    assert {t.id for t in train} | {t.id for t in held} == {t.id for t in every}
    assert not {t.id for t in train} & {t.id for t in held} and 0.1 < len(held) / 256 < 0.3
    assert {t.meta["kind"] for t in every} == {"most_lines", "largest_return", "joined_count"}
    assert [t.question for t in make_tasks(0, 10, long=True)] == [t.question for t in every[:10]]  # the first k
    other = env_of(long_kinds, "data.synthetic_seed=1").tasks("synthetic")
    assert [t.question for t in other] != [t.question for t in every]
    both = env_of("data.synthetic_kinds=[count,sum,where,returns,joined_count]").tasks("synthetic")
    assert [t.question for t in both[:256]] == [t.question for t in env_of().tasks("synthetic")]  # the short, unchanged
    assert {t.meta["kind"] for t in both[256:]} == {"joined_count"}
    cfg = config.resolve(["env=files", "data.train=[{source: synthetic:train, kinds: [largest_return]}, "
                          "{source: synthetic:train, kinds: [sum]}]"])
    (long, short), _, _ = load_sources(cfg.data.train, cfg)  # a source's kinds name them too
    assert {t.meta["kind"] for t in long} == {"largest_return"} and {t.meta["kind"] for t in short} == {"sum"}
    assert set(workspace(every[0].id)) - set(workspace(env_of().tasks("synthetic")[0].id)) >= {"data/users.csv"}


def _recount(files: dict[str, str], t: Task) -> str:
    """The task's answer recomputed from the files alone, by other code than the generator's."""
    q = t.question
    lines = [line.split(" ") for path, text in files.items() if path.startswith("logs/") for line in text.splitlines()]
    if m := re.fullmatch(r"Which user has the most (\w+) lines across all logs\?", q):
        (first, n), (_, second) = collections.Counter(w[3] for w in lines if w[2] == m.group(1)).most_common(2)
        assert n > second, t  # one answer
        return first
    if q == "Which function in src/ returns the largest number?":
        values = {}
        for path, text in files.items():
            if path.startswith("src/") and not path.endswith("__init__.py"):
                exec(text, scope := {})
                values |= {k: f() for k, f in scope.items()
                           if inspect.isfunction(f) and not inspect.signature(f).parameters}
        (first, n), (_, second) = sorted(values.items(), key=lambda kv: kv[1], reverse=True)[:2]
        assert n > second, t
        return first
    if m := re.fullmatch(r"How many (\w+) lines across all logs are from users of the (\w+) team\?", q):
        team = dict(line.split(",") for line in files["data/users.csv"].splitlines()[1:])
        return str(sum(w[2] == m.group(1) and team[w[3]] == m.group(2) for w in lines))
    if m := re.fullmatch(r"How many lines of (\S+) have (.+)\?", q):
        conds = dict(c.split(" ") for c in m.group(2).split(" and "))
        field = {"level": 2, "user": 3, "action": 4}  # date time LEVEL user action duration
        return str(sum(all(line.split(" ")[field[k]] == v for k, v in conds.items())
                       for line in files[m.group(1)].splitlines()))
    if m := re.fullmatch(r"What is the sum of the (\w+) column of (\S+) over the rows whose (\w+) is (\w+)\?", q):
        col, path, by, val = m.groups()
        return str(sum(int(r[col]) for r in csv.DictReader(io.StringIO(files[path])) if r[by] == val))
    m = re.fullmatch(r"Which file defines the function (\w+)\?|What number does the function (\w+)\(\) in src/ return\?", q)
    name = m.group(1) or m.group(2)
    defining = [p for p, text in files.items() if re.search(rf"^def {name}\(", text, re.MULTILINE)]
    assert len(defining) == 1, (t.id, defining)
    if m.group(1):
        return defining[0]
    scope: dict = {}
    exec(files[defining[0]], scope)  # a module stands alone: no imports of the others
    return str(scope[name]())


def test_every_gold_follows_from_the_generated_files():
    tasks = make_tasks(3, 200)
    for t in tasks + make_tasks(3, 100, long=True):
        files = workspace(t.id)
        assert _recount(files, t) == t.answers[0], t
        assert 2_000 < sum(map(len, files.values())) < 20_000 and len(setup_cells(files)) == 1  # small; valid paths
        if t.meta["kind"] in ("count", "joined_count"):
            assert int(t.answers[0]) >= 1  # the question's values come from a line
    assert workspace(tasks[5].id) == workspace(make_tasks(3, 6)[5].id)  # regenerated, the same


def test_a_function_name_alone_is_in_two_files():
    """The package's __init__ imports it: only `def name(` finds where it is defined."""
    t = next(t for t in make_tasks(0, 200) if t.meta["kind"] == "where" and
             sum(t.meta["function"] in text for text in workspace(t.id).values()) > 1)
    assert sum(f"def {t.meta['function']}(" in text for text in workspace(t.id).values()) == 1


def ep_of(task: Task, answer):
    return Episode(task, final_answer=answer)


def test_grader_numbers_and_paths():
    env = env_of()
    num = Task("n", "How many?", ["37"], {"kind": "returns"})
    path = Task("p", "Which file?", ["src/acme/net.py"], {"kind": "where"})
    for answer, correct in (("37", 1), ("37.0", 1), ("37 lines", 1), (" 37\n", 1), ("38", 0), ("37 or 38", 0)):
        assert env.score(ep_of(num, answer)) == {"core": 0.9 * correct + 0.1, "correct": correct}, answer
    for answer, correct in (("src/acme/net.py", 1), ("./src/acme/net.py", 1), (" 'src/acme/net.py' ", 1),
                            ("/workspace/src/acme/net.py", 1), ("src/acme/config.py", 0), ("net.py", 0),
                            ("['src/acme/net.py']", 0)):
        assert env.score(ep_of(path, answer)) == {"core": 0.9 * correct + 0.1, "correct": correct}, answer
    for kind, gold in (("most_lines", "carol"), ("largest_return", "max_quota")):  # a name, quoted or called
        name = Task("u", "Which?", [gold], {"kind": kind})
        for answer, correct in ((gold, 1), (f" '{gold}'", 1), (f"{gold}()", 1), ("alice", 0), (f"{gold} and bob", 0)):
            assert env.score(ep_of(name, answer))["correct"] == correct, answer
    for task in (num, path):  # nothing submitted earns nothing
        assert env.score(ep_of(task, None)) == env.score(ep_of(task, "  ")) == {"core": 0.0, "correct": 0.0}
    weighted = env_of("reward.em_weight=0.7", "reward.has_answer_weight=0.3")
    assert weighted.score(ep_of(num, "37"))["core"] == 1.0 and weighted.score(ep_of(num, "1"))["core"] == 0.3
    assert env.metrics == ("correct",) and env.tools == () and "working directory" in env.system_prompt
    assert normalize_path("./src/a.py") == "src/a.py"


def test_the_expert_code_solves_tasks_of_every_kind_on_the_host(tmp_path, monkeypatch):
    """Its cells, run in order in one namespace in a folder holding the workspace (the kernel does the same
    below for a few tasks): each task's submitted answer is graded correct; a long task's in 4 cells (the join 5)."""
    env = env_of()
    for t in make_tasks(0, 60) + make_tasks(0, 30, long=True):
        folder = tmp_path / t.id
        for path, text in workspace(t.id).items():
            (folder / path).parent.mkdir(parents=True, exist_ok=True)
            (folder / path).write_text(text)
        monkeypatch.chdir(folder)
        submitted = []
        scope = {"submit_final_answer": submitted.append}
        for action in expert_actions(t):
            assert action.startswith("<think>") and action.count("<code>") == 1
            exec(action.split("<code>")[1].removesuffix("</code>"), scope)
        assert len(submitted) == 1 and env.score(ep_of(t, submitted[0]))["correct"] == 1.0, (t, submitted)
        assert len(expert_actions(t)) == EXPERT_STEPS.get(t.meta["kind"], 1)


# A module-path environment around Files (`env=probed_files`): the expert first looks at the sandbox (the
# workspace's files, whether web_search is in the namespace), and some tasks' files do not fit the workspace. Its
# tasks: the first 8 training tasks and a long task of each long kind.
PROBED = '''
from l0_min.envs.files import Files, make_tasks

TOO_BIG = {too_big!r}
LONG = {long!r}


class Probed(Files):
    def tasks(self, source, limit=None):
        return super().tasks(source, 8) + [t for t in make_tasks(0, 20, long=True) if t.id in LONG]

    def files(self, task):
        return super().files(task) | ({{"data/big.txt": "x" * 2_000_000}} if task.id in TOO_BIG else {{}})

    def expert(self, task):
        look = '<think>I look at the workspace.</think>\\n<code>import os\\n' \\
               'print(sorted(os.listdir()), sorted(os.listdir("src")) != [], "web_search" in dir())</code>'
        return [look] + super().expert(task)


def make_env(cfg):
    return Probed(cfg)
'''


@pytest.fixture(scope="module")
def probed_run(tmp_path_factory):
    """`rollout.py --expert` over 8 training tasks and 3 long ones through bwrap'd kernels with a 1 MB workspace;
    the files of up to 3 of the 8 (not the first of each kind) are too big for it. Returns (episodes, too-big ids)."""
    tasks = env_of().tasks("synthetic:train", 8)
    first = {next(t.id for t in tasks if t.meta["kind"] == kind) for kind in ("count", "sum", "where", "returns")}
    too_big = set(sorted(t.id for t in tasks if t.id not in first)[:3])
    long = {next(t.id for t in make_tasks(0, 20, long=True) if t.meta["kind"] == kind) for kind in LONG_KINDS}
    tasks += [t for t in make_tasks(0, 20, long=True) if t.id in long]
    tmp = tmp_path_factory.mktemp("files")
    (tmp / "probed_files.py").write_text(PROBED.format(too_big=too_big, long=long))
    args = ["rollout.py", "--expert", "--data", "synthetic:train", "--model", "tiny-random", "--out", str(tmp / "out"),
            "env=probed_files", "kernel.pool_size=2", "sandbox.workspace_mb=1", "rollout.max_retries=1"]
    p = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": f"{tmp}{os.pathsep}{ROOT}"})
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    eps = [json.loads(line) for line in (tmp / "out" / "trajectories.jsonl").read_text().splitlines()]
    assert sorted(e["task"]["id"] for e in eps) == [t.id for t in tasks]
    return eps, too_big


@pytest.mark.slow
def test_rollout_expert_solves_tasks_in_the_sandbox_workspace(probed_run):
    """The hidden setup cell wrote the files into the kernel's working directory and took web_search out
    of the namespace; the expert computed every answer from them, in code, through the real kernel: a short
    task in one step after the look, a long one in four or five (list, open, compute, submit)."""
    eps, too_big = probed_run
    solved = [e for e in eps if e["task"]["id"] not in too_big]
    assert {e["task"]["meta"]["kind"] for e in solved} == {"count", "sum", "where", "returns", *LONG_KINDS}
    for e in solved:
        assert e["status"] == "answered" and e["rewards"]["correct"] == 1.0, e
        assert len(e["steps"]) == 1 + EXPERT_STEPS.get(e["task"]["meta"]["kind"], 1)
        assert "['data', 'logs', 'src'] True False" in e["steps"][0]["observation"], e["steps"][0]
        assert all(s["exec_ok"] for s in e["steps"]) and e["final_answer"] == e["task"]["answers"][0]


@pytest.mark.slow
def test_a_workspace_that_cannot_be_written_is_an_environment_failure(probed_run):
    """Files over the sandbox's workspace size: retried, then masked; the agent took no step."""
    eps, too_big = probed_run
    failed = [e for e in eps if e["task"]["id"] in too_big]
    assert len(failed) == len(too_big) == 3
    for e in failed:
        assert e["status"] == "env_error" and e["masked"] and e["steps"] == [], e
        assert f"setting up the workspace of task {e['task']['id']} failed" in e["error"], e["error"]
        assert "No space left on device" in e["error"], e["error"]
