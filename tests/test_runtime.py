"""runtime: the start-up probe that one sandbox can start, before any kernel or episode."""

import os
import stat

import pytest

from l0_min.config import SandboxConfig
from l0_min.runtime import check_sandbox
from l0_min.sandbox.bwrap import SandboxError


def test_sandbox_probe_passes_where_bwrap_works():
    check_sandbox(SandboxConfig())  # this machine runs bwrap (tests/test_sandbox.py)


@pytest.fixture
def bwrap_without_namespaces(tmp_path, monkeypatch):
    """A `bwrap` first on PATH that fails as bubblewrap 0.8 does in a container without user namespaces."""
    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to create new namespace, likely because the kernel "
                    "does not allow non-privileged user namespaces.' >&2\nexit 1\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")


def test_sandbox_probe_names_the_cause_and_the_options_in_one_line(bwrap_without_namespaces):
    with pytest.raises(SandboxError) as e:
        check_sandbox(SandboxConfig())
    message = str(e.value)
    assert "\n" not in message and message.startswith("sandbox: bwrap cannot start a sandbox here")
    assert "No permissions to create new namespace" in message  # the cause, in bwrap's words
    assert "--security-opt seccomp=unconfined" in message and "sandbox.enabled=false" in message  # the options
    check_sandbox(SandboxConfig(enabled=False))  # the explicit opt-out starts no sandbox


@pytest.mark.slow
def test_train_stops_at_start_up_with_that_line(bwrap_without_namespaces, tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    p = subprocess.run([sys.executable, "train.py", "--config", "configs/tiny_test.yaml", f"run.out_dir={tmp_path}"],
                       cwd=root, capture_output=True, text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    errors = [line for line in p.stderr.splitlines() if line.startswith("train.py: error:")]
    assert p.returncode == 2 and len(errors) == 1, p.stderr[-2000:]
    assert "bwrap cannot start a sandbox here (bwrap: No permissions" in errors[0]
    assert "inference ready" not in p.stdout  # checked before the inference server is started or waited for


def test_memory_peak_counts_children_started_from_any_thread():
    # a child started from a worker thread (asyncio.to_thread starts the embedded server so) is listed under
    # that thread in /proc while it lives, not under the main one; its 200 MB, touched, are in the tree's PSS
    import subprocess
    import sys
    import threading
    import time

    from l0_min.runtime import PEAK_MB, tree_pss_mb, watch_memory

    before, started, measured = tree_pss_mb(os.getpid()), [], threading.Event()
    code = "import sys, time; b = bytearray(200 << 20); print('ok', flush=True); time.sleep(30)"

    def spawn():
        started.append(subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True))
        measured.wait(30)

    thread = threading.Thread(target=spawn)
    thread.start()
    try:
        while not started:
            time.sleep(0.01)
        assert started[0].stdout.readline() == "ok\n"
        watch_memory(every=0.05)
        deadline = time.time() + 10
        while PEAK_MB[0] < before + 190 and time.time() < deadline:  # 200 MB private, ~10 MB of its own
            time.sleep(0.05)
        assert tree_pss_mb(os.getpid()) - before > 190 and PEAK_MB[0] - before > 190
    finally:
        measured.set()
        started[0].kill()
        started[0].wait()
        thread.join()
