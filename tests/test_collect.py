"""The rollout collector (l0_min.collect) under load and under faults.

A scripted policy server (bench/scripted_policy.py) answers SGLang's /generate with fixed actions:
search, then submit "42". Part 1 runs real sandboxed kernels and the real tool server: 32
concurrent episodes, kernels killed from outside mid-cell, kernels that die every time, a search
backend that errors or stalls. Part 2 runs the collector's own logic on in-process fake kernels
(fast): the inference server stopped and restarted, or gone for good, refused requests, dynamic
sampling, over-sampled groups, timeouts, run_tasks order, TaskStream.
Every collector call runs under an asyncio timeout: nothing may hang.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
from types import SimpleNamespace

import pytest
import pytest_asyncio

from l0_min.collect import Batches, InferenceDown, Services, TaskStream, collect_batch, run_tasks
from l0_min.config import Config
from l0_min.episode import ANSWERED, ENV_ERROR, INFERENCE_ERROR, KERNEL_CRASHED, TIMEOUT, Task, training_rows
from l0_min.inference import Generation, InferenceClient
from l0_min.models import tiny_tokenizer
from l0_min.sandbox.pool import KernelPool
from l0_min.search import SearchError
from l0_min.sandbox.tools import PROBE, ToolServer
from bench.scripted_policy import ANSWER, SEARCH, ScriptedPolicyServer, default_script
from tests.fakes import FakeKernels, qa_envs

TOK = tiny_tokenizer()


def act(think: str, code: str) -> str:
    return f"<think>{think}</think><code>{code}</code>"


def config(batch_size=2, n_samples=2, **rollout) -> Config:
    cfg = Config()
    cfg.agent.max_steps = 4
    cfg.kernel.pool_size = 0
    cfg.rollout.batch_size, cfg.rollout.n_samples = batch_size, n_samples
    cfg.rollout.max_retries = 1
    for k, v in rollout.items():
        setattr(cfg.rollout, k, v)
    cfg.inference.backoff, cfg.inference.max_retries, cfg.inference.down_after = 0.05, 3, 10.0
    return cfg


def tasks(*questions: str) -> list[Task]:
    return [Task(q.replace(" ", "_"), q, ["42"]) for q in questions]


class ListStream:
    """The tasks in the given order (TaskStream's interface), so a test knows which group is which."""

    def __init__(self, items: list[Task]):
        self.items, self.position = items, 0

    def next(self) -> Task:
        self.position += 1
        return self.items[(self.position - 1) % len(self.items)]


class Tracked:
    """A pool wrapper that counts kernels in use (and the peak), and can start kernels beforehand."""

    def __init__(self, inner):
        self.inner = inner
        self.in_use = self.peak = self.acquired = self.released = 0
        self.ready: list = []
        self.acquired_kernels: asyncio.Queue = asyncio.Queue()

    async def prestart(self, n: int) -> None:
        self.ready = list(await asyncio.gather(*(self.inner.acquire() for _ in range(n))))

    async def acquire(self):
        k = self.ready.pop() if self.ready else await self.inner.acquire()
        self.acquired += 1
        self.in_use += 1
        self.peak = max(self.peak, self.in_use)
        self.acquired_kernels.put_nowait(k)
        return k

    async def release(self, k) -> None:
        self.in_use -= 1
        self.released += 1
        await self.inner.release(k)


def groups_of(batch) -> dict[int, list]:
    out: dict[int, list] = {}
    for e in batch.episodes:
        out.setdefault(e.group, []).append(e)
    return out


def assert_well_formed(batch, batch_size: int, n_samples: int) -> None:
    """batch_size groups numbered 0..batch_size-1, each of n_samples episodes of one task."""
    groups = groups_of(batch)
    assert sorted(groups) == list(range(batch_size))
    for eps in groups.values():
        assert sorted(e.sample for e in eps) == list(range(n_samples))
        assert len({e.task.id for e in eps}) == 1


def answered_ok(e) -> bool:
    return e.status == ANSWERED and e.final_answer == "42" and not e.masked and len(e.steps) == 2


# ---------------------------------------------------------------------------------------------
# part 1: real sandboxed kernels, the real tool server, the policy over HTTP

real = pytest.mark.asyncio(loop_scope="module")


class Backend:
    """Search backend, down for the tool server's probe too (PROBE: a failure is the backend's only if that fails as
    well): "boom" fails while `failures_left` > 0, and the probe until a search answers; "stall" never answers, and
    from then on nor does the probe, while `hung`."""

    def __init__(self):
        self.failures_left, self.down, self.hung = 0, False, False

    async def search(self, query: str, k: int) -> list[dict]:
        probe = query == PROBE["web_search"]["query"]
        if query == "stall" or probe and self.hung:
            self.hung = True
            await asyncio.sleep(3600)
        if query == "boom" and self.failures_left > 0 or probe and self.down:
            self.failures_left -= not probe
            self.down = True
            raise SearchError("the search API answered HTTP 503")
        self.down = False
        return [{"id": "x", "title": "X", "text": "x marks the spot", "score": 1.0}]

    async def read_page(self, ref: str) -> str:
        return "X\n\nx marks the spot"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack():
    cfg = config()
    backend = Backend()
    tools = ToolServer(backend, timeout=1.0)
    await tools.start()
    pool = KernelPool(cfg.sandbox, cfg.kernel, tools)
    await pool.start()
    yield SimpleNamespace(pool=pool, tools=tools, backend=backend)
    await pool.close()
    await tools.close()


@contextlib.asynccontextmanager
async def policy_over_http(script=None, delay=0.0, cfg=None):
    server = ScriptedPolicyServer(script, delay)
    url = await server.start()
    client = InferenceClient([url], (cfg or config()).inference, max_connections=64)
    try:
        yield server, client
    finally:
        await client.close()
        await server.stop()


@pytest.mark.slow
@real
async def test_32_concurrent_episodes_complete_without_a_failure(stack):
    cfg = config(batch_size=16, n_samples=2, max_concurrency=32)
    async with policy_over_http(delay=0.05) as (server, client):
        pool = Tracked(stack.pool)
        await pool.prestart(32)  # started first, so all 32 episodes run at once
        env = Services(cfg, client, pool, stack.tools, TOK, qa_envs(cfg))
        stream = TaskStream(tasks(*(f"question {i}" for i in range(40))), seed=1)
        batch = await asyncio.wait_for(collect_batch(env, stream, cfg.rollout, dynamic_sampling=False), 120)
    assert_well_formed(batch, 16, 2)
    assert all(answered_ok(e) for e in batch.episodes)
    for e in batch.episodes:
        assert e.steps[0].observation.startswith("<output>\n1\n</output>")  # one search hit, printed by the kernel
        assert e.tool_calls == {"web_search": 1, "submit_final_answer": 1}
        assert e.weight_version == "scripted" and e.rewards["core"] == 1.0
    assert pool.peak == 32 and pool.in_use == 0 and pool.acquired == pool.released == 32
    assert server.requests == 64 and stream.position == 16
    assert batch.stats["episodes_masked"] == batch.stats["env_retries"] == batch.stats["timeouts_dropped"] == 0
    assert batch.stats["groups_launched"] == 16 and batch.stats["task_position"] == 16


def slow_then_answer(question, step, count):
    if step == 1:
        return act("wait for it", "import time; time.sleep(3); print('woke')")
    return ANSWER


@pytest.mark.slow
@real
async def test_kernels_killed_mid_cell_are_retried_on_fresh_kernels(stack):
    rng = random.Random(0)
    victims = sorted(rng.sample(range(4), 3))  # 3 of the 4 first attempts, each at a random moment
    cfg = config(batch_size=2, n_samples=2, max_retries=1)
    killed = []

    async def kill_later(k, delay):
        await asyncio.sleep(delay)
        assert k.is_alive()
        os.kill(k.pid, signal.SIGKILL)  # bwrap, from outside the sandbox: its whole namespace dies with it
        killed.append(k)

    async with policy_over_http(slow_then_answer) as (server, client):
        pool = Tracked(stack.pool)
        env = Services(cfg, client, pool, stack.tools, TOK, qa_envs(cfg))

        async def killer():
            for i in range(4):
                k = await pool.acquired_kernels.get()
                if i in victims:
                    asyncio.ensure_future(kill_later(k, rng.uniform(0.5, 1.5)))

        kill_task = asyncio.ensure_future(killer())
        batch = await asyncio.wait_for(collect_batch(env, ListStream(tasks("slow a", "slow b")), cfg.rollout, False), 90)
        await kill_task
    assert len(killed) == 3 and not any(k.is_alive() for k in killed)
    assert_well_formed(batch, 2, 2)
    assert all(answered_ok(e) for e in batch.episodes)
    assert all(e.steps[0].observation.startswith("<output>\nwoke\n") for e in batch.episodes)
    assert batch.stats["env_retries"] == 3 and batch.stats["episodes_masked"] == 0
    assert pool.acquired == pool.released == 7 and pool.in_use == 0


def crash_or_answer(question, step, count):
    if step == 1 and question.startswith("crash"):
        return act("exit now", "import os; os._exit(1)")
    return default_script(question, step, count)


@real
async def test_a_kernel_killed_by_its_own_code_is_the_agents_failure_not_masked(stack):
    """os._exit in the agent's cell: scored as a failure (no retry, no mask), or the policy would
    learn to kill its kernel whenever it is about to be wrong."""
    cfg = config(batch_size=2, n_samples=2, max_retries=1)
    async with policy_over_http(crash_or_answer) as (server, client):
        pool = Tracked(stack.pool)
        env = Services(cfg, client, pool, stack.tools, TOK, qa_envs(cfg))
        batch = await asyncio.wait_for(collect_batch(env, ListStream(tasks("crash", "fine")), cfg.rollout, False), 90)
    assert_well_formed(batch, 2, 2)
    crashed = [e for e in batch.episodes if e.task.question == "crash"]
    assert len(crashed) == 2 and all(e.status == KERNEL_CRASHED and not e.masked for e in crashed)
    assert all("it exited with status 1" in e.error and e.rewards["core"] == 0 for e in crashed)
    assert all(answered_ok(e) for e in batch.episodes if e.task.question == "fine")
    assert batch.stats["env_retries"] == 0 and batch.stats["episodes_masked"] == 0
    assert pool.acquired == pool.released == 4
    rows = training_rows(batch.episodes, cfg.algo)
    assert len(rows) == 4 and all(sum(r.mask) > 0 for r in rows)  # the crashes train, as failures


def search_for(question, step, count):
    if step == 1:
        return act("search first", f"r = web_search({question.split()[0]!r}); print(len(r))")
    return ANSWER


@pytest.mark.slow
@real
async def test_search_backend_errors_and_stalls_are_environment_failures(stack):
    """A backend that fails every search, the tool server's probe included (a query only it fails is the agent's:
    test_adversarial.py's test 22), is the environment's failure: four `boom` episodes fail their first attempts (the
    retries work), four `stall` ones never get an answer (masked)."""
    stack.backend.failures_left = 4
    cfg = config(batch_size=2, n_samples=2, max_retries=1)
    batches, pool = [], Tracked(stack.pool)
    async with policy_over_http(search_for) as (server, client):
        env = Services(cfg, client, pool, stack.tools, TOK, qa_envs(cfg))
        for questions in (("boom", "boom again"), ("stall", "stall again")):  # all at once: the backend is down
            stream = ListStream(tasks(*questions))
            batches.append(await asyncio.wait_for(collect_batch(env, stream, cfg.rollout, False), 90))
    stack.backend.hung = False
    for batch in batches:
        assert_well_formed(batch, 2, 2)
        assert batch.stats["env_retries"] == 4
    assert all(answered_ok(e) and e.steps[0].exec_ok for e in batches[0].episodes)
    for e in batches[1].episodes:  # the agent answered, but its search never came back: not the policy's fault
        assert e.status == ENV_ERROR and e.masked and "did not answer within 1 s" in e.error
        assert "ToolError" in e.steps[0].observation
    assert stack.backend.failures_left == 0 and batches[1].stats["episodes_masked"] == 4
    assert pool.acquired == pool.released == 16


# ---------------------------------------------------------------------------------------------
# part 2: the collector's logic on in-process fake kernels


def fake_env(cfg: Config, policy) -> Services:
    pool = Tracked(FakeKernels())
    return Services(cfg, policy, pool, pool.inner.tools, TOK, qa_envs(cfg))


async def test_inference_server_stopped_and_restarted_mid_rollout():
    cfg = config(batch_size=4, n_samples=2)
    async with policy_over_http(delay=0.2) as (server, client):
        env = fake_env(cfg, client)
        rollout = asyncio.ensure_future(collect_batch(env, ListStream(tasks(*"abcd")), cfg.rollout, False))
        while server.requests < 4 or not server.in_flight:  # some on their second step, others on the first
            await asyncio.sleep(0.01)
        dropped = server.in_flight
        await server.stop()  # requests in flight are dropped
        await asyncio.sleep(1.0)
        assert not rollout.done()
        await server.start()  # the same port
        batch = await asyncio.wait_for(rollout, 30)
    assert_well_formed(batch, 4, 2)
    assert all(answered_ok(e) for e in batch.episodes)
    assert dropped >= 1 and server.requests >= 16 and batch.stats["episodes_masked"] == 0
    assert env.kernels.in_use == 0


@pytest.mark.slow  # waits out the client's retries until inference.down_after (~3 s): make test, not test-fast
async def test_inference_server_down_for_good_stops_with_inference_down():
    cfg = config(batch_size=4, n_samples=2)
    cfg.inference.down_after = 1.0
    async with policy_over_http(delay=0.2, cfg=cfg) as (server, client):
        env = fake_env(cfg, client)
        rollout = asyncio.ensure_future(collect_batch(env, ListStream(tasks(*"abcd")), cfg.rollout, False))
        while server.requests < 4:
            await asyncio.sleep(0.01)
        await server.stop()
        with pytest.raises(InferenceDown, match=r"unreachable for 1 s \(inference.down_after\)"):
            await asyncio.wait_for(rollout, 30)
        assert env.kernels.in_use == 0  # every episode has stopped and released its kernel
        acquired = env.kernels.acquired
        await asyncio.sleep(0.3)
    assert env.kernels.in_use == 0 and env.kernels.acquired == acquired  # and none goes on in the background
    assert env.counters["inference_pauses"] >= 1


def refuse(question, step, count):
    return None if question == "refused" else default_script(question, step, count)


async def test_refused_requests_are_retried_then_masked():
    cfg = config(batch_size=2, n_samples=2, max_retries=2)
    async with policy_over_http(refuse) as (server, client):
        env = fake_env(cfg, client)
        batch = await asyncio.wait_for(collect_batch(env, ListStream(tasks("refused", "fine")), cfg.rollout, False), 30)
    assert_well_formed(batch, 2, 2)
    refused = [e for e in batch.episodes if e.task.question == "refused"]
    assert all(e.status == INFERENCE_ERROR and e.masked and "HTTP 400" in e.error for e in refused)
    assert all(answered_ok(e) for e in batch.episodes if e.task.question == "fine")
    assert batch.stats["inference_retries"] == 4 and batch.stats["episodes_masked"] == 2
    assert server.counts["refused", 1] == 6  # 2 episodes x (1 + 2 retries), then it gives up


def mixed_or_same(question, step, count):
    """"mixed" groups alternate right / wrong answers (variance); the others always answer 42 (none)."""
    if step == 1:
        return SEARCH
    return act("answer now", f"submit_final_answer({'42' if count % 2 == 0 or 'mixed' not in question else 'no'!r})")


@pytest.mark.parametrize(
    "order, max_extra, dynamic, kept, counts",
    [
        # the first group has no variance: dropped, one extra group replaces it
        (["same 0", "mixed 1", "mixed 2"], 16, True, {"mixed_1", "mixed_2"},
         dict(groups_launched=3, groups_dropped_ds=1, groups_topped_up=0)),
        # the extra-group cap is reached: the batch is topped up with the last dropped group
        (["same 0", "mixed 1", "same 2", "same 3", "mixed 4"], 2, True, {"mixed_1", "same_3"},
         dict(groups_launched=4, groups_dropped_ds=3, groups_topped_up=1)),
        # without dynamic sampling every group is kept
        (["same 0", "mixed 1", "mixed 2"], 16, False, {"same_0", "mixed_1"},
         dict(groups_launched=2, groups_dropped_ds=0, groups_topped_up=0)),
    ],
)  # fmt: skip
async def test_dynamic_sampling_drops_groups_without_variance(order, max_extra, dynamic, kept, counts):
    cfg = config(batch_size=2, n_samples=2, max_extra_groups=max_extra)
    env = fake_env(cfg, ScriptedPolicyServer(mixed_or_same))
    batch = await asyncio.wait_for(collect_batch(env, ListStream(tasks(*order)), cfg.rollout, dynamic), 30)
    assert_well_formed(batch, 2, 2)
    assert {e.task.id for e in batch.episodes} == kept
    assert {k: batch.stats[k] for k in counts} == counts
    for eps in groups_of(batch).values():
        if "mixed" in eps[0].task.id:
            assert sorted(e.rewards["core"] for e in eps) == [0.1, 1.0]  # right and wrong: a learning signal
    assert env.kernels.in_use == 0


def slow_or_fast(question, step, count):
    if step == 1 and question.startswith("slow"):
        return act("take forever", "sleep(60)")
    return default_script(question, step, count)


async def test_over_sampled_groups_cancel_the_stragglers():
    cfg = config(batch_size=2, n_samples=1, over_sample_groups=2)
    env = fake_env(cfg, ScriptedPolicyServer(slow_or_fast))
    stream = ListStream(tasks("fast 0", "slow 1", "fast 2", "slow 3"))
    batch = await asyncio.wait_for(collect_batch(env, stream, cfg.rollout, dynamic_sampling=False), 10)
    assert_well_formed(batch, 2, 1)
    assert {e.task.id for e in batch.episodes} == {"fast_0", "fast_2"}
    assert batch.stats["groups_launched"] == 4 and batch.stats["stragglers_cancelled"] == 2
    assert env.kernels.acquired == 4 and env.kernels.in_use == 0  # the stragglers gave their kernels back


def first_sample_sleeps(question, step, count):
    if step == 1 and count == 0:
        return act("take forever", "sleep(60)")
    return default_script(question, step, count)


@pytest.mark.parametrize("budget", ["agent.max_wall_seconds", "rollout.episode_timeout"])
async def test_timeouts_are_dropped_up_to_the_cap_then_kept(budget):
    """One episode of each of 3 groups times out; at most int(0.34 * 6) = 2 may be dropped."""
    cfg = config(batch_size=3, n_samples=2, max_dropped_frac=0.34)
    section, key = budget.split(".")
    setattr(getattr(cfg, section), key, 1.0)
    env = fake_env(cfg, ScriptedPolicyServer(first_sample_sleeps))
    batch = await asyncio.wait_for(collect_batch(env, ListStream(tasks("a", "b", "c")), cfg.rollout, False), 30)
    assert batch.stats["timeouts_dropped"] == 2 and batch.stats["timeouts_kept"] == 1
    assert len(batch.episodes) == 4 and sorted(groups_of(batch)) == [0, 1, 2]
    timeouts = [e for e in batch.episodes if e.status == TIMEOUT]
    assert len(timeouts) == 1 and not timeouts[0].masked  # past the cap: trained as the failure it is
    assert sum(answered_ok(e) for e in batch.episodes) == 3


async def test_an_exception_from_score_fails_its_episode_never_the_run():
    """Issue 34: an OverflowError from math's grader escaped run_one and collect_batch and ended training. Raised
    on the agent's answer, the episode is scored as unanswered (trained on, not masked); raised on every answer
    (the environment's bug), the episode is masked; the batch is collected either way."""
    from l0_min.envs.qa import QA

    class Fragile(QA):
        def score(self, ep):
            if ep.task.question == "broken" or ep.final_answer == "42":
                raise OverflowError("integer division result too large for a float")
            return super().score(ep)

    cfg = config(batch_size=2, n_samples=2)
    env = fake_env(cfg, ScriptedPolicyServer())
    env.envs = {"qa": Fragile(cfg)}
    batch = await asyncio.wait_for(collect_batch(env, ListStream(tasks("answer", "broken")), cfg.rollout, False), 30)
    assert_well_formed(batch, 2, 2)
    for e in batch.episodes:
        assert e.final_answer == "42" and e.rewards["core"] == 0.0 and "OverflowError" in e.error, (e.status, e.error)
        broken = e.task.question == "broken"
        assert (e.status, e.masked) == ((ENV_ERROR, True) if broken else (ANSWERED, False))
        assert ("on the answer" in e.error) != broken and e.reward > 0  # format and execution still count
    assert batch.stats["episodes_masked"] == 2 and env.kernels.in_use == 0


async def test_resampled_groups_start_from_the_experts_first_steps_which_are_never_trained():
    """Issue 36, chunk-initialization resampling (rollout.resample): a group starts from the first k steps of its
    task's expert (k drawn per group, 1 .. its steps - 1; every sample of the group from the same state); those
    steps are context: no reward, mask 0 in the training rows whatever their advantage, counted per k."""
    from l0_min.envs.qa import QA
    from l0_min.episode import segment_rows
    from l0_min.log import batch_metrics

    expert = [act("look", 'print("a")'), act("peek", 'print("b")'), ANSWER]  # thoughts too short to be well formed

    class WithExpert(QA):
        def expert(self, task):
            return expert

    cfg = config(batch_size=8, n_samples=2, resample=1.0)
    cfg.reward.min_think_chars = 5  # the policy's "answer now" is well formed, the expert's "look" is not
    env = fake_env(cfg, ScriptedPolicyServer())
    env.envs = {"qa": WithExpert(cfg)}
    batch = await asyncio.wait_for(collect_batch(env, ListStream(tasks(*"abcdefgh")), cfg.rollout, False), 30)
    assert_well_formed(batch, 8, 2)
    ks = [{e.prefix_steps for e in eps} for eps in groups_of(batch).values()]
    assert all(len(k) == 1 for k in ks) and set().union(*ks) == {1, 2}, ks  # one state per group; both lengths drawn
    for e in batch.episodes:
        k = e.prefix_steps
        assert [s.prefix for s in e.steps] == [True] * k + [False] * (len(e.steps) - k)
        assert [s.action_text for s in e.steps[:k]] == expert[:k] and e.final_answer == "42"
        assert all(s.reward == 0.0 for s in e.steps[:k]) and e.rewards["format"] == 1.0  # only its own steps count
        (row,) = segment_rows(e, [1.0] * len(e.steps))
        for s in e.steps:
            span = row.mask[len(s.context_ids) : len(s.context_ids) + len(s.action_ids)]
            assert set(span) == ({0.0} if s.prefix else {1.0})
    assert sum(r.mask.count(0.0) < len(r.mask) for r in training_rows(batch.episodes, cfg.algo)) == 16
    m = batch_metrics(batch.episodes, env.envs)
    assert m["resample/k1/episodes"] + m["resample/k2/episodes"] == 16 and m["resample/k2/solved"] == m["resample/k2/episodes"]
    cfg.rollout.resample = 0.0  # off: no group starts from a prefix
    batch = await asyncio.wait_for(collect_batch(env, ListStream(tasks("a")), cfg.rollout, False), 30)
    assert all(e.prefix_steps == 0 for e in batch.episodes)


async def test_run_tasks_returns_every_sample_in_task_order():
    cfg = config(max_concurrency=3)
    env = fake_env(cfg, ScriptedPolicyServer(delay=0.01))
    seen = []

    async def on_episode(ep):
        seen.append((ep.group, ep.sample))

    eps = await asyncio.wait_for(run_tasks(env, tasks("a", "b", "c"), 2, on_episode=on_episode), 30)
    assert [(e.task.id, e.group, e.sample) for e in eps] == [(t, g, s) for g, t in enumerate("abc") for s in range(2)]
    assert sorted(seen) == [(g, s) for g in range(3) for s in range(2)] and all(answered_ok(e) for e in eps)
    assert env.kernels.peak == 3  # max_concurrency


# ---------------------------------------------------------------------------------------------
# the task stream


def test_task_stream_is_seeded_shuffled_per_epoch_and_resumable():
    items = tasks(*"abcde")
    s, again = TaskStream(items, seed=3), TaskStream(items, seed=3)
    seq = [s.next().id for _ in range(15)]
    assert [again.next().id for _ in range(15)] == seq and seq[:5] != seq[5:10]
    for e in range(3):
        assert sorted(seq[5 * e : 5 * e + 5]) == list("abcde")  # each epoch is a permutation
    other = TaskStream(items, seed=4)
    assert [other.next().id for _ in range(15)] != seq
    for k in range(15):  # a resumed stream continues exactly where the old one was
        resumed = TaskStream(items, seed=3, position=k)
        assert [resumed.next().id for _ in range(15 - k)] == seq[k:]
    rewound = TaskStream(items, seed=3)
    for _ in range(7):
        rewound.next()
    rewound.position = 3  # train.py rewinds after a cancelled rollout, across an epoch boundary here
    assert [rewound.next().id for _ in range(12)] == seq[3:]
    with pytest.raises(ValueError, match="data.train"):
        TaskStream([])


def test_scripted_policy_uses_the_tiny_random_token_ids():
    from bench.scripted_policy import dec, enc

    text = SEARCH + "<|im_start|>user\n<output>\ncafé\n</output>"
    assert enc(text) == TOK.encode(text, add_special_tokens=False) and dec(enc(text)) == text


# ---------------------------------------------------------------------------------------------
# rollout/training overlap (collect.Batches) and staleness (collect.drop_stale)


class VersionedPolicy:
    """Step 1 runs a cell, step 2 submits; each generation reports the server's current weight version."""

    def __init__(self, delay: float):
        self.version, self.delay = "0", delay

    async def health(self):
        return True

    async def generate(self, input_ids, sampling):
        await asyncio.sleep(self.delay)
        step = TOK.decode(input_ids).count("<output>")  # observations so far (the system prompt names <output> once)
        text = act("run a cell first", "x = 1") if step < 2 else act("submit the answer", "submit_final_answer('42')")
        ids = TOK.encode(text, add_special_tokens=False)
        return Generation(ids, [-0.1] * len(ids), "stop", "</code>", weight_version=self.version)


@pytest.mark.parametrize("k", [1, 2])
async def test_overlap_collects_ahead_and_staleness_never_exceeds_k(k):
    cfg = config(batch_size=2, n_samples=2)
    policy = VersionedPolicy(delay=0.05)
    cfg.rollout.overlap = k
    batches = Batches(fake_env(cfg, policy), ListStream(tasks(*"abcdefgh")), cfg.rollout, False)
    straddling = 0
    try:
        for step in range(5):  # the learner holds weights version `step` and trains on the next batch
            batch = await asyncio.wait_for(batches.next(step), 30)  # drop_stale(version=step, max_lag=k) inside
            assert batch.stats["stale_dropped"] == 0 and len(batch.episodes) == 4
            assert max(int(key[4:]) for key in batch.stats if key.startswith("lag/")) <= k
            straddling += any(len({s.weight_version for s in e.steps}) > 1 for e in batch.episodes)
            await asyncio.sleep(0.07)  # "training": the producer goes on collecting meanwhile
            policy.version = str(step + 1)  # weight sync between generation requests
    finally:
        await batches.close()
    assert straddling > 0  # episodes in flight across an update keep each step's own version
    assert batches.producer.done()


async def test_a_batch_older_than_k_versions_is_dropped_and_counted():
    cfg = config(batch_size=2, n_samples=2)
    policy = VersionedPolicy(delay=0.0)
    cfg.rollout.overlap = 1
    batches = Batches(fake_env(cfg, policy), ListStream(tasks(*"abcd")), cfg.rollout, False)
    try:
        batch = await asyncio.wait_for(batches.next(2), 30)  # generated by version 0, trained at 2
    finally:
        await batches.close()
    assert batch.episodes == [] and batch.stats["stale_dropped"] == 4 and batch.stats["lag/2"] > 0
