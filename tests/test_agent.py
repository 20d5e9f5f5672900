"""The NB-Agent episode loop, driven by a scripted policy.

Part 1 runs the loop against an in-process fake kernel (fast: parsing, budgets, errors, token-in/
token-out). Part 2 runs it against real sandboxed kernels with the real tool server and a BM25 corpus.
"""

from __future__ import annotations


import pytest
import pytest_asyncio

from l0_min.agent import parse_action, run_episode
from l0_min.config import Config
from l0_min.envs.qa import QA, SYSTEM_PROMPT, WORKED_EXAMPLE
from l0_min.rewards import score_episode
from l0_min.episode import (
    ANSWERED,
    ENV_ERROR,
    INFERENCE_ERROR,
    KERNEL_CRASHED,
    MAX_STEPS,
    MAX_TOKENS,
    TIMEOUT,
    Task,
    segment_rows,
)
from l0_min.inference import InferenceError
from l0_min.sandbox.pool import KernelPool
from l0_min.search import BM25Backend
from l0_min.sandbox.tools import ToolServer
from tests.fakes import TOK, FakeKernel, FakeTools, ScriptedPolicy, dec, enc


def act(think: str, code: str) -> str:
    return f"<think>{think}</think>\n<code>{code}</code>"


def config(**agent) -> Config:
    cfg = Config()
    cfg.agent.max_steps = agent.pop("max_steps", 6)
    cfg.agent.max_context_tokens = agent.pop("max_context_tokens", 4096)
    for k, v in agent.items():
        setattr(cfg.agent, k, v)
    cfg.sampling.max_new_tokens = 256
    cfg.reward.min_think_chars = cfg.reward.min_code_chars = 0  # format_ok: the structure only (thresholds: test_rewards)
    return cfg


TASK = Task("t1", "What is 6 times 7?", ["42"])


async def fake_episode(actions, cfg=None, **policy_kw):
    tools = FakeTools()
    kernel = FakeKernel(tools)
    policy = ScriptedPolicy(actions, **policy_kw)
    cfg = cfg or config()
    ep = await run_episode(TASK, QA(cfg), policy, kernel, tools, TOK, cfg)
    score_episode(ep, cfg.reward, QA(cfg))  # as the collector does: the reward judges each step's format
    return ep, policy, kernel


def assert_append_only(ep):
    """Within a segment each context is the previous context + action + observation ids."""
    for a, b in zip(ep.steps, ep.steps[1:]):
        if a.segment == b.segment:
            assert b.context_ids[: len(a.context_ids) + len(a.action_ids)] == a.context_ids + a.action_ids
            obs = dec(b.context_ids[len(a.context_ids) + len(a.action_ids) :])
            assert obs == f"<|im_end|>\n<|im_start|>user\n{a.observation}<|im_end|>\n<|im_start|>assistant\n"


# ---------------------------------------------------------------------------------------------
# part 1: the loop with a fake kernel


def test_system_prompt_explains_the_format_and_tools():
    for s in ("<think>", "</think>", "<code>", "</code>", "<output>", "web_search(", "read_page(", "notepad",
              "render()", "submit_final_answer(", "Only this ends the task"):
        assert s in SYSTEM_PROMPT
    assert len(SYSTEM_PROMPT) < 1200  # it is paid for in every context


def test_parse_action_variants():
    # the code of a closed block runs even when the format is wrong (the reward's rule: test_rewards.py)
    p = parse_action("<think>plan the steps</think>\n<code>x = 1\nprint(x)</code>")
    assert (p.think, p.code, p.error) == ("plan the steps", "x = 1\nprint(x)", "")
    p = parse_action("<think>plan the steps</think><code>\n```python\nprint(2)\n```\n</code>")
    assert p.code == "print(2)"
    p = parse_action("<think>plan</think>\n<code>x = 1\nprint(x)</code>")  # a think of 4 characters
    assert p.code == "x = 1\nprint(x)" and p.error == ""
    p = parse_action("<code>print(3)</code>")  # runs, but the format is wrong
    assert p.code == "print(3)" and "think" in p.error
    p = parse_action("<think>plan the steps</think><code>print(4)", "length")
    assert p.code == "" and "cut off by the token limit" in p.error
    p = parse_action("<think>plan the steps</think><code>print(5)", "stop", "</code>")  # server trimmed the stop string
    assert p.code == "print(5)"
    p = parse_action("<think>t</think><code>print(6)", "stop", 1)  # EOS before </code>
    assert p.code == "" and "not closed" in p.error
    p = parse_action("I think the answer is 42.")
    assert p.code == "" and p.error == "no <code>...</code> block and no <think>...</think> block"
    p = parse_action("<think>t</think><code>  \n</code>")
    assert p.code == "" and p.error == "the <code> block is empty"


