"""The embedded server: SGLang's response shape and errors over HTTP, the batching engine (continuous
batching, stops, aborts, prefix cache), sampling, weight updates and the on-policy log-prob check."""

import asyncio
import contextlib
import hashlib
import json
import threading
import time
from pathlib import Path

import aiohttp
import pytest
import torch

from l0_min.config import InferenceConfig
from l0_min.serve import engine as engine_module
from l0_min.serve.engine import Engine, RadixCache, SamplingParams, Sequence, sample
from l0_min.inference import InferenceClient
from l0_min.models import ModelNotFoundError, load_model, resolve_model

FIXTURES = Path(__file__).parent / "fixtures" / "sglang"
SCHEMA = json.loads((FIXTURES / "schema.json").read_text())


def fixture(name):
    return json.loads((FIXTURES / name).read_text())


def byte_ids(text: str) -> list[int]:
    """tiny-random's tokenizer (ByT5): id = byte + 3."""
    return [b + 3 for b in text.encode()]


async def post(url, path, body):
    async with aiohttp.ClientSession() as s:
        async with s.post(url + path, json=body) as r:
            text = await r.text()
            try:
                return r.status, json.loads(text)
            except ValueError:
                return r.status, text


async def get(url, path):
    async with aiohttp.ClientSession() as s:
        async with s.get(url + path) as r:
            text = await r.text()
            try:
                return r.status, json.loads(text)
            except ValueError:
                return r.status, text


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """tiny-random's ops are too small to split over threads: on a busy machine the split costs more
    than it saves (a 2-layer, 64-wide forward took 35 ms with 2 threads under load)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def json_type(v):
    return "number" if isinstance(v, (int, float)) and not isinstance(v, bool) else type(v).__name__


# ---------------------------------------------------------------------------------------------
# SGLang's response shape, over HTTP (the subprocess server)


@pytest.mark.slow
async def test_generate_response_has_sglang_shape(tiny_server_url):
    expected = fixture("generate_response_length.json")
    status, body = await post(tiny_server_url, "/generate", {
        "input_ids": byte_ids("hello"), "sampling_params": {"max_new_tokens": 8, "temperature": 0}, "return_logprob": True})
    assert status == 200
    assert set(body) == set(SCHEMA["generate_response_keys"])
    meta = body["meta_info"]
    for key in SCHEMA["meta_info_keys"]:
        assert json_type(meta[key]) == json_type(expected["meta_info"][key]), key
    assert meta["finish_reason"] == {"type": "length", "length": 8}
    assert meta["prompt_tokens"] == 5 and meta["completion_tokens"] == 8
    assert len(body["output_ids"]) == 8
    for (lp, tok, text), out in zip(meta["output_token_logprobs"], body["output_ids"]):
        assert isinstance(lp, float) and lp <= 0.0 and tok == out and text is None


@pytest.mark.slow
async def test_batch_n_rid_and_text_in_logprobs(tiny_server_url):
    status, body = await post(tiny_server_url, "/generate", {
        "input_ids": [byte_ids("abc"), byte_ids("de")], "rid": ["a", "b"],
        "sampling_params": {"max_new_tokens": 3, "n": 2}, "return_logprob": True, "return_text_in_logprobs": True})
    assert status == 200 and isinstance(body, list) and len(body) == 4
    assert [o["meta_info"]["prompt_tokens"] for o in body] == [3, 3, 2, 2]  # prompt-major, as SGLang
    assert [o["meta_info"]["id"] for o in body] == ["a_0", "a_1", "b_0", "b_1"]
    for o in body:
        for lp, tok, text in o["meta_info"]["output_token_logprobs"]:
            assert isinstance(text, str)

    # one prompt with n=2 is a list too; text prompts are tokenized by the server
    status, body = await post(tiny_server_url, "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2, "n": 2}})
    assert status == 200 and len(body) == 2 and "output_token_logprobs" not in body[0]["meta_info"]


@pytest.mark.slow
async def test_stop_string_is_matched_and_trimmed_like_sglang(tiny_server_url):
    prompt = byte_ids("hello")
    _, full = await post(tiny_server_url, "/generate", {
        "input_ids": prompt, "sampling_params": {"max_new_tokens": 24, "temperature": 0, "no_stop_trim": True}})
    text = full["text"]
    stop = next(text[i:i + 2] for i in range(1, len(text) - 1) if text[i:i + 2].isprintable() and text[i:i + 2].strip())
    for no_trim in (True, False):
        _, out = await post(tiny_server_url, "/generate", {
            "input_ids": prompt, "sampling_params": {"max_new_tokens": 24, "temperature": 0, "stop": [stop], "no_stop_trim": no_trim}})
        ids = out["output_ids"]
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        assert ids == full["output_ids"][: len(ids)]  # greedy: a prefix of the unstopped output
        if no_trim:
            assert stop in out["text"]
        else:
            assert out["text"] == text[: text.find(stop)]


@pytest.mark.parametrize(
    "body, shape, message",
    [
        ({"input_ids": "abc"}, "schema", "input_ids: expected a list"),
        ({"input_ids": [1, 2], "foo": 1}, "schema", "foo: unknown field"),
        ({"input_ids": [[1, 2], ["x"]]}, "schema", "input_ids[1]: expected a list of integers"),
        ({}, "generate", "Either text or input_ids"),
        ({"input_ids": []}, "generate", "input_ids cannot be empty"),
        ({"input_ids": [1], "text": "a"}, "generate", "Either text or input_ids"),
        ({"input_ids": [100000]}, "generate", "input_ids: token id 100000 is outside the vocabulary"),
        ({"input_ids": [1], "sampling_params": {"temperature": -1}}, "generate", "sampling_params.temperature must be"),
        ({"input_ids": [1], "sampling_params": {"top_p": 0}}, "generate", "sampling_params.top_p must be in (0, 1]"),
        ({"input_ids": [1], "sampling_params": {"top_k": 0}}, "generate", "sampling_params.top_k must be -1"),
        ({"input_ids": [1], "sampling_params": {"max_new_tokens": -2}}, "generate", "sampling_params.max_new_tokens must be"),
        ({"input_ids": [1], "sampling_params": {"max_new_tokens": "5"}}, "schema", "sampling_params.max_new_tokens: expected an integer"),
        ({"input_ids": [1], "sampling_params": {"stop": [1]}}, "schema", "sampling_params.stop: expected a string or a list"),
        ({"input_ids": [1], "sampling_params": {"temprature": 1}}, "schema", "sampling_params.temprature: unknown sampling parameter"),
        ({"input_ids": [1], "sampling_params": {"repetition_penalty": 1.2}}, "generate", "repetition_penalty=1.2 is not supported"),
        ({"input_ids": [1], "stream": True}, "generate", "stream=True is not supported"),
        ({"input_ids": [1], "return_logprob": "yes"}, "schema", "return_logprob: expected a boolean"),
        ({"input_ids": [[1], [2]], "sampling_params": [{"n": 1}, {"n": 2}]}, "generate", "parallel_sample_num"),
        ({"input_ids": [1] * 5000}, "generate", "longer than the model's context length"),
        ([1, 2], "schema", "request body: expected a JSON object"),
    ],
)
@pytest.mark.slow
async def test_bad_requests_get_sglang_400s_naming_the_field(tiny_server_url, body, shape, message):
    status, err = await post(tiny_server_url, "/generate", body)
    assert status == 400
    if shape == "schema":  # FastAPI validation error body
        assert set(err) == set(fixture("error_validation_400.json")) and err["code"] == 400
        assert message in err["message"]
    else:  # /generate ValueError body
        assert set(err) == {"error"} and message in err["error"]["message"]


@pytest.mark.slow
async def test_invalid_json_and_server_stays_up(tiny_server_url):
    async with aiohttp.ClientSession() as s:
        async with s.post(tiny_server_url + "/generate", data=b"{not json", headers={"Content-Type": "application/json"}) as r:
            assert r.status == 400 and "not valid JSON" in (await r.json())["message"]
    assert (await get(tiny_server_url, "/health"))[0] == 200
    assert (await get(tiny_server_url, "/health_generate"))[0] == 200
    status, info = await get(tiny_server_url, "/get_model_info")
    assert status == 200 and set(info) == set(fixture("get_model_info_response.json"))
    assert (await get(tiny_server_url, "/get_weight_version")) == (200, {"weight_version": "default"})
    status, text = await post(tiny_server_url, "/flush_cache", None)
    assert status == 200 and text.startswith("Cache flushed.")


@pytest.mark.slow
async def test_update_weights_from_disk_errors(tiny_server_url, tmp_path):
    status, body = await post(tiny_server_url, "/update_weights_from_disk", {"model_path": str(tmp_path / "nope")})
    assert status == 400 and body["success"] is False and "does not exist" in body["message"]
    assert set(body) == set(fixture("update_weights_from_disk_response_failed.json"))
    status, body = await post(tiny_server_url, "/update_weights_from_disk", {"model_path": 3, "wieght_version": "2"})
    assert status == 400 and "wieght_version: unknown field" in body["message"] and "model_path" in body["message"]


# ---------------------------------------------------------------------------------------------
# the engine, in-process


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-random")


@contextlib.contextmanager
def running_engine(model, tok, **kw):
    engine = Engine(model, tok, **kw).start()
    try:
        yield engine
    finally:
        engine.stop()


def run_all(engine, requests, join_after_steps=0):
    """Submit (ids, params) pairs, each `join_after_steps` engine steps after the previous one (0: all at
    once, queued between two engine steps); wait for all; return the finished Sequences. Counting engine
    steps, not seconds, makes the later requests arrive mid-decode however fast or loaded the machine is."""
    done = threading.Semaphore(0)
    seqs = [Sequence(rid=str(i), input_ids=ids, params=p, on_done=lambda s: done.release()) for i, (ids, p) in enumerate(requests)]
    if not join_after_steps:  # submitted from the engine thread: all are queued before its next step
        engine.call(lambda: [engine.submit(s) for s in seqs]).result(timeout=60)
    for s in seqs if join_after_steps else []:
        start = engine.steps
        engine.submit(s)
        deadline = time.time() + 30
        while engine.steps < start + join_after_steps and time.time() < deadline:
            time.sleep(0.001)
    for _ in seqs:
        assert done.acquire(timeout=60)
    return seqs


def hf_logprobs(model, prompt, action, temperature=0.0):
    """Learner side: a plain fp32 forward over prompt + action, log_softmax(logits / T) gathered at the
    action ids (T = 0, greedy: the raw distribution)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + action])).logits[0].float() / (temperature or 1.0)
    lp = torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : -1]
    return lp.gather(1, torch.tensor(action)[:, None]).squeeze(1)


