"""Memory budgets: one cgroup per sandbox (memory + swap, tasks) where the host can make one, and a watch over all.

RLIMIT_AS and RLIMIT_NPROC count per process or per uid; memfds, tmpfs files and kernel objects (an inode flood) escape
them, a cgroup counts them all. Each sandbox's cgroup is a child of the one of all this process's sandboxes (`shared`),
a child of this process's own: cgroup v2 where memory and pids are enabled for this process's children, else the v1
`memory` and `pids` hierarchies where they are writable (root), else none (`detect` says why, the first kernel start
logs it). The sandbox's launcher shell joins them before it execs bwrap (bwrap.command): children stay where born.

All sandboxes together get SHARE of the memory available at start-up. The OOM killer ranks by resident memory, which
memfds and tmpfs files are not: the host chooses. `watch` reads every PERIOD s, each in a thread (one costing over SLOW
s of CPU kills it, unless the host was reclaiming memory in it), what each sandbox holds (`held`, or `pss`). Past HIGH
of the share (v1: the OOM killer is off at the shared limit, v2: memory.high throttles) it kills, as its own doing, one
holding half the share, else the one that grew the most in the last second (oomd's size-or-growth rule), and without a
cgroup one past its own limit (memfds and SysV shm are refused then: bwrap).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import functools
import glob
import logging
import os
import re
import time

log = logging.getLogger(__name__)
SHARE, HIGH, PERIOD = 0.75, 0.9, 0.25  # all sandboxes' part of the memory at start-up; the watch: where, how often
SLOW, INODE = 0.25, 1 << 10  # the CPU seconds one look at a sandbox may cost (~1.3M mappings); a tmpfs file's bytes


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _write(path: str, value) -> None:
    with open(path, "w") as f:
        f.write(str(value))


def _rmdir(d: str) -> None:
    with contextlib.suppress(OSError):  # still holds processes (or another cgroup): left for a later sweep
        os.rmdir(d)


def _own() -> dict[str, str]:
    """This process's cgroup by controller ("" for v2)."""
    own = {}
    for line in _read("/proc/self/cgroup").splitlines():
        _, names, path = line.split(":", 2)
        own.update((name, path.rstrip("/")) for name in (names.split(",") if names else [""]))
    return own


@functools.cache
def detect() -> tuple[int, list[str]] | str:
    """(version, the parent folders of the sandboxes' cgroups), or why there are none."""
    own = _own()
    for mount in ("/sys/fs/cgroup", "/sys/fs/cgroup/unified"):
        try:
            if {"memory", "pids"} <= set(_read(f"{mount}{own.get('', '/')}/cgroup.subtree_control").split()):
                return 2, [mount + own[""]]
        except (OSError, KeyError):
            pass
    parents = [f"/sys/fs/cgroup/{c}{own[c]}" for c in ("memory", "pids") if c in own]
    if len(parents) == 2 and all(os.access(p, os.W_OK) for p in parents):
        return 1, parents
    return ("no cgroup for sandboxes: neither cgroup v2 with memory and pids enabled for this process's children "
            "nor writable cgroup v1 memory and pids hierarchies (run as root, or delegate a v2 subtree)")


@functools.cache
def available_mb() -> int:
    """The memory available to this process at the first call (start-up), in MB: MemAvailable, or what its memory
    cgroup's limit leaves (a container's, delegated or not) if less."""
    mb, own = int(re.search(r"MemAvailable:\s+(\d+)", _read("/proc/meminfo"))[1]) >> 10, _own()
    for d, limit, used in ((f"/sys/fs/cgroup/memory{own.get('memory')}", "limit_in_bytes", "usage_in_bytes"),
                           (f"/sys/fs/cgroup{own.get('')}", "max", "current")):
        with contextlib.suppress(OSError, ValueError):  # no such hierarchy; v2 "max": no limit
            mb = min(mb, (int(_read(f"{d}/memory.{limit}")) - int(_read(f"{d}/memory.{used}"))) >> 20)
    return mb


