"""The SGLang HTTP client: token ids in, sampled token ids and their log-probs out, over SGLang's native API, so
one code path drives SGLang on GPUs, an sglang-router, or the embedded CPU server (`python -m l0_min.serve`).

    client = InferenceClient(["http://127.0.0.1:30000"], cfg.inference, max_connections=64)
    await client.wait_ready()                    # SGLang takes minutes to load: 503 until then
    gen = await client.generate(context_ids, {"max_new_tokens": 512, "temperature": 1.0, "stop": ["</code>"]})

Requests send `input_ids` with `return_logprob`, `no_stop_trim`, `skip_special_tokens=False`: the returned ids are
all the sampled ids. An episode's requests (`episode_key`) go to one server. Connection errors, timeouts and 5xx are
retried until `down_after` seconds of outage; a 4xx raises BadRequestError at once; a weight update is never
re-sent: when its answer is lost, the worker's version is polled until it reports the new one.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import itertools
import json
import logging
import os
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import aiohttp

from l0_min.config import InferenceConfig

log = logging.getLogger("l0_min.inference")

MAX_BACKOFF = 30.0
SKIP_FAILED_SERVER_FOR = 5.0  # seconds a server that failed a connection is passed over (if others are up)
ROUTING_HEADER = "X-SMG-Routing-Key"  # sglang-router (smg) --policy consistent_hashing routes on it
episode_key: contextvars.ContextVar[str | None] = contextvars.ContextVar("l0_min_episode_key", default=None)


@dataclass
class Generation:
    output_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length" | "abort"
    matched_stop: object = None  # the stop string / token id that matched, if any
    weight_version: str = ""
    text: str = ""
    prompt_tokens: int = 0
    meta_info: dict = field(default_factory=dict, repr=False)  # the server's whole meta_info


class _IdText(dict):
    """Token id -> its JSON text (str(i)), filled as ids are seen: joining these is several times
    faster than json.dumps on a long list of ints. Only exact ints are looked up (a bool would hit 0/1)."""

    def __missing__(self, i: int) -> str:
        text = int.__repr__(i)
        if 0 <= i < 1 << 22:  # a vocabulary's worth; anything else is not kept
            self[i] = text
        return text


_ID_TEXT = _IdText()
_JSON_HEADERS = {"Content-Type": "application/json"}  # what aiohttp's json= sends


class InferenceError(RuntimeError):
    """The server(s) stayed unreachable / kept failing after retries, or answered something unusable."""


class BadRequestError(InferenceError):
    """The server refused the request (HTTP 4xx); retrying would not help. The message is the server's."""


@dataclass
class _Server:
    url: str
    outstanding: int = 0
    down_since: float | None = None  # first failure of the current outage
    last_failure: float = 0.0
    info_route: str = "/model_info"  # "/get_model_info" on a server that answers 404 to it

    def failed(self) -> None:
        self.last_failure = time.monotonic()
        self.down_since = self.down_since or self.last_failure


class _Retry(Exception):
    """One attempt failed in a way worth retrying (`answered`: the server sent a 5xx)."""

    def __init__(self, message: str, unreachable: bool, answered: bool = False):
        super().__init__(message)
        self.unreachable, self.answered = unreachable, answered


def parse_generation(body) -> Generation:
    """SGLang's /generate response object -> Generation. Raises InferenceError naming a missing field."""
    meta = body.get("meta_info") if isinstance(body, dict) else None
    if not isinstance(meta, dict):
        raise InferenceError(f"/generate response has no meta_info: {str(body)[:200]}")
    entries = meta.get("output_token_logprobs")
    if not isinstance(entries, list):
        raise InferenceError("/generate response has no meta_info.output_token_logprobs (was return_logprob sent?)")
    try:
        logprobs = [float(e[0]) for e in entries]
        ids_from_logprobs = [int(e[1]) for e in entries]
    except (TypeError, ValueError, IndexError) as e:
        raise InferenceError(f"meta_info.output_token_logprobs: expected [logprob, token_id, text] entries ({e})") \
            from None
    output_ids = body.get("output_ids", ids_from_logprobs)  # older SGLang versions omit output_ids
    if list(output_ids) != ids_from_logprobs:
        raise InferenceError(f"output_ids ({len(output_ids)}) and meta_info.output_token_logprobs ({len(entries)}) "
                             "disagree")  # fmt: skip
    finish = meta.get("finish_reason")
    finish = {"type": finish} if isinstance(finish, str) else finish  # some SGLang-compatible servers send a string
    if not isinstance(finish, dict) or finish.get("type") not in ("stop", "length", "abort"):
        raise InferenceError(f"meta_info.finish_reason.type: expected stop, length or abort, got {finish!r}")
    return Generation(list(output_ids), logprobs, finish["type"], finish.get("matched"),
                      weight_version=str(meta.get("weight_version") or ""), text=body.get("text") or "",
                      prompt_tokens=int(meta.get("prompt_tokens") or 0), meta_info=meta)  # fmt: skip


