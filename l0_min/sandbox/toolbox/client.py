"""The in-kernel side of the tools: one JSON POST per call to the host's tool server.

The socket ($L0_TOOLS_SOCKET) is bound into this sandbox only, so it says which episode a call belongs to. Every
call has a timeout ($L0_TOOLS_TIMEOUT seconds) and raises ToolError with the reason when it fails.
"""

import http.client
import json
import os
import socket


class ToolError(RuntimeError):
    """A tool call failed (no tool server, a timeout, a backend error, bad arguments)."""


def call(tool: str, **args):
    """POST {"tool", "args"} and return the reply's result, or raise ToolError."""
    path = os.environ.get("L0_TOOLS_SOCKET", "")
    if not path or not os.path.exists(path):
        raise ToolError(f"{tool}: tools are unavailable in this kernel (no tool server is attached)")
    timeout = float(os.environ.get("L0_TOOLS_TIMEOUT", "30"))
    conn = http.client.HTTPConnection("localhost", timeout=timeout)
    try:
        conn.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # HTTP over the episode's socket
        conn.sock.settimeout(timeout)
        conn.sock.connect(path)
        try:
            conn.request("POST", "/call", json.dumps({"tool": tool, "args": args}), {"Content-Type": "application/json"})
        except BrokenPipeError:  # the server answered before the whole body was sent (over its size limit)
            pass
        resp = conn.getresponse()
        body = resp.read()
    except TimeoutError:
        raise ToolError(f"{tool}: no answer from the tool server within {timeout:g} s") from None
    except OSError as e:
        raise ToolError(f"{tool}: cannot reach the tool server ({e})") from None
    finally:
        conn.close()
    try:
        reply = json.loads(body)
    except ValueError:
        raise ToolError(f"{tool}: the tool server sent a reply that is not JSON (HTTP {resp.status})") from None
    if not reply.get("ok"):
        raise ToolError(f"{tool}: {reply.get('error', 'failed')}")
    return reply.get("result")


class Results(list):
    """Search results: a list of dicts (id, title, snippet, score) that prints readably."""

    def __str__(self) -> str:
        if not self:
            return "(no results)"
        return "\n".join(f"[{i}] {r.get('title', '')} (ref: {r.get('id', '')})\n    {r.get('snippet', '')}"
                         for i, r in enumerate(self, 1))  # fmt: skip

    __repr__ = __str__


class Page(str):
    """A page's text; shown as plain text (not a quoted repr) when it ends a cell."""

    def __repr__(self) -> str:
        return str.__str__(self)


def web_search(query: str, k: int | None = None) -> Results:
    """Search; returns up to k results (default: the host's tools.top_k). Read one with read_page(result["id"])."""
    return Results(call("web_search", query=str(query), **({} if k is None else {"k": int(k)})))


def read_page(ref: str) -> Page:
    """The text of the page with this ref (a result's "id")."""
    return Page(call("read_page", ref=str(ref)))


def submit_final_answer(answer) -> None:
    """Record the final answer with the host; this ends the episode. The first answer counts:
    later ones are refused (and said so)."""
    r = call("submit_final_answer", answer=str(answer))
    if r["accepted"]:
        print(f"Final answer submitted: {r['answer']}")
    else:
        print(f"A final answer was already submitted ({r['answer']!r}); this one was ignored.")
