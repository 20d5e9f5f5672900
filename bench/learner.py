"""Learner throughput against plain PyTorch, and packing efficiency, measured in one run.

    python bench/learner.py                  # full: a larger random Llama, more rows, more repetitions
    python bench/learner.py --quick          # the same measurement, smaller (within 60 s on 2 CPU cores)
    torchrun --nproc_per_node=2 bench/learner.py --quick   # per-rank numbers (the targets are on one rank)
    python bench/learner.py --mfu            # one GPU: MFU before/after issue 27 (bench/gpu_learner.sh; CPU: tiny)

--mfu (issue 27): `Learner.train_step` on one agent-shaped global batch (37 rows, 65,536 tokens, log-normal
lengths median ~1,500 in 256..4,096, 48.6% action tokens in spans of 64-512) on random weights of Qwen2.5-3B,
1.5B and 0.5B shapes (vocabulary 151,936, tied embeddings; built on the GPU), micro-batches of 32,768, bf16
mixed precision, activation checkpointing. Per shape two rows in one process: "before" (main at e64b70d: one
SDPA per row, full checkpointing, autograd LM head, foreach AdamW; its checkpoint now sits inside FSDP's hooks)
and "after" (configs/gpu_example.yaml's learner section, plus --after overrides). Each: build, the log-probs of micro-batch 0 (forward + backward: compile warm-up), one
warm-up step, two timed steps. MFU = useful FLOPs (`step_flops`) / step time / 989 TFLOP/s (H100 SXM bf16),
also against a bf16 8192^3 matmul timed in the same run; peak = torch.cuda.max_memory_allocated from the
build on. The before and after log-probs of micro-batch 0 (same weights) must agree to bf16 noise.
--variant NAME[@SHAPES] OVERRIDE... adds a row (the after row's settings plus overrides; kernel=LABEL: that
varlen kernel of learner.VARLEN_KERNELS alone), --no-before drops the before rows, --profile profiles one more
step of each row but before: the device's time by kind of kernel, its idle share within the step, the longest
kernels, torch.compile's graph breaks (on CPU: the ops' self time). Rows run each shape's before and after first,
then the variants, and each prints its line (the after row its RESULT) as it ends: a time limit loses only the
rows it cut. On CPU the after row runs gpu_example.yaml's learner with device cpu and compile aot_eager
(inductor's C++ build takes minutes), and every variant runs at the tiny shape.

Workload: a realistic agent batch. Row lengths are log-normal (median ~500, clipped to 100..1500
tokens); each row is a prompt followed by alternating action spans (masked in, ~30% of the tokens,
one random advantage per span, sampler log-probs) and observation spans, as `segment_rows` makes them.
The model is a random Llama saved to a temporary HF folder (toy tokenizer).

  A  learner   `Learner.train_step(rows)`: FSDP2-wrapped model, first-fit-decreasing packing into
               `micro_batch_tokens`, list->tensor conversion, DAPO loss bookkeeping, clip_grad_norm_,
               AdamW step. Timed from the call to its return, everything included.
  B  plain     the same weights loaded plainly (no FSDP, transformers' default attention), the same
               rows, one unpadded row per forward (no packing, no padding: attention costs sum(len^2)),
               `F.cross_entropy` summed over the row / total tokens, backward, AdamW step. Rows are
               tensors before the clock starts. This is "a plain single-process PyTorch forward+backward
               of the same model and tokens"; the headline ratio is tokens/s of A over B.
  C  plain packed (full run; context) the learner's own packed forward (`token_logprobs`, same
               attention implementation) on its micro-batches, -sum(logp) / n, backward, AdamW, with no
               FSDP and no bookkeeping: A / C is the cost of FSDP + bookkeeping, C / B that of packing.

Both A and B (and C) take an AdamW step with the same hyper-parameters; only the learner clips
gradients. One warm-up of each, then the repetitions are interleaved (A B [C] A B [C] ...) and medians
reported, of wall time and of process CPU time. On CPU each rank runs one thread (--threads) and the
headline ratio uses CPU time: on a shared 2-core machine a step's wall time swings 2-3x with the other
tenants' load while its CPU time (the work done; both sides in the same process, the same one thread)
stays within a few percent. On GPU, with several ranks (where waiting on the others is part of the
cost), or with --clock wall, the ratio uses wall time (CUDA-synchronised).

Packing efficiency = real tokens / tokens fed to the model by the learner (its micro-batches,
including the zero-weight filler rows that keep ranks in step). Naive padded batching (k rows per
micro-batch padded to the longest, k chosen to fill the same budget on average) is shown for context,
as is the attention work of packing: sum(len^2) / sum(micro-batch len^2) (what a dense block-diagonal
mask computes).
"""

# ruff: noqa: E402
import time

