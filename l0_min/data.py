"""Task files in their public release layouts (sniffed from a row's fields; .csv, .tsv, .json, .jsonl, .parquet,
gzipped too), by name from $L0_MIN_DATA / data.data_dir or the Hugging Face hub, or by path:

    load_tasks("hotpotqa"), load_tasks("path/to/dev.jsonl"), load_benchmark("bamboogle", "test.csv", limit=10)

Layouts (`detect_layout`): simpleqa, qa (HotpotQA, 2Wiki), musique, csv_qa (Bamboogle), gsm8k, answers (NQ-open),
triviaqa, flashrag. Aliases joined with `<|answer_split|>` are split; a row's `data_source` becomes its
`meta["benchmark"]` (canonical name: ALIASES). A malformed or non-UTF-8 row raises `DataError` naming file and row;
with `skip_bad_rows=True` it is skipped and counted (`Tasks`' `.skipped`, `.errors`). Ids come from the row, else
`<file stem>:<row>`. Synthetic tasks come from each environment's own generator.
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

from l0_min.config import DataConfig
from l0_min.episode import Task

log = logging.getLogger(__name__)


class DataError(ValueError):
    """A missing, unreadable or malformed data file; the message names the file (and row)."""


class Tasks(list):
    """A list of Task that also records where it came from and what was skipped."""

    def __init__(self, items=(), source: str = "", skipped: int = 0, errors: list[str] | None = None):
        super().__init__(items)
        self.source, self.skipped, self.errors = source, skipped, errors or []


# name -> (hub dataset repo, file in it). FlashRAG files are in the `flashrag` layout.
_FLASHRAG = "RUC-NLPIR/FlashRAG_datasets"
BENCHMARKS = {
    "simpleqa": ("basicv8vc/SimpleQA", "simple_qa_test_set.csv"), "hotpotqa": (_FLASHRAG, "hotpotqa/dev.jsonl"),
    "musique": (_FLASHRAG, "musique/dev.jsonl"), "2wikimultihopqa": (_FLASHRAG, "2wikimultihopqa/dev.jsonl"),
    "bamboogle": (_FLASHRAG, "bamboogle/test.jsonl"), "nq": (_FLASHRAG, "nq/test.jsonl"),
    "triviaqa": (_FLASHRAG, "triviaqa/test.jsonl"), "gsm8k": ("openai/gsm8k", "main/test-00000-of-00001.parquet"),
}
ALIASES = {"2wiki": "2wikimultihopqa", "2wikimqa": "2wikimultihopqa", "nq_open": "nq", "nq-open": "nq",
           "simple_qa": "simpleqa", "hotpot": "hotpotqa", "hotpot_qa": "hotpotqa", "trivia_qa": "triviaqa",
           "tq": "triviaqa", "pop_qa": "popqa"}  # other names files give a benchmark (Search-R1's data_source)
_SUFFIXES = (".csv", ".tsv", ".json", ".jsonl", ".parquet", ".json.gz", ".jsonl.gz")


class _RowError(ValueError):
    pass


# ----------------------------------------------------------------------------- reading records
_SURROGATE = re.compile("[\udc80-\udcff]")


def _not_utf8(text: str) -> _RowError | None:
    """The error for a row read from bytes that are not UTF-8, else None.

    >>> _not_utf8("caf\\udce9")
    _RowError('not UTF-8 text (byte 0xe9): fix the encoding of the file (e.g. iconv -f cp1252 -t utf-8 IN > OUT, which reads latin1 text too; for a .gz file: gunzip -c IN | iconv -f cp1252 -t utf-8 | gzip > OUT)')
    """
    m = _SURROGATE.search(text)
    return m and _RowError(f"not UTF-8 text (byte 0x{ord(m.group()) - 0xDC00:02x}): fix the encoding of the file "
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
                    yield i, _RowError(f"{'more' if None in row else 'fewer'} fields than the "
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
                        yield i, _RowError(f"not valid JSON: {e}")
                elif len(parts := line.rstrip("\n").split("\t")) != 2:  # DPR qas: question<TAB>['alias', ...]
                    yield i, _RowError(f"expected 'question<TAB>answers', got {len(parts)} fields")
                else:
                    try:
                        answers = ast.literal_eval(parts[1])
                    except (ValueError, SyntaxError):
                        answers = [parts[1]]
                    yield i, _not_utf8(line) or {"question": parts[0], "answer": answers}


# --------------------------------------------------------------------------------- row layouts
def detect_layout(row: dict) -> str:
    """The layout of a row, from its fields.

    >>> detect_layout({"question": "q", "golden_answers": ["a"]})
    'flashrag'
    >>> detect_layout({"Question": "q", "Answer": "a"}), detect_layout({"id": "d1", "title": "T", "text": "x"})
    ('csv_qa', 'corpus')
    """
    if not isinstance(row, dict):
        raise _RowError(f"expected an object with fields, got {type(row).__name__}")
    keys = set(row)
    if "question" not in keys and ({"title", "text"} <= keys or keys & {"contents", "wikipedia_title"}):
        return "corpus"
    if "golden_answers" in keys:
        return "flashrag"
    if {"problem", "answer"} <= keys:
        return "simpleqa"
    if isinstance(row.get("answer"), str) and "\n#### " in row["answer"]:
        return "gsm8k"
    if "paragraphs" in keys or "answer_aliases" in keys:
        return "musique"
    if isinstance(row.get("Answer"), dict) or isinstance(row.get("answer"), dict):
        return "triviaqa"
    if {"Question", "Answer"} <= keys:
        return "csv_qa"
    if "question" in keys and (isinstance(row.get("answer"), list) or isinstance(row.get("answers"), list)):
        return "answers"
    if {"question", "answer"} <= keys:
        return "qa"
    raise _RowError(f"unknown layout, fields: {sorted(keys)[:12]}")


def _text(row: dict, key: str) -> str:
    if key not in row:
        raise _RowError(f"missing field '{key}'")
    v = row[key]
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        v = str(v)
    if not isinstance(v, str) or not v.strip():
        raise _RowError(f"field '{key}' must be a non-empty string, got {v!r}")
    return v.strip()


def _alias_list(v, key: str) -> list[str]:
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list):
        raise _RowError(f"field '{key}' must be a list of strings, got {type(v).__name__}")
    if bad := [a for a in v if not isinstance(a, (str, int, float)) or isinstance(a, bool)]:
        raise _RowError(f"field '{key}' has a non-string answer {bad[0]!r}")
    return [str(a).strip() for a in v]


def split_answers(answers: list[str]) -> list[str]:
    """Aliases joined with "<|answer_split|>" split apart, blanks and exact repeats dropped (scores take
    the best alias, so spellings that normalise alike may stay).

    >>> split_answers(["Tokyo<|answer_split|> Tokio", "", "Tokyo", "tokyo"])
    ['Tokyo', 'Tokio', 'tokyo']
    """
    return list(dict.fromkeys(p.strip() for a in answers for p in a.split("<|answer_split|>") if p.strip()))


def _context(v) -> list[list]:
    """HotpotQA context as [[title, [sentences]]], from the release form or HF's {title, sentences}."""
    if isinstance(v, dict) and "title" in v and "sentences" in v:
        v = [[t, s] for t, s in zip(v["title"], v["sentences"])]
    if not isinstance(v, list) or not all(isinstance(p, list) and len(p) == 2 and isinstance(p[0], str)
                                          and isinstance(p[1], list) for p in v):
        raise _RowError("field 'context' must be [[title, [sentences]], ...]")
    return [[t, [str(s) for s in sents]] for t, sents in v]


