"""Bring up (and tear down) what episodes need, the same way for train.py, rollout.py and evaluate.py:

    async with rollout_env(cfg, model_path, tokenizer, tasks, envs, log_dir=run_dir) as svc:
        ...  # svc.policy (InferenceClient), svc.kernels (KernelPool), svc.tools (ToolServer), svc.envs

The policy (`policy_client`) is `inference.urls` or, where empty, the embedded CPU server started on `model_path`,
ready before it returns; the tool server gets a search backend (`tools.search`) where an environment searches; the
kernel pool starts after one probe sandbox (`check_sandbox`). `sync_weights` hands a new policy to the servers.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from .collect import Services
from .config import Config, SandboxConfig
from .inference import InferenceClient
from .sandbox import bwrap, cgroup
from .sandbox.pool import KernelPool
from .search import make_backend
from .serve.server import start_server_process, stop_server_process
from .sandbox.tools import ToolServer

log = logging.getLogger(__name__)


def check_sandbox(cfg: SandboxConfig) -> None:
    """Run `true` in one sandbox built like a kernel's (bwrap.command: the same namespaces, mounts and limits): where
    bwrap cannot create namespaces (GPU containers often), stop here with one line, not an env_error per episode."""
    if not cfg.enabled:
        return
    lease = bwrap.UidLease(cfg) if bwrap.runs_as_root() else None
    try:
        with tempfile.TemporaryDirectory() as d:
            argv = bwrap.command(cfg, d, ["true"], uid=lease.uid if lease else None)
            p = subprocess.run(argv, capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
    finally:
        if lease:
            lease.release()
    if p.returncode != 0:
        lines = p.stderr.strip().splitlines() or [f"exit status {p.returncode}"]
        cause = next((line for line in lines if line.startswith("bwrap:")), lines[-1])
        raise bwrap.SandboxError(
            f"sandbox: bwrap cannot start a sandbox here ({cause}). Options: run the container with --security-opt "
            "seccomp=unconfined --security-opt apparmor=unconfined (plus --cap-add SYS_ADMIN when it runs as root), or "
            "allow unprivileged user namespaces on the host (sysctl kernel.apparmor_restrict_unprivileged_userns=0); "
            "or set sandbox.enabled=false to run kernels without a sandbox (unsafe; logged)")


async def sync_weights(policy: InferenceClient, folder: Path, version: str) -> None:
    """Every worker loads the weights folder `folder` and confirms `version`; then the other step_* folders beside it
    go. A failed load raises (SGLang's rollback re-reads the new folder, docs/gpu.md), so train.py stops."""
    folder = Path(folder).resolve()
    await policy.update_weights_from_disk(str(folder), version)
    for old in folder.parent.glob("step_*"):
        if old != folder:
            shutil.rmtree(old, ignore_errors=True)
    from .serve.engine import trim_heap

    trim_heap()  # what the learner step and the export freed (GBs of activations) goes back to the system


def tree_pss_mb(pid: int) -> float:
    """PSS (shared pages split among the processes that map them) of a process and all its descendants, MB."""
    return cgroup.pss(pid) / (1 << 20)  # the sandboxes' memory watch's reading: a zombie child counts 0


PEAK_MB = [0.0]  # the largest tree_pss_mb of this process that watch_memory's thread saw


def watch_memory(every: float = 2.0) -> None:
    """From the first call on, a thread samples the memory of this process and its descendants (the embedded
    server, the kernels) every `every` seconds into PEAK_MB[0]."""
    def sample():
        while True:
            PEAK_MB[0] = max(PEAK_MB[0], tree_pss_mb(os.getpid()))
            time.sleep(every)

    if not any(t.name == "l0_min-memory" for t in threading.enumerate()):
        threading.Thread(target=sample, daemon=True, name="l0_min-memory").start()


def settle_gc(young: int = 20_000) -> None:
    """Once a long-running process is set up: gc.freeze what is alive and collect young objects less often (full
    collections re-scanned the model and modules: 0.06-0.33 s of ~1.7 s per round of bench/rollout.py at 64)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(young, *gc.get_threshold()[1:])


@contextlib.asynccontextmanager
async def policy_client(cfg: Config, model_path: str | Path, log_dir: str | Path | None = None):
    """An InferenceClient on `cfg.inference.urls`, else on the embedded server started on `model_path`
    (and stopped at the end), once every server is ready."""
    async with contextlib.AsyncExitStack() as stack:
        urls = list(cfg.inference.urls)
        if cfg.inference.worker_urls and not urls:
            raise ValueError("inference.worker_urls needs inference.urls (the URL(s) that generate)")
        if not urls:  # `python -m l0_min.serve` on the model
            args = ["--dtype", cfg.model.serving_dtype(cuda=False), *cfg.inference.embedded_args]
            if "--threads" not in args:  # a core left to the kernels and the loop: threads contending with them run slower
                args += ["--threads", str(max(1, (os.cpu_count() or 1) - 1))]
            proc, url = await asyncio.to_thread(start_server_process, str(model_path), port=cfg.inference.embedded_port,
                                                extra_args=args, log_path=Path(log_dir) / "server.log" if log_dir else None)
            stack.callback(stop_server_process, proc)
            urls = [url]
            log.info("embedded inference server at %s (log: %s)", url, proc.log_path)
        client = InferenceClient(urls, cfg.inference, max_connections=max(8, cfg.rollout.max_concurrency))
        stack.push_async_callback(client.close)
        waited = await client.wait_ready()
        print(f"inference ready: {', '.join(urls)} ({waited:.0f} s)", flush=True)
        yield client


async def servers_ready(cfg: Config) -> None:
    """Wait until inference.urls answer /health (train.py, before the learner: a server on its GPU has then taken the
    memory the learner's check must leave it)."""
    async with policy_client(cfg, ""):
        pass


@contextlib.asynccontextmanager
async def rollout_env(cfg: Config, model_path: str | Path, tokenizer, tasks: list, envs: dict,
                      log_dir: str | Path | None = None):
    async with contextlib.AsyncExitStack() as stack:
        watch_memory()
        await asyncio.to_thread(check_sandbox, cfg.sandbox)  # seconds, where the servers may take minutes
        client = await stack.enter_async_context(policy_client(cfg, model_path, log_dir))
        searching = [e for e in envs.values() if e.tools]
        docs = [d for e in searching for d in e.corpus([t for t in tasks if t.env == e.name])]
        backend = make_backend(cfg.tools, docs=docs) if searching else None
        if backend is not None and hasattr(backend, "close"):
            stack.push_async_callback(backend.close)
        t = cfg.tools
        tools = ToolServer(backend, timeout=t.timeout, snippet_chars=t.snippet_chars, page_chars=t.page_chars, top_k=t.top_k)
        await tools.start()
        stack.push_async_callback(tools.close)
        pool = KernelPool(cfg.sandbox, cfg.kernel, tools)
        await pool.start()
        stack.push_async_callback(pool.close)
        yield Services(cfg, client, pool, tools, tokenizer, envs, urls=[s.url for s in client.servers])
