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


def fake_nvidia_smi(folder: Path, cuda: str = "12.4") -> Path:
    """An `nvidia-smi` that lists one GPU whose driver supports CUDA `cuda` (a double for this test only)."""
    folder.mkdir(parents=True, exist_ok=True)
    exe = folder / "nvidia-smi"
    exe.write_text(f'#!/bin/sh\n[ "$1" = -L ] && echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)" && exit 0\n'
                   f'echo "| NVIDIA-SMI 550.54.15   Driver Version: 550.54.15   CUDA Version: {cuda} |"\n')
    exe.chmod(0o755)
    return folder


def test_gpus_present_but_unusable_fail_the_first_check(tmp_path):
    """A CPU fallback where nvidia-smi sees GPUs would pass every check; instead the first one FAILs with the
    reason (here torch cannot use CUDA: CUDA_VISIBLE_DEVICES hides any real GPU) and the smoke test stops."""
    env = dict(os.environ, PATH=f"{fake_nvidia_smi(tmp_path / 'bin')}:{os.environ['PATH']}", CUDA_VISIBLE_DEVICES="",
               L0_MIN_CACHE=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "bench/gpu_smoke.py"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 1, p.stdout[-2000:] + p.stderr[-2000:]
    first, last = p.stdout.splitlines()[0], p.stdout.splitlines()[-1]
    assert first.startswith("FAIL  collectives  learner.device=cuda but torch") and last.startswith("FAIL: 0 of 1"), p.stdout