def _paragraphs(v) -> list[dict]:
    if not isinstance(v, list) or not all(isinstance(p, dict) and "title" in p and "paragraph_text" in p for p in v):
        raise _RowError("field 'paragraphs' must be a list of {title, paragraph_text, ...}")
    return v


def _parse(layout: str, row: dict) -> tuple[str, list[str], dict]:
    """(question, answers, meta) of one row of a layout."""
    meta: dict = {}
    if layout == "simpleqa":
        q, answers = _text(row, "problem"), [_text(row, "answer")]
        md = row.get("metadata") or None
        if isinstance(md, str) and md.strip():
            try:
                md = ast.literal_eval(md)
            except (ValueError, SyntaxError):
                raise _RowError("field 'metadata' is not a Python-literal dict") from None
        if md is not None and not isinstance(md, dict):
            raise _RowError(f"field 'metadata' must be a dict, got {type(md).__name__}")
        meta.update(md or {})
    elif layout == "qa":
        q, answers = _text(row, "question"), [_text(row, "answer")]
        meta.update({k: row[k] for k in ("type", "level", "supporting_facts", "evidences") if k in row})
        if row.get("context"):
            meta["context"] = _context(row["context"])
    elif layout == "gsm8k":  # a worked solution ending "#### <number>": the number is the gold
        q, (solution, mark, gold) = _text(row, "question"), _text(row, "answer").rpartition("#### ")
        if not mark or not gold.strip():
            raise _RowError("GSM8K layout: field 'answer' must end with '#### <number>' (the gold)")
        answers, meta["solution"] = [gold.replace(",", "").strip()], solution.rstrip("\n")
    elif layout == "musique":
        q = _text(row, "question")
        answers = [_text(row, "answer")] + _alias_list(row.get("answer_aliases") or [], "answer_aliases")
        meta["paragraphs"] = _paragraphs(row.get("paragraphs") or [])
        meta.update({k: row[k] for k in ("answerable", "question_decomposition") if k in row})
    elif layout == "csv_qa":
        q, answers = _text(row, "Question"), [_text(row, "Answer")]
    elif layout == "answers":
        q = _text(row, "question")
        key = "answer" if "answer" in row else "answers"
        answers = _alias_list(row[key], key)
    elif layout == "triviaqa":
        qk, ak = ("Question", "Answer") if "Question" in row else ("question", "answer")
        q, a = _text(row, qk), row[ak]
        low = {k.lower(): v for k, v in a.items()}
        value = low.get("value")
        if not isinstance(value, str) or not value.strip():
            raise _RowError(f"field '{ak}' has no 'Value'")
        # (NormalizedAliases are the same aliases, normalised)
        answers = [value] + _alias_list(low.get("aliases") or [], f"{ak}.Aliases")
    elif layout == "flashrag":
        q, answers = _text(row, "question"), _alias_list(row["golden_answers"], "golden_answers")
        md = row.get("metadata") or {}
        if isinstance(md, dict):
            meta.update(md)
            if md.get("context"):
                meta["context"] = _context(md["context"])
            if md.get("paragraphs"):
                meta["paragraphs"] = _paragraphs(md["paragraphs"])
    if not (answers := split_answers(answers)):
        raise _RowError("no non-empty answer")
    return q, answers, meta


