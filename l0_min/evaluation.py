"""Benchmark evaluation: sample records, a resumable results file, per-question aggregation, tables.

`evaluate.py` is the command line; this module holds what it computes. An evaluation folder
(default `runs/eval/<bench>-<model>`) holds:

    run.json            what is evaluated (bench, data file, mode, model, judge, sampling, agent budgets);
                        a rerun into the same folder must match it, and then resumes
    results.jsonl       one record per finished (question, sample), appended and flushed as each one
                        finishes, so a killed run loses only the samples that were in flight
    trajectories.jsonl  agent mode: the whole Episode behind each record (viewer.html shows them)
    summary.json, summary.md, config.yaml, server.log

A record (one line of results.jsonl):

    {"id": "5a8b57f2", "sample": 0, "question": "...", "answers": ["..."], "prediction": "..." | null,
     "status": "answered", "em": 1.0, "f1": 1.0, "answered": true, "grade": "correct" | null,
     "steps": 3, "seconds": 12.5, "error": ""}

Scoring (see `summarize`): EM and F1 are the best over the gold aliases (l0_min.rewards, SQuAD /
HotpotQA normalisation). Per question they are averaged over its samples, then over questions.
pass@k is the unbiased estimator of Chen et al. (2021), 1 - C(n-c, k) / C(n, k) for n samples of
which c are correct (EM = 1); with k = n (what evaluate.py reports) that is "any of the k samples is
correct". The judge (SimpleQA style) grades each sample correct / incorrect / not attempted; its
rates are averaged the same way, and accuracy-given-attempted and F-score follow simple-evals.
"""

from __future__ import annotations

import fcntl
import json
import logging
import math
import os
from collections import Counter
from pathlib import Path

from l0_min.episode import ENV_ERROR, Episode, Task
from l0_min.rewards import CORRECT, GRADES, INCORRECT, NOT_ATTEMPTED, exact_match, f1_score, has_answer

log = logging.getLogger(__name__)

# The benchmarks in the column order of the paper's tables (L0: SimpleQA, HotpotQA, MuSiQue,
# Bamboogle; then the extended set), with the headers used for them.
PAPER_ORDER = [("simpleqa", "SimpleQA"), ("hotpotqa", "HotpotQA"), ("musique", "MuSiQue"), ("bamboogle", "Bamboogle"),
               ("2wikimultihopqa", "2Wiki"), ("nq", "NQ"), ("triviaqa", "TriviaQA")]


class EvalError(ValueError):
    """A results file or evaluation folder that cannot be used; the message names it."""


# ---------------------------------------------------------------------------------------------
# records


def make_record(task: Task, sample: int, prediction: str | None, status: str, steps: int = 0,
                seconds: float = 0.0, error: str = "", grade: str | None = None) -> dict:
    """One finished (question, sample), scored with EM / F1 against every gold alias.

    >>> r = make_record(Task("q1", "Capital of France?", ["Paris"]), 0, "paris.", "answered", steps=2)
    >>> r["em"], r["f1"], r["answered"], r["grade"]
    (1.0, 1.0, True, None)
    """
    if grade is not None and grade not in GRADES:
        raise ValueError(f"grade must be one of {GRADES} or None, got {grade!r}")
    return {"id": task.id, "sample": sample, "question": task.question, "answers": list(task.answers),
            "prediction": prediction, "status": status, "em": exact_match(prediction, task.answers),
            "f1": f1_score(prediction, task.answers), "answered": has_answer(prediction), "grade": grade,
            "steps": steps, "seconds": round(seconds, 3), "error": error}


def record_from_episode(ep: Episode, grade: str | None = None) -> dict:
    return make_record(ep.task, ep.sample, ep.final_answer, ep.status, len(ep.steps), ep.seconds, ep.error, grade)


def first_line(text: str) -> str:
    """A direct answer: the first non-blank line of the generated text, stripped.

    >>> first_line("\\n  Paris \\nThe capital of France is Paris.")
    'Paris'
    >>> first_line("  ")
    ''
    """
    return next((line.strip() for line in text.splitlines() if line.strip()), "")


# ---------------------------------------------------------------------------------------------
# the results file


