"""InferenceClient: its requests and its reading of responses against SGLang fixtures, retries, routing,
weight updates; then the same client against the embedded server over real HTTP."""

import asyncio
import contextlib
import dataclasses
import json
import socket
import time
from pathlib import Path

import pytest
from aiohttp import web

from l0_min.config import InferenceConfig
from l0_min.inference import BadRequestError, Generation, InferenceClient, InferenceError, parse_generation

FIXTURES = Path(__file__).parent / "fixtures" / "sglang"
FAST = InferenceConfig(timeout=10.0, max_retries=3, backoff=0.01, down_after=0.3)


def fixture(name):
    return json.loads((FIXTURES / name).read_text())


@contextlib.asynccontextmanager
async def fake_sglang(routes):
    """An aiohttp server on a free port; routes: {(method, path): async handler(request, log)}.
    Yields (url, log) where log lists (path, json body or None) of every request received."""
    received = []

    def wrap(handler):
        async def h(request):
            body = await request.json() if request.can_read_body else None
            received.append((request.path, body))
            return await handler(request, received)

        return h

    app = web.Application()
    for (method, path), handler in routes.items():
        app.router.add_route(method, path, wrap(handler))
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", received
    finally:
        await runner.cleanup()


def answer(body, status=200):
    async def handler(request, log):
        return web.json_response(body, status=status)

    return handler


