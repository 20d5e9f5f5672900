"""Async Jupyter kernels, each in its own bubblewrap sandbox (bwrap.py).

    k = Kernel(cfg.sandbox, cfg.kernel, tool_server)
    await k.start()                      # ~0.5 s: bwrap + ipykernel with the toolbox preloaded
    r = await k.execute("x = 1; x + 1")  # ExecResult(result="2", ...), ~10 ms
    await k.shutdown()                   # no process, no workspace left

`execute` never raises for problems of the code it runs: errors, timeouts and a dead kernel are fields of the
result, a death the agent's own doing (`crashed`) unless the host caused it (`death`). What a kernel sends is
hostile and bounded before it becomes Python objects (docs/internals.md "Inside the loop": protocol, bounds).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import glob
import json
import logging
import os
import re
import resource
import shutil
import signal
import stat
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass
from queue import Empty

import zmq
import zmq.asyncio
from jupyter_client import AsyncKernelManager
from jupyter_client.kernelspec import KernelSpec

from l0_min.config import KernelConfig, SandboxConfig, is_number
from l0_min.context import valid_text
from l0_min.sandbox import bwrap as sb
from l0_min.sandbox import cgroup
from l0_min.sandbox.toolbox._capture import trim

log = logging.getLogger(__name__)

_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]")
# no history database, plain tracebacks without colour (short, fast, no ANSI), no echo to the process's stdout
KERNEL_ARGS = ["--HistoryManager.enabled=False", "--InteractiveShell.colors=nocolor", "--InteractiveShell.xmode=Plain",
               "--IPKernelApp.quiet=True"]
# What the host reads from a kernel: the toolbox keeps a cell to max_output_chars (<= 100,000; 6 bytes a
# character in JSON, 3 text fields: < 2 MiB), a few KB a frame and a few hundred messages a cell.
MAX_FRAME = 2 << 20
MAX_FRAMES = 8  # a topic or identity, the delimiter, the signature, header, parent, metadata, content, one spare
CELL_BYTES, CELL_MESSAGES = 64 << 20, 20_000  # from one request to the next, so between cells too
WANTED = {"shell": {"execute_reply"},
          "iopub": {"stream", "execute_result", "display_data", "update_display_data", "error", "status"}}


@dataclass
class ExecResult:
    stdout: str = ""
    stderr: str = ""
    result: str = ""  # text/plain of the cell's value
    display: str = ""  # text/plain of display() calls
    error_name: str = ""
    error_value: str = ""
    traceback: str = ""  # no ANSI codes
    truncated: bool = False
    duration: float = 0.0
    timed_out: bool = False
    dead: bool = False  # the kernel died; its state is lost
    crashed: bool = False  # ... by the agent's own doing (see Kernel.death), not the environment's
    death: str = ""  # how it died

    @property
    def ok(self) -> bool:
        return not (self.error_name or self.timed_out or self.dead)

    def text(self, max_chars: int = 2000) -> str:
        """One observation text: outputs, then the error, then notes on a timeout or a death."""
        parts = [p for p in (self.stdout, self.stderr, self.result, self.display) if p]
        if self.error_name and not (self.timed_out and self.error_name == "KeyboardInterrupt"):
            last = f"{self.error_name}: {self.error_value}"
            tb = [ln for ln in self.traceback.splitlines() if ln.strip()]
            if tb and tb[-1].strip() == last.strip():  # the traceback ends with the error line itself
                tb.pop()
            parts.append("\n".join(tb[-8:] + [f"Error: {last}"]))
        if self.timed_out:
            how = "the kernel did not stop and was killed" if self.dead else "the cell was interrupted"
            parts.append(f"[timed out after {self.duration:.1f} s: {how}]")
        elif self.dead:
            parts.append(f"[the kernel died{': ' + self.death if self.death else ''}; its state is lost]")
        return trim("\n".join(p.rstrip("\n") for p in parts), max_chars)


# a send to a kernel whose end of the connection is gone, or a message no kernel sends (a forged
# one: the agent's code runs in the kernel's process and knows its key)
BROKEN = (zmq.ZMQError, AttributeError, KeyError, TypeError, ValueError)


class KernelDied(Exception):
    """The kernel is gone (it died, or was shut down) and cannot run anything; `crashed` as in ExecResult."""

    crashed = False


class KernelStartError(RuntimeError):
    """A kernel did not start; the message carries the end of its log."""


class _Bounded:
    """Text that keeps at most 2 * `limit` characters (head and tail, `trim`'s marker between), however
    much arrives. It is trimmed in batches: `trim` counts what an earlier marker stood for."""

    def __init__(self, limit: int):
        self.limit, self.text, self.trimmed = limit, "", False

    def add(self, s: str) -> None:
        self.text += s
        if len(self.text) > 4 * self.limit:
            self.text, self.trimmed = trim(self.text, 2 * self.limit), True

    def value(self) -> tuple[str, bool]:
        """The text, and whether any of it was cut."""
        return trim(self.text, 2 * self.limit), self.trimmed or len(self.text) > 2 * self.limit


# ------------------------------ process-wide plumbing: one zmq context, enough file descriptors
@functools.cache
def zmq_context() -> zmq.asyncio.Context:
    """The zmq context of all kernels: no socket cap below the fd limit, a message size cap."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:  # 256 kernels need a few thousand descriptors
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    ctx = zmq.asyncio.Context()
    ctx.set(zmq.MAX_SOCKETS, max(1024, min(hard, 1 << 16)))
    # a kernel that undoes its output cap cannot push a bigger frame (a bigger one ends that connection for
    # good); a send to a peer that is gone fails at once (SNDTIMEO 0) instead of blocking the event loop
    ctx.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME)
    ctx.setsockopt(zmq.SNDTIMEO, 0)
    return ctx


