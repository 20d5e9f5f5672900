"""The host side of the agent's tools: one aiohttp server, one unix socket per episode.

    server = ToolServer(backend)              # backend: async search(query, k), async read_page(ref)
    await server.start()
    path = server.open_episode(kernel.id)     # the kernel's sandbox binds this socket (and only it)
    server.allow(kernel.id, ("web_search",))  # the task's search tools (default: all; submit_final_answer always)
    server.final_answer(kernel.id)            # recorded when the call arrived; None if none
    server.served(kernel.id)                  # what its tools served: (tool, page) pairs, for the env's step rewards
    server.close_episode(kernel.id)

The socket a request arrives on names its episode; printed text is never parsed for answers. Every request and call is
bounded (connections, rate, sizes, time), and an episode's backend calls take turns in its own line, so one episode's
searches delay only itself (docs/internals.md "Inside the loop" has the bounds). A call that fails is the backend's
failure (`backend_errors`: retried, then masked) only if PROBE, a request no agent chose, fails too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import shutil
import socket
import tempfile
import time
from collections import Counter, OrderedDict

from aiohttp import web

from l0_min.config import is_number
from l0_min.context import valid_text

log = logging.getLogger(__name__)

TOOLS = ("web_search", "read_page", "submit_final_answer")
PROBE = {"web_search": {"query": "wikipedia", "k": 1}, "read_page": {"ref": "https://example.com"}}  # no agent's


class ToolServer:
    max_connections = 8  # open connections per episode
    calls_per_second = 10  # per episode; a legit cell makes a few
    backend_calls = 1  # per episode at the backend at once; its other calls wait in its own line
    max_arg_chars = 2000  # a query, a ref, an answer
    max_request_bytes = 64 << 10  # 3 such arguments, JSON-escaped at up to 6 bytes a character, fit
    max_served = 1000  # (tool, page) records kept per episode

    def __init__(self, backend=None, *, timeout: float = 20.0, snippet_chars: int = 300, page_chars: int = 4000,
                 top_k: int = 3, keep_closed: int = 10000):  # fmt: skip
        self.backend, self.timeout, self.keep_closed = backend, timeout, keep_closed
        self.snippet_chars, self.page_chars, self.top_k = snippet_chars, page_chars, top_k
        self.root: str | None = None  # the sockets' folder (0700: only this user reaches them)
        self._runner: web.AppRunner | None = None
        self._sites: dict[str, tuple] = {}  # open: key -> (path, listener, connections, [calls due, when], its line)
        self._by_path: dict[str, str] = {}  # socket path -> key
        self._answers: dict[str, str] = {}
        self._allowed: dict[str, tuple[str, ...]] = {}  # key -> the search tools its task may call
        self._calls: dict[str, Counter] = {}
        self._served: dict[str, list[tuple[str, str]]] = {}  # key -> (tool, search hit's id | read page's first line)
        self._errors: dict[str, list[str]] = {}  # backend failures (timeouts, exceptions) per episode
        self._closed_keys: OrderedDict[str, None] = OrderedDict()  # closed episodes, oldest first
        self._pending: set[asyncio.Task] = set()
        self._warned = 0.0  # when accept() last failed for want of descriptors

    async def start(self) -> None:
        self.root = tempfile.mkdtemp(prefix="l0_min-tools-")
        app = web.Application(client_max_size=self.max_request_bytes)
        app.router.add_post("/call", self._handle)
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)  # a hang-up ends its call
        await self._runner.setup()

    async def close(self) -> None:
        for key in list(self._sites):
            self.close_episode(key)
        await asyncio.gather(*self._pending, return_exceptions=True)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self.root:
            shutil.rmtree(self.root, ignore_errors=True)

    # ------------------------------------------------------------------ episodes
    def open_episode(self, key: str) -> str:
        """Listen on a fresh unix socket for this episode and return its host path."""
        if self._runner is None:
            raise RuntimeError("ToolServer.open_episode: call `await start()` first")
        if key in self._sites:
            raise ValueError(f"ToolServer.open_episode: episode {key!r} is already open")
        path = os.path.join(self.root, f"{secrets.token_hex(8)}.sock")  # a neutral name: it shows in mountinfo
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(path)
        os.chmod(path, 0o666)  # the sandbox may run as another uid; the folder keeps others out
        sock.listen(self.max_connections)  # connections queue from now on
        sock.setblocking(False)
        bucket, line = [self.calls_per_second, time.monotonic()], asyncio.Semaphore(self.backend_calls)
        self._sites[key], self._by_path[path] = (path, sock, set(), bucket, line), key
        self._calls[key], self._served[key] = Counter(), []
        asyncio.get_running_loop().add_reader(sock, self._accept, key)
        return path

    def _accept(self, key: str) -> None:
        """Accept what the episode's connection cap and call rate allow, then pause (bounded work per turn)."""
        path, sock, open_, bucket, _ = self._sites[key]
        open_ -= {c for c in open_ if c.fileno() < 0}  # closed by aiohttp
        loop, now = asyncio.get_running_loop(), time.monotonic()
        bucket[:] = min(self.calls_per_second, bucket[0] + (now - bucket[1]) * self.calls_per_second), now
        pause = 0.02
        while len(open_) < self.max_connections:
            if bucket[0] < 1:  # until the next call is due
                pause = max(pause, (1 - bucket[0]) / self.calls_per_second)
                break
            try:
                conn, _ = sock.accept()
            except (BlockingIOError, InterruptedError):
                break
            except OSError as e:  # EMFILE, ENFILE, ENOBUFS: say so once a minute, not once per connection
                if time.monotonic() - self._warned > 60:
                    self._warned = time.monotonic()
                    log.error("tool server: cannot accept connections (%s); pausing the episode's socket", e)
                pause = 1.0
                break
            open_.add(conn)
            bucket[0] -= 1
            task = asyncio.ensure_future(self._serve(conn))
            self._pending.add(task)
            task.add_done_callback(self._done)
        loop.remove_reader(sock)
        loop.call_later(pause, lambda: sock.fileno() >= 0 and loop.add_reader(sock, self._accept, key))

    async def _serve(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        try:
            transport, _ = await loop.connect_accepted_socket(self._runner.server, conn)
        except BaseException:
            conn.close()
            raise
        loop.call_later(3 * self.timeout + 5, transport.abort)  # idle, slow clients too; a call: line, backend, probe

    def close_episode(self, key: str) -> None:
        """Stop listening for this episode; its answer and counts stay readable for a while."""
        if (entry := self._sites.pop(key, None)) is None:
            return
        path, sock, *_ = entry
        self._by_path.pop(path, None)
        asyncio.get_running_loop().remove_reader(sock)
        sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        self._closed_keys[key] = None
        while len(self._closed_keys) > self.keep_closed:
            old, _ = self._closed_keys.popitem(last=False)
            for records in (self._answers, self._calls, self._errors, self._allowed, self._served):
                records.pop(old, None)

    def allow(self, key: str, tools: tuple[str, ...]) -> None:
        """The search tools this episode's task may call (its environment's); the others are refused."""
        self._allowed[key] = tuple(tools)

    def final_answer(self, key: str) -> str | None:
        return self._answers.get(key)

    def tool_calls(self, key: str) -> dict[str, int]:
        return dict(self._calls.get(key, {}))

    def served(self, key: str) -> list[tuple[str, str]]:
        """What the episode's tools served, in order: ("web_search", a hit's id), ("read_page", the text's first line)."""
        return list(self._served.get(key, ()))

    def backend_errors(self, key: str) -> list[str]:
        """What went wrong in this episode's backend calls that the backend's probe failed too (PROBE)."""
        return list(self._errors.get(key, []))

    def _done(self, task: asyncio.Task) -> None:
        self._pending.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("tool server: a connection failed: %r", task.exception())

    # ------------------------------------------------------------------ requests
    async def _handle(self, request: web.Request) -> web.Response:
        key = self._by_path.get(request.transport.get_extra_info("sockname") if request.transport else None)
        if key is None:
            return _reply(False, "this socket belongs to no open episode", 403)
        line = self._sites[key][4]
        try:
            body = await request.json()
            tool, args = body["tool"], body.get("args") or {}
            assert isinstance(args, dict)
        except web.HTTPRequestEntityTooLarge:
            return _reply(False, f"the request body is over the limit of {request.client_max_size:,} bytes", 413)
        except Exception:
            return _reply(False, 'the request must be JSON {"tool": name, "args": {...}}', 400)
        if tool not in TOOLS:
            return _reply(False, f"unknown tool {tool!r} (known: {', '.join(TOOLS)})", 400)
        if tool != "submit_final_answer" and tool not in self._allowed.get(key, TOOLS):
            return _reply(False, f"{tool} is not available in this task", 403)
        self._calls[key][tool] += 1
        try:
            if tool == "submit_final_answer":
                return _reply(True, self._submit(key, args))
            result = await self._in_turn(line, tool, args)
            pages = [h["id"] for h in result] if tool == "web_search" else [result.split("\n", 1)[0][:200]]
            self._served[key] += [(tool, p) for p in pages][: self.max_served - len(self._served[key])]
        except ValueError as e:
            return _reply(False, str(e), 400)
        except Exception as e:  # asyncio.TimeoutError included
            why = (f"the {tool} backend did not answer within {self.timeout:g} s" if isinstance(e, asyncio.TimeoutError)
                   else f"the {tool} backend failed: {type(e).__name__}: {e}")  # fmt: skip
            try:  # the backend answers PROBE, a request no agent chose: the request failed, an answer to the agent
                await asyncio.wait_for(self._backend_call(tool, PROBE[tool]), self.timeout)
            except Exception:  # it fails too: the backend's failure
                log.warning("tool %s of episode %s: %s", tool, key, why)
                self._errors[key] = (self._errors.get(key, []) + [why])[:20]
            return _reply(False, why, 502)
        return _reply(True, result)

    def _text(self, args: dict, name: str, blank_ok: bool = False) -> str:
        """A text argument of at most max_arg_chars (not blank unless `blank_ok`), else a ValueError for the agent."""
        v = args.get(name)
        if not isinstance(v, str) or not (blank_ok or v.strip()):
            raise ValueError(f"{name} must be a {'' if blank_ok else 'non-empty '}string, got {v!r:.60}")
        if len(v) > self.max_arg_chars:
            raise ValueError(f"the {name} has {len(v):,} characters, more than the {self.max_arg_chars:,} allowed")
        return v

    def _submit(self, key: str, args: dict) -> dict:
        answer = self._text(args, "answer", blank_ok=True)  # the agent's text, kept as sent
        if key in self._answers:
            return {"accepted": False, "answer": self._answers[key]}
        self._answers[key] = answer
        return {"accepted": True, "answer": answer}

    async def _in_turn(self, line: asyncio.Semaphore, tool: str, args: dict):
        """The backend call, in the episode's turn (its `line`): a wait past `timeout` is the agent's error."""
        try:
            await asyncio.wait_for(line.acquire(), self.timeout)
        except asyncio.TimeoutError:
            raise ValueError(f"this episode's earlier tool calls held the backend for {self.timeout:g} s") from None
        try:
            return await asyncio.wait_for(self._backend_call(tool, args), self.timeout)
        finally:
            line.release()

    async def _backend_call(self, tool: str, args: dict):
        if self.backend is None:
            raise ValueError("no search backend is configured (tools.search=none)")
        if tool == "web_search":
            query, k = valid_text(self._text(args, "query")), args.get("k", self.top_k)
            if not is_number(k, integer=True) or not 1 <= k <= 20:
                raise ValueError(f"k must be an integer from 1 to 20, got {k!r}")
            hits = await self.backend.search(query, k)
            return [{"id": str(h.get("id", "")), "title": str(h.get("title", "")),
                     "snippet": str(h.get("text", ""))[: self.snippet_chars], "score": float(h.get("score", 0.0))}
                    for h in hits[:k]]  # fmt: skip
        ref = valid_text(self._text(args, "ref"))
        return str(await self.backend.read_page(ref))[: self.page_chars]


def _reply(ok: bool, payload, status: int = 200) -> web.Response:
    """One reply; the connection closes after it (one request a connection: `_accept` paces the calls)."""
    r = web.json_response({"ok": True, "result": payload} if ok else {"ok": False, "error": payload}, status=status)
    r.force_close()
    return r
