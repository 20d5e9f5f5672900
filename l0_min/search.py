"""Host-side search and page backends behind the agent's `web_search` / `read_page` tools: `BM25Backend` (local,
the offline default), `RetrieverClient` (a Search-R1-compatible retriever), `SerperBackend` (Google via serper.dev,
pages via the Jina reader), each with `async search(query, k)` (best first) and `async read_page(ref)`. A missing
page is a normal answer; a failing call raises `SearchError` (whose failure: the tool server says, docs/internals.md).
"""

from __future__ import annotations

import asyncio
import difflib
import json
import os
import re
import unicodedata
from concurrent.futures import ThreadPoolExecutor

import aiohttp

from l0_min.config import ToolsConfig


class SearchError(RuntimeError):
    """A search or page backend failed (not "no results"); the message names the backend."""


def _not_found(ref: str) -> str:
    return f"No page found for {ref!r}. Use a document id or an exact title from web_search results."


def format_page(doc: dict) -> str:
    return f"{doc['title']}\n\n{doc['text']}"


STOPWORDS = frozenset("a an and are as at be been but by did do does for from had has have he her his how i if in into "
                      "is it its of on or she so than that the their them then there these they this those to was were "
                      "what when where which who whom whose why will with you your".split())


def tokenize(text: str) -> list[str]:
    """Lowercased word tokens without English stopwords (Unicode letters and digits kept).

    >>> tokenize("In what year was Zoë Marel born?")
    ['year', 'zoë', 'marel', 'born']
    """
    return [t for t in re.findall(r"\w+", unicodedata.normalize("NFKC", text).casefold()) if t not in STOPWORDS]


class BM25Backend:
    """BM25 over title + text of a list of documents {id, title, text}. Searches run in one thread of their own, in
    turn, off the event loop: many episodes search at once, and a long query takes long (the tool server caps them)."""
    max_terms = 32  # a query's first distinct terms count (its cost grows with them: 2,000 characters, 21 -> 2.4 ms)

    def __init__(self, docs: list[dict], k1: float = 1.5, b: float = 0.75):
        import bm25s

        self.docs = list(docs)
        if not self.docs:
            raise ValueError("BM25Backend: no documents to index")
        first: dict[str, int] = {}  # id -> index of its document
        self._by_title: dict[str, dict] = {}
        self._by_title_folded: dict[str, dict] = {}
        for i, d in enumerate(self.docs):
            if not isinstance(d, dict) or not all(isinstance(d.get(k), str) for k in ("id", "title", "text")):
                raise ValueError(f"document {i}: expected {{id, title, text}} strings, got {str(d)[:120]}")
            if d["id"] in first:
                raise ValueError(f"document {i}: duplicate id {d['id']!r} (first at {first[d['id']]})")
            first[d["id"]] = i
            self._by_title.setdefault(d["title"], d)
            self._by_title_folded.setdefault(d["title"].casefold().strip(), d)
        self._by_id = {d["id"]: d for d in self.docs}
        self._bm25 = bm25s.BM25(k1=k1, b=b)
        self._bm25.index([tokenize(d["title"] + " " + d["text"]) for d in self.docs], show_progress=False)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="bm25")

    def search_sync(self, query: str, k: int) -> list[dict]:
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        if not (tokens := list(dict.fromkeys(tokenize(query)))[: self.max_terms]):
            return []
        idx, scores = self._bm25.retrieve([tokens], k=min(k, len(self.docs)), show_progress=False)
        return [{**{f: self.docs[i][f] for f in ("id", "title", "text")}, "score": float(s)}
                for i, s in zip(idx[0].tolist(), scores[0].tolist()) if s > 0]  # 0: no query word in the document

    async def search(self, query: str, k: int) -> list[dict]:
        """Cancelled, a search still queued leaves the queue; one that has started holds the thread until it ends, and
        so does its caller (the tool server's turn of an episode): cancelling the wrapper cancels a job not started."""
        job = self._thread.submit(self.search_sync, query, k)
        try:
            return await asyncio.wrap_future(job)
        finally:
            if job.running():
                await asyncio.wait([asyncio.wrap_future(job)])

    async def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)

    async def read_page(self, ref: str) -> str:
        ref = ref.strip()
        d = self._by_id.get(ref) or self._by_title.get(ref) or self._by_title_folded.get(ref.casefold())
        near = [] if d else self.closest(ref)
        return format_page(d) if d else _not_found(ref) + (f" Closest refs: {', '.join(near)}." if near else "")

    def closest(self, ref: str, n: int = 5) -> list[str]:
        """Up to `n` refs near an unknown one, a wiki's "did you mean": the ids whose id or title (case-folded) starts
        with it, then contains it, then difflib's close matches. None over 5,000 documents (a scan a miss)."""
        if len(self.docs) > 5000 or not (key := ref.casefold()):
            return []
        keys = {k: d["id"] for d in self.docs for k in (d["id"].casefold(), d["title"].casefold())}
        near = [i for k, i in keys.items() if k.startswith(key)] + [i for k, i in keys.items() if key in k]
        near += [keys[k] for k in difflib.get_close_matches(key, list(keys), n, 0.6)]
        return [i[:100] for i in dict.fromkeys(near)][:n]


