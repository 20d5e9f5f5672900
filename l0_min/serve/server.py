"""The embedded CPU inference server: SGLang's native HTTP API over transformers, for machines without a GPU.

    python -m l0_min.serve --model smollm2-135m --port 30000

The subset of SGLang's `http_server.py` l0_min uses, same JSON: /generate, /update_weights_from_disk (`UpdateLock`),
/health (503 until the engine runs), /health_generate, /model_info (/get_model_info before 0.5.x),
/get_weight_version, /flush_cache. Bad requests get SGLang's 400 bodies, naming the field; fields SGLang has and
this server does not implement are accepted only at their default. It listens on 127.0.0.1 unless told otherwise;
with `--api-key KEY` every request but /health* needs `Authorization: Bearer KEY`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import hmac
import logging
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from http import HTTPStatus
from pathlib import Path

from aiohttp import web

from l0_min.config import is_number

log = logging.getLogger("l0_min.serve")
STATE = web.AppKey("l0_min_state", dict)

READY_RE = re.compile(r"l0_min\.serve ready at (http://\S+)")


class RequestError(ValueError):
    """A bad request; `schema` (unparsable body, wrong JSON type) picks the body (see the module doc)."""

    def __init__(self, message: str, schema: bool = False):
        super().__init__(message)
        self.schema = schema


# ---- request schema: SGLang's GenerateReqInput, SamplingParams (srt/managers/io_struct.py, sampling_params.py)

# accepted and without effect here
IGNORED_FIELDS = {"log_metrics", "priority", "routing_key", "conversation_id", "extra_key", "cache_salt",
                  "custom_labels", "no_logs", "external_trace_header", "received_time", "routed_dp_rank",
                  "data_parallel_rank", "modalities", "background"}
# SGLang features not implemented here: accepted only at their default value
UNSUPPORTED_FIELDS = {"stream": (False,), "logprob_start_len": (-1,), "top_logprobs_num": (0,),
                      "token_ids_logprob": (), "input_embeds": (), "image_data": (), "video_data": (),
                      "audio_data": (), "lora_path": (), "lora_id": (), "session_params": (), "session_id": (),
                      "custom_logit_processor": (), "return_hidden_states": (False,),
                      "return_routed_experts": (False,), "return_entropy": (False,),
                      "return_prompt_token_ids": (False,), "return_sampling_mask": (False,),
                      "bootstrap_host": (), "bootstrap_port": (), "bootstrap_room": ()}
GENERATE_FIELDS = {"text", "input_ids", "sampling_params", "return_logprob", "return_text_in_logprobs", "rid"}

SAMPLING_FIELDS = {"max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids",
                   "ignore_eos", "skip_special_tokens", "no_stop_trim", "n", "spaces_between_special_tokens"}
UNSUPPORTED_SAMPLING = {"frequency_penalty": (0, 0.0), "presence_penalty": (0, 0.0), "repetition_penalty": (1, 1.0),
                        "min_new_tokens": (0,), "json_schema": (), "regex": (), "ebnf": (), "structural_tag": (),
                        "stop_regex": (), "logit_bias": (), "custom_params": (), "stream_interval": (),
                        "sampling_seed": ()}


_is_int = functools.partial(is_number, integer=True)
# JSON type checks by the name a message gives them
_TYPES = {
    "an integer": _is_int,
    "a number": is_number,
    "a boolean": lambda x: isinstance(x, bool),
    "a string or a list of strings": lambda x: isinstance(x, str) or (isinstance(x, list)
                                                                     and all(isinstance(s, str) for s in x)),
    "a list of integers": lambda x: isinstance(x, list) and all(_is_int(t) for t in x),
}


def _fields(obj: dict, where: str, known: set, unsupported: dict, unknown_message: str) -> None:
    """Unknown fields are schema errors; unsupported ones only pass at their default value."""
    if unknown := sorted(set(obj) - known - set(unsupported)):
        raise RequestError(f"{where}{unknown[0]}: {unknown_message}", schema=True)
    for key, defaults in unsupported.items():
        if obj.get(key) is not None and obj[key] not in defaults:
            raise RequestError(f"{where}{key}={obj[key]!r} is not supported by the embedded server (l0_min.serve)")


def parse_sampling_params(sp, where: str, context_length: int):
    """JSON sampling_params -> (engine SamplingParams, n). Raises RequestError naming the field."""
    from l0_min.serve.engine import TOP_K_ALL, SamplingParams

    sp = {} if sp is None else sp
    if not isinstance(sp, dict):
        raise RequestError(f"{where}: expected an object, got {type(sp).__name__}", schema=True)
    _fields(sp, f"{where}.", SAMPLING_FIELDS, UNSUPPORTED_SAMPLING,
            f"unknown sampling parameter (known: {', '.join(sorted(SAMPLING_FIELDS))})")

    def get(key, default, kind):
        if (value := sp.get(key)) is None:
            return default
        if not _TYPES[kind](value):
            raise RequestError(f"{where}.{key}: expected {kind}, got {value!r}", schema=True)
        return value

    p = SamplingParams(
        # SGLang: 128 when absent; null means no limit but the context length
        max_new_tokens=get("max_new_tokens", 128 if "max_new_tokens" not in sp else context_length, "an integer"),
        temperature=float(get("temperature", 1.0, "a number")), top_p=float(get("top_p", 1.0, "a number")),
        top_k=get("top_k", -1, "an integer"), min_p=float(get("min_p", 0.0, "a number")),
        ignore_eos=get("ignore_eos", False, "a boolean"), no_stop_trim=get("no_stop_trim", False, "a boolean"),
        skip_special_tokens=get("skip_special_tokens", True, "a boolean"))
    get("spaces_between_special_tokens", True, "a boolean")
    stop = get("stop", [], "a string or a list of strings")
    p.stop = [stop] if isinstance(stop, str) else [s for s in stop if s]
    p.stop_token_ids = list(get("stop_token_ids", [], "a list of integers"))
    n = get("n", 1, "an integer")
    p.top_k = TOP_K_ALL if p.top_k == -1 else p.top_k
    # value checks, SGLang's wording (SamplingParams.verify)
    for ok, message in [
        (math.isfinite(p.temperature) and p.temperature >= 0.0,
         f"temperature must be a non-negative finite number, got {p.temperature}."),
        (0.0 < p.top_p <= 1.0, f"top_p must be in (0, 1], got {p.top_p}."),
        (0.0 <= p.min_p <= 1.0, f"min_p must be in [0, 1], got {p.min_p}."),
        (p.top_k >= 1, f"top_k must be -1 (disable) or at least 1, got {p.top_k}."),
        (p.max_new_tokens >= 0, f"max_new_tokens must be at least 0, got {p.max_new_tokens}."),
        (n >= 1, f"n must be at least 1, got {n}."),
    ]:
        if not ok:
            raise RequestError(f"{where}.{message}")
    return p, n


def parse_generate(body, tokenizer, context_length: int = 1 << 30) -> tuple[list, bool]:
    """A /generate body -> ([(prompt ids, SamplingParams, rid)], single). Prompts are expanded n times
    in SGLang's order (prompt-major: p0 s0, p0 s1, ..., p1 s0, ...)."""
    if not isinstance(body, dict):
        raise RequestError(f"request body: expected a JSON object, got {type(body).__name__}", schema=True)
    _fields(body, "", GENERATE_FIELDS | IGNORED_FIELDS, UNSUPPORTED_FIELDS,
            f"unknown field (this server reads: {', '.join(sorted(GENERATE_FIELDS))})")
    for key in ("return_logprob", "return_text_in_logprobs"):
        if body.get(key) is not None and not isinstance(body[key], bool):
            raise RequestError(f"{key}: expected a boolean, got {body[key]!r}", schema=True)

    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise RequestError("Either text or input_ids should be provided (exactly one of them).")
    if ids is not None:
        if not isinstance(ids, list):
            raise RequestError(f"input_ids: expected a list of token ids, got {type(ids).__name__}", schema=True)
        single = not ids or not isinstance(ids[0], list)  # [] is one empty prompt: refused below
        prompts = [ids] if single else ids
        for i, p in enumerate(prompts):
            where = "input_ids" if single else f"input_ids[{i}]"
            if not isinstance(p, list) or not all(_is_int(t) for t in p):
                raise RequestError(f"{where}: expected a list of integers", schema=True)
            if not p:
                raise RequestError(f"{where} cannot be empty.")
    else:
        single = isinstance(text, str)
        texts = [text] if single else text
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
            raise RequestError("text: expected a string or a non-empty list of strings", schema=True)
        prompts = [tokenizer.encode(t) for t in texts]

    sp = body.get("sampling_params")
    if isinstance(sp, list):
        if single or len(sp) != len(prompts):
            raise RequestError(f"sampling_params: a list must have one entry per prompt ({len(prompts)}), got {len(sp)}")
        params = [parse_sampling_params(s, f"sampling_params[{i}]", context_length) for i, s in enumerate(sp)]
    else:
        params = [parse_sampling_params(sp, "sampling_params", context_length)] * len(prompts)
    if len({n for _, n in params}) > 1:
        raise RequestError("The parallel_sample_num should be the same for all samples in sample params.")
    n = params[0][1]

    rid, total = body.get("rid"), len(prompts) * n
    if rid is None:
        rids = [uuid.uuid4().hex for _ in range(total)]
    elif isinstance(rid, str):
        rids = [rid] if total == 1 else [f"{rid}_{i}" for i in range(total)]
    elif isinstance(rid, list) and all(isinstance(r, str) for r in rid) and len(rid) == len(prompts):
        rids = [r if n == 1 else f"{r}_{j}" for r in rid for j in range(n)]
    else:
        raise RequestError("rid: expected a string or one string per prompt", schema=True)
    items = [(prompt, p) for prompt, (p, _) in zip(prompts, params) for _ in range(n)]
    return [(prompt, p, r) for (prompt, p), r in zip(items, rids)], single and n == 1


