"""The FSDP2 learner: shard a Hugging Face causal LM, take on-policy steps, export, checkpoint (SPMD: every rank
runs the same code; `train_step` takes this rank's share of the global batch).

The model is built on the meta device, `fully_shard` wraps `fsdp_unit` decoder layers at a time, then the root; rank 0
alone reads the checkpoint and broadcasts it. Micro-batches are packed: rows concatenated into one sequence of at most
`micro_batch_tokens`, attention within each row (`packed_sdpa`, `packed_varlen`): no padding, no dense mask (it cost 2x
at 4k tokens, bench/learner.py). The GPU speed paths are `apply_*` functions composed in `_build` (torchtitan's style).
Log-probs are those the sampler drew from, log_softmax(logits / T) (top-p / top-k not modelled), computed by the LM
head in chunks of action positions (`LogProbHead`): no [tokens, vocab] fp32 tensor exists.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import math
import random
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)

from l0_min import loss as losses
from l0_min.distributed import all_reduce, from_rank0, init_distributed
from l0_min.config import AlgoConfig, LearnerConfig
from l0_min.episode import Row


# --------------------------------------------------------------------------------------- memory
def memory_estimate(config, n_params: int, n_train: int, cfg: LearnerConfig, world: int, mixed: bool, ref: bool) -> dict:
    """GiB per rank at its peak, by part: fp32 masters, gradients, AdamW's moments, the KL reference (sharded); the
    gathered copies (root and two units in flight); a micro-batch's activations (what checkpointing keeps, then the
    larger of a layer's backward and the head's chunk). Within -0.02..+0.65 GiB of 10 measured peaks (docs/gpu.md)."""
    h, i, n = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    a, t, v, kv = 2 if mixed else 4, cfg.micro_batch_tokens, config.vocab_size, config.num_key_value_heads
    kv *= getattr(config, "head_dim", None) or h // config.num_attention_heads
    root = v * h * (1 if config.tie_word_embeddings else 2)
    layer, head = (8 * h + 5 * i) * a * t, LogProbHead.chunk * v * (a + 9)
    kept = {"none": n * layer, "full": n * h * a * t, "selective": n * (4 * h + 2 * kv + 2 * i) * a * t}
    ac = {True: "full", False: "none"}.get(cfg.activation_checkpointing, cfg.activation_checkpointing)
    gathered = (root + 2 * cfg.fsdp_unit * (n_params - root) / n) * a if cfg.reshard else n_params * a
    parts = {"weights": 4 * n_params / world, "grads": 4 * n_train / world, "AdamW": 8 * n_train / world,
             "reference": a * n_params / world * ref, "gathered": gathered,
             "activations": kept.get(ac, 0) + max(layer, head) + v * h * 4 + t * h * 4}  # fmt: skip
    return {k: x / 2**30 for k, x in parts.items()}


class NoRoom(RuntimeError):
    """The learner cannot fit on its GPU (check_memory's line)."""


def free_memory(device: torch.device) -> tuple[float, float] | None:
    """(free, total) GiB on the learner's GPU; None on the CPU, where no budget is checked."""
    return tuple(x / 2**30 for x in torch.cuda.mem_get_info(device)) if device.type == "cuda" else None


def check_memory(config, n_params: int, n_train: int, cfg: LearnerConfig, world: int, mixed: bool, ref: bool,
                 room: tuple[float, float], gpu: int | None = None) -> None:
    """Say what the learner needs (memory_estimate) against what is free on its GPU; where it cannot fit, stop with
    one line naming what would fit (no KL reference, LoRA, full checkpointing, more ranks), each with its estimate."""
    (free, total), parts = room, memory_estimate(config, n_params, n_train, cfg, world, mixed, ref)
    need = sum(parts.values())
    line = (f"~{need:.1f} GiB on GPU {gpu} (" + ", ".join(f"{k} {x:.1f}" for k, x in parts.items() if x)
            + f", per micro-batch of {cfg.micro_batch_tokens} tokens) of {free:.1f} free of {total:.1f}")  # fmt: skip
    if need > free:
        kv = config.num_key_value_heads * (getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        lora = 16 * config.num_hidden_layers * (9 * config.hidden_size + 2 * kv + 3 * config.intermediate_size)
        need_of = lambda nt, c, w, r: sum(memory_estimate(config, n_params, nt, c, w, mixed, r).values())  # noqa: E731
        options = {"algo.kl_coef=0": (n_train, cfg, world, False)} if ref else {}
        options |= {"learner.lora_rank=16": (lora, cfg, world, ref)} if not cfg.lora_rank else {}
        if cfg.activation_checkpointing not in ("full", True):
            options["learner.activation_checkpointing=full"] = (n_train, dataclasses.replace(cfg, activation_checkpointing="full"),
                                                                world, ref)  # fmt: skip
        w = next((w for w in (2 * world, 4 * world, 8 * world) if need_of(n_train, cfg, w, ref) <= free), 8 * world)
        options[f"{w} ranks"] = (n_train, cfg, w, ref)  # the fewest that fit
        est = {k: need_of(*o) for k, o in options.items()}
        fits = [k for k, x in est.items() if x <= free]
        shown = ", ".join(f"{k} (~{est[k]:.1f} GiB)" for k in (fits or est))
        raise NoRoom(f"the learner needs {line}: {total - free:.1f} GiB are in use (an inference server?); "
                     + (f"it would fit with {shown}" if fits else f"none of {shown} fits: a smaller model"))
    if dist.get_rank() == 0:
        print(f"learner: memory {line}", file=sys.stderr, flush=True)


# -------------------------------------------------------------------------------------- packing
def pack_rows(rows: list[Row], budget: int, balance: bool = True) -> list[list[Row]]:
    """Rows into as few micro-batches of at most `budget` tokens as first-fit-decreasing finds, spread as evenly as
    the budget allows (as verl does: a pass has fixed costs). A row over budget is alone.

    >>> r = lambda n: Row([0] * n, [0.0] * n, [0.0] * n, [0.0] * n)
    >>> [[len(x) for x in mb] for mb in pack_rows([r(6), r(3), r(5), r(2), r(12), r(1)], 10)]
    [[12], [6, 2, 1], [5, 3]]
    """
    bins, load = [], []  # first fit decreasing: how many micro-batches
    for row in (order := sorted(rows, key=len, reverse=True)):
        i = next((i for i, n in enumerate(load) if n + len(row) <= budget), len(bins))
        if i == len(bins):
            bins.append([])
            load.append(0)
        bins[i].append(row)
        load[i] += len(row)
    even, level = [[] for _ in bins], [0] * len(bins)
    for row in order if balance else ():  # as many, filled evenly
        fits = [i for i, n in enumerate(level) if n + len(row) <= budget or n == 0]
        if not fits:  # no room in the even fill: first fit's packing stands
            return bins
        i = min(fits, key=level.__getitem__)
        even[i].append(row)
        level[i] += len(row)
    return even if balance else bins


def shard_rows(rows: list[Row], rank: int, world: int) -> list[Row]:
    """This rank's share of the global batch: longest-first to the rank with fewest tokens so far.

    >>> r = lambda n: Row([0] * n, [0.0] * n, [0.0] * n, [0.0] * n)
    >>> [len(x) for x in shard_rows([r(9), r(5), r(4), r(3)], 0, 2)], [len(x) for x in shard_rows([r(9), r(5), r(4), r(3)], 1, 2)]
    ([9, 3], [5, 4])
    """
    load, mine = [0] * world, []
    for row in sorted(rows, key=len, reverse=True):
        k = min(range(world), key=lambda j: (load[j], j))
        load[k] += len(row)
        if k == rank:
            mine.append(row)
    return mine


def _concat(mb: list[Row], device) -> dict:
    """A micro-batch's rows as flat tensors on the device, each token's chunk (loss.chunks) and its `packing`,
    worked out on the host (no device sync)."""
    cat = lambda f, dt: torch.cat([torch.as_tensor(f(r), dtype=dt) for r in mb])
    b = {"ids": cat(lambda r: r.ids, torch.long), "pos": cat(lambda r: range(len(r)), torch.long),
         "mask": cat(lambda r: r.mask, torch.float32), "adv": cat(lambda r: r.adv, torch.float32),
         "old": cat(lambda r: r.old_logp, torch.float32)}  # fmt: skip
    b["chunk"] = losses.chunks(b["mask"])
    cu, longest, idx = packing(b["pos"], b["mask"] > 0)
    return {k: v.to(device) for k, v in b.items()} | {"packing": (cu.to(device), longest, idx.to(device))}


# ------------------------------------------------------------------------------------ attention
# transformers' attention call on a packed micro-batch ([1, heads, tokens, head_dim], `cu_seq_lens_q` = row bounds
# [0, len0, len0+len1, ..., tokens]), causal within each row: sum(row_len^2) work, no mask (sdpa's is ~ tokens^2).
PACKED_ATTENTION, VARLEN_ATTENTION = "l0_packed_sdpa", "l0_packed_varlen"


def packed_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, cu_seq_lens_q=None, **kwargs):
    """One SDPA call per row (CPU, and CUDA without a varlen kernel); one `.tolist()` of the bounds per layer."""
    gqa = getattr(module, "num_key_value_groups", 1) > 1  # SDPA shares K/V across query heads itself
    bounds = [0, query.shape[2]] if cu_seq_lens_q is None else cu_seq_lens_q.tolist()
    out = [F.scaled_dot_product_attention(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], dropout_p=dropout,
                                          is_causal=True, scale=scaling, enable_gqa=gqa)
           for a, b in zip(bounds[:-1], bounds[1:])]  # fmt: skip
    return torch.cat(out, dim=2).transpose(1, 2).contiguous(), None