@pytest.mark.slow
def test_continuous_batching_joins_and_matches_unbatched_greedy(tiny):
    model, tok = tiny
    prompts = [byte_ids(t) for t in ("hello", "The answer is", "x", "abc def ghi jkl")]
    greedy = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    with running_engine(model, tok) as engine:
        seqs = run_all(engine, [(p, greedy) for p in prompts], join_after_steps=3)
        assert max(engine.step_batch_sizes) >= 2  # later requests joined the running batch
        assert engine.steps < 4 * 40  # they shared decode steps instead of running one after another
    # arriving together, prompts of similar length are prefilled in one left-padded forward
    similar = [byte_ids(t) for t in ("one two three", "four five six!", "seven eight", "nine ten elev")]
    with running_engine(model, tok) as engine:
        together = run_all(engine, [(p, greedy) for p in similar])
        assert max(engine.prefill_batch_sizes) >= 2
    for s, p in zip(seqs + together, prompts + similar):
        ref = model.generate(torch.tensor([p]), max_new_tokens=40, min_new_tokens=40, do_sample=False)[0, len(p):]
        assert s.output_ids == ref.tolist()  # left padding and merging change nothing
        assert torch.allclose(torch.tensor(s.logprobs), hf_logprobs(model, p, s.output_ids), atol=1e-4)
        assert s.finish_reason == {"type": "length", "length": 40}