def render(seq, rid: str, tokenizer, return_logprob: bool, text_in_logprobs: bool, started: float) -> dict:
    """An engine Sequence -> SGLang's /generate response object."""
    p, ids = seq.params, seq.output_ids
    finish = {k: v for k, v in seq.finish_reason.items() if k != "status_code"}
    matched = finish.get("matched")
    trim_token = not p.no_stop_trim and finish.get("type") == "stop" and isinstance(matched, int) and ids
    text = tokenizer.decode(ids[:-1] if trim_token else ids, skip_special_tokens=p.skip_special_tokens)
    if not p.no_stop_trim and isinstance(matched, str) and matched in text:
        text = text[: text.find(matched)]
    meta = {"id": rid, "finish_reason": finish, "prompt_tokens": len(seq.input_ids),
            "weight_version": seq.weight_version}
    if return_logprob:
        texts = [tokenizer.decode([t]) for t in ids] if text_in_logprobs else [None] * len(ids)
        meta["input_token_logprobs"] = []
        meta["output_token_logprobs"] = [[lp, t, s] for lp, t, s in zip(seq.logprobs, ids, texts)]
    meta.update(completion_tokens=len(ids), cached_tokens=seq.cached_tokens, e2e_latency=time.time() - started)
    return {"text": text, "output_ids": list(ids), "meta_info": meta}