def read_results(path: str | Path) -> tuple[list[dict], int]:
    """(records, number of bytes that hold them) of a results.jsonl.

    A last line without its newline, or one that is not JSON, is a write cut short by a kill: it
    is left out (and `ResultsFile` truncates it away). A bad line anywhere else is an error naming
    file and line, as is a record without `id` or `sample`.
    """
    path = Path(path)
    if not path.exists():
        return [], 0
    data = path.read_bytes()
    complete = data.rfind(b"\n") + 1  # the bytes of whole lines
    if complete < len(data):
        log.warning("%s: dropping a torn last line (%d bytes) left by an interrupted run", path, len(data) - complete)
    lines = data[:complete].split(b"\n")[:-1]
    records, good = [], 0
    for i, raw in enumerate(lines, 1):
        if raw.strip():
            try:
                rec = json.loads(raw)
            except json.JSONDecodeError as e:
                if i == len(lines):
                    log.warning("%s:%d: dropping an unreadable last line left by an interrupted run", path, i)
                    break
                raise EvalError(f"{path}:{i}: not a JSON record ({e}); fix or delete that line") from None
            if not isinstance(rec, dict) or not isinstance(rec.get("id"), str) or not isinstance(rec.get("sample"), int):
                raise EvalError(f"{path}:{i}: a record needs a string 'id' and an integer 'sample'")
            records.append(rec)
        good += len(raw) + 1
    return records, good


def latest(records: list[dict]) -> dict[tuple[str, int], dict]:
    """Records by (id, sample); a later record of the same key replaces an earlier one (a retried
    env_error)."""
    return {(r["id"], r["sample"]): r for r in records}


class ResultsFile:
    """results.jsonl of an evaluation folder, opened for appending under an exclusive lock.

        with ResultsFile(out / "results.jsonl") as results:
            todo = [(t, s) for t in tasks for s in range(k) if (t.id, s) not in results.done]
            results.append(record)          # one line, flushed: a kill loses nothing finished

    `done` holds the finished keys. Samples that ended in env_error (the sandbox or a tool backend
    failed after the collector's retries: not the model's doing) are not done, so a rerun tries them
    again. A second process on the same file gets an EvalError instead of interleaving lines.
    """

    def __init__(self, path: str | Path, extra_files: tuple = ()):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = open(self.path.parent / ".lock", "w")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise EvalError(f"{self.path.parent} is in use by another evaluate.py (lock file {self.path.parent / '.lock'})") from None
        try:
            self.records, good = read_results(self.path)
        except EvalError:
            self._lock.close()
            raise
        if self.path.exists() and self.path.stat().st_size > good:
            os.truncate(self.path, good)
        for extra in extra_files:  # e.g. trajectories.jsonl: drop its torn tail too
            _truncate_torn_tail(Path(extra))
        self.by_key = latest(self.records)
        self.done = {k for k, r in self.by_key.items() if r.get("status") != ENV_ERROR}
        self.resumed = len(self.done)
        self._file = open(self.path, "a", encoding="utf-8")

    def append(self, record: dict) -> None:
        self._file.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._file.flush()
        self.records.append(record)
        key = (record["id"], record["sample"])
        self.by_key[key] = record
        if record.get("status") != ENV_ERROR:
            self.done.add(key)

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()
        if not self._lock.closed:
            self._lock.close()  # releases the flock

    def __enter__(self) -> "ResultsFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _truncate_torn_tail(path: Path) -> None:
    if path.exists() and path.stat().st_size:
        data = path.read_bytes()
        if not data.endswith(b"\n"):
            os.truncate(path, data.rfind(b"\n") + 1)


