"""The embedded inference server: throughput vs in-process generation, the client's overhead, and the demo's
workload against the machine's compute limit.

    python bench/inference.py                 # all parts (SmolLM2-135M)
    python bench/inference.py --parts limit   # only part 3
    python bench/inference.py --quick         # smaller: 8 new tokens at 1 and 32; 32 agents x 2 turns x 32

1. Throughput. For each batch size B, the same chat prompt B times, B x N new tokens, sampled at
   temperature 1 with EOS ignored so every sequence has exactly N tokens:
     - in-process: one `model.generate` call on the batch (HF's own batched generation, KV cache);
     - server: B concurrent `InferenceClient.generate` calls to `python -m l0_min.serve` (a subprocess,
       same model, same torch threads), over HTTP, through continuous batching.
   Tokens/s of each and their ratio. The two alternate per batch size (in-process, server, in-process,
   server, ...) and each keeps its best of `--rounds`, so load from other processes on a shared machine
   hits both alike. The server's prefix cache is off: it would skip the repeated prompt.
2. Client overhead. Sequential requests to a canned SGLang endpoint (in this process, answering a
   512-token response) through `InferenceClient.generate` and through a bare `aiohttp` POST + json();
   the difference is what the client adds per request (routing, retry wrapper, parsing).
3. The compute limit. The demo evaluation's shape: 64 agents at once, the demo's system prompt, 3 turns
   of 50 sampled tokens, each turn's prompt the previous one + its output + an observation of ~70
   tokens; through the server's HTTP app and engine (in this process, so forward hooks can time the
   model). The arithmetic it needs: 2 x non-embedding params per token an ideal prefix cache computes
   (each distinct prefix once: the nodes of the token trie of all the agents' sequences), + 2 x hidden x
   vocab (the LM head) per sampled token, + attention: 4 x query heads x head_dim x layers FLOPs per key
   column a computed token reads. The limit: that arithmetic at the speed plain fp32 matmuls of the
   model's shapes reach in the same run, same threads (decode shapes at 64 rows, prefill shapes at 512,
   the LM head at 64; the best of 3 probes before and 3 after the workload: what the cores do when
   nothing else runs, so other load lowers the ratio, never raises it), except decode attention, which
   is memory-bound (1.5 FLOPs per byte of fp32 keys/values): its floor is the bytes it reads at the speed
   a 1 GB sum reaches. The weights' matmuls alone (the first estimate, issue 25) are printed too.
   Printed per phase (prefill forwards, decode forwards, the LM head inside them, and the host:
   everything outside the model's forwards), and the same ratio in CPU seconds, which other load on a
   shared machine changes less (with --threads 1 it counts no OpenMP spinning).

Last lines: RESULT server_vs_inprocess_at_32=<ratio> target >= 0.8 MET|SHORT
            RESULT generation_vs_compute_limit=<seconds at the limit / seconds taken> target >= 0.5 MET|SHORT
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import resource
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402
from aiohttp import web  # noqa: E402

from l0_min.config import InferenceConfig  # noqa: E402
from l0_min.inference import InferenceClient  # noqa: E402
from l0_min.models import load_model  # noqa: E402
from l0_min.serve.server import start_server_process, stop_server_process  # noqa: E402

TARGET = 0.8
LIMIT_TARGET = 0.5


def inprocess_tps(model, prompt: list[int], batch: int, new_tokens: int, pad_id: int) -> float:
    x = torch.tensor([prompt] * batch)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=pad_id)
    dt = time.perf_counter() - t0
    assert out.shape == (batch, len(prompt) + new_tokens), out.shape
    return batch * new_tokens / dt


async def server_tps(client: InferenceClient, prompt: list[int], batch: int, new_tokens: int) -> float:
    sampling = {"max_new_tokens": new_tokens, "temperature": 1.0, "ignore_eos": True}
    t0 = time.perf_counter()
    gens = await asyncio.gather(*(client.generate(prompt, sampling) for _ in range(batch)))
    dt = time.perf_counter() - t0
    assert all(len(g.output_ids) == new_tokens for g in gens)
    return batch * new_tokens / dt


async def client_overhead(requests: int) -> tuple[float, float]:
    """(bare aiohttp seconds per request, InferenceClient seconds per request) against a canned endpoint."""
    n = 512
    canned = {"text": "x" * n, "output_ids": list(range(n)), "meta_info": {
        "id": "bench", "finish_reason": {"type": "length", "length": n}, "prompt_tokens": 1000, "weight_version": "0",
        "input_token_logprobs": [], "output_token_logprobs": [[-0.5, i, None] for i in range(n)],
        "completion_tokens": n, "cached_tokens": 0, "e2e_latency": 0.0}}

    async def generate(request):
        await request.read()
        return web.json_response(canned)

    app = web.Application()
    app.router.add_post("/generate", generate)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    prompt = list(range(1000))
    payload = {"input_ids": prompt, "sampling_params": {"max_new_tokens": n, "no_stop_trim": True, "skip_special_tokens": False},
               "return_logprob": True}
    bare_times, client_times = [], []
    async with aiohttp.ClientSession() as session, InferenceClient([url], InferenceConfig()) as client:
        for i in range(requests):  # interleaved, after a warm-up round
            t0 = time.perf_counter()
            async with session.post(url + "/generate", json=payload) as r:
                await r.json()
            t1 = time.perf_counter()
            await client.generate(prompt, {"max_new_tokens": n})
            t2 = time.perf_counter()
            if i >= 10:
                bare_times.append(t1 - t0)
                client_times.append(t2 - t1)
    await runner.cleanup()
    median = lambda xs: sorted(xs)[len(xs) // 2]
    return median(bare_times), median(client_times)


# ------------------------------------------------------------------ the demo's workload vs the compute limit

PREFILL_ROWS = 512  # rows of the prefill-shape matmuls (a prefill forward of a few prompts' new tokens)


def linear_shapes(config) -> list[tuple[int, int]]:
    """(in, out) of one decoder layer's matmuls (a Llama-style layer: q, k, v, o, gate, up, down)."""
    h, inter = config.hidden_size, config.intermediate_size
    hd = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    return [(h, q), (h, kv), (h, kv), (q, h), (h, inter), (h, inter), (inter, h)]