T_START = time.perf_counter()  # the quick run's 60 s include the imports

import argparse
import dataclasses
import gc
import math
import random
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from l0_min.config import Config, resolve
from l0_min.episode import Row
import l0_min.learner as learner_module
from l0_min.distributed import close_distributed, init_distributed
from l0_min.learner import (VARLEN_KERNELS, Learner, LogProbHead, _concat, memory_estimate, pack_rows, shard_rows,
                            token_logprobs)

ap = argparse.ArgumentParser()
ap.add_argument("--quick", action="store_true")
ap.add_argument("--seed", type=int, default=0)
ap.add_argument("--reps", type=int, default=None, help="timed repetitions of each side")
ap.add_argument("--rows", type=int, default=None, help="rows in the global batch")
ap.add_argument("--threads", type=int, default=None, help="CPU threads per rank (default 1)")
ap.add_argument("--hidden", type=int, default=None)
ap.add_argument("--layers", type=int, default=None)
ap.add_argument("--micro-batch-tokens", type=int, default=None, help="packing budget (quick 2048, full 4096)")
ap.add_argument("--clock", choices=["auto", "wall", "cpu"], default="auto", help="auto: process CPU time on a 1-rank, 1-thread CPU run, else wall")
ap.add_argument("--packed-baseline", action=argparse.BooleanOptionalAction, default=None, help="also time C")
ap.add_argument("--mfu", action="store_true", help="the learner against the GPU's peak, before/after issue 27 (below)")
ap.add_argument("--shapes", default="3b,1.5b,0.5b", help="--mfu on CUDA: Qwen2.5 shapes, in this order")
ap.add_argument("--after", nargs="*", default=[], help="--mfu: overrides of the after row, e.g. learner.compile=aot_eager")
ap.add_argument("--budget-s", type=float, default=270.0, help="--mfu: start no new row after this many seconds")
ap.add_argument("--variant", nargs="+", action="append", default=[], metavar=("NAME", "OVERRIDE"),
                help="--mfu: one more row, the after row's settings plus overrides (repeatable), e.g. --variant "
                     "gathered learner.reshard=false; NAME@3b,0.5b: at those shapes only")  # fmt: skip
ap.add_argument("--no-before", action="store_true", help="--mfu: skip the before rows (docs/results.md has them)")
ap.add_argument("--profile", action="store_true", help="--mfu: one more step of each row but before, profiled: "
                "where the device's time goes, by kind of kernel, and how much of the step it is idle")
args = ap.parse_args()

RATIO_TARGET, PACK_TARGET = 0.9, 0.95
if args.quick:
    shape = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, vocab_size=2048)
    n_rows, reps, packed_baseline, budget = 5, 3, False, 2048
else:
    shape = dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=6, num_key_value_heads=2, vocab_size=8192)
    n_rows, reps, packed_baseline, budget = 24, 5, True, 4096
