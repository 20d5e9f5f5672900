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
import re
from typing import Protocol

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


REQUIRED = ("tasks", "prompt", "files", "score", "expert", "corpus", "metrics", "tools", "system_prompt",
            "worked_example")  # fmt: skip


class TaskEnvBase:
    """Defaults for a TaskEnv: no tools, files, expert, corpus, judge or step rewards; the prompt is the question."""

    name, metrics, eval_metrics, tools, worked_example = "", ("correct",), (), (), ()
    system_prompt = """\
You solve tasks by writing Python in a Jupyter notebook. Each step, write your reasoning in <think>...</think>, \
then one code cell in <code>...</code>. The cell runs in a persistent kernel and you get its output in \
<output>...</output>. Call submit_final_answer(answer) with a short final answer: only this ends the task."""

    def __init__(self, cfg=None):
        self.cfg = cfg

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
    except ModuleNotFoundError as e:
        if e.name and module.startswith(e.name):  # the module itself (or its package) is not there
            raise ValueError(f"env {spec!r}: no module {e.name!r} (built-in: {', '.join(BUILTIN)}, or a module path "
                             "on PYTHONPATH that defines make_env(cfg))") from None
        raise ValueError(f"env {spec!r}: importing {module} failed: {type(e).__name__}: {e}") from None
    except Exception as e:  # noqa: BLE001 -- a bug in the module: its own exception, in one line
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


SETUP_CHUNK = 200_000  # characters of file text per setup cell: the kernel echoes a cell back in one message, as
# JSON of its repr (up to 8 bytes a character: "\u2028"), and the host drops a message over 2 MiB (sandbox.kernel)


def setup_cells(files: dict[str, str], drop_tools: tuple[str, ...] = (), chunk: int = SETUP_CHUNK) -> list[str]:
    """The hidden first cells of an episode: write the task's files under the workspace, `chunk` characters of
    text a cell at most, then take the host tools this task does not get out of the namespace (the tool server
    refuses them anyway). A path that is not relative, or a name over 255 bytes, is refused with its reason.

    >>> print("\\n----\\n".join(setup_cells({"a/b.txt": "xyz"}, ("web_search",), chunk=2)))
    def _l0_write(path, text, mode):
        import os
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, mode) as f:
            f.write(text)
    _l0_write('a/b.txt', 'xy', 'w')
    ----
    _l0_write('a/b.txt', 'z', 'a')
    del _l0_write, web_search
    """
    for path in files:
        if not re.fullmatch(r"[\w.-]+(/[\w.-]+)*", path) or ".." in path.split("/"):
            raise ValueError(f"setup: workspace file {path!r} is not a relative path of letters, digits, '._-'")
        if long := [part for part in path.split("/") if len(part.encode()) > 255]:
            raise ValueError(f"setup: workspace file name {long[0][:40]!r}... is {len(long[0].encode())} bytes (at most 255)")
    writes = [(f"_l0_write({path!r}, {text[i : i + chunk]!r}, {'a' if i else 'w'!r})", min(chunk, len(text) - i))
              for path, text in files.items() for i in range(0, max(len(text), 1), chunk)]  # fmt: skip
    cells, size = [], chunk
    for line, n in writes:  # as few cells as fit `chunk` characters of text each
        if size + n > chunk:
            cells.append([])
            size = 0
        cells[-1].append(line)
        size += n
    if cells:
        cells[0].insert(0, 'def _l0_write(path, text, mode):\n    import os\n    os.makedirs(os.path.dirname(path) or ".", '
                           'exist_ok=True)\n    with open(path, mode) as f:\n        f.write(text)')  # fmt: skip
    if names := ("_l0_write",) * bool(cells) + drop_tools:
        cells = cells or [[]]
        cells[-1].append(f"del {', '.join(names)}")
    return ["\n".join(c) for c in cells]


class ExpertPolicy:
    """The environments' experts behind the Policy interface, so expert episodes run through the real agent loop,
    kernels and tools (log-probs 0). With `then` (a policy), an episode's first `steps` actions are the expert's and
    the rest `then`'s (chunk-initialization resampling, collect.run_one)."""

    def __init__(self, tasks: list[Task], envs: dict[str, TaskEnv], tokenizer, prefill: str = "", then=None,
                 steps: int = 0):  # fmt: skip
        self.tasks, self.envs = {t.id: t for t in tasks}, envs
        self.tokenizer, self.prefill, self.then, self.steps = tokenizer, prefill, then, steps
        self.calls: dict[str, int] = {}

    async def health(self) -> bool:
        return True if self.then is None else await self.then.health()

    async def generate(self, input_ids: list[int], sampling: dict):
        from l0_min.inference import Generation, episode_key

        key = episode_key.get()
        n = self.calls[key] = self.calls.get(key, -1) + 1
        if self.then is not None and n >= self.steps:
            return await self.then.generate(input_ids, sampling)
        task = self.tasks[key.rsplit("#", 1)[0]]
        actions = self.envs[task.env].expert(task)
        action = actions[min(n, len(actions) - 1)]
        action = action[len(self.prefill):] if self.prefill and action.startswith(self.prefill) else action
        ids = self.tokenizer.encode(action, add_special_tokens=False)  # the context already ends with the prefill
        return Generation(ids, [0.0] * len(ids), "stop", "</code>")