def test_observations_keep_head_and_tail_of_a_long_output():
    from l0_min.sandbox.toolbox._capture import trim

    s = "HEAD" + "x" * 5000 + "TAIL"
    t = trim(s, 200)
    assert len(t) <= 200 and t.startswith("HEADx") and t.endswith("xTAIL") and "[... 4,846 characters truncated ...]" in t  # 5008 - (200 - 38-char marker)
    assert trim("short", 200) == "short"


async def test_answered_episode_records_everything():
    ep, policy, kernel = await fake_episode([
        act("Multiply.", "x = 6 * 7\nprint(x)"),
        act("Submit it.", "submit_final_answer(str(x))"),
    ])
    assert ep.status == ANSWERED and ep.final_answer == "42" and ep.error == ""
    assert len(ep.steps) == 2 and ep.tool_calls == {"submit_final_answer": 1}
    s0, s1 = ep.steps
    assert [s.format_ok for s in ep.steps] == [True, True] and [s.exec_ok for s in ep.steps] == [True, True]
    assert (s0.think, s0.code) == ("Multiply.", "x = 6 * 7\nprint(x)")
    assert s0.observation.startswith("<output>\n42\n</output>\n[5 steps left, ~")
    assert s1.observation.endswith("[final answer recorded]")
    assert all(s.finish_reason == "stop" and s.weight_version == "w1" and s.segment == 0 for s in ep.steps)
    assert ep.weight_version == "w1" and ep.truncations == 0 and ep.seconds > 0 and s0.seconds > 0
    # the first context is the chat template's system + user turn with the generation prompt
    assert dec(s0.context_ids).startswith("<|im_start|>system\n" + SYSTEM_PROMPT + "<|im_end|>\n<|im_start|>user\nTask: What is 6 times 7?")
    assert dec(s0.context_ids).endswith("<|im_end|>\n<|im_start|>assistant\n")
    # what the policy was sent is exactly what the steps record
    assert [c for c, _ in policy.calls] == [s.context_ids for s in ep.steps]
    assert_append_only(ep)
    # the budget note counts the context tokens left after the observation itself
    left = int(s0.observation.split("~")[1].split(" ")[0])
    assert left == 4096 - len(s1.context_ids)
    row, = segment_rows(ep, [1.0, 2.0])
    assert row.ids == s1.context_ids + s1.action_ids
    assert sum(row.mask) == len(s0.action_ids) + len(s1.action_ids)


async def test_prefill_opens_every_assistant_turn_in_the_context_not_the_action():
    # with prefill "<think>" the policy continues an open think block; its ids are all it sampled
    cfg = config(prefill="<think>", max_steps=10, max_context_tokens=1300, min_action_tokens=64, keep_recent_steps=1)
    actions = ["Multiply six by seven.</think>\n<code>x = 6 * 7\nprint(x)</code>"]
    actions += [f"print a long line {i}</think><code>print('{i}' * 200)</code>" for i in range(6)]
    actions += ["Submit the product.</think><code>submit_final_answer(str(x))</code>"]
    ep, policy, _ = await fake_episode(actions, cfg)
    assert ep.status == ANSWERED and ep.final_answer == "42" and ep.truncations >= 1
    for s, a in zip(ep.steps, actions):
        assert dec(s.context_ids).endswith("<|im_start|>assistant\n<think>")  # also after a rebuild
        assert s.action_ids == enc(a) and s.action_text == "<think>" + a
        assert s.format_ok and s.think and s.code
    assert ep.steps[0].think == "Multiply six by seven."
    assert_rows_hold_sampled_ids(ep)
    for a, b in zip(ep.steps, ep.steps[1:]):  # append-only within a segment, the prefill after each observation
        if a.segment == b.segment:
            obs = dec(b.context_ids[len(a.context_ids) + len(a.action_ids) :])
            assert obs == f"<|im_end|>\n<|im_start|>user\n{a.observation}<|im_end|>\n<|im_start|>assistant\n<think>"
    # the reward recomputes format from action_text, which carries the prefill
    from l0_min.rewards import score_episode
    score_episode(ep, cfg.reward, QA(cfg))
    assert ep.rewards["format"] == 1.0