def _row_id(row: dict) -> str | None:
    ids = (str(v).strip() for k in ("_id", "id", "idx", "QuestionId", "question_id")
           if isinstance(v := row.get(k), (str, int)) and not isinstance(v, bool))
    return next((i for i in ids if i), None)


# ------------------------------------------------------------------------------------- loading
def load_file(path: str | Path, limit: int | None = None, skip_bad_rows: bool = False,
              benchmark: str | None = None) -> Tasks:
    """Tasks of one benchmark file of any supported layout (see the module docstring)."""
    path = Path(path)
    stem = path.name.split(".")[0]
    out, layout, seen = Tasks(source=str(path)), None, {}
    for i, row in read_records(path):
        if limit is not None and len(out) >= limit:
            break
        try:
            if isinstance(row, Exception):
                raise row
            layout = layout or detect_layout(row)
            if layout == "corpus":
                raise DataError(f"{path}: a corpus (documents with a title and text), not questions: "
                                f"pass it as tools.corpus={path}")
            q, answers, meta = _parse(layout, row)
            tid = _row_id(row) or f"{stem}:{i}"
            if tid in seen:
                raise _RowError(f"duplicate id {tid!r} (first at row {seen[tid]})")
        except _RowError as e:
            msg = f"{path}: row {i}: {e}"
            if not skip_bad_rows:
                raise DataError(msg + " (data.skip_bad_rows=true skips bad rows)") from None
            out.skipped += 1
            out.errors.append(msg)
            continue
        seen[tid] = i
        meta = {"benchmark": benchmark_name(str(row.get("data_source") or benchmark or layout), known=False), "row": i,
                **meta}
        out.append(Task(id=tid, question=q, answers=answers, meta=meta, env="math" if layout == "gsm8k" else "qa"))
    if out.skipped:
        log.warning("%s: skipped %d bad rows, first: %s", path, out.skipped, out.errors[0])
    if not out and limit != 0:
        raise DataError(f"{path}: no tasks" + (f" ({out.skipped} bad rows skipped)" if out.skipped else ""))
    return out


