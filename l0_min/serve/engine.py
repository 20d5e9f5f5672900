"""The batching engine of the embedded CPU server: continuous batching over a Hugging Face causal LM.

One background thread owns the model; each turn it takes new requests (thread-safe `submit`, `abort`, `call`),
admits waiting ones while rows and keys/values room last, prefills admitted prompts (at most `prefill_chunk` tokens a
turn, each reusing the longest prefix the `RadixCache` holds) and runs one decode step for the whole batch. Keys and
values live in `BatchKV`: a buffer [2, rows, kv_heads, columns, head_dim] per layer, row r holding sequence r's
tokens at columns 0..n_r-1, attended through a 4D mask (docs/internals.md "Inside the loop": the details).
"""

from __future__ import annotations

import contextlib
import ctypes
import inspect
import logging
import math
import os
import queue
import threading
import traceback
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable

import torch
from transformers import DynamicCache

from l0_min.models import load_safetensors_folder

log = logging.getLogger("l0_min.engine")

TOP_K_ALL = 1 << 30
GREEDY_EPS = 1e-6  # temperatures below this are greedy (as in SGLang)
IDLE_SECONDS = 2.0  # an engine idle this long releases its batch's keys/values buffer
PREFIX_IDLE_SECONDS = 10.0  # and this long, its prefix cache (the learner is stepping: new weights will come)
MIN_SHARED = 32  # a prefix that waiting prompts share is computed once first when it is at least this long