def sweep_stale_runtime_dirs() -> list[str]:
    """Remove the runtime folders of host processes that died without shutting their kernels down
    (their kernels died with them: bwrap --die-with-parent). Returns the folders removed."""
    removed = [p for p in glob.glob(os.path.join(tempfile.gettempdir(), "l0_min-*-k*-*"))
               if (m := re.match(r"l0_min-(\d+)-k", os.path.basename(p))) and not os.path.exists(f"/proc/{m[1]}")]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


_swept = False


class _Manager(AsyncKernelManager):
    """jupyter_client's manager with a kernelspec built per kernel and the `Kernel._launched` hook."""

    spec: KernelSpec | None = None
    on_launched = None  # async callable; both set by Kernel

    @property
    def kernel_spec(self) -> KernelSpec | None:
        return self.spec

    async def _async_post_start_kernel(self, **kw):
        await self.on_launched()
        await super()._async_post_start_kernel(**kw)


def check(kcfg: KernelConfig) -> None:
    """Reject bad kernel and pool settings with an error that names the field."""
    for name, integer, least, strict in [  # strict: the value must be above `least`
        ("start_timeout", False, 0, True), ("exec_timeout", False, 0, True), ("interrupt_grace", False, 0, False),
        ("max_output_chars", True, 200, False), ("pool_size", True, 0, False), ("start_retries", True, 1, False),
        ("max_starting", True, 0, False),
    ]:  # fmt: skip
        v = getattr(kcfg, name)
        if not is_number(v, integer) or v < least or strict and v == least or name == "max_output_chars" and v > 100_000:
            want = f"{'an integer' if integer else 'a number'} {'>' if strict else '>='} {least}"
            raise ValueError(f"kernel.{name} must be {want}{' and <= 100,000' * (name == 'max_output_chars')}, got {v!r}")