def test_late_request_joins_before_early_one_finishes(tiny):
    model, tok = tiny
    order = []
    with running_engine(model, tok) as engine:
        done = threading.Semaphore(0)

        def finished(s):
            order.append(s.rid)
            done.release()

        long = Sequence("long", byte_ids("a long one"), SamplingParams(max_new_tokens=300, ignore_eos=True), on_done=finished)
        short = Sequence("short", byte_ids("short"), SamplingParams(max_new_tokens=5, ignore_eos=True), on_done=finished)
        engine.submit(long)
        while engine.steps < 20:
            time.sleep(0.01)
        engine.submit(short)
        assert done.acquire(timeout=60) and done.acquire(timeout=60)
    assert order == ["short", "long"]  # did not wait for the batch to drain


def test_stop_token_eos_abort_and_zero_tokens(tiny):
    model, tok = tiny
    p = byte_ids("hello")
    with running_engine(model, tok) as engine:
        (ref,) = run_all(engine, [(p, SamplingParams(max_new_tokens=20, temperature=0.0))])
        target = ref.output_ids[6]
        first = ref.output_ids.index(target)
        (s,) = run_all(engine, [(p, SamplingParams(max_new_tokens=20, temperature=0.0, stop_token_ids=[target]))])
        assert s.output_ids == ref.output_ids[: first + 1] and s.finish_reason == {"type": "stop", "matched": target}

        real_eos, engine.eos_ids = engine.eos_ids, {target}  # pretend it is EOS
        (s,) = run_all(engine, [(p, SamplingParams(max_new_tokens=20, temperature=0.0))])
        assert s.finish_reason == {"type": "stop", "matched": target}
        (s,) = run_all(engine, [(p, SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True))])
        assert s.finish_reason["type"] == "length" and len(s.output_ids) == 20
        engine.eos_ids = real_eos

        (s,) = run_all(engine, [(p, SamplingParams(max_new_tokens=0))])
        assert s.output_ids == [] and s.finish_reason == {"type": "length", "length": 0}

        done = threading.Semaphore(0)
        s = Sequence("x", p, SamplingParams(max_new_tokens=10_000, ignore_eos=True), on_done=lambda s: done.release())
        engine.submit(s)
        while len(s.output_ids) < 3:
            time.sleep(0.01)
        engine.abort("x")
        assert done.acquire(timeout=10)
        assert s.finish_reason["type"] == "abort" and engine.num_requests() == 0
        (after,) = run_all(engine, [(p, SamplingParams(max_new_tokens=20, temperature=0.0))])
        assert after.output_ids == ref.output_ids  # still serving, same results


