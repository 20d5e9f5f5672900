"""Work in the sandbox's files (the ROLL team's lesson: agents in terminal-like environments). Each task has
its own workspace of generated files, written into the kernel's working directory before the first step:
logs (logs/<name>.log), CSV tables (data/<name>.csv) and a small source tree (src/<package>/<module>.py).
The question needs code over them; the answer is graded exactly (numbers by `envs.math.numbers_equal`):

    count    How many lines of logs/app.log have level ERROR and user alice?
    sum      What is the sum of the units column of data/sales.csv over the rows whose region is north?
    where    Which file defines the function max_quota?                      (a path: src/shop/billing.py)
    returns  What number does the function max_quota() in src/ return?

The long kinds name no file: the expert lists the files, opens them, computes over them all, then submits (4 or 5
steps).
Their workspaces also hold data/users.csv (each log user's team). A run gets them only where it names one, in
data.synthetic_kinds or a source's kinds (ids "files<seed>-L0001"): the short kinds' tasks and configs stay as
they were.

    most_lines      Which user has the most ERROR lines across all logs?           (a user: carol)
    largest_return  Which function in src/ returns the largest number?            (a function: max_quota)
    joined_count    How many WARN lines across all logs are from users of the otter team?   (logs joined with users.csv)

    env = make_env(cfg)
    env.tasks("synthetic:train")   # data.synthetic_seed / _tasks / _heldout / _kinds; or "synthetic:heldout"
    env.files(task)                # {relative path: text}, 5 to 10 KB

A workspace is a function of its task id (ids "files<seed>-0001"), so it is regenerated when needed and never
stored: trajectories and a task's meta stay small.

    >>> t = make_tasks(0, 4)[3]
    >>> t.id, t.meta["kind"], t.answers, sorted({p.split("/")[0] for p in workspace(t.id)})
    ('files0-0003', 'returns', ['12'], ['data', 'logs', 'src'])
"""

from __future__ import annotations

import collections
import functools
import itertools
import random
import re

from l0_min.answers import answer_reward, numbers_equal
from l0_min.envs import TaskEnvBase
from l0_min.episode import Episode, Task

KINDS = ("count", "sum", "where", "returns")
LONG_KINDS = ("most_lines", "largest_return", "joined_count")
TEAMS = ("falcon", "otter", "lynx")  # data/users.csv of a long task's workspace: each log user's team
LOGS = ("app", "worker", "api", "auth")
LOG_FIELDS = {  # every value is one space-separated word of a line, and in one field only
    "level": (("INFO", "WARN", "ERROR", "DEBUG"), (6, 2, 2, 1)),
    "user": (("alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi"), None),
    "action": (("login", "logout", "upload", "download", "delete", "search"), None),
}
TABLES = {  # path: (columns to filter on, number columns with their ranges)
    "data/sales.csv": ({"region": ("north", "south", "east", "west"), "product": ("widget", "gadget", "gizmo")},
                       {"units": (1, 40), "price": (5, 250)}),
    "data/inventory.csv": ({"site": ("berlin", "paris", "rome", "oslo"), "item": ("bolts", "nuts", "screws")},
                           {"qty": (0, 500), "cost": (1, 90)}),
    "data/staff.csv": ({"team": ("red", "blue", "green"), "role": ("dev", "ops", "qa", "pm")},
                       {"hours": (10, 60), "tickets": (0, 30)}),
}
PACKAGES = ("acme", "shop", "core", "tools", "app")
MODULES = ("config", "net", "storage", "billing", "cache", "auth", "report", "jobs")
VERBS = ("get", "compute", "load", "default", "max", "min", "total", "base")
NOUNS = ("timeout", "retries", "port", "size", "limit", "rate", "offset", "width", "depth", "budget", "quota", "delay")
CONSTS = ("RATE", "LIMIT", "BASE", "STEP", "SCALE", "UNIT", "FACTOR", "MARGIN")


# ------------------------------------------------------------------------------------ generation


