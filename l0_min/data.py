"""Reading task files, for every environment: rows of .csv, .tsv, .json, .jsonl, .parquet (gzipped too), a file by
path or a benchmark by name (from data.data_dir, $L0_MIN_DATA or the Hugging Face hub); each environment parses its
own layouts (QA's: l0_min/envs/qa.py; GSM8K: envs/math.py) with a `parse(row) -> (question, answers, meta)` that raises
`RowError`. A malformed or non-UTF-8 row raises `DataError` naming file and row; with `skip_bad_rows=True` it is
skipped and counted (`Tasks`' `.skipped`, `.errors`). Ids come from the row, else `<file stem>:<row>`.
"""

from __future__ import annotations

import ast
import contextlib
import csv
import gzip
import json
import logging
import os
import re
from pathlib import Path
from typing import Iterator

from l0_min.config import DataConfig, is_number
from l0_min.episode import Task

log = logging.getLogger(__name__)


class DataError(ValueError):
    """A missing, unreadable or malformed data file; the message names the file (and row)."""


class Tasks(list):
    """A list of Task that also records where it came from and what was skipped."""

    def __init__(self, items=(), source: str = "", skipped: int = 0, errors: list[str] | None = None):
        super().__init__(items)
        self.source, self.skipped, self.errors = source, skipped, errors or []


_SUFFIXES = (".csv", ".tsv", ".json", ".jsonl", ".parquet", ".json.gz", ".jsonl.gz")


class RowError(ValueError):
    """One row that cannot be read; load_file adds the file and row."""


# ----------------------------------------------------------------------------- reading records
_SURROGATE = re.compile("[\udc80-\udcff]")


def _not_utf8(text: str) -> RowError | None:
    """The error for a row read from bytes that are not UTF-8, else None.

    >>> _not_utf8("caf\\udce9")
    RowError('not UTF-8 text (byte 0xe9): fix the encoding of the file (e.g. iconv -f cp1252 -t utf-8 IN > OUT, which reads latin1 text too; for a .gz file: gunzip -c IN | iconv -f cp1252 -t utf-8 | gzip > OUT)')
    """
    m = _SURROGATE.search(text)
    return m and RowError(f"not UTF-8 text (byte 0x{ord(m.group()) - 0xDC00:02x}): fix the encoding of the file "
                           "(e.g. iconv -f cp1252 -t utf-8 IN > OUT, which reads latin1 text too; for a .gz file: "
                           "gunzip -c IN | iconv -f cp1252 -t utf-8 | gzip > OUT)")