# --------------------------------------------------------------------------------- the HTTP app
class UpdateLock:
    """Many requests at once, or one weight update alone (SGLang's model_update_lock). An update holds
    the gate from the moment it waits, so new requests queue behind it and a steady stream of them
    cannot starve it; it runs once the requests already in are done."""

    def __init__(self):
        self._gate = asyncio.Lock()
        self._idle = asyncio.Event()  # set while no request holds the lock
        self._idle.set()
        self._readers = 0

    @contextlib.asynccontextmanager
    async def reading(self):
        async with self._gate:
            self._readers += 1
            self._idle.clear()
        try:
            yield
        finally:
            self._readers -= 1
            if not self._readers:
                self._idle.set()

    @contextlib.asynccontextmanager
    async def writing(self):
        async with self._gate:
            await self._idle.wait()
            yield


def schema_error_body(message: str, code: int = 400) -> dict:
    """SGLang's (FastAPI) validation / HTTPException error (`ErrorResponse`)."""
    return {"object": "error", "message": message, "type": HTTPStatus(code).phrase, "param": None, "code": code}


@web.middleware
async def errors(request, handler):
    """A RequestError is a 400 in SGLang's shape; any other exception a 500 (the server stays up)."""
    try:
        return await handler(request)
    except RequestError as e:
        body = schema_error_body(str(e)) if e.schema else {"error": {"message": str(e)}}  # _create_error_response
        return web.json_response(body, status=400)
    except (web.HTTPException, asyncio.CancelledError):
        raise
    except Exception as e:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return web.json_response(schema_error_body(f"internal server error: {e!r}", 500), status=500)


