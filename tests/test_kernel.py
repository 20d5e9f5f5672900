"""Kernel, KernelPool and the tool server, on real sandboxed ipykernels.

Kernels are started concurrently once per module (a start is ~0.3 s of CPU); tests that destroy a
kernel take one of the spares.
"""

import asyncio
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time

import aiohttp

import pytest
import pytest_asyncio

from l0_min.sandbox import cgroup as cgroup_module
from l0_min.sandbox import kernel as kernel_module
from l0_min.sandbox import bwrap as sb
from l0_min.config import KernelConfig, SandboxConfig
from l0_min.sandbox.kernel import ExecResult, Kernel, KernelDied, KernelStartError
from l0_min.sandbox.pool import KernelPool
from l0_min.sandbox.tools import ToolServer

pytestmark = pytest.mark.asyncio(loop_scope="module")
module_fixture = pytest_asyncio.fixture(scope="module", loop_scope="module")

KCFG = KernelConfig(exec_timeout=10, interrupt_grace=1.5, max_output_chars=2000, start_timeout=60)

DOCS = {"d1": ("Paris", "Paris is the capital of France."), "d2": ("Lyon", "Lyon is a city in France.")}


class FakeBackend:
    """Search over two documents; the queries 'explode' and 'stall' misbehave on purpose."""

    async def search(self, query: str, k: int) -> list[dict]:
        if query == "explode":
            raise RuntimeError("index offline")
        if query == "stall":
            await asyncio.sleep(30)
        words = query.lower().split()
        hits = [(i, t, x) for i, (t, x) in DOCS.items() if any(w in x.lower() for w in words)]
        return [{"id": i, "title": t, "text": x, "score": 1.0} for i, t, x in hits][:k]

    async def read_page(self, ref: str) -> str:
        if ref not in DOCS:
            raise KeyError(f"no page {ref!r}")
        return "\n".join(DOCS[ref])


def processes_of(pid: int | None) -> bool:
    return pid is not None and os.path.exists(f"/proc/{pid}")


def uid_processes(uid: int) -> list[int]:
    pids = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                if os.stat(f"/proc/{p}").st_uid == uid:
                    pids.append(int(p))
            except FileNotFoundError:
                pass
    return pids


@module_fixture
async def tools():
    server = ToolServer(FakeBackend(), timeout=1.0)
    await server.start()
    yield server
    await server.close()


@module_fixture
async def kernels(tools):
    """Two kernels with tools (a, b), two spares to destroy, one without a tool server."""
    ks = [Kernel(SandboxConfig(), KCFG, tools) for _ in range(4)] + [Kernel(SandboxConfig(), KCFG, None)]
    await asyncio.gather(*(k.start() for k in ks))
    yield {"a": ks[0], "b": ks[1], "spares": ks[2:4], "no_tools": ks[4]}
    await asyncio.gather(*(k.shutdown() for k in ks))


# --------------------------------------------------------------------------- results


async def test_exec_result_text():
    r = ExecResult(stdout="hi\n", error_name="ValueError", error_value="bad",
                   traceback="Traceback (most recent call last):\n  Cell In[1], line 1\nValueError: bad")  # fmt: skip
    assert r.text() == "hi\nTraceback (most recent call last):\n  Cell In[1], line 1\nError: ValueError: bad"
    assert not r.ok and ExecResult(stdout="x").ok
    t = ExecResult(error_name="KeyboardInterrupt", timed_out=True, duration=2.0)
    assert t.text() == "[timed out after 2.0 s: the cell was interrupted]" and not t.ok
    assert ExecResult(dead=True).text() == "[the kernel died; its state is lost]"
    long = ExecResult(stdout="a" * 5000 + "END").text(300)
    assert len(long) <= 300 and long.startswith("a" * 170) and long.endswith("END") and "characters truncated" in long


async def test_toolbox_needs_only_the_standard_library(tmp_path):
    (tmp_path / "l0_toolbox").symlink_to(sb.TOOLBOX_SRC)
    code = f"import sys\nsys.path.insert(0, {str(tmp_path)!r})\nimport l0_toolbox, l0_toolbox._capture\n"
    code += "print(l0_toolbox.notepad)"
    p = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True)
    assert p.returncode == 0 and p.stdout == "(the notepad is empty)\n", p.stderr  # -S: no site-packages