def _logs(rng: random.Random) -> tuple[dict[str, str], dict[str, list[dict]]]:
    """Two log files: {path: text} and {path: [{level, user, action}] per line}."""
    files, rows = {}, {}
    for name in rng.sample(LOGS, 2):
        path, day, n = f"logs/{name}.log", rng.randint(1, 28), rng.randint(40, 90)
        cols = {f: rng.choices(values, weights, k=n) for f, (values, weights) in LOG_FIELDS.items()}
        recs = [dict(zip(cols, rec)) for rec in zip(*cols.values())]
        t = list(itertools.accumulate(rng.choices(range(1, 300), k=n), initial=rng.randint(0, 40000)))[1:]
        files[path] = "".join(f"2024-05-{day:02d} {s // 3600 % 24:02d}:{s // 60 % 60:02d}:{s % 60:02d} {r['level']} "
                              f"{r['user']} {r['action']} {ms}ms\n" for s, r, ms in zip(t, recs, rng.choices(range(3, 900), k=n)))
        rows[path] = recs
    return files, rows


def _tables(rng: random.Random) -> tuple[dict[str, str], dict[str, list[dict]]]:
    """Two CSV tables with a header: {path: text} and {path: [row as {column: str or int}]}."""
    files, rows = {}, {}
    for path in rng.sample(sorted(TABLES), 2):
        (cats, nums), n = TABLES[path], rng.randint(15, 40)
        cols = {c: rng.choices(v, k=n) for c, v in cats.items()} | {c: rng.choices(range(lo, hi + 1), k=n)
                                                                    for c, (lo, hi) in nums.items()}
        rows[path] = [dict(zip(cols, rec)) for rec in zip(*cols.values())]
        files[path] = "\n".join([",".join(cols)] + [",".join(map(str, rec)) for rec in zip(*cols.values())]) + "\n"
    return files, rows


def _source_tree(rng: random.Random) -> tuple[dict[str, str], dict[str, str], dict[str, int]]:
    """Two packages of 2-3 modules: {path: text}, {function: the file that defines it} and {function: value}
    for the functions without arguments. Each package's __init__ imports one function of each module, so a
    name alone is found in two files; `def name(` in one."""
    names = rng.sample([f"{v}_{n}" for v in VERBS for n in NOUNS], 40)
    files, where, value = {}, {}, {}
    for pkg in rng.sample(PACKAGES, 2):
        exports = []
        for mod in rng.sample(MODULES, rng.randint(2, 3)):
            path = f"src/{pkg}/{mod}.py"
            consts = {c: rng.randint(2, 20) for c in rng.sample(CONSTS, 2)}
            lines, local = [f'"""{mod.capitalize()} settings of {pkg}."""', "", *(f"{c} = {v}" for c, v in consts.items())], []
            for _ in range(rng.randint(2, 4)):
                name, (c, cv), a, b = names.pop(), rng.choice(list(consts.items())), rng.randint(2, 9), rng.randint(1, 30)
                form = rng.randrange(4 if local else 3)
                if form == 0:
                    body, v = f"return {c} * {a} + {b}", cv * a + b
                elif form == 1:
                    body, v = f"return ({c} + {b}) * {a}", (cv + b) * a
                elif form == 2:
                    body, v = f"x = {a} * {b}\n    return x - {c}", a * b - cv
                else:
                    prev = rng.choice(local)
                    body, v = f"return {prev}() + {b}", value[prev] + b
                lines += ["", "", f"def {name}():", f"    {body}"]
                local.append(name)
                where[name], value[name] = path, v
            name = names.pop()  # one function with an argument: a place to look, not a value to ask for
            lines += ["", "", f"def {name}(value):", f"    return value * {rng.choice(list(consts))}"]
            where[name] = path
            files[path] = "\n".join(lines) + "\n"
            exports.append((mod, local[0]))
        files[f"src/{pkg}/__init__.py"] = "".join(f"from .{m} import {f}\n" for m, f in exports)
    return files, where, value


