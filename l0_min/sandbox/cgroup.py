"""One cgroup per sandbox: a memory (+swap) and task budget for everything the sandbox does.

RLIMIT_AS and RLIMIT_NPROC count per process or per uid; memfds, tmpfs files and kernel objects
(an inode flood) escape them, a cgroup counts them all. Each sandbox's cgroup is a child of the
one of all this process's sandboxes (`shared`: SHARE of the memory this process may use, so 64
sandboxes of 4 GB on a 24 GB machine meet that limit, and the OOM killer takes a sandbox, before
the machine runs out), a child of this process's own: cgroup v2 where memory and pids are enabled
for this process's children, else the v1 `memory` and `pids` hierarchies where they are writable
(root), else none (`detect` says why, the first kernel start logs it). The sandbox's launcher
shell writes itself into cgroup.procs before it execs bwrap (bwrap.command): moving bwrap after
the spawn would race with its first fork, and children stay where they were born.
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

log = logging.getLogger(__name__)
SHARE = 0.75  # of the memory this process may use, for all its sandboxes together


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _write(path: str, value) -> None:
    with open(path, "w") as f:
        f.write(str(value))


def _rmdir(d: str) -> None:
    with contextlib.suppress(OSError):  # still holds processes (or another cgroup): left for a later sweep
        os.rmdir(d)


@functools.cache
def detect() -> tuple[int, list[str]] | str:
    """(version, the parent folders of the sandboxes' cgroups), or why there are none."""
    own = {}  # controller ("" for v2) -> this process's cgroup
    for line in _read("/proc/self/cgroup").splitlines():
        _, names, path = line.split(":", 2)
        own.update((name, path.rstrip("/")) for name in (names.split(",") if names else [""]))
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


def machine_mb() -> int:
    """The memory this process may use, in MB: the machine's, or its own memory cgroup's limit if lower."""
    total = int(_read("/proc/meminfo").split()[1]) >> 10  # MemTotal, kB
    if not isinstance(how := detect(), str):
        with contextlib.suppress(OSError, ValueError):  # v2 "max": no limit
            total = min(total, int(_read(f"{how[1][0]}/memory.{'max' if how[0] == 2 else 'limit_in_bytes'}")) >> 20)
    return total


@functools.cache
def shared() -> tuple[int, list[str], int] | str:
    """(version, the folders of the cgroup of all this process's sandboxes, its memory limit in MB),
    made at the first call and removed at exit; or why there is none. Removes the ones of dead processes."""
    if isinstance(how := detect(), str):
        return how
    (version, parents), limit = how, int(machine_mb() * SHARE)
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
        else:
            _write(f"{dirs[0]}/memory.limit_in_bytes", limit << 20)
    except OSError as e:
        return f"no cgroup for all sandboxes: {e}"
    atexit.register(lambda: [_rmdir(d) for d in dirs])
    return version, dirs, limit


def _struck(d: str, version: int, limit: int) -> tuple[int, bool, int]:
    """(OOM kills in cgroup `d`, whether memory reached its own limit of `limit` bytes there, its peak
    memory in bytes: 0 where the kernel does not keep it)."""
    if version == 2:  # memory.events.local: this cgroup's own events (Linux 5.2+); memory.peak: 5.19+
        local = ".local" * os.path.exists(f"{d}/memory.events.local")
        events = dict(line.split() for line in _read(f"{d}/memory.events{local}").splitlines())
        peak = int(_read(f"{d}/memory.peak")) if os.path.exists(f"{d}/memory.peak") else 0
        return int(events["oom_kill"]), int(events["oom"]) > 0, peak
    control = dict(line.split() for line in _read(f"{d}/memory.oom_control").splitlines())
    peak = int(_read(f"{d}/memory.max_usage_in_bytes"))
    return int(control.get("oom_kill", 0)), peak >= limit, peak


class Cgroup:
    """The cgroup(s) of one sandbox: made with its limits before it starts, removed after it is gone."""

    def __init__(self, name: str, memory_mb: int, tasks: int):
        self.version, parents, self.shared_mb = shared()
        self.dirs, self.limit = [f"{p}/{name}" for p in parents], memory_mb << 20
        limits = {"memory.max": self.limit, "memory.swap.max": 0, "pids.max": tasks} if self.version == 2 else {
            "memory.limit_in_bytes": self.limit, "memory.memsw.limit_in_bytes": self.limit, "pids.max": tasks}
        for d in self.dirs:
            os.mkdir(d)
        for name, value in limits.items():  # memory before memsw (memory + swap may not be below it)
            for d in self.dirs:
                if os.path.exists(f"{d}/{name}"):  # memsw / swap.max only where swap is accounted
                    _write(f"{d}/{name}", value)
        self.procs = [f"{d}/cgroup.procs" for d in self.dirs]

    def oom(self) -> str:
        """'limit' if the OOM killer struck at the sandbox's own limit; 'all' at the limit of all sandboxes,
        this one having held over half of its own (the OOM killer ranks by mapped memory, not memfds or
        tmpfs files: a small sandbox may die for a big one); 'host' otherwise; '' if it did not strike."""
        d = self.dirs[0]  # v1: the memory hierarchy
        try:
            kills, at_limit, peak = _struck(d, self.version, self.limit)
            big = kills and not at_limit and 2 * peak > self.limit
            all_at_limit = big and _struck(os.path.dirname(d), self.version, self.shared_mb << 20)[1]
        except (OSError, KeyError, ValueError):
            return ""
        return "" if not kills else "limit" if at_limit else "all" if all_at_limit else "host"

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
