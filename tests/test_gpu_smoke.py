"""bench/gpu_smoke.py (make gpu-smoke) on CPU: 2 gloo ranks, two embedded servers, every check passes."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # torchrun, two ranks and two servers in subprocesses
ROOT = Path(__file__).resolve().parents[1]


def test_gpu_smoke_passes_on_cpu(tmp_path):
    env = dict(os.environ, L0_MIN_CACHE=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        "bench/gpu_smoke.py"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    lines = [line for line in p.stdout.splitlines() if line.startswith(("PASS", "FAIL"))]
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert [line.split()[1] for line in lines[:-1]] == ["collectives", "sticky", "export", "version", "logprobs", "resume"]
    assert all(line.startswith("PASS") for line in lines) and lines[-1].startswith("PASS: 6 of 6 checks"), lines