@dataclass
class SamplingParams:
    """Per-request sampling settings, already validated (see server.parse_sampling_params)."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = TOP_K_ALL  # -1 in the API means all
    min_p: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS or self.top_k == 1


@dataclass
class Sequence:
    """One generation request as the engine tracks it. `on_done(seq)` is called once, from the engine
    thread, when `finish_reason` is set (SGLang's shape: {"type": "stop"|"length"|"abort", ...})."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    on_done: Callable[["Sequence"], None] = lambda seq: None
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: dict | None = None
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    weight_version: str = ""
    # engine-private while it is prefilled: keys/values of its first `prefilled` prompt tokens, as segments
    # [layers, 2, kv_heads, n, head_dim] (from the radix cache, or what it computed itself)
    prefix: list[torch.Tensor] = field(default_factory=list)
    prefilled: int = 0

    @property
    def kv_len(self) -> int:
        """Tokens whose keys/values are in the cache once the sequence runs: all but the last sampled one."""
        return len(self.input_ids) + len(self.output_ids) - 1


# ------------------------------------------------------------------------------------- sampling
def sample(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor,
           min_p: torch.Tensor, greedy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids [B], their log-probs [B]) of one token per row of `logits` [B, V]: greedy rows the argmax, others
    sampled under top_k, top_p and min_p. The log-prob is of softmax(logits / temperature) before that truncation
    (SGLang's default, what the learner computes). Without truncation a row inverts its fp32 cumulative
    distribution with one uniform number (torch.multinomial draws one exponential per vocabulary entry)."""
    logits, rows = logits.float(), ~greedy  # below, no pass over B x V (2-4 ms at 64 x 49k) that changes nothing
    t = torch.where(greedy, 1.0, temperature)
    logp = torch.log_softmax(logits if bool((t == 1.0).all()) else logits / t[:, None], dim=-1)
    ids = torch.zeros(len(logits), dtype=torch.long)
    ids[greedy] = logits[greedy].argmax(dim=-1)
    if rows.any():
        probs = (logp if bool(rows.all()) else logp[rows]).exp()
        k, p, mp = top_k[rows], top_p[rows], min_p[rows]
        if (k < probs.shape[-1]).any() or (p < 1.0).any() or (mp > 0.0).any():
            sorted_p, order = probs.sort(dim=-1, descending=True)
            drop = (sorted_p.cumsum(dim=-1) - sorted_p) > p[:, None]  # mass before this token already >= top_p
            drop |= torch.arange(probs.shape[-1])[None, :] >= k[:, None]
            drop |= sorted_p < mp[:, None] * sorted_p[:, :1]
            ids[rows] = order.gather(1, torch.multinomial(sorted_p.masked_fill(drop, 0.0), 1)).squeeze(1)
        else:
            cdf = probs.cumsum(dim=-1)
            drawn = torch.searchsorted(cdf, torch.rand(len(cdf), 1) * cdf[:, -1:], right=True).squeeze(1)
            past = drawn >= probs.shape[-1]  # u rounded up to the total (p ~ 2^-24): the mode, never a p = 0 token
            drawn[past] = probs[past].argmax(dim=-1)
            ids[rows] = drawn
    return ids, logp.gather(1, ids[:, None]).squeeze(1)


# ------------------------------------------------------------------------------ the radix cache
def _common(a: list[int], b: list[int], start: int, limit: int) -> int:
    """How many leading tokens of `a` equal b[start:limit] (a binary search over list slices: C speed)."""
    lo, hi = 0, min(len(a), limit - start)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[start + lo : start + mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class _Node:
    __slots__ = ("ids", "kv", "children", "used")  # no parent link: a cycle would keep a dropped tree's

    def __init__(self, ids: list[int], kv: torch.Tensor | None):  # GBs until the cyclic collector ran
        self.ids, self.kv, self.children, self.used = ids, kv, {}, 0


class RadixCache:
    """Keys/values of sequences the engine computed, in a radix tree over token ids (SGLang's RadixAttention): a
    prompt that starts like an earlier sequence (an agent's next turn) copies that prefix instead of computing it.
    A node holds its edge's ids and keys/values [layers, 2, kv_heads, n, head_dim]. Least recently used leaves go
    beyond `max_tokens`, leaves a lookup took whole first (the batch holds them now). `clear()` on weight updates."""

    def __init__(self, max_tokens: int):
        self.max_tokens, self.tokens, self.clock = max_tokens, 0, 0
        self.root = _Node([], None)

    def lookup(self, ids: list[int]) -> tuple[int, list[torch.Tensor]]:
        """(n, segments): the longest cached prefix of `ids`, at most len(ids) - 1 tokens (the last prompt
        token must be computed for the next-token logits), as keys/values segments of n tokens in all."""
        node, n, segments, limit = self.root, 0, [], len(ids) - 1
        self.clock += 1
        while n < limit and (child := node.children.get(ids[n])) is not None:
            k = _common(child.ids, ids, n, limit)
            segments.append(child.kv[..., :k, :])
            n, node = n + k, child
            # a leaf taken whole is one sequence's context, copied into the batch that extends it: first to go
            child.used = 0 if k == len(child.ids) and not child.children else self.clock
            if k < len(child.ids):
                break
        return n, segments

    def insert(self, ids: list[int], kv_of: Callable[[int, int], torch.Tensor]) -> None:
        """Add `ids`; kv_of(a, b) gives the keys/values of ids[a:b] (asked only for what the tree lacks)."""
        node, n = self.root, 0
        self.clock += 1
        while n < len(ids):
            child = node.children.get(ids[n])
            if child is None:
                child = node.children[ids[n]] = _Node(ids[n:], kv_of(n, len(ids)))
                self.tokens += len(ids) - n
                k = len(ids) - n
            elif (k := _common(child.ids, ids, n, len(ids))) < len(child.ids):  # split the edge at k
                head = node.children[ids[n]] = _Node(child.ids[:k], child.kv[..., :k, :].clone())
                child.ids, child.kv = child.ids[k:], child.kv[..., k:, :].clone()
                head.children[child.ids[0]] = child
                child = head
            child.used, n, node = self.clock, n + k, child
        self._evict()

    def _evict(self) -> None:
        while self.tokens > self.max_tokens:  # the least recently used leaf goes (its parent may be a leaf next)
            nodes = [(self.root, None)]
            for node, _ in nodes:  # all of them with their parents, breadth first
                nodes.extend((child, node) for child in node.children.values())
            leaf, parent = min((pair for pair in nodes[1:] if not pair[0].children), key=lambda pair: pair[0].used)
            del parent.children[leaf.ids[0]]
            self.tokens -= len(leaf.ids)

    def clear(self) -> None:
        self.root.children.clear()
        self.tokens = 0
        trim_heap()


def trim_heap() -> None:
    """Give the heap's free pages back to the system (glibc keeps freed memory for reuse)."""
    with contextlib.suppress(AttributeError, OSError):  # not glibc
        ctypes.CDLL(None).malloc_trim(0)


# --------------------------------------------------------------------------- the running batch
class BatchKV(DynamicCache):
    """The batch's keys/values (module doc) as a forward's cache: `update` writes a layer's new ones at `cols` [B, T]
    of rows `first`.. and returns those rows' first `width` columns (the 4D mask hides what a token must not see).
    Not transformers' own cache layers: their API differs between 4.x and 5.x."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype):
        super().__init__()
        self.buf = [torch.zeros((2, 0, kv_heads, 0, head_dim), dtype=dtype) for _ in range(layers)]
        self.first, self.rows, self.cols, self.width = 0, None, None, 0

    def reserve(self, rows: int, cols: int, grow_cols: int, keep_rows: int, keep_cols: int, budget: int) -> None:
        """Room for `rows` x `cols` (`grow_cols` when the columns grow; the old rows while rows x columns
        stay within `budget` tokens: the old rows x new columns outgrew it 3x), keeping keep_rows x keep_cols;
        new space is zeros (masked keys must be finite). A layer at a time (two whole buffers at once)."""
        shape = list(self.buf[0].shape)
        if rows <= shape[1] and cols <= shape[3]:
            return
        shape[3] = max(cols, grow_cols, keep_cols)
        shape[1] = max(rows, shape[1]) if max(rows, shape[1]) * shape[3] <= budget else rows
        for i, old in enumerate(self.buf):
            self.buf[i] = torch.zeros(shape, dtype=old.dtype)
            self.buf[i][:, :keep_rows, :, :keep_cols] = old[:, :keep_rows, :, :keep_cols]
            del old

    def take(self, row: int, a: int, b: int) -> torch.Tensor:
        """A copy of `row`'s keys/values at columns a..b-1: [layers, 2, kv_heads, b - a, head_dim]."""
        return torch.stack([layer[:, row, :, a:b] for layer in self.buf])

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        buf = self.buf[layer_idx]
        buf[0][self.rows, :, self.cols] = key_states.transpose(1, 2)  # [B, T, kv_heads, head_dim]
        buf[1][self.rows, :, self.cols] = value_states.transpose(1, 2)
        rows = slice(self.first, self.first + len(self.cols))
        return buf[0, rows, :, : self.width], buf[1, rows, :, : self.width]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.width


GQA_ATTENTION = "l0_gqa_sdpa"


def gqa_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' "sdpa" attention with grouped-query heads left to the kernel (transformers repeats K/V to every
    query head when a mask is given: a copy of the cache per layer). A decode step folds the query heads of a K/V
    head into query rows of it: one call without `enable_gqa`, ~20% faster on CPU at 64 rows x 600 columns."""
    if is_causal is None:
        is_causal = query.shape[2] > 1 and attention_mask is None and getattr(module, "is_causal", True)
    sdpa, groups = torch.nn.functional.scaled_dot_product_attention, getattr(module, "num_key_value_groups", 1)
    b, heads, t, d = query.shape
    if t == 1 and groups > 1 and attention_mask is not None:
        out = sdpa(query.reshape(b, heads // groups, groups, d), key, value, attn_mask=attention_mask, scale=scaling)
        return out.reshape(b, 1, heads, d), None
    out = sdpa(query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, is_causal=is_causal,
               enable_gqa=groups > 1)
    return out.transpose(1, 2).contiguous(), None


# ----------------------------------------------------------------------------------- the engine
class Engine:
    def __init__(self, model, tokenizer, *, max_running: int = 128, max_total_tokens: int = 0,
                 prefill_chunk: int = 2048, prefix_cache_tokens: int = -1, context_length: int | None = None,
                 weight_version: str = "default"):
        """max_total_tokens (0) and prefix_cache_tokens (-1): by default, the tokens whose keys/values fill a
        sixteenth of the machine's memory each (SmolLM2-135M, fp32: 46 KB a token; 34k tokens on 24 GB)."""
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        AttentionInterface.register(GQA_ATTENTION, gqa_sdpa)
        AttentionMaskInterface.register(GQA_ATTENTION, sdpa_mask)  # for callers that pass a 2D mask
        model.set_attn_implementation(GQA_ATTENTION)
        self.model, self.tokenizer = model, tokenizer
        # the forward's cache argument: `cache` from transformers 5.24 (`past_key_values` goes in 5.40), before it the other
        self.cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        c = model.config
        self.kv_shape = (c.num_hidden_layers, getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
                         getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)
        per_token = 2 * math.prod(self.kv_shape) * next(model.parameters()).element_size()
        share = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 16 // per_token
        self.max_running, self.prefill_chunk, self.weight_version = max_running, prefill_chunk, weight_version
        self.max_total_tokens = max_total_tokens or share
        self.context_length = context_length or getattr(model.config, "max_position_embeddings", 1 << 30)
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.eos_ids: set[int] = set()
        for source in (getattr(model, "generation_config", None), model.config, tokenizer):
            eos = getattr(source, "eos_token_id", None)
            if isinstance(eos, (int, list, tuple)):
                self.eos_ids.update([eos] if isinstance(eos, int) else map(int, eos))
        self.prefix_cache = RadixCache(share if prefix_cache_tokens < 0 else prefix_cache_tokens)

        self.waiting: list[Sequence] = []  # submitted, not yet admitted
        self.prefilling: list[Sequence] = []  # admitted, prompt not fully computed yet
        self.running: list[Sequence] = []  # in the batch: running[r] is row r of self.kv
        self.kv: BatchKV | None = None  # released when the engine is idle (IDLE_SECONDS)
        self.steps = 0  # decode steps run (tests and stats)
        self.step_batch_sizes: list[int] = []  # batch size of the last decode steps (bounded)
        self.prefill_batch_sizes: list[int] = []  # prompts per prefill forward, last ones (bounded)

        self._inflight: dict[int, Sequence] = {}  # submitted and not yet notified, by id()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()  # functions the engine thread runs between steps
        self._thread: threading.Thread | None = None
        self._stopped = False
        self._idle = 0  # idle timeouts in a row

    # -- thread-safe API --------------------------------------------------------------------
    def start(self) -> "Engine":
        self._thread = threading.Thread(target=self._loop, name="l0_min-engine", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.call(lambda: setattr(self, "_stopped", True))
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, seq: Sequence) -> None:
        """Queue a request; `seq.on_done(seq)` is called from the engine thread when it finishes."""
        self.validate(seq)
        self.call(lambda: (self.waiting.append(seq), self._inflight.setdefault(id(seq), seq)))

    def validate(self, seq: Sequence) -> None:
        """Raise ValueError for a request the engine cannot run (called by submit; the server calls it
        first so it can answer 400 before queuing anything)."""
        n = len(seq.input_ids)
        if n == 0:
            raise ValueError("input_ids cannot be empty.")
        if bad := [t for t in seq.input_ids if not 0 <= t < self.vocab_size]:
            raise ValueError(f"input_ids: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        if n >= self.context_length:
            raise ValueError(f"The input ({n} tokens) is longer than the model's context length "
                             f"({self.context_length} tokens).")
        if n + 1 > self.max_total_tokens:
            raise ValueError(f"The input ({n} tokens) does not fit the server's max_total_tokens "
                             f"({self.max_total_tokens}).")

    def abort(self, rid: str | None = None) -> None:
        """Abort request `rid`, or all of them."""
        self.call(lambda: self._abort(rid))

    def call(self, fn: Callable[[], object]) -> Future:
        """Run fn() in the engine thread between two steps; the Future holds its result."""
        fut: Future = Future()

        def run():
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as e:  # handed to the caller
                    fut.set_exception(e)

        self._commands.put(run)
        return fut

    def num_requests(self) -> int:
        """Requests not finished yet (approximate when read from another thread)."""
        return len(self.waiting) + len(self.prefilling) + len(self.running)

    # -- engine thread ----------------------------------------------------------------------
    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while not self._stopped:
            self._drain_commands(block=not self.num_requests())
            if self._stopped:
                break
            try:
                with torch.inference_mode():
                    self._admit()
                    self._prefill()
                    if self.running:
                        self._decode()
            except Exception as e:  # a bug or out of memory: fail what is in flight, keep serving
                log.error("engine step failed:\n%s", traceback.format_exc())
                self.waiting, self.prefilling, self.running, self.kv = [], [], [], None
                self._fail_all({"type": "abort", "message": f"engine error: {e!r}", "status_code": 500})
        self._fail_all({"type": "abort", "message": "server is shutting down", "status_code": 503})

    def _fail_all(self, reason: dict) -> None:
        for seq in list(self._inflight.values()):
            seq.finish_reason = reason
            self._notify(seq)

    def _drain_commands(self, block: bool) -> None:
        while not self._stopped:
            try:
                self._commands.get(block=block, timeout=IDLE_SECONDS if block else None)()
                self._idle = 0
            except queue.Empty:
                if block:  # idle a while (a learner step?): the batch's memory goes back, then the cache's
                    self._idle, self.kv = self._idle + 1, None
                    (self.prefix_cache.clear if self._idle * IDLE_SECONDS >= PREFIX_IDLE_SECONDS else trim_heap)()
                return
            block = False

    def _abort(self, rid: str | None) -> None:
        hit = lambda seq: rid is None or seq.rid == rid  # noqa: E731
        reason = {"type": "abort", "message": f"Abort request {rid}" if rid else "Abort all requests"}
        aborted = [s for s in self.waiting + self.prefilling + self.running if hit(s)]
        self.waiting = [s for s in self.waiting if not hit(s)]
        self.prefilling = [s for s in self.prefilling if not hit(s)]
        self._drop_rows([r for r, s in enumerate(self.running) if hit(s)])
        for seq in aborted:
            self._finish(seq, reason)

    def _admit(self) -> None:
        """Waiting requests join while there are rows and keys/values room (module doc, step 2)."""
        admitted, room = self.running + self.prefilling, lambda s: min(len(s.input_ids) + s.params.max_new_tokens,
                                                                        self.context_length)
        longest = max(map(room, admitted), default=0)
        while self.waiting and len(admitted) < self.max_running:
            seq = self.waiting[0]
            if admitted and (len(admitted) + 1) * max(longest, room(seq)) > self.max_total_tokens:
                return
            self.waiting.pop(0)
            seq.weight_version, seq.prefix, seq.prefilled, seq.cached_tokens = self.weight_version, [], 0, 0
            if seq.params.max_new_tokens == 0:
                self._finish(seq, {"type": "length", "length": 0})
                continue
            admitted.append(seq)
            self.prefilling.append(seq)
            longest = max(longest, room(seq))

    def _prefill(self) -> None:
        """Up to prefill_chunk (padded) prompt tokens per turn, oldest requests first (see the module doc)."""
        budget = self.prefill_chunk
        while self.prefilling and budget > 0:
            for seq in self.prefilling:  # the longest cached prefix there is now
                n, segments = self.prefix_cache.lookup(seq.input_ids)
                if n > seq.prefilled:
                    seq.prefix, seq.prefilled, seq.cached_tokens = segments, n, n
            head, others = self.prefilling[0], self.prefilling[1:] if self.prefix_cache.max_tokens else []
            shared = min(max((_common(head.input_ids, s.input_ids, 0, len(s.input_ids)) for s in others), default=0),
                         len(head.input_ids) - 1) - head.prefilled  # shared with another, not computed yet
            if shared >= MIN_SHARED:
                budget -= self._prefill_rows([head], min(shared, budget))
            elif budget < min(self.prefill_chunk, len(head.input_ids) - head.prefilled):
                break  # what is left of the turn's budget would only cut a prompt into pieces
            else:
                budget -= self._prefill_rows(*self._group(budget))

    def _group(self, budget: int) -> tuple[list[Sequence], int]:
        """Prompts that fit one forward of at most `budget` tokens, padding included, with at most 25% of it
        padding, the longest rests first (similar lengths pad least); and T, the most tokens any of them
        computes (the rest of a longer one waits)."""
        group, width, total = [], 0, 0
        for seq in sorted(self.prefilling, key=lambda s: len(s.input_ids) - s.prefilled, reverse=True):
            t = min(len(seq.input_ids) - seq.prefilled, budget)
            padded = max(width, t) * (len(group) + 1)
            if group and (padded > budget or padded > 1.25 * (total + t)):
                break
            group, width, total = group + [seq], max(width, t), total + t
        return group, width

    def _prefill_rows(self, group: list[Sequence], width: int) -> int:
        """Compute up to `width` more prompt tokens of each of `group` in one forward, in the rows after the running
        ones, after copying in its prefix's keys/values; new tokens are left-padded, and the padding written after
        them is overwritten later. Returns the tokens computed, padding included."""
        first, lens = len(self.running), [min(len(s.input_ids) - s.prefilled, width) for s in group]
        start, new = torch.tensor([s.prefilled for s in group]), torch.tensor(lens)
        cols = start[:, None] + (torch.arange(width)[None, :] - (width - new)[:, None]) % width
        kv = self._reserve(first + len(group), int(cols.max()) + 1)
        for row, seq in enumerate(group, first):  # its prefix's keys/values (segments [layers, 2, ...]) first
            for i, layer in enumerate(kv.buf if seq.prefix else []):
                layer[:, row, :, : seq.prefilled] = torch.cat([segment[i] for segment in seq.prefix], dim=-2)
        ids = torch.tensor([[0] * (width - n) + q.input_ids[q.prefilled : q.prefilled + n]
                            for q, n in zip(group, lens)])
        logits = self._forward(ids, first, cols)
        self.prefill_batch_sizes = (self.prefill_batch_sizes + [len(group)])[-1000:]
        self.running += group  # rows first..; those whose prompt is not all in yet leave again below
        for row, (seq, n) in enumerate(zip(group, lens), first):
            seq.prefilled += n
            if seq.prefilled < len(seq.input_ids):  # a chunk of a long prompt, or a shared prefix: its keys/values
                seq.prefix = [kv.take(row, 0, seq.prefilled)]  # wait outside the batch
                if self.prefix_cache.max_tokens:
                    self.prefix_cache.insert(seq.input_ids[: seq.prefilled], lambda a, b: seq.prefix[0][..., a:b, :])
        if done := [g for g, seq in enumerate(group) if seq.prefilled == len(seq.input_ids)]:
            self._take_token(logits[done], [group[g] for g in done])
        gone = {id(group[g]) for g in done}
        self.prefilling = [s for s in self.prefilling if id(s) not in gone]
        for g in done:
            group[g].prefix = []
            if not group[g].finish_reason and group[g].cached_tokens < len(group[g].input_ids) // 2:
                self._to_cache(group[g], first + g)  # mostly computed here: shared now (a system prompt...)
        self._leave([first + g for g, seq in enumerate(group) if seq.finish_reason or g not in done])
        return width * len(group)

    def _reserve(self, rows: int, cols: int) -> BatchKV:
        """Room for `rows` x `cols`; growing: a row per admitted sequence, columns +25% +64 (<= the longest)."""
        admitted = self.running + self.prefilling
        longest = max(min(len(s.input_ids) + s.params.max_new_tokens, self.context_length) for s in admitted)
        if self.kv is None:
            self.kv = BatchKV(*self.kv_shape, next(self.model.parameters()).dtype)
        self.kv.reserve(max(rows, len(admitted)), cols, min(cols + cols // 4 + 64, longest), len(self.running),
                        max((s.kv_len for s in self.running), default=0), self.max_total_tokens)
        return self.kv

    def _forward(self, ids: torch.Tensor, first: int, cols: torch.Tensor) -> torch.Tensor:
        """A forward of `ids` [B, T] in rows first.. of the batch at positions (= columns) `cols` [B, T], each
        token seeing the columns up to its own; the logits of the last input column."""
        kv = self.kv
        kv.first, kv.cols, kv.width = first, cols, int(cols.max()) + 1
        kv.rows = torch.arange(first, first + len(cols))[:, None]
        mask = (torch.arange(kv.width)[None, None, :] <= cols[:, :, None])[:, None]  # [B, 1, T, width]
        out = self.model(input_ids=ids, position_ids=cols, attention_mask=mask, use_cache=True, logits_to_keep=1,
                         **{self.cache_arg: kv})
        return out.logits[:, -1, :]

    def _decode(self) -> None:
        batch, n = self.running, torch.tensor([s.kv_len for s in self.running])
        self._reserve(len(batch), int(n.max()) + 1)
        logits = self._forward(torch.tensor([[s.output_ids[-1]] for s in batch]), 0, n[:, None])
        self.steps += 1
        self.step_batch_sizes = (self.step_batch_sizes + [len(batch)])[-1000:]
        self._take_token(logits, batch)
        self._leave([r for r, s in enumerate(batch) if s.finish_reason is not None])

    def _leave(self, rows: list[int]) -> None:
        """Rows leave the batch; a finished sequence's keys/values go to the radix cache, then it is notified."""
        seqs = [self.running[r] for r in rows]
        for r, seq in zip(rows, seqs):
            if seq.finish_reason:
                self._to_cache(seq, r)
        self._drop_rows(rows)
        for seq in seqs:
            if seq.finish_reason:
                self._notify(seq)

    def _to_cache(self, seq: Sequence, row: int) -> None:
        """A finished sequence's keys/values (prompt + output but the last token) go to the radix cache."""
        if self.prefix_cache.max_tokens:
            kv = self.kv
            self.prefix_cache.insert((seq.input_ids + seq.output_ids)[: seq.kv_len], lambda a, b: kv.take(row, a, b))

    def _drop_rows(self, rows: list[int]) -> None:
        """Rows leave the batch; the last row moves into each gap (one row copied, not the batch)."""
        for r in sorted(rows, reverse=True):
            last = self.running.pop()
            if r < len(self.running):
                for layer in self.kv.buf:
                    layer[:, r, :, : last.kv_len] = layer[:, len(self.running), :, : last.kv_len]
                self.running[r] = last

    def _take_token(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """Sample one token for each of `seqs` (rows of logits), append it, and set finish_reason on those
        that are done (the caller notifies them once they are out of the batch)."""
        ps = [s.params for s in seqs]
        ids, lps = sample(logits, torch.tensor([p.temperature for p in ps]), torch.tensor([p.top_p for p in ps]),
                          torch.tensor([min(p.top_k, TOP_K_ALL) for p in ps]), torch.tensor([p.min_p for p in ps]),
                          torch.tensor([p.greedy for p in ps]))
        for seq, tok, lp in zip(seqs, ids.tolist(), lps.tolist()):
            seq.output_ids.append(tok)
            seq.logprobs.append(lp)
            seq.finish_reason = self._check_finished(seq)

    def _check_finished(self, seq: Sequence) -> dict | None:
        """SGLang's order: length, then stop token ids / EOS, then stop strings."""
        p, tok = seq.params, seq.output_ids[-1]
        if len(seq.output_ids) >= p.max_new_tokens:
            return {"type": "length", "length": p.max_new_tokens}
        if len(seq.input_ids) + len(seq.output_ids) >= self.context_length:
            return {"type": "length", "length": len(seq.output_ids)}
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_ids):
            return {"type": "stop", "matched": tok}
        if p.stop:
            # every token is at least one byte, a character at most four: this window covers any stop string
            window = 4 * max(len(s) for s in p.stop) + 2
            tail = self.tokenizer.decode(seq.output_ids[-window:], skip_special_tokens=False)
            return next(({"type": "stop", "matched": s} for s in p.stop if s in tail), None)
        return None

    def _finish(self, seq: Sequence, reason: dict) -> None:
        if seq.finish_reason is None:
            seq.finish_reason = reason
            self._notify(seq)

    def _notify(self, seq: Sequence) -> None:
        seq.prefix = []
        self._inflight.pop(id(seq), None)
        try:
            seq.on_done(seq)
        except Exception:
            log.error("on_done callback failed:\n%s", traceback.format_exc())

    # -- run in the engine thread through call() ----------------------------------------------
    def flush_cache(self) -> bool:
        """Drop the prefix cache; refused (False) while requests are in flight, as in SGLang."""
        if self.num_requests():
            return False
        self.prefix_cache.clear()
        return True

    def load_weights(self, folder: str, weight_version: str | None) -> None:
        """Copy the weights of an HF folder (safetensors) into the model in place; all tensors are
        checked before any is copied, so a bad folder leaves the model as it was."""
        if self.num_requests():
            raise RuntimeError("weights can only be updated while no request is running")
        state, own = load_safetensors_folder(folder), self.model.state_dict()
        present = {own[k].data_ptr() for k in state if k in own}  # a tied weight needs only one of its names
        problems = [f"{what} {names[:5]}" for what, names in [
            ("unexpected tensors", sorted(set(state) - set(own))),
            ("missing tensors", sorted(k for k in own if k not in state and own[k].data_ptr() not in present)),
            ("shape mismatch", [f"{k}: {tuple(t.shape)} != {tuple(own[k].shape)}"
                                for k, t in state.items() if k in own and t.shape != own[k].shape])] if names]
        if problems:
            raise RuntimeError(f"{folder}: does not fit the served model: " + "; ".join(problems))
        with torch.no_grad():
            for k, t in state.items():
                own[k].copy_(t)
        self.prefix_cache.clear()
        if weight_version is not None:
            self.weight_version = weight_version
