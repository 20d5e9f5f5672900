"""The batching engine of the embedded CPU server: continuous batching over a Hugging Face causal LM.

One background thread owns the model. Each turn of its loop:

    1. takes new requests, aborts and calls from a queue (thread-safe `submit`, `abort`, `call`);
    2. admits waiting requests while the running batch has room (`max_running`, `max_total_tokens`),
       reusing the KV of a cached prefix if a finished sequence shares one (`PrefixCache`);
    3. prefills admitted prompts, at most `prefill_chunk` tokens per turn, each in its own KV cache, and
       samples their first token;
    4. merges the newly prefilled sequences into the running batch (left-padded KV cache), and
    5. runs one decode step for the whole batch: every running sequence gets one token.

So a request that arrives while others decode joins them at the next step instead of waiting for the
batch to drain. Sequences leave the batch as soon as they finish (length, EOS, stop token id, stop
string) or are aborted; the cache is then compacted (rows dropped, common left padding trimmed).

Layout of the running batch: the KV cache is a transformers `DynamicCache` whose tensors are
[batch, kv_heads, L, head_dim]; row r holds its `n_r` tokens right-aligned in the last `n_r` of
the L columns (left padding, zeros). A decode step feeds each row's last sampled token at position
`n_r` with an attention mask that hides the padding.

Log-probs, as SGLang's default: the returned log-prob of a sampled token is
`log_softmax(logits / temperature)[token]` in fp32, before top-p / top-k / min-p renormalisation;
greedy requests get `log_softmax(logits)`. The learner computes the same (logits / T).
"""

from __future__ import annotations

import logging
import queue
import threading
import traceback
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from l0_min.models import load_safetensors_folder

log = logging.getLogger("l0_min.engine")

TOP_K_ALL = 1 << 30
GREEDY_EPS = 1e-6  # temperatures below this are greedy (as in SGLang)


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
    prefix_version: int = -1  # PrefixCache.version when this prompt last looked up a prefix
    weight_version: str = ""
    # engine-private: the sequence's own KV cache while it is being prefilled, and how far it got
    cache: DynamicCache | None = None
    prefilled: int = 0

    @property
    def kv_len(self) -> int:
        """Tokens whose keys/values are in the cache once the sequence runs: all but the last sampled one."""
        return len(self.input_ids) + len(self.output_ids) - 1


class EngineError(RuntimeError):
    pass


