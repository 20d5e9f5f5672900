"""Task environments: what the agent is asked, which host tools its kernel gets, what its workspace holds,
and how an episode is scored. The agent loop, the collector, the learner and the logs know nothing more.

    env = load_env("math", cfg)              # a built-in name (qa | math | files) or a module "my_pkg.my_env"
    tasks = env.tasks("synthetic:train")     # Task(env="math", ...): each task names its environment
    load_sources(cfg.data.train, cfg)        # several sources, each with its environment and weight

A module is an environment when it defines `make_env(cfg) -> TaskEnv` (`TaskEnvBase` has the defaults; README
"Write your own environment").
"""

from __future__ import annotations

import importlib
from typing import Protocol

from l0_min.answers import split
from l0_min.config import check
from l0_min.episode import Episode, Task

BUILTIN = ("qa", "math", "files")
SEARCH_TOOLS = ("web_search", "read_page")  # the host tools a kernel may be given (submit_final_answer: always)


class TaskEnv(Protocol):
    name: str  # what tables show and tasks carry in Task.env (default: the module's last part)
    metrics: tuple[str, ...]  # score() keys the tables print; the first is the headline, 0 or 1 per episode
    eval_metrics: tuple[str, ...]  # what evaluate.py reports, the headline first (default: metrics)
    tools: tuple[str, ...]  # host tools the kernel may call, from SEARCH_TOOLS ((): none)
    system_prompt: str
    worked_example: tuple[dict, ...]  # one solved task as earlier chat turns (agent.worked_example)

    def tasks(self, source: str, limit: int | None = None) -> list[Task]: ...
    def prompt(self, task: Task) -> str: ...  # the task's user message (the agent adds the step budget)
    def files(self, task: Task) -> dict[str, str]: ...  # written into the workspace before the first cell
    def score(self, ep: Episode) -> dict[str, float]: ...  # "core" in [0, 1] (the answer reward) and metrics
    def expert(self, task: Task) -> list[str] | None: ...  # a scripted solver's actions (SFT), or None
    def corpus(self, tasks: list[Task]) -> list[dict]: ...  # documents the search tools serve ({id, title, text})
    def judge_prompt(self, question: str, golds: list[str], prediction: str | None) -> str | None: ...  # evaluate.py --judge-url
    def report(self, summaries: list[dict]) -> str: ...  # evaluate.py: tables of its own (QA: the papers' layout)
    def step_rewards(self, ep: Episode) -> list[float]: ...  # optional: one per step of ep.steps (rewards.score_episode)


REQUIRED = ("tasks", "prompt", "files", "score", "expert", "corpus", "metrics", "tools", "system_prompt", "worked_example")


class TaskEnvBase:
    """Defaults for a TaskEnv: no tools, files, expert, corpus, judge or step rewards; the prompt is the question."""

    name, metrics, eval_metrics, tools, worked_example = "", ("correct",), (), (), ()
    system_prompt = """\
You solve tasks by writing Python in a Jupyter notebook. Each step, write your reasoning in <think>...</think>, \
then one code cell in <code>...</code>. The cell runs in a persistent kernel and you get its output in \
<output>...</output>. Call submit_final_answer(answer) with a short final answer: only this ends the task."""

    def __init__(self, cfg=None):
        self.cfg = cfg

    def tasks(self, source: str, limit: int | None = None) -> list[Task]:
        """The one rule for "synthetic[:train|:heldout]": `synthetic(seed, n)` of data.synthetic_seed and _tasks, its
        train or held-out part (data.synthetic_heldout, by a hash of the id), data.synthetic_kinds kept, the first
        `limit`; any other source is the environment's `load(source, limit)` (a file or benchmark it reads)."""
        name, _, part = source.partition(":")
        if name != "synthetic":
            return self.load(source, limit)
        if part not in ("", "train", "heldout"):
            raise ValueError(f"expected synthetic, synthetic:train or synthetic:heldout, got {source!r}")
        d = self.cfg.data
        tasks = self.synthetic(d.synthetic_seed, d.synthetic_tasks)
        tasks = split(tasks, d.synthetic_heldout)[part == "heldout"] if part else tasks
        return [t for t in tasks if not d.synthetic_kinds or t.meta.get("kind") in d.synthetic_kinds][:limit]

    def synthetic(self, seed: int, n: int) -> list[Task]:
        raise ValueError("this environment generates no synthetic tasks")

    def load(self, source: str, limit: int | None = None) -> list[Task]:
        raise ValueError(f"expected synthetic, synthetic:train or synthetic:heldout, got {source!r}")

    def prompt(self, task: Task) -> str:
        return f"Task: {task.question}"

    def files(self, task: Task) -> dict[str, str]: return {}  # noqa: E704
    def expert(self, task: Task) -> list[str] | None: return None  # noqa: E704
    def corpus(self, tasks: list[Task]) -> list[dict]: return []  # noqa: E704
    def judge_prompt(self, question: str, golds: list[str], prediction: str | None) -> str | None: return None  # noqa: E704
    def report(self, summaries: list[dict]) -> str: return ""  # noqa: E704
    def step_rewards(self, ep: Episode) -> list[float]: return [0.0] * len(ep.steps)  # noqa: E704


