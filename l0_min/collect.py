"""The rollout collector: many NB-Agent episodes as coroutines in one asyncio event loop.

    svc = Services(cfg, policy, kernels, tools, tokenizer, envs)   # envs: name -> l0_min.envs.TaskEnv
    batch = await collect_batch(svc, stream, cfg.rollout)         # train.py: groups, dynamic sampling
    await run_tasks(svc, tasks, n_samples, on_episode=write)      # rollout.py / evaluate.py

Each task runs in its environment (`task.env`). Environment failures are retried, then masked; timeouts dropped up
to a cap, then failures; an unreachable server ends the run (InferenceDown); a score() that raises fails its episode,
never the run (docs/internals.md "Inside the loop" has the rules).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import re
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Awaitable, Callable, Protocol

from l0_min import algo
from l0_min.agent import Kernel, Policy, Tools, run_episode
from l0_min.config import Config, RolloutConfig
from l0_min.envs import SEARCH_TOOLS, TaskEnv
from l0_min.episode import ENV_ERROR, INFERENCE_ERROR, TIMEOUT, Episode, Task
from l0_min.inference import Generation, InferenceError, episode_key
from l0_min.rewards import score_episode

log = logging.getLogger(__name__)


class InferenceDown(RuntimeError):
    """The inference server(s) stayed unreachable: the run stops instead of making empty episodes."""


class Kernels(Protocol):
    async def acquire(self) -> Kernel: ...
    async def release(self, kernel: Kernel) -> None: ...


@dataclass
class Services:
    """What episodes need: config, policy, kernels, host tools, tokenizer, the task environments by name."""

    cfg: Config
    policy: Policy
    kernels: Kernels
    tools: Tools
    tokenizer: object
    envs: dict[str, TaskEnv]
    urls: list[str] = field(default_factory=list)  # the inference servers, for messages
    semaphore: asyncio.Semaphore | None = None
    counters: dict = field(default_factory=lambda: {"env_retries": 0, "inference_retries": 0, "inference_pauses": 0})
    down_since: float | None = None  # when an episode first found the policy unreachable (shared deadline)

    def __post_init__(self):
        if self.semaphore is None:  # dataclasses.replace(svc, ...) shares svc's (train.py's greedy evaluation)
            self.semaphore = asyncio.Semaphore(self.cfg.rollout.max_concurrency)


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
        if not re.fullmatch(r"[\w.-]+(/[\w.-]+)*", path) or {".", ".."} & set(path.split("/")):
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


async def prepare(kernel, env: TaskEnv, task: Task, tools: Tools, timeout: float) -> None:
    """Give a fresh kernel the task's host tools and workspace files; raises if the sandbox cannot be set up."""
    tools.allow(kernel.id, env.tools)
    try:
        cells = setup_cells(env.files(task), tuple(t for t in SEARCH_TOOLS if t not in env.tools))
    except ValueError as e:  # the environment's files(): its mistake, named
        raise ValueError(f"env {env.name!r}: files() of task {task.id}: {e}") from None
    for cell in cells:
        res = await kernel.execute(cell, timeout=timeout)
        if not res.ok:  # the error's last lines: the cause, not the echo of a long file
            raise RuntimeError(f"setting up the workspace of task {task.id} failed: {res.text()[-500:]}")


class ExpertPolicy:
    """The environments' experts behind the Policy interface, so expert episodes run through the real agent loop,
    kernels and tools (log-probs 0). With `then` (a policy), an episode's first `steps` actions are the expert's and
    the rest `then`'s (chunk-initialization resampling, collect.run_one)."""

    def __init__(self, tasks: list[Task], envs: dict[str, TaskEnv], tokenizer, prefill: str = "", then=None, steps: int = 0):
        self.tasks, self.envs, self.calls = {t.id: t for t in tasks}, envs, {}  # calls: episode key -> actions asked
        self.tokenizer, self.prefill, self.then, self.steps = tokenizer, prefill, then, steps

    async def health(self) -> bool:
        return True if self.then is None else await self.then.health()

    async def generate(self, input_ids: list[int], sampling: dict):
        key = episode_key.get()
        n = self.calls[key] = self.calls.get(key, -1) + 1
        if self.then is not None and n >= self.steps:
            return await self.then.generate(input_ids, sampling)
        task = self.tasks[key.rsplit("#", 1)[0]]
        actions = self.envs[task.env].expert(task)
        action = actions[min(n, len(actions) - 1)].removeprefix(self.prefill)  # the context already ends with it
        ids = self.tokenizer.encode(action, add_special_tokens=False)
        return Generation(ids, [0.0] * len(ids), "stop", "</code>")


