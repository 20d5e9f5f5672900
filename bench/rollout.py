"""Rollout throughput: whole episodes through the collector vs. the same cells on the same kind of kernels.

    python bench/rollout.py            # full: concurrency 1, 16, 64, 256 (~12 min here, ~9 GB PSS at 256)
    python bench/rollout.py --quick    # the same measurement at 1, 4, 16 (within a minute)

Episodes: collect_batch (one training batch of n_samples=1 groups, no dynamic sampling) runs the
NB-Agent on sandboxed kernels with the real tool server (BM25 over a small corpus) and a zero-latency
scripted policy server (bench/scripted_policy.py) in a subprocess on 127.0.0.1, reached by the
InferenceClient over HTTP. Each episode is STEPS agent steps: STEPS - 1 times
`r = web_search("x"); print(len(r))`, then `submit_final_answer("42")`.

Baseline: the same number of kernels, each executing exactly those cells directly with
Kernel.execute, at the same concurrency (no collector, agent, context, policy or HTTP; the cells'
own tool calls reach the same tool server, since they are part of what the cells do).

Both sides get fresh kernels started before the clock starts and shut down after it stops, so
kernel start and shutdown are excluded from both (the pool prewarms them in training). Each level
runs a few rounds (3 at 64, 2 below, 1 at 256 and in --quick), raw and episodes alternating in
order, so background load hits both alike; the table sums the rounds (`episodes` counts them all).

overhead = episode time / raw time - 1 (throughput, the headline). On a shared machine it also
moves with how much CPU other users leave, so the table shows the CPU cost too: CPU seconds of this
process and every kernel process per raw cell and per agent step, and separately the policy
server's (a stand-in for SGLang, which runs on other machines). At 256 (full
run) the peak RSS of this process and the RSS and PSS summed over every kernel process (bwrap,
sandbox init, ipykernel) are measured after the episodes, with all 256 kernels still alive.

Last lines:
    RESULT orchestration_overhead_at_<C>=<ratio-1> target <= 0.20   (C = 64 full, 16 quick)
    RESULT failures_at_<C>=<n> target == 0                           (C = 256 full, 16 quick)
(--levels 8,64 measures other levels; the overhead headline is at 64 if measured, else the largest.)
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common import tree_memory_mb  # noqa: E402  (bench/common.py)
from l0_min.collect import Services, collect_batch  # noqa: E402
from l0_min.config import Config  # noqa: E402
from l0_min.envs.qa import QA  # noqa: E402
from l0_min.episode import ANSWERED, Task  # noqa: E402
from l0_min.inference import InferenceClient  # noqa: E402
from l0_min.models import tiny_tokenizer  # noqa: E402
from l0_min.sandbox.pool import KernelPool  # noqa: E402
from l0_min.runtime import settle_gc  # noqa: E402
from l0_min.search import BM25Backend  # noqa: E402
from l0_min.sandbox.tools import ToolServer  # noqa: E402
from bench.scripted_policy import ANSWER, SEARCH  # noqa: E402

STEPS = 6
CELLS = [re.search(r"<code>(.*)</code>", a, re.S).group(1) for a in [SEARCH] * (STEPS - 1) + [ANSWER]]
CORPUS = [{"id": f"d{i}", "title": f"Doc {i}", "text": f"x marks spot {i}"} for i in range(20)]


def fast_byte_tokenizer():
    """tiny-random's byte tokenizer (id = byte + 3; 0 <pad>, 1 </s>, 2 <unk>; ChatML) as a fast (Rust)
    tokenizer, as real models have: the same ids, without the Python ByT5Tokenizer's cost per call."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode  # (4.x and 5.x; gpt2 moved it in 5)

    chars = bytes_to_unicode()
    t = Tokenizer(models.BPE(vocab={"<pad>": 0, "</s>": 1, "<unk>": 2} | {chars[b]: b + 3 for b in range(256)},
                             merges=[], unk_token="<unk>"))  # fmt: skip
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    t.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=t, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")
    tok.chat_template = tiny_tokenizer().chat_template
    sample = "<think>café</think><code>print('ü')</code><|im_start|>user\n"
    assert tok.encode(sample, add_special_tokens=False) == tiny_tokenizer().encode(sample, add_special_tokens=False)
    return tok