def _error_message(text: str) -> str:
    """The message of an SGLang error body ({"error": {"message"}} or {"message"}), else the raw text."""
    with contextlib.suppress(ValueError):
        body = json.loads(text)
        for d in (body.get("error"), body) if isinstance(body, dict) else ():
            if isinstance(d, dict) and "message" in d:
                return str(d["message"])
    return text.strip()[:1000]


def _servers(urls, field: str) -> list[_Server]:
    for u in urls:
        if not isinstance(u, str) or not u.startswith(("http://", "https://")):
            raise ValueError(f"{field}: expected http(s)://host:port, got {u!r}")
    return [_Server(u.rstrip("/")) for u in urls]


class InferenceClient(contextlib.AbstractAsyncContextManager):
    def __init__(self, urls: list[str], cfg: InferenceConfig | None = None, max_connections: int = 256):
        if not urls:
            raise ValueError("inference.urls: at least one server URL is needed")
        if max_connections < 1:
            raise ValueError(f"max_connections: expected at least 1, got {max_connections}")
        self.cfg = cfg or InferenceConfig()
        for setting in ("api_key_env", "admin_api_key_env"):  # each names an environment variable holding a key
            if (name := getattr(self.cfg, setting)) and not os.environ.get(name):
                raise ValueError(f"inference.{setting}: the environment variable {name} is not set")
        key, admin = (os.environ.get(name, "") if name else "" for name in (self.cfg.api_key_env, self.cfg.admin_api_key_env))
        self._headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._admin = {"Authorization": f"Bearer {admin}"} if admin else {}  # replaces the session's header
        self.servers = _servers(urls, "inference.urls")
        self.workers = _servers(self.cfg.worker_urls, "inference.worker_urls") or self.servers
        self.max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None
        self._rr = itertools.count()
        self._sticky: OrderedDict[str, _Server] = OrderedDict()  # episode key -> its server (LRU)

    async def generate(self, input_ids: list[int], sampling: dict) -> Generation:
        """Sample a continuation of `input_ids` under SGLang `sampling` params."""
        exact = isinstance(input_ids, list) and set(map(type, input_ids)) == {int}  # the usual case, one pass in C
        if not exact and not (isinstance(input_ids, list) and input_ids and all(isinstance(i, int) for i in input_ids)):
            raise ValueError("input_ids: expected a non-empty list of token ids")
        if not isinstance(sampling, dict):
            raise ValueError(f"sampling: expected a dict of SGLang sampling_params, got {type(sampling).__name__}")
        rest = {"sampling_params": {**sampling, "no_stop_trim": True, "skip_special_tokens": False},
                "return_logprob": True}
        # the bytes of json.dumps({"input_ids": input_ids, **rest}), several times faster (a bool is sent as its int)
        ids = input_ids if exact else list(map(int, input_ids))
        payload = f'{{"input_ids": [{", ".join(map(_ID_TEXT.__getitem__, ids))}], {json.dumps(rest)[1:]}'.encode()
        return parse_generation(await self._generate(payload, episode_key.get()))

    async def update_weights_from_disk(self, path: str, weight_version: str) -> None:
        """Every worker loads the HF folder `path`; raises InferenceError if one reports failure or does
        not confirm the version within inference.ready_timeout. `path` must be absolute: SGLang resolves
        a relative one against its own working directory, and then tries it as a hub id."""
        if not os.path.isabs(path):
            raise ValueError(f"weights path must be absolute (servers resolve it in their own folder): {path}")
        payload = {"model_path": str(path), "weight_version": str(weight_version), "flush_cache": True,
                   "abort_all_requests": False}

        async def one(server: _Server):
            route, failed = "/update_weights_from_disk", f"{server.url}: update_weights_from_disk({path}) failed"
            try:  # one POST, never re-sent: a second one would queue a second full load
                status, body = await self._attempt(server, "POST", route, (200, 400), json=payload, headers=self._admin)
            except _Retry as e:
                if e.answered:  # a 5xx: the load ended, and failed
                    raise InferenceError(f"{failed}: {e}") from None
                log.warning("%s: update_weights_from_disk: %s; polling its weight version", server.url, e)
                return await self._confirm(server, str(weight_version), path)
            except BadRequestError as e:
                if "HTTP 404" in str(e):
                    raise InferenceError(f"inference.worker_urls: {server.url} has no {route} (a router? name the "
                                         "SGLang servers themselves in inference.worker_urls)") from None
                if "HTTP 401" in str(e) or "HTTP 403" in str(e):  # SGLang's --admin-api-key guards the route
                    raise InferenceError(f"{e} (a server started with --admin-api-key needs that key here: "
                                         "inference.admin_api_key_env names the variable that holds it)") from None
                raise
            if not isinstance(body, dict) or body.get("success") is not True:
                message = body.get("message") if isinstance(body, dict) else body
                raise InferenceError(f"{failed} (HTTP {status}): {message}")

        await asyncio.gather(*(one(s) for s in self.workers))

    async def model_info(self, server: _Server) -> dict:
        """GET /model_info of one server; /get_model_info where that is 404 (SGLang before its rename)."""
        try:
            return (await self._attempt(server, "GET", server.info_route))[1]
        except BadRequestError as e:
            if "HTTP 404" not in str(e) or server.info_route == "/get_model_info":
                raise
        server.info_route = "/get_model_info"
        return (await self._attempt(server, "GET", server.info_route))[1]

    async def _confirm(self, server: _Server, version: str, path: str) -> None:
        """Poll the worker's model info until it reports `version`, for at most inference.ready_timeout."""
        t0, last = time.monotonic(), None
        while time.monotonic() - t0 < self.cfg.ready_timeout:
            await asyncio.sleep(min(5.0, 10 * self.cfg.backoff))
            try:
                info = await self.model_info(server)
                last = info.get("weight_version") if isinstance(info, dict) else info
                if last == version:
                    return
            except (_Retry, InferenceError) as e:
                last = f"({e})"
                if server.down_since is not None and time.monotonic() - server.down_since > self.cfg.down_after:
                    break  # gone, not loading
        raise InferenceError(f"{server.url}: weights {path} not confirmed after {time.monotonic() - t0:.0f} s "
                             f"(inference.ready_timeout, down_after); its weight_version is {last}")

    async def health(self) -> bool:
        """True when every server answers GET /health with 200 (no retries)."""
        return all(status == 200 for status in await asyncio.gather(*(self._probe(s, "/health") for s in self.servers)))

    async def wait_ready(self) -> float:
        """The seconds until every server and worker answered GET /health with 200 (SGLang refuses connections, then
        answers 503 while it loads); InferenceError on any other answer or past inference.ready_timeout."""
        t0 = time.monotonic()

        async def one(server: _Server):
            said = -60.0  # say so at once, then once a minute
            while (status := await self._probe(server, "/health")) != 200:
                waited = time.monotonic() - t0
                if isinstance(status, int) and status != 503:
                    raise InferenceError(f"{server.url}/health: HTTP {status} (is it an SGLang server?)")
                if waited > self.cfg.ready_timeout:
                    raise InferenceError(f"{server.url} not ready after {waited:.0f} s (inference.ready_timeout); "
                                         f"last answer: {status}")
                if waited - said >= 60:
                    log.warning("waiting for %s to be ready (%.0f s of inference.ready_timeout=%g; %s)", server.url,
                                waited, self.cfg.ready_timeout, status)
                    said = waited
                await asyncio.sleep(min(2.0, 4 * self.cfg.backoff))

        await asyncio.gather(*(one(s) for s in {s.url: s for s in self.servers + self.workers}.values()))
        return time.monotonic() - t0

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=self.max_connections, limit_per_host=self.max_connections)
            timeout = aiohttp.ClientTimeout(total=self.cfg.timeout, sock_connect=min(10.0, self.cfg.timeout))
            self._session = aiohttp.ClientSession(connector=connector, timeout=timeout, headers=self._headers)
        return self._session

    async def _probe(self, server: _Server, path: str) -> int | str:
        """GET `path` once: the HTTP status, or what went wrong."""
        try:
            async with self._get_session().get(server.url + path, timeout=aiohttp.ClientTimeout(total=30)) as r:
                return r.status
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            return f"{type(e).__name__}: {e}"

    def _pick(self, key: str | None = None) -> _Server:
        """The episode's server if it is up, else the least busy one that did not just fail (then remembered)."""
        now = time.monotonic()
        up = lambda s: s.down_since is None or now - s.last_failure > SKIP_FAILED_SERVER_FOR  # noqa: E731
        if key is not None and key in self._sticky and up(self._sticky[key]):
            self._sticky.move_to_end(key)
            return self._sticky[key]
        pool = [s for s in self.servers if up(s)] or self.servers
        least = min(s.outstanding for s in pool)
        tied = [s for s in pool if s.outstanding == least]
        server = tied[next(self._rr) % len(tied)]
        if key is not None:
            self._sticky[key] = server
            self._sticky.move_to_end(key)
            if len(self._sticky) > 4 * self.max_connections:
                self._sticky.popitem(last=False)
        return server

    async def _generate(self, payload: bytes, key: str | None):
        """POST /generate with retries on the episode's server (another one while it is down)."""
        headers = _JSON_HEADERS | ({ROUTING_HEADER: key} if key else {})
        attempt = 0
        while True:
            target = self._pick(key)
            try:
                return (await self._attempt(target, "POST", "/generate", (200,), data=payload, headers=headers))[1]
            except _Retry as e:
                attempt += 1
                down = [s.down_since for s in self.servers if s.down_since is not None]
                all_down = len(down) == len(self.servers) and time.monotonic() - max(down) < self.cfg.down_after
                if attempt > self.cfg.max_retries and not (e.unreachable and all_down):
                    where = ", ".join(s.url for s in self.servers)
                    raise InferenceError(f"POST /generate failed after {attempt} attempts ({where}): {e}") from None
                delay = min(self.cfg.backoff * 2 ** (attempt - 1), MAX_BACKOFF)
                log.warning("POST %s/generate: %s; retry %d in %.1fs", target.url, e, attempt, delay)
                await asyncio.sleep(delay)

    async def _attempt(self, server: _Server, method: str, path: str, ok=(200,), **request):
        """One request (aiohttp's `request` arguments); returns (status, parsed body) for a status in `ok`."""
        server.outstanding += 1
        try:
            async with self._get_session().request(method, server.url + path, **request) as resp:
                status, text = resp.status, await resp.text()
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, asyncio.TimeoutError) as e:
            server.failed()
            kind = "timeout" if isinstance(e, asyncio.TimeoutError) else type(e).__name__
            raise _Retry(f"{kind}: {e}", unreachable=isinstance(e, aiohttp.ClientConnectorError)) from None
        finally:
            server.outstanding -= 1
        if status >= 500:
            server.failed()
            raise _Retry(f"HTTP {status}: {_error_message(text)}", unreachable=False, answered=True)
        server.down_since = None
        if status not in ok:
            raise BadRequestError(f"{method} {server.url}{path}: HTTP {status}: {_error_message(text)}")
        try:
            body = json.loads(text) if text.strip().startswith(("{", "[")) else text
        except ValueError:
            raise InferenceError(f"{method} {server.url}{path}: response is not valid JSON: {text[:200]}") from None
        return status, body