def api_key_middleware(api_key: str | None):
    @web.middleware
    async def check_api_key(request, handler):  # as SGLang's add_api_key_middleware
        if api_key and request.method != "OPTIONS" and not request.path.startswith(("/health", "/metrics")):
            if not hmac.compare_digest(request.headers.get("Authorization", "").encode(), f"Bearer {api_key}".encode()):
                return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)
    return check_api_key


UPDATE_FIELDS = {"model_path", "load_format", "abort_all_requests", "weight_version", "is_async", "torch_empty_cache",
                 "keep_pause", "recapture_cuda_graph", "token_step", "flush_cache", "manifest"}


def parse_update(body) -> tuple[str, str | None]:
    """(model_path, weight_version) of an /update_weights_from_disk body, or one RequestError naming every problem."""
    if not isinstance(body, dict):
        raise RequestError("request body: expected a JSON object", schema=True)
    unknown = sorted(set(body) - UPDATE_FIELDS)
    problems = [f"{unknown[0]}: unknown field"] if unknown else []
    path, version = body.get("model_path"), body.get("weight_version")
    if not isinstance(path, str) or not path:
        problems.append(f"model_path: expected a non-empty string, got {path!r}")
    if version is not None and not isinstance(version, str):
        problems.append(f"weight_version: expected a string, got {version!r}")
    if body.get("load_format") not in (None, "auto", "safetensors"):
        problems.append(f"load_format={body['load_format']!r} is not supported (auto, safetensors)")
    if problems:
        raise RequestError("; ".join(problems), schema=True)
    return path, version