async def _attempt(svc: Services, task: Task, prefix: int = 0) -> tuple[Episode, list[str]]:
    """One try: acquire a kernel, prepare it for the task, run the agent under the hard timeout (its first `prefix`
    actions the expert's: context, Step.prefix), release the kernel; the episode and the tool backend errors seen."""
    kernel, cfg, env = None, svc.cfg, svc.envs[task.env]
    policy = ExpertPolicy([task], svc.envs, svc.tokenizer, cfg.agent.prefill, svc.policy, prefix) if prefix else svc.policy
    try:
        kernel = await svc.kernels.acquire()
        await prepare(kernel, env, task, svc.tools, cfg.kernel.exec_timeout)
        ep = await asyncio.wait_for(run_episode(task, env, policy, kernel, svc.tools, svc.tokenizer, cfg),
                                    timeout=cfg.rollout.episode_timeout)
        for s in ep.steps[:prefix]:
            s.prefix = True
        return ep, svc.tools.backend_errors(kernel.id)
    except asyncio.TimeoutError:
        return Episode(task, status=TIMEOUT, error=f"hard episode timeout of {cfg.rollout.episode_timeout:g} s"), []
    except InferenceError as e:
        return Episode(task, status=INFERENCE_ERROR, error=str(e)), []
    except Exception as e:  # the sandbox, the kernel or a tool backend: not the policy's fault
        return Episode(task, status=ENV_ERROR, error=f"{type(e).__name__}: {e}"), []
    finally:
        if kernel is not None:
            with contextlib.suppress(Exception):
                await svc.kernels.release(kernel)


async def _wait_for_server(svc: Services) -> bool:
    """After an inference failure: False if the policy answers /health at once (the request failed), True once it
    answers again after an outage; InferenceDown once the outage has lasted inference.down_after seconds."""
    paused, delay = False, svc.cfg.inference.backoff
    while True:
        with contextlib.suppress(Exception):  # a /health that raises: not healthy
            if await svc.policy.health():
                svc.down_since = None
                return paused
        svc.counters["inference_pauses"] += not paused
        paused, svc.down_since = True, svc.down_since or time.monotonic()  # the deadline of the first to find it down
        left = svc.down_since + svc.cfg.inference.down_after - time.monotonic()
        if left <= 0:
            raise InferenceDown(f"inference server(s) unreachable for {svc.cfg.inference.down_after:g} s "
                                "(inference.down_after); stopping the run")  # fmt: skip
        await asyncio.sleep(min(delay, left))
        delay = min(delay * 2, 10.0)


async def run_one(svc: Services, task: Task, group: int = 0, sample: int = 0, prefix: int = 0) -> Episode:
    """One finished episode (from the first `prefix` steps of the task's expert: rollout.resample): environment retries
    and inference pauses, then its status, mask and score are settled here, the one place an episode is finished."""
    retries, failures = svc.cfg.rollout.max_retries, {ENV_ERROR: 0, INFERENCE_ERROR: 0}
    async with svc.semaphore:
        while True:
            ep, backend_errors = await _attempt(svc, task, prefix)
            if backend_errors and ep.status not in failures:  # a tool backend failed under it
                ep.status = ENV_ERROR
                ep.error = f"{len(backend_errors)} tool backend failure(s), the first: {backend_errors[0]}"
            if ep.status == INFERENCE_ERROR and await _wait_for_server(svc):  # an outage that ended (or InferenceDown)
                continue
            if failures.get(ep.status, retries) >= retries:  # done, or out of retries
                break
            failures[ep.status] += 1  # an environment failure, or the server is up but this request failed
            env = ep.status == ENV_ERROR
            svc.counters["env_retries" if env else "inference_retries"] += 1
            why = f"environment failure: {ep.error}; retrying on a fresh kernel" if env else f"{ep.error}; retrying"
            log.warning("episode of task %s: %s", task.id, why)
    ep.group, ep.sample = group, sample
    ep.masked = ep.status in (ENV_ERROR, INFERENCE_ERROR)  # after max_retries: a zero-weight placeholder for stats
    _score(ep, svc)
    return ep