# ------------------------------------------------------------------------------------- sampling


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor,
           min_p: torch.Tensor, greedy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of `logits` [B, V]; return (token ids [B], their log-probs [B]).

    Greedy rows take the argmax. Other rows sample from softmax(logits / temperature) restricted to
    the top_k most likely tokens, the smallest set whose mass reaches top_p, and tokens with at least
    min_p times the top probability. The log-prob is that of softmax(logits / temperature) (see module doc).
    """
    logits = logits.float()
    logp = torch.log_softmax(logits, dim=-1)
    ids = torch.empty(logits.shape[0], dtype=torch.long)
    if greedy.any():
        ids[greedy] = logits[greedy].argmax(dim=-1)
    rows = ~greedy
    if rows.any():
        scaled = logits[rows] / temperature[rows, None]
        probs = torch.softmax(scaled, dim=-1)
        k, p, mp = top_k[rows], top_p[rows], min_p[rows]
        if (k < probs.shape[-1]).any() or (p < 1.0).any() or (mp > 0.0).any():
            sorted_p, order = probs.sort(dim=-1, descending=True)
            drop = (sorted_p.cumsum(dim=-1) - sorted_p) > p[:, None]  # mass before this token already >= top_p
            drop |= torch.arange(probs.shape[-1])[None, :] >= k[:, None]
            drop |= sorted_p < mp[:, None] * sorted_p[:, :1]
            ids[rows] = order.gather(1, torch.multinomial(sorted_p.masked_fill(drop, 0.0), 1)).squeeze(1)
        else:
            ids[rows] = torch.multinomial(probs, 1).squeeze(1)
        logp[rows] = torch.log_softmax(scaled, dim=-1)
    return ids, logp.gather(1, ids[:, None]).squeeze(1)


# --------- KV cache helpers: a DynamicCache is a list of layers with .keys/.values [B, H, L, D]


class GrowingLayer(DynamicLayer):
    """A KV cache layer that appends in place: `keys`/`values` are views of the first n columns of
    buffers with spare columns, so a decode step writes one column instead of copying the whole cache
    (DynamicLayer's torch.cat: 43% of a decode step's CPU time at batch 20 x 900 tokens).

    Tensors handed in (a prefix-cache entry, a merged or selected cache) are never written: the first
    update moves them into a new buffer with room to grow (len + len/4 + 64 columns).
    """

    def wrap(self, k: torch.Tensor, v: torch.Tensor) -> "GrowingLayer":
        self.lazy_initialization(k)
        self.keys, self.values = k, v
        self._kbuf = self._vbuf = None  # not ours: copy before the first write
        return self

    def update(self, key_states, value_states, cache_kwargs=None):
        if not self.is_initialized:
            self.wrap(key_states[..., :0, :], value_states[..., :0, :])
        n, new = self.keys.shape[-2], key_states.shape[-2]
        if self._kbuf is None or n + new > self._kbuf.shape[-2]:
            b, h, _, d = key_states.shape
            cap = n + new + (n + new) // 4 + 64
            self._kbuf, self._vbuf = key_states.new_empty(b, h, cap, d), value_states.new_empty(b, h, cap, d)
            self._kbuf[..., :n, :], self._vbuf[..., :n, :] = self.keys, self.values
        self._kbuf[..., n : n + new, :] = key_states
        self._vbuf[..., n : n + new, :] = value_states
        self.keys, self.values = self._kbuf[..., : n + new, :], self._vbuf[..., : n + new, :]
        return self.keys, self.values


GQA_ATTENTION = "l0_gqa_sdpa"


def gqa_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' "sdpa" attention, but grouped-query heads are left to the kernel (`enable_gqa`)
    also when there is a padding mask. transformers repeats K/V to every query head whenever a mask
    is given (CUDA falls back to its math kernel otherwise); on CPU that copy of the whole cache was
    60% of a decode step of a left-padded batch (batch 20 x 900 tokens: 1.09 s -> 0.32 s per step)."""
    if attention_mask is not None and attention_mask.ndim == 4:
        attention_mask = attention_mask[:, :, :, : key.shape[-2]]
    if is_causal is None:
        is_causal = query.shape[2] > 1 and attention_mask is None and getattr(module, "is_causal", True)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, is_causal=is_causal,
        enable_gqa=getattr(module, "num_key_value_groups", 1) > 1)
    return out.transpose(1, 2).contiguous(), None


