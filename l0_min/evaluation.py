"""Evaluation, for any environment: records scored by the task's environment (`TaskEnv.score`), the LLM judge,
a resumable results file, per-question aggregates with confidence intervals, tables; `evaluate.py` is the
command line, and train.py / rollout.py summarise their held-out episodes with the same `summarize`.

An evaluation folder (default `runs/eval/<bench>-<model>-<mode>`) holds run.json (what is evaluated; a rerun
into the folder must match it, and then resumes), results.jsonl (one `record` per finished (question, sample),
appended and flushed as each one finishes, and again once judged with "grade", "judge", "judge_error"),
trajectories.jsonl (agent mode), summary.json, summary.md, config.yaml, server.log.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import functools
import json
import math
import os
import re
from collections import Counter
from pathlib import Path
from typing import Awaitable, Callable

import aiohttp

from l0_min.answers import has_answer
from l0_min.envs import solved
from l0_min.config import is_number
from l0_min.episode import ENV_ERROR, Episode
from l0_min.log import label, open_jsonl, read_jsonl, write_jsonl


class EvalError(ValueError):
    """A results file, evaluation folder or judge that cannot be used; the message names it."""


# ------------------------------------------------------------------------------------- records
def record(ep: Episode) -> dict:
    """The record of a scored episode: the task, the answer, how it ended and every number its scoring gave.

    >>> from l0_min.episode import Task
    >>> r = record(Episode(Task("q1", "Capital?", ["Paris"]), status="answered", final_answer="paris", reward=0.9,
    ...                    rewards={"core": 1.0, "em": 1.0, "note": "x"}))
    >>> r["prediction"], r["answered"], r["em"], r["reward"], "note" in r
    ('paris', True, 1.0, 0.9, False)
    """
    t = ep.task
    return {"id": t.id, "sample": ep.sample, "source": str(t.meta.get("benchmark", "")), "question": t.question,
            "answers": list(t.answers), "prediction": ep.final_answer, "status": ep.status,
            "answered": has_answer(ep.final_answer), "steps": len(ep.steps), "seconds": round(ep.seconds, 3),
            "error": ep.error, "reward": ep.reward, **{k: float(v) for k, v in ep.rewards.items() if is_number(v)}}


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

class JudgeParseError(ValueError):
    """The judge's reply names no grade; the message quotes the reply."""