def make_app(engine, model_path: str, tokenizer_path: str, api_key: str | None = None):
    from l0_min.serve.engine import SamplingParams, Sequence

    tokenizer = engine.tokenizer
    state = {"model_path": model_path, "tokenizer_path": tokenizer_path, "lock": UpdateLock(), "closing": False}

    async def json_body(request):
        try:
            return await request.json()
        except ValueError as e:
            raise RequestError(f"request body is not valid JSON: {e}", schema=True) from None

    async def run(seqs: list) -> list:
        """Submit to the engine and wait; aborts them if the client goes away (handler cancelled)."""
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in seqs]
        for seq, fut in zip(seqs, futures):
            seq.on_done = lambda s, fut=fut: loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(s))
            engine.submit(seq)
        try:
            return await asyncio.gather(*futures)
        except asyncio.CancelledError:
            for seq in seqs:
                engine.abort(seq.rid)
            raise

    async def generate(request):
        started = time.time()
        body = await json_body(request)
        try:
            items, single = parse_generate(body, tokenizer, engine.context_length)
            seqs = [Sequence(rid=uuid.uuid4().hex, input_ids=list(ids), params=p) for ids, p, _ in items]
            for seq in seqs:
                engine.validate(seq)
        except RequestError:
            raise
        except ValueError as e:  # what the engine cannot run, or the tokenizer cannot encode: /generate's error body
            raise RequestError(str(e)) from None
        if state["closing"]:
            return web.json_response(schema_error_body("server is shutting down", 503), status=503)
        async with state["lock"].reading():
            done = await run(seqs)
        for seq in done:
            if seq.finish_reason["type"] == "abort" and (code := seq.finish_reason.get("status_code")) in (500, 503):
                return web.json_response(schema_error_body(seq.finish_reason["message"], code), status=code)
        logprob, text_in_logprobs = bool(body.get("return_logprob")), bool(body.get("return_text_in_logprobs"))
        outs = [render(seq, rid, tokenizer, logprob, text_in_logprobs, started)
                for seq, (_, _, rid) in zip(done, items)]
        return web.json_response(outs[0] if single else outs)

    async def health(request):
        return web.Response(status=200 if engine.alive and not state["closing"] else 503)

    async def health_generate(request):
        if not engine.alive or state["closing"]:
            return web.Response(status=503)
        seq = Sequence(f"HEALTH_CHECK_{uuid.uuid4().hex}", [0], SamplingParams(max_new_tokens=1, temperature=0.0))
        try:
            (seq,) = await asyncio.wait_for(run([seq]), timeout=20)
        except asyncio.TimeoutError:
            return web.Response(status=503)
        return web.Response(status=200 if seq.finish_reason["type"] != "abort" else 503)

    async def get_model_info(request):
        return web.json_response({"model_path": state["model_path"], "tokenizer_path": state["tokenizer_path"],
                                  "is_generation": True, "preferred_sampling_params": None,
                                  "weight_version": engine.weight_version})

    async def get_weight_version(request):
        return web.json_response({"weight_version": engine.weight_version})

    async def flush_cache(request):
        ok = await asyncio.wrap_future(engine.call(engine.flush_cache))
        text = ("Cache flushed.\nPlease check backend logs for more details. "
                "(When there are running or waiting requests, the operation will not be performed.)\n")
        return web.Response(text=text, status=200 if ok else 400)

    async def update_weights_from_disk(request):
        body = await json_body(request)
        path, version = parse_update(body)
        if body.get("abort_all_requests"):
            engine.abort()
        async with state["lock"].writing():
            try:
                await asyncio.wrap_future(engine.call(lambda: engine.load_weights(path, version)))
            except Exception as e:  # any reason the folder cannot be loaded: SGLang's success=false answer
                content = {"success": False, "message": f"Failed to update weights: {e}", "num_paused_requests": 0}
                return web.json_response(content, status=400)
        state["model_path"] = path
        note = "" if version is None else f" Weight version updated to {version}."
        return web.json_response({"success": True, "message": "Succeeded to update model weights." + note,
                                  "num_paused_requests": 0})

    app = web.Application(middlewares=[api_key_middleware(api_key), errors], client_max_size=256 * 1024 * 1024)
    app.add_routes([web.post("/generate", generate), web.put("/generate", generate), web.get("/health", health),
                    web.get("/health_generate", health_generate), web.get("/model_info", get_model_info),
                    web.get("/get_model_info", get_model_info),
                    web.get("/get_weight_version", get_weight_version),
                    web.get("/flush_cache", flush_cache, allow_head=False), web.post("/flush_cache", flush_cache),
                    web.post("/update_weights_from_disk", update_weights_from_disk)])
    app[STATE] = state
    return app


# ---------------------------------------------------------------------------------- entry point
def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m l0_min.serve", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="an HF folder, or smollm2-135m, or tiny-random")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--api-key", default=None, help="require Authorization: Bearer KEY (all but /health*)")
    ap.add_argument("--port", type=int, default=30000, help="0 picks a free port (printed in the ready line)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--max-running-requests", type=int, default=128)
    ap.add_argument("--max-total-tokens", type=int, default=0, help="keys/values of the running batch, in tokens: "
                    "rows x their longest prompt + max_new_tokens (0: a sixteenth of the machine's memory)")
    ap.add_argument("--prefill-chunk", type=int, default=2048, help="prompt tokens prefilled per engine step")
    ap.add_argument("--prefix-cache-tokens", type=int, default=-1, help="tokens of computed sequences kept for reuse "
                    "(-1: a sixteenth of the machine's memory; 0: off)")
    ap.add_argument("--weight-version", default="default")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--parent-pid", type=int, default=0, help="exit when this process is gone")
    ap.add_argument("--log-level", default="info")
    return ap.parse_args(argv)