def packed_varlen(module, query, key, value, attention_mask, dropout=0.0, scaling=None, cu_seq_lens_q=None,
                  max_length_q=None, kernel=None, **kwargs):  # fmt: skip
    """All rows in one varlen kernel call (CUDA, bf16): no loop, no host sync. `kernel(q, k, v, cu, max_len,
    scale)` takes [tokens, heads, head_dim] (see `varlen_kernel`); `max_length_q` is computed once per micro-batch."""
    q, k, v = (x[0].transpose(0, 1).contiguous() for x in (query, key, value))
    return kernel(q, k, v, cu_seq_lens_q, max_length_q, scaling)[None], None


def _flash_varlen(module: str):
    """`module`'s flash_attn_varlen_func (flash_attn: flash-attn 2; flash_attn_interface: 3; flash_attn.cute: 4, whose
    wheel SGLang installs and which leaves `flash_attn` an empty namespace package); 3 and 4 may return (out, lse)."""
    fn = importlib.import_module(module).flash_attn_varlen_func

    def run(q, k, v, cu, n, scale):
        out = fn(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=n, max_seqlen_k=n, softmax_scale=scale, causal=True)
        return out[0] if isinstance(out, tuple) else out

    return run


def _torch_varlen(repeat: bool):
    """torch's `varlen_attn`, causal as `window_size=(-1, 0)`. Its flash kernel shares K/V heads itself (GQA, asked
    for with `enable_gqa`); where it does not (`repeat`), the shared heads are repeated first, as transformers' own
    `repeat_kv` does."""
    from torch.nn.attention.varlen import varlen_attn

    kw = {} if repeat else {"enable_gqa": True}

    def run(q, k, v, cu, n, scale):
        if repeat and k.shape[1] != q.shape[1]:
            k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
        return varlen_attn(q, k, v, cu, cu, n, n, scale=scale, window_size=(-1, 0), **kw)

    return run