def parse_grade(reply: str) -> str:
    """The grade in a judge reply (a letter, bare, with markup or a label, or the label words; a leading
    <think>...</think> ignored), or JudgeParseError.

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


JUDGE_SYSTEM = "You grade answers to factual questions. Reply with one letter."
JUDGE_MAX_NEW_TOKENS = 128


async def judge_record(rec: dict, generate_text: Callable[[str], Awaitable[str]], judge: str,
                       prompt: Callable[[str, list, str], str], retries: int = 1) -> dict:
    """Grade a record's prediction with an LLM: {"grade", "judge": `judge` (kept so that another judge grades
    again), "judge_error"}, by `prompt(question, golds, prediction)` (`TaskEnv.judge_prompt`) and any async
    `generate_text`. No answer: not attempted, without a call. A reply that names no grade is asked again up to
    `retries` times, then is "unparsed" (counted apart, not as not attempted as simple-evals does)."""
    fields = {"grade": NOT_ATTEMPTED, "judge": judge, "judge_error": ""}
    if has_answer(rec["prediction"]):
        text = prompt(rec["question"], rec["answers"], rec["prediction"])
        for _ in range(retries + 1):
            try:
                return fields | {"grade": parse_grade(await generate_text(text)), "judge_error": ""}
            except JudgeParseError as e:
                fields |= {"grade": UNPARSED, "judge_error": str(e)}
    return fields


async def chat_completion(session: aiohttp.ClientSession, url: str, model: str, prompt: str, tries: int = 4) -> str:
    """One greedy reply of an OpenAI-compatible endpoint (POST {url}/chat/completions); 429, 5xx and
    connection errors are retried with backoff (1, 2, 4 s)."""
    body = {"model": model, "temperature": 0, "max_tokens": JUDGE_MAX_NEW_TOKENS,
            "messages": [{"role": "system", "content": JUDGE_SYSTEM}, {"role": "user", "content": prompt}]}
    for attempt in range(tries):
        try:
            async with session.post(f"{url}/chat/completions", json=body) as r:
                status, text = r.status, await r.text()
            if status == 200:
                return json.loads(text)["choices"][0]["message"]["content"] or ""
            error = f"HTTP {status}: {text[:300]}"
            if status != 429 and status < 500:
                break
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            error = f"{type(e).__name__}: {e}"
        except (ValueError, LookupError, TypeError):
            raise EvalError(f"judge {url}/chat/completions: not a chat completion: {text[:300]}") from None
        if attempt < tries - 1:
            await asyncio.sleep(2 ** attempt)
    raise EvalError(f"judge {url}/chat/completions: {error}")


@contextlib.asynccontextmanager
async def judge_client(url: str, judge: str, key_env: str | None, tokenizer, policy, cfg, prompt):
    """grade(record) -> the judge's fields (judge_record): `judge` behind an OpenAI-compatible `url` (.../v1; the API
    key in $`key_env`), an SGLang server, or `policy` itself (url "self"), prompted with its chat template."""
    if url.endswith("/v1"):
        key = os.environ.get(key_env or "", "")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=300)) as session:
            yield lambda rec: judge_record(rec, functools.partial(chat_completion, session, url, judge), judge, prompt)
        return
    from l0_min.context import ChatFormat
    from l0_min.inference import InferenceClient

    chat = ChatFormat(tokenizer)
    client = policy if url == "self" else InferenceClient([u for u in url.split(",") if u], cfg.inference)
    async with contextlib.nullcontext() if url == "self" else client:  # the policy is its caller's to close
        if url != "self" and not await client.health():
            raise EvalError(f"judge {url}: no server answers /health")

        async def generate_text(prompt: str) -> str:
            gen = await client.generate(chat.prompt_ids(JUDGE_SYSTEM, prompt),
                                        {"max_new_tokens": JUDGE_MAX_NEW_TOKENS, "temperature": 0.0})
            return tokenizer.decode(gen.output_ids, skip_special_tokens=True)

        yield lambda rec: judge_record(rec, generate_text, judge, prompt)


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
    """results.jsonl of an evaluation folder, appended to (one flushed line a record) under an exclusive lock: a second
    process on the folder gets an EvalError. `by_key`: the latest record of each (id, sample). `done`: the finished
    keys; env_error samples (the sandbox or a tool failed, not the model) are not, so a rerun retries them."""

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
            raise EvalError(f"{self.path.parent} is in use by another evaluate.py (lock file {self._lock.name})") from None
        except BaseException:
            self.close()
            raise
        self.done = {k for k, r in self.by_key.items() if r.get("status") != ENV_ERROR}

    def append(self, record: dict) -> None:
        write_jsonl(self._file, record)
        self.by_key[(record["id"], record["sample"])] = record
        if record.get("status") != ENV_ERROR:
            self.done.add((record["id"], record["sample"]))

    def close(self, *exc) -> None:
        if hasattr(self, "_file"):
            self._file.close()
        self._lock.close()  # releases the flock

    __exit__ = close


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
    """Unbiased pass@k (Chen et al. 2021): the chance that k of n samples include one of the c correct ones.

    >>> pass_at_k(4, 1, 4), pass_at_k(4, 0, 4), pass_at_k(4, 1, 1), pass_at_k(4, 2, 2)
    (1.0, 0.0, 0.25, 0.8333333333333334)
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1.0 if n - c < k else 1.0 - math.comb(n - c, k) / math.comb(n, k)


def wilson_interval(successes: float, n: int, z: float = 1.959963984540054) -> tuple[float, float]:
    """The Wilson score interval (95% by default) of successes / n: unlike p +- z*se, inside [0, 1] and not empty at 0 or n.

    >>> [round(x, 4) for x in wilson_interval(8, 10)], [round(x, 4) for x in wilson_interval(0, 10)]
    ([0.4902, 0.9433], [0.0, 0.2775])
    """
    if n < 1 or not 0 <= successes <= n:
        raise ValueError(f"wilson_interval needs n >= 1 and 0 <= successes <= n, got {successes}/{n}")
    p, d = successes / n, 1 + z * z / n
    center, half = (p + z * z / (2 * n)) / d, z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return max(0.0, center - half), min(1.0, center + half)