async def test_state_persists_across_cells(kernels):
    a = kernels["a"]
    assert (await a.execute("x = 40")).ok
    assert (await a.execute("x += 2\ndef f(y):\n    return x + y")).ok
    r = await a.execute("f(0)")
    assert r.ok and r.result == "42"


async def test_state_never_crosses_kernels(kernels):
    a, b = kernels["a"], kernels["b"]
    r = await a.execute("secret = 'alpha'\nopen('/workspace/secret.txt', 'w').write(secret)")
    assert r.ok, r.text()
    r = await b.execute("import os\nprint('secret' in globals(), os.listdir('/workspace'))")
    assert r.stdout == "False []\n"


async def test_outputs_land_in_their_fields(kernels):
    r = await kernels["a"].execute(
        "import sys\nfrom IPython.display import display\nprint('out')\nprint('err', file=sys.stderr)\n"
        "display('shown')\n6 * 7"
    )
    assert (r.stdout, r.stderr, r.display, r.result) == ("out\n", "err\n", "'shown'", "42")
    assert r.ok and not r.truncated and 0 < r.duration < 5


async def test_errors_are_structured_without_ansi(kernels):
    r = await kernels["a"].execute("def g():\n    raise ValueError('bad input')\ng()")
    assert (r.error_name, r.error_value) == ("ValueError", "bad input")
    assert "g()" in r.traceback and "\x1b" not in r.traceback
    assert not r.ok and r.text().endswith("Error: ValueError: bad input")


async def test_long_output_is_cut_inside_the_kernel(kernels):
    r = await kernels["a"].execute("print('a' * 50_000 + 'END')")
    assert r.truncated and r.ok
    assert r.stdout.startswith("a" * 1000) and r.stdout.endswith("END\n")
    assert len(r.stdout) < 2 * KCFG.max_output_chars  # head (the budget) + a tail of a quarter of it
    assert "characters truncated" in r.stdout
    r = await kernels["a"].execute("'r' * 1_000_000")
    assert r.truncated and len(r.result) < KCFG.max_output_chars + 100


async def test_timeout_interrupts_and_keeps_the_kernel(kernels):
    a = kernels["a"]
    await a.execute("kept = 'yes'")
    r = await a.execute("while True:\n    pass", timeout=1.0)
    assert r.timed_out and not r.dead and r.error_name == "KeyboardInterrupt"
    assert 1.0 <= r.duration < 1.0 + KCFG.interrupt_grace + 1
    assert "timed out after" in r.text()
    assert (await a.execute("kept")).result == "'yes'" and a.is_alive()


@pytest.mark.slow  # waits out the interrupt's grace before the kill (~2.5 s): make test, not test-fast
async def test_a_cell_that_ignores_the_interrupt_is_killed(kernels):
    k = kernels["spares"][0]
    r = await k.execute("import re\nre.match(r'(a+)+$', 'a' * 40 + 'b')", timeout=1.0)  # never checks signals
    assert r.timed_out and r.dead
    assert r.duration < 1.0 + KCFG.interrupt_grace + 6
    assert "was killed" in r.text()
    assert not k.is_alive() and not processes_of(k.sandbox_pid)
    assert (await k.execute("1")).dead  # answered at once, without a kernel
    with pytest.raises(KernelDied):
        await k.read_notepad()


async def test_a_dying_kernel_is_reported_at_once(kernels):
    k = kernels["spares"][1]
    t = time.monotonic()
    r = await k.execute("import os\nos._exit(3)")
    assert r.dead and not r.timed_out and not r.ok
    assert time.monotonic() - t < 2.0  # noticed by the pidfd watch, not by a timeout
    assert "kernel died" in r.text()


