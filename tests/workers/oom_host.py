"""Run by tests/test_adversarial.py in a cgroup that stands for the machine (the test sets its limit), as

    python oom_host.py SCENARIO MODE     MODE: cgroup (the sandboxes' own cgroups) or none (detection forced off)

    host   (issue 23, test 12) two sandboxes of 1,024 MB start, the host then holds 500 MB of its 1,200 MB, and
           each sandbox writes 400 MB at once: the OOM killer (or the memory watch) must take a sandbox, not the host
    share  (issue 34, test 16) five sandboxes each write 448 MB (under half of their own 1,024 MB) and an innocent
           one holds 50 MB: together they pass their share of 2,400 MB: the host kills those holding the most
    inodes (issue 44, test 18) an innocent sandbox holds 150 MB, then another makes empty files (~0.94 KiB of kernel
           memory each, in no process's memory) until it is stopped
    tmpfs  (issue 44, test 19) an innocent sandbox holds 300 MB, then six others fill their tmpfs mounts (376 MB each,
           pages no process maps)

A sandbox's memory is memfds where it has a cgroup (in no process's RSS), anonymous memory where it has none
(memfds are refused then). Prints one JSON line: each cell's end, the share; that it prints at all says the host
lived.
"""

import asyncio
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from l0_min.config import KernelConfig, SandboxConfig  # noqa: E402
from l0_min.sandbox import cgroup  # noqa: E402
from l0_min.sandbox.kernel import Kernel  # noqa: E402

MEMFD = ("import os\nhold = []\ndef chunk():  # one memfd a chunk: each under RLIMIT_FSIZE\n"
         "    hold.append(os.memfd_create('x'))\n    os.write(hold[-1], b'0' * (16 << 20))\n")
ANON = "hold = []\ndef chunk():\n    hold.append(bytearray(b'0') * (16 << 20))\n"
HOG = "import time\nfor _ in range({n}):\n    chunk()\n    time.sleep({pause})\n'held'"  # 16 MB at a time
INNOCENT = "import time\nx = bytearray(b'1') * ({mb} << 20)\ntime.sleep({s})\n'innocent'"
INODES = ("import os, time\ntime.sleep(1)\nfor i in range(3_000_000):\n"
          "    os.close(os.open(f'/workspace/{i}', os.O_CREAT | os.O_WRONLY))")
TMPFS = """import time
time.sleep(1.5)
for folder in ('/workspace', '/tmp', '/dev/shm'):  # 16 MB files (RLIMIT_FSIZE is 64 MB) until each is full
    try:
        for i in range(100):
            with open(f'{folder}/f{i}', 'wb') as f:
                f.write(b'1' * (16 << 20))
            time.sleep(0.05)  # as the share scenario's hogs: the watch, not the box's OOM killer, stops them
    except OSError:
        pass
time.sleep(3)
'held'"""


def cells_of(scenario: str, mode: str) -> list[str]:
    """Each sandbox's cell: the attackers', then the innocent's (if any)."""
    hog = (MEMFD if mode == "cgroup" else ANON) + HOG
    return {"host": [hog.format(n=25, pause=0.0)] * 2,
            "share": [hog.format(n=28, pause=0.05)] * 5 + [INNOCENT.format(mb=50, s=3)],
            "inodes": [INODES, INNOCENT.format(mb=150, s=6)],
            "tmpfs": [TMPFS] * 6 + [INNOCENT.format(mb=300, s=6)]}[scenario]  # fmt: skip


async def heartbeat(stall: list) -> None:
    """tests/test_adversarial.py's Heartbeat: a 10 ms tick's lateness, at most the loop thread's CPU time meanwhile."""
    while True:
        t, cpu = time.monotonic(), time.thread_time()
        await asyncio.sleep(0.01)
        stall[0] = max(stall[0], min(time.monotonic() - t - 0.01, time.thread_time() - cpu))


async def main(scenario: str, mode: str) -> None:
    if mode == "none":
        cgroup.detect = lambda: "no cgroup for sandboxes: turned off by the test"
    codes = cells_of(scenario, mode)
    kernels = [Kernel(SandboxConfig(total_memory_mb=1024), KernelConfig(exec_timeout=60, start_timeout=120))
               for _ in codes]  # fmt: skip
    await asyncio.gather(*(k.start() for k in kernels))
    adj = [open(f"/proc/{k.sandbox_pid}/oom_score_adj").read().strip() for k in kernels]
    held = bytearray(500 << 20) if scenario == "host" else bytearray()
    held[::4096] = b"\1" * len(held[::4096])  # touch every page: 500 MB resident
    stall = [0.0]  # from here on: the host's own work above is no stall
    beat = asyncio.ensure_future(heartbeat(stall))
    cells = await asyncio.gather(*(k.execute(code) for code, k in zip(codes, kernels)))
    await asyncio.sleep(2 * cgroup.PERIOD)  # a kernel may die after its cell, for one that allocated later
    ends = [(r.death, r.crashed) if r.dead else k.death() if not k.is_alive() else ("", False)
            for r, k in zip(cells, kernels)]
    await asyncio.gather(*(k.shutdown() for k in kernels))
    beat.cancel()
    print(json.dumps({"cells": [{"result": r.result, "error": r.error_value, "dead": bool(death), "death": death,
                                 "crashed": crashed} for r, (death, crashed) in zip(cells, ends)],
                      "adj": adj, "share": int(cgroup.available_mb() * cgroup.SHARE), "available": cgroup.available_mb(),
                      "shared": cgroup.shared(), "host_mb": len(held) >> 20,
                      "stall_ms": 1000 * stall[0]}))  # fmt: skip


asyncio.run(main(*sys.argv[1:3]))