def test_prefix_cache_reuses_an_agent_turn(tiny, monkeypatch):
    model, tok = tiny
    greedy = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    turn1 = byte_ids("system prompt and a question")
    with running_engine(model, tok, prefill_chunk=8) as engine:  # chunked prefill too
        (a,) = run_all(engine, [(turn1, greedy)])
        turn2 = turn1 + a.output_ids + byte_ids(" observation")
        (b,) = run_all(engine, [(turn2, greedy)])
        assert b.cached_tokens == len(turn1) + len(a.output_ids) - 1  # everything the first turn computed
        assert engine.call(engine.flush_cache).result() is True
        (c,) = run_all(engine, [(turn2, greedy)])
        assert c.cached_tokens == 0
    with monkeypatch.context() as m, running_engine(model, tok) as engine:  # an idle engine lets its memory go
        m.setattr(engine_module, "IDLE_SECONDS", 0.05)
        m.setattr(engine_module, "PREFIX_IDLE_SECONDS", 1e9)
        run_all(engine, [(turn1, greedy)])
        assert engine.prefix_cache.tokens > 0
        m.setattr(engine_module, "PREFIX_IDLE_SECONDS", 0.2)
        deadline = time.monotonic() + 30
        while (engine.kv is not None or engine.prefix_cache.tokens) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.kv is None and engine.prefix_cache.tokens == 0
    assert b.output_ids == c.output_ids
    assert torch.allclose(torch.tensor(b.logprobs), torch.tensor(c.logprobs), atol=1e-4)