def _score(ep: Episode, svc: Services) -> None:
    """score_episode, where a score() that raises ends no run: raised on the agent's answer (not on none), the episode
    is scored as unanswered, the agent's failure; raised on none too, it is masked (env_error). Each cause (environment,
    exception) is counted in svc.counters (the step's metrics) and printed at its 1st, 10th, 100th ... episode."""
    cfg, env = svc.cfg.reward, svc.envs[ep.task.env]
    try:
        return score_episode(ep, cfg, env)
    except Exception as e:
        ep.error = f"the environment's score() raised {type(e).__name__} on the answer: {str(e)[:300]}"
        cause = f"score_errors/{env.name}/{type(e).__name__}"
        n = svc.counters[cause] = svc.counters.get(cause, 0) + 1
    answer, ep.final_answer = ep.final_answer, None
    try:
        score_episode(ep, cfg, env)
    except Exception:
        ep.status, ep.masked, ep.error = ENV_ERROR, True, ep.error.replace(" on the answer", "")
        score_episode(ep, cfg, SimpleNamespace(name="", score=lambda ep: {"core": 0.0}))
    ep.final_answer = answer
    if str(n).rstrip("0") == "1":  # 1, 10, 100, ...
        log.warning("episode of task %s: %s (%d episode(s) so far of this cause, %s)", ep.task.id, ep.error, n, cause)


async def run_tasks(svc: Services, tasks: list[Task], n_samples: int = 1,
                    on_episode: Callable[[Episode], Awaitable[None] | None] | None = None) -> list[Episode]:
    """Every task `n_samples` times (no filtering, no dropping), in task order; `on_episode` is called as each
    episode finishes. rollout.py and evaluate.py."""

    async def one(i: int, task: Task, s: int) -> Episode:
        ep = await run_one(svc, task, i, s)
        r = on_episode(ep) if on_episode is not None else None
        if asyncio.iscoroutine(r):
            await r
        return ep

    jobs = [asyncio.create_task(one(i, t, s)) for i, t in enumerate(tasks) for s in range(n_samples)]
    try:
        return list(await asyncio.gather(*jobs))
    finally:
        await _cancel(jobs)


async def _cancel(jobs) -> None:
    """Cancel what still runs and wait until it has let go of its kernels."""
    for j in jobs:
        j.cancel()
    await asyncio.gather(*jobs, return_exceptions=True)


# ----------------------------------------------------------------------------- training batches
class TaskStream:
    """An endless, seeded, resumable order over the training tasks of one or several sources (each draw: a source by
    its weight, then its next task, a fresh shuffle each epoch).

    >>> s = TaskStream([Task(str(i), "q", []) for i in range(3)], seed=0)
    >>> [s.next().id for _ in range(4)], s.position
    (['0', '2', '1', '1'], 4)
    >>> mix = TaskStream([[Task("a", "q", [])], [Task("b", "q", [])]], weights=[3, 1], seed=0)
    >>> "".join(mix.next().id for _ in range(12))
    'babaaabaaaaa'
    """

    def __init__(self, sources: list, weights: list[float] | None = None, seed: int = 0, position: int = 0):
        sources = [sources] if sources and isinstance(sources[0], Task) else sources
        if not sources or not all(sources):
            raise ValueError("the training task list is empty (data.train)")
        self.sources, self.weights, self.seed = [list(s) for s in sources], weights or [1.0] * len(sources), seed
        self._orders: dict[int, tuple[int, list[int]]] = {}  # source -> (epoch, its shuffled order)
        self.position = position

    @property
    def position(self) -> int:
        return self._position

    @position.setter
    def position(self, position: int) -> None:
        """Set (resume, rewind) the stream: the choices of source up to there are replayed (cheap: no tasks)."""
        self._position, self.drawn = 0, [0] * len(self.sources)  # tasks drawn from each source
        while self._position < position:
            self._source()

    def _source(self) -> int:
        k = 0 if len(self.sources) == 1 else \
            random.Random(self.seed * 1_000_003 + self._position).choices(range(len(self.sources)), self.weights)[0]
        self._position += 1
        self.drawn[k] += 1
        return k

    def next(self) -> Task:
        k = self._source()
        tasks = self.sources[k]
        epoch, i = divmod(self.drawn[k] - 1, len(tasks))
        if self._orders.get(k, (None,))[0] != epoch:
            order = list(range(len(tasks)))
            random.Random(self.seed * 1_000_003 + epoch + 7_919 * k).shuffle(order)  # source 0: as a single source
            self._orders[k] = epoch, order
        return tasks[self._orders[k][1][i]]