async def test_shutdown_leaves_no_process_and_no_folder(tools):
    k = Kernel(SandboxConfig(), KCFG, tools)
    await k.start()
    r = await k.execute("import subprocess\np = subprocess.Popen(['sleep', '600'])\np.pid")
    assert r.ok
    socket_path = tools._sites[k.id][0]
    uid = k._uid.uid if k._uid else None
    pids = [k.pid, k.sandbox_pid]
    assert all(processes_of(p) for p in pids) and os.path.isdir(k.runtime_dir) and os.path.exists(socket_path)
    cgroups = list(k._cgroup.dirs) if k._cgroup else []
    assert all(os.path.isdir(d) for d in cgroups)
    pinned = list(k._sockets)
    assert len(pinned) == 5 and all(os.path.exists(f"/proc/self/fd/{fd}") for fd in pinned)
    await k.shutdown()
    await k.shutdown()  # idempotent
    assert not any(processes_of(p) for p in pids)
    assert not os.path.exists(k.runtime_dir) and not os.path.exists(socket_path)
    assert not any(os.path.exists(d) for d in cgroups) and k._sockets == []
    if uid is not None:
        assert uid_processes(uid) == []
    with pytest.raises(KernelDied, match="shut down"):
        await k.execute("1")


async def test_runtime_folders_of_dead_hosts_are_swept():
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = tempfile.mkdtemp(prefix=f"l0_min-{dead.pid}-k000000000000-")
    live = tempfile.mkdtemp(prefix=f"l0_min-{os.getpid()}-k000000000000-")
    try:
        removed = kernel_module.sweep_stale_runtime_dirs()
        assert stale in removed and not os.path.exists(stale)
        assert os.path.isdir(live)  # this process is alive: its folders stay
    finally:
        shutil.rmtree(live, ignore_errors=True)


# --------------------------------------------------------------------------- tools


async def test_tools_call_the_host(kernels, tools):
    b = kernels["b"]
    r = await b.execute("print(web_search('capital', k=2))")
    assert r.stdout == "[1] Paris (ref: d1)\n    Paris is the capital of France.\n"
    r = await b.execute("hits = web_search('france')\nlen(hits), hits[1]['id']")
    assert r.result == "(2, 'd2')"
    r = await b.execute("read_page('d1')")
    assert r.result == "Paris\nParis is the capital of France."
    r = await b.execute("submit_final_answer('Paris')")
    assert r.stdout == "Final answer submitted: Paris\n" and tools.final_answer(b.id) == "Paris"
    r = await b.execute("submit_final_answer('Lyon')")
    assert "already submitted ('Paris')" in r.stdout and tools.final_answer(b.id) == "Paris"
    assert tools.tool_calls(b.id) == {"web_search": 2, "read_page": 1, "submit_final_answer": 2}
    assert tools.final_answer(kernels["a"].id) is None


async def test_tool_failures_raise_clear_errors_in_the_kernel(kernels, tools):
    a = kernels["a"]
    r = await a.execute("read_page('nope')")
    assert r.error_name == "ToolError" and "read_page backend failed: KeyError" in r.error_value
    r = await a.execute("web_search('explode')")
    assert r.error_name == "ToolError" and "index offline" in r.error_value
    t = time.monotonic()
    r = await a.execute("web_search('stall')")
    assert r.error_name == "ToolError" and "did not answer within 1 s" in r.error_value
    assert time.monotonic() - t < 5
    r = await a.execute("web_search('paris', k=99)")
    assert r.error_name == "ToolError" and "k must be an integer from 1 to 20" in r.error_value


async def test_tool_server_protocol():
    """The HTTP side of the tool server, without a kernel: errors name what was wrong."""
    server = ToolServer(FakeBackend(), timeout=1.0, keep_closed=1)
    await server.start()
    try:
        paths = {key: server.open_episode(key) for key in ("e1", "e2", "e3")}
        with pytest.raises(ValueError, match="already open"):
            server.open_episode("e1")

        async def post(key, body):
            async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=paths[key])) as s:
                async with s.post("http://tools/call", data=body) as r:
                    return r.status, await r.json()

        status, reply = await post("e1", "not json")
        assert status == 400 and reply["error"] == 'the request must be JSON {"tool": name, "args": {...}}'
        status, reply = await post("e1", json.dumps({"tool": "rm_rf", "args": {}}))
        assert status == 400 and "unknown tool 'rm_rf'" in reply["error"]
        status, reply = await post("e1", json.dumps({"tool": "submit_final_answer", "args": {"answer": "x" * 5000}}))
        assert (status, reply["error"]) == (400, "the answer has 5,000 characters, more than the 2,000 allowed")
        assert server.final_answer("e1") is None
        status, reply = await post("e2", json.dumps({"tool": "submit_final_answer", "args": {"answer": "B"}}))
        assert (status, reply) == (200, {"ok": True, "result": {"accepted": True, "answer": "B"}})
        assert server.final_answer("e2") == "B" and server.final_answer("e1") is None
        # after close: the socket is gone, the records stay (for the last keep_closed=1 episodes)
        server.close_episode("e2")
        assert not os.path.exists(paths["e2"]) and server.final_answer("e2") == "B"
        server.close_episode("e1")
        assert server.final_answer("e2") is None and server.tool_calls("e1") == {"submit_final_answer": 1}
        assert server.tool_calls("e3") == {}
    finally:
        await server.close()
    assert not os.path.exists(server.root)


