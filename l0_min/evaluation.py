"""Benchmark evaluation: paper-comparable scores, records, the LLM judge, a resumable results file,
per-question aggregates with confidence intervals, tables; `evaluate.py` is the command line. An
evaluation folder (default `runs/eval/<bench>-<model>-<mode>`) holds:

    run.json            what is evaluated (bench, data file, mode, model, sampling, agent budgets);
                        a rerun into the same folder must match it, and then resumes
    results.jsonl       one record per finished (question, sample), appended and flushed as each one
                        finishes (and again once judged), so a killed run or a failed judge loses
                        only the samples in flight
    trajectories.jsonl  agent mode: the whole Episode behind each record (viewer.html shows them)
    summary.json, summary.md, config.yaml, server.log

A record (one line of results.jsonl):

    {"id": "5a8b57f2", "sample": 0, "source": "hotpotqa", "question": "...", "answers": ["..."],
     "prediction": "..." | null, "status": "answered", "em": 1.0, "f1": 1.0, "lenient_em": 1.0,
     "lenient_f1": 1.0, "answered": true, "steps": 3, "seconds": 12.5, "error": "", "wall_s": 40.2,
     "grade": "correct", "judge": "<judge model>", "judge_error": ""}     (the last three when judged)

Scoring (see `summarize`, also per source for a mixed file, as the papers print it): EM and F1 are the
official SQuAD / HotpotQA ones (`envs.qa.official_normalize`), best over the gold aliases, so tables compare with
published numbers; lenient_em / lenient_f1 are the training reward's Unicode-aware scores. The judge
(SimpleQA style) grades each sample correct / incorrect / not attempted, or "unparsed" when its reply
named no grade (counted apart, and said), kept in the record for resumes.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import re
from collections import Counter
from pathlib import Path
from typing import Awaitable, Callable, Iterable

from l0_min.episode import ENV_ERROR, Episode, Task
from l0_min.log import open_jsonl, read_jsonl, write_jsonl
from l0_min.envs.qa import exact_match, f1_score, official_em, official_f1
from l0_min.rewards import has_answer

# The papers' columns: L0's judged SimpleQA, then Search-R1's seven in the order its tables print them; each
# with its header and the other names a row's data_source gives it (FlashRAG and Search-R1 files differ).
PAPER_ORDER = [("simpleqa", "SimpleQA", "simple_qa"), ("nq", "NQ", "nq_open nq-open"), ("triviaqa", "TriviaQA", "tq trivia_qa"),
               ("popqa", "PopQA", "pop_qa"), ("hotpotqa", "HotpotQA", "hotpot hotpot_qa"),
               ("2wikimultihopqa", "2Wiki", "2wiki 2wikimqa"), ("musique", "MuSiQue", ""), ("bamboogle", "Bamboogle", "")]
_BENCHMARK = {alias: key for key, _, aliases in PAPER_ORDER for alias in (key, *aliases.split())}


def benchmark_key(source: str) -> str:
    """The benchmark a data_source names ("tq" -> "triviaqa"); an unknown one, lower-cased.

    >>> benchmark_key("2wiki"), benchmark_key("TQ"), benchmark_key("my_set")
    ('2wikimultihopqa', 'triviaqa', 'my_set')
    """
    return _BENCHMARK.get(source.strip().lower(), source.strip().lower())


class EvalError(ValueError):
    """A results file, evaluation folder or judge that cannot be used; the message names it."""


# ------------------------------------------------------------------------------------- records
def make_record(task: Task, sample: int, prediction: str | None, status: str, steps: int | None = 0,
                seconds: float = 0.0, error: str = "") -> dict:
    """One finished (question, sample), scored against every gold alias, officially and leniently.

    >>> r = make_record(Task("q1", "Capital of France?", ["Paris"]), 0, "paris.", "answered", steps=2)
    >>> r["em"], r["f1"], r["answered"]
    (1.0, 1.0, True)
    >>> r = make_record(Task("q2", "Capital of Japan?", ["“Tokyo”"]), 0, "Tokyo", "answered")
    >>> r["em"], r["lenient_em"]  # curly quotes are not in string.punctuation
    (0.0, 1.0)
    """
    golds = list(task.answers)
    return {"id": task.id, "sample": sample, "source": task.meta.get("benchmark", ""), "question": task.question,
            "answers": golds, "prediction": prediction, "status": status, "em": official_em(prediction, golds),
            "f1": official_f1(prediction, golds), "lenient_em": exact_match(prediction, golds),
            "lenient_f1": f1_score(prediction, golds), "answered": has_answer(prediction), "steps": steps,
            "seconds": round(seconds, 3), "error": error}


def record_from_episode(ep: Episode) -> dict:
    """The record of a scored episode (evaluate.py's agent mode)."""
    return make_record(ep.task, ep.sample, ep.final_answer, ep.status, len(ep.steps), ep.seconds, ep.error)


def first_line(text: str) -> str:
    """A direct answer: the first non-blank line of the generated text, stripped.

    >>> first_line("\\n  Paris \\nThe capital of France is Paris.")
    'Paris'
    """
    return next((line.strip() for line in text.splitlines() if line.strip()), "")


# ---------------- the LLM judge, SimpleQA style: A = correct, B = incorrect, C = not attempted
CORRECT, INCORRECT, NOT_ATTEMPTED, UNPARSED = "correct", "incorrect", "not_attempted", "unparsed"
GRADES = (CORRECT, INCORRECT, NOT_ATTEMPTED, UNPARSED)
_LETTER = dict(zip("ABC", GRADES))

JUDGE_PROMPT = """You are grading an answer to a factual question. Compare the predicted answer with the gold \
answer and choose one grade.

A) CORRECT: the predicted answer contains the gold answer's meaning and says nothing that contradicts it. \
Differences in capitalisation, punctuation, word order, spelling of names, or extra context that does not \
contradict the gold answer are fine. A number must match the gold answer to the precision the question \
asks for (e.g. "about 3,500" is fine for "3,518" only if the question does not ask for an exact figure). \
Hedged answers are correct only if the hedge still commits to the gold answer.
B) INCORRECT: the predicted answer contradicts the gold answer, names a different entity, date or number, \
or lists several candidates of which some are wrong.
C) NOT_ATTEMPTED: the predicted answer does not commit to any answer (e.g. "I don't know", "I could not \
find it", an empty answer, or only a restatement of the question), and contradicts nothing.

Judge only whether the predicted answer matches the gold answer; do not use your own knowledge to \
second-guess the gold answer.

Question: {question}
Gold answer: {gold}
Predicted answer: {predicted}

Reply with one letter, A, B or C, and nothing else."""


def judge_prompt(question: str, gold: str | Iterable[str], predicted: str | None) -> str:
    """The grader prompt; several gold aliases are joined with " | "."""
    gold_text = gold if isinstance(gold, str) else " | ".join(gold)
    return JUDGE_PROMPT.format(question=question.strip(), gold=gold_text.strip(),
                               predicted=(predicted or "").strip() or "(no answer)")


class JudgeParseError(ValueError):
    """The judge's reply names no grade; the message quotes the reply."""


def parse_grade(reply: str) -> str:
    """The grade in a judge reply: 'correct' | 'incorrect' | 'not_attempted'.

    Accepts a bare letter, a letter with markup or a label ("**B**", "(A)", "Grade: C",
    "A) CORRECT"), the label words (upper case), and ignores a leading <think>...</think>.
    Raises JudgeParseError when no grade can be found.

    >>> parse_grade("A"), parse_grade("**B**"), parse_grade("<think>It says A?</think>\\nGrade: C")
    ('correct', 'incorrect', 'not_attempted')
    >>> parse_grade("The prediction is INCORRECT.")
    'incorrect'
    """
    text = re.sub(r"<think>.*?(</think>|$)", " ", reply, flags=re.S).strip()
    bare = re.sub(r"[\s*_`'\"().:\[\]]+", "", text)
    if bare in _LETTER:
        return _LETTER[bare]
    # "Grade: B", "answer is (A)", "verdict - **C**"; then "A) CORRECT", "B. INCORRECT", or a letter alone on a line
    for pattern in (r"(?i:grade|answer|verdict|choice)\W{0,4}(?i:is)?\W{0,4}\b([ABC])\b(?![\w'])",
                    r"(?m)^\W*([ABC])\s*(?:[).:\]*`-]|$)"):
        if m := re.findall(pattern, text):
            return _LETTER[m[-1]]
    if m := re.findall(r"\b(NOT[_ ]ATTEMPTED|INCORRECT|CORRECT)\b", text):
        return m[-1].lower().replace(" ", "_")
    raise JudgeParseError(f"no grade (A/B/C) in judge reply: {reply[:300]!r}")


async def judge_record(rec: dict, generate_text: Callable[[str], Awaitable[str]], judge: str, retries: int = 1) -> dict:
    """Grade a record's prediction with an LLM: {"grade": correct | incorrect | not_attempted | unparsed,
    "judge": `judge` (the judge model's name, kept so that another judge grades again), "judge_error": ""}.
    `generate_text(prompt) -> reply` is any async text generator (a chat endpoint, the inference client).
    An unanswered prediction is not attempted without a call. A reply that names no grade is asked again
    up to `retries` times, then is "unparsed" (simple-evals would count it not attempted; here it is
    counted apart and the summary says how many), quoted in judge_error."""
    fields = {"grade": NOT_ATTEMPTED, "judge": judge, "judge_error": ""}
    if has_answer(rec["prediction"]):
        prompt = judge_prompt(rec["question"], rec["answers"], rec["prediction"])
        for _ in range(retries + 1):
            try:
                return fields | {"grade": parse_grade(await generate_text(prompt)), "judge_error": ""}
            except JudgeParseError as e:
                fields |= {"grade": UNPARSED, "judge_error": str(e)}
    return fields


# ---------------------------------------------------------------------------- the results file
def read_results(path: str | Path) -> list[dict]:
    """The records of a results.jsonl (a torn last line left by a kill is left out). A bad line
    elsewhere, or a record without a string `id` and an integer `sample`, is an EvalError naming it."""
    try:
        records = read_jsonl(path) if Path(path).exists() else []
    except ValueError as e:
        raise EvalError(f"{e}; fix or delete that line") from None
    for i, r in enumerate(records, 1):
        if not isinstance(r, dict) or not isinstance(r.get("id"), str) or not isinstance(r.get("sample"), int):
            raise EvalError(f"{path}: record {i} needs a string 'id' and an integer 'sample'")
    return records


class ResultsFile(contextlib.AbstractContextManager):
    """results.jsonl of an evaluation folder, opened for appending under an exclusive lock.

        with ResultsFile(out / "results.jsonl") as results:
            todo = [(t, s) for t in tasks for s in range(k) if (t.id, s) not in results.done]
            results.append(record)          # one line, flushed: a kill loses nothing finished

    `by_key` holds the latest record of each (id, sample): a later line replaces an earlier one (a retried
    env_error, a judged record). `done` holds the finished keys: env_error samples (the sandbox or a tool
    backend failed after the collector's retries, not the model) are not done, so a rerun retries them.
    A torn last line is cut before appending. A second process on the folder gets an EvalError.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = open(self.path.parent / ".lock", "w")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            self._file = open_jsonl(self.path)  # cuts a torn last line first, so reading cannot keep it
            self.by_key = {(r["id"], r["sample"]): r for r in read_results(self.path)}
        except BlockingIOError:
            self._lock.close()
            raise EvalError(f"{self.path.parent} is in use by another evaluate.py (lock file {self._lock.name})") \
                from None
        except BaseException:
            self.close()
            raise
        self.done = {k for k, r in self.by_key.items() if r.get("status") != ENV_ERROR}

    def append(self, record: dict) -> None:
        write_jsonl(self._file, record)
        self.by_key[(record["id"], record["sample"])] = record
        if record.get("status") != ENV_ERROR:
            self.done.add((record["id"], record["sample"]))

    def close(self) -> None:
        if hasattr(self, "_file"):
            self._file.close()
        self._lock.close()  # releases the flock

    def __exit__(self, *exc) -> None:
        self.close()


def check_run_info(path: str | Path, info: dict) -> None:
    """Write run.json, or check that an existing one describes the same evaluation (else resuming
    would mix results of different runs). Raises EvalError naming the settings that differ."""
    path = Path(path)
    if path.exists():
        try:
            old = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise EvalError(f"{path}: not JSON ({e})") from None
        if diff := [k for k in sorted(set(old) | set(info)) if old.get(k) != info.get(k)]:
            shown = "; ".join(f"{k}: {old.get(k)!r} before, {info.get(k)!r} now" for k in diff)
            raise EvalError(f"{path.parent} holds results of a different evaluation ({shown}). "
                            "Pass another --out, or delete the folder to start over.")
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(info, indent=2, ensure_ascii=False) + "\n")


# ---------------------------------------------------------------------------------- statistics
def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k (Chen et al. 2021): the chance that k of the n samples, drawn without
    replacement, include one of the c correct ones. With k == n: 1.0 if any sample is correct.

    >>> pass_at_k(4, 1, 4), pass_at_k(4, 0, 4), pass_at_k(4, 1, 1), pass_at_k(4, 2, 2)
    (1.0, 0.0, 0.25, 0.8333333333333334)
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1.0 if n - c < k else 1.0 - math.comb(n - c, k) / math.comb(n, k)


Z95 = 1.959963984540054  # the two-sided 95% quantile of the standard normal


def wilson_interval(successes: float, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval (95% by default) of a proportion successes / n: unlike p +- z*se it
    stays inside [0, 1] and is not empty at 0 or n successes.

    >>> [round(x, 4) for x in wilson_interval(8, 10)], [round(x, 4) for x in wilson_interval(0, 10)]
    ([0.4902, 0.9433], [0.0, 0.2775])
    """
    if n < 1 or not 0 <= successes <= n:
        raise ValueError(f"wilson_interval needs n >= 1 and 0 <= successes <= n, got {successes}/{n}")
    p, d = successes / n, 1 + z * z / n
    center, half = (p + z * z / (2 * n)) / d, z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return max(0.0, center - half), min(1.0, center + half)


def two_proportion_z_test(c1: float, n1: int, c2: float, n2: int) -> tuple[float, float, float]:
    """(difference p1 - p2, z, two-sided p-value) of the pooled two-proportion z-test, e.g. EM after vs
    before training on n1 and n2 questions. Worked example: 60/100 vs 45/100 correct: pooled p =
    105/200 = 0.525, se = sqrt(0.525 * 0.475 * (1/100 + 1/100)) = 0.07062, z = 0.15 / se = 2.124,
    p = erfc(2.124 / sqrt 2) = 0.0337: significant at 5%.

    >>> [round(x, 4) for x in two_proportion_z_test(60, 100, 45, 100)]
    [0.15, 2.124, 0.0337]
    """
    p1, p2, pooled = c1 / n1, c2 / n2, (c1 + c2) / (n1 + n2)
    se = math.sqrt(pooled * (1 - pooled) * (1 / n1 + 1 / n2))
    if se == 0:  # both all right or all wrong: no evidence of a difference
        return p1 - p2, 0.0, 1.0
    z = (p1 - p2) / se
    return p1 - p2, z, math.erfc(abs(z) / math.sqrt(2))


# --------------------------------------------------------------------------------- the summary
def summarize(records: list[dict], k: int | None = None, judged: bool = False) -> dict:
    """Aggregate metrics of finished samples (pure, exact): evaluate.py's one scoring path.

    Each question weighs the same: a metric is averaged over a question's samples, then over
    questions. `em_ci` is the 95% Wilson interval of EM over the questions (exact for one sample per
    question). pass@k uses the question's n samples (k = min(k, n); k defaults to the most samples
    any question has). `judged`: add the SimpleQA judge rates (every record must then carry a grade;
    "unparsed" ones count in no rate but their own). `steps` is None when a record has none (direct
    mode). Records of several sources (`source`, by `benchmark_key`) are also summarised per source,
    under "sources", with their mean under "source_avg".

    >>> rec = lambda i, s, em, ans=True: {"id": i, "sample": s, "em": em, "f1": em, "lenient_em": em,
    ...                                   "lenient_f1": em, "answered": ans, "status": "answered", "steps": 2}
    >>> m = summarize([rec("a", 0, 1.0), rec("a", 1, 0.0), rec("b", 0, 0.0), rec("b", 1, 0.0, False)])
    >>> m["questions"], m["k"], m["em"], m["pass_at_k"], m["answered"], m["not_attempted"]
    (2, 2, 0.25, 0.5, 0.75, 0.25)
    """
    by_q: dict[str, list[dict]] = {}
    for r in records:
        by_q.setdefault(r["id"], []).append(r)
    if not by_q:
        raise ValueError("summarize: no records")
    per_q = list(by_q.values())
    k = k or max(map(len, per_q))

    def qmean(fn) -> float:
        return sum(sum(fn(r) for r in rs) / len(rs) for rs in per_q) / len(per_q)

    def rate_pass_at_k(correct) -> float:
        return sum(pass_at_k(len(rs), sum(map(correct, rs)), min(k, len(rs))) for rs in per_q) / len(per_q)

    answered = qmean(lambda r: float(r["answered"]))
    m = {"questions": len(per_q), "samples": len(records), "k": k,
         **{key: qmean(lambda r, key=key: float(r[key])) for key in ("em", "f1", "lenient_em", "lenient_f1")}}
    m.update(em_ci=wilson_interval(min(m["em"] * len(per_q), len(per_q)), len(per_q)),
             pass_at_k=rate_pass_at_k(lambda r: r["em"] == 1.0), answered=answered,
             not_attempted=1.0 - answered,  # no answer submitted (the judge's own rate is under "judge")
             steps=None if any(r.get("steps") is None for r in records) else qmean(lambda r: float(r["steps"])),
             incomplete_questions=sum(len(rs) < k for rs in per_q),
             status=dict(sorted(Counter(r["status"] for r in records).items())))
    if judged:
        if missing := [r["id"] for r in records if r.get("grade") not in GRADES]:
            raise ValueError(f"summarize(judged=True): {len(missing)} records have no grade, e.g. {missing[0]!r}")
        c, w, na, unparsed = (qmean(lambda r, g=g: float(r["grade"] == g)) for g in GRADES)
        aga = c / (c + w) if c + w > 0 else 0.0  # accuracy given attempted; F: its harmonic mean with accuracy
        m["judge"] = {"accuracy": c, "incorrect": w, "not_attempted": na, "accuracy_given_attempted": aga,
                      "f_score": 2 * aga * c / (aga + c) if aga + c > 0 else 0.0,
                      "pass_at_k": rate_pass_at_k(lambda r: r["grade"] == CORRECT), "unparsed": unparsed,
                      "unparsed_samples": sum(r["grade"] == UNPARSED for r in records)}
    sources = sorted({benchmark_key(r.get("source", "")) for r in records})
    if len(sources) > 1:
        m["sources"] = {s: summarize([r for r in records if benchmark_key(r.get("source", "")) == s], k, judged)
                        for s in sources}  # fmt: skip
        m["source_avg"] = {key: sum(sm[key] for sm in m["sources"].values()) / len(sources) for key in ("em", "f1")}
    return m


def _pct(v: float) -> str:
    return f"{100 * v:.1f}"


def format_summary(m: dict) -> str:
    """One line of a summary's headline numbers, in percent.

    >>> print(format_summary(summarize([{"id": "a", "sample": 0, "em": 1.0, "f1": 1.0, "lenient_em": 1.0,
    ...     "lenient_f1": 1.0, "answered": True, "status": "answered", "steps": 3}])))
    EM 100.0 (95% CI 20.7-100.0) | F1 100.0 | lenient EM 100.0 | answered 100.0 | 1 questions x 1 samples
    """
    parts = [f"EM {_pct(m['em'])} (95% CI {_pct(m['em_ci'][0])}-{_pct(m['em_ci'][1])})", f"F1 {_pct(m['f1'])}",
             f"lenient EM {_pct(m['lenient_em'])}", f"answered {_pct(m['answered'])}"]
    if m["k"] > 1:
        parts.append(f"pass@{m['k']} {_pct(m['pass_at_k'])}")
    if m.get("judge"):
        parts.append(f"judge accuracy {_pct(m['judge']['accuracy'])}")
        if m["judge"].get("unparsed_samples"):
            parts.append(f"{m['judge']['unparsed_samples']} judge replies unparsed")
    return " | ".join(parts + [f"{m['questions']} questions x {m['k']} samples"])


# -------------------------------------------------------------------------------------- tables
# (header, the summary row's key(s) of the cell, format); text columns left-aligned; judge.* only when judged
COLUMNS = [
    ("model", "model", None), ("mode", "mode", None), ("bench", "bench", None), ("n", "questions", str),
    ("EM", "em", _pct), ("95% CI", "em_ci", lambda v: f"{_pct(v[0])}-{_pct(v[1])}"), ("F1", "f1", _pct),
    ("lenient EM", "lenient_em", _pct), ("judge acc", "judge.accuracy", _pct),
    ("acc|attempted", "judge.accuracy_given_attempted", _pct), ("judge F", "judge.f_score", _pct),
    ("not attempted", "judge.not_attempted", _pct), ("unparsed", "judge.unparsed", _pct), ("pass@k", "pass_at_k", _pct),
    ("answered", "answered", _pct),
    ("steps", "steps", lambda v: f"{v:.2f}"), ("wall", "wall_s", lambda v: f"{v:.0f} s" if v >= 10 else f"{v:.1f} s"),
]


def _cell(row: dict, key: str, fmt) -> str:
    """The formatted value at `key` ("judge.accuracy": a nested key) of the row or its metrics; "-" if none."""
    value = row if key in row else row["metrics"]
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return "-" if value is None else (fmt or str)(value)


def markdown_table(rows: list[dict]) -> str:
    """One row per evaluation run (a summary.json's object), one column per COLUMNS entry (the judge
    ones only if a row was judged). Rates are percentages.

    >>> m = {"questions": 2, "em": 0.5, "em_ci": [0.1, 0.9], "f1": 0.75, "lenient_em": 0.5, "pass_at_k": 0.5,
    ...      "answered": 1.0, "steps": 2.5, "k": 1}
    >>> print(markdown_table([{"model": "m", "mode": "agent", "bench": "hotpotqa", "metrics": m, "wall_s": 3.21}]))
    | model | mode | bench | n | EM | 95% CI | F1 | lenient EM | pass@1 | answered | steps | wall |
    | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |
    | m | agent | hotpotqa | 2 | 50.0 | 10.0-90.0 | 75.0 | 50.0 | 50.0 | 100.0 | 2.50 | 3.2 s |
    """
    judged = any(r["metrics"].get("judge") for r in rows)
    cols = [c for c in COLUMNS if judged or not c[1].startswith("judge.")]
    ks = sorted({r["metrics"].get("k", 1) for r in rows})
    headers = [f"pass@{ks[0]}" if h == "pass@k" and len(ks) == 1 else h for h, _, _ in cols]
    lines = [_line(headers), _line("---" if fmt is None else "---:" for *_, fmt in cols)]
    return "\n".join(lines + [_line(_cell(r, key, fmt) for _, key, fmt in cols) for r in rows])


def _line(cells) -> str:
    return "| " + " | ".join(cells) + " |"


def paper_table(summaries: list[dict]) -> str:
    """Several runs as the papers lay them out: a row per (model, mode), a column per benchmark of
    PAPER_ORDER present (a mixed run per source), EM in percent, then F1 in a table of its own; a judged
    SimpleQA shows the judge's accuracy and F-score, which "Avg." (of EM, or F1) leaves out. A later
    summary of the same model, mode and bench replaces an earlier.

    >>> s = lambda b, em: {"model": "m", "mode": "agent", "bench": b, "metrics": {"em": em, "f1": em + 0.1}}
    >>> print(paper_table([s("bamboogle", 0.2), s("hotpotqa", 0.4)]))
    EM
    | model | mode | HotpotQA | Bamboogle | Avg. |
    | --- | --- | ---: | ---: | ---: |
    | m | agent | 40.0 | 20.0 | 30.0 |
    <BLANKLINE>
    F1
    | model | mode | HotpotQA | Bamboogle | Avg. |
    | --- | --- | ---: | ---: | ---: |
    | m | agent | 50.0 | 30.0 | 40.0 |
    """
    cells: dict[tuple[str, str], dict[str, dict]] = {}
    for s in summaries:
        for bench, m in (s["metrics"].get("sources") or {s["bench"]: s["metrics"]}).items():
            cells.setdefault((s["model"], s["mode"]), {})[benchmark_key(bench)] = m
    present = {b for row in cells.values() for b in row}
    benches = [(b, name) for b, name, _ in PAPER_ORDER if b in present] + [(b, b) for b in sorted(present - set(_BENCHMARK))]
    judged = {b for b, _ in benches if b == "simpleqa" and any(row.get(b, {}).get("judge") for row in cells.values())}
    tables = []
    for metric, judge_metric, title in (("em", "accuracy", "EM"), ("f1", "f_score", "F1")):
        heads = [f"{name} {'acc' if metric == 'em' else 'F'}" if b in judged else name for b, name in benches]
        lines = [title, _line(["model", "mode", *heads] + ["Avg."] * (len(benches) > 1)),
                 _line(["---", "---"] + ["---:"] * (len(benches) + (len(benches) > 1)))]
        for (model, mode), row in cells.items():
            values = [None if b not in row else (row[b].get("judge") or {}).get(judge_metric) if b in judged else row[b][metric]
                      for b, _ in benches]  # fmt: skip
            if len(benches) > 1:
                plain = [v for (b, _), v in zip(benches, values) if v is not None and b not in judged]
                values.append(sum(plain) / len(plain) if plain else None)
            lines.append(_line([model, mode] + ["-" if v is None else _pct(v) for v in values]))
        tables.append("\n".join(lines))
    return "\n\n".join(tables)
