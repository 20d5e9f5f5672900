"""Task environments: what the agent is asked, which host tools its kernel gets, what its workspace holds,
and how an episode is scored. The agent loop, the collector, the learner and the logs know nothing more.

    env = load_env("math", cfg)              # a built-in name (qa | math | files) or a module "my_pkg.my_env"
    tasks = env.tasks("synthetic:train")     # Task(env="math", ...): each task names its environment
    load_sources(cfg.data.train, cfg)        # several sources, each with its environment and weight

A module is an environment when it defines `make_env(cfg) -> TaskEnv`; subclassing `TaskEnvBase` leaves a
fork only what differs. The smallest complete one is in the README ("Write your own environment").
"""

from __future__ import annotations

import importlib
import re
from typing import Protocol

from l0_min.episode import Episode, Task

BUILTIN = ("qa", "math", "files")
SEARCH_TOOLS = ("web_search", "read_page")  # the host tools a kernel may be given (submit_final_answer: always)


class TaskEnv(Protocol):
    name: str  # what tasks carry in Task.env: the name it was loaded by
    metrics: tuple[str, ...]  # score() keys the tables print; the first is the headline, 0 or 1 per episode
    tools: tuple[str, ...]  # host tools the kernel may call, from SEARCH_TOOLS ((): none)
    system_prompt: str
    worked_example: tuple[dict, ...]  # one solved task as earlier chat turns (agent.worked_example)

    def tasks(self, source: str, limit: int | None = None) -> list[Task]: ...
    def prompt(self, task: Task) -> str: ...  # the task's user message (the agent adds the step budget)
    def files(self, task: Task) -> dict[str, str]: ...  # written into the workspace before the first cell
    def score(self, ep: Episode) -> dict[str, float]: ...  # "core" in [0, 1] (the answer reward) and metrics
    def expert(self, task: Task) -> list[str] | None: ...  # a scripted solver's actions (SFT), or None
    def corpus(self, tasks: list[Task]) -> list[dict]: ...  # documents the search tools serve ({id, title, text})


class TaskEnvBase:
    """Defaults for a TaskEnv: no tools, no files, no expert, no corpus; the prompt is the question."""

    name, metrics, tools, worked_example = "", ("correct",), (), ()
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


def load_env(spec: str, cfg) -> TaskEnv:
    """The environment named `spec`: a built-in (l0_min/envs/<spec>.py) or any importable module path; its
    `make_env(cfg)`. The run's own env (cfg.env) takes `agent.system_prompt` when that is set."""
    module = f"l0_min.envs.{spec}" if spec in BUILTIN else spec
    try:
        env = importlib.import_module(module).make_env(cfg)
    except ModuleNotFoundError as e:
        raise ValueError(f"env {spec!r}: no module {e.name!r} (built-in: {', '.join(BUILTIN)}, or a module path "
                         "on PYTHONPATH that defines make_env(cfg))") from None
    except AttributeError:
        raise ValueError(f"env {spec!r}: module {module} defines no make_env(cfg)") from None
    env.name = spec
    if bad := set(env.tools) - set(SEARCH_TOOLS):
        raise ValueError(f"env {spec!r}: unknown host tools {sorted(bad)} (known: {', '.join(SEARCH_TOOLS)})")
    if spec == cfg.env and cfg.agent.system_prompt:
        env.system_prompt = cfg.agent.system_prompt
    return env


def load_sources(sources, cfg, limit: int | None = None) -> tuple[list[list[Task]], list[float], dict[str, TaskEnv]]:
    """Each source's tasks (tagged with their environment), the sources' weights, the environments by name.
    An error names the source."""
    envs: dict[str, TaskEnv] = {}
    parts = []
    for s in sources:
        name = s.env or cfg.env
        if name not in envs:
            envs[name] = load_env(name, cfg)
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


def setup_cell(files: dict[str, str], drop_tools: tuple[str, ...] = ()) -> str:
    """The hidden first cell of an episode: write the task's files under the workspace, and take the
    host tools this task does not get out of the namespace (the tool server refuses them anyway).

    >>> print(setup_cell({"a/b.txt": "x"}, ("web_search",)))
    def _l0_setup(files):
        import os
        for path, text in files.items():
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            with open(path, "w") as f:
                f.write(text)
    _l0_setup({'a/b.txt': 'x'})
    del _l0_setup, web_search
    """
    for path in files:
        if not re.fullmatch(r"[\w.-]+(/[\w.-]+)*", path) or ".." in path.split("/"):
            raise ValueError(f"setup: workspace file {path!r} is not a relative path of letters, digits, '._-'")
    return ("def _l0_setup(files):\n    import os\n    for path, text in files.items():\n"
            "        os.makedirs(os.path.dirname(path) or \".\", exist_ok=True)\n"
            "        with open(path, \"w\") as f:\n            f.write(text)\n"
            f"_l0_setup({files!r})\ndel {', '.join(('_l0_setup',) + drop_tools)}")


class ExpertPolicy:
    """The environments' experts behind the Policy interface, so expert episodes run through the real agent
    loop, kernels and tools like sampled ones (their observations are real). An episode's task is found by
    its id in the episode key the agent sets; its step by the calls made for that episode. Log-probs are 0."""

    def __init__(self, tasks: list[Task], envs: dict[str, TaskEnv], tokenizer, prefill: str = ""):
        self.tasks, self.envs = {t.id: t for t in tasks}, envs
        self.tokenizer, self.prefill = tokenizer, prefill
        self.calls: dict[str, int] = {}

    async def health(self) -> bool:
        return True

    async def generate(self, input_ids: list[int], sampling: dict):
        from l0_min.inference import Generation, episode_key

        key = episode_key.get()
        task = self.tasks[key.rsplit("#", 1)[0]]
        actions = self.envs[task.env].expert(task)
        n = self.calls[key] = self.calls.get(key, -1) + 1
        action = actions[min(n, len(actions) - 1)]
        action = action[len(self.prefill):] if self.prefill and action.startswith(self.prefill) else action
        ids = self.tokenizer.encode(action, add_special_tokens=False)  # the context already ends with the prefill
        return Generation(ids, [0.0] * len(ids), "stop", "</code>")