def dead_url():
    """A URL nothing listens on."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"http://127.0.0.1:{port}"


# ---------------------------------------------------------------------------------------------
# contract: requests the client sends, responses it reads


async def test_generate_request_matches_sglang_schema_and_fixture():
    schema = fixture("schema.json")
    expected = fixture("generate_request.json")
    async with fake_sglang({("POST", "/generate"): answer(fixture("generate_response.json"))}) as (url, log):
        async with InferenceClient([url], FAST) as client:
            sampling = {k: v for k, v in expected["sampling_params"].items() if k not in ("no_stop_trim", "skip_special_tokens")}
            await client.generate(expected["input_ids"], sampling)
    (path, sent), = log
    assert path == "/generate"
    assert set(sent) <= set(schema["GenerateReqInput"])
    assert set(sent["sampling_params"]) <= set(schema["SamplingParams"])
    assert sent == expected  # input_ids, return_logprob, no_stop_trim and skip_special_tokens=False


def test_parse_generation_reads_sglang_responses():
    g = parse_generation(fixture("generate_response.json"))
    assert g.output_ids == [19556, 17, 1073, 416, 339, 724, 47, 2]
    assert g.logprobs == [-0.8912, -0.0131, -1.2044, -0.0457, -0.0022, -0.1570, -0.6631, -0.0009]
    assert (g.finish_reason, g.matched_stop, g.weight_version, g.prompt_tokens) == ("stop", 2, "default", 20)
    assert g.text.endswith("<|im_end|>")
    assert g.meta_info["num_retractions"] == 0  # keys of newer versions are kept, not required

    g = parse_generation(fixture("generate_response_stop_str.json"))
    assert (g.finish_reason, g.matched_stop, g.weight_version) == ("stop", "</code>", "3")
    assert g.logprobs[0] == -2.31 and len(g.output_ids) == 10

    g = parse_generation(fixture("generate_response_length.json"))
    assert (g.finish_reason, g.matched_stop, len(g.output_ids)) == ("length", None, 8)


def test_parse_generation_without_output_ids_uses_logprob_ids():
    body = fixture("generate_response.json")
    del body["output_ids"]  # SGLang before 0.4.7 sent no output_ids in text mode
    assert parse_generation(body).output_ids == [19556, 17, 1073, 416, 339, 724, 47, 2]


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda b: b.pop("meta_info"), "meta_info"),
        (lambda b: b["meta_info"].pop("output_token_logprobs"), "output_token_logprobs"),
        (lambda b: b["meta_info"]["output_token_logprobs"].pop(), "disagree"),
        (lambda b: b["meta_info"].update(finish_reason={"type": "exploded"}), "finish_reason.type"),
        (lambda b: b["meta_info"].update(output_token_logprobs=[[-1.0]] * 8), "output_token_logprobs"),
    ],
)
def test_parse_generation_rejects_malformed_responses(mutate, message):
    body = fixture("generate_response.json")
    mutate(body)
    with pytest.raises(InferenceError, match=message):
        parse_generation(body)


async def test_generate_rejects_bad_arguments_before_sending():
    client = InferenceClient(["http://127.0.0.1:1"], FAST)
    with pytest.raises(ValueError, match="input_ids"):
        await client.generate([], {})
    with pytest.raises(ValueError, match="input_ids"):
        await client.generate("hello", {})
    with pytest.raises(ValueError, match="sampling"):
        await client.generate([1, 2], None)
    await client.close()


def test_client_config_errors_name_the_field():
    with pytest.raises(ValueError, match="inference.urls"):
        InferenceClient([])
    with pytest.raises(ValueError, match="inference.urls"):
        InferenceClient(["localhost:30000"])
    with pytest.raises(ValueError, match="max_connections"):
        InferenceClient(["http://a:1"], max_connections=0)


# ---------------------------------------------------------------------------------------------
# failures: retries, bad requests, unreachable servers, routing


async def test_retries_503_and_5xx_then_succeeds():
    calls = []

    async def flaky(request, log):
        calls.append(time.monotonic())
        if len(calls) == 1:
            return web.Response(status=503)
        if len(calls) == 2:
            return web.json_response({"object": "error", "message": "boom", "code": 500}, status=500)
        return web.json_response(fixture("generate_response.json"))

    async with fake_sglang({("POST", "/generate"): flaky}) as (url, _):
        async with InferenceClient([url], FAST) as client:
            g = await client.generate([1, 2, 3], {"max_new_tokens": 8})
    assert len(calls) == 3 and g.finish_reason == "stop"
    assert calls[2] - calls[1] >= calls[1] - calls[0]  # backoff grows


async def test_gives_up_after_max_retries_on_5xx():
    async with fake_sglang({("POST", "/generate"): answer({"message": "overloaded"}, status=503)}) as (url, log):
        async with InferenceClient([url], FAST) as client:
            with pytest.raises(InferenceError, match="after 4 attempts.*503.*overloaded"):
                await client.generate([1], {})
    assert len(log) == FAST.max_retries + 1


@pytest.mark.parametrize("body", ["error_generate_400.json", "error_validation_400.json"])
async def test_400_is_a_bad_request_not_retried(body):
    err = fixture(body)
    async with fake_sglang({("POST", "/generate"): answer(err, status=400)}) as (url, log):
        async with InferenceClient([url], FAST) as client:
            with pytest.raises(BadRequestError, match="HTTP 400") as e:
                await client.generate([1], {})
    assert len(log) == 1
    message = err["error"]["message"] if "error" in err else err["message"]
    assert message in str(e.value)


async def test_unreachable_server_raises_after_down_after():
    cfg = InferenceConfig(timeout=5.0, max_retries=1, backoff=0.02, down_after=0.5)
    t0 = time.monotonic()
    async with InferenceClient([dead_url()], cfg) as client:
        with pytest.raises(InferenceError, match="failed after .* attempts"):
            await client.generate([1], {})
    took = time.monotonic() - t0
    assert 0.5 <= took < 5.0  # kept retrying past max_retries until down for down_after, then stopped


async def test_routes_around_a_dead_server():
    async with fake_sglang({("POST", "/generate"): answer(fixture("generate_response.json"))}) as (url, log):
        async with InferenceClient([dead_url(), url], FAST) as client:
            gens = await asyncio.gather(*(client.generate([1, 2], {}) for _ in range(6)))
    assert all(isinstance(g, Generation) for g in gens) and len(log) == 6


async def test_least_outstanding_requests_routing():
    async def slow(request, log):
        await asyncio.sleep(0.3)
        return web.json_response(fixture("generate_response.json"))

    async with fake_sglang({("POST", "/generate"): slow}) as (url_a, log_a), \
            fake_sglang({("POST", "/generate"): slow}) as (url_b, log_b):
        async with InferenceClient([url_a, url_b], FAST) as client:
            await asyncio.gather(*(client.generate([1], {}) for _ in range(10)))
    assert (len(log_a), len(log_b)) == (5, 5)  # ten at once: split evenly

    release = asyncio.Event()
    first = []

    async def first_one_waits(request, log):
        if not first:
            first.append(1)
            await release.wait()
        return web.json_response(fixture("generate_response.json"))

    async with fake_sglang({("POST", "/generate"): first_one_waits}) as (url_a, log_a), \
            fake_sglang({("POST", "/generate"): first_one_waits}) as (url_b, log_b):
        async with InferenceClient([url_a, url_b], FAST) as client:
            busy = asyncio.ensure_future(client.generate([1], {}))  # held by whichever server got it
            while not first:
                await asyncio.sleep(0.01)
            for _ in range(4):  # one at a time: each goes to the server with nothing in flight
                await client.generate([1], {})
            release.set()
            await busy
    assert sorted([len(log_a), len(log_b)]) == [1, 4]


# ---------------------------------------------------------------------------------------------
# weight updates, health, readiness


async def test_update_weights_sends_sglang_request_to_every_server():
    schema = fixture("schema.json")
    ok = fixture("update_weights_from_disk_response_ok.json")
    routes = {("POST", "/update_weights_from_disk"): answer(ok)}
    async with fake_sglang(routes) as (url_a, log_a), fake_sglang(routes) as (url_b, log_b):
        async with InferenceClient([url_a, url_b], FAST) as client:
            await client.update_weights_from_disk("/runs/demo/weights/step_3", "3")
    for log in (log_a, log_b):
        (path, sent), = log
        assert path == "/update_weights_from_disk"
        assert set(sent) <= set(schema["UpdateWeightFromDiskReqInput"])
        assert sent == fixture("update_weights_from_disk_request.json")


async def test_update_weights_raises_when_a_server_reports_failure():
    failed = fixture("update_weights_from_disk_response_failed.json")
    ok = fixture("update_weights_from_disk_response_ok.json")
    async with fake_sglang({("POST", "/update_weights_from_disk"): answer(ok)}) as (url_a, _), \
            fake_sglang({("POST", "/update_weights_from_disk"): answer(failed, status=400)}) as (url_b, _):
        async with InferenceClient([url_a, url_b], FAST) as client:
            with pytest.raises(InferenceError, match=f"{url_b}.*repository not found"):
                await client.update_weights_from_disk("/runs/demo/weights/step_3", "3")
    # success=false with HTTP 200 is a failure too
    async with fake_sglang({("POST", "/update_weights_from_disk"): answer(failed)}) as (url, _):
        async with InferenceClient([url], FAST) as client:
            with pytest.raises(InferenceError, match="failed"):
                await client.update_weights_from_disk("/x", "1")


async def test_health():
    async def ok(request, log):
        return web.Response(status=200)

    async with fake_sglang({("GET", "/health"): ok}) as (url, _):
        async with InferenceClient([url], FAST) as client:
            assert await client.health() is True
        async with InferenceClient([url, dead_url()], FAST) as client:
            assert await client.health() is False  # every server must be healthy


async def test_wait_ready_waits_through_refused_connections_and_503():
    """SGLang refuses connections while it loads the model, then answers 503 while it warms up."""
    calls = []

    async def warming_up(request, log):
        calls.append(time.monotonic())
        return web.Response(status=503 if len(calls) < 4 else 200)

    cfg = InferenceConfig(timeout=5.0, backoff=0.01, ready_timeout=5.0)
    async with fake_sglang({("GET", "/health"): warming_up}) as (url, _):
        async with InferenceClient([url], cfg) as client:
            assert await client.wait_ready() < 5.0
    assert len(calls) == 4

    port = int(dead_url().rsplit(":", 1)[1])  # nothing listens yet; the server comes up 0.3 s later
    async with InferenceClient([f"http://127.0.0.1:{port}"], cfg) as client:
        waiting = asyncio.ensure_future(client.wait_ready())
        await asyncio.sleep(0.3)
        assert not waiting.done()
        async def ok(request):
            return web.Response(status=200)

        app = web.Application()
        app.router.add_get("/health", ok)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            assert 0.3 <= await asyncio.wait_for(waiting, 5) < 5.0
        finally:
            await runner.cleanup()


async def test_wait_ready_gives_up_at_the_deadline_or_on_a_wrong_answer():
    cfg = InferenceConfig(timeout=5.0, backoff=0.01, ready_timeout=0.3)
    async with fake_sglang({("GET", "/health"): answer({}, status=503)}) as (url, _):
        async with InferenceClient([url], cfg) as client:
            with pytest.raises(InferenceError, match=f"{url} not ready after 0 s .*inference.ready_timeout.*503"):
                await client.wait_ready()
    async with fake_sglang({}) as (url, _):  # answers 404: not an SGLang server
        async with InferenceClient([url], cfg) as client:
            with pytest.raises(InferenceError, match="/health: HTTP 404"):
                await client.wait_ready()


# ---------------------------------------------------------------------------------------------
# a router for generation, weight updates to the workers, sticky episodes


def _worker(version: list[str], delay: float = 0.0, success: bool = True,
            info_routes=("/model_info", "/get_model_info")):
    """Routes of a fake SGLang worker: an update takes `delay` s, then sets version[0]. SGLang 0.5.23 serves
    /model_info and, deprecated, /get_model_info (http_server.py: get_model_info); older ones only the latter."""

    async def update(request, log):
        await asyncio.sleep(delay)
        body = await request.json()
        if success:
            version[0] = body["weight_version"]
        return web.json_response({"success": success, "message": "ok" if success else "Failed to get weights iterator",
                                  "num_paused_requests": 0}, status=200 if success else 400)  # fmt: skip

    async def info(request, log):
        return web.json_response({"model_path": "m", "weight_version": version[0]})

    return {("POST", "/update_weights_from_disk"): update, ("GET", "/health"): answer({})} | {
        ("GET", route): info for route in info_routes}


async def test_generation_through_a_router_and_weight_updates_to_the_workers():
    router_routes = {("POST", "/generate"): answer(fixture("generate_response.json")),
                     ("GET", "/health"): answer({})}  # fmt: skip
    va, vb = ["default"], ["default"]
    async with fake_sglang(router_routes) as (router, router_log), fake_sglang(_worker(va)) as (wa, log_a), \
            fake_sglang(_worker(vb)) as (wb, log_b):
        cfg = InferenceConfig(timeout=5.0, backoff=0.01, worker_urls=[wa, wb])
        async with InferenceClient([router], cfg) as client:
            await client.wait_ready()
            await asyncio.gather(*(client.generate([1, 2], {}) for _ in range(4)))
            await client.update_weights_from_disk("/shared/weights/step_1", "1")
        # the router named as a worker: its 404 becomes one line that says what to change
        async with InferenceClient([router], InferenceConfig(timeout=5.0, worker_urls=[router])) as client:
            with pytest.raises(InferenceError, match=f"inference.worker_urls: {router} has no /update_weights_from_disk"):
                await client.update_weights_from_disk("/shared/weights/step_1", "1")
    assert [p for p, _ in router_log].count("/generate") == 4
    assert [p for p, _ in log_a if p != "/health"] == ["/update_weights_from_disk"] and va == vb == ["1"]
    assert log_b[-1][1]["model_path"] == "/shared/weights/step_1"


async def test_weight_update_is_sent_once_then_its_version_polled():
    """The load outlives the request timeout: the client polls /model_info instead of re-sending."""
    version = ["default"]
    async with fake_sglang(_worker(version, delay=1.0)) as (url, log):
        async with InferenceClient([url], InferenceConfig(timeout=0.3, backoff=0.01, ready_timeout=5.0)) as client:
            await client.update_weights_from_disk("/w/step_2", "2")
        assert [p for p, _ in log].count("/update_weights_from_disk") == 1
        assert log[-1][0] == "/model_info" and version == ["2"]
        async with InferenceClient([url], InferenceConfig(timeout=0.3, backoff=0.01, ready_timeout=0.5)) as client:
            with pytest.raises(InferenceError, match="weights /w/step_3 not confirmed after .*weight_version is 2"):
                await client.update_weights_from_disk("/w/step_3", "3")  # still loading at the deadline
    with pytest.raises(ValueError, match="must be absolute"):
        await InferenceClient([url]).update_weights_from_disk("runs/x/weights/step_1", "1")
    t0 = time.monotonic()  # a worker that is gone: given up after inference.down_after, not ready_timeout
    async with InferenceClient([dead_url()], InferenceConfig(backoff=0.01, down_after=0.3, ready_timeout=60)) as client:
        with pytest.raises(InferenceError, match="not confirmed .*ClientConnectorError"):
            await client.update_weights_from_disk("/w/step_4", "4")
    assert time.monotonic() - t0 < 5


async def test_model_info_falls_back_to_get_model_info_on_older_servers():
    version = ["default"]
    async with fake_sglang(_worker(version, delay=0.5, info_routes=("/get_model_info",))) as (url, log):
        async with InferenceClient([url], InferenceConfig(timeout=0.2, backoff=0.01, ready_timeout=5.0)) as client:
            assert (await client.model_info(client.workers[0]))["weight_version"] == "default"
            await client.update_weights_from_disk("/w/step_2", "2")  # the answer is lost: polled
            assert client.workers[0].info_route == "/get_model_info"  # the 404 is paid once
        assert version == ["2"] and [p for p, _ in log].count("/get_model_info") >= 2


def _guarded(routes: dict, api_key: str, admin_api_key: str) -> dict:
    """`routes` behind SGLang 0.5.23's key check (utils/auth.py, decide_request_auth): /health* open;
    /update_weights_from_disk is ADMIN_OPTIONAL (http_server.py), so with an admin key only that key opens it;
    every other route (NORMAL) needs the API key, which the admin key does not replace."""

    def check(path, handler):
        async def h(request, log):
            want = admin_api_key if path == "/update_weights_from_disk" else api_key
            if not path.startswith("/health") and request.headers.get("Authorization") != f"Bearer {want}":
                return web.json_response({"error": "Unauthorized"}, status=401)
            return await handler(request, log)

        return h

    return {(m, path): check(path, handler) for (m, path), handler in routes.items()}


async def test_admin_key_opens_weight_updates_and_the_api_key_the_rest(monkeypatch):
    version = ["default"]
    routes = _guarded(_worker(version) | {("POST", "/generate"): answer(fixture("generate_response.json"))},
                      api_key="user-key", admin_api_key="admin-key")
    monkeypatch.setenv("L0_TEST_KEY", "user-key")
    monkeypatch.setenv("L0_TEST_ADMIN_KEY", "admin-key")
    both = InferenceConfig(timeout=5.0, api_key_env="L0_TEST_KEY", admin_api_key_env="L0_TEST_ADMIN_KEY")
    async with fake_sglang(routes) as (url, log):
        async with InferenceClient([url], both) as client:
            await client.wait_ready()
            await client.generate([1, 2], {})
            await client.update_weights_from_disk("/w/step_1", "1")
            assert (await client.model_info(client.workers[0]))["weight_version"] == "1"
        async with InferenceClient([url], dataclasses.replace(both, admin_api_key_env="")) as client:
            await client.generate([1, 2], {})  # the API key alone still generates, but cannot update
            with pytest.raises(InferenceError, match="HTTP 401.*inference.admin_api_key_env"):
                await client.update_weights_from_disk("/w/step_2", "2")
    assert version == ["1"]
    monkeypatch.delenv("L0_TEST_ADMIN_KEY")
    with pytest.raises(ValueError, match="inference.admin_api_key_env: the environment variable L0_TEST_ADMIN_KEY"):
        InferenceClient(["http://127.0.0.1:1"], both)


async def test_sync_weights_keeps_the_previous_folder_until_every_worker_confirmed(tmp_path, monkeypatch):
    from l0_min.runtime import sync_weights

    for n in (1, 2):
        (tmp_path / "weights" / f"step_{n}").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    ok, bad = ["default"], ["default"]
    async with fake_sglang(_worker(ok)) as (url_ok, log), fake_sglang(_worker(bad, success=False)) as (url_bad, _):
        async with InferenceClient([url_ok], InferenceConfig(timeout=5.0, worker_urls=[url_ok, url_bad])) as client:
            with pytest.raises(InferenceError, match="Failed to get weights iterator"):
                await sync_weights(client, Path("weights/step_2"), "2")
        assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["step_1", "step_2"]
        async with InferenceClient([url_ok], InferenceConfig(timeout=5.0)) as client:
            await sync_weights(client, Path("weights/step_2"), "2")
    assert [p.name for p in (tmp_path / "weights").iterdir()] == ["step_2"]
    assert log[-1][1]["model_path"] == str(tmp_path / "weights" / "step_2")  # absolute, whatever the cwd


async def test_an_episode_stays_on_one_server_and_episodes_spread():
    from l0_min.inference import ROUTING_HEADER, episode_key

    seen = {}

    def server(name):
        async def gen(request, log):
            seen.setdefault(request.headers[ROUTING_HEADER], []).append(name)
            await asyncio.sleep(0.05)
            return web.json_response(fixture("generate_response.json"))

        return {("POST", "/generate"): gen}

    async def episode(client, n):
        episode_key.set(f"together#{n}")
        for turn in range(3):
            await asyncio.sleep(0.01 * n)
            await asyncio.wait_for(client.generate([1, 2 + turn], {}), 5)  # wait_for: a task of its own

    async with fake_sglang(server("a")) as (url_a, log_a), fake_sglang(server("b")) as (url_b, log_b):
        async with InferenceClient([url_a, url_b], FAST) as client:
            for turn in range(3):  # three episodes take turns, one request at a time: per-request
                for n in range(3):  # balancing would move every episode between the two servers
                    episode_key.set(f"interleaved#{n}")
                    await client.generate([1, 2 + turn], {})
            assert (len(log_a), len(log_b)) == (6, 3)
            await asyncio.gather(*(episode(client, n) for n in range(4)))  # four at once: two per server
    assert len(seen) == 7 and all(len(set(servers)) == 1 for servers in seen.values())
    assert (len(log_a), len(log_b)) == (12, 9)


# ---------------------------------------------------------------------------------------------
# the same client against the embedded server (real HTTP)


@pytest.mark.slow
async def test_client_against_embedded_server(tiny_server_url):
    async with InferenceClient([tiny_server_url], FAST) as client:
        assert await client.health() and await client.wait_ready() < 5
        prompt = list(b"<|im_start|>user\nhello<|im_end|>\n")
        prompt = [b + 3 for b in prompt]  # tiny-random's byte tokenizer: id = byte + 3
        g = await client.generate(prompt, {"max_new_tokens": 12, "temperature": 0.0})
        assert len(g.output_ids) == len(g.logprobs) == 12
        assert g.finish_reason == "length" and g.prompt_tokens == len(prompt)
        assert g.weight_version == "default" and all(lp <= 0.0 for lp in g.logprobs)
        again = await client.generate(prompt, {"max_new_tokens": 12, "temperature": 0.0})
        assert again.output_ids == g.output_ids  # greedy is deterministic

        # stop at a token id: the stop token is returned (no_stop_trim) and reported
        stop_id = g.output_ids[4]
        first = g.output_ids.index(stop_id)
        s = await client.generate(prompt, {"max_new_tokens": 12, "temperature": 0.0, "stop_token_ids": [stop_id]})
        assert s.output_ids == g.output_ids[: first + 1]
        assert (s.finish_reason, s.matched_stop) == ("stop", stop_id)

        # a bad sampling parameter comes back as BadRequestError naming it
        with pytest.raises(BadRequestError, match="sampling_params.top_p"):
            await client.generate(prompt, {"top_p": 0.0})