class JsonlWriter:
    """Append one JSON object per line and flush (trajectories.jsonl)."""

    def __init__(self, path: str | Path):
        self._file = open(path, "a", encoding="utf-8")

    def write(self, obj: dict) -> None:
        self._file.write(json.dumps(obj, ensure_ascii=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def check_run_info(path: str | Path, info: dict) -> None:
    """Write run.json, or check that an existing one describes the same evaluation (else resuming
    would mix results of different runs). Raises EvalError naming the settings that differ."""
    path = Path(path)
    if path.exists():
        try:
            old = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise EvalError(f"{path}: not JSON ({e})") from None
        diff = [k for k in sorted(set(old) | set(info)) if old.get(k) != info.get(k)]
        if diff:
            shown = "; ".join(f"{k}: {old.get(k)!r} before, {info.get(k)!r} now" for k in diff)
            raise EvalError(f"{path.parent} holds results of a different evaluation ({shown}). "
                            "Pass another --out, or delete the folder to start over.")
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(info, indent=2, ensure_ascii=False) + "\n")


# ---------------------------------------------------------------------------------------------
# the summary


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k (Chen et al. 2021): the chance that k of the n samples, drawn without
    replacement, include one of the c correct ones. With k == n: 1.0 if any sample is correct.

    >>> pass_at_k(4, 1, 4), pass_at_k(4, 0, 4), pass_at_k(4, 1, 1), pass_at_k(4, 2, 2)
    (1.0, 0.0, 0.25, 0.8333333333333334)
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def summarize(records: list[dict], k: int, judged: bool = False) -> dict:
    """Aggregate metrics of finished samples (pure, exact).

    Each question weighs the same: a metric is averaged over a question's samples, then over
    questions. pass@k uses the question's n samples (k = min(k, n) for a question with fewer).
    `judged`: add the SimpleQA judge rates (every record must then carry a grade). `steps` (agent
    steps per sample) is None when a record has none (direct mode).

    >>> rec = lambda i, s, em, ans=True: {"id": i, "sample": s, "em": em, "f1": em, "answered": ans,
    ...                                   "status": "answered", "steps": 2, "grade": None}
    >>> m = summarize([rec("a", 0, 1.0), rec("a", 1, 0.0), rec("b", 0, 0.0), rec("b", 1, 0.0, False)], k=2)
    >>> m["questions"], m["em"], m["pass_at_k"], m["answered"], m["not_attempted"]
    (2, 0.25, 0.5, 0.75, 0.25)
    """
    by_q: dict[str, list[dict]] = {}
    for r in records:
        by_q.setdefault(r["id"], []).append(r)
    if not by_q:
        raise ValueError("summarize: no records")
    per_q = list(by_q.values())

    def qmean(fn) -> float:
        return sum(sum(fn(r) for r in rs) / len(rs) for rs in per_q) / len(per_q)

    answered = qmean(lambda r: float(r["answered"]))
    m = {
        "questions": len(per_q),
        "samples": len(records),
        "k": k,
        "em": qmean(lambda r: float(r["em"])),
        "f1": qmean(lambda r: float(r["f1"])),
        "pass_at_k": _mean([pass_at_k(len(rs), sum(r["em"] == 1.0 for r in rs), min(k, len(rs))) for rs in per_q]),
        "answered": answered,
        "not_attempted": 1.0 - answered,  # no answer submitted (the judge's own rate is under "judge")
        "steps": None if any(r.get("steps") is None for r in records) else qmean(lambda r: float(r["steps"])),
        "incomplete_questions": sum(len(rs) < k for rs in per_q),
        "status": dict(sorted(Counter(r["status"] for r in records).items())),
    }
    if judged:
        missing = [r["id"] for r in records if r.get("grade") not in GRADES]
        if missing:
            raise ValueError(f"summarize(judged=True): {len(missing)} records have no grade, e.g. {missing[0]!r}")
        c, w, na = (qmean(lambda r, g=g: float(r["grade"] == g)) for g in (CORRECT, INCORRECT, NOT_ATTEMPTED))
        aga = c / (c + w) if c + w > 0 else 0.0
        m["judge"] = {
            "accuracy": c,
            "incorrect": w,
            "not_attempted": na,
            "accuracy_given_attempted": aga,
            "f_score": 2 * aga * c / (aga + c) if aga + c > 0 else 0.0,
            "pass_at_k": _mean([pass_at_k(len(rs), sum(r["grade"] == CORRECT for r in rs), min(k, len(rs)))
                                for rs in per_q]),
        }
    return m


# ---------------------------------------------------------------------------------------------
# tables

# (header, how to get the cell from a summary row, format); judge columns only when a row has them
_PCT, _NUM = "pct", "num"
COLUMNS = [
    ("model", lambda r: r["model"], None),
    ("mode", lambda r: r["mode"], None),
    ("bench", lambda r: r["bench"], None),
    ("n", lambda r: r["metrics"]["questions"], None),
    ("EM", lambda r: r["metrics"]["em"], _PCT),
    ("F1", lambda r: r["metrics"]["f1"], _PCT),
    ("judge acc", lambda r: r["metrics"]["judge"]["accuracy"], _PCT),
    ("acc|attempted", lambda r: r["metrics"]["judge"]["accuracy_given_attempted"], _PCT),
    ("judge F", lambda r: r["metrics"]["judge"]["f_score"], _PCT),
    ("not attempted", lambda r: r["metrics"]["judge"]["not_attempted"], _PCT),
    ("pass@k", lambda r: r["metrics"]["pass_at_k"], _PCT),
    ("answered", lambda r: r["metrics"]["answered"], _PCT),
    ("steps", lambda r: r["metrics"]["steps"], _NUM),
    ("wall", lambda r: r.get("wall_s"), "sec"),
]
JUDGE_COLUMNS = {"judge acc", "acc|attempted", "judge F", "not attempted"}


def _cell(value, fmt) -> str:
    if value is None:
        return "-"
    if fmt == _PCT:
        return f"{100 * value:.1f}"
    if fmt == _NUM:
        return f"{value:.2f}"
    if fmt == "sec":
        return f"{value:.0f} s" if value >= 10 else f"{value:.1f} s"
    return str(value)


def markdown_table(rows: list[dict]) -> str:
    """One row per evaluation run (a summary.json's object): model, mode, bench, n, EM, F1, the judge
    columns if any row was judged, pass@k, answered, mean steps, wall time. Rates are percentages.

    >>> m = {"questions": 2, "em": 0.5, "f1": 0.75, "pass_at_k": 0.5, "answered": 1.0, "steps": 2.5, "k": 1}
    >>> print(markdown_table([{"model": "m", "mode": "agent", "bench": "hotpotqa", "metrics": m, "wall_s": 3.21}]))
    | model | mode | bench | n | EM | F1 | pass@1 | answered | steps | wall |
    | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |
    | m | agent | hotpotqa | 2 | 50.0 | 75.0 | 50.0 | 100.0 | 2.50 | 3.2 s |
    """
    judged = any(r["metrics"].get("judge") for r in rows)
    cols = [c for c in COLUMNS if judged or c[0] not in JUDGE_COLUMNS]
    ks = sorted({r["metrics"].get("k", 1) for r in rows})
    headers = [f"pass@{ks[0]}" if h == "pass@k" and len(ks) == 1 else h for h, _, _ in cols]
    lines = ["| " + " | ".join(headers) + " |",
             "| " + " | ".join("---" if fmt is None and h != "n" else "---:" for h, _, fmt in cols) + " |"]
    for r in rows:
        cells = []
        for h, get, fmt in cols:
            try:
                v = get(r)
            except (KeyError, TypeError):  # a run without the judge in a judged table
                v = None
            cells.append(_cell(v, fmt))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def headline(summary: dict) -> float | None:
    """The number a paper's table shows for a run: judge accuracy if judged, else EM."""
    m = summary["metrics"]
    return m["judge"]["accuracy"] if m.get("judge") else m["em"]


def paper_table(summaries: list[dict]) -> str:
    """Several runs as the paper's tables lay them out: one row per (model, mode), one column per
    benchmark in PAPER_ORDER (only those present), each cell the headline (judge accuracy if judged,
    else EM) and F1, in percent. A later summary of the same model, mode and bench replaces an earlier.

    >>> s = lambda b, em: {"model": "m", "mode": "agent", "bench": b, "metrics": {"em": em, "f1": em}}
    >>> print(paper_table([s("bamboogle", 0.2), s("hotpotqa", 0.4)]))
    | model | mode | HotpotQA EM / F1 | Bamboogle EM / F1 |
    | --- | --- | ---: | ---: |
    | m | agent | 40.0 / 40.0 | 20.0 / 20.0 |
    """
    cells: dict[tuple[str, str], dict[str, dict]] = {}
    for s in summaries:
        cells.setdefault((s["model"], s["mode"]), {})[s["bench"]] = s
    benches = [(b, name) for b, name in PAPER_ORDER if any(b in row for row in cells.values())]
    benches += [(b, b) for b in sorted({b for row in cells.values() for b in row} - {b for b, _ in PAPER_ORDER})]
    heads = []
    for b, name in benches:
        judged = any(row[b]["metrics"].get("judge") for row in cells.values() if b in row)
        heads.append(f"{name} {'acc' if judged else 'EM'} / F1")
    lines = ["| model | mode | " + " | ".join(heads) + " |", "| --- | --- | " + " | ".join("---:" for _ in heads) + " |"]
    for (model, mode), row in cells.items():
        out = []
        for b, _ in benches:
            s = row.get(b)
            out.append("-" if s is None else f"{_cell(headline(s), _PCT)} / {_cell(s['metrics']['f1'], _PCT)}")
        lines.append(f"| {model} | {mode} | " + " | ".join(out) + " |")
    return "\n".join(lines)