async def _serve(args) -> None:
    from l0_min.models import load_model, resolve_model  # models imports torch only when it loads one

    t0 = time.time()
    path = resolve_model(args.model)  # before the slow imports: a wrong path fails at once

    import torch

    from l0_min.serve.engine import Engine

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model, tokenizer = load_model(path, dtype=args.dtype)
    engine = Engine(model, tokenizer, max_running=args.max_running_requests, max_total_tokens=args.max_total_tokens,
                    prefill_chunk=args.prefill_chunk, prefix_cache_tokens=args.prefix_cache_tokens,
                    weight_version=args.weight_version).start()
    log.info("loaded %s (%s) in %.1fs, %d torch threads; keys/values: batch %d tokens, prefix cache %d tokens",
             args.model, path, time.time() - t0, torch.get_num_threads(), engine.max_total_tokens,
             engine.prefix_cache.max_tokens)
    app = make_app(engine, str(path), str(path), api_key=args.api_key)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None if args.log_level != "debug" else log)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    print(f"l0_min.serve ready at http://{args.host}:{site._server.sockets[0].getsockname()[1]}", flush=True)

    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)

    async def watch_parent():
        while os.getppid() == args.parent_pid:
            await asyncio.sleep(1.0)
        log.warning("parent process %d is gone, shutting down", args.parent_pid)
        stop.set()

    watcher = asyncio.create_task(watch_parent()) if args.parent_pid else None
    await stop.wait()
    if watcher:
        watcher.cancel()
    app[STATE]["closing"] = True
    engine.stop()
    await runner.cleanup()


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    asyncio.run(_serve(args))


# ------------------------------------------------------------- starting it from another process
class ServerStartError(RuntimeError):
    pass


def start_server_process(model: str, port: int = 0, extra_args=(), *, host: str = "127.0.0.1",
                         timeout: float = 300.0, log_path: str | Path | None = None):
    """(Popen, url) of `python -m l0_min.serve` once /health answers 200; its output goes to `log_path` (default a
    temp file, `proc.log_path`), whose tail a ServerStartError carries. It exits on its own when this process does."""
    if log_path is None:
        fd, log_path = tempfile.mkstemp(prefix="l0_min_serve_", suffix=".log")
        os.close(fd)
    log_path = Path(log_path)
    root = str(Path(__file__).resolve().parents[2])
    # waiting OpenMP threads sleep, not spin: on few cores a spinning one holds a core the kernels and host loop need
    env = {"OMP_WAIT_POLICY": "PASSIVE", **os.environ,
           "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "l0_min.serve", "--model", str(model), "--host", host, "--port", str(port),
           "--parent-pid", str(os.getpid()), *map(str, extra_args)]
    with open(log_path, "wb") as logf:
        # its own session: train.py's Ctrl-C must not kill it mid-step (it exits with its parent: --parent-pid)
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    proc.log_path = log_path

    def fail(why: str):
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-40:])
        return ServerStartError(f"embedded server ({' '.join(cmd)}) {why}; last lines of {log_path}:\n{tail}")

    deadline, url = time.time() + timeout, None
    while time.time() < deadline:
        if proc.poll() is not None:
            raise fail(f"exited with code {proc.returncode} before it was ready")
        if url is None and (m := READY_RE.search(log_path.read_text(errors="replace"))):
            url = m.group(1)
        if url is not None:
            with contextlib.suppress(OSError), urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return proc, url
        time.sleep(0.2)
    stop_server_process(proc)
    raise fail(f"not ready after {timeout:.0f}s")


def stop_server_process(proc, timeout: float = 10.0) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