# (module, how to load its kernel) in order of preference; flash-attn 4 last: its CuTe kernels compile at each first use
VARLEN_KERNELS = {"flash_attn": ("flash_attn", lambda: _flash_varlen("flash_attn")),
                  "flash_attn_interface": ("flash_attn_interface", lambda: _flash_varlen("flash_attn_interface")),
                  "torch_varlen": ("torch.nn.attention.varlen", lambda: _torch_varlen(repeat=False)),
                  "torch_varlen_repeat_kv": ("torch.nn.attention.varlen", lambda: _torch_varlen(repeat=True)),
                  "flash_attn_cute": ("flash_attn.cute", lambda: _flash_varlen("flash_attn.cute"))}


def _probe_varlen(kernel, device: torch.device, dtype: torch.dtype) -> None:
    """Raise unless `kernel` runs forward and backward on `device` in `dtype` and gives one causal SDPA per row:
    two rows (3 and 5 tokens), 4 query heads sharing 2 K/V heads, head_dim 64."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(8, h, 64, generator=g).to(device, dtype).requires_grad_() for h in (4, 2, 2))
    cu = torch.tensor([0, 3, 8], dtype=torch.int32, device=device)
    out = kernel(q, k, v, cu, 5, 0.125)
    out.float().square().sum().backward()
    want = torch.cat([F.scaled_dot_product_attention(*(x[a:b].detach().float().transpose(0, 1) for x in (q, k, v)),
                                                     is_causal=True, scale=0.125, enable_gqa=True).transpose(0, 1)
                      for a, b in ((0, 3), (3, 8))])  # fmt: skip
    err = (out.detach().float() - want).abs().max().item()  # values ~1: bf16 rounding ~0.01, a wrong mask ~0.3
    if not err <= 0.05 or q.grad is None or not torch.isfinite(q.grad).all():
        raise ValueError(f"wrong output: max |difference| to one SDPA per row {err:.3g}")


def varlen_kernel(device: torch.device, dtype: torch.dtype) -> tuple:
    """(kernel, its name) of the first of VARLEN_KERNELS that imports, runs on `device` in `dtype` and is right, or
    (None, None); and why each installed one before it was passed over, in one line."""
    skipped = []
    for name, (module, load) in VARLEN_KERNELS.items():
        try:
            if importlib.util.find_spec(module) is None:
                continue
            _probe_varlen(kernel := load(), device, dtype)
            return kernel, name, "; ".join(skipped)
        except Exception as e:  # noqa: BLE001 -- an import, a missing device kernel, a wrong answer: the next one
            skipped.append(f"{name}: {type(e).__name__}: {' '.join(str(e).split())[:200]}")
    return None, None, "; ".join(skipped)


def _attention(choice: str, device: torch.device, dtype: torch.dtype) -> str:
    """learner.attention -> the registered implementation: auto = one varlen call per micro-batch on CUDA in bf16
    where a varlen kernel runs, else one SDPA per row; varlen = the same, refused at start-up where none runs."""
    from transformers import AttentionInterface

    if choice not in ("auto", "rows", "varlen"):
        raise ValueError(f"learner.attention: unknown {choice!r} (auto | rows | varlen)")
    kernel = None
    if choice == "varlen" or (choice == "auto" and device.type == "cuda" and dtype == torch.bfloat16):
        kernel, name, why = varlen_kernel(device, dtype)
        if choice == "varlen" and kernel is None:
            raise ValueError(f"learner.attention=varlen: no varlen kernel runs on {device.type} in {str(dtype)[6:]} "
                             f"({why or 'none installed'}); use auto or rows (varlen needs CUDA and learner.mixed_precision)")  # fmt: skip
        if not dist.is_initialized() or dist.get_rank() == 0:  # which, and why any installed before it was not
            print(f"learner: attention {name or 'one SDPA per row'}" + (f"; passed over {why}" if why else ""),
                  file=sys.stderr, flush=True)
    AttentionInterface.register(PACKED_ATTENTION, torch.compiler.disable(packed_sdpa))  # compiled layers: run as is
    if kernel is not None:  # (registrations are global: never replace a working one with none)
        AttentionInterface.register(VARLEN_ATTENTION, functools.partial(packed_varlen, kernel=kernel))
    return PACKED_ATTENTION if kernel is None else VARLEN_ATTENTION


# -------------------------------------------------------------------------------------- LM head
def _logp_lse(z: torch.Tensor, targets: torch.Tensor, inv_t: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk's log p(target) and logsumexp at temperature 1 / inv_t, in fp32, from its logits `z`."""
    z = z.float() * inv_t
    lse = z.logsumexp(-1)
    return z.gather(-1, targets[:, None]).squeeze(-1) - lse, lse