def tree_cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of these processes and their descendants (as far as they live)."""
    total, stack, tick = 0, list(pids), os.sysconf("SC_CLK_TCK")
    while stack:
        p = stack.pop()
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime
            with open(f"/proc/{p}/task/{p}/children") as f:
                stack += [int(c) for c in f.read().split()]
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            pass
    return total / tick


class Prestarted:
    """Hands out kernels started beforehand; shuts them down only when asked (after the clock stops)."""

    def __init__(self, pool: KernelPool):
        self.pool, self.ready, self.used = pool, [], []

    async def start(self, n: int) -> int:
        """Start n kernels; returns how many failed to start (those are started on demand later)."""
        started = await asyncio.gather(*(self.pool.acquire() for _ in range(n)), return_exceptions=True)
        for e in started:
            if isinstance(e, BaseException):
                print(f"  kernel start failed: {e}", flush=True)
        self.ready = [k for k in started if not isinstance(k, BaseException)]
        for k in self.ready:  # warm, as a pool kernel is: the first cell does not pay for imports
            await k.execute("pass")
        return n - len(self.ready)

    async def acquire(self):
        return self.ready.pop() if self.ready else await self.pool.acquire()

    async def release(self, kernel) -> None:
        self.used.append(kernel)

    async def shutdown_all(self) -> None:
        await asyncio.gather(*(self.pool.release(k) for k in self.used + self.ready))
        self.used, self.ready = [], []


def start_policy_server() -> tuple[subprocess.Popen, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, str(ROOT / "bench" / "scripted_policy.py"), "--steps", str(STEPS)],
                            stdout=subprocess.PIPE, text=True, env=env)  # fmt: skip
    line = proc.stdout.readline()
    m = re.search(r"ready at (http://\S+)", line)
    if not m:
        proc.kill()
        raise RuntimeError(f"the scripted policy server did not start: {line!r}")
    return proc, m.group(1)


async def raw_run(kernels: Prestarted, n: int, concurrency: int) -> tuple[int, int]:
    """n kernels each execute CELLS, `concurrency` kernels at a time. Returns (cells run, failed cells)."""
    sem = asyncio.Semaphore(concurrency)
    failures = 0

    async def one() -> None:
        nonlocal failures
        async with sem:
            k = await kernels.acquire()
            for code in CELLS:
                r = await k.execute(code)
                failures += not r.ok
            await kernels.release(k)

    await asyncio.gather(*(one() for _ in range(n)))
    return n * len(CELLS), failures


async def episode_run(cfg: Config, client, kernels: Prestarted, tools, tok, n: int, concurrency: int, tag: str):
    """n episodes through collect_batch at `concurrency`. Returns (agent steps, failed episodes)."""
    cfg.rollout.max_concurrency = concurrency
    cfg.rollout.batch_size, cfg.rollout.n_samples = n, 1
    env = Services(cfg, client, kernels, tools, tok, {"qa": QA(cfg)})

    class Stream:
        position = 0

        def next(self) -> Task:
            self.position += 1
            return Task(f"{tag}-{self.position}", f"What is item {self.position} of run {tag}?", ["42"])

    batch = await collect_batch(env, Stream(), cfg.rollout, dynamic_sampling=False)
    failed = [e for e in batch.episodes if e.status != ANSWERED or len(e.steps) != STEPS or e.masked]
    for e in failed[:5]:
        print(f"  failed episode {e.task.id}: {e.status}: {e.error[:300]}", flush=True)
    return sum(len(e.steps) for e in batch.episodes), len(failed) + n - len(batch.episodes)


async def measure(side: str, n: int, c: int, pool, server_pid: int, run) -> dict:
    """Start n kernels, run one side on them with the clock and CPU counters running, shut them down."""
    kernels = Prestarted(pool)
    start_failures = await kernels.start(n)
    pids = [k.pid for k in kernels.ready]
    cpu0 = (time.process_time(), tree_cpu_seconds([server_pid]), tree_cpu_seconds(pids))
    t = time.perf_counter()
    steps, failures = await run(kernels)
    seconds = time.perf_counter() - t
    cpu1 = (time.process_time(), tree_cpu_seconds([server_pid]), tree_cpu_seconds(pids))
    memory = None
    if side == "episodes" and c == 256:
        per_kernel = [tree_memory_mb(pid) for pid in pids]
        memory = (sum(m for m, _ in per_kernel), sum(p for _, p in per_kernel), len(per_kernel))
    await kernels.shutdown_all()
    cpu = [b - a for a, b in zip(cpu0, cpu1)]  # host process, policy server, kernels
    print(f"  concurrency {c}: {side} {seconds:.2f} s, CPU host {cpu[0]:.2f} s, policy server {cpu[1]:.2f} s, "
          f"kernels {cpu[2]:.2f} s", flush=True)  # fmt: skip
    return {"seconds": seconds, "cpu": cpu[0] + cpu[2], "policy_cpu": cpu[1], "steps": steps,
            "failures": failures + start_failures, "memory": memory}  # fmt: skip


async def main(quick: bool, tokenizer: str, levels: list[int] | None) -> None:
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("bm25s").setLevel(logging.WARNING)
    levels = levels or ([1, 4, 16] if quick else [1, 16, 64, 256])
    target_level = 64 if 64 in levels else levels[-1]
    fail_level = levels[-1]
    t_all = time.perf_counter()
    cfg = Config()
    cfg.agent.max_steps = STEPS + 2
    cfg.kernel.pool_size, cfg.kernel.start_timeout = 0, 300
    tok = fast_byte_tokenizer() if tokenizer == "fast" else tiny_tokenizer()
    server, url = start_policy_server()
    tools = ToolServer(BM25Backend(CORPUS))
    await tools.start()
    pool = KernelPool(cfg.sandbox, cfg.kernel, tools)
    await pool.start()
    client = InferenceClient([url], cfg.inference, max_connections=max(levels))
    settle_gc()  # as train.py and rollout.py do once set up (both sides run in this process alike)
    rows, memory = [], None
    try:
        for c in levels:
            n = max(c, 4)  # episodes (and raw kernels) per measurement
            rounds = 1 if quick or c >= 256 else 3 if c == 64 else 2
            total = {side: {"seconds": 0.0, "cpu": 0.0, "policy_cpu": 0.0, "steps": 0, "failures": 0}
                     for side in ("raw", "episodes")}  # fmt: skip
            for r in range(rounds):
                for side in (("raw", "episodes") if (r + len(rows)) % 2 == 0 else ("episodes", "raw")):
                    if side == "raw":
                        m = await measure(side, n, c, pool, server.pid, lambda k: raw_run(k, n, c))
                    else:
                        tag = f"c{c}r{r}"
                        m = await measure(side, n, c, pool, server.pid,
                                          lambda k: episode_run(cfg, client, k, tools, tok, n, c, tag))  # fmt: skip
                    memory = m.pop("memory") or memory
                    for key, v in m.items():
                        total[side][key] += v
            rows.append((c, n * rounds, total))
    finally:
        await client.close()
        await pool.close()
        await tools.close()
        server.kill()
        server.wait()

    host_peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"\nrollout: episodes through the collector vs. the same cells on raw kernels "
          f"({'quick' if quick else 'full'} run, {os.cpu_count()} CPUs, {STEPS} steps/episode, "
          f"host tokenizer {tokenizer}, {time.perf_counter() - t_all:.0f} s)\n")  # fmt: skip
    print(f"{'':>31}{'throughput':^33}{'CPU ms per cell / step':^40}")
    print(f"{'concurrency':>11}{'episodes':>10}{'raw cells/s':>12}{'episodes/s':>11}{'steps/s':>9}"
          f"{'overhead':>10}{'raw':>8}{'episodes':>10}{'overhead':>10}{'policy':>9}{'failures':>10}")  # fmt: skip
    overhead, failures = {}, {}
    for c, n, t in rows:
        raw, ep = t["raw"], t["episodes"]
        steps = max(1, ep["steps"])
        overhead[c], failures[c] = ep["seconds"] / raw["seconds"] - 1, raw["failures"] + ep["failures"]
        cpu_raw, cpu_ep = 1000 * raw["cpu"] / raw["steps"], 1000 * ep["cpu"] / steps
        print(f"{c:>11}{n:>10}{raw['steps'] / raw['seconds']:>12.1f}{n / ep['seconds']:>11.2f}"
              f"{ep['steps'] / ep['seconds']:>9.1f}{overhead[c]:>+10.1%}{cpu_raw:>8.2f}{cpu_ep:>10.2f}"
              f"{cpu_ep / cpu_raw - 1:>+10.1%}{1000 * ep['policy_cpu'] / steps:>9.2f}{failures[c]:>10}")  # fmt: skip
    print("\nthroughput overhead = episode time / raw time - 1. CPU: this process (collector, agent, client, tool "
          "server,\nkernel clients) + the kernel processes, per raw cell / agent step; `policy` is the scripted "
          "policy\nserver's own CPU per step (it stands in for SGLang on other machines, so it is not in the ratio).")
    print(f"\npeak RSS of this process (collector, tool server, client): {host_peak_mb:.0f} MB")
    if memory:
        rss, pss, k = memory
        print(f"kernel processes at 256 ({k} kernels, after their episodes): RSS sum {rss:.0f} MB, "
              f"PSS sum {pss:.0f} MB ({pss / k:.1f} MB per kernel)")  # fmt: skip
    print()
    o = overhead[target_level]
    print(f"RESULT orchestration_overhead_at_{target_level}={o:.3f} target <= 0.20 {'MET' if o <= 0.20 else 'SHORT'}")
    f = failures[fail_level]
    print(f"RESULT failures_at_{fail_level}={f} target == 0 {'MET' if f == 0 else 'SHORT'}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller, within about a minute")
    ap.add_argument("--tokenizer", choices=["fast", "byt5"], default="fast",
                    help="the agent's tokenizer: fast (default; the byte ids in Rust, as real models' tokenizers are) "
                         "or byt5 (tiny-random's Python ByT5Tokenizer; same ids, about 1 ms more per step)")  # fmt: skip
    ap.add_argument("--levels", help="comma-separated concurrency levels instead of the default ones")
    args = ap.parse_args()
    asyncio.run(main(args.quick, args.tokenizer, [int(x) for x in args.levels.split(",")] if args.levels else None))
