"""In-process stand-ins for the rollout side's kernels and host tools (the Protocols of l0_min/agent.py
and l0_min/collect.py), shared by the benchmarks and the tests (tests/fakes.py). Cells are exec'd in a
dict: no sandbox, no process, no CPU beyond the cell itself. The real kernels have tests of their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import re

from l0_min.sandbox.kernel import ExecResult


class FakeTools:
    """The host's record of final answers and tool calls (l0_min.agent.Tools)."""

    def __init__(self):
        self.answers: dict[str, str] = {}
        self.calls: dict[str, dict[str, int]] = {}
        self.errors: dict[str, list[str]] = {}
        self.allowed: dict[str, tuple] = {}
        self.pages: dict[str, list[tuple[str, str]]] = {}  # what search tools served (none here: no search)

    def allow(self, key, tools):
        self.allowed[key] = tuple(tools)

    def final_answer(self, key):
        return self.answers.get(key)

    def tool_calls(self, key):
        return dict(self.calls.get(key, {}))

    def backend_errors(self, key):
        return list(self.errors.get(key, []))

    def served(self, key):
        return list(self.pages.get(key, []))


class FakeNotepad:
    def __init__(self):
        self.facts: list[str] = []

    def render(self):
        return "facts:\n" + "\n".join(f"- {f}" for f in self.facts)


class FakeKernel:
    """Cells are exec'd in a dict; `submit_final_answer` reports to the tools like the real host (the
    first answer counts). Special cells: "DIE" (its own code kills it), "LOST" (the host loses it), "RAISE" (the kernel connection
    fails), "sleep(N)" (sleeps without blocking, times out past `timeout`)."""

    def __init__(self, tools: FakeTools, id: str = "k0"):
        self.id, self.tools = id, tools
        self.ns = {"notepad": FakeNotepad(), "submit_final_answer": self._submit, "web_search": lambda query, k=3: [],
                   "read_page": lambda ref: ""}
        self.executed: list[str] = []

    def _submit(self, answer):
        self.tools.answers.setdefault(self.id, str(answer))
        calls = self.tools.calls.setdefault(self.id, {})
        calls["submit_final_answer"] = calls.get("submit_final_answer", 0) + 1

    async def execute(self, code, timeout=30.0):
        self.executed.append(code)
        if code in ("DIE", "LOST"):  # killed by its own code / by the host
            return ExecResult(error_name="KernelDied", error_value="kernel died", dead=True, crashed=code == "DIE")
        if code == "RAISE":
            raise ConnectionError("zmq socket closed")
        m = re.fullmatch(r"sleep\((\d+)\)", code)
        if m:
            await asyncio.sleep(min(int(m.group(1)), timeout))
            return ExecResult(timed_out=int(m.group(1)) > timeout, duration=timeout)
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out):
                exec(code, self.ns)
        except Exception as e:
            return ExecResult(stdout=out.getvalue(), error_name=type(e).__name__, error_value=str(e))
        return ExecResult(stdout=out.getvalue())

    async def read_notepad(self):
        return self.ns["notepad"].render()


class FakeKernels:
    """A pool of fake kernels sharing one FakeTools (l0_min.collect.Kernels)."""

    def __init__(self):
        self.tools, self.n = FakeTools(), 0

    async def acquire(self):
        self.n += 1
        return FakeKernel(self.tools, f"fake{self.n}")

    async def release(self, kernel) -> None:
        pass