@functools.cache
def shared() -> tuple[int, list[str], int] | str:
    """(version, the folders of the cgroup of all this process's sandboxes, its memory limit in MB),
    made at the first call and removed at exit; or why there is none. Removes the ones of dead processes."""
    if isinstance(how := detect(), str):
        return how
    (version, parents), limit = how, int(available_mb() * SHARE)
    for stale in [p for parent in parents for p in glob.glob(f"{parent}/l0_min-*")]:
        if (m := re.fullmatch(r"l0_min-(\d+)(-k\w+)?", os.path.basename(stale))) and not os.path.exists(f"/proc/{m[1]}"):
            [_rmdir(d) for d in [*glob.glob(f"{stale}/*/"), stale]]
    dirs = [f"{p}/l0_min-{os.getpid()}" for p in parents]
    try:
        for d in dirs:
            os.makedirs(d, exist_ok=True)
        if version == 2:
            _write(f"{dirs[0]}/cgroup.subtree_control", "+memory +pids")
            _write(f"{dirs[0]}/memory.max", limit << 20)
            _write(f"{dirs[0]}/memory.high", int(HIGH * limit) << 20)
        else:
            _write(f"{dirs[0]}/memory.limit_in_bytes", limit << 20)
            _write(f"{dirs[0]}/memory.oom_control", 1)
    except OSError as e:
        return f"no cgroup for all sandboxes: {e}"
    atexit.register(lambda: [_rmdir(d) for d in dirs])
    return version, dirs, limit


def _peak(d: str, version: int) -> int:
    """The peak memory of cgroup `d` in bytes (0 where the kernel does not keep it: v2 before Linux 5.19)."""
    name = f"{d}/memory.{'peak' if version == 2 else 'max_usage_in_bytes'}"
    return int(_read(name)) if os.path.exists(name) else 0


def _struck(d: str, version: int, limit: int) -> tuple[int, bool]:
    """(OOM kills in cgroup `d`, whether memory reached its own limit of `limit` bytes there)."""
    if version == 2:  # memory.events.local: this cgroup's own events (Linux 5.2+)
        local = ".local" * os.path.exists(f"{d}/memory.events.local")
        events = dict(line.split() for line in _read(f"{d}/memory.events{local}").splitlines())
        return int(events["oom_kill"]), int(events["oom"]) > 0
    control = dict(line.split() for line in _read(f"{d}/memory.oom_control").splitlines())
    return int(control.get("oom_kill", 0)), _peak(d, 1) >= limit


class Cgroup:
    """The cgroup(s) of one sandbox: made with its limits before it starts, removed after it is gone."""

    def __init__(self, name: str, memory_mb: int, tasks: int):
        self.version, parents, self.shared_mb = shared()
        self.dirs, self.limit = [f"{p}/{name}" for p in parents], memory_mb << 20
        limits = {"memory.max": self.limit, "memory.swap.max": 0, "pids.max": tasks} if self.version == 2 else {
            "memory.limit_in_bytes": self.limit, "memory.memsw.limit_in_bytes": self.limit, "pids.max": tasks,
            "memory.oom_control": 0}  # the OOM killer on at its own limit (a child inherits its parent's off)
        for d in self.dirs:
            os.mkdir(d)
        for name, value in limits.items():  # memory before memsw (memory + swap may not be below it)
            for d in self.dirs:
                if os.path.exists(f"{d}/{name}"):  # memsw / swap.max only where swap is accounted
                    _write(f"{d}/{name}", value)
        self.procs = [f"{d}/cgroup.procs" for d in self.dirs]

    def oom(self) -> str:
        """'limit' if the OOM killer struck at the sandbox's own limit; 'all' at the limit of all sandboxes, its peak
        the largest of theirs; 'host' otherwise; '' if it did not strike."""
        try:
            d, parent = self.dirs[0], os.path.dirname(self.dirs[0])  # v1: the memory hierarchy
            (kills, at_limit), others = _struck(d, self.version, self.limit), glob.glob(f"{parent}/l0_min-*/")
            most = kills and not at_limit and _peak(d, self.version) >= max(_peak(o, self.version) for o in others)
            all_at_limit = most and _struck(parent, self.version, self.shared_mb << 20)[1]
        except (OSError, LookupError, ValueError):  # removed (no dirs left), or its files gone
            return ""
        return "" if not kills else "limit" if at_limit else "all" if all_at_limit else "host"

    def held(self) -> int:
        """Bytes the sandbox holds that the kernel cannot reclaim: all it is charged but the cache of files on disk."""
        with contextlib.suppress(OSError, LookupError, ValueError):  # removed (no dirs left, or its files gone): gone
            d, (used, cache) = self.dirs[0], ("current", "file") if self.version == 2 else ("usage_in_bytes", "cache")
            stat = dict(line.split() for line in _read(f"{d}/memory.stat").splitlines())
            return int(_read(f"{d}/memory.{used}")) - int(stat[cache]) + int(stat["shmem"])  # shmem is cache too
        return 0

    async def remove(self) -> None:
        for _ in range(100):  # its last processes may still be on their way out
            for d in list(self.dirs):
                try:
                    os.rmdir(d)
                except FileNotFoundError:
                    pass
                except OSError:
                    continue
                self.dirs.remove(d)
            if not self.dirs:
                return
            await asyncio.sleep(0.01)
        log.warning("cgroups %s still hold processes after 1 s; left in place", self.dirs)


