"""Caps what one cell sends to the host, inside the kernel, so that a huge or endless output never reaches the
host's memory in full. It wraps `session.send`, which every outgoing message passes, with one budget of `limit`
characters per cell: stream text passes until it is spent, then only each stream's last `limit // 4` characters
are sent before the execute_reply, behind "[... N characters truncated ...]"; display data keeps text/plain,
trimmed; errors and tracebacks are trimmed; the reply of a cell that lost output carries "l0_truncated": true.
A cell can undo this, but only to its own cost: the host bounds what it keeps too.
"""

import json
import re
import threading
from collections import OrderedDict

MARKER = "\n[... {n:,} characters truncated ...]\n"
_MARKER_RE = re.compile(r"\[\.\.\. ([\d,]+) characters truncated \.\.\.\]")


def trim(text: str, limit: int) -> str:
    """Head (2/3) and tail (1/3) of `text` with a marker between, at most `limit` characters in all
    (a limit below the marker's length keeps only the marker). The one text trimmer of the project:
    the host imports it too. The count in the marker includes what earlier markers in the cut part
    stood for, so trimming twice reports the true total.

    >>> trim("abcdefghij" * 10, 60)
    'abcdefghijabcdef\\n[... 76 characters truncated ...]\\ncdefghij'
    >>> trim(trim("x" * 1000, 100), 60)
    'xxxxxxxxxxxxxxxx\\n[... 975 characters truncated ...]\\nxxxxxxxxx'

    """
    if len(text) <= limit:
        return text
    keep = max(0, limit - len(MARKER.format(n=len(text))))
    head = keep * 2 // 3
    tail = keep - head
    cut = text[head : len(text) - tail]
    n = len(cut)
    for m in _MARKER_RE.finditer(cut):  # an earlier marker stands for more than its own length
        n += int(m.group(1).replace(",", "")) - len(m.group(0)) - 2
    return text[:head] + MARKER.format(n=n) + (text[len(text) - tail :] if tail else "")


class Json(str):
    """`text` trimmed to `limit`, shown as JSON: the host reads it back (the notepad) with json.loads."""

    def __new__(cls, text, limit: int):
        return super().__new__(cls, trim(str(text), limit))

    __repr__ = json.dumps


class _Cell:
    def __init__(self):
        self.used = self.dropped = 0  # characters sent so far; characters of display output dropped
        self.tails = {}  # stream name -> [kept tail, characters held back]


class OutputCap:
    def __init__(self, limit: int):
        self.limit = max(200, int(limit))
        self.tail_keep = self.limit // 4
        self._cells, self._lock = OrderedDict(), threading.Lock()
        self._send = self._iopub = None  # the session's own send; where stream messages go (from the first one)

    def install(self, session) -> None:
        self._send = session.send
        session.send = self.send

    def _cell(self, msg_id):
        if msg_id not in self._cells:
            self._cells[msg_id] = _Cell()
            while len(self._cells) > 64:  # output of cells long finished (background threads)
                self._cells.popitem(last=False)
        return self._cells[msg_id]

    def send(self, stream, msg_or_type, content=None, parent=None, *args, **kwargs):
        if isinstance(msg_or_type, dict):
            msg_type, body = msg_or_type["header"]["msg_type"], msg_or_type["content"]
            msg_id = (msg_or_type.get("parent_header") or {}).get("msg_id")
        else:
            msg_type, body = msg_or_type, content
            msg_id = ((parent or {}).get("header") or {}).get("msg_id")
        if isinstance(body, dict):
            with self._lock:
                if not self._filter(stream, msg_type, body, msg_id, parent):
                    return None
        return self._send(stream, msg_or_type, content, parent, *args, **kwargs)

    def _filter(self, stream, msg_type, body, msg_id, parent) -> bool:
        if msg_type == "stream":
            self._iopub = stream
            cell = self._cell(msg_id)
            text = str(body.get("text", ""))
            room = max(0, self.limit - cell.used)
            if len(text) > room:
                rest = text[room:]
                tail = cell.tails.setdefault(body.get("name", "stdout"), ["", 0])
                tail[0] = (tail[0] + rest[-self.tail_keep :])[-self.tail_keep :]
                tail[1] += len(rest)
                text = text[:room]
            cell.used += len(text)
            body["text"] = text
            return bool(text)
        if msg_type in ("display_data", "execute_result", "update_display_data"):
            cell = self._cell(msg_id)
            plain = str((body.get("data") or {}).get("text/plain", ""))
            room = self.limit - cell.used
            if room <= 0:
                cell.dropped += len(plain)
                return False
            body["data"] = {"text/plain": trim(plain, room)} if plain else {}
            cell.used += len(body["data"].get("text/plain", ""))
            return True
        if msg_type in ("error", "execute_reply"):
            if "evalue" in body:
                body["evalue"] = trim(str(body["evalue"]), self.limit // 4)
            if isinstance(body.get("traceback"), list):
                tb = [trim(str(line), self.limit // 4) for line in body["traceback"]]
                body["traceback"] = tb if len(tb) <= 12 else tb[:4] + [f"[... {len(tb) - 10} frames ...]"] + tb[-6:]
        if msg_type == "execute_reply":
            cell = self._cells.pop(msg_id, None) or _Cell()
            truncated = cell.dropped > 0
            for name, (tail, held) in cell.tails.items():  # held back: sent now, behind a marker if cut
                cut = held - len(tail)
                truncated |= cut > 0
                if self._iopub is not None:
                    text = (MARKER.format(n=cut) if cut else "") + tail
                    self._send(self._iopub, "stream", {"name": name, "text": text}, parent)
            if truncated:
                body["l0_truncated"] = True
        return True