class _Http:
    """One aiohttp session per event loop, created on first use."""

    name, max_reply = "http", 1 << 20  # bytes read of a reply: a page of 100 MB costs the host 1 MiB

    def __init__(self, timeout: float):
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._session: aiohttp.ClientSession | None = None
        self._loop = None

    async def close(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()

    async def _request(self, method: str, url: str, **kw) -> str:
        """Body of a 2xx reply; SearchError otherwise. Never puts query params (keys) in messages."""
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._loop is not loop:
            self._session, self._loop = aiohttp.ClientSession(timeout=self._timeout), loop
        try:
            async with self._session.request(method, url, **kw) as r:  # the rest of a reply is never read
                body, status = b"", r.status
                while len(body) < self.max_reply and (chunk := await r.content.read(self.max_reply - len(body))):
                    body += chunk
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            raise SearchError(f"{self.name}: {method} {url} failed: {type(e).__name__}: {e}") from None
        if status >= 400:
            raise SearchError(f"{self.name}: {method} {url} -> HTTP {status}: {body[:300].decode(errors='replace')}")
        return body.decode(errors="replace")

    async def _json(self, method: str, url: str, **kw):
        body = await self._request(method, url, **kw)
        try:
            return json.loads(body)
        except json.JSONDecodeError:
            raise SearchError(f"{self.name}: {url} replied with non-JSON: {body[:200]!r}") from None


def split_contents(contents: str) -> tuple[str, str]:
    """Search-R1 / wiki-18 `contents` -> (title, text).

    >>> split_contents('"Evan Morris"\\nEvan L. Morris was a lobbyist.')
    ('Evan Morris', 'Evan L. Morris was a lobbyist.')
    """
    first, _, rest = contents.partition("\n")
    return first.strip().strip('"'), rest.strip()


class RetrieverClient(_Http):
    """Client of a Search-R1-compatible retriever (`url`: the server root or its /retrieve). The API has no page
    endpoint: read_page(ref) returns a document an earlier search saw, else a search's top hit titled `ref`."""

    name = "retriever"

    def __init__(self, url: str, timeout: float = 20.0):
        super().__init__(timeout)
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"retriever url must start with http:// or https://, got {url!r}")
        self.url = url.rstrip("/").removesuffix("/retrieve") + "/retrieve"
        self._seen: dict[str, dict] = {}

    async def search(self, query: str, k: int) -> list[dict]:
        data = await self._json("POST", self.url, json={"queries": [query], "topk": k, "return_scores": True})
        try:
            hits = data["result"][0]
        except (KeyError, IndexError, TypeError):
            raise SearchError(f"retriever {self.url}: reply has no result[0]: {str(data)[:200]}") from None
        out = []
        for rank, h in enumerate(hits):  # {document, score} with return_scores, else the document alone
            doc, score = (h["document"], h.get("score")) if isinstance(h, dict) and "document" in h else (h, None)
            if not isinstance(doc, dict):
                raise SearchError(f"retriever {self.url}: hit {rank} is not a document: {str(h)[:200]}")
            title, text = (split_contents(doc["contents"]) if isinstance(doc.get("contents"), str)
                           else (str(doc.get("title", "")), str(doc.get("text", ""))))
            d = {"id": str(doc.get("id", f"{title}#{rank}")), "title": title, "text": text,
                 "score": float(score) if score is not None else 1.0 / (rank + 1)}
            self._seen[d["id"]] = d
            self._seen.setdefault(title, d)
            out.append(d)
        return out

    async def read_page(self, ref: str) -> str:
        ref = ref.strip()
        if ref in self._seen:
            return format_page(self._seen[ref])
        hits = [d for d in await self.search(ref, 1) if d["title"].casefold() == ref.casefold()]
        return format_page(hits[0]) if hits else _not_found(ref)