def test_a_burst_sharing_a_system_prompt_computes_it_once(tiny):
    # agents start together with the same system prompt: once the first prompt is prefilled, the
    # others reuse its KV instead of each computing the shared part again
    model, tok = tiny
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    system = byte_ids("a long system prompt that every agent of the batch starts with. ")
    prompts = [system + byte_ids(f"task {i}: question {7 * i}") for i in range(6)]
    with running_engine(model, tok) as engine:
        shared = run_all(engine, [(p, greedy) for p in prompts])
        assert engine.prefill_batch_sizes == [1, 6]  # the shared part once, then the six rests in one forward
    with running_engine(model, tok, prefix_cache_tokens=0) as engine:
        alone = run_all(engine, [(p, greedy) for p in prompts])
    assert shared[0].cached_tokens == 0
    assert [s.cached_tokens for s in shared[1:]] == [len(system) + len("task ")] * 5
    assert [s.output_ids for s in shared] == [s.output_ids for s in alone]
    for a, b in zip(shared, alone):
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4)


def test_next_turns_of_several_agents_are_prefilled_in_one_forward(tiny):
    # each agent's next prompt extends its previous turn by a different amount: every row copies its own
    # cached prefix (different lengths) and all rows compute their new tokens in one forward
    model, tok = tiny
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    first = [byte_ids(f"agent {i} asks question {i * 13}") for i in range(4)]
    with running_engine(model, tok) as engine:
        turn1 = run_all(engine, [(p, greedy) for p in first])
        second = [p + s.output_ids + byte_ids(" observation" + "!" * i) for i, (p, s) in enumerate(zip(first, turn1))]
        forwards = len(engine.prefill_batch_sizes)
        turn2 = run_all(engine, [(p, greedy) for p in second])
        assert engine.prefill_batch_sizes[forwards:] == [4]
    assert [s.cached_tokens for s in turn2] == [len(p) + 11 for p in first]  # all the first turn computed
    with running_engine(model, tok, prefix_cache_tokens=0) as engine:
        alone = run_all(engine, [(p, greedy) for p in second])
    assert [s.output_ids for s in turn2] == [s.output_ids for s in alone]
    for a, b in zip(turn2, alone):
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4)


def test_radix_cache_shares_prefixes_splits_edges_and_evicts_the_least_recent():
    def kv(ids):  # the "keys/values" of a token are its id: what comes back shows which tokens it covers
        return lambda a, b: torch.tensor(ids[a:b], dtype=torch.float)[None, None, None, :, None]

    def got(ids):
        n, segments = cache.lookup(ids)
        return n, torch.cat(segments, dim=-2).flatten().int().tolist() if segments else []

    cache = RadixCache(max_tokens=10)
    cache.insert([1, 2, 3, 4, 5], kv([1, 2, 3, 4, 5]))
    cache.insert([1, 2, 3, 9], kv([1, 2, 3, 9]))  # splits the first edge after [1, 2, 3]
    assert cache.tokens == 6  # the shared prefix is held once
    assert got([1, 2, 3, 9, 7]) == (4, [1, 2, 3, 9])
    assert got([1, 2, 3, 4]) == (3, [1, 2, 3])  # at most all but the last prompt token
    assert got([8, 1]) == (0, [])
    # a leaf a lookup takes whole ([9] above) is one sequence's context, now in the batch: it goes first
    cache.insert([7, 8, 9, 10, 11], kv([7, 8, 9, 10, 11]))  # 11 tokens > 10
    assert cache.tokens == 10 and got([1, 2, 3, 9, 0])[0] == 3
    assert got([1, 2, 3, 4, 5, 6]) == (5, [1, 2, 3, 4, 5])
    cache.insert([1, 2, 3, 8], kv([1, 2, 3, 8]))  # 11 tokens again: [4, 5], just taken whole, goes
    assert cache.tokens == 9 and got([1, 2, 3, 4, 5, 6])[0] == 3 and got([7, 8, 9, 10, 11, 0])[0] == 5
    cache.clear()
    assert cache.tokens == 0 and got([1, 2, 3, 9, 0]) == (0, [])


def test_engine_rejects_what_it_cannot_run(tiny):
    model, tok = tiny
    engine = Engine(model, tok, context_length=64)
    for ids, message in [([], "empty"), ([10**6], "outside the vocabulary"), ([5] * 64, "context length")]:
        with pytest.raises(ValueError, match=message):
            engine.validate(Sequence("r", ids, SamplingParams()))


