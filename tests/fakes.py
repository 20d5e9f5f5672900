"""The one shared fake of each service the rollout side talks to (see the Protocols in l0_min/agent.py
and l0_min/collect.py): kernels and tools from bench/stand_ins.py (the benchmarks use them too), and a
scripted policy. The real ones (sandboxed kernels, the tool server, the SGLang client) have tests of their own.
"""

from __future__ import annotations

import asyncio

from l0_min.envs.qa import QA
from l0_min.inference import Generation
from l0_min.models import tiny_tokenizer
from bench.stand_ins import FakeKernel, FakeKernels, FakeNotepad, FakeTools  # noqa: F401

TOK = tiny_tokenizer()  # one id per UTF-8 byte (id = byte + 3), eos "</s>" = 1; ChatML template as text


def enc(s: str) -> list[int]:
    return TOK.encode(s, add_special_tokens=False)


def dec(ids) -> str:
    return TOK.decode(ids)


class ScriptedPolicy:
    """Returns fixed actions as token ids (strings are encoded, lists of ids used as given, exceptions
    raised), with made-up log-probs; stops like a server: at max_new_tokens ("length") or after </code>
    or the eos token ("stop"). `calls` records what was asked."""

    def __init__(self, actions, version="w1", delay=0.0):
        self.actions, self.version, self.delay = list(actions), version, delay
        self.calls: list[tuple[list[int], dict]] = []

    async def health(self) -> bool:
        return True

    async def generate(self, input_ids, sampling):
        self.calls.append((list(input_ids), dict(sampling)))
        if self.delay:
            await asyncio.sleep(self.delay)
        if not self.actions:
            raise AssertionError("the scripted policy ran out of actions")
        a = self.actions.pop(0)
        if isinstance(a, Exception):
            raise a
        ids = list(a) if isinstance(a, list) else enc(a)
        finish, matched = "length", None
        if dec(ids).endswith("</code>"):
            finish, matched = "stop", "</code>"
        elif ids and ids[-1] == TOK.eos_token_id:
            finish, matched = "stop", TOK.eos_token_id
        if len(ids) > sampling["max_new_tokens"]:
            ids, finish, matched = ids[: sampling["max_new_tokens"]], "length", None
        logprobs = [-0.01 * (1 + i % 13) for i in range(len(ids))]
        return Generation(ids, logprobs, finish, matched, weight_version=self.version)


def qa_envs(cfg) -> dict:
    """The environments of a QA-only run (collect.Services.envs)."""
    return {"qa": QA(cfg)}