def _dlogits(z: torch.Tensor, lse: torch.Tensor, targets: torch.Tensor, g: torch.Tensor, inv_t: float) -> torch.Tensor:
    """d(sum_i g_i log p_i) / dz = (onehot(target) - softmax(z / T)) * g / T, in z's dtype.

    >>> _dlogits(torch.zeros(1, 2), torch.tensor([math.log(2)]), torch.tensor([0]), torch.ones(1), 1.0)
    tensor([[ 0.5000, -0.5000]])
    """
    gt = (g * inv_t)[:, None]
    d = (z.float() * inv_t - lse[:, None]).exp_().mul_(-gt)
    return d.scatter_add_(1, targets[:, None], gt).to(z.dtype)


class _LinearLogProb(torch.autograd.Function):
    """log p(target) = z[target] - logsumexp(z), z = (h W^T + b) / T, chunk by chunk; the backward recomputes each
    chunk's logits. One [chunk, vocab] block exists at a time."""

    @staticmethod
    def forward(ctx, h, weight, bias, targets, inv_t, chunk, kernels):
        parts = [kernels[0](F.linear(h[a : a + chunk], weight, bias), targets[a : a + chunk], inv_t)
                 for a in range(0, len(h), chunk)]  # fmt: skip
        ctx.save_for_backward(h, weight, bias, targets, torch.cat([lse for _, lse in parts]))
        ctx.inv_t, ctx.chunk, ctx.kernels = inv_t, chunk, kernels
        return torch.cat([lp[None, :, None] for lp, _ in parts], dim=1)  # [1, n, 1], as logits; not a view (FSDP2)

    @staticmethod
    def backward(ctx, g):
        h, weight, bias, targets, lse = ctx.saved_tensors
        g = g.reshape(-1)
        # the gradients that are needed (not: LoRA's frozen head, a bias-free head's bias), summed in fp32
        dh, dw, db = (torch.zeros(x.shape, dtype=torch.float32, device=x.device) if need else None
                      for x, need in zip((h, weight, bias), ctx.needs_input_grad))  # fmt: skip
        for a in range(0, len(h), ctx.chunk):
            s = slice(a, a + ctx.chunk)
            dz = ctx.kernels[1](F.linear(h[s], weight, bias), lse[s], targets[s], g[s], ctx.inv_t)
            if dh is not None:
                dh[s] = dz @ weight
            if dw is not None:
                dw += dz.t() @ h[s]
            if db is not None:
                db += dz.sum(0)
        cast = lambda d, x: None if d is None else d.to(x.dtype)
        return cast(dh, h), cast(dw, weight), cast(db, bias), None, None, None, None


class LogProbHead(torch.nn.Linear):
    """An LM head (same weights and names) that returns log p(target) at temperature T instead of logits, inside the
    model's forward, so FSDP2 has the root's weights gathered; full fp32 logits of a 32k-token micro-batch were ~20 GB.
    `token_logprobs` sets `targets` and `inv_t`; `apply_compile` compiles `kernels`."""

    chunk = 2048
    targets: torch.Tensor
    inv_t: float = 1.0
    kernels = (_logp_lse, _dlogits)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h.reshape(-1, h.shape[-1])
        return _LinearLogProb.apply(h, self.weight, self.bias, self.targets, self.inv_t, self.chunk, self.kernels)


def packing(pos: torch.Tensor, need: torch.Tensor | None = None) -> tuple[torch.Tensor, int, torch.Tensor]:
    """Row bounds [0, len0, ..., tokens] (int32), the longest row, the positions `need` marks (all; never a row's first)."""
    starts = torch.nonzero(pos == 0).flatten()
    cu = torch.cat([starts, starts.new_tensor([len(pos)])]).to(torch.int32)
    want = pos != 0 if need is None else (need.bool() & (pos != 0))
    want[-1] |= not want.any()  # a zero-weight filler: keep one position so the graph still reaches every weight
    return cu, int((cu[1:] - cu[:-1]).max()), torch.nonzero(want).flatten()