# ---------------------------------------------------------------------------------------------
# sampling


def test_sample_greedy_topk_topp_minp_and_tempered_logprobs():
    torch.manual_seed(0)
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]] * 6)
    ones = torch.ones(6)
    raw = torch.log_softmax(logits[0], -1)

    def run(temperature=1.0, top_p=1.0, top_k=1 << 30, min_p=0.0, greedy=False):
        return sample(logits, temperature * ones, top_p * ones, torch.full((6,), top_k), min_p * ones,
                      torch.full((6,), greedy))

    ids, lps = run(greedy=True)
    assert ids.tolist() == [0] * 6 and torch.allclose(lps, raw[0].expand(6))
    for kwargs in (dict(top_k=1), dict(top_p=0.1), dict(min_p=0.9)):
        assert run(**kwargs)[0].tolist() == [0] * 6, kwargs  # filters leave only the top token
    ids = torch.cat([run(top_k=2)[0] for _ in range(50)])
    assert set(ids.tolist()) == {0, 1}  # top_k=2 keeps exactly two
    ids = torch.cat([run()[0] for _ in range(200)])
    assert set(ids.tolist()) == {0, 1, 2, 3}
    # the unrestricted sampler follows softmax(logits / T): over 6 x 4000 draws a frequency's standard
    # error is at most sqrt(0.25 / 24000) = 0.0032; 5 of them is 0.016
    ids = torch.cat([run(temperature=0.7)[0] for _ in range(4000)])
    freq = torch.bincount(ids, minlength=4) / len(ids)
    assert (freq - torch.softmax(logits[0] / 0.7, -1)).abs().max() < 0.016, freq

    ids, lps = run(temperature=0.5, top_p=0.9)  # SGLang's default: tempered, not renormalised by top_p
    assert torch.allclose(lps, torch.log_softmax(logits[0] / 0.5, -1)[ids])
    ids, lps = run(temperature=0.5, greedy=True)
    assert torch.allclose(lps, raw[ids])  # greedy: the raw distribution


# ---------------------------------------------------------------------------------------------
# weight updates and the on-policy check (an in-process server: real HTTP, own weights)


@pytest.fixture(scope="module")
def perturbed(tmp_path_factory):
    """A copy of tiny-random with different weights, saved as an HF folder (what the learner exports)."""
    model, tok = load_model("tiny-random")
    with torch.no_grad():
        gen = torch.Generator().manual_seed(1)
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen))
    folder = tmp_path_factory.mktemp("weights") / "step_1"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder, model


@contextlib.asynccontextmanager
async def in_process_server(api_key=None, **engine_kw):
    from aiohttp import web

    from l0_min.serve.server import make_app

    model, tok = load_model("tiny-random")
    engine = Engine(model, tok, **engine_kw).start()
    runner = web.AppRunner(make_app(engine, "tiny-random", "tiny-random", api_key=api_key), handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}", engine
    finally:
        await runner.cleanup()
        engine.stop()


async def test_on_policy_logprobs_after_weight_update(perturbed):
    folder, learner = perturbed
    prompts = [byte_ids(t) for t in ("hello", "The answer is 42 because", "x")]
    settings = [{"temperature": 0.0}, {"temperature": 1.0}, {"temperature": 0.7, "top_p": 0.9, "top_k": 50}]
    async with in_process_server() as (url, engine):
        async with InferenceClient([url], InferenceConfig(timeout=60)) as client:
            before = await client.generate(prompts[0], {"max_new_tokens": 8, "temperature": 0.0})
            await client.update_weights_from_disk(str(folder), "1")
            assert (await get(url, "/get_model_info"))[1]["weight_version"] == "1"
            jobs = [client.generate(p, {"max_new_tokens": 24, "ignore_eos": True, **s}) for p in prompts for s in settings]
            gens = await asyncio.gather(*jobs)  # all at once: batched, left-padded, different lengths
    assert max(engine.step_batch_sizes) > 1
    for (p, s), g in zip([(p, s) for p in prompts for s in settings], gens):
        assert g.weight_version == "1" and len(g.output_ids) == 24
        learner_lp = hf_logprobs(learner, p, g.output_ids, s["temperature"])
        diff = (torch.tensor(g.logprobs) - learner_lp).abs().max().item()
        assert diff < 1e-4, (s, diff)
    old_lp = hf_logprobs(load_model("tiny-random")[0], prompts[0], before.output_ids)
    new_lp = hf_logprobs(learner, prompts[0], before.output_ids)
    assert torch.allclose(torch.tensor(before.logprobs), old_lp, atol=1e-4)
    assert not torch.allclose(old_lp, new_lp, atol=1e-2)  # the update changed the policy