class Kernel:
    def __init__(self, sandbox: SandboxConfig, kcfg: KernelConfig, tool_server=None):
        check(kcfg)
        self.id = f"k{uuid.uuid4().hex[:12]}"
        self.sandbox, self.kcfg, self.tool_server = sandbox, kcfg, tool_server
        self.runtime_dir: str | None = None  # private host folder: connection file, /etc/passwd
        self.pid: int | None = None  # bwrap (or the kernel itself, unsandboxed)
        self.sandbox_pid: int | None = None  # pid 1 of the sandbox, as the host sees it
        self.start_seconds = 0.0
        self._km: _Manager | None = None
        self._kc = None
        self._exited: asyncio.Future | None = None  # the process's exit status
        self._pidfd = -1
        self._log = bytearray()  # last 8 KiB of the kernel's stdout/stderr
        self._uid: sb.UidLease | None = None  # root hosts: the sandbox's own uid
        self._cgroup: cgroup.Cgroup | None = None  # and the host's OOM kills so far (without one, death() reads them)
        self._ooms = cgroup.oom_kills()
        self._sockets: list[int] = []  # O_PATH fds of the kernel's ipc sockets (zmq connects through them)
        self._killed_for = ""  # why the host killed it (a cell that ignored the interrupt)
        self._lock, self._closed = asyncio.Lock(), False
        self._inbox, self._readers = {}, []  # channel -> messages of the request waited for (`_read`); the readers
        self._want, self._cell = "", [0, 0]  # that request's msg_id; bytes and messages read since it was sent

    # ---------------------------------------------------------------- start
    async def start(self) -> None:
        """Start the sandboxed kernel; raises KernelStartError (with the kernel's log) if it does not come up."""
        if self._km is not None or self._closed:
            raise RuntimeError(f"kernel {self.id} was already started; kernels are not restarted")
        t0 = time.perf_counter()
        try:
            await asyncio.wait_for(self._start(), self.kcfg.start_timeout)
        except (asyncio.TimeoutError, KernelDied, OSError, RuntimeError) as e:
            tail = self.log_tail()
            await self.shutdown()
            why = f"no reply within {self.kcfg.start_timeout:g} s" if isinstance(e, asyncio.TimeoutError) else str(e)
            raise KernelStartError(f"kernel {self.id} did not start: {why}\n--- kernel log ---\n{tail}") from e
        except BaseException:  # cancelled, or a setting error (ValueError): clean up and pass it on
            await self.shutdown()
            raise
        self.start_seconds = time.perf_counter() - t0

    async def _start(self) -> None:
        global _swept
        sb.check(self.sandbox)
        if not _swept:  # once per process
            _swept = True
            sweep_stale_runtime_dirs()
            if self.sandbox.enabled:
                on, missing = sb.protections(self.sandbox)
                (log.warning if missing else log.info)("sandbox protections: %s%s", "; ".join(on),
                                                       "".join(f"; MISSING {k}: {v}" for k, v in missing.items()))
        self.runtime_dir = tempfile.mkdtemp(prefix=f"l0_min-{os.getpid()}-{self.id}-")
        if self.sandbox.enabled and sb.runs_as_root():
            self._uid = sb.UidLease(self.sandbox)
        if self.sandbox.enabled and not isinstance(cgroup.shared(), str):
            limits = self.sandbox.total_memory_mb, self.sandbox.max_procs + 2
            self._cgroup = cgroup.Cgroup(f"l0_min-{os.getpid()}-{self.id}", *limits)
        tools = self.tool_server.open_episode(self.id) if self.tool_server is not None else None
        conn = os.path.join(self.runtime_dir, "conn.json")
        extra = {"L0_MAX_OUTPUT_CHARS": str(self.kcfg.max_output_chars),
                 "L0_TOOLS_TIMEOUT": str(3 * getattr(self.tool_server, "timeout", 20.0) + 5)}  # fmt: skip
        argv, env, ip, cwd = sb.launch(self.sandbox, self.runtime_dir, conn_file=conn, kernel_args=KERNEL_ARGS,
                                       tools_socket=tools, extra_env=extra, uid=self._uid.uid if self._uid else None,
                                       cgroup_procs=self._cgroup.procs if self._cgroup else [])
        spec = KernelSpec(argv=argv, display_name="l0 sandbox", language="python", interrupt_mode="message")
        km = self._km = _Manager(context=zmq_context(), transport="ipc", ip=ip, connection_file=conn, autorestart=False)
        km.spec, km.on_launched = spec, lambda: self._launched(ip)
        await km.start_kernel(env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        if self.sandbox.enabled:  # the host's memory watch; a cgroup enforces its own limit where there is one
            c, read = self._cgroup, functools.partial(cgroup.pss, self.sandbox_pid, sb.TMPFS)
            cgroup.watch(self, c.held if c else read, 0 if c else self.sandbox.total_memory_mb << 20, self._kill_for)
        km._close_control_socket()  # nobody would read it: an interrupt opens one, then closes it (`_run`)
        self._kc = km.client(context=zmq_context())  # not a context (and io thread) of its own
        self._kc.start_channels(shell=True, iopub=True, stdin=False, hb=False, control=False)
        await self._until_exit(self._ready())
        for name in WANTED:  # from now on everything the kernel sends is read as it arrives
            self._inbox[name] = asyncio.Queue()
            self._readers.append(asyncio.ensure_future(self._read(name)))
        # the toolbox must be in the namespace, and the first cell should not pay for warm-up
        r = await self._request("", silent=True, user_expressions={"ok": "type(notepad).__name__"}, timeout=10)
        if r["user_expressions"]["ok"].get("status") != "ok":
            raise KernelStartError(f"the toolbox is not loaded in kernel {self.id}: {r['user_expressions']['ok']}")

    async def _ready(self) -> None:
        """jupyter_client's wait_for_ready without its last step, 0.2 s of silence on iopub (of a ~0.5 s start)."""
        while True:
            self._kc.kernel_info()
            with contextlib.suppress(Empty):
                if (await self._kc.shell_channel.get_msg(timeout=1))["msg_type"] == "kernel_info_reply":
                    await self._kc.iopub_channel.get_msg(timeout=0.2)
                    return

    async def _launched(self, ip: str) -> None:
        """Right after the process exists: watch it, keep its log; sandboxed, pin its sockets.

        Their folder is the sandbox's to write, so the host resolves no path in it after this: once
        the kernel has bound them (before any agent code runs), each is opened once (O_PATH, no
        symlink followed, a socket of the sandbox's uid) and zmq connects to /proc/self/fd/N through
        links in the host's runtime folder: a reconnect reaches the same socket, whatever happens."""
        proc = self._km.provisioner.process
        self.pid = proc.pid
        loop = asyncio.get_running_loop()
        self._exited = loop.create_future()
        self._pidfd = os.pidfd_open(proc.pid)
        loop.add_reader(self._pidfd, self._on_exit)
        os.set_blocking(proc.stdout.fileno(), False)
        loop.add_reader(proc.stdout.fileno(), self._on_output, proc.stdout.fileno())
        if not self.sandbox.enabled:
            return
        km = self._km
        ports = [km.shell_port, km.iopub_port, km.stdin_port, km.control_port, km.hb_port]
        while not self._open_sockets(ip, ports):
            if self._exited.done():
                raise KernelDied(f"bwrap exited with status {self._exited.result()}")
            await asyncio.sleep(0.005)  # the kernel is still importing
        for port, fd in zip(ports, self._sockets):
            os.symlink(f"/proc/self/fd/{fd}", os.path.join(self.runtime_dir, f"ipc-{port}"))
        km.ip = os.path.join(self.runtime_dir, "ipc")

    def _open_sockets(self, ip: str, ports: list[int]) -> bool:
        """One try at finding the sandbox's init and opening the sockets not yet open."""
        (folder, base), uid, run = os.path.split(ip), self._uid.uid if self._uid else os.getuid(), -1
        try:
            with open(f"/proc/{self.pid}/task/{self.pid}/children") as f:
                self.sandbox_pid = int(f.read().split()[0])  # bwrap's only child: the sandbox's pid 1
            run = os.open(f"/proc/{self.sandbox_pid}/root{folder}", os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW)
            with open(f"/proc/{self.sandbox_pid}/stat") as f:  # still bwrap's child: the pid was not reused
                if int(f.read().rsplit(")", 1)[1].split()[1]) != self.pid:
                    return False
            for port in ports[len(self._sockets) :]:
                fd = os.open(f"{base}-{port}", os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=run)
                self._sockets.append(fd)
                st = os.fstat(fd)
                if not stat.S_ISSOCK(st.st_mode) or st.st_uid != uid:
                    raise KernelDied(f"{ip}-{port} is not a socket of the sandbox's user")
        except (FileNotFoundError, IndexError):  # no init yet, or a socket not bound yet
            return False
        finally:
            if run >= 0:
                os.close(run)
        return True

    def _close_pidfd(self) -> None:
        if self._pidfd >= 0:
            asyncio.get_running_loop().remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = -1

    def _on_exit(self) -> None:
        self._close_pidfd()
        code = self._proc.poll() if self._proc is not None else None
        if not self._exited.done():
            self._exited.set_result(code)

    def _on_output(self, fd: int) -> None:
        """Keep the last 8 KiB of what the kernel process writes to its own stdout/stderr."""
        for _ in range(16):  # a bounded amount per call: a flood must not starve the event loop
            try:
                data = os.read(fd, 1 << 16)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data = b""
            if not data:  # end of file: the process is gone
                asyncio.get_running_loop().remove_reader(fd)
                return
            self._log += data
            del self._log[: max(0, len(self._log) - 8192)]

    @property
    def _proc(self) -> subprocess.Popen | None:
        return self._km.provisioner.process if self._km and self._km.provisioner else None

    def log_tail(self) -> str:
        """The end of the kernel's own stdout/stderr (start errors, crashes)."""
        proc = self._proc
        if proc is not None and proc.stdout is not None and not proc.stdout.closed:
            self._on_output(proc.stdout.fileno())  # what arrived since the last event loop turn
        return self._log.decode(errors="replace")

    def is_alive(self) -> bool:
        return not self._closed and self._exited is not None and not self._exited.done()

    # ---------------------------------------------------------------- execute
    async def _until_exit(self, aw, timeout: float | None = None):
        """Await `aw`, but raise KernelDied if the kernel process exits first (TimeoutError on timeout)."""
        task = asyncio.ensure_future(aw)
        try:
            await asyncio.wait([task, self._exited], timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            if task.done():
                return task.result()
        finally:
            task.cancel()  # nothing to cancel once it is done
        if self._exited.done():
            raise KernelDied(f"kernel {self.id} exited with status {self._exited.result()}")
        raise asyncio.TimeoutError

    async def _read(self, name: str) -> None:
        """Read channel `name` (shell, iopub) as long as the kernel lives; see the module docstring."""
        sock = getattr(self._kc, f"{name}_channel").socket
        raw, queue = zmq.Socket.shadow(sock.underlying), self._inbox[name]
        try:
            while True:
                work = 0
                while work < 1 << 20:  # bytes, at least 64 KiB a message; then the rest of the event loop runs
                    msg, size = self._receive(await sock.recv(copy=False), raw, WANTED[name])
                    work += max(size, 64 << 10)
                    if msg is not None:
                        queue.put_nowait(msg)
                await asyncio.sleep(0)
        except zmq.ZMQError:  # the socket is closed: the kernel is shut down
            pass
        except Exception as e:  # the kernel sent what the host will not read: its code did
            for channel in (self._kc.shell_channel, self._kc.iopub_channel):  # zmq frees what it holds
                channel.socket.close(linger=0)
            await self._kill_for(f"it broke its connection to the host: {str(e)[:300] or type(e).__name__}")

    def _receive(self, first: zmq.Frame, raw: zmq.Socket, wanted: set[str]) -> tuple[dict | None, int]:
        """One message (None unless the request waited for wants it) and its size, counted for the cell."""
        frames = [first]
        while frames[-1].more:  # zmq delivers a message whole: its other frames are there
            if len(frames) == MAX_FRAMES:
                raise ValueError(f"a message of more than {MAX_FRAMES} frames")
            frames.append(raw.recv(zmq.NOBLOCK, copy=False))
        size = sum(len(f) for f in frames)
        self._cell[0] += size
        self._cell[1] += 1
        if self._cell[0] > CELL_BYTES or self._cell[1] > CELL_MESSAGES:
            raise ValueError(f"more than {CELL_BYTES >> 20} MB or {CELL_MESSAGES:,} messages in one cell")
        parts = (session := self._kc.session).feed_identities(frames, copy=False)[1]  # no signature: the key is its own
        _, header, parent, _, content = (f.bytes for f in parts[:5])
        if self._want.encode() not in parent:  # another request's: not parsed (nor dates extracted, nor past a budget)
            return None, size
        header, parent = (session.unpack(_bounded(b, 100)) for b in (header, parent))
        if parent.get("msg_id") != self._want or header["msg_type"] not in wanted or len(parts) > 5:
            return None, size  # a kind no one reads (comm_msg ...), or with binary buffers
        content = session.unpack(_bounded(content, 10_000))  # a few dozen in any the toolbox sends; nesting raises
        if not isinstance(content, dict):
            raise ValueError(f"a {header['msg_type']} message whose content is not an object")
        return {"msg_type": header["msg_type"], "content": content}, size

    def _expect(self, msg_id: str) -> None:
        """A request was sent: its messages are kept from now on, and its cell's budget starts."""
        self._want, self._cell = msg_id, [0, 0]
        for queue in self._inbox.values():
            while not queue.empty():
                queue.get_nowait()

    async def _answer(self, channel: str, deadline: float) -> dict:
        """The next message on `channel` (iopub, shell): one of the request waited for (`_receive` keeps no other)."""
        return await self._until_exit(self._inbox[channel].get(), max(0.0, deadline - time.monotonic()))

    async def _request(self, code: str, *, timeout: float, **kw) -> dict:
        """Run `code` and return the execute_reply content (its iopub messages are not read)."""
        msg_id = self._kc.execute(code, allow_stdin=False, store_history=False, **kw)
        self._expect(msg_id)
        return (await self._answer("shell", time.monotonic() + timeout))["content"]

    async def execute(self, code: str, timeout: float | None = None) -> ExecResult:
        """Run one cell. Errors, a timeout and a dead kernel are reported in the result."""
        if not isinstance(code, str):
            raise TypeError(f"Kernel.execute: code must be a str, got {type(code).__name__}")
        if self._closed or self._kc is None:
            raise KernelDied(f"kernel {self.id} is shut down" if self._closed else f"kernel {self.id} was not started")
        timeout = self.kcfg.exec_timeout if timeout is None else timeout
        async with self._lock:
            t0 = time.monotonic()
            out = _Output(self.kcfg.max_output_chars)
            if self.is_alive():
                try:
                    await self._run(code, out, t0 + timeout)
                except BROKEN as e:
                    await self._kill_for(f"it broke its connection to the host ({type(e).__name__}: {e})")
            r = out.finish(time.monotonic() - t0)
            if not self.is_alive():
                r.dead, (r.death, r.crashed) = True, self.death()
            return r

    async def _run(self, code: str, out: "_Output", deadline: float) -> None:
        msg_id = self._kc.execute(code, allow_stdin=False, stop_on_error=False)
        self._expect(msg_id)
        if not await self._collect(out, deadline):
            out.r.timed_out = True
            await self._km.interrupt_kernel()
            self._km._close_control_socket()  # zmq still delivers the request (linger)
            if not await self._collect(out, time.monotonic() + self.kcfg.interrupt_grace):
                await self._kill_for(f"its cell ignored an interrupt for {self.kcfg.interrupt_grace:g} s")

    async def _kill_for(self, reason: str) -> None:
        self._killed_for = reason
        log.warning("kernel %s: %s; killing it", self.id, reason)
        await self._kill()

    def death(self) -> tuple[str, bool]:
        """How the kernel died, and whether the agent's code is to blame: it is, unless the host's OOM killer
        (without a cgroup: a SIGKILL while the host's OOM kills rose) or a kill from outside the sandbox (bwrap
        killed by a signal) ended it (cgroup.oom says when one at the limit of all sandboxes counts as its own)."""
        code = self._exited.result() if self._exited is not None and self._exited.done() else None
        oom = self._cgroup.oom() if self._cgroup else "host" * (code == 137 and cgroup.oom_kills() > self._ooms)
        if self._killed_for or oom in ("limit", "all"):
            why = self._killed_for or (f"the sandbox reached its memory limit ({self.sandbox.total_memory_mb:,} MB)"
                                       if oom == "limit" else f"all sandboxes together reached their memory limit "
                                       f"({self._cgroup.shared_mb:,} MB) while it held the most")  # fmt: skip
            return f"killed: {why}", True
        if oom or (code is not None and code < 0):
            how = "by the host's OOM killer" if oom else f"(signal {-code})"
            return f"killed from outside the sandbox {how}", False
        return f"it exited with status {code}" + (f" (signal {code - 128})" if code and code > 128 else ""), True

    async def _collect(self, out: "_Output", deadline: float) -> bool:
        """Read this cell's messages until it is idle and replied, or the kernel is gone; False at the deadline."""
        try:
            with contextlib.suppress(KernelDied):
                while not out.idle:
                    out.add(await self._answer("iopub", deadline))
                while not out.replied:
                    out.add_reply((await self._answer("shell", deadline))["content"])
        except asyncio.TimeoutError:
            return False
        return True

    async def read_notepad(self) -> str:
        """notepad.render() from inside the kernel (silent: no output, not in the history), trimmed to max_output_chars,
        as JSON. Whatever the agent did, the answer is text (a note if the kernel sent no such text within 10 s), and
        raises KernelDied only if the kernel is gone."""
        if not self.is_alive():
            raise self._died()
        limit, unavailable = self.kcfg.max_output_chars, "(the notepad is unavailable: {})".format
        expr = f"__import__('l0_toolbox._capture', fromlist=['Json']).Json(notepad.render(), {limit})"
        try:
            async with self._lock:
                r = await self._request("", silent=True, user_expressions={"n": expr},
                                        timeout=min(10.0, self.kcfg.exec_timeout))  # fmt: skip
        except BROKEN as e:
            await self._kill_for(f"it broke its connection to the host ({type(e).__name__}: {e})")
            raise self._died() from None
        except KernelDied:
            raise self._died() from None
        except asyncio.TimeoutError:
            return unavailable("the kernel did not answer")
        try:  # the kernel's answer is the agent's to forge: check everything
            n = r["user_expressions"]["n"]
            if n["status"] != "ok":
                return trim(unavailable(f"{n.get('ename', '?')}: {n.get('evalue', '')}"), 300)
            raw = n["data"]["text/plain"]
            if len(raw) > 12 * limit + 2:  # the JSON of `limit` characters: at most 12 each (\ud83d\ude00)
                raise ValueError(f"{len(raw):,} characters arrived")
            text = json.loads(raw)
            if not isinstance(text, str):
                raise ValueError(f"a {type(text).__name__} arrived")
        except Exception as e:
            return trim(unavailable(f"the kernel sent no text of at most {limit:,} characters: {e}"), 300)
        return valid_text(trim(text, limit))

    def _died(self) -> KernelDied:
        e = KernelDied(f"kernel {self.id} is not running")
        if self._exited is not None and self._exited.done() and not self._closed:
            how, e.crashed = self.death()
            e.args = (f"kernel {self.id} died: {how}",)
        return e

    # ---------------------------------------------------------------- stop
    async def _kill(self) -> None:
        """SIGKILL the sandbox's pid 1 (its namespace dies with it) and wait for bwrap to exit.
        Unsandboxed, SIGKILL the kernel's process group."""
        for pid in (self.sandbox_pid, self.pid):  # bwrap only if its pid 1 did not die within 5 s
            if pid is None or self._exited is None or self._exited.done():
                continue
            with contextlib.suppress(ProcessLookupError):  # unsandboxed: start_new_session, so pgid == pid
                (os.kill if self.sandbox_pid is not None else os.killpg)(pid, signal.SIGKILL)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._exited), 5.0)

    async def shutdown(self) -> None:
        """Stop the kernel: no process, no runtime folder and no tool socket are left. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for task in self._readers:
            task.cancel()
        if self._kc is not None:
            self._kc.stop_channels()
        await self._kill()
        if self._km is not None:
            self._close_pidfd()
            if (proc := self._proc) is not None:
                if proc.poll() is None:  # reap bwrap; it is dead unless the kill above failed
                    log.error("kernel %s: process %s survived SIGKILL", self.id, proc.pid)
                if proc.stdout is not None:
                    asyncio.get_running_loop().remove_reader(proc.stdout.fileno())
                    proc.stdout.close()
            await self._km.cleanup_resources()
        for fd in self._sockets:
            os.close(fd)
        self._sockets = []
        cgroup.unwatch(self)
        if self._cgroup is not None:
            await self._cgroup.remove()
        if self.tool_server is not None:
            self.tool_server.close_episode(self.id)
        if self.runtime_dir:
            shutil.rmtree(self.runtime_dir, ignore_errors=True)
        if self._uid is not None:
            self._uid.release()  # every process of that uid is gone with the namespace

    def __repr__(self) -> str:
        state = "closed" if self._closed else "alive" if self.is_alive() else "dead" if self._exited else "new"
        return f"Kernel({self.id}, {state})"


def _str(v) -> str:
    if not isinstance(v, str):  # a forged message (BROKEN)
        raise TypeError(f"a text field of a message holds a {type(v).__name__}")
    return v


def _bounded(frame: bytes, limit: int) -> bytes:
    """`frame` if its JSON holds at most `limit` values (its strings, commas and brackets outside them: a bound on
    json.loads's work over any valid prefix, counted unparsed), else a ValueError."""
    plain = frame.replace(b"\\\\", b"").replace(b'\\"', b"")  # no escapes: each quote left opens or closes a string
    n = plain.count(b'"') // 2
    if n > limit or n + sum(b"".join(plain.split(b'"')[::2]).count(c) for c in b",[{") > limit:
        raise ValueError(f"a message frame of more than {limit:,} JSON values")
    return frame


class _Output:
    """Collects one cell's messages into an ExecResult (`r`); memory is bounded whatever arrives."""

    def __init__(self, limit: int):
        self.r, self.limit, self.idle, self.replied = ExecResult(), limit, False, False
        self.streams = {name: _Bounded(limit) for name in ("stdout", "stderr", "display")}

    def add(self, msg: dict) -> None:
        kind, c = msg["msg_type"], msg["content"]
        if kind == "stream":
            self.streams["stderr" if c.get("name") == "stderr" else "stdout"].add(_str(c.get("text", "")))
        elif kind == "execute_result":
            self.r.result = trim(_str(c.get("data", {}).get("text/plain", "")), self.limit)
        elif kind in ("display_data", "update_display_data"):
            if text := _str(c.get("data", {}).get("text/plain", "")):
                self.streams["display"].add(text + "\n")
        elif kind == "error":
            self.r.error_name, self.r.error_value = _str(c.get("ename", "")), _ANSI.sub("", _str(c.get("evalue", "")))
            self.r.traceback = trim(_ANSI.sub("", "\n".join(c.get("traceback", []))), self.limit)
        elif kind == "status" and c.get("execution_state") == "idle":
            self.idle = True

    def add_reply(self, c: dict) -> None:
        self.replied = True
        self.r.truncated |= bool(c.get("l0_truncated"))
        if c.get("status") == "error" and not self.r.error_name:
            self.add({"msg_type": "error", "content": c})

    def finish(self, duration: float) -> ExecResult:
        r = self.r
        (r.stdout, cut_out), (r.stderr, cut_err), (display, cut_display) = (s.value() for s in self.streams.values())
        r.display, r.duration = display.rstrip("\n"), duration
        for name in ("stdout", "stderr", "result", "display", "error_name", "error_value", "traceback"):
            setattr(r, name, valid_text(getattr(r, name)))
        r.truncated |= cut_out or cut_err or cut_display or "characters truncated ...]" in r.result
        return r