def _cache_from(kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> DynamicCache:
    """A cache of GrowingLayers holding these tensors as they are (from_legacy_cache would copy them);
    without tensors, an empty one whose layers are GrowingLayers."""
    cache = DynamicCache()
    cache.layer_class_to_replicate = GrowingLayer
    cache.layers.extend(GrowingLayer().wrap(k, v) for k, v in kv or [])
    return cache


def _kv(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


def _merge(a: DynamicCache | None, b: DynamicCache) -> DynamicCache:
    """Stack two left-padded caches (rows of `a`, then rows of `b`) into one, padded to the longer."""
    if a is None:
        return b
    la, lb = a.get_seq_length(), b.get_seq_length()
    total, layers = max(la, lb), []
    for (ka, va), (kb, vb) in zip(_kv(a), _kv(b)):
        rows, heads, _, dim = ka.shape
        shape = (rows + kb.shape[0], heads, total, dim)
        k, v = ka.new_zeros(shape), va.new_zeros(shape)
        k[:rows, :, total - la :], v[:rows, :, total - la :] = ka, va
        k[rows:, :, total - lb :], v[rows:, :, total - lb :] = kb, vb
        layers.append((k, v))
    return _cache_from(layers)


def _select(cache: DynamicCache, keep: list[int], longest: int) -> DynamicCache:
    """Keep rows `keep` and only the last `longest` columns (the left padding common to all of them goes)."""
    idx, start = torch.tensor(keep, dtype=torch.long), cache.get_seq_length() - longest
    return _cache_from([(k[idx, :, start:], v[idx, :, start:]) for k, v in _kv(cache)])


def _row(cache: DynamicCache, r: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Row r's last n positions as single-row tensors (a copy)."""
    return [(k[r : r + 1, :, -n:].clone(), v[r : r + 1, :, -n:].clone()) for k, v in _kv(cache)]


class PrefixCache:
    """The KV of recently finished sequences, so a prompt that extends one of them (an agent's next turn:
    previous context + action + observation) only prefills the new part. Least recently used entries are
    dropped beyond `max_tokens`. Entries are for the current weights only: `clear()` on weight updates."""

    def __init__(self, max_tokens: int):
        self.max_tokens, self.tokens, self._next = max_tokens, 0, 0
        self.entries: OrderedDict[int, tuple[torch.Tensor, list]] = OrderedDict()
        self.version = 0  # bumped by every insert, so waiting prompts know when to look again

    def insert(self, ids: list[int], kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if len(ids) > self.max_tokens or len(ids) < 2:
            return
        self.entries[self._next] = (torch.tensor(ids, dtype=torch.long), kv)
        self._next, self.version, self.tokens = self._next + 1, self.version + 1, self.tokens + len(ids)
        while self.tokens > self.max_tokens:
            _, (old, _) = self.entries.popitem(last=False)
            self.tokens -= len(old)

    def lookup(self, ids: list[int]) -> tuple[int, list | None]:
        """(n, kv): the longest cached prefix of `ids`, at most len(ids) - 1 tokens (the last prompt token
        must be computed to get the next-token logits), or (0, None)."""
        if not self.entries or len(ids) < 2:
            return 0, None
        query = torch.tensor(ids[:-1], dtype=torch.long)
        best, best_key = 0, None
        for key, (cached, _) in self.entries.items():
            n = min(len(cached), len(query))
            diff = (cached[:n] != query[:n]).nonzero()
            if (common := int(diff[0]) if len(diff) else n) > best:
                best, best_key = common, key
        if best_key is None:
            return 0, None
        self.entries.move_to_end(best_key)
        return best, [(k[:, :, :best], v[:, :, :best]) for k, v in self.entries[best_key][1]]

    def clear(self) -> None:
        self.entries.clear()
        self.tokens = 0
        self.version += 1


# ----------------------------------------------------------------------------------- the engine


class Engine:
    def __init__(self, model, tokenizer, *, max_running: int = 128, max_total_tokens: int = 1 << 18,
                 prefill_chunk: int = 2048, prefix_cache_tokens: int = 1 << 16, context_length: int | None = None,
                 weight_version: str = "default"):
        if getattr(model.config, "_attn_implementation", None) == "sdpa":
            from transformers import AttentionInterface
            from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

            AttentionInterface.register(GQA_ATTENTION, gqa_sdpa)
            AttentionMaskInterface.register(GQA_ATTENTION, sdpa_mask)  # else the raw 2D mask is passed in
            model.set_attn_implementation(GQA_ATTENTION)
        self.model, self.tokenizer = model, tokenizer
        self.max_running, self.max_total_tokens, self.prefill_chunk = max_running, max_total_tokens, prefill_chunk
        self.weight_version = weight_version
        self.context_length = context_length or getattr(model.config, "max_position_embeddings", 1 << 30)
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.eos_ids: set[int] = set()
        for source in (getattr(model, "generation_config", None), model.config, tokenizer):
            eos = getattr(source, "eos_token_id", None)
            if isinstance(eos, (int, list, tuple)):
                self.eos_ids.update([eos] if isinstance(eos, int) else map(int, eos))
        self.prefix_cache = PrefixCache(prefix_cache_tokens)

        self.waiting: list[Sequence] = []  # submitted, not yet admitted
        self.prefilling: list[Sequence] = []  # admitted, prompt not fully in their own cache yet
        self.running: list[Sequence] = []  # in the batch, aligned with the rows of self.cache
        self.cache: DynamicCache | None = None
        self.steps = 0  # decode steps run (tests and stats)
        self.step_batch_sizes: list[int] = []  # batch size of the last decode steps (bounded)
        self.prefill_batch_sizes: list[int] = []  # prompts per prefill forward, last ones (bounded)

        self._inflight: dict[int, Sequence] = {}  # submitted and not yet notified, by id()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()  # functions the engine thread runs between steps
        self._thread: threading.Thread | None = None
        self._stopped = False

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

        def enqueue():
            self.waiting.append(seq)
            self._inflight[id(seq)] = seq

        self.call(enqueue)

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

    def abort(self, rid: str) -> None:
        self.call(lambda: self._abort(rid))

    def abort_all(self) -> None:
        self.call(lambda: self._abort(None))

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
                self.waiting, self.prefilling, self.running, self.cache = [], [], [], None
                self._fail_all({"type": "abort", "message": f"engine error: {e!r}", "status_code": 500})
        self._fail_all({"type": "abort", "message": "server is shutting down", "status_code": 503})

    def _fail_all(self, reason: dict) -> None:
        for seq in list(self._inflight.values()):
            seq.finish_reason = reason
            self._notify(seq)

    def _drain_commands(self, block: bool) -> None:
        while not self._stopped:
            try:
                self._commands.get(block=block)()
            except queue.Empty:
                return
            block = False

    def _abort(self, rid: str | None) -> None:
        def hit(seq: Sequence) -> bool:
            return rid is None or seq.rid == rid

        reason = {"type": "abort", "message": f"Abort request {rid}" if rid else "Abort all requests"}
        aborted = [s for s in self.waiting + self.prefilling + self.running if hit(s)]
        self.waiting = [s for s in self.waiting if not hit(s)]
        self.prefilling = [s for s in self.prefilling if not hit(s)]
        if gone := {r for r, s in enumerate(self.running) if hit(s)}:
            self._drop_rows(gone, keep_prefix=False)
        for seq in aborted:
            self._finish(seq, reason)

    def _admit(self) -> None:
        while self.waiting and len(self.running) + len(self.prefilling) < self.max_running:
            seq = self.waiting[0]
            budget = sum(len(s.input_ids) + s.params.max_new_tokens for s in self.running + self.prefilling)
            if budget and budget + len(seq.input_ids) + seq.params.max_new_tokens > self.max_total_tokens:
                return
            self.waiting.pop(0)
            seq.weight_version = self.weight_version
            seq.cache, seq.prefilled, seq.cached_tokens = None, 0, 0  # prefix looked up when its prefill starts
            self.prefilling.append(seq)

    def _lookup_prefixes(self) -> None:
        """Give each admitted prompt whose prefill has not started the longest cached prefix there is
        now. Looking up here rather than at admission lets a burst of agents that share a system prompt
        reuse the first one's KV once it is prefilled (see `_prompts_done`)."""
        version = self.prefix_cache.version
        for seq in self.prefilling:
            if seq.prefilled != seq.cached_tokens or seq.prefix_version == version:
                continue  # its prefill has started, or the cache has not changed since it looked
            seq.prefix_version = version
            n, kv = self.prefix_cache.lookup(seq.input_ids)
            if seq.cache is None or n > seq.cached_tokens:
                # no copy needed: a GrowingLayer copies tensors it did not allocate before writing
                seq.cache, seq.prefilled, seq.cached_tokens = _cache_from(kv), n, n

    def _prefill(self) -> None:
        """Up to prefill_chunk prompt tokens per turn, oldest requests first. Fresh prompts of similar
        length are prefilled together in one left-padded forward; a long prompt goes in chunks, in its
        own cache. A prompt that is done samples its first token and joins the running batch."""
        budget = self.prefill_chunk
        while self.prefilling and budget > 0:
            self._lookup_prefixes()
            group, head = self._fresh_group(budget), self.prefilling[0]
            if len(group) > 1:
                budget -= self._prefill_group(group)
            elif budget < self.prefill_chunk and head.prefilled == 0 and len(head.input_ids) > budget:
                break  # a fresh prompt that does not fit what is left waits for a whole turn
            else:
                budget -= self._prefill_chunk(head, budget)

    def _fresh_group(self, budget: int) -> list[Sequence]:
        """The leading prefilling sequences without a cached prefix that fit one padded forward of at most
        `budget` tokens, with at most 25% of it padding."""
        group: list[Sequence] = []
        for seq in self.prefilling:
            candidate = group + [seq]
            padded = max(len(s.input_ids) for s in candidate) * len(candidate)
            if seq.prefilled or padded > budget or padded > 1.25 * sum(len(s.input_ids) for s in candidate):
                break
            group = candidate
        return group

    def _forward(self, ids, cache, start: int, **kw):
        """A model forward of `ids` [B, T] at cache positions start..start+T-1; logits of the last one only."""
        return self.model(input_ids=ids, cache_position=torch.arange(start, start + ids.shape[1]),
                          past_key_values=cache, use_cache=True, logits_to_keep=1, **kw)

    def _prefill_group(self, group: list[Sequence]) -> int:
        lens = torch.tensor([len(s.input_ids) for s in group])
        length, pad = int(lens.max()), int(lens.max()) - lens
        ids = torch.tensor([[0] * int(p) + s.input_ids for p, s in zip(pad, group)], dtype=torch.long)
        cols = torch.arange(length)[None, :]
        out = self._forward(ids, _cache_from(), 0, attention_mask=(cols >= pad[:, None]).long(),
                            position_ids=(cols - pad[:, None]).clamp(min=0))
        for k, v in _kv(out.past_key_values):  # padding keys/values: zeros, never garbage (or NaN)
            for r, p in enumerate(pad.tolist()):
                k[r, :, :p] = v[r, :, :p] = 0
        del self.prefilling[: len(group)]
        self.prefill_batch_sizes = (self.prefill_batch_sizes + [len(group)])[-1000:]
        for seq in group:
            seq.prefilled = len(seq.input_ids)
        self._prompts_done(group, out.logits[:, -1, :], out.past_key_values)
        return length * len(group)

    def _prefill_chunk(self, seq: Sequence, budget: int) -> int:
        start, end = seq.prefilled, min(len(seq.input_ids), seq.prefilled + budget)
        out = self._forward(torch.tensor([seq.input_ids[start:end]], dtype=torch.long), seq.cache, start,
                            position_ids=torch.arange(start, end)[None, :])
        seq.cache, seq.prefilled = out.past_key_values, end
        self.prefill_batch_sizes = (self.prefill_batch_sizes + [1])[-1000:]
        if end == len(seq.input_ids):
            self.prefilling.pop(0)
            self._prompts_done([seq], out.logits[:, -1, :], seq.cache)
        return end - start

    def _prompts_done(self, seqs: list[Sequence], logits: torch.Tensor, cache: DynamicCache) -> None:
        """The prompts of `seqs` (rows of the left-padded `cache`) are in: sample each one's first token;
        the unfinished join the running batch."""
        for seq in seqs:
            seq.cache = None
            if seq.params.max_new_tokens == 0:
                self._finish(seq, {"type": "length", "length": 0})
        live = [r for r, s in enumerate(seqs) if s.finish_reason is None]
        if live:
            self._take_token(logits[live], [seqs[r] for r in live])
        for r in live:
            seq = seqs[r]
            # a finished prompt's KV is shared; so is a prompt mostly computed from scratch (a system
            # prompt that many agents start with) right now, not only when its sequence finishes
            if self.prefix_cache.max_tokens and (seq.finish_reason or seq.cached_tokens < len(seq.input_ids) // 2):
                self.prefix_cache.insert(seq.input_ids, _row(cache, r, len(seq.input_ids)))
            if seq.finish_reason:
                self._notify(seq)
        if joined := [r for r in live if seqs[r].finish_reason is None]:
            new = _select(cache, joined, max(len(seqs[r].input_ids) for r in joined))
            self.cache = _merge(self.cache, new)
            self.running.extend(seqs[r] for r in joined)

    def _decode(self) -> None:
        batch, length = self.running, self.cache.get_seq_length()
        n = torch.tensor([s.kv_len for s in batch], dtype=torch.long)
        out = self._forward(torch.tensor([[s.output_ids[-1]] for s in batch], dtype=torch.long), self.cache, length,
                            attention_mask=(torch.arange(length + 1)[None, :] >= (length - n)[:, None]).long(),
                            position_ids=n[:, None])
        self.cache = out.past_key_values
        self.steps += 1
        self.step_batch_sizes = (self.step_batch_sizes + [len(batch)])[-1000:]
        self._take_token(out.logits[:, -1, :], batch)
        if done := {r for r, s in enumerate(batch) if s.finish_reason is not None}:
            self._drop_rows(done, keep_prefix=True)
            for r in sorted(done):
                self._notify(batch[r])

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

    def _drop_rows(self, rows: set[int], keep_prefix: bool) -> None:
        if keep_prefix and self.prefix_cache.max_tokens > 0:
            length = self.cache.get_seq_length()
            for r in sorted(rows):
                seq, n = self.running[r], min(self.running[r].kv_len, length)
                self.prefix_cache.insert((seq.input_ids + seq.output_ids)[:n], _row(self.cache, r, n))
        keep = [r for r in range(len(self.running)) if r not in rows]
        self.cache = _select(self.cache, keep, max(self.running[r].kv_len for r in keep)) if keep else None
        self.running = [self.running[r] for r in keep]

    def _finish(self, seq: Sequence, reason: dict) -> None:
        if seq.finish_reason is None:
            seq.finish_reason = reason
            self._notify(seq)

    def _notify(self, seq: Sequence) -> None:
        seq.cache = None
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

    def load_weights(self, folder: str, weight_version: str | None) -> str:
        """Copy the weights of an HF folder (safetensors) into the model in place; all tensors are
        checked before any is copied, so a bad folder leaves the model as it was."""
        if self.num_requests():
            raise EngineError("weights can only be updated while no request is running")
        state, own = load_safetensors_folder(folder), self.model.state_dict()
        present = {own[k].data_ptr() for k in state if k in own}  # a tied weight needs only one of its names
        problems = [f"{what} {names[:5]}" for what, names in [
            ("unexpected tensors", sorted(set(state) - set(own))),
            ("missing tensors", sorted(k for k in own if k not in state and own[k].data_ptr() not in present)),
            ("shape mismatch", [f"{k}: {tuple(t.shape)} != {tuple(own[k].shape)}"
                                for k, t in state.items() if k in own and t.shape != own[k].shape])] if names]
        if problems:
            raise EngineError(f"{folder}: does not fit the served model: " + "; ".join(problems))
        with torch.no_grad():
            for k, t in state.items():
                own[k].copy_(t)
        self.prefix_cache.clear()
        if weight_version is not None:
            self.weight_version = weight_version
        return self.weight_version