def _long(rng: random.Random, files: dict[str, str], log_rows: dict[str, list[dict]], value: dict[str, int]):
    """A long task over `files` (+ data/users.csv): the first kind, in random order, whose answer is unique."""
    teams = {u: rng.choice(TEAMS) for u in LOG_FIELDS["user"][0]}
    files["data/users.csv"] = "user,team\n" + "".join(f"{u},{t}\n" for u, t in teams.items())
    lines = [r for rows in log_rows.values() for r in rows]
    for kind in rng.sample(LONG_KINDS, len(LONG_KINDS)):
        if kind == "most_lines":
            level = rng.choice(LOG_FIELDS["level"][0][:3])
            counts = collections.Counter(r["user"] for r in lines if r["level"] == level).most_common(2)
            (user, n), (_, second) = (counts + [("", 0)] * 2)[:2]
            if n > second:
                return kind, f"Which user has the most {level} lines across all logs?", user, {"level": level}
        elif kind == "largest_return":
            (top, n), (_, second) = sorted(value.items(), key=lambda kv: -kv[1])[:2]
            if second < n:
                return kind, "Which function in src/ returns the largest number?", top, {}
        else:  # a level and a team of one line: at least one line counts
            r = rng.choice(lines)
            team, level = teams[r["user"]], r["level"]
            n = sum(x["level"] == level and teams[x["user"]] == team for x in lines)
            return (kind, f"How many {level} lines across all logs are from users of the {team} team?", n,
                    {"level": level, "team": team})
    raise AssertionError("joined_count always has an answer")


@functools.lru_cache(maxsize=256)
def _generate(task_id: str) -> tuple[dict[str, str], str, str, str, dict]:
    """The task's workspace, kind, question, gold answer and meta: a function of the id alone."""
    rng = random.Random(f"l0-files-{task_id}")
    (logs, log_rows), (tables, table_rows) = _logs(rng), _tables(rng)
    src, where, value = _source_tree(rng)
    if task_id.rsplit("-", 1)[-1].startswith("L"):  # a long task: the same generators, then its own question
        files = logs | tables | src
        kind, question, gold, meta = _long(rng, files, log_rows, value)
        return files, kind, question, str(gold), meta
    kind = rng.choice(KINDS)
    if kind == "count":
        path = rng.choice(sorted(logs))
        row = rng.choice(log_rows[path])  # the question's values are of one line: at least one matches
        fields = sorted(rng.sample(sorted(LOG_FIELDS), rng.randint(1, 2)), key=list(LOG_FIELDS).index)
        question = f"How many lines of {path} have " + " and ".join(f"{f} {row[f]}" for f in fields) + "?"
        gold = sum(all(r[f] == row[f] for f in fields) for r in log_rows[path])
        meta = {"file": path, "terms": [row[f] for f in fields]}
    elif kind == "sum":
        path = rng.choice(sorted(tables))
        cats, nums = TABLES[path]
        col, by, row = rng.choice(list(nums)), rng.choice(list(cats)), rng.choice(table_rows[path])
        question = f"What is the sum of the {col} column of {path} over the rows whose {by} is {row[by]}?"
        gold = sum(r[col] for r in table_rows[path] if r[by] == row[by])
        meta = {"file": path, "column": col, "where": [by, row[by]]}
    elif kind == "where":
        name = rng.choice(sorted(where))
        question, gold, meta = f"Which file defines the function {name}?", where[name], {"function": name}
    else:
        name = rng.choice(sorted(value))
        question, gold = f"What number does the function {name}() in src/ return?", value[name]
        meta = {"function": name, "file": where[name]}
    return logs | tables | src, kind, question, str(gold), meta


def workspace(task_id: str) -> dict[str, str]:
    return _generate(task_id)[0]


@functools.cache
def _question(task_id: str) -> tuple[str, str, str, dict]:  # a task without its files (a train and an eval source)
    return _generate(task_id)[1:]


def make_tasks(seed: int, n_tasks: int, long: bool = False) -> list[Task]:
    """`n_tasks` tasks "files<seed>-0000", ... (long: of the long kinds, "files<seed>-L0000", ...); the first k do
    not depend on n_tasks."""
    tasks = []
    for i in range(n_tasks):
        kind, question, gold, meta = _question(task_id := f"files{seed}-{'L' * long}{i:04d}")
        tasks.append(Task(task_id, question, [gold], {"kind": kind, "seed": seed, "source": "files"} | meta))
    return tasks


def normalize_path(s: str | None) -> str:
    """A submitted path as the grader compares it: no whitespace, quotes, leading "./" or "/workspace/".

    >>> normalize_path(" './src/a/b.py' "), normalize_path("/workspace/src/a/b.py"), normalize_path(None)
    ('src/a/b.py', 'src/a/b.py', '')
    """
    s = (s or "").strip().strip("'\"`").strip()
    return re.sub(r"^(?:\./|/workspace/)+", "", s)