class JinaReader(_Http):
    """Reads a web page as text through a Jina-style reader: GET <base_url>/<page url>."""

    name = "jina reader"

    def __init__(self, api_key: str | None = None, base_url: str = "https://r.jina.ai", timeout: float = 20.0):
        super().__init__(timeout)
        self.api_key, self.base_url = api_key, base_url.rstrip("/")

    async def read_page(self, ref: str) -> str:
        ref = ref.strip()
        if not ref.startswith(("http://", "https://")):
            return f"read_page needs a web address (http://... or https://...) from web_search results, got {ref!r}."
        headers = {"Accept": "text/plain", **({"Authorization": f"Bearer {self.api_key}"} if self.api_key else {})}
        return await self._request("GET", f"{self.base_url}/{ref}", headers=headers)


class SerperBackend(_Http):
    """Google results from serper.dev: POST <base_url>/search {q, num}, header X-API-KEY."""

    name = "serper"

    def __init__(self, api_key: str, base_url: str = "https://google.serper.dev", reader: JinaReader | None = None,
                 timeout: float = 20.0):
        super().__init__(timeout)
        self.api_key, self.base_url = api_key, base_url.rstrip("/")
        self.reader = reader or JinaReader(timeout=timeout)

    async def search(self, query: str, k: int) -> list[dict]:
        data = await self._json("POST", f"{self.base_url}/search", json={"q": query, "num": k},
                                headers={"X-API-KEY": self.api_key, "Content-Type": "application/json"})
        return parse_serper(data, k)

    async def read_page(self, ref: str) -> str:
        return await self.reader.read_page(ref)

    async def close(self) -> None:
        await super().close()
        await self.reader.close()


def parse_serper(data: dict, k: int) -> list[dict]:
    """serper.dev JSON -> results: the answer box (if any), then organic results, at most k, scored 1/rank.

    >>> parse_serper({"organic": [{"title": "T", "link": "https://x", "snippet": "S"}]}, 3)
    [{'id': 'https://x', 'title': 'T', 'text': 'S', 'score': 1.0}]
    """
    if not isinstance(data, dict):
        raise SearchError(f"serper: expected a JSON object, got {str(data)[:200]}")
    out, box = [], data.get("answerBox")
    if isinstance(box, dict) and (text := box.get("answer") or box.get("snippet")):
        out.append({"id": box.get("link") or "answer-box", "title": box.get("title") or "Answer", "text": str(text)})
    out += [{"id": r.get("link", ""), "title": r.get("title", ""), "text": r.get("snippet", "")}
            for r in data.get("organic") or []]
    return [{**r, "score": 1.0 / (i + 1)} for i, r in enumerate(out[:k])]


def make_backend(cfg: ToolsConfig, docs: list[dict] | None = None, env: dict | None = None):
    """The backend named by `cfg.search` (None for "none"): bm25 indexes `docs`, the environments' corpora
    (`TaskEnv.corpus`); serper needs its API key in the environment variable the config names."""
    env = os.environ if env is None else env
    if cfg.search == "none":
        return None
    if cfg.search == "bm25":
        if not docs:
            raise ValueError("tools.search=bm25 needs documents: set tools.corpus to a corpus file, or use a task "
                             "source that carries its paragraphs (synthetic, hotpotqa, musique)")
        return BM25Backend(docs)
    if cfg.search == "retriever":
        if not cfg.retriever_url:
            raise ValueError("tools.search=retriever needs tools.retriever_url (e.g. http://127.0.0.1:8000)")
        return RetrieverClient(cfg.retriever_url, timeout=cfg.timeout)
    if cfg.search == "serper":
        if not (key := env.get(cfg.serper_api_key_env, "")):
            raise ValueError(f"tools.search=serper needs an API key in the environment variable "
                             f"{cfg.serper_api_key_env}, which is unset")
        reader = JinaReader(api_key=env.get(cfg.jina_api_key_env) or None, timeout=cfg.timeout)
        return SerperBackend(key, reader=reader, timeout=cfg.timeout)
    raise ValueError(f"tools.search={cfg.search!r}: expected one of bm25, retriever, serper, none")