def pss(pid: int, mounts: tuple[str, ...] = ()) -> int:
    """Bytes the sandbox of pid 1 `pid` holds: its processes' PSS (a shared page split among its users, shared memory
    included; 0 for processes that are gone) and in its tmpfs `mounts` the files' pages and INODE a file."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        with contextlib.suppress(OSError, ValueError, IndexError):  # gone meanwhile
            kids = (_read(f"/proc/{p}/task/{t}/children").split() for t in os.listdir(f"/proc/{p}/task"))
            todo += [int(c) for some in kids for c in some]
            total += int(_read(f"/proc/{p}/smaps_rollup").split("\nPss:")[1].split()[0]) << 10
    with contextlib.suppress(OSError):  # pages no process maps, and kernel memory: an inode flood's is ~0.94 KiB a file
        total += sum((s.f_blocks - s.f_bfree) * s.f_frsize + (s.f_files - s.f_ffree) * INODE
                     for s in (os.statvfs(f"/proc/{pid}/root{m}") for m in mounts))
    return total


def stalled() -> float:  # s the host's tasks have waited for memory (PSI, Linux 4.20+; 0 where it does not say)
    with contextlib.suppress(OSError, TypeError):
        return int(re.search(r"^some .*total=(\d+)", _read("/proc/pressure/memory"))[1]) / 1e6
    return 0.0


def _timed(read) -> tuple[int, float, float]:  # what a sandbox holds; the CPU s reading it cost; the host's stall then
    cpu, stall = time.thread_time(), stalled()
    return read(), time.thread_time() - cpu, stalled() - stall


def oom_kills() -> int:  # the host's OOM kills since boot (/proc/vmstat, Linux 4.13+; 0 where it does not say)
    return int(m[1]) if (m := re.search(r"\boom_kill (\d+)", _read("/proc/vmstat"))) else 0


_watched: dict = {}  # a sandbox's key -> (read: what it holds in bytes, its own limit (0: its cgroup's), kill: async)
_watching: asyncio.Task | None = None


def watch(key, read, limit: int, kill) -> None:
    """Watch a sandbox's memory (the module docstring) until `unwatch(key)`; `read()` runs off the event loop."""
    global _watching
    _watched[key] = read, limit, kill
    if _watching is None or _watching.done() or _watching.get_loop() is not asyncio.get_running_loop():
        _watching = asyncio.ensure_future(_watch())


def unwatch(key, why: str = "") -> None:
    """Stop watching a sandbox; with a reason, kill it (`kill(why)`)."""
    if (entry := _watched.pop(key, None)) is not None and why:
        asyncio.ensure_future(entry[2](why))


async def _watch() -> None:
    share, loop, held, reads, past = int(available_mb() * SHARE), asyncio.get_running_loop(), {}, {}, [{}]  # past: 1 s
    while _watched:  # one read per sandbox at a time, each in a thread (a slow one delays its own), timed in its CPU
        reads |= {key: loop.run_in_executor(None, _timed, read) for key, (read, _, _) in _watched.items()
                  if key not in reads}
        await asyncio.wait(reads.values(), timeout=PERIOD)
        for key in [key for key, f in reads.items() if f.done()]:
            held[key], cost, stall = reads.pop(key).result()
            if cost > SLOW and stall < cost / 2:  # the CPU not the host's own reclaim of memory (it stalls tasks)
                unwatch(key, f"reading its memory cost the host {cost:.1f} s of CPU (more than {SLOW:g} s)")
        held = {key: n for key, n in held.items() if key in _watched}
        for key, n in list(held.items()):
            if (limit := _watched[key][1]) and n > limit:
                unwatch(key, f"the sandbox reached its memory limit ({limit >> 20:,} MB)")
        if held and sum(held.values()) > HIGH * (share << 20):  # (v1 at the shared limit: tasks wait, all is held)
            key = max(held, key=held.get)
            if grew := held[key] <= share << 19:  # none holds half: the one that grew the most in the last second
                key = max(held, key=lambda k: held[k] - past[0].get(k, 0))
            unwatch(key, f"all sandboxes together reached {HIGH:.0%} of their memory limit ({share:,} MB) while it "
                         f"{'grew' if grew else 'held'} the most ({held[key] >> 20:,} MB)")  # fmt: skip
        past = (past + [held])[-4:]
        await asyncio.sleep(PERIOD)