async def test_failed_update_leaves_weights_and_version(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    other = LlamaForCausalLM(LlamaConfig(vocab_size=259, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2))
    other.save_pretrained(tmp_path / "wrong")
    prompt = byte_ids("hello")
    async with in_process_server() as (url, engine):
        _, before = await post(url, "/generate", {"input_ids": prompt, "sampling_params": {"max_new_tokens": 8, "temperature": 0}, "return_logprob": True})
        status, body = await post(url, "/update_weights_from_disk", {"model_path": str(tmp_path / "wrong"), "weight_version": "9"})
        assert status == 400 and body["success"] is False and "shape mismatch" in body["message"]
        _, after = await post(url, "/generate", {"input_ids": prompt, "sampling_params": {"max_new_tokens": 8, "temperature": 0}, "return_logprob": True})
    assert after["output_ids"] == before["output_ids"]
    lp = lambda out: torch.tensor([e[0] for e in out["meta_info"]["output_token_logprobs"]])
    assert torch.allclose(lp(after), lp(before), atol=1e-5)  # (the second reuses cached keys/values)
    assert after["meta_info"]["weight_version"] == "default"


async def test_update_waits_for_in_flight_requests_or_aborts_them(perturbed):
    folder, _ = perturbed
    long_request = {"input_ids": byte_ids("go"), "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}
    async with in_process_server() as (url, engine):
        running = asyncio.ensure_future(post(url, "/generate", long_request))
        while engine.steps < 5:
            await asyncio.sleep(0.01)
        status, body = await post(url, "/update_weights_from_disk", {"model_path": str(folder), "weight_version": "2"})
        assert status == 200 and body["success"] and body["message"].endswith("Weight version updated to 2.")
        _, out = await running
        assert out["meta_info"]["finish_reason"]["type"] == "length"  # it finished first ...
        assert out["meta_info"]["weight_version"] == "default"  # ... on the old weights

        running = asyncio.ensure_future(post(url, "/generate", long_request))
        while engine.num_requests() == 0 or engine.steps < 3:
            await asyncio.sleep(0.01)
        status, body = await post(url, "/update_weights_from_disk", {"model_path": str(folder), "weight_version": "3", "abort_all_requests": True})
        assert status == 200
        _, out = await running
        assert out["meta_info"]["finish_reason"]["type"] == "abort" and len(out["output_ids"]) < 400


async def test_api_key_is_required_like_sglang_and_the_client_sends_it(monkeypatch):
    from l0_min.inference import BadRequestError
    from l0_min.serve.server import parse_args

    assert parse_args(["--model", "tiny-random"]).host == "127.0.0.1"  # loopback unless told otherwise
    async with in_process_server(api_key="s3cret") as (url, engine):
        assert (await get(url, "/health"))[0] == 200  # health checks stay open, as in SGLang
        for path, body in [("/update_weights_from_disk", {"model_path": "/x"}), ("/generate", {"input_ids": [5]})]:
            assert await post(url, path, body) == (401, {"error": "Unauthorized"})
        assert (await get(url, "/get_model_info"))[0] == 401
        monkeypatch.setenv("L0_TEST_API_KEY", "s3cret")
        async with InferenceClient([url], InferenceConfig(api_key_env="L0_TEST_API_KEY", max_retries=0)) as client:
            assert len((await client.generate([5, 6], {"max_new_tokens": 2, "ignore_eos": True})).output_ids) == 2
        monkeypatch.setenv("L0_TEST_API_KEY", "wrong")
        async with InferenceClient([url], InferenceConfig(api_key_env="L0_TEST_API_KEY", max_retries=0)) as client:
            with pytest.raises(BadRequestError, match="HTTP 401: .*Unauthorized"):
                await client.generate([5, 6], {"max_new_tokens": 2})
    monkeypatch.delenv("L0_TEST_API_KEY")
    with pytest.raises(ValueError, match="inference.api_key_env: the environment variable L0_TEST_API_KEY is not set"):
        InferenceClient([url], InferenceConfig(api_key_env="L0_TEST_API_KEY"))


async def test_update_lock_holds_new_requests_behind_a_waiting_update():
    from l0_min.serve.server import UpdateLock

    lock, order, release = UpdateLock(), [], asyncio.Event()

    async def request(name):
        async with lock.reading():
            order.append(name)
            await release.wait()
        order.append(f"{name} done")

    async def update():
        async with lock.writing():
            order.append("update")

    tasks = [asyncio.ensure_future(request("early"))]
    await asyncio.sleep(0.01)
    tasks += [asyncio.ensure_future(update())]
    await asyncio.sleep(0.01)
    tasks += [asyncio.ensure_future(request("late"))]
    await asyncio.sleep(0.01)
    assert order == ["early"]  # the update waits for the request in flight, the late one waits behind it
    release.set()
    await asyncio.gather(*tasks)
    assert order == ["early", "early done", "update", "late", "late done"]


async def test_client_disconnect_aborts_the_request():
    async with in_process_server() as (url, engine):
        task = asyncio.ensure_future(post(url, "/generate", {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 100000, "ignore_eos": True}}))
        while engine.num_requests() == 0:
            await asyncio.sleep(0.01)
        task.cancel()
        deadline = time.time() + 10
        while engine.num_requests() and time.time() < deadline:
            await asyncio.sleep(0.05)
        assert engine.num_requests() == 0


# ---------------------------------------------------------------------------------------------
# models and starting the server


def test_resolve_model_errors_name_the_path(tmp_path):
    with pytest.raises(ModelNotFoundError, match=str(tmp_path / "missing")):
        resolve_model(str(tmp_path / "missing"))
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        resolve_model(str(tmp_path))
    with pytest.raises(ModelNotFoundError, match="built-in name"):
        resolve_model("")


def test_tiny_random_builds_are_identical(tmp_path, monkeypatch):
    digests = []
    for i in range(2):
        monkeypatch.setenv("L0_MIN_CACHE", str(tmp_path / f"cache{i}"))
        folder = resolve_model("tiny-random")
        assert folder == tmp_path / f"cache{i}" / "models" / "tiny-random"
        digests.append({f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(folder.iterdir())})
    assert digests[0] == digests[1] and "model.safetensors" in digests[0]
    _, tok = load_model(folder)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_start_server_process_reports_the_servers_error(tmp_path):
    from l0_min.serve.server import ServerStartError, start_server_process

    with pytest.raises(ServerStartError, match="exited with code") as e:
        start_server_process(str(tmp_path / "no-such-model"), timeout=60)
    assert "model path does not exist" in str(e.value)  # the tail of the server's log


# ---------------------------------------------------------------------------------------------
# the real model (deselect with -m "not slow")


@pytest.mark.slow
async def test_smollm2_server_stops_at_im_end_and_is_on_policy():
    from l0_min.serve.server import start_server_process, stop_server_process

    proc, url = start_server_process("smollm2-135m", timeout=300)
    try:
        model, tok = load_model("smollm2-135m")
        prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                         add_generation_prompt=True, return_dict=False)  # ids, transformers 4 and 5
        async with InferenceClient([url], InferenceConfig(timeout=300)) as client:
            greedy, sampled = await asyncio.gather(
                client.generate(prompt, {"max_new_tokens": 64, "temperature": 0.0}),
                client.generate(prompt, {"max_new_tokens": 16, "temperature": 1.0, "top_p": 0.95}),
            )
    finally:
        stop_server_process(proc)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert (greedy.finish_reason, greedy.matched_stop, greedy.output_ids[-1]) == ("stop", im_end, im_end)
    assert "Paris" in greedy.text
    for g in (greedy, sampled):
        diff = (torch.tensor(g.logprobs) - hf_logprobs(model, prompt, g.output_ids)).abs().max().item()
        assert diff < 1e-3, diff