def two_proportion_z_test(c1: float, n1: int, c2: float, n2: int) -> tuple[float, float, float]:
    """(p1 - p2, z, two-sided p-value) of the pooled two-proportion z-test, e.g. EM after vs before training.

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
def summarize(records: list[dict], metrics: tuple[str, ...] | list[str], k: int | None = None,
              judged: bool = False) -> dict:
    """The one summary of held-out results (evaluate.py, train.py, rollout.py). Each question weighs the same
    (averaged over its samples, then over questions). `metrics`: the environment's, each one's mean; the first,
    the headline (0 or 1 a sample), also as "score" with "successes", its 95% Wilson interval "score_ci" and
    pass@k (k: by default the most samples any question has). `judged`: the judge's rates (every record needs a
    grade). `steps` is None in direct mode. Several sources: also per source ("sources", mean "source_avg").

    >>> rec = lambda i, s, em, ans=True: {"id": i, "sample": s, "em": em, "answered": ans, "status": "answered",
    ...                                   "steps": 2, "reward": em}
    >>> m = summarize([rec("a", 0, 1.0), rec("a", 1, 0.0), rec("b", 0, 0.0), rec("b", 1, 0.0, False)], ["em"])
    >>> m["n"], m["k"], m["score"], m["successes"], m["pass_at_k"], m["answered"], m["not_attempted"]
    (2, 2, 0.25, 0.5, 0.5, 0.75, 0.25)
    """
    by_q: dict[str, list[dict]] = {}
    for r in records:
        by_q.setdefault(r["id"], []).append(r)
    if not by_q:
        raise ValueError("summarize: no records")
    if not metrics:
        raise ValueError("summarize: no metrics (the environment's `metrics`; the first is the headline)")
    per_q, head = list(by_q.values()), metrics[0]
    k = k or max(map(len, per_q))

    def qmean(fn) -> float:
        return sum(sum(fn(r) for r in rs) / len(rs) for rs in per_q) / len(per_q)

    def rate_pass_at_k(correct) -> float:
        return sum(pass_at_k(len(rs), sum(map(correct, rs)), min(k, len(rs))) for rs in per_q) / len(per_q)

    m = {"n": len(per_q), "samples": len(records), "k": k, "metric": head,
         **{key: qmean(lambda r, key=key: float(r.get(key, 0.0))) for key in metrics}}
    m.update(score=m[head], successes=m[head] * len(per_q), score_ci=list(wilson_interval(min(m[head] * len(per_q),
             len(per_q)), len(per_q))), pass_at_k=rate_pass_at_k(lambda r: float(r.get(head, 0.0)) == 1.0),
             answered=qmean(lambda r: float(r["answered"])), reward=qmean(lambda r: float(r.get("reward", 0.0))),
             steps=None if any(r.get("steps") is None for r in records) else qmean(lambda r: float(r["steps"])),
             incomplete_questions=sum(len(rs) < k for rs in per_q),
             status=dict(sorted(Counter(r["status"] for r in records).items())))  # fmt: skip
    m["not_attempted"] = 1.0 - m["answered"]  # no answer submitted (the judge's own rate is under "judge")
    if judged:
        if missing := [r["id"] for r in records if r.get("grade") not in GRADES]:
            raise ValueError(f"summarize(judged=True): {len(missing)} records have no grade, e.g. {missing[0]!r}")
        c, w, na, unparsed = (qmean(lambda r, g=g: float(r["grade"] == g)) for g in GRADES)
        aga = c / (c + w) if c + w > 0 else 0.0  # accuracy given attempted; F: its harmonic mean with accuracy
        m["judge"] = {"accuracy": c, "incorrect": w, "not_attempted": na, "accuracy_given_attempted": aga,
                      "f_score": 2 * aga * c / (aga + c) if aga + c > 0 else 0.0,
                      "pass_at_k": rate_pass_at_k(lambda r: r["grade"] == CORRECT), "unparsed": unparsed,
                      "unparsed_samples": sum(r["grade"] == UNPARSED for r in records)}
    sources = sorted({str(r.get("source", "")).strip().lower() for r in records})
    if len(sources) > 1:
        m["sources"] = {s: summarize([r for r in records if str(r.get("source", "")).strip().lower() == s], metrics, k,
                                     judged) for s in sources}  # fmt: skip
        m["source_avg"] = {key: sum(sm[key] for sm in m["sources"].values()) / len(sources) for key in metrics}
    return m


def summarize_episodes(episodes: list[Episode], envs: dict) -> dict[str, dict]:
    """Held-out episodes summarised per environment and, with several, "all" (headline "solved"). Each episode is
    a trial of its own (several samples of one task too); masked episodes count as failures."""
    recs = [record(ep) | {"solved": float(solved(ep, envs[ep.task.env])), "id": f"{ep.task.env}/{ep.task.id}#{i}"}
            for i, ep in enumerate(episodes)]
    names = sorted({ep.task.env for ep in episodes})
    by_env = {"all": summarize(recs, envs[names[0]].metrics)} if len(names) == 1 else \
        {name: summarize([r for r, ep in zip(recs, episodes) if ep.task.env == name], envs[name].metrics)
         for name in names} | {"all": summarize(recs, ["solved"])}  # fmt: skip
    return {name: m | {"unit": "episodes"} for name, m in by_env.items()}


def _pct(v: float) -> str:
    return f"{100 * v:.1f}"


def format_summary(m: dict) -> str:
    """One line of a summary's headline numbers, rates in percent.

    >>> print(format_summary(summarize([{"id": "a", "sample": 0, "em": 1.0, "f1": 0.5, "answered": True,
    ...     "status": "answered", "steps": 3, "reward": 0.9}], ["em", "f1"])))
    EM 100.0 (95% CI 20.7-100.0) | F1 50.0 | answered 100.0 | reward 0.900 | 1 questions x 1 samples
    """
    parts = [f"{label(m['metric'])} {_pct(m['score'])} (95% CI {_pct(m['score_ci'][0])}-{_pct(m['score_ci'][1])})"]
    parts += [f"{label(key)} {_pct(m[key])}" for key in _metrics(m)[1:]]
    parts += [f"answered {_pct(m['answered'])}", f"reward {m['reward']:.3f}"]
    if m["k"] > 1:
        parts.append(f"pass@{m['k']} {_pct(m['pass_at_k'])}")
    if m.get("judge"):
        parts.append(f"judge accuracy {_pct(m['judge']['accuracy'])}")
        if m["judge"].get("unparsed_samples"):
            parts.append(f"{m['judge']['unparsed_samples']} judge replies unparsed")
    if masked := m.get("status", {}).get(ENV_ERROR):
        parts.append(f"{masked} masked as environment errors (scored 0)")
    return " | ".join(parts + [f"{m['n']} episodes" if m.get("unit") == "episodes" else f"{m['n']} questions x {m['k']} samples"])


_KEYS = {"n", "samples", "k", "metric", "score", "successes", "score_ci", "pass_at_k", "answered", "reward", "steps",
         "incomplete_questions", "status", "not_attempted", "judge", "sources", "source_avg", "unit"}


def _metrics(m: dict) -> list[str]:
    """A summary's metrics, in the environment's order (the headline first)."""
    return [m["metric"]] + [k for k in m if k not in _KEYS and k != m["metric"]]


# -------------------------------------------------------------------------------------- tables
def markdown_table(rows: list[dict]) -> str:
    """One row per evaluation run (a summary.json's object).

    >>> m = summarize([{"id": "a", "sample": 0, "em": 1.0, "answered": True, "status": "answered", "steps": 2},
    ...                {"id": "b", "sample": 0, "em": 0.0, "answered": True, "status": "answered", "steps": 3}], ["em"])
    >>> print(markdown_table([{"model": "m", "mode": "agent", "bench": "hotpotqa", "metrics": m, "wall_s": 3.21}]))
    | model | mode | bench | n | EM | 95% CI | pass@1 | answered | steps | wall |
    | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |
    | m | agent | hotpotqa | 2 | 50.0 | 9.5-90.5 | 50.0 | 100.0 | 2.50 | 3.2 s |
    """
    names = list(dict.fromkeys(k for r in rows for k in _metrics(r["metrics"])))
    judged = any(r["metrics"].get("judge") for r in rows)
    ks = sorted({r["metrics"].get("k", 1) for r in rows})
    cols = [("model", "model", None), ("mode", "mode", None), ("bench", "bench", None), ("n", "n", str),
            *[(label(k), k, _pct) for k in names[:1]], ("95% CI", "score_ci", lambda v: f"{_pct(v[0])}-{_pct(v[1])}"),
            *[(label(k), k, _pct) for k in names[1:]],
            *[(h, "judge." + key, _pct) for h, key in (("judge acc", "accuracy"), ("acc|attempted", "accuracy_given_attempted"),
              ("judge F", "f_score"), ("not attempted", "not_attempted"), ("unparsed", "unparsed")) if judged],
            (f"pass@{ks[0]}" if len(ks) == 1 else "pass@k", "pass_at_k", _pct), ("answered", "answered", _pct),
            ("steps", "steps", lambda v: f"{v:.2f}"), ("wall", "wall_s", lambda v: f"{v:.0f} s" if v >= 10 else f"{v:.1f} s")]  # fmt: skip
    lines = [_line(h for h, _, _ in cols), _line("---" if fmt is None else "---:" for *_, fmt in cols)]
    return "\n".join(lines + [_line(_cell(r, key, fmt) for _, key, fmt in cols) for r in rows])


def _cell(row: dict, key: str, fmt) -> str:
    """The formatted value at `key` ("judge.accuracy": a nested key) of the row or its metrics; "-" if none."""
    value = row if key in row else row["metrics"]
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return "-" if value is None else (fmt or str)(value)


def _line(cells) -> str:
    return "| " + " | ".join(cells) + " |"