async def test_worked_example_sits_between_system_and_task_and_survives_a_rebuild():
    cfg = config(worked_example=True, max_steps=10, max_context_tokens=2600, min_action_tokens=64, keep_recent_steps=1)
    actions = [act(f"step {i}", f"print('{i}' * 200)") for i in range(6)] + [act("done", "submit_final_answer('42')")]
    ep, _, _ = await fake_episode(actions, cfg)
    assert ep.status == ANSWERED and ep.truncations >= 1
    example = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in WORKED_EXAMPLE)
    for s in (ep.steps[0], next(s for s in ep.steps if s.segment == 1)):
        text = dec(s.context_ids)
        assert text.startswith(f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n{example}<|im_start|>user\nTask: What is 6 times 7?")
    assert "Orlen Bridge" not in dec(ep.steps[0].context_ids).split("Task: What is 6 times 7?")[1]


async def test_sampling_params_follow_config_and_room():
    cfg = config(max_context_tokens=1400, min_action_tokens=64)
    cfg.sampling.temperature, cfg.sampling.top_p, cfg.sampling.top_k = 0.7, 0.9, 20
    ep, policy, _ = await fake_episode([act("a", "print(1)"), act("b", "submit_final_answer('1')")], cfg)
    (c0, s0), (c1, s1) = policy.calls
    assert len(c0) <= 1400 - 256 < len(c1)  # the prompt leaves 256 tokens of room, the second context less
    assert s0 == {"temperature": 0.7, "top_p": 0.9, "top_k": 20, "max_new_tokens": 256, "stop": ["</code>"]}
    assert s1["max_new_tokens"] == 1400 - len(c1)


async def test_printed_answer_is_not_a_final_answer():
    ep, _, _ = await fake_episode([act("say it", "print('submit_final_answer(42)')")] * 2, config(max_steps=2))
    assert ep.status == MAX_STEPS and ep.final_answer is None and len(ep.steps) == 2


async def test_malformed_actions_get_an_observation_saying_what_was_wrong():
    ep, _, kernel = await fake_episode([
        "The answer is 42.",  # no code at all
        "<think>t</think><code>print(1)",  # EOS-less, cut: ends without </code> -> "length"
        act("t", "   "),  # empty code
        "<code>print('no think')</code>",  # runs, format not ok
        act("ok", "submit_final_answer('42')"),
    ])
    assert ep.status == ANSWERED
    s = ep.steps
    assert [x.format_ok for x in s] == [False, False, False, False, True]
    assert [x.exec_ok for x in s] == [None, None, None, True, True]
    assert kernel.executed == ["print('no think')", "submit_final_answer('42')"]
    assert "Format error: no <code>...</code> block and no <think>...</think> block" in s[0].observation
    assert s[1].finish_reason == "length" and "cut off by the token limit before </code>" in s[1].observation
    assert "the <code> block is empty" in s[2].observation and "nothing was run" in s[2].observation
    assert s[3].observation.startswith("<output>\nno think\nFormat note: start each step with <think>")
    assert_append_only(ep)


async def test_code_error_is_shown_and_flagged():
    ep, _, _ = await fake_episode([act("t", "print(undefined_name)"), act("t", "submit_final_answer('x')")])
    assert ep.steps[0].exec_ok is False and "NameError" in ep.steps[0].observation
    assert ep.status == ANSWERED


async def test_long_output_is_trimmed_head_and_tail():
    cfg = config(max_observation_chars=300)
    ep, _, _ = await fake_episode([act("t", "print('A' + 'x' * 5000 + 'Z')"), act("t", "submit_final_answer('x')")], cfg)
    obs = ep.steps[0].observation
    body = obs[len("<output>\n") : obs.index("\n</output>")]
    assert len(body) <= 300 and body.startswith("Axxx") and body.endswith("xxZ") and "characters truncated" in body


async def test_step_budget():
    ep, _, _ = await fake_episode([act("t", f"print({i})") for i in range(3)], config(max_steps=3))
    assert ep.status == MAX_STEPS and len(ep.steps) == 3
    assert "[2 steps left" in ep.steps[0].observation
    assert "[1 step left: call submit_final_answer(...) now" in ep.steps[1].observation


async def test_wall_time_budget_while_generating():
    cfg = config(max_wall_seconds=0.5)
    ep, _, _ = await fake_episode([act("t", "print(1)")] * 10, cfg, delay=0.2)
    assert ep.status == TIMEOUT and 1 <= len(ep.steps) <= 3 and ep.seconds < 1.5
    assert ep.error == "the wall-time budget of 0.5 s was spent"


async def test_context_full_without_rebuild_is_max_tokens():
    cfg = config(max_context_tokens=1200, min_action_tokens=64, context_rebuild=False)
    ep, _, _ = await fake_episode([act("t", "print('x' * 300)")] * 10, cfg)
    assert ep.status == MAX_TOKENS and ep.truncations == 0 and "context full" in ep.error
    assert len(ep.steps[-1].context_ids) + 64 <= 1200  # no action was sampled without its room


async def test_context_rebuild_keeps_task_and_notepad():
    cfg = config(max_steps=12, max_context_tokens=1400, min_action_tokens=64, keep_recent_steps=1)
    actions = [act("note", "notepad.facts.append('the secret is 1234')")]
    actions += [act(f"step {i}", f"print('{i}' * 200)") for i in range(8)]
    actions += [act("done", "submit_final_answer('1234')")]
    ep, _, _ = await fake_episode(actions, cfg)
    assert ep.status == ANSWERED and ep.truncations >= 1
    first = next(s for s in ep.steps if s.segment == 1)
    text = dec(first.context_ids)
    assert "Task: What is 6 times 7?" in text and "- the secret is 1234" in text
    assert "were dropped to save space" in text and "Kernel variables and your notepad are kept" in text
    assert text.count("<|im_start|>system\n") == 1
    assert "notepad.facts.append" not in text  # the first step itself was dropped
    assert [s.segment for s in ep.steps] == sorted(s.segment for s in ep.steps)
    assert_append_only(ep)
    rows = segment_rows(ep, [0.5] * len(ep.steps))
    assert len(rows) == ep.truncations + 1 and all(len(r) <= 1400 for r in rows)


async def test_notepad_too_big_for_a_rebuild_is_max_tokens():
    cfg = config(max_context_tokens=1200, min_action_tokens=64)
    actions = [act("fill", "notepad.facts.append('y' * 2000)")] + [act("t", "print('z' * 300)")] * 10
    ep, _, _ = await fake_episode(actions, cfg)
    assert ep.status == MAX_TOKENS and "notepad of" in ep.error and ep.truncations == 0


async def test_inference_error_and_abort_end_the_episode():
    ep, _, _ = await fake_episode([act("t", "print(1)"), InferenceError("server down after 6 retries")])
    assert ep.status == INFERENCE_ERROR and "server down" in ep.error and len(ep.steps) == 1

    class Aborting(ScriptedPolicy):
        async def generate(self, input_ids, sampling):
            g = await super().generate(input_ids, sampling)
            g.finish_reason = "abort"
            return g

    tools = FakeTools()
    ep = await run_episode(TASK, QA(config()), Aborting([act("t", "print(1)")]), FakeKernel(tools), tools, TOK, config())
    assert ep.status == INFERENCE_ERROR and ep.steps == [] and "aborted" in ep.error


async def test_a_kernel_killed_by_its_own_code_is_kernel_crashed_any_other_failure_env_error():
    ep, _, _ = await fake_episode([act("t", "DIE")])
    assert ep.status == KERNEL_CRASHED and "kernel died" in ep.error and ep.steps[0].exec_ok is False
    ep, _, _ = await fake_episode([act("t", "LOST")])
    assert ep.status == ENV_ERROR and "kernel died" in ep.error
    ep, _, _ = await fake_episode([act("t", "RAISE")])
    assert ep.status == ENV_ERROR and "ConnectionError: zmq socket closed" in ep.error and len(ep.steps) == 1


# ---------------------------------------------------------------------------------------------
# token-in/token-out


def assert_rows_hold_sampled_ids(ep):
    rows = segment_rows(ep, [1.0] * len(ep.steps))
    by_seg = {}
    for s in ep.steps:
        by_seg.setdefault(s.segment, []).append(s)
    for row, seg in zip(rows, sorted(by_seg)):
        spans = []
        i = 0
        while i < len(row.mask):  # the masked-in spans of the row, in order
            if row.mask[i]:
                j = i
                while j < len(row.mask) and row.mask[j]:
                    j += 1
                spans.append((i, j))
                i = j
            else:
                i += 1
        # action spans are adjacent to observation tokens, so each span is exactly one action
        assert [row.ids[a:b] for a, b in spans] == [s.action_ids for s in by_seg[seg]]
        assert [row.old_logp[a:b] for a, b in spans] == [s.action_logprobs for s in by_seg[seg]]


async def test_training_ids_are_the_sampled_ids_bit_for_bit():
    # a lone UTF-8 lead byte (0xC3) decodes to nothing: decode/encode cannot give these ids back
    lone = enc("<think>caf") + [0xC3 + 3] + enc("</think>\n<code>print('ok')</code>")
    assert enc(dec(lone)) != lone
    # "é" = C3 A9 split across two actions: the first is cut by the token limit right after C3
    e_bytes = [b + 3 for b in "é".encode()]
    cut = enc("<think>caf") + e_bytes[:1]
    rest = e_bytes[1:] + enc("</think><code>submit_final_answer('café')</code>")
    assert enc(dec(cut)) != cut and enc(dec(rest)) != rest
    ep, policy, _ = await fake_episode([lone, cut, rest])
    assert ep.status == ANSWERED and ep.final_answer == "café"
    assert [s.action_ids for s in ep.steps] == [lone, cut, rest]
    assert ep.steps[1].finish_reason == "length" and ep.steps[1].format_ok is False
    assert ep.steps[0].code == "print('ok')" and ep.steps[0].exec_ok
    assert [s.action_logprobs for s in ep.steps] == [[-0.01 * (1 + i % 13) for i in range(len(a))] for a in (lone, cut, rest)]
    assert [c for c, _ in policy.calls] == [s.context_ids for s in ep.steps]
    assert_append_only(ep)
    assert_rows_hold_sampled_ids(ep)


# ---------------------------------------------------------------------------------------------
# part 2: real sandboxed kernels, the real tool server, a BM25 corpus

CORPUS = [
    {"id": "zorbia", "title": "Zorbia", "text": "Zorbia is a small island nation. Its capital is Quellton, founded in 1802."},
    {"id": "quellton", "title": "Quellton", "text": "Quellton is a port city with a lighthouse built in 1850."},
    {"id": "fish", "title": "Herring", "text": "The herring is a forage fish of the North Atlantic."},
]
ZTASK = Task("z1", "How many years before 2024 was the capital of Zorbia founded?", ["222"])
real = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def env():
    cfg = Config()
    cfg.kernel.pool_size = 2
    server = ToolServer(BM25Backend(CORPUS))
    await server.start()
    pool = KernelPool(cfg.sandbox, cfg.kernel, server)
    await pool.start()
    yield pool, server
    await pool.close()
    await server.close()


async def real_episode(env, actions, cfg, task=ZTASK):
    pool, server = env
    kernel = await pool.acquire()
    try:
        ep = await run_episode(task, QA(cfg), ScriptedPolicy(actions), kernel, server, TOK, cfg)
        score_episode(ep, cfg.reward, QA(cfg))
        return ep
    finally:
        await pool.release(kernel)


@real
async def test_real_kernel_search_read_note_compute_submit(env):
    ep = await real_episode(env, [
        act("Search first.", "r = web_search('capital of Zorbia', k=2)\nprint(r)"),
        act("Read the top page.", "page = read_page(r[0]['id'])\nprint(page)"),
        act("Note it.", "notepad.facts.append('Quellton founded 1802 (zorbia)')\nprint(notepad.render())"),
        act("Compute.", "years = 2024 - 1802\nyears"),
        act("Submit.", "submit_final_answer(str(years))"),
    ], config())
    assert ep.status == ANSWERED and ep.final_answer == "222" and ep.error == ""
    assert ep.tool_calls == {"web_search": 1, "read_page": 1, "submit_final_answer": 1}
    assert [s.exec_ok for s in ep.steps] == [True] * 5 and [s.format_ok for s in ep.steps] == [True] * 5
    obs = [s.observation for s in ep.steps]
    assert "[1] Zorbia (ref: zorbia)" in obs[0]
    assert "Its capital is Quellton, founded in 1802." in obs[1]
    assert "## Facts\n- Quellton founded 1802 (zorbia)" in obs[2]
    assert obs[3].startswith("<output>\n222\n</output>")
    assert "Final answer submitted: 222" in obs[4] and obs[4].endswith("[final answer recorded]")
    assert_append_only(ep)
    assert_rows_hold_sampled_ids(ep)


@real
async def test_real_kernel_errors_long_output_bad_format_and_step_budget(env):
    cfg = config(max_steps=4, max_observation_chars=500)
    ep = await real_episode(env, [
        act("Divide.", "1 / 0"),
        act("Print a lot.", "print('A' + 'x' * 20000 + 'Z')"),
        "I will just answer: submit_final_answer('222')",  # not code: nothing runs
        act("Only print it.", "print(\"submit_final_answer('222')\")"),
    ], cfg)
    assert ep.status == MAX_STEPS and ep.final_answer is None and len(ep.steps) == 4
    s = ep.steps
    assert [x.exec_ok for x in s] == [False, True, None, True]
    assert "ZeroDivisionError: division by zero" in s[0].observation
    body = s[1].observation[len("<output>\n") : s[1].observation.index("\n</output>")]
    assert len(body) <= 500 and body.startswith("Axxx") and body.endswith("xxZ") and "characters truncated" in body
    assert "Format error: no <code>...</code> block" in s[2].observation
    assert ep.tool_calls == {}  # printing the call's text is not calling it
    assert_append_only(ep)


@real
async def test_real_kernel_context_rebuild_keeps_task_notepad_and_variables(env):
    cfg = config(max_steps=12, max_context_tokens=2200, min_action_tokens=64, keep_recent_steps=1, max_observation_chars=400)
    actions = [act("Remember.", "secret = 'PELICAN'\nnotepad.facts.append('the code word is PELICAN')")]
    actions += [act(f"Look {i}.", f"print('{i}' * 300)") for i in range(6)]
    actions += [act("Submit from memory.", "submit_final_answer(secret)")]
    ep = await real_episode(env, actions, cfg)
    assert ep.status == ANSWERED and ep.final_answer == "PELICAN" and ep.truncations >= 1
    rebuilt = next(s for s in ep.steps if s.segment == 1)
    text = dec(rebuilt.context_ids)
    assert "Task: How many years before 2024 was the capital of Zorbia founded?" in text
    assert "## Facts\n- the code word is PELICAN" in text  # read from the live kernel
    assert "were dropped to save space" in text and "secret = 'PELICAN'" not in text
    assert all(len(s.context_ids) + 64 <= 2200 for s in ep.steps)
    assert_append_only(ep)
    assert_rows_hold_sampled_ids(ep)


@real
async def test_real_kernel_notepad_too_big_ends_with_max_tokens(env):
    cfg = config(max_context_tokens=1600, min_action_tokens=64, max_observation_chars=300)
    actions = [act("Hoard.", "notepad.facts.append('y' * 1000)")] + [act("Look.", "print('z' * 300)")] * 8
    ep = await real_episode(env, actions, cfg)
    assert ep.status == MAX_TOKENS and ep.truncations == 0 and "notepad of 1" in ep.error


@pytest.mark.slow  # waits out the 2 s wall-time budget in a real kernel: make test, not test-fast
@real
async def test_real_kernel_wall_time_budget_interrupts_a_long_cell(env):
    cfg = config(max_wall_seconds=2.0)
    ep = await real_episode(env, [act("Wait.", "import time\ntime.sleep(60)"), act("x", "print(1)")], cfg)
    assert ep.status == TIMEOUT and len(ep.steps) == 1 and ep.seconds < 10 and "wall-time budget" in ep.error
    assert ep.steps[0].exec_ok is False and "timed out" in ep.steps[0].observation


@real
async def test_real_kernel_killed_by_its_own_code_is_kernel_crashed(env):
    ep = await real_episode(env, [act("Exit.", "import os\nos._exit(1)")], config())
    assert ep.status == KERNEL_CRASHED and "it exited with status 1" in ep.error and ep.steps[0].exec_ok is False