def matmul_gflops(shapes: list[tuple[int, int]], rows: int, seconds: float = 1.0) -> tuple[float, float]:
    """GFLOPS of plain fp32 `x @ W.T` over these (in, out) shapes at `rows` rows (torch's threads), per second
    of wall time and per second of this process's CPU time."""
    xs = [(torch.randn(rows, i), torch.randn(o, i)) for i, o in shapes]
    flops = sum(2 * rows * i * o for i, o in shapes)
    run = lambda: [torch.nn.functional.linear(x, w) for x, w in xs]  # noqa: E731
    run()
    reps, t0, c0 = 0, time.perf_counter(), time.process_time()
    while (dt := time.perf_counter() - t0) < seconds or reps < 3:
        run()
        reps += 1
    return flops * reps / dt / 1e9, flops * reps / (time.process_time() - c0) / 1e9


def read_gbps(gb: float = 1.0) -> float:
    """GB/s of summing a fresh fp32 buffer of `gb` GB (larger than the caches: what reading keys/values costs),
    torch's threads, the best of 3."""
    x = torch.ones(int(gb * 2**30) // 4)
    best = 0.0
    for _ in range(3):
        t0 = time.perf_counter()
        x.sum()
        best = max(best, x.numel() * 4 / 1e9 / (time.perf_counter() - t0))
    return best


def rss_gb() -> tuple[float, float]:
    """This process's resident memory now and at its peak, GB."""
    with open("/proc/self/statm") as f:
        now = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30
    return now, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


class ModelTimer:
    """Seconds (wall, and CPU of the thread that runs the model) and rows of the model's forwards (a decode
    forward feeds one token per row) and of its LM head, through forward hooks: the engine is not touched."""

    def __init__(self, model):
        self.seconds = {"prefill": 0.0, "decode": 0.0, "lm_head": 0.0}
        self.cpu, self.rows, self.calls, self._t = dict(self.seconds), dict.fromkeys(self.seconds, 0), {}, {}
        self.calls = dict.fromkeys(self.seconds, 0)
        head = model.get_output_embeddings()
        self.hooks = [model.register_forward_pre_hook(self._start, with_kwargs=True),
                      model.register_forward_hook(self._stop, with_kwargs=True),
                      head.register_forward_pre_hook(lambda m, args: self._t.update(head=self._now())),
                      head.register_forward_hook(lambda m, args, out: self._add("lm_head", "head", out.shape[:-1].numel()))]

    @staticmethod
    def _now() -> tuple[float, float]:
        return time.perf_counter(), time.thread_time()

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()

    def _start(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        self._t["kind"], self._t["rows"] = ("decode" if ids.shape[1] == 1 else "prefill"), ids.numel()
        self._t["model"] = self._now()

    def _stop(self, module, args, kwargs, out):
        self._add(self._t["kind"], "model", self._t["rows"])

    def _add(self, kind: str, key: str, rows: int):
        (wall, cpu), (wall0, cpu0) = self._now(), self._t[key]
        self.seconds[kind] += wall - wall0
        self.cpu[kind] += cpu - cpu0
        self.rows[kind] += rows
        self.calls[kind] += 1


def agent_prompts(tok, system: str, i: int):
    """Agent i's first prompt and the observation after each turn (a page of ~60 tokens), as the demo's
    context builds them: ChatML, every assistant turn opened with <think>."""
    rng = random.Random(i)
    words = ["river", "museum", "founded", "population", "northern", "engineer", "council", "treaty", "village",
             "station", "festival", "author", "harbour", "bridge", "census", "district", "painter", "college"]
    name = " ".join(rng.choice(["Bripi", "Laele", "Ostra", "Quen", "Varo", "Tamsin", "Ilke"]) for _ in range(2))
    question = f"Task: In which year was {name} founded, according to the encyclopedia?\nYou have 3 steps."
    first = tok.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": question}],
                                    add_generation_prompt=True, return_dict=False) + tok.encode("<think>")

    def observation(turn: int) -> list[int]:
        page = f"{name}: " + " ".join(rng.choice(words) for _ in range(40)) + f". Founded in {1700 + i}."
        return tok.encode(f"<|im_end|>\n<|im_start|>user\n<output>\n{page}\n</output>\n"
                          f"[{2 - turn} steps left]<|im_end|>\n<|im_start|>assistant\n<think>")

    return first, observation


def unique_tokens(sequences: list[list[int]]) -> tuple[int, int]:
    """Nodes of the token trie of these sequences (the tokens an ideal prefix cache computes once), and the sum
    of their depths (the key columns those tokens' attention reads: a token sees itself and all before it)."""
    root, nodes, columns = {}, 0, 0
    for seq in sequences:
        node = root
        for depth, t in enumerate(seq, 1):
            if t not in node:
                node[t], nodes, columns = {}, nodes + 1, columns + depth
            node = node[t]
    return nodes, columns


async def demo_workload(client, tok, system: str, agents: int, turns: int, new_tokens: int):
    """`agents` episodes at once, each `turns` requests of `new_tokens` sampled tokens (T = 1, EOS ignored);
    a turn's prompt is the previous prompt + its output + an observation. Returns each agent's
    [(prompt, Generation)] per turn."""
    async def agent(i):
        ids, observation = agent_prompts(tok, system, i)
        calls = []
        for turn in range(turns):
            gen = await client.generate(ids, {"max_new_tokens": new_tokens, "temperature": 1.0, "ignore_eos": True})
            calls.append((ids, gen))
            ids = ids + gen.output_ids + observation(turn)
        return calls

    return await asyncio.gather(*(agent(i) for i in range(agents)))


async def compute_limit_run(args, threads: int) -> float:
    """The demo-shaped workload through the server's HTTP app and engine in this process, with the model's
    forwards timed, then plain matmuls of the model's shapes at the same threads. Returns the ratio."""
    from l0_min.serve.engine import Engine
    from l0_min.serve.server import make_app

    agents, turns, new_tokens = (32, 2, 32) if args.quick else (64, 3, 50)
    model, tok = load_model(args.model)
    system = yaml.safe_load((ROOT / "configs" / "cpu_demo.yaml").read_text())["agent"]["system_prompt"]
    config, head = model.config, model.get_output_embeddings().weight
    shapes, (vocab, hidden) = linear_shapes(config) * config.num_hidden_layers, head.shape

    def gflops() -> list[tuple[float, float]]:  # decode shapes, prefill shapes, the LM head: (wall, CPU), best of 3
        return [tuple(map(max, zip(*(matmul_gflops(sh, rows, 0.3) for _ in range(3)))))
                for sh, rows in ((shapes, agents), (shapes, PREFILL_ROWS), ([(hidden, vocab)], agents))]

    before = gflops()  # measured before and after the workload, the best kept: what these cores can do
    engine = Engine(model, tok).start()
    runner = web.AppRunner(make_app(engine, args.model, args.model))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    try:
        async with InferenceClient([url], InferenceConfig(timeout=3600), max_connections=agents) as client:
            await demo_workload(client, tok, system, 4, 1, 4)  # warm-up
            assert engine.call(engine.flush_cache).result()
            timer = ModelTimer(model)
            rss_before = rss_gb()
            t0, c0 = time.perf_counter(), time.process_time()
            per_agent = await demo_workload(client, tok, system, agents, turns, new_tokens)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            rss_after = rss_gb()
            timer.remove()
    finally:
        await runner.cleanup()
        engine.stop()

    # the arithmetic: 2 x non-embedding params per computed token, + the LM head (2 x hidden x vocab) per
    # sampled token; attention scores (~2 x 2 x context x hidden per token and layer) are not counted
    after = gflops()
    (g_decode, g_prefill, g_head), cpu_gflops = ([max(a[i], b[i]) for a, b in zip(before, after)] for i in (0, 1))
    embed = model.get_input_embeddings().weight
    params = sum(p.numel() for p in model.parameters()) - embed.numel() - (0 if head is embed else head.numel())
    calls = [c for turns_ in per_agent for c in turns_]
    finals = [turns_[-1][0] + turns_[-1][1].output_ids for turns_ in per_agent]  # the last turn holds them all
    generated = sum(len(g.output_ids) for _, g in calls)
    decode_rows = sum(len(g.output_ids) - 1 for _, g in calls)  # the first token of a turn comes from its prefill
    nodes, columns = unique_tokens(finals)
    prefill_rows = nodes - len(finals) - decode_rows  # a last token is never fed
    decode_cols = sum(len(ids) + j for ids, g in calls for j in range(1, len(g.output_ids)))  # columns each reads
    prefill_cols = columns - sum(map(len, finals)) - decode_cols
    cached = sum(g.meta_info.get("cached_tokens", 0) for _, g in calls)
    prompt_tokens = sum(len(ids) for ids, _ in calls)

    f_prefill, f_decode, f_head = 2 * params * prefill_rows, 2 * params * decode_rows, 2 * hidden * vocab * generated
    weights_only = f_prefill / g_prefill / 1e9 + f_decode / g_decode / 1e9 + f_head / g_head / 1e9
    # attention: 4 x query heads x head_dim FLOPs per layer for each key column a token reads (scores, then
    # values). Prefill's is arithmetic at matmul speed; a decode step's reads each running row's keys/values
    # (fp32, 2 x layers x kv_heads x head_dim x 4 bytes a column) for 1.5 FLOPs a byte with SmolLM2's 9 : 3
    # heads: memory-bound, so its floor is those bytes at the memory's read speed (a sum over 1 GB, same threads)
    hd = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    per_col = 4 * config.num_attention_heads * hd * config.num_hidden_layers
    kv_gb, gbps = 2 * config.num_hidden_layers * config.num_key_value_heads * hd * 4 * decode_cols / 1e9, read_gbps()

    def floor(g_decode, g_prefill, g_head, read_seconds):  # seconds of each phase at these speeds
        return {"prefill": (f_prefill + per_col * prefill_cols) / g_prefill / 1e9, "lm_head": f_head / g_head / 1e9,
                "decode": f_decode / g_decode / 1e9 + max(per_col * decode_cols / g_decode / 1e9, read_seconds)}

    limit = floor(g_decode, g_prefill, g_head, kv_gb / gbps)
    at_limit = sum(limit.values())
    cpu_at_limit = sum(floor(*cpu_gflops, kv_gb / gbps * threads).values())  # the read keeps every thread busy

    # exactness: the engine's log-probs against a plain fp32 forward of prompt + output (the learner's)
    ratios = []
    with torch.no_grad():
        for ids, gen in calls[-8:]:
            logits = model(torch.tensor([ids + gen.output_ids])).logits[0, len(ids) - 1 : -1].float()
            lp = torch.log_softmax(logits, -1).gather(1, torch.tensor(gen.output_ids)[:, None]).squeeze(1)
            ratios.append((torch.tensor(gen.logprobs) - lp).abs())
    ratios = torch.cat(ratios)

    t = timer.seconds
    host = wall - t["prefill"] - t["decode"]
    print(f"\ndemo workload: {agents} agents x {turns} turns x {new_tokens} new tokens (T = 1), shared system prompt; "
          f"torch threads {threads}; {params / 1e6:.1f} M non-embedding params, LM head {hidden} x {vocab}")
    print(f"  prompt tokens sent {prompt_tokens}, served from the prefix cache {cached}, fed to prefill forwards "
          f"{timer.rows['prefill']} (ideal: {prefill_rows}); generated {generated}; decode steps {timer.calls['decode']} "
          f"(mean batch {timer.rows['decode'] / max(1, timer.calls['decode']):.1f}), prefill forwards {timer.calls['prefill']}")
    print(f"  plain fp32 matmul, {threads} threads, GFLOPS before / after the workload: decode shapes ({agents} rows) "
          f"{before[0][0]:.1f} / {after[0][0]:.1f}, prefill shapes ({PREFILL_ROWS} rows) {before[1][0]:.1f} / "
          f"{after[1][0]:.1f}, LM head ({agents} x {hidden} x {vocab}) {before[2][0]:.1f} / {after[2][0]:.1f}")
    print(f"  in CPU seconds (what other load on the machine changes less): the workload took {cpu:.1f}, the limit "
          f"{cpu_at_limit:.1f}: ratio {cpu_at_limit / cpu:.2f}")
    print(f"  memory of this process (model, engine, client): RSS {rss_before[0]:.2f} GB before the workload "
          f"(peak {rss_before[1]:.2f}), {rss_after[0]:.2f} GB after it (peak {rss_after[1]:.2f})")
    print(f"  the limit's parts: the weights' matmuls {weights_only:.1f} s (alone: ratio {weights_only / wall:.2f}); "
          f"prefill attention {per_col * prefill_cols / 1e9:.0f} GFLOP, {per_col * prefill_cols / g_prefill / 1e9:.1f} s; "
          f"decode attention's key/value reads {kv_gb:.1f} GB at {gbps:.1f} GB/s, {kv_gb / gbps:.1f} s")
    print(f"  sampler vs a plain forward (last 8 requests): mean |log ratio| {ratios.mean():.2e}, max {ratios.max():.2e}")
    print(f"\n{'phase':>22} | {'seconds':>7} | {'share':>5} | {'at the limit (s)':>16} | limit / actual | "
          f"model thread CPU s")
    print(f"{'-' * 22}-+-{'-' * 7}-+-{'-' * 5}-+-{'-' * 16}-+-{'-' * 14}-+-{'-' * 18}")
    c = timer.cpu
    rows = [("prefill forwards", t["prefill"], limit["prefill"], c["prefill"]),
            ("decode forwards", t["decode"], limit["decode"] + limit["lm_head"], c["decode"]),
            ("  LM head (in both)", t["lm_head"], limit["lm_head"], c["lm_head"]),
            ("host (all the rest)", host, 0.0, None), ("total", wall, at_limit, None)]
    for name, sec, lim, cpu_s in rows:
        print(f"{name:>22} | {sec:7.1f} | {sec / wall:5.0%} | {lim:16.1f} | {lim / sec if sec else 0:14.2f} | "
              f"{'' if cpu_s is None else f'{cpu_s:18.1f}'}")
    return at_limit / wall


async def server_vs_inprocess(args) -> float | None:
    """Part 1 (and 2): the server's tokens/s against in-process `model.generate`; returns the ratio at 32."""
    rounds = args.rounds or (1 if args.quick else 2)
    new_tokens = args.tokens or (8 if args.quick else 32)
    sizes = [int(s) for s in (args.sizes or ("1,32" if args.quick else "1,8,32,64")).split(",")]

    t0 = time.perf_counter()
    with ThreadPoolExecutor(1) as pool:  # load the model here while the server starts
        server = pool.submit(start_server_process, args.model, extra_args=["--prefix-cache-tokens", "0"])
        model, tok = load_model(args.model)
        proc, url = server.result()
    messages = [{"role": "user", "content": "Write a short story about a robot who learns to paint."}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)  # ids (transformers 4, 5)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    print(f"model {args.model}, prompt {len(prompt)} tokens, {new_tokens} new tokens per sequence, "
          f"torch threads {torch.get_num_threads()}, best of {rounds}, setup {time.perf_counter() - t0:.1f}s")

    rows = []
    try:
        async with InferenceClient([url], InferenceConfig(timeout=3600), max_connections=max(sizes)) as client:
            # warm-up both paths with a batch (the first large forward of a process is slow)
            warm = 8 if args.quick else max(sizes)
            await server_tps(client, prompt, warm, 2)
            inprocess_tps(model, prompt, warm, 2, pad_id)
            for b in sizes:
                inproc = served = 0.0
                for _ in range(rounds):
                    inproc = max(inproc, inprocess_tps(model, prompt, b, new_tokens, pad_id))
                    served = max(served, await server_tps(client, prompt, b, new_tokens))
                rows.append((b, inproc, served))
                print(f"  batch {b:>3}: in-process {inproc:7.1f} tok/s   server {served:7.1f} tok/s   ratio {served / inproc:.2f}", flush=True)
    finally:
        stop_server_process(proc)

    bare, via_client = await client_overhead(60 if args.quick else 200)

    print()
    print(f"{'concurrent':>10} | {'in-process tok/s':>16} | {'server tok/s':>12} | {'server / in-process':>19}")
    print(f"{'-' * 10}-+-{'-' * 16}-+-{'-' * 12}-+-{'-' * 19}")
    for b, inproc, served in rows:
        print(f"{b:>10} | {inproc:>16.1f} | {served:>12.1f} | {served / inproc:>19.2f}")
    print()
    print(f"client overhead per request (512-token response, canned endpoint): bare aiohttp {bare * 1e3:.2f} ms, "
          f"InferenceClient {via_client * 1e3:.2f} ms, overhead {(via_client - bare) * 1e3:+.2f} ms")
    return {b: s / i for b, i, s in rows}.get(32)


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--parts", default="server,limit", help="server: vs in-process generate; limit: the demo workload")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--tokens", type=int, default=0, help="new tokens per sequence (default 32, quick 8)")
    ap.add_argument("--sizes", default="", help="comma-separated batch sizes (default 1,8,32,64, quick 1,32)")
    ap.add_argument("--rounds", type=int, default=0, help="measurements per side and size, best kept (default 2, quick 1)")
    args = ap.parse_args()
    parts = args.parts.split(",")
    if args.threads:
        torch.set_num_threads(args.threads)
    at32 = await server_vs_inprocess(args) if "server" in parts else None
    ratio = await compute_limit_run(args, torch.get_num_threads()) if "limit" in parts else None
    print()
    if "server" in parts:
        if at32 is None:
            print("RESULT server_vs_inprocess_at_32=n/a target >= 0.8 SHORT (batch size 32 not measured)")
        else:
            print(f"RESULT server_vs_inprocess_at_32={at32:.2f} target >= {TARGET} {'MET' if at32 >= TARGET else 'SHORT'}")
    if ratio is not None:
        print(f"RESULT generation_vs_compute_limit={ratio:.2f} target >= {LIMIT_TARGET} "
              f"{'MET' if ratio >= LIMIT_TARGET else 'SHORT'}")


if __name__ == "__main__":
    asyncio.run(main())