def benchmark_name(name: str, known: bool = True) -> str:
    """The canonical name ("2wiki" -> "2wikimultihopqa"); unless `known` is False it must be in BENCHMARKS."""
    key = ALIASES.get(name.strip().lower(), name.strip().lower())
    if known and key not in BENCHMARKS:
        raise DataError(f"unknown benchmark {name!r}; known: {', '.join(BENCHMARKS)} (or pass a file path)")
    return key


def find_benchmark_file(name: str, root: str | Path) -> Path:
    """The one data file of benchmark `name` under `root`: root itself if a file, else the files in
    root/<name>/, root/benchmarks/<name>/ or root/ (the first of those that has any)."""
    root = Path(root)
    if root.is_file():
        return root
    if not root.is_dir():
        raise DataError(f"benchmark {name}: {root} is neither a file nor a folder")
    for folder in (root / name, root / "benchmarks" / name, root):
        files = sorted(p for p in folder.glob("*") if p.is_file() and p.name.lower().endswith(_SUFFIXES)) \
            if folder.is_dir() else []
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

    answered = threading.Event()

    def probe():
        try:
            urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout)
        except urllib.error.HTTPError:  # an answer all the same
            pass
        except Exception:  # no name lookup, no route, refused, timed out
            return
        answered.set()

    threading.Thread(target=probe, daemon=True).start()  # a stalled name lookup is left behind
    return answered.wait(timeout)


def _from_hub(name: str) -> Path:
    """The public file: from the hub's cache, else downloaded if the hub answers at once (offline,
    huggingface_hub would retry for ~25 s before failing)."""
    repo, filename = BENCHMARKS[name]
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


def load_benchmark(name: str, path: str | None = None, limit: int | None = None,
                   skip_bad_rows: bool = False, data_dir: str | None = None) -> Tasks:
    """A benchmark by name, from `path` (a file or a folder: `find_benchmark_file`; then any name labels the run),
    else from `data_dir` or $L0_MIN_DATA, else from the Hugging Face hub."""
    key = benchmark_name(name, known=not path)
    root = path or data_dir or os.environ.get("L0_MIN_DATA")
    file = find_benchmark_file(key, root) if root else _from_hub(key)
    return load_file(file, limit=limit, skip_bad_rows=skip_bad_rows, benchmark=key)


def load_tasks(spec: str, cfg: DataConfig | None = None, limit: int | None = None) -> Tasks:
    """Tasks from a benchmark name or a file path (layout sniffed). Synthetic tasks come from an
    environment's own generator (l0_min.envs: `env.tasks("synthetic:train")`)."""
    cfg = cfg or DataConfig()
    spec = spec.strip()
    if Path(spec).is_file():
        return load_file(spec, limit=limit, skip_bad_rows=cfg.skip_bad_rows)
    if benchmark_name(spec, known=False) in BENCHMARKS:
        return load_benchmark(spec, limit=limit, skip_bad_rows=cfg.skip_bad_rows, data_dir=cfg.data_dir or None)
    raise DataError(f"data spec {spec!r} is not 'synthetic[:train|:heldout]', a benchmark name "
                    f"({', '.join(BENCHMARKS)}), or an existing file")
