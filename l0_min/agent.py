"""The NB-Agent episode loop: think, write Python, read the output, repeat until submit_final_answer.

    context ids --policy.generate--> action ids + log-probs (stop at </code>)
      -> decode -> parse <think>...</think><code>...</code> -> kernel.execute(code)
      -> the cell's output -> the context watcher adds "<output>...</output> + budget note"

A Step keeps the context ids sent and the action ids and log-probs returned (text is decoded for parsing and display
only). The episode ends with a final answer the tool server recorded, or on a budget (docs/internals.md).
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from dataclasses import dataclass
from typing import Protocol

from l0_min.config import Config
from l0_min.context import ContextWatcher, chat_format
from l0_min.episode import (ANSWERED, ENV_ERROR, INFERENCE_ERROR, KERNEL_CRASHED, MAX_STEPS, MAX_TOKENS, TIMEOUT,
                            Episode, Step, Task)
from l0_min.inference import Generation, InferenceError, episode_key
from l0_min.rewards import THINK


class Policy(Protocol):
    async def generate(self, input_ids: list[int], sampling: dict) -> Generation: ...
    async def health(self) -> bool: ...


class Kernel(Protocol):
    id: str

    async def execute(self, code: str, timeout: float | None = None): ...  # -> sandbox.kernel.ExecResult
    async def read_notepad(self) -> str: ...


class Tools(Protocol):
    """The host's record of an episode's tool calls, keyed by kernel id."""

    def allow(self, key: str, tools: tuple[str, ...]) -> None: ...  # the search tools the episode's task gets
    def final_answer(self, key: str) -> str | None: ...
    def tool_calls(self, key: str) -> dict[str, int]: ...
    def served(self, key: str) -> list[tuple[str, str]]: ...  # (tool, page) pairs, in order
    def backend_errors(self, key: str) -> list[str]: ...


STOP = "</code>"


# ---------------------------------------------------------------------------- parsing an action
@dataclass
class Parsed:
    think: str = ""
    code: str = ""  # "" when there is nothing to run
    error: str = ""  # what was wrong with the format, for the observation ("" when nothing was)


_FENCE = re.compile(r"^\s*```[a-zA-Z0-9_]*\s*\n(.*?)\n?\s*```\s*$", re.DOTALL)


def parse_action(text: str, finish_reason: str = "stop", matched_stop=None) -> Parsed:
    """Split an action into think and code; tolerant, never raises. The code of a closed (or stop-trimmed)
    <code> block runs even when the format is wrong (whether it is well formed is the reward's rule:
    rewards.format_ok, applied in score_episode).

    >>> p = parse_action("<think>add the numbers</think>\\n<code>print(1+1)</code>")
    >>> p.think, p.code
    ('add the numbers', 'print(1+1)')
    >>> parse_action("<think>add</think><code>print(1+", "length").error
    'the action was cut off by the token limit before </code>; write shorter steps'
    """
    m = THINK.search(text)
    think = m.group(1).strip() if m else ""
    after_think = text[m.end() :] if m else text
    start = after_think.find("<code>")
    if start < 0:
        why = "no <code>...</code> block" + ("" if m else " and no <think>...</think> block")
        return Parsed(think, error=why + (" before the token limit" if finish_reason == "length" else ""))
    body = after_think[start + len("<code>") :]
    end = body.find(STOP)
    if end >= 0:
        body = body[:end]
    elif finish_reason == "length":
        return Parsed(think, error="the action was cut off by the token limit before </code>; write shorter steps")
    elif not (finish_reason == "stop" and matched_stop == STOP):  # else the server trimmed the stop string
        return Parsed(think, error="the <code> block was not closed with </code>")
    fence = _FENCE.match(body)
    code = (fence.group(1) if fence else body).strip("\n")
    if not code.strip():
        return Parsed(think, error="the <code> block is empty")
    if not m:
        return Parsed("", code, error="start each step with <think>...</think>")
    return Parsed(think, code)


def sampling_params(cfg: Config, room: int) -> dict:
    s = cfg.sampling
    return {"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k,
            "max_new_tokens": max(1, min(s.max_new_tokens, room)), "stop": [STOP]}


# ---------------------------------------------------------------------------------- the episode
async def run_episode(task: Task, env, policy: Policy, kernel: Kernel, tools: Tools, tokenizer, cfg: Config) -> Episode:
    """Run one NB-Agent episode of `env` on a kernel the caller acquired, prepared and will release."""
    t0 = time.monotonic()
    ep = Episode(task=task)
    episode_key.set(f"{task.id}#{uuid.uuid4().hex[:12]}")  # its requests go to one server (its prefix cache)
    examples = env.worked_example if cfg.agent.worked_example else ()
    task_text = f"{env.prompt(task)}\nYou have {cfg.agent.max_steps} steps."  # the environment's prompt, the budget
    ctx = ContextWatcher(chat_format(tokenizer), env.system_prompt, task_text, cfg.agent, cfg.sampling.max_new_tokens,
                         examples)
    try:
        ep.status = await _loop(ep, ctx, policy, kernel, tools, cfg, t0 + cfg.agent.max_wall_seconds)
    finally:
        ep.truncations = ctx.truncations
        ep.weight_version = ep.steps[0].weight_version if ep.steps else ""
        ep.tool_calls = dict(tools.tool_calls(kernel.id))
        ep.seconds = time.monotonic() - t0
    return ep


class _End(Exception):
    """The episode ends before its steps run out: its status and why."""

    def __init__(self, status: str, error: str = ""):
        super().__init__(error)
        self.status, self.error = status, error


async def _loop(ep: Episode, ctx: ContextWatcher, policy: Policy, kernel: Kernel, tools: Tools, cfg: Config,
                deadline: float) -> str:
    a = cfg.agent
    out_of_time = _End(TIMEOUT, f"the wall-time budget of {a.max_wall_seconds:g} s was spent")
    try:
        for n in range(a.max_steps):
            if time.monotonic() >= deadline:
                raise out_of_time
            if ctx.needs_rebuild():  # 1. make room for the next action (a new segment), or stop
                await _make_room(ctx, kernel, a, deadline, out_of_time)
            t_step = time.monotonic()  # 2. sample an action
            context_ids = list(ctx.ids)
            gen = await _generate(policy, context_ids, sampling_params(cfg, ctx.room()), deadline, out_of_time)
            text = a.prefill + ctx.chat.decode(gen.output_ids)  # the prefill is context, shown with the action
            p = parse_action(text, gen.finish_reason, gen.matched_stop)
            step = Step(context_ids, list(gen.output_ids), list(gen.logprobs), text, p.think, p.code,
                        finish_reason=gen.finish_reason, weight_version=gen.weight_version, segment=ctx.segment)
            ep.steps.append(step)
            res = None  # 3. run the code
            if p.code:
                served = len(tools.served(kernel.id))
                try:  # a cell ends by the episode's deadline
                    res = await kernel.execute(p.code, max(0.1, min(cfg.kernel.exec_timeout, deadline - time.monotonic())))
                except Exception as e:
                    step.seconds = time.monotonic() - t_step
                    raise _End(ENV_ERROR, f"kernel.execute failed: {type(e).__name__}: {e}") from None
                step.served, step.exec_ok = tools.served(kernel.id)[served:], bool(res.ok)
                output = res.text(a.max_observation_chars).strip("\n") or "(no output)"
                output += f"\nFormat note: {p.error}." if p.error else ""
            else:
                output = f"Format error: {p.error}. Write <think>...</think> then <code>...</code>; nothing was run."
            # 4. did it end? else the observation goes back into the context, with a budget note
            if (answer := tools.final_answer(kernel.id)) is not None or (res is not None and res.dead):
                ep.final_answer = answer
                step.observation = f"<output>\n{output}\n</output>" + "\n[final answer recorded]" * (answer is not None)
                step.seconds = time.monotonic() - t_step
                if answer is not None:
                    return ANSWERED
                raise _End(KERNEL_CRASHED if res.crashed else ENV_ERROR, "the kernel died: " + output[-300:])
            step.observation = ctx.add_step(step.action_ids, output, a.max_steps - (n + 1))
            step.seconds = time.monotonic() - t_step
            if time.monotonic() >= deadline:
                raise out_of_time
    except _End as end:
        ep.error = end.error
        return end.status
    return MAX_STEPS


async def _make_room(ctx: ContextWatcher, kernel: Kernel, a, deadline: float, out_of_time: _End) -> None:
    """Rebuild a full context around the notepad (read from the kernel), or end the episode saying why."""
    if not a.context_rebuild:
        raise _End(MAX_TOKENS, f"context full: {len(ctx.ids)} of {a.max_context_tokens} tokens used")
    try:
        notepad = await asyncio.wait_for(kernel.read_notepad(), deadline - time.monotonic())
    except asyncio.TimeoutError:
        raise out_of_time from None
    except Exception as e:  # the kernel died (KernelDied.crashed: by the agent's own doing)
        raise _End(KERNEL_CRASHED if getattr(e, "crashed", False) else ENV_ERROR,
                   f"reading the notepad failed: {type(e).__name__}: {e}") from None
    if not ctx.rebuild(notepad):
        raise _End(MAX_TOKENS, f"the rebuilt context (system, task, notepad of {len(notepad)} chars) leaves less than "
                               f"{ctx.min_room} of {a.max_context_tokens} tokens for an action")


async def _generate(policy: Policy, context_ids: list[int], sampling: dict, deadline: float, out_of_time: _End):
    """The policy's action for the context, or the end of the episode (out of time, the server failed)."""
    try:
        gen = await asyncio.wait_for(policy.generate(context_ids, sampling), deadline - time.monotonic())
    except asyncio.TimeoutError:
        raise out_of_time from None
    except InferenceError as e:
        raise _End(INFERENCE_ERROR, f"{type(e).__name__}: {e}") from None
    if gen.finish_reason == "abort":
        raise _End(INFERENCE_ERROR, "the inference server aborted the request")
    if len(gen.logprobs) != len(gen.output_ids) or not gen.output_ids:
        raise _End(INFERENCE_ERROR, f"bad generation: {len(gen.output_ids)} ids, {len(gen.logprobs)} log-probs")
    return gen