@dataclass
class Batch:
    episodes: list[Episode]  # kept groups, in group order (masked placeholders included)
    stats: dict


async def _group(svc: Services, task: Task, gi: int, rc: RolloutConfig, draw: random.Random) -> list[Episode]:
    """A group of `rc.n_samples` episodes of one task; with rollout.resample, all from one expert prefix."""
    expert = svc.envs[task.env].expert(task) if rc.resample and draw.random() < rc.resample else None
    k = draw.randint(1, len(expert) - 1) if expert and len(expert) > 1 else 0  # one state for the whole group
    jobs = [asyncio.ensure_future(run_one(svc, task, gi, s, k)) for s in range(rc.n_samples)]
    try:
        return list(await asyncio.gather(*jobs))
    finally:  # one sample raised (InferenceDown) or the group was cancelled: stop its siblings
        await _cancel(jobs)


def _drop_timeouts(eps: list[Episode], stats: dict, max_dropped: int) -> list[Episode]:
    """Timed-out episodes are dropped while the batch has dropped fewer than `max_dropped`, kept as failures past it."""
    kept = []
    for ep in eps:
        drop = ep.status == TIMEOUT and stats["timeouts_dropped"] < max_dropped
        stats["timeouts_dropped" if drop else "timeouts_kept"] += ep.status == TIMEOUT
        kept += [] if drop else [ep]
    return kept


async def collect_batch(svc: Services, stream: TaskStream, rc: RolloutConfig, dynamic_sampling: bool = True) -> Batch:
    """`rc.batch_size` groups of `rc.n_samples` episodes for one training step."""
    t0, counters0 = time.perf_counter(), dict(svc.counters)  # to report this batch's time and counts
    max_dropped = int(rc.max_dropped_frac * rc.batch_size * rc.n_samples)
    stats = {"groups_launched": 0, "groups_dropped_ds": 0, "groups_topped_up": 0, "timeouts_dropped": 0,
             "timeouts_kept": 0, "stragglers_cancelled": 0}  # fmt: skip

    draw = random.Random(f"{getattr(stream, 'seed', 0)}-{stream.position}")  # which groups start from an expert prefix

    kept, dropped, running = [], [], set()  # groups: kept, dropped by dynamic sampling (for topping up), in flight
    extra_left = rc.max_extra_groups if dynamic_sampling else 0

    def launch() -> None:
        running.add(asyncio.create_task(_group(svc, stream.next(), stats["groups_launched"], rc, draw)))
        stats["groups_launched"] += 1

    for _ in range(rc.batch_size + rc.over_sample_groups):
        launch()
    try:
        while running and len(kept) < rc.batch_size:
            done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            for fut in done:
                running.discard(fut)
                eps = fut.result()  # InferenceDown propagates and ends the run
                if len(kept) == rc.batch_size:  # finished together with the last group needed
                    continue
                if not (eps := _drop_timeouts(eps, stats, max_dropped)):
                    launch()
                    continue
                rewards = [float(e.rewards.get("core", 0.0)) for e in eps]  # the environment's answer reward
                if dynamic_sampling and not all(algo.dynamic_sampling_keep(rewards, [0] * len(eps))):
                    stats["groups_dropped_ds"] += 1
                    dropped.append(eps)
                    if extra_left > 0:
                        extra_left -= 1
                        launch()
                    continue
                kept.append(eps)
            # keep enough groups in flight to fill the batch
            while len(kept) + len(running) < rc.batch_size and (extra_left > 0 or not dynamic_sampling):
                if dynamic_sampling:
                    extra_left -= 1
                launch()
    finally:
        stats["stragglers_cancelled"] = sum(1 for t in running if not t.done())
        await _cancel(running)
    while len(kept) < rc.batch_size and dropped:  # the extra-generation cap was reached
        kept.append(dropped.pop())
        stats["groups_topped_up"] += 1
    for gi, eps in enumerate(kept):  # renumber groups 0..batch_size-1 for the advantage functions
        for e in eps:
            e.group = gi
    episodes = [e for eps in kept for e in eps]
    stats["episodes_masked"] = sum(e.masked for e in episodes)
    stats.update({k: svc.counters[k] - counters0.get(k, 0) for k in svc.counters})
    return Batch(episodes, stats | dict(rollout_seconds=time.perf_counter() - t0, task_position=stream.position))