# ---- the expert: a scripted solver that writes real NB-Agent steps (the SFT cold start's episodes)


def expert_actions(task: Task) -> list[str]:
    """One step: the <think> states the plan, the cell computes the answer over the files and submits it.
    The kinds share their code's shape (count and sum: `n = sum(...)`; where and returns: the file with
    `def name(` as `path`), so a small model learns four patterns as two.

    >>> for kind in KINDS: print(expert_actions(next(t for t in make_tasks(0, 20) if t.meta["kind"] == kind))[0])
    <think>I count the lines of logs/api.log that contain " delete ", and submit the count.</think>
    <code>n = sum(1 for line in open("logs/api.log") if " delete " in line)
    submit_final_answer(str(n))</code>
    <think>I add up the tickets column of data/staff.csv over the rows whose role is dev, and submit the sum.</think>
    <code>import csv
    n = sum(int(r["tickets"]) for r in csv.DictReader(open("data/staff.csv")) if r["role"] == "dev")
    submit_final_answer(str(n))</code>
    <think>I find the .py file under src that contains "def compute_limit(", and submit its path.</think>
    <code>import glob
    path = [p for p in glob.glob("src/*/*.py") if "def compute_limit(" in open(p).read()][0]
    submit_final_answer(path)</code>
    <think>I find the .py file under src that contains "def min_timeout(", run it, and submit what min_timeout() returns.</think>
    <code>import glob
    path = [p for p in glob.glob("src/*/*.py") if "def min_timeout(" in open(p).read()][0]
    exec(open(path).read())
    submit_final_answer(str(min_timeout()))</code>
    """
    m = task.meta
    if m["kind"] in LONG_KINDS:
        return long_expert_actions(task)
    if m["kind"] == "count":
        terms, test = (" and ".join(f'" {t} "{s}' for t in m["terms"]) for s in ("", " in line"))
        think = f"I count the lines of {m['file']} that contain {terms}, and submit the count."
        code = f'n = sum(1 for line in open("{m["file"]}") if {test})\nsubmit_final_answer(str(n))'
    elif m["kind"] == "sum":
        (by, val), col = m["where"], m["column"]
        think = f"I add up the {col} column of {m['file']} over the rows whose {by} is {val}, and submit the sum."
        code = (f'import csv\nn = sum(int(r["{col}"]) for r in csv.DictReader(open("{m["file"]}")) if r["{by}"] == "{val}")'
                "\nsubmit_final_answer(str(n))")
    else:
        f = m["function"]
        find = f'import glob\npath = [p for p in glob.glob("src/*/*.py") if "def {f}(" in open(p).read()][0]\n'
        think = f'I find the .py file under src that contains "def {f}(", ' + (
            "and submit its path." if m["kind"] == "where" else f"run it, and submit what {f}() returns.")
        code = find + ("submit_final_answer(path)" if m["kind"] == "where"
                       else f"exec(open(path).read())\nsubmit_final_answer(str({f}()))")
    return [f"<think>{think}</think>\n<code>{code}</code>"]