def load_env(spec: str, cfg) -> TaskEnv:
    """The environment named `spec`: a built-in (l0_min/envs/<spec>.py) or any importable module path; its
    `make_env(cfg)`, checked against the TaskEnv protocol. The run's own env (cfg.env) takes
    `agent.system_prompt` when that is set. Every mistake is one ValueError naming the environment."""
    module = f"l0_min.envs.{spec}" if spec in BUILTIN else spec
    try:
        mod = importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 -- a bug in the module: its own exception, in one line
        if isinstance(e, ModuleNotFoundError) and e.name and module.startswith(e.name):  # it (or its package) is missing
            raise ValueError(f"env {spec!r}: no module {e.name!r} (built-in: {', '.join(BUILTIN)}, or a module path "
                             "on PYTHONPATH that defines make_env(cfg))") from None
        raise ValueError(f"env {spec!r}: importing {module} failed: {type(e).__name__}: {e}") from None
    if not callable(make := getattr(mod, "make_env", None)):
        raise ValueError(f"env {spec!r}: module {module} defines no make_env(cfg)")
    try:
        env = make(cfg)
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"env {spec!r}: make_env(cfg) raised {type(e).__name__}: {e}") from None
    if missing := [a for a in REQUIRED if not hasattr(env, a)]:
        raise ValueError(f"env {spec!r}: make_env(cfg) returned {type(env).__name__}, which lacks "
                         f"{', '.join(a + '()' if a in REQUIRED[:6] else a for a in missing)} (a TaskEnv; subclass "
                         "l0_min.envs.TaskEnvBase for the defaults)")  # fmt: skip
    if not env.metrics or not all(isinstance(m, str) for m in env.metrics):
        raise ValueError(f"env {spec!r}: metrics must name score()'s keys, the headline first; got {env.metrics!r}")
    env.name = getattr(env, "name", "") or spec.rsplit(".", 1)[-1]
    env.eval_metrics = tuple(getattr(env, "eval_metrics", ()) or env.metrics)
    for hook, default in [(h, getattr(TaskEnvBase, h)) for h in ("judge_prompt", "report", "step_rewards")]:
        if not hasattr(env, hook):
            setattr(env, hook, default.__get__(env))
    if bad := set(env.tools) - set(SEARCH_TOOLS):
        raise ValueError(f"env {spec!r}: unknown host tools {sorted(bad)} (known: {', '.join(SEARCH_TOOLS)})")
    if spec == cfg.env and cfg.agent.system_prompt:
        env.system_prompt = cfg.agent.system_prompt
    return env


def settings(cfg, name: str, cls):
    """Environment `name`'s settings: config `envs.<name>` (a mapping) read into the dataclass `cls` (its defaults
    for what is not set); an unknown key or a wrong type is a ConfigError naming `envs.<name>.<key>`."""
    return check(cfg.envs.get(name, {}) if cfg is not None else {}, cls, f"envs.{name}")


def solved(ep: Episode, env: TaskEnv) -> bool:
    """The one definition of a solved episode: its environment's headline metric is 1."""
    return float(ep.rewards.get(env.metrics[0], 0.0)) == 1.0


def load_sources(sources, cfg, limit: int | None = None) -> tuple[list[list[Task]], list[float], dict[str, TaskEnv]]:
    """Each source's tasks (tagged with their environment), the sources' weights, the environments by name."""
    envs, names, parts = {}, {}, []  # name -> environment (tasks carry its name); spec -> name
    for s in sources:
        spec = s.env or cfg.env
        if spec not in names:
            env = load_env(spec, cfg)
            if env.name in envs:
                other = next(k for k, n in names.items() if n == env.name)
                raise ValueError(f"env {spec!r} and env {other!r} are both named {env.name!r}: give one another `name`")
            envs[env.name], names[spec] = env, env.name
        name = names[spec]
        try:
            tasks = [t for t in envs[name].tasks(s.source, None if s.kinds else limit)
                     if not s.kinds or t.meta.get("kind") in s.kinds][:limit]
        except Exception as e:
            raise ValueError(f"{name} source {s.source!r}: {e}") from None
        if not tasks:
            raise ValueError(f"{name} source {s.source!r} gave no tasks")
        if min(s.weight, s.sft_weight if s.sft_weight != -1 else 0) < 0 or max(s.weight, s.sft_weight) <= 0:
            raise ValueError(f"{name} source {s.source!r}: weight, sft_weight must be >= 0 (sft_weight -1: the weight), "
                             f"one > 0; got {s.weight}, {s.sft_weight}")
        for t in tasks:
            t.env = name
        parts.append(tasks)
    if sources and not any(s.weight for s in sources):
        raise ValueError("no source has weight > 0: nothing to draw RL tasks from")
    return parts, [s.weight for s in sources], envs