class Batches:
    """Training batches from `stream`. With `ahead` = k >= 1 a producer collects up to k batches ahead (step t+1's
    episodes run while the learner trains step t) and `next(version)` drops episodes more than k weight versions
    old (`drop_stale`); with 0 a batch is collected when asked for (strictly on-policy)."""

    def __init__(self, svc: Services, stream: TaskStream, rc: RolloutConfig, dynamic_sampling: bool):
        self.collect = lambda: collect_batch(svc, stream, rc, dynamic_sampling)
        self.ahead, self.slots, self.ready = rc.overlap, asyncio.Semaphore(max(rc.overlap, 1)), asyncio.Queue()
        self.producer: asyncio.Task | None = None  # started by the first next(), in the running loop

    async def _produce(self) -> None:
        while True:
            await self.slots.acquire()  # a slot frees when a collected batch is taken
            self.ready.put_nowait(await self.collect())

    async def next(self, version: int = 0) -> Batch:
        """The next batch for the learner at weight `version`; the producer's error (InferenceDown) is raised here."""
        if self.ahead:
            self.producer = self.producer or asyncio.ensure_future(self._produce())
            get = asyncio.ensure_future(self.ready.get())
            await asyncio.wait([get, self.producer], return_when=asyncio.FIRST_COMPLETED)
            if not get.done():  # the producer ended first: with an error
                get.cancel()
                self.producer.result()
            self.slots.release()
        batch = get.result() if self.ahead else await self.collect()
        kept, stale = drop_stale(batch.episodes, version, self.ahead)
        return Batch(kept, batch.stats | stale)

    async def close(self) -> None:
        if self.producer is not None:
            self.producer.cancel()
            await asyncio.gather(self.producer, return_exceptions=True)


def drop_stale(episodes: list[Episode], version: int, max_lag: int) -> tuple[list[Episode], dict]:
    """The episodes whose every action came from weights at most `max_lag` updates older than `version`, and stats
    (dropped episodes, action tokens by lag). A weight version that is not a number ("default") is 0.

    >>> from l0_min.episode import Step
    >>> ep = lambda *vs: Episode(Task("t", "q", []), [Step([], [1, 2], [0, 0], weight_version=v) for v in vs])
    >>> kept, stats = drop_stale([ep("3"), ep("2", "3"), ep("1", "2")], version=3, max_lag=1)
    >>> len(kept), stats
    (2, {'lag/0': 4, 'lag/1': 4, 'lag/2': 2, 'stale_dropped': 1})
    """
    kept, stats = [], {"stale_dropped": 0}
    for ep in episodes:
        own = [s for s in ep.steps if not s.prefix]  # an expert prefix came from no weights
        lags = [version - (int(s.weight_version) if s.weight_version.isdigit() else 0) for s in own]
        for lag, s in zip(lags, own):
            stats[f"lag/{lag}"] = stats.get(f"lag/{lag}", 0) + len(s.action_ids)
        if lags and max(lags) > max_lag:
            stats["stale_dropped"] += 1
        else:
            kept.append(ep)
    return kept, dict(sorted(stats.items()))