def token_logprobs(model, ids: torch.Tensor, pos: torch.Tensor, need: torch.Tensor | None = None,
                   temperature: float = 1.0, packed: tuple | None = None) -> torch.Tensor:
    """log p(ids[t] | ids[<t]) at `temperature` of a packed sequence at the positions `need` marks (default: all;
    `packed`: `packing(pos, need)` worked out ahead), 0 elsewhere. Only those go through the LogProbHead lm_head."""
    cu, longest, idx = packing(pos, need) if packed is None else packed  # idx: t; their logits are t - 1's
    model.lm_head.targets, model.lm_head.inv_t = ids[idx], 1.0 / (temperature or 1.0)  # T = 0 (greedy): raw logits
    logp = model(input_ids=ids[None], position_ids=pos[None], use_cache=False, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                 max_length_q=longest, max_length_k=longest, logits_to_keep=idx - 1).logits.reshape(-1)
    return logp.new_zeros(len(ids)).index_put((idx,), logp)


# ---------------------------------------------------------------------------------- the learner
def _lr_factor(cfg: LearnerConfig, total_steps: int, step: int) -> float:
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "cosine":
        progress = (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps)
        cos = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cos
    if cfg.schedule != "constant":
        raise ValueError(f"learner.schedule: unknown schedule {cfg.schedule!r} (constant | cosine)")
    return 1.0


def add_lora(model: torch.nn.Module, cfg: LearnerConfig) -> torch.nn.Module:
    """LoRA adapters (peft) in place on the decoder's linear layers; the base weights stop training.
    Seeded, so rank 0's real model and every rank's meta model agree on names and rank 0's init."""
    from peft import LoraConfig, inject_adapter_in_model

    with torch.random.fork_rng():
        torch.manual_seed(0)
        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        return inject_adapter_in_model(LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, target_modules=targets), model)


def merge_lora(sd: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """A full state dict with LoRA adapters -> the base model's names and merged weights W + s * B @ A."""
    out = {}
    for k, v in sd.items():
        if k.endswith(".base_layer.weight"):
            stem = k[: -len(".base_layer.weight")]
            v = v + scaling * (sd[f"{stem}.lora_B.default.weight"] @ sd[f"{stem}.lora_A.default.weight"])
        if ".lora_" not in k:
            out[k.replace(".base_layer.", ".")] = v
    return out


# ---------------------------------------------------------------------- speed paths (torchtitan's style)
def _layers(model: torch.nn.Module):
    if (layers := getattr(getattr(model, "model", model), "layers", None)) is None:
        raise ValueError(f"{type(model).__name__}: expected decoder layers at model.model.layers")
    return layers


_SAVED_OPS = {"aten.mm", "aten.addmm", "aten._scaled_dot_product_flash_attention", "aten._flash_attention_forward",
              "aten._scaled_dot_product_efficient_attention", "aten._scaled_dot_product_cudnn_attention",
              "aten._scaled_dot_product_flash_attention_for_cpu", "torch_attn._varlen_attn",
              "flash_attn._flash_attn_varlen_forward"}  # fmt: skip


def _save_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if str(op).rsplit(".", 1)[0] in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def apply_activation_checkpointing(model: torch.nn.Module, mode: str | bool) -> None:
    """learner.activation_checkpointing: recompute each decoder layer in backward. "full" keeps the layer's input;
    "selective" also the matmul and attention outputs (~15x hidden per token at Qwen2.5's shapes), recomputing
    only the elementwise chains. true/false: full/none."""
    mode = {True: "full", False: "none"}.get(mode, mode)
    sac = {"context_fn": functools.partial(create_selective_checkpoint_contexts, _save_matmuls)}
    policies = {"none": None, "full": {}, "selective": sac}
    if mode not in policies:
        raise ValueError(f"learner.activation_checkpointing: unknown {mode!r} (none | full | selective)")
    for layer in _layers(model) if mode != "none" else ():  # FSDP's hooks stay outside
        layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False, **policies[mode])


def apply_compile(model: torch.nn.Module, backend: str) -> None:
    """learner.compile: torch.compile each decoder layer's forward (checkpointing inside, FSDP's hooks outside, as
    torchtitan does) and the LM head's kernels, with dynamic shapes (a new packed length does not recompile)."""
    if backend == "none":
        return
    compile = functools.partial(torch.compile, backend=backend, dynamic=True)
    for layer in _layers(model):
        layer.forward = compile(layer.forward)
    model.lm_head.kernels = tuple(compile(k) for k in LogProbHead.kernels)