def long_expert_actions(task: Task) -> list[str]:
    """A long task step by step: list the files, open them (the logs as lists of words; the modules run), compute
    and print, submit; the join reads data/users.csv in a step of its own (4 steps; the join 5).

    >>> for a in long_expert_actions(make_tasks(0, 1, long=True)[0]): print(a)
    <think>I list the files.</think>
    <code>import glob
    print(sorted(glob.glob("*/*")))</code>
    <think>I read the lines of every log as lists of words.</think>
    <code>lines = [line.split() for p in glob.glob("logs/*.log") for line in open(p)]
    print(len(lines), lines[0])</code>
    <think>The user is word 3, the level word 2. I count the INFO lines of each user.</think>
    <code>from collections import Counter
    c = Counter(w[3] for w in lines if w[2] == "INFO")
    print(c.most_common(3))</code>
    <think>bob has the most INFO lines. I submit bob.</think>
    <code>submit_final_answer(c.most_common(1)[0][0])</code>
    """
    m, gold = task.meta, task.answers[0]
    listing = ("I list the files.", 'import glob\nprint(sorted(glob.glob("*/*")))')
    logs = ("I read the lines of every log as lists of words.", 'lines = [line.split() for p in glob.glob("logs/*.log") '
            "for line in open(p)]\nprint(len(lines), lines[0])")
    if m["kind"] == "most_lines":
        steps = [listing, logs,
                 (f"The user is word 3, the level word 2. I count the {m['level']} lines of each user.",
                  f'from collections import Counter\nc = Counter(w[3] for w in lines if w[2] == "{m["level"]}")\n'
                  "print(c.most_common(3))"),
                 (f"{gold} has the most {m['level']} lines. I submit {gold}.", "submit_final_answer(c.most_common(1)[0][0])")]
    elif m["kind"] == "largest_return":
        steps = [("I list the modules under src.", 'import glob\nprint(sorted(glob.glob("src/*/*.py")))'),
                 ("I run each module but __init__ and keep its functions.", 'fns = {}\nfor p in glob.glob('
                  '"src/*/[!_]*.py"):\n    ns = {}\n    exec(open(p).read(), ns)\n    fns |= ns\nprint(list(fns))'),
                 ("I call each function without arguments and find the largest number.", "vals = {k: f() for k, f in "
                  "fns.items() if callable(f) and not f.__code__.co_argcount}\ntop = max(vals, key=vals.get)\n"
                  "print(top, vals[top])"),
                 (f"{gold} returns the largest number. I submit {gold}.", "submit_final_answer(top)")]
    else:
        steps = [listing, logs,
                 ("I read each user's team from data/users.csv.", 'import csv\nteam = {r["user"]: r["team"] for r in '
                  'csv.DictReader(open("data/users.csv"))}\nprint(team)'),
                 (f"I count the {m['level']} lines of users in the {m['team']} team.",
                  f'n = sum(1 for w in lines if w[2] == "{m["level"]}" and team[w[3]] == "{m["team"]}")\nprint(n)'),
                 (f"The count is {gold}. I submit it.", "submit_final_answer(str(n))")]
    return [f"<think>{think}</think>\n<code>{code}</code>" for think, code in steps]


# ------------------------------------------------------------------------------- the environment

SYSTEM_PROMPT = """\
You answer questions about the files in the working directory (logs/, CSV tables in data/, Python code in \
src/) by writing Python. Each step, write <think>...</think> then one <code>...</code> cell; you see its \
output. submit_final_answer(answer) ends the task with a short answer."""

# One solved task as earlier chat turns (agent.worked_example).
WORKED_EXAMPLE = (
    {"role": "user", "content": "Task: How many lines of logs/web.log have level WARN?\nYou have 3 steps."},
    {"role": "assistant", "content": "<think>I count the lines of logs/web.log that contain \" WARN \", and submit the "
                                     "count.</think>\n<code>n = sum(1 for line in open(\"logs/web.log\") if \" WARN \" in "
                                     "line)\nsubmit_final_answer(str(n))</code>"},
)  # fmt: skip


class Files(TaskEnvBase):
    metrics = ("correct",)
    system_prompt, worked_example = SYSTEM_PROMPT, WORKED_EXAMPLE

    def synthetic(self, seed: int, n: int) -> list[Task]:
        d = self.cfg.data
        tasks = make_tasks(seed, n)
        if set(LONG_KINDS) & set(d.synthetic_kinds).union(*(s.kinds for s in d.train + d.eval)):
            tasks += make_tasks(seed, n, long=True)  # named by the run: see above
        return tasks

    def files(self, task: Task) -> dict[str, str]:
        return workspace(task.id)

    def score(self, ep: Episode) -> dict[str, float]:
        """0.9 * correct + 0.1 * answered (reward.em_weight, has_answer_weight); a path by `normalize_path`."""
        r, pred, gold = self.cfg.reward, ep.final_answer, ep.task.answers[0]
        if ep.task.meta["kind"] in ("where", "most_lines", "largest_return"):  # a path or a name ("top()" too)
            correct = float(pred is not None and normalize_path(pred).removesuffix("()") == normalize_path(gold))
        else:
            correct = float(numbers_equal(pred, gold))
        return {"core": answer_reward(pred, correct, r.em_weight, r.has_answer_weight), "correct": correct}

    def expert(self, task: Task) -> list[str]:
        return expert_actions(task)


def make_env(cfg) -> Files:
    return Files(cfg)
