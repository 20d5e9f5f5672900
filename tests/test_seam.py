"""The environment seam (issue 37): the core imports no environment and nothing imports in a circle; without
qa.py the other environments still train; every mistake a forker's environment makes is one clear line."""

import ast
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from l0_min import config as configlib
from l0_min.envs import load_env
from tests.test_envs import README_ENV
from tests.test_train import ROOT, _env

PKG = ROOT / "l0_min"


def _imports(path: Path) -> set[str]:
    """The l0_min modules a file imports anywhere in it (function-level imports too), as dotted names."""
    name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from .x import y, from . import y
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            out |= {f"{base}.{a.name}" for a in node.names} | {base}
    return {m for m in out if m == "l0_min" or m.startswith("l0_min.")}


def _graph() -> dict[str, set[str]]:
    files = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p for p in PKG.rglob("*.py")}
    resolve = lambda m: m if m in files else (m.rsplit(".", 1)[0] if m.rsplit(".", 1)[0] in files else None)
    return {mod: {r for m in _imports(p) if (r := resolve(m)) and r != mod} for mod, p in files.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` (module -> modules it imports), or None."""
    state, stack = {}, []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        stack.pop()
        state[m] = 2
        return None

    return next((c for m in sorted(graph) if m not in state and (c := visit(m))), None)


def test_the_core_imports_no_environment_and_nothing_imports_in_a_circle():
    """l0_min/ outside envs/ (the seam, envs/__init__.py, included) imports no environment; an environment imports the
    seam and the core's neutral helpers, never another environment; no module imports back into its importers, at the
    top or inside a function."""
    graph = _graph()
    envs = {m for m in graph if m.startswith("l0_min.envs.")}
    assert {"l0_min.envs.qa", "l0_min.envs.math", "l0_min.envs.files"} <= envs
    core = {m: deps & envs for m, deps in graph.items() if m not in envs and deps & envs}
    assert core == {}, f"core modules import environments: {core}"
    crossing = {m: deps & envs for m, deps in graph.items() if m in envs and deps & envs}
    assert crossing == {}, f"environments import each other: {crossing}"
    assert _cycle(graph) is None, f"an import cycle: {' -> '.join(_cycle(graph))}"
    # the checks can fail: a circle and a core -> environment import are found where they are planted
    assert _cycle(graph | {"l0_min.episode": graph["l0_min.episode"] | {"l0_min.log"}}) is not None
    assert _imports(PKG / "evaluation.py") - {"l0_min.envs.qa"} == _imports(PKG / "evaluation.py")


BLOCK_QA = textwrap.dedent("""
    import runpy, sys
    class NoQA:  # qa.py as if deleted: importing it fails
        def find_spec(self, name, path=None, target=None):
            if name == "l0_min.envs.qa":
                raise ModuleNotFoundError("No module named 'l0_min.envs.qa' (blocked by the test)", name=name)
    sys.meta_path.insert(0, NoQA())
    sys.argv = ["train.py"] + sys.argv[1:]
    runpy.run_path("train.py", run_name="__main__")
""")


@pytest.mark.slow
def test_without_qa_the_math_files_and_a_module_path_environment_train_through_train_py(tmp_path):
    """Deleting qa.py leaves the other environments whole: math, files and the README's module-path environment
    train one RL step through train.py on the tiny model with l0_min.envs.qa unimportable."""
    (tmp_path / "letters_env.py").write_text(README_ENV)
    args = ["env=math", "data.train=[{source: synthetic:train}, {source: synthetic:train, env: files}, "
            "{source: 'words:train', env: letters_env}]", "data.eval=[]", "run.eval_every=-1", "sft.episodes=0",
            "run.steps=1", "rollout.batch_size=3", "rollout.n_samples=2", f"run.out_dir={tmp_path / 'runs'}"]
    env = _env() | {"PYTHONPATH": f"{tmp_path}:{ROOT}"}
    p = subprocess.run([sys.executable, "-c", BLOCK_QA, "--config", "configs/tiny_test.yaml", *args], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    header = next(line for line in p.stdout.splitlines() if line.lstrip().startswith("step  reward"))
    assert header.split()[2:5] == ["files", "letters_env", "math"], header
    assert re.search(r"^\s+1\s", p.stdout, re.M), p.stdout[-2000:]  # the RL step's row
    assert "l0_min.envs.qa" not in p.stderr
    check = subprocess.run([sys.executable, "-c", BLOCK_QA.replace('runpy.run_path("train.py", run_name="__main__")',
                                                                   "import l0_min.envs.qa")],
                           cwd=ROOT, env=env, capture_output=True, text=True)  # the blocker does block
    assert check.returncode != 0 and "blocked by the test" in check.stderr


# ---------------------------------------------------------------------------------------------
# a forker's mistakes, each one line (issue 37, section 2)


def _write_env(tmp_path, monkeypatch, name: str, source: str) -> str:
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


BASE = "from l0_min.envs import TaskEnvBase\nfrom l0_min.episode import Task\n"


@pytest.mark.parametrize("name, body, message", [
    ("no_score", BASE + textwrap.dedent("""
        class Env:
            metrics, tools, system_prompt, worked_example = ("correct",), (), "", ()
            def tasks(self, source, limit=None): return []
            def prompt(self, task): return ""
            def files(self, task): return {}
            def expert(self, task): return None
            def corpus(self, tasks): return []
        def make_env(cfg): return Env()
     """), "env 'no_score': make_env(cfg) returned Env, which lacks score() (a TaskEnv; subclass "
          "l0_min.envs.TaskEnvBase for the defaults)"),
    ("returns_none", BASE + "def make_env(cfg): return None\n",
     "env 'returns_none': make_env(cfg) returned NoneType, which lacks tasks(), prompt(), files(), score()"),
    ("raises_attribute", BASE + "def make_env(cfg): return cfg.data.no_such_field\n",
     "env 'raises_attribute': make_env(cfg) raised AttributeError: 'DataConfig' object has no attribute 'no_such_field'"),
    ("raises_key", BASE + "def make_env(cfg): return {}['missing']\n", "env 'raises_key': make_env(cfg) raised KeyError: 'missing'"),
    ("imports_missing", "import no_such_dependency\ndef make_env(cfg): pass\n",
     "env 'imports_missing': importing imports_missing failed: ModuleNotFoundError: No module named 'no_such_dependency'"),
    ("no_metrics", BASE + "class E(TaskEnvBase):\n    metrics = ()\n    def tasks(self, s, limit=None): return []\n"
                   "    def score(self, ep): return {'core': 0.0}\ndef make_env(cfg): return E(cfg)\n",
     "env 'no_metrics': metrics must name score()'s keys, the headline first; got ()"),
])
def test_an_environment_that_cannot_load_is_one_line_naming_it(tmp_path, monkeypatch, name, body, message):
    spec = _write_env(tmp_path, monkeypatch, name, body)
    with pytest.raises(ValueError) as e:
        load_env(spec, configlib.Config())
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)


def test_an_environment_gets_a_short_display_name_and_two_of_one_name_are_refused(tmp_path, monkeypatch):
    (tmp_path / "pkg_a").mkdir()
    (tmp_path / "pkg_b").mkdir()
    for pkg in ("pkg_a", "pkg_b"):
        (tmp_path / pkg / "__init__.py").write_text("")
        (tmp_path / pkg / "letters.py").write_text(README_ENV)
    monkeypatch.syspath_prepend(str(tmp_path))
    from l0_min.envs import load_sources

    env = load_env("pkg_a.letters", configlib.Config())
    assert env.name == "letters" and env.eval_metrics == env.metrics == ("correct",)
    assert env.judge_prompt("q", ["a"], "a") is None and env.report([]) == ""  # the protocol's defaults
    cfg = configlib.resolve(["data.train=[{source: 'words:train', env: pkg_a.letters}, {source: 'words:train', "
                             "env: pkg_b.letters}]"])
    with pytest.raises(ValueError, match="env 'pkg_b.letters' and env 'pkg_a.letters' are both named 'letters'"):
        load_sources(cfg.data.train, cfg)


@pytest.mark.parametrize("returned", ["{'correct': 1.0}", "{'core': 1.5}", "None", "{'core': 'yes'}"])
def test_a_score_without_a_core_in_range_is_one_line_naming_env_and_task(returned):
    from l0_min.config import RewardConfig
    from l0_min.episode import Episode, Task
    from l0_min.rewards import score_episode

    class Env:
        name = "mine"

        def score(self, ep):
            return eval(returned)

    with pytest.raises(ValueError) as e:
        score_episode(Episode(Task("t7", "q", ["a"])), RewardConfig(), Env())
    assert str(e.value) == (f"env 'mine': score() of task 't7' returned {str(eval(returned))}: expected a dict whose "
                            "'core' is a number in [0, 1]")


def test_a_headline_metric_score_never_returns_is_one_line_naming_env_and_task():
    """Issue 44: a score() without its metrics[0] was caught only where SFT ran; with sft.episodes=0 the run trained to
    exit 0 printing "-" for the metric. score_episode refuses it (the collector masks the episode, naming this)."""
    from l0_min.config import RewardConfig
    from l0_min.episode import Episode, Task
    from l0_min.rewards import score_episode

    class Env:
        name, metrics = "mine", ("correct",)

        def score(self, ep):
            return {"core": 1.0, "right": 1.0}

    with pytest.raises(ValueError) as e:
        score_episode(Episode(Task("t7", "q", ["a"])), RewardConfig(), Env())
    assert str(e.value) == "env 'mine': score() of task 't7' returned 'core', 'right': no 'correct', its headline metric (metrics[0])"


def test_a_raising_score_is_printed_once_per_cause_at_1_10_100_and_counted(caplog):
    """Issue 44: a score() that raises printed one warning per episode (the noise grew with the run): each cause
    (environment, exception) is counted in the step's metrics and printed at its 1st, 10th, 100th ... episode."""
    import logging
    from types import SimpleNamespace

    from l0_min.collect import _score
    from l0_min.config import Config
    from l0_min.episode import Episode, Task

    class Env:
        name, metrics = "mine", ("correct",)

        def score(self, ep):
            raise KeyError("gold")

    svc = SimpleNamespace(cfg=Config(), envs={"mine": Env()}, counters={})
    with caplog.at_level(logging.WARNING, logger="l0_min.collect"):
        for i in range(12):
            ep = Episode(Task(f"t{i}", "q", ["a"], env="mine"), status="answered", final_answer="a")
            _score(ep, svc)
            assert ep.masked and ep.status == "env_error" and ep.reward == 0.0
    assert svc.counters == {"score_errors/mine/KeyError": 12}
    assert [r.getMessage().split(" (")[-1] for r in caplog.records] == [
        "1 episode(s) so far of this cause, score_errors/mine/KeyError)", "10 episode(s) so far of this cause, "
        "score_errors/mine/KeyError)"]


def test_an_evaluation_of_masked_episodes_says_so():
    """Issue 44: an evaluation whose every episode was masked as an environment error printed "correct 0.0 |
    8 episodes" and no more."""
    from l0_min.evaluation import format_summary, summarize

    recs = [{"id": f"t{i}", "sample": 0, "correct": 0.0, "answered": False, "status": "env_error", "steps": 0,
             "reward": 0.0} for i in range(8)]
    line = format_summary(summarize(recs, ["correct"]) | {"unit": "episodes"})
    assert line.endswith("| 8 masked as environment errors (scored 0) | 8 episodes"), line


def _train(tmp_path, *args, timeout=600):
    return subprocess.run([sys.executable, "train.py", "--config", "configs/tiny_test.yaml", "env=letters_env",
                           "data.train=words:train", "data.eval=words:heldout", f"run.out_dir={tmp_path / 'runs'}", *args],
                          cwd=ROOT, env=_env() | {"PYTHONPATH": str(tmp_path)}, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("mistake, message", [
    ('return [f"<think>I count the letters in the file.</think>\\n<code>submit_final_answer(\'wrong\')</code>"]',
     r"train.py: error: 0 of 4 expert episodes solved their task \(sft.episodes=4\); the first, task train-\w+ of env "
     r"'letters_env': answered, answer 'wrong', gold \['\d+'\]\n"),
    ("return None", r"train.py: error: sft.episodes=4 but no training task has an expert: every expert\(task\) of env "
                    r"'letters_env' returned None \(set sft.episodes=0\)\n"),
    ("raise KeyError('word')", r"train.py: error: env 'letters_env': expert\(\) raised KeyError on task 'train-\w+': "
                               r"'word'\n"),  # issue 44: a traceback and exit 1
])
def test_an_expert_that_solves_nothing_stops_the_run_with_one_line(tmp_path, mistake, message):
    """It ended with exit 0 and "SFT: 0 expert episodes": no SFT and no RL step though both were asked for."""
    env = re.sub(r"(    def expert\(self, task.*?\n)(.*?)\n\n", lambda m: m.group(1) + f"        {mistake}\n\n", README_ENV,
                 count=1, flags=re.S)
    assert mistake in env
    (tmp_path / "letters_env.py").write_text(env)
    p = _train(tmp_path, "sft.episodes=4", "sft.steps=1", "run.eval_every=-1")
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-2000:]
    assert re.search(message, p.stderr), p.stderr[-2000:]


@pytest.mark.slow
def test_a_headline_score_never_returns_stops_an_rl_only_run_naming_it(tmp_path):
    """Issue 44: with sft.episodes=0 a score() without its metrics[0] trained to exit 0, printing "-" for the metric."""
    env = README_ENV.replace('return {"core": correct, "correct": correct}', 'return {"core": correct, "right": correct}')
    assert env != README_ENV
    (tmp_path / "letters_env.py").write_text(env)
    p = _train(tmp_path, "sft.episodes=0", "run.eval_every=-1", "run.steps=2")
    assert p.returncode == 3, p.stdout[-2000:] + p.stderr[-2000:]
    assert re.search(r"train.py: error: every episode of step 1 failed and was masked \(4 env_error\), the first: the "
                     r"environment's score\(\) raised ValueError: env 'letters_env': score\(\) of task 'train-\w+' returned "
                     r"'core', 'right': no 'correct', its headline metric \(metrics\[0\]\); stopping\n", p.stderr), p.stderr[-2000:]


@pytest.mark.slow
def test_a_step_whose_every_episode_is_masked_stops_the_run_with_its_cause(tmp_path):
    """Every episode an environment failure (here a workspace file its setup cannot write): the run stops after that
    step, naming the cause; it went on step after step, then ended with exit 0 and an untrained checkpoint."""
    env = README_ENV.replace('        return {"word.txt": task.meta["word"]}', "        return {'a': 'x', 'a/b': 'y'}")
    assert env != README_ENV
    (tmp_path / "letters_env.py").write_text(env)
    p = _train(tmp_path, "sft.episodes=0", "run.eval_every=-1", "run.steps=3", "rollout.max_retries=0")
    assert p.returncode == 3, p.stdout[-2000:] + p.stderr[-2000:]
    assert re.search(r"train.py: error: every episode of step 1 failed and was masked \(4 env_error\), the first: "
                     r"RuntimeError: setting up the workspace of task train-\w+ failed: Traceback .* \.\.\. Error: "
                     r"FileExistsError: .*; stopping\n", p.stderr), p.stderr[-2000:]