n_rows = args.rows or n_rows
if args.hidden:
    shape.update(hidden_size=args.hidden, intermediate_size=3 * args.hidden, num_attention_heads=max(1, args.hidden // 64), num_key_value_heads=max(1, args.hidden // 64))
if args.layers:
    shape.update(num_hidden_layers=args.layers)
reps = args.reps or reps
budget = args.micro_batch_tokens or budget
packed_baseline = packed_baseline if args.packed_baseline is None else args.packed_baseline

rank, world, device = init_distributed()
if device.type == "cpu":
    torch.set_num_threads(args.threads or 1)


def log(*a):
    if rank == 0:
        print(*a, flush=True)


def sync():
    if device.type == "cuda":
        torch.cuda.synchronize()


# -- the model: a random Llama in a temporary HF folder ------------------------------------------


def make_model(folder: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from bench.toy import make_toy_tokenizer

    torch.manual_seed(args.seed)
    config = LlamaConfig(**shape, max_position_embeddings=2048, tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, bos_token_id=3)
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    make_toy_tokenizer().save_pretrained(folder)


# -- the workload: rows shaped like agent trajectories --------------------------------------------


def make_rows(n: int, vocab: int, rng: random.Random) -> list[Row]:
    rows = []
    for _ in range(n):
        length = int(min(1500, max(100, rng.lognormvariate(math.log(500), 0.6))))
        ids = [rng.randrange(4, vocab) for _ in range(length)]
        mask, adv, old = [0.0] * length, [0.0] * length, [0.0] * length
        t = max(20, int(0.15 * length))  # the prompt
        while t < length:
            a = rng.randint(16, 128)  # an action span ...
            span_adv = rng.gauss(0.0, 1.0)
            for j in range(t, min(t + a, length)):
                mask[j], adv[j], old[j] = 1.0, span_adv, -rng.uniform(0.0, 3.0)
            t += a + rng.randint(32, 256)  # ... then its observation
        rows.append(Row(ids, mask, adv, old))
    return rows


# -- the plain baseline ---------------------------------------------------------------------------


def plain_step(model, opt, rows: list[torch.Tensor], n_tokens: int) -> float:
    """B: per row, forward + summed cross-entropy + backward; then AdamW. Returns the loss."""
    opt.zero_grad(set_to_none=True)
    total = 0.0
    for ids in rows:
        logits = model(input_ids=ids[None], use_cache=False).logits[0]
        loss = F.cross_entropy(logits[:-1].float(), ids[1:], reduction="sum") / n_tokens
        loss.backward()
        total += loss.detach()
    opt.step()
    return float(total)


def plain_packed_step(model, opt, batches: list[tuple[torch.Tensor, torch.Tensor]], n_tokens: int) -> float:
    """C: per packed micro-batch, the learner's own forward (`token_logprobs`), -sum(logp) / n, backward; AdamW."""
    opt.zero_grad(set_to_none=True)
    total = 0.0
    for ids, pos in batches:
        loss = -token_logprobs(model, ids, pos).sum() / n_tokens
        loss.backward()
        total += loss.detach()
    opt.step()
    return float(total)


def main() -> None:
    # one folder for all ranks: rank 0 makes it, the others learn its name
    tmp = [tempfile.mkdtemp(prefix="l0min-bench-learner-") if rank == 0 else None]
    dist.broadcast_object_list(tmp, src=0)
    folder = Path(tmp[0])
    if rank == 0:
        make_model(folder)
    dist.barrier()

    rows = make_rows(n_rows, shape["vocab_size"], random.Random(args.seed))  # the same global batch on every rank
    mine = shard_rows(rows, rank, world)

    cfg = Config()
    cfg.learner.lr, cfg.learner.micro_batch_tokens, cfg.learner.grad_clip = 1e-5, budget, 1.0
    learner = Learner(folder, cfg.learner, cfg.algo, total_steps=1000)

    from transformers import AutoModelForCausalLM

    def plain_model(**kw):
        m = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kw).to(device)  # eval mode, as the learner's
        m.config.use_cache = False
        opt = torch.optim.AdamW(m.parameters(), lr=cfg.learner.lr, betas=tuple(cfg.learner.betas), weight_decay=cfg.learner.weight_decay)
        return m, opt

    plain, plain_opt = plain_model()  # transformers' default attention (sdpa)

    # -- packing accounting (what the learner does inside train_step, recomputed here) --
    per_rank_mb = [pack_rows(shard_rows(rows, r, world), budget) for r in range(world)]
    n_mb = max(len(m) for m in per_rank_mb)
    real = sum(len(r) for r in rows)
    processed = sum(sum(len(x) for mb in m for x in mb) + 2 * (n_mb - len(m)) for m in per_rank_mb)
    packing_eff = real / processed
    mean_len = real / len(rows)
    k = max(1, round(budget / mean_len))  # rows per naive micro-batch: the same budget on average
    padded_tokens = lambda seq: sum(len(b) * max(map(len, b)) for b in (seq[i : i + k] for i in range(0, len(seq), k)))
    padded, padded_sorted = padded_tokens(rows), padded_tokens(sorted(rows, key=len))
    attn_useful = sum(len(r) ** 2 for r in rows)
    attn_packed = sum(sum(len(x) for x in mb) ** 2 for m in per_rank_mb for mb in m)
    action_frac = sum(sum(1 for v in r.mask if v > 0) for r in rows) / real

    # -- tensors for the plain sides (built before the clock, on purpose: B is pure fwd+bwd+opt) --
    my_tokens = sum(len(r) for r in mine)
    per_row = [torch.tensor(r.ids, device=device) for r in mine]
    packed = [
        (
            torch.tensor([t for r in mb for t in r.ids], device=device),
            torch.tensor([p for r in mb for p in range(len(r))], device=device),
        )
        for mb in per_rank_mb[rank]
    ]

    sides = {"A": lambda: learner.train_step(mine), "B": lambda: plain_step(plain, plain_opt, per_row, my_tokens)}
    if packed_baseline:  # the learner's attention implementation, whatever it is
        plain_c, plain_c_opt = plain_model(attn_implementation=learner.model.config._attn_implementation)
        plain_c.lm_head.__class__ = LogProbHead  # token_logprobs' chunked head, as in the learner
        sides["C"] = lambda: plain_packed_step(plain_c, plain_c_opt, packed, my_tokens)
    times: dict[str, list[float]] = {s: [] for s in sides}
    cpu: dict[str, list[float]] = {s: [] for s in sides}
    log(f"model: {shape} ({sum(p.numel() for p in plain.parameters()) / 1e6:.1f}M params), device={device}, ranks={world}, threads={torch.get_num_threads()}")
    log(f"batch: {len(rows)} rows, {real} tokens (this rank {len(mine)} rows, {my_tokens} tokens), action tokens {action_frac:.1%}, micro_batch_tokens={budget}")
    log(f"setup {time.perf_counter() - T_START:.1f} s; warm-up, then {reps} interleaved repetitions of {' '.join(sides)}")
    for rep in range(reps + 1):  # rep 0 is the warm-up
        for name, fn in sides.items():
            dist.barrier()
            sync()
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            sync()
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
            if rep:
                times[name].append(dt)
                cpu[name].append(dc)
        if rep:
            log(f"  rep {rep}: " + "  ".join(f"{n}={times[n][-1]:.3f}s (cpu {cpu[n][-1]:.3f}s)" for n in sides))

    # -- per-rank medians, gathered to rank 0 --
    clock = args.clock if args.clock != "auto" else ("cpu" if device.type == "cpu" and torch.get_num_threads() == 1 and world == 1 else "wall")
    med = {n: statistics.median(v) for n, v in times.items()}
    med_cpu = {n: statistics.median(v) for n, v in cpu.items()}
    mine_stats = [med, med_cpu, my_tokens]
    gathered = [None] * world
    dist.all_gather_object(gathered, mine_stats)
    if rank == 0:
        labels = {"A": "learner (FSDP2, packed, DAPO loss)", "B": "plain fwd+bwd, one row per forward", "C": "plain fwd+bwd, learner's packed forward"}
        print(f"\n{'rank':>4} {'side':<42} {'tokens':>7} {'median s':>9} {'tokens/s':>9} {'vs B':>6} {'cpu s':>7} {'vs B':>6}")
        for r, (m, mc, tok) in enumerate(gathered):
            for n in m:
                print(f"{r:>4} {n + ' ' + labels[n]:<42} {tok:>7} {m[n]:9.3f} {tok / m[n]:9.0f} {m['B'] / m[n]:6.3f} {mc[n]:7.3f} {mc['B'] / mc[n]:6.3f}")
        print(f"\n{'packing':<48} {'processed':>9} {'efficiency':>10}")
        print(f"{'learner: first-fit-decreasing, no padding':<48} {processed:>9} {packing_eff:10.3f}   ({sum(len(m) for m in per_rank_mb)} micro-batches + {sum(n_mb - len(m) for m in per_rank_mb)} filler)")
        print(f"{f'naive: {k} rows per batch in order, padded':<48} {padded:>9} {real / padded:10.3f}")
        print(f"{f'naive: {k} rows per batch sorted by length, padded':<48} {padded_sorted:>9} {real / padded_sorted:10.3f}")
        print(f"attention pairs: one row per forward {attn_useful:.3g}, packed (block-diagonal mask, dense) {attn_packed:.3g} -> {attn_useful / attn_packed:.3f}")
        m, mc, _ = gathered[0]
        ratio = (mc if clock == "cpu" else m)["B"] / (mc if clock == "cpu" else m)["A"]
        print(f"ratio = tokens/s of A over B on rank 0, by {'process CPU time' if clock == 'cpu' else 'wall time'} (--clock {args.clock})")
        print(f"\ntotal {time.perf_counter() - T_START:.1f} s")
        print(f"RESULT learner_vs_plain_ratio={ratio:.3f} target >= {RATIO_TARGET} {'MET' if ratio >= RATIO_TARGET else 'SHORT'}")
        print(f"RESULT packing_efficiency={packing_eff:.3f} target >= {PACK_TARGET} {'MET' if packing_eff >= PACK_TARGET else 'SHORT'}")
    dist.barrier()
    if rank == 0:
        shutil.rmtree(folder, ignore_errors=True)
    close_distributed()


# -- --mfu: the learner against the GPU's peak, before and after issue 27 -------------------------------------

QWEN = {  # Qwen2.5 shapes: hidden, intermediate, layers, heads, K/V heads, MFU target (issue 27)
    "3b": (2048, 11008, 36, 16, 2, 0.45), "1.5b": (1536, 8960, 28, 12, 2, 0.35), "0.5b": (896, 4864, 24, 14, 2, 0.25),
}
PEAK = 989e12  # H100 SXM, dense bf16


def agent_batch(n_rows: int, total: int, vocab: int, rng: random.Random, median: int, lo: int, hi: int) -> list[Row]:
    """`n_rows` agent-shaped rows of `total` tokens in all: log-normal lengths (median `median`, within lo..hi),
    a prompt, then action spans of 64-512 tokens (one advantage each, sampler log-probs) between observation
    spans of 64-512: 42-49% action tokens (seeds 0-3; 48.6% at seed 0)."""
    lens = [rng.lognormvariate(math.log(median), 0.6) for _ in range(n_rows)]
    for _ in range(50):  # scale to `total`, keeping the bounds
        lens = [min(hi, max(lo, x * total / sum(lens))) for x in lens]
    lens = [int(x) for x in lens]
    lens[lens.index(min(lens))] += total - sum(lens)
    rows = []
    for n in lens:
        mask, adv = [0.0] * n, [0.0] * n
        t = rng.randint(lo // 2, 3 * lo // 2)
        while t < n:
            a, g = rng.randint(64, 512), rng.gauss(0.0, 1.0)
            mask[t : t + a], adv[t : t + a] = [1.0] * len(mask[t : t + a]), [g] * len(mask[t : t + a])
            t += a + rng.randint(64, 512)
        rows.append(Row([rng.randrange(vocab) for _ in range(n)], mask, adv, [-math.log(vocab)] * n))
    return rows


def step_flops(config, n_params: int, rows: list[Row]) -> float:
    """Useful FLOPs of one step (issue 27): 6 x non-embedding parameters x tokens + causal attention
    (6 x layers x hidden x sum of squared row lengths) + the LM head on the action positions (6 x hidden x
    vocab x action tokens). Recomputation (activation checkpointing) is not useful work."""
    h, v = config.hidden_size, config.vocab_size
    tokens, actions = sum(len(r) for r in rows), sum(1 for r in rows for m in r.mask if m > 0)
    return (6 * (n_params - v * h) * tokens + 6 * config.num_hidden_layers * h * sum(len(r) ** 2 for r in rows)
            + 6 * h * v * actions)  # fmt: skip


def matmul_flops_per_s(n: int = 8192) -> float:
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    sync()
    t0 = time.perf_counter()
    for _ in range(10):
        a @ b
    sync()
    return 10 * 2 * n**3 / (time.perf_counter() - t0)


def todays_head(head, h: torch.Tensor) -> torch.Tensor:
    """The LM head before issue 27 (the before row): autograd through fp32 logits, chunk by chunk, each chunk
    recomputed in backward (torch.utils.checkpoint)."""
    from torch.utils.checkpoint import checkpoint

    def chunk(h, w, t, inv_t):
        z = F.linear(h, w).float() * inv_t
        return z.gather(-1, t[:, None]).squeeze(-1) - z.logsumexp(-1)

    h = h.reshape(-1, h.shape[-1])
    return torch.cat([checkpoint(chunk, h[a : a + 2048], head.weight, head.targets[a : a + 2048], head.inv_t,
                                 use_reentrant=False)[None, :, None] for a in range(0, len(h), 2048)], dim=1)  # fmt: skip


def random_model(config):
    """Random weights (transformers' init), built on the device (seconds at 3B); seeded: the same for every row."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(args.seed)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


KINDS = (  # (kind, words in a kernel's or CPU op's lower-cased name), the first match wins
    ("collectives (FSDP)", ("nccl", "c10d::", "all_gather", "reduce_scatter")),
    ("attention", ("flash", "fmha", "attention", "attn", "sdpa")),
    ("matmul", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "aten::mm", "aten::addmm", "aten::bmm", "aten::linear")),
    ("multi-tensor (AdamW, grad norm)", ("multi_tensor", "adam", "foreach")),
    ("compiled (triton)", ("triton",)),
    ("copies, casts, cat", ("memcpy", "memset", "copy", "cat", "aten::to", "index")),
    ("elementwise, reductions (aten)", ("elementwise", "reduce", "aten::")),
)  # fmt: skip


def kind_of(name: str) -> str:
    name = name.lower()
    return next((k for k, words in KINDS if any(w in name for w in words)), "other")


def profile_step(tag: str, learner, rows: list[Row]) -> dict:
    """One more step under torch.profiler: the device's busy time by kind of kernel, its idle time within the step
    (the host not keeping up: launches, Python, syncs) and the longest kernels; on CPU, the ops' self time.
    Where the time goes, to show what to change next (issue 27's profile)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        t0 = time.perf_counter()
        learner.train_step(rows)
        sync()
        wall = (time.perf_counter() - t0) * 1e6  # us, as the profiler's times
    if cuda:  # the kernels (and memcpys/memsets) themselves: [start, end) on the device's clock
        spans = [(e.time_range.start, e.time_range.end, e.name) for e in prof.events() if e.device_type == DeviceType.CUDA]
    else:  # CPU: each op's self time (its children's excluded), in one line of time
        spans = [(0.0, e.self_cpu_time_total, e.name) for e in prof.events() if e.device_type == DeviceType.CPU
                 and e.name.startswith(("aten::", "c10d::")) and e.self_cpu_time_total > 0]  # fmt: skip
    by_kind, by_name = {}, {}
    for a, b, name in spans:
        k = kind_of(name)
        by_kind[k] = by_kind.get(k, 0.0) + (b - a)
        n, t = by_name.get(name, (0, 0.0))
        by_name[name] = (n + 1, t + b - a)
    total, busy, end = sum(by_kind.values()) or 1.0, 0.0, -math.inf
    for a, b, _ in sorted(spans) if cuda else ():  # the union of the device's intervals (its streams overlap)
        busy, end = busy + max(0.0, b - max(a, end)), max(end, b)
    busy = busy if cuda else total
    if not spans:
        log(f"{tag} profile: no {'kernel' if cuda else 'op'} events recorded")
        return None
    what = "device busy" if cuda else "ops' self CPU time"
    waits = [e.time_range.end - e.time_range.start for e in prof.events() if e.name.endswith("Synchronize")]
    log(f"{tag} profile: step {wall / 1e6:.2f} s under the profiler; {what} {busy / 1e6:.2f} s"
        + (f" = {busy / wall:.0%} of the step (idle {1 - busy / wall:.0%}: the host not keeping up); the host waited "
           f"for the device {len(waits)} times, {sum(waits) / 1e6:.2f} s (cuda*Synchronize)" if cuda else ""))
    for k, t in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        log(f"    {k:<32} {t / 1e6:8.3f} s {t / total:6.1%}")
    log("    longest kernels (count, s):" if cuda else "    longest ops (count, s):")
    for name, (n, t) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:10]:
        log(f"      {n:6d} {t / 1e6:8.3f}  {name[:110]}")
    return dict(wall=wall / 1e6, busy=busy / 1e6, kinds={k: t / 1e6 for k, t in by_kind.items()})


def measure(tag, folder, c, config, rows, budget, matmul, todays: bool) -> dict:
    """One row: build the learner, micro-batch 0's log-probs (forward + backward: compile warm-up), one warm-up
    step, two timed steps."""
    from types import MethodType

    cuda, total = device.type == "cuda", sum(len(r) for r in rows)
    t0, left = time.perf_counter(), torch.cuda.memory_allocated() / 2**30 if cuda else 0.0  # the last row's: ~0
    learner = Learner(folder, c, Config().algo, total_steps=10, weights=random_model(config))
    if todays:
        learner.model.lm_head.forward = MethodType(todays_head, learner.model.lm_head)
        learner.opt = torch.optim.AdamW(learner.params, lr=c.lr, betas=tuple(c.betas), foreach=True)
        learner.sched = torch.optim.lr_scheduler.LambdaLR(learner.opt, lambda step: 1.0)
    n_params = sum(p.numel() for p in learner.model.parameters())
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    log(f"[{time.perf_counter() - T_START:6.1f} s] {tag}: built ({n_params / 1e9:.2f} B parameters, "
        f"{time.perf_counter() - t0:.1f} s; {left:.1f} GiB were still allocated before)")  # fmt: skip
    b = _concat(pack_rows(rows, budget)[0], device)
    t0 = time.perf_counter()
    lp = token_logprobs(learner.model, b["ids"], b["pos"], packed=b["packing"])  # the action tokens (_concat's)
    (lp.sum() * 0).backward()
    lp = lp.detach().float().cpu()[b["mask"].cpu() > 0]
    sync()
    t1 = time.perf_counter()
    first = learner.train_step(rows)
    sync()
    t2 = time.perf_counter()
    log(f"[{t2 - T_START:6.1f} s] {tag}: log-probs of micro-batch 0 {t1 - t0:.1f} s, warm-up step {t2 - t1:.1f} s")
    secs = []
    for _ in range(2):
        t0 = time.perf_counter()
        learner.train_step(rows)
        sync()
        secs.append(time.perf_counter() - t0)
    step, flops = statistics.mean(secs), step_flops(config, n_params, rows)
    mem = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
    longest = max(sum(map(len, mb)) for mb in pack_rows(rows, c.micro_batch_tokens))  # the estimate at this micro-batch
    mixed = cuda if c.mixed_precision is None else c.mixed_precision
    est = memory_estimate(config, n_params, n_params, dataclasses.replace(c, micro_batch_tokens=longest), 1, mixed, False)
    log(f"[{time.perf_counter() - T_START:6.1f} s] {tag}: steps {' '.join(f'{x:.2f}' for x in secs)} s, "
        f"{total / step:,.0f} tokens/s, MFU {flops / step / PEAK:.1%}, peak {mem:.1f} GiB (estimated "
        f"{sum(est.values()):.1f} at {longest} tokens: " + ", ".join(f"{k} {x:.2f}" for k, x in est.items() if x) + ")")
    prof = profile_step(tag, learner, rows) if args.profile and not todays else None
    return dict(prof=prof, tok_s=total / step, mfu=flops / step / PEAK, of_matmul=flops / step / matmul, mem=mem, step=step,
                loss=first["loss"], grad_norm=first["grad_norm"], lp=lp)  # fmt: skip


def mfu() -> None:
    from dataclasses import replace

    from transformers import Qwen2Config

    from bench.toy import make_toy_tokenizer

    if world != 1:
        raise SystemExit("--mfu: one rank (python bench/learner.py --mfu); its targets are for one GPU")
    cuda = device.type == "cuda"
    if cuda:  # issue 27's workload
        shapes = {k: QWEN[k] for k in args.shapes.split(",")}
        vocab, total, n_rows, lengths, budget = 151936, 65536, 37, (1500, 256, 4096), 32768
    else:  # CPU: a tiny shape, only to prove the bench runs
        shapes = {"tiny": (64, 128, 2, 4, 2, None)}
        vocab, total, n_rows, lengths, budget = 512, 4096, 12, (300, 64, 1024), 2048
    rows = agent_batch(n_rows, total, vocab, random.Random(args.seed), *lengths)
    gpu = resolve(config_file=Path(__file__).resolve().parents[1] / "configs/gpu_example.yaml").learner
    gpu = replace(gpu, lr=1e-6, grad_clip=1.0, micro_batch_tokens=budget)
    if not cuda:  # the same path on CPU: dynamo + AOTAutograd without inductor's C++ build (minutes here)
        gpu = replace(gpu, device="cpu", compile="aot_eager" if gpu.compile != "none" else "none")
    base = replace(Config().learner, lr=1e-6, grad_clip=1.0, micro_batch_tokens=budget)
    # before: main at e64b70d (one SDPA per row, full checkpointing, autograd LM head, foreach AdamW); after:
    # gpu_example.yaml's learner section (+ --after); each --variant: the after row's settings + its overrides
    variants = {} if args.no_before else {"before": replace(base, attention="rows", activation_checkpointing="full",
                                                            compile="none")}  # fmt: skip
    only, kernel = {}, {}  # a variant NAME@s1,s2 runs at those shapes only; kernel=LABEL: that varlen kernel alone
    for name, overrides in [("after", []), *((v[0], v[1:]) for v in args.variant)]:  # (resolve sets its base's fields)
        name, _, at = name.partition("@")
        kernel[name] = next((o.split("=", 1)[1] for o in overrides if o.startswith("kernel=")), None)
        overrides = [o for o in overrides if not o.startswith("kernel=")]
        if kernel[name] not in (None, *VARLEN_KERNELS):
            raise SystemExit(f"--variant {name}: kernel={kernel[name]}: expected one of {', '.join(VARLEN_KERNELS)}")
        only[name] = set(at.split(",")) if at else set(QWEN)
        if only[name] - set(QWEN):
            raise SystemExit(f"--variant {name}@{at}: no shape {', '.join(sorted(only[name] - set(QWEN)))} ({', '.join(QWEN)})")
        variants[name] = resolve(args.after + overrides, base=Config(learner=replace(gpu))).learner
    # the order rows run in, the most informative first (a time limit cuts the last): each shape's before and
    # after rows (its RESULT line), in --shapes order, then each variant at its shapes (on CPU: at the tiny one)
    plan = [(s, n) for s in shapes for n in ("before", "after") if n in variants]
    plan += [(s, n) for n in variants if n not in ("before", "after") for s in shapes if s in only[n] or not cuda]
    actions = sum(1 for r in rows for m in r.mask if m > 0)
    log(f"batch: {len(rows)} rows, {total} tokens (median row {sorted(map(len, rows))[len(rows) // 2]}, "
        f"{min(map(len, rows))}-{max(map(len, rows))}), action tokens {actions / total:.1%}, "
        f"{len(pack_rows(rows, budget))} micro-batches of <= {budget}; device {device}")  # fmt: skip
    for name, c in variants.items():
        log(f"{name}: attention={c.attention}{f' ({kernel[name]})' if kernel.get(name) else ''} activation_checkpointing={c.activation_checkpointing} compile={c.compile} "
            f"reshard={c.reshard} fsdp_unit={c.fsdp_unit} micro_batch_tokens={c.micro_batch_tokens} mixed_precision="
            f"{c.mixed_precision}{' + the autograd LM head, foreach AdamW' if name == 'before' else ''}")  # fmt: skip
    log("rows, in order: " + ", ".join(f"{s} {n}" for s, n in plan))
    matmul = matmul_flops_per_s(8192 if cuda else 512)
    log(f"[{time.perf_counter() - T_START:6.1f} s] bf16 matmul {'8192' if cuda else '512'}^3: {matmul / 1e12:.1f} TFLOP/s")
    tmp, res = Path(tempfile.mkdtemp(prefix="l0min-bench-mfu-")), {s: {} for s in shapes}
    w = max(7, *map(len, variants))
    header = (f"{'shape':<6} {'path':<{w}} {'tokens/s':>9} {'MFU (989)':>9} {'of matmul':>9} {'peak GiB':>8} {'step s':>7} "
              f"{'step-1 loss':>12} {'grad norm':>10} {'device idle':>11}")  # fmt: skip
    for shape, name in plan:
        hidden, inter, layers, heads, kv, target = shapes[shape]
        folder = tmp / shape
        config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                             num_attention_heads=heads, num_key_value_heads=kv, tie_word_embeddings=True,
                             max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6)  # fmt: skip
        if not folder.exists():
            config.save_pretrained(folder)
            make_toy_tokenizer().save_pretrained(folder)  # the learner's tokenizer; the rows are ids already
        if time.perf_counter() - T_START > args.budget_s:
            log(f"[{time.perf_counter() - T_START:6.1f} s] {shape} {name}: skipped (--budget-s {args.budget_s:.0f})")
        else:
            if kernel.get(name):  # this row's build sees that kernel alone
                learner_module.VARLEN_KERNELS = {kernel[name]: VARLEN_KERNELS[kernel[name]]}
            try:  # a row that fails (out of memory, a compile error) is reported; the others still run
                res[shape][name] = measure(f"{shape} {name}", folder, variants[name], config, rows, budget, matmul,
                                           todays=name == "before")  # fmt: skip
            except Exception as e:  # noqa: BLE001
                log(f"[{time.perf_counter() - T_START:6.1f} s] {shape} {name}: FAILED {type(e).__name__}: {str(e)[:2000]}")
            learner_module.VARLEN_KERNELS = VARLEN_KERNELS
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
        report_row(shape, name, res[shape], target, header, cuda)  # now: a time limit loses no finished row
    shutil.rmtree(tmp, ignore_errors=True)
    if any(r["prof"] for rs in res.values() for r in rs.values()):
        from torch._dynamo.utils import counters

        breaks = sum(counters["graph_break"].values())
        print(f"torch.compile: {counters['stats'].get('unique_graphs', 0)} graphs compiled, {breaks} graph breaks"
              + "".join(f"\n  graph break x{n}: {' '.join(why.split())[:200]}" for why, n in counters["graph_break"].most_common(5)))
    print(f"\ntotal {time.perf_counter() - T_START:.1f} s; bf16 matmul {matmul / 1e12:.1f} TFLOP/s")
    close_distributed()


HEADER_SHOWN = []


def report_row(shape: str, name: str, res: dict, target, header: str, cuda: bool) -> None:
    """A row's table line, its log-probs against the shape's reference row (before, else after), and for the after
    row the shape's RESULT line, printed as soon as the row ends."""
    if not HEADER_SHOWN:
        print("\n" + header, flush=True)
        HEADER_SHOWN.append(True)
    w = header.index("tokens/s") - 8
    if (r := res.get(name)) is not None:
        idle = f"{1 - r['prof']['busy'] / r['prof']['wall']:.0%}" if r["prof"] and cuda else "-"
        print(f"{shape:<6} {name:<{w}} {r['tok_s']:>9,.0f} {r['mfu']:>9.1%} {r['of_matmul']:>9.1%} {r['mem']:>8.1f} "
              f"{r['step']:>7.2f} {r['loss']:>12.5g} {r['grad_norm']:>10.4g} {idle:>11}")  # fmt: skip
        ref = next((k for k in ("before", "after") if k in res), None)  # the others' log-probs against it
        if ref and ref != name:
            d, spread = (r["lp"] - res[ref]["lp"]).abs(), res[ref]["lp"].std().item()
            ok = d.mean().item() <= 0.05 * spread
            print(f"{shape:<6} {name}/{ref} {r['tok_s'] / res[ref]['tok_s']:.2f}x tokens/s; log-probs "
                  f"|{name} - {ref}| mean {d.mean():.2e}, max {d.max():.2e} over {len(d)} action tokens (their spread "
                  f"{spread:.2e}; bf16 noise ~2% of it, a broken path ~100%): {'PASS' if ok else 'FAIL'}")  # fmt: skip
    if name != "after":
        return sys.stdout.flush()
    if target is None:
        m = f"{r['mfu']:.4f}" if r else "nan"
        print(f"RESULT learner_mfu_{shape}={m} (CPU: the tiny shape only proves the bench runs; the targets are for one H100)")
    elif r is None:
        print(f"RESULT learner_mfu_{shape}=nan target >= {target} SHORT (not measured: failed, or --budget-s)")
    else:
        print(f"RESULT learner_mfu_{shape}={r['mfu']:.3f} target >= {target} {'MET' if r['mfu'] >= target else 'SHORT'}")
    sys.stdout.flush()


mfu() if args.mfu else main()