async def test_tool_calls_are_capped_paced_and_one_per_connection():
    """Issue 23, weakness 4: argument and body caps are clear errors, an episode's calls are paced at
    calls_per_second (a burst of as many first), a connection carries one request, and a query reaches
    the backend as valid Unicode."""
    seen = []

    class Backend(FakeBackend):
        async def search(self, query, k):
            seen.append(query)
            return await super().search(query, k)

    server = ToolServer(Backend(), timeout=1.0)
    await server.start()
    try:
        path = server.open_episode("e")
        session = aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=path, force_close=True))  # as the toolbox

        async def call(tool, **args):
            async with session.post("http://tools/call", json={"tool": tool, "args": args}) as r:
                return r.status, (await r.json())

        status, reply = await call("web_search", query="q" * 2001)
        assert status == 400 and reply["error"] == "the query has 2,001 characters, more than the 2,000 allowed"
        status, reply = await call("read_page", ref=["d1"])
        assert status == 400 and reply["error"] == "ref must be a non-empty string, got ['d1']"
        assert (await call("web_search", query="Paris \ud800"))[0] == 200 and seen == ["Paris \ufffd"]
        t0 = time.monotonic()  # 3 calls above, 7 left in the burst; then 10 a second, 1.9 s for the other 19
        statuses = [(await call("submit_final_answer", answer=str(i)))[0] for i in range(26)]
        assert statuses == [200] * 26 and 1.6 < time.monotonic() - t0 < 4, time.monotonic() - t0
        await session.close()
        # two requests written at once on one connection: one answer, then the connection is closed
        reader, writer = await asyncio.open_unix_connection(path)
        body = b'{"tool": "submit_final_answer", "args": {"answer": "x"}}'
        request = b"POST /call HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        writer.write(request * 2)
        answers = (await asyncio.wait_for(reader.read(), 5)).count(b"HTTP/1.1 200")
        writer.close()
        assert answers == 1
    finally:
        await server.close()


async def test_tools_say_they_are_unavailable_without_a_server(kernels):
    r = await kernels["no_tools"].execute("submit_final_answer('x')")
    assert r.error_name == "ToolError" and "unavailable" in r.error_value


async def test_read_notepad(kernels):
    a, b = kernels["a"], kernels["no_tools"]
    assert await b.read_notepad() == "(the notepad is empty)"
    await a.execute("notepad.todo += ['find the year', 'check it']\nnotepad.facts.append('born 1912 (d3)')\n"
                    "notepad.draft = '1912'")  # fmt: skip
    want = "## Todo\n1. find the year\n2. check it\n## Facts\n- born 1912 (d3)\n## Draft\n1912"
    assert await a.read_notepad() == want
    await a.execute("del notepad")
    assert (await a.read_notepad()).startswith("(the notepad is unavailable: NameError")


async def test_unsandboxed_is_an_explicit_loud_opt_in(caplog, monkeypatch):
    sb._warn_unsandboxed.cache_clear()  # the warning comes once per process
    k = Kernel(SandboxConfig(enabled=False), KCFG)
    with caplog.at_level(logging.WARNING, logger="l0_min.sandbox.bwrap"):
        await k.start()
    try:
        assert "WITHOUT bubblewrap" in caplog.text
        r = await k.execute("import os\nos.getuid(), os.path.basename(os.getcwd())")
        assert r.result == f"({os.getuid()}, 'workspace')"
    finally:
        await k.shutdown()
    assert not os.path.exists(k.runtime_dir)