def _build(config, attn: str, cfg: LearnerConfig, mixed: bool, device, full_sd: dict, buffers: dict, train: bool):
    """The sharded model: built on the meta device, sped up, sharded, then filled from rank 0's `full_sd`."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attn)
    model.config.use_cache = False
    model.lm_head.__class__ = LogProbHead
    model = add_lora(model, cfg) if cfg.lora_rank > 0 else model
    apply_activation_checkpointing(model, cfg.activation_checkpointing if train else "none")
    apply_compile(model, cfg.compile)
    if mixed and not train:  # the frozen reference is kept in the compute dtype: what every gather cast it to anyway
        for x in model.parameters():
            x.data = x.data.to(torch.bfloat16)
    kw = {"mesh": init_device_mesh(device.type, (dist.get_world_size(),))}  # the learner's device, not the host's GPU
    kw |= {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)} if mixed else {}
    layers, k = list(_layers(model)), cfg.fsdp_unit
    if k < 1:
        raise ValueError(f"learner.fsdp_unit: expected >= 1 decoder layers, got {k}")
    for m in [*(layers[i : i + k] for i in range(0, len(layers), k)), model]:  # k decoder layers a unit, then the root
        fully_shard(m, **kw)
    model.eval()  # dropout off (the checkpointing above is ours, not transformers' training-mode one)
    model.to_empty(device=device)  # then the broadcast lands on the device (a meta model would be loaded on CPU)
    # a copy: set_model_state_dict puts sharded tensors into its dict (the KL reference would get the policy's DTensors)
    set_model_state_dict(model, dict(full_sd), options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    for name, b in buffers.items():  # non-persistent buffers (rotary inv_freq) are not in any state dict
        model.get_buffer(name).copy_(b)
    for m in model.modules():  # transformers 4.x: an alias of the buffer that to_empty replaced
        if "original_inv_freq" in vars(m):
            m.original_inv_freq = m.inv_freq
    return model if train else model.requires_grad_(False)


class Learner:
    def __init__(self, model_path: str | Path, cfg: LearnerConfig, algo_cfg: AlgoConfig, total_steps: int = 1,
                 temperature: float = 1.0, weights: torch.nn.Module | None = None):
        """`weights`: rank 0's full model instead of `model_path`'s checkpoint (bench/learner.py); the config
        and tokenizer still come from `model_path`."""
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        self.cfg, self.algo, self.temperature = cfg, algo_cfg, temperature
        self.rank, self.world, self.device = init_distributed(cfg.backend, cfg.device)
        self.model_path = Path(model_path)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        mixed = self.device.type == "cuda" if cfg.mixed_precision is None else cfg.mixed_precision
        full_sd, shared = {}, None  # rank 0 alone reads the checkpoint (one host copy, not one per rank), broadcasts it
        if self.rank == 0:
            cpu = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32) if weights is None else weights
            cpu = add_lora(cpu, cfg) if cfg.lora_rank > 0 else cpu  # the adapters' init travels with the weights
            full_sd = cpu.state_dict()
            lora = sum(x.numel() for name, x in cpu.named_parameters() if "lora_" in name)  # the adapters' parameters
            base = sum(x.numel() for x in cpu.parameters()) - lora
            shared = dict(cpu.named_buffers()), base, lora or base
        buffers, n_params, n_train = from_rank0(shared)
        config = AutoConfig.from_pretrained(self.model_path)
        if (room := free_memory(self.device)) is not None:  # what it needs against what is free, before it allocates
            check_memory(config, n_params, n_train, cfg, self.world, mixed, algo_cfg.kl_coef > 0, room, self.device.index)
        args = (config, _attention(cfg.attention, self.device, torch.bfloat16 if mixed else torch.float32),
                cfg, mixed, self.device, full_sd, buffers)
        self.model = _build(*args, train=True)
        self.ref = _build(*args, train=False) if algo_cfg.kl_coef > 0 else None  # the KL penalty's frozen reference
        del full_sd, args
        self.params = [p for p in self.model.parameters() if p.requires_grad]  # the adapters alone with LoRA
        self.reset_optimizer(cfg.lr, total_steps)
        self.step = 0

    def reset_optimizer(self, lr: float, total_steps: int) -> None:
        """A fresh AdamW (fused on CUDA) and schedule, for a new phase (SFT, then RL at its own learning rate)."""
        self.opt = torch.optim.AdamW(self.params, lr=lr, betas=tuple(self.cfg.betas), weight_decay=self.cfg.weight_decay,
                                     fused=self.device.type == "cuda" or None)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, functools.partial(_lr_factor, self.cfg, total_steps))

    # -- one RL update -------------------------------------------------------------------------
    def train_step(self, rows: list[Row], sft: bool = False) -> dict:
        """One update from this rank's rows (`ppo_epochs` optimizer steps). RL: token t's gradient is w_t * A_t *
        grad log p_t, w_t the behaviour correction of the sampler's log-prob (Row.old_logp) against the learner's
        at the start of the step, "prox" (loss.behaviour_weights); PPO's ratio is against prox. SFT: the actions'
        log-likelihood, normalised like the RL loss, without correction."""
        t0 = time.perf_counter()
        a = self.algo
        # DAPO: normalise by the action tokens of the WHOLE global batch (all ranks, micro-batches)
        n_actions = sum(1 for r in rows for m in r.mask if m > 0)
        if self.ref is None:  # a row whose every advantage is 0 adds exactly 0 to the loss: skip its passes
            rows = [r for r in rows if any(m > 0 and x != 0 for m, x in zip(r.mask, r.adv))]
        n_global, n_processed = all_reduce([n_actions, sum(len(r) for r in rows)], self.device)
        micro = pack_rows(rows, self.cfg.micro_batch_tokens)
        # every rank must run the same number of forward/backward passes (FSDP collectives)
        (n_mb,) = all_reduce([len(micro)], self.device, op=dist.ReduceOp.MAX)
        micro += [[Row([0, 0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0])]] * (int(n_mb) - len(micro))  # zero-weight filler
        batches = [_concat(mb, self.device) for mb in micro]

        with torch.no_grad():  # the KL penalty's frozen reference (None: no penalty)
            ref_logps = None if self.ref is None else [token_logprobs(self.ref, b["ids"], b["pos"], None, self.temperature,
                                                                      b["packing"]) for b in batches]  # fmt: skip
        clip = a.clip_eps if a.ppo_epochs > 1 else None
        if a.ratio_level not in ("token", "chunk"):
            raise ValueError(f"algo.ratio_level: expected token or chunk, got {a.ratio_level!r}")
        stats = {"loss": 0.0, "pg_loss": 0.0, "kl": 0.0, "clip_frac": 0.0, "truncated": 0.0, "masked": 0.0}
        gap = {k: torch.zeros((), device=self.device) for k in ("tokens", "abs_log_ratio_sum", "abs_log_ratio_max", "k3_sum",
                                                                "chunks", "chunk_abs_log_ratio_sum", "chunk_abs_log_ratio_max")}
        for epoch in range(a.ppo_epochs):
            self.opt.zero_grad(set_to_none=True)
            for i, b in enumerate(batches):
                if not self.cfg.reshard:  # gathered once a step: the last micro-batch's backward frees the weights
                    for m in _layers(self.model):  # (on one rank sharding saves nothing: re-gathering is only copies)
                        m.set_reshard_after_forward(i == len(batches) - 1)
                    self.model.set_reshard_after_backward(i == len(batches) - 1)
                logp = token_logprobs(self.model, b["ids"], b["pos"], None, 1.0 if sft else self.temperature, b["packing"])
                if epoch == 0:  # prox = the learner at the start of the step; the weights stay fixed for the step
                    b["prox"] = logp.detach()
                    gap = gap if sft else self._correct(b, stats, gap)
                chunk = b["chunk"] if a.ratio_level == "chunk" else None
                loss = pg = losses.policy_loss(logp, b["prox"], b["adv"], b["mask"], n_global, clip, chunk)
                if ref_logps is not None:
                    kl = (losses.kl_penalty(logp, ref_logps[i], a.kl_estimator) * b["mask"]).sum() / max(n_global, 1.0)
                    loss = loss + a.kl_coef * kl
                    stats["kl"] += kl.detach() if epoch == 0 else 0.0
                # FSDP averages over ranks: x world is the gradient of (global-batch sum / n_global), however rows are split
                (loss * self.world).backward()
                if epoch == 0:
                    stats["loss"] += loss.detach()  # (sums on the device: no sync per micro-batch)
                    stats["pg_loss"] += pg.detach()
                elif clip is not None:
                    d = logp.detach() - b["prox"]
                    ratio = torch.exp(d if chunk is None else losses.chunk_mean(d, chunk))
                    outside = ((ratio - 1).abs() > clip).float() * (b["mask"] > 0).float()
                    stats["clip_frac"] += outside.sum() / max(n_global, 1.0) / (a.ppo_epochs - 1)
            norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip)
            stats.setdefault("grad_norm", norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # epoch 0's
            self.opt.step()
        self.sched.step()
        self.step += 1
        stats = self._reduce(stats, gap, sft)
        secs = time.perf_counter() - t0
        return stats | dict(lr=self.sched.get_last_lr()[0], action_tokens=n_global, tokens=n_processed,
                            train_seconds=secs, tokens_per_s=n_processed / max(secs, 1e-9))

    def _correct(self, b: dict, stats: dict, gap: dict) -> dict:
        """Micro-batch `b`'s mask times its behaviour correction (loss.behaviour_weights), counted in `stats`; returns
        `gap` plus its loss.mismatch. Sums stay on the device (no sync per micro-batch)."""
        a, on = self.algo, b["mask"] > 0
        w, keep = losses.behaviour_weights(b["prox"], b["old"], a.tis_cap, tuple(a.mask_band) if a.mask_band else None,
                                           b["chunk"] if a.ratio_level == "chunk" else None)  # fmt: skip
        if a.tis_cap > 0:
            stats["truncated"] += ((w >= a.tis_cap) & on).sum()
        stats["masked"] += ((keep == 0) & on).sum()
        b["mask"] = b["mask"] * w * keep
        m = losses.mismatch(b["prox"], b["old"], on.float(), b["chunk"])
        return {k: torch.maximum(gap[k], v) if k.endswith("max") else gap[k] + v for k, v in m.items()}

    def _reduce(self, stats: dict, gap: dict, sft: bool) -> dict:
        """The step's numbers over every rank (each holds its share), read back once."""
        keys = [k for k in stats | gap if k != "grad_norm" and not k.endswith("_max")]  # the sums
        sums = dict(zip(keys, all_reduce([(stats | gap)[k] for k in keys], self.device)))
        gap_max, chunk_max = all_reduce([gap[k] for k in gap if k.endswith("_max")], self.device, op=dist.ReduceOp.MAX)
        out = {k: sums[k] for k in ("loss", "pg_loss", "kl", "clip_frac")} | {"grad_norm": float(stats["grad_norm"])}
        if not sft:  # sampler vs learner on the action tokens (loss.mismatch), and what the correction did
            n = max(sums["tokens"], 1.0)
            out.update({"mismatch/abs_log_ratio_mean": sums["abs_log_ratio_sum"] / n, "mismatch/abs_log_ratio_max": gap_max,
                        "mismatch/chunk_abs_log_ratio_mean": sums["chunk_abs_log_ratio_sum"] / max(sums["chunks"], 1.0),
                        "mismatch/chunk_abs_log_ratio_max": chunk_max, "mismatch/kl_k3": sums["k3_sum"] / n,
                        "tis/truncated_frac": sums["truncated"] / n, "tis/masked_frac": sums["masked"] / n})  # fmt: skip
        return out

    # -- weights out ---------------------------------------------------------------------------
    def full_state_dict(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """The unsharded weights, cast to `dtype` (a collective: every rank calls; rank 0 gets the CPU
        tensors). One tensor is gathered at a time, so rank 0 holds one host copy, in `dtype`."""
        sd, lora = {}, self.cfg.lora_rank > 0  # LoRA: merged in fp32 first, then cast
        for name, t in self.model.state_dict().items():
            t = t.full_tensor() if hasattr(t, "full_tensor") else t
            if self.rank == 0:
                cast = dtype is not None and t.is_floating_point() and not lora  # a copy (1 CPU rank: not the live one)
                sd[name] = t.to("cpu", dtype=dtype if cast else t.dtype, copy=True)
        if lora and self.rank == 0:
            sd = {k: v.to(dtype) if dtype is not None else v for k, v in
                  merge_lora(sd, self.cfg.lora_alpha / self.cfg.lora_rank).items()}
        return sd

    def export_hf(self, folder: str | Path, dtype: str = "float32") -> Path | None:
        """Write a complete Hugging Face folder (config, safetensors, tokenizer) from rank 0, with the
        weights in the serving dtype (bf16 on GPU: half the bytes of the fp32 masters, every step)."""
        sd = self.full_state_dict(getattr(torch, dtype))
        folder = Path(folder).resolve()
        if self.rank == 0:
            if self.model.config.tie_word_embeddings:  # lm_head is embed_tokens: SGLang warns of an lm_head.weight
                sd.pop("lm_head.weight", None)  # (transformers drops it itself only where the two share storage)
            folder.mkdir(parents=True, exist_ok=True)
            self.model.save_pretrained(folder, state_dict=sd, safe_serialization=True)
            self.model.config.dtype = dtype  # save_pretrained wrote the masters' dtype
            self.model.config.save_pretrained(folder)
            self.tokenizer.save_pretrained(folder)
        dist.barrier()
        return folder if self.rank == 0 else None

    # -- checkpoint ----------------------------------------------------------------------------
    def _dcp_state(self) -> dict:
        return {"model": get_model_state_dict(self.model), "optim": get_optimizer_state_dict(self.model, self.opt)}

    def save(self, ckpt_dir: str | Path, extra: dict | None = None) -> None:
        """Model + optimizer (torch.distributed.checkpoint), scheduler, step, RNG, caller's extra."""
        ckpt_dir = Path(ckpt_dir)
        dcp.save(self._dcp_state(), checkpoint_id=str(ckpt_dir / "dcp"))
        torch.save({"torch": torch.get_rng_state(), "python": random.getstate()}, ckpt_dir / f"rng_rank{self.rank}.pt")
        if self.rank == 0:
            meta = {"step": self.step, "sched": self.sched.state_dict(), "extra": extra or {}}
            (ckpt_dir / "learner.json").write_text(json.dumps(meta))
        dist.barrier()

    def load(self, ckpt_dir: str | Path) -> dict:
        """Restore everything `save` wrote; returns the caller's `extra`."""
        ckpt_dir = Path(ckpt_dir)
        if not (ckpt_dir / "learner.json").is_file():
            raise FileNotFoundError(f"{ckpt_dir}: not a checkpoint (learner.json missing)")
        state = self._dcp_state()
        dcp.load(state, checkpoint_id=str(ckpt_dir / "dcp"))
        set_model_state_dict(self.model, state["model"])
        set_optimizer_state_dict(self.model, self.opt, state["optim"])
        meta = json.loads((ckpt_dir / "learner.json").read_text())
        self.step = meta["step"]
        self.sched.load_state_dict(meta["sched"])
        rng_file = ckpt_dir / f"rng_rank{self.rank}.pt"
        if rng_file.is_file():
            rng = torch.load(rng_file, weights_only=False)
            torch.set_rng_state(rng["torch"])
            random.setstate(rng["python"])
        return meta["extra"]
