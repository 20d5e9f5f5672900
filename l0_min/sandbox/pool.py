"""A pool of started kernels: one kernel per episode, destroyed after it (a clean environment for every episode).

    pool = KernelPool(cfg.sandbox, cfg.kernel, tool_server)
    await pool.start()                            # prewarms pool_size kernels in the background
    k = await pool.acquire(); ...; await pool.release(k)   # never reused
    await pool.close()

It keeps `pool_size` kernels ready or starting, plus one per waiting `acquire`, at most `max_starting` starting at
once. A failed start is retried with backoff; after `start_retries` failures in a row the waiting `acquire` raises
KernelStartError with the last error. `stats` counts what happened.
"""

from __future__ import annotations

import asyncio
import logging
import os

from l0_min.sandbox import bwrap as sb
from l0_min.config import KernelConfig, SandboxConfig
from l0_min.sandbox.kernel import Kernel, KernelStartError, check

log = logging.getLogger(__name__)


class KernelPool:
    def __init__(self, sandbox: SandboxConfig, kcfg: KernelConfig, tool_server=None):
        check(kcfg)
        self.sandbox, self.kcfg, self.tool_server = sandbox, kcfg, tool_server
        self.stats = {"started": 0, "failed_starts": 0, "acquired": 0, "released": 0, "discarded_dead": 0,
                      "start_seconds": 0.0, "last_error": ""}  # fmt: skip
        self._ready: asyncio.Queue = asyncio.Queue()  # started kernels, or the error of a slot that gave up
        self._starting = 0  # prewarm tasks that have not delivered yet
        self._waiting = 0  # acquire calls waiting for a kernel
        self._tasks: set[asyncio.Task] = set()
        self._out: set[Kernel] = set()  # acquired, not yet released
        self._sem = asyncio.Semaphore(kcfg.max_starting or 2 * (os.cpu_count() or 1))
        self._started = self._closed = False

    async def start(self) -> None:
        """Check the sandbox setup (fails fast with a clear message), then prewarm in the background."""
        sb.check(self.sandbox)
        if self.sandbox.enabled:
            sb.find_tool("bwrap"), sb.find_tool("prlimit")
            if sb.runs_as_root():
                sb.find_tool("setpriv")
        self._started = True
        self._top_up()

    def _top_up(self) -> None:
        while not self._closed and self._ready.qsize() + self._starting < self.kcfg.pool_size + self._waiting:
            self._starting += 1
            task = asyncio.ensure_future(self._prewarm())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _prewarm(self) -> None:
        """Start one kernel, retrying with backoff; deliver it (or the final error) to the queue."""
        retries = self.kcfg.start_retries
        try:
            for attempt in range(retries):
                if attempt:
                    await asyncio.sleep(self.kcfg.start_backoff * 2 ** (attempt - 1))
                kernel = Kernel(self.sandbox, self.kcfg, self.tool_server)
                try:
                    async with self._sem:
                        await kernel.start()
                except (KernelStartError, OSError) as e:
                    error = self._failed(e)
                    log.warning("kernel start failed (attempt %d of %d): %s", attempt + 1, retries, e)
                    continue
                self.stats["started"] += 1
                self.stats["start_seconds"] += kernel.start_seconds
                return self._ready.put_nowait(kernel)
            self._ready.put_nowait(KernelStartError(f"no kernel started after {retries} attempts; last error: {error}"))
        except Exception as e:  # a setup error (config, missing tool): retrying will not help
            self._ready.put_nowait(self._failed(e))
        finally:
            self._starting -= 1

    def _failed(self, e: BaseException) -> BaseException:
        self.stats["failed_starts"] += 1
        self.stats["last_error"] = str(e)[:2000]
        return e

    async def acquire(self) -> Kernel:
        """A fresh started kernel; waits for one if none is ready."""
        if self._closed:
            raise RuntimeError("KernelPool.acquire: the pool is closed")
        if not self._started:
            raise RuntimeError("KernelPool.acquire: call `await pool.start()` first")
        while True:
            self._waiting += 1
            self._top_up()
            try:
                item = await self._ready.get()
            finally:
                self._waiting -= 1
            if isinstance(item, BaseException):
                raise item
            if item.is_alive():
                self.stats["acquired"] += 1
                self._out.add(item)
                return item
            self.stats["discarded_dead"] += 1  # died while waiting in the pool
            log.warning("discarding kernel %s, which died in the pool: %s", item.id, item.log_tail()[-500:])
            await item.shutdown()

    async def release(self, kernel: Kernel) -> None:
        """Destroy the kernel of a finished episode (its replacement is already starting)."""
        self._out.discard(kernel)
        await kernel.shutdown()
        self.stats["released"] += 1

    async def close(self) -> None:
        """Stop prewarming and shut down every kernel, ready or acquired."""
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        kernels = list(self._out)
        while not self._ready.empty():
            item = self._ready.get_nowait()
            if isinstance(item, Kernel):
                kernels.append(item)
        await asyncio.gather(*(k.shutdown() for k in kernels), return_exceptions=True)
        self._out.clear()
        for _ in range(self._waiting):  # wake acquirers that would otherwise wait forever
            self._ready.put_nowait(RuntimeError("KernelPool.acquire: the pool was closed"))

    @property
    def ready(self) -> int:
        return self._ready.qsize()
