"""Run by tests/test_adversarial.py (issue 23, weakness 5) inside a cgroup of 1,200 MB: a host that holds
500 MB itself starts two sandboxes (1,024 MB each), and each writes 400 MB of memfds at once (memfd
pages are in no process's RSS, so without oom_score_adj the OOM killer took the host). Prints one JSON
line: each cell's end and the cgroup of all sandboxes; that it prints at all says the host lived.
"""

import asyncio
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from l0_min.config import KernelConfig, SandboxConfig  # noqa: E402
from l0_min.sandbox import cgroup  # noqa: E402
from l0_min.sandbox.kernel import Kernel  # noqa: E402

HOG = "import os\nfds = [os.memfd_create('x') for _ in range(25)]\nfor fd in fds:\n    os.write(fd, b'0' * (16 << 20))\n'held'"


async def main() -> None:
    held = bytearray(500 << 20)
    held[::4096] = b"\1" * len(held[::4096])  # touch every page: 500 MB resident
    kernels = [Kernel(SandboxConfig(total_memory_mb=1024), KernelConfig(exec_timeout=60, start_timeout=120))
               for _ in range(2)]  # fmt: skip
    await asyncio.gather(*(k.start() for k in kernels))
    adj = [open(f"/proc/{k.sandbox_pid}/oom_score_adj").read().strip() for k in kernels]
    cells = await asyncio.gather(*(k.execute(HOG) for k in kernels))
    await asyncio.gather(*(k.shutdown() for k in kernels))
    print(json.dumps({"cells": [{"result": r.result, "dead": r.dead, "death": r.death, "crashed": r.crashed} for r in cells],
                      "adj": adj, "shared": cgroup.shared(), "host_mb": len(held) >> 20}))  # fmt: skip


asyncio.run(main())