def read_records(path: str | Path) -> Iterator[tuple[int, dict | Exception]]:
    """(row number, record) for each data row of a file; an unreadable row yields an exception in
    place of the record, so the caller decides whether to fail or skip."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: " + ("a folder, expected a file" if path.is_dir() else "file not found"))
    kind = next((suf.split(".")[1] for suf in _SUFFIXES if path.name.lower().endswith(suf)), None)
    if kind is None:
        raise DataError(f"{path}: unsupported file type (expected one of {', '.join(_SUFFIXES)})")
    if kind == "parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DataError(f"{path}: reading parquet needs pyarrow (pip install pyarrow)") from None
        yield from enumerate(pq.read_table(str(path)).to_pylist(), 1)
        return
    # bytes that are not UTF-8 become U+DC80..U+DCFF: `_not_utf8` names their row
    with (gzip.open(path, "rt", encoding="utf-8-sig", errors="surrogateescape") if path.suffix == ".gz"
          else open(path, encoding="utf-8-sig", errors="surrogateescape", newline="")) as f:  # -sig: a BOM is no text
        if kind == "csv":
            reader = csv.DictReader(f)
            if not reader.fieldnames:
                raise DataError(f"{path}: empty CSV (no header row)")
            for i, row in enumerate(reader, 1):
                if None in row or None in row.values():  # fields beyond the header's, or missing ones
                    yield i, RowError(f"{'more' if None in row else 'fewer'} fields than the "
                                       f"{len(reader.fieldnames)} of the header")
                else:
                    yield i, _not_utf8(",".join(row.values())) or row
        elif kind == "json":
            text = f.read()
            try:
                data = json.loads(text)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}: not valid JSON: {e}") from None
            if isinstance(data, dict):  # TriviaQA rc / unfiltered: {"Data": [...]}, else {"data": [...]}
                data = next((data[k] for k in ("Data", "data") if isinstance(data.get(k), list)), data)
            if not isinstance(data, list):
                raise DataError(f"{path}: expected a JSON list of rows (or TriviaQA's {{'Data': [...]}}), "
                                f"got {type(data).__name__}")
            bad = _SURROGATE.search(text) is not None
            yield from ((i, bad and _not_utf8(json.dumps(r, ensure_ascii=False)) or r) for i, r in enumerate(data, 1))
        else:  # tsv or jsonl: one row a line
            for i, line in enumerate(f, 1):
                if not line.strip():
                    continue
                if kind == "jsonl":
                    try:
                        yield i, _not_utf8(line) or json.loads(line)
                    except json.JSONDecodeError as e:
                        yield i, RowError(f"not valid JSON: {e}")
                elif len(parts := line.rstrip("\n").split("\t")) != 2:  # DPR qas: question<TAB>['alias', ...]
                    yield i, RowError(f"expected 'question<TAB>answers', got {len(parts)} fields")
                else:
                    try:
                        answers = ast.literal_eval(parts[1])
                    except (ValueError, SyntaxError):
                        answers = [parts[1]]
                    yield i, _not_utf8(line) or {"question": parts[0], "answer": answers}


# --------------------------------------------------------------------------------- rows
def text_field(row: dict, key: str) -> str:
    """Field `key` of a row as a non-empty string (a number is written out), else RowError."""
    if key not in row:
        raise RowError(f"missing field '{key}'")
    v = str(row[key]) if is_number(row[key]) else row[key]
    if not isinstance(v, str) or not v.strip():
        raise RowError(f"field '{key}' must be a non-empty string, got {v!r}")
    return v.strip()


def row_id(row: dict) -> str | None:
    ids = (str(v).strip() for k in ("_id", "id", "idx", "QuestionId", "question_id")
           if isinstance(v := row.get(k), str) or is_number(v, integer=True))
    return next((i for i in ids if i), None)


# ------------------------------------------------------------------------------------- loading
def load_file(path: str | Path, parse, limit: int | None = None, skip_bad_rows: bool = False,
              benchmark: str | None = None) -> Tasks:
    """Tasks of one file, each row through the environment's `parse(row) -> (question, answers, meta)`; meta gets
    "row" and, unless parse set one, "benchmark" (the name it was loaded by)."""
    path = Path(path)
    stem = path.name.split(".")[0]
    out, seen = Tasks(source=str(path)), {}
    for i, row in read_records(path):
        if limit is not None and len(out) >= limit:
            break
        try:
            if isinstance(row, Exception):
                raise row
            if not isinstance(row, dict):
                raise RowError(f"expected an object with fields, got {type(row).__name__}")
            q, answers, meta = parse(row)
            tid = row_id(row) or f"{stem}:{i}"
            if tid in seen:
                raise RowError(f"duplicate id {tid!r} (first at row {seen[tid]})")
        except DataError as e:  # the whole file is of another kind: the parser says which
            raise DataError(f"{path}: {e}") from None
        except RowError as e:
            msg = f"{path}: row {i}: {e}"
            if not skip_bad_rows:
                raise DataError(msg + " (data.skip_bad_rows=true skips bad rows)") from None
            out.skipped += 1
            out.errors.append(msg)
            continue
        seen[tid] = i
        out.append(Task(id=tid, question=q, answers=answers, meta={"benchmark": benchmark, "row": i} | meta))
    if out.skipped:
        log.warning("%s: skipped %d bad rows, first: %s", path, out.skipped, out.errors[0])
    if not out and limit != 0:
        raise DataError(f"{path}: no tasks" + (f" ({out.skipped} bad rows skipped)" if out.skipped else ""))
    return out


def find_benchmark_file(name: str, root: str | Path) -> Path:
    """The one data file of benchmark `name` under `root`: root itself if a file, else the files in
    root/<name>/, root/benchmarks/<name>/ or root/ (the first of those that has any)."""
    root = Path(root)
    if root.is_file():
        return root
    if not root.is_dir():
        raise DataError(f"benchmark {name}: {root} is neither a file nor a folder")
    for folder in (root / name, root / "benchmarks" / name, root):
        files = sorted(p for p in folder.glob("*") if p.is_file() and p.name.lower().endswith(_SUFFIXES))
        if len(files) == 1:
            return files[0]
        if len(files) > 1:
            raise DataError(f"benchmark {name}: several data files in {folder}, pass one as path: "
                            + ", ".join(p.name for p in files))
    raise DataError(f"benchmark {name}: no data file ({', '.join(_SUFFIXES)}) in {root}/{name}, "
                    f"{root}/benchmarks/{name} or {root}")


def _reachable(url: str, timeout: float = 3.0) -> bool:
    """Whether `url` answers at all (any HTTP status) within `timeout` seconds, name lookup included."""
    import threading
    import urllib.error
    import urllib.request

    done, answered = threading.Event(), []

    def probe():
        try:
            urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout)
            answered.append(True)
        except urllib.error.HTTPError:  # an answer all the same
            answered.append(True)
        except Exception:  # no name lookup, no route, refused, timed out: said at once, not at the timeout
            pass
        done.set()

    threading.Thread(target=probe, daemon=True).start()  # a stalled name lookup is left behind
    return done.wait(timeout) and bool(answered)


def _from_hub(name: str, repo: str, filename: str) -> Path:
    """The public file: from the hub's cache, else downloaded if the hub answers at once (offline,
    huggingface_hub would retry for ~25 s before failing)."""
    missing = (f"benchmark {name}: no --data, data.data_dir or $L0_MIN_DATA given, and {{}}. Pass --data FILE, or "
               f"set L0_MIN_DATA (or data.data_dir=DIR) to a folder holding {name}/{Path(filename).name}; the public "
               f"file is {filename} of the dataset {repo} (https://huggingface.co/datasets/{repo})")
    try:
        import huggingface_hub as hub
    except ImportError:
        raise DataError(missing.format("huggingface_hub is not installed to download it")) from None
    with contextlib.suppress(Exception):  # not in the cache
        return Path(hub.hf_hub_download(repo, filename, repo_type="dataset", local_files_only=True))
    if hub.constants.HF_HUB_OFFLINE or not _reachable(hub.constants.ENDPOINT):
        raise DataError(missing.format(f"it is not in the hub cache ({hub.constants.HF_HUB_CACHE}) and the hub "
                                       f"({hub.constants.ENDPOINT}) is not reachable (offline)"))
    try:
        return Path(hub.hf_hub_download(repo, filename, repo_type="dataset"))
    except Exception as e:  # gated, moved, a network error
        raise DataError(missing.format(f"downloading it failed: {type(e).__name__}: {str(e)[:300]}")) from None


def load(spec: str, benchmarks: dict[str, tuple[str, str]], parser, cfg: DataConfig | None = None,
         limit: int | None = None) -> Tasks:
    """Tasks of `spec`: a file, or a benchmark by name: its file under data.data_dir (a folder, or the file itself:
    then any name labels it) or $L0_MIN_DATA (`find_benchmark_file`), else the Hugging Face hub's file of
    `benchmarks[name]` ((dataset repo, file)). `parser(name, path)` gives the row parser of a file (load_file)."""
    cfg, spec = cfg or DataConfig(), spec.strip()
    if Path(spec).is_file() or "/" in spec or spec.lower().endswith(_SUFFIXES):  # a path ("file not found" if not)
        return load_file(spec, parser(None, spec), limit, cfg.skip_bad_rows)
    root = cfg.data_dir or os.environ.get("L0_MIN_DATA")
    if spec not in benchmarks and not cfg.data_dir:
        raise DataError(f"unknown benchmark {spec!r}: expected 'synthetic[:train|:heldout]', a benchmark name "
                        f"({', '.join(benchmarks)}), or an existing file")
    file = find_benchmark_file(spec, root) if root else _from_hub(spec, *benchmarks[spec])
    return load_file(file, parser(spec, file), limit, cfg.skip_bad_rows, benchmark=spec)