async def test_the_first_start_says_which_protections_are_on_and_which_are_missing(caplog, monkeypatch):
    monkeypatch.setattr(kernel_module, "_swept", False)  # the line comes once per process
    k = Kernel(SandboxConfig(), KCFG)
    with caplog.at_level(logging.INFO, logger="l0_min.sandbox.kernel"):
        await k.start()
    await k.shutdown()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("sandbox protections: ")]
    on, missing = sb.protections(SandboxConfig())
    assert len(lines) == 1 and all(p in lines[0] for p in on) and on[0].startswith("bwrap ")
    assert all(f"MISSING {name}: {why}" in lines[0] for name, why in missing.items())
    # on a host without cgroups for sandboxes, or an architecture without a seccomp table, it says so
    monkeypatch.setattr(sb.platform, "machine", lambda: "riscv64")
    monkeypatch.setattr(cgroup_module, "detect", lambda: "no cgroup for sandboxes: ...")
    assert sb.protections(SandboxConfig())[1] == {
        "seccomp": "no seccomp table for the 'riscv64' architecture (x86_64, aarch64 only)",
        "cgroup": "no cgroup for sandboxes: ...",
    }


async def test_missing_bwrap_fails_start_with_the_install_hint(monkeypatch):
    monkeypatch.setattr(sb.shutil, "which", lambda *a, **k: None)
    with pytest.raises(sb.SandboxError, match="apt-get install bubblewrap"):
        await KernelPool(SandboxConfig(), KCFG).start()
    k = Kernel(SandboxConfig(), KCFG)
    with pytest.raises(KernelStartError, match="apt-get install bubblewrap"):
        await k.start()
    assert not os.path.exists(k.runtime_dir)


# --------------------------------------------------------------------------- pool


async def wait_for(cond, timeout: float = 60.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not reached"
        await asyncio.sleep(0.05)


async def test_pool_prewarms_hands_out_and_replaces(tools):
    pool = KernelPool(SandboxConfig(), KernelConfig(pool_size=2, start_timeout=60), tools)
    await pool.start()
    try:
        await wait_for(lambda: pool.ready == 2)
        t = time.perf_counter()
        k = await pool.acquire()
        assert time.perf_counter() - t < 0.5 and k.is_alive()
        assert (await k.execute("1 + 1")).result == "2"
        await wait_for(lambda: pool.ready == 2)  # the replacement starts on acquire
        await pool.release(k)
        assert not k.is_alive() and not os.path.exists(k.runtime_dir)
        assert pool.stats["acquired"] == 1 and pool.stats["released"] == 1 and pool.stats["started"] == 3
        assert pool.stats["failed_starts"] == 0
        # a kernel that dies while waiting in the pool is discarded, not handed out
        dying = pool._ready._queue[0]
        os.kill(dying.sandbox_pid, 9)
        await wait_for(lambda: not dying.is_alive())
        k2 = await pool.acquire()
        assert k2 is not dying and k2.is_alive() and pool.stats["discarded_dead"] == 1
        left = [k2, *pool._ready._queue]
    finally:
        await pool.close()
    assert not any(k.is_alive() or processes_of(k.pid) for k in left)


async def test_pool_retries_failed_starts_then_raises():
    # 16 MiB of address space is too little for Python to start: every start fails. pool_size=0:
    # only the waiting acquire's kernel is started, so the counts are exact
    pool = KernelPool(SandboxConfig(memory_mb=16), KernelConfig(pool_size=0, start_retries=2, start_backoff=0.01))
    await pool.start()
    try:
        with pytest.raises(KernelStartError, match="no kernel started after 2 attempts") as e:
            await asyncio.wait_for(pool.acquire(), 60)
        assert "--- kernel log ---" in str(e.value) and "MemoryError" in str(e.value)  # the kernel's own words
        assert pool.stats["failed_starts"] == 2 and pool.stats["started"] == 0
    finally:
        await pool.close()


async def test_pool_rejects_bad_settings():
    with pytest.raises(ValueError, match=r"kernel\.pool_size must be an integer >= 0, got -1"):
        KernelPool(SandboxConfig(), KernelConfig(pool_size=-1))
