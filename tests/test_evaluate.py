"""evaluate.py and l0_min.evaluation: summary math, the results file, resuming after a kill, and whole
runs against a scripted SGLang-compatible policy server that answers from the gold answers (or never).

The scripted server decodes each request with the tiny-random byte tokenizer (id = byte + 3, eos 1),
recognises which prompt it is (agent step, direct question, judge grading) and answers deterministically,
so whole evaluation runs have exact expected numbers.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import os
import re
import signal
import string
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
from aiohttp import web

import evaluate
from l0_min import config as config_mod
from l0_min import evaluation
from l0_min.answers import exact_match, f1_score
from l0_min.data import DataError
from l0_min.envs.qa import QA, judge_prompt, official_em, official_f1, paper_table
from l0_min.episode import Episode, Task
from l0_min.evaluation import (EvalError, ResultsFile, check_run_info, format_summary, judge_record, markdown_table,
                               parse_grade, pass_at_k, read_results, record, summarize, two_proportion_z_test,
                               wilson_interval)

QA_ENV = QA(config_mod.Config())
METRICS = QA.eval_metrics  # official EM and F1, then the training reward's Unicode-aware ones


def make_record(task: Task, sample: int, prediction, status: str, steps=0, seconds: float = 0.0) -> dict:
    """A record as evaluate.py makes one: the episode scored by the QA environment."""
    ep = Episode(task, status=status, final_answer=prediction, sample=sample, seconds=seconds)
    ep.rewards = QA_ENV.score(ep)
    return record(ep) | {"steps": steps}


ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared" / "data" / "benchmarks"
EOS = 1


def enc(text: str) -> list[int]:
    return [b + 3 for b in text.encode()]


def dec(ids) -> str:
    return bytes(i - 3 for i in ids if 3 <= i < 259).decode(errors="replace")


# ---------------------------------------------------------------------------------------------
# the scripted policy / judge server


class ScriptedServer:
    """SGLang's /generate and /health in a background thread.

    policy(question) -> "gold" | "wrong" | "silent" decides what the agent / direct answer is:
      agent step: `<think>..</think><code>print(web_search(q)); submit_final_answer(gold)</code>`
                  ("wrong" submits "nobody", "silent" only prints and never submits);
      direct:     the gold answer, "nobody", or nothing (EOS at once);
      judge:      "A" if the predicted answer matches the gold by EM, else "B".
    """

    def __init__(self):
        self.answers: dict[str, list[str]] = {}
        self.policy = lambda q: "gold"
        self.delay = 0.0
        self.calls: Counter = Counter()  # question -> agent / direct requests
        self.judge_calls = 0
        self.chat_auth: list[str] = []  # Authorization headers seen by /v1/chat/completions
        self.chat_status = 200  # /v1/chat/completions answers with this status (503: a judge outage)
        self.ramble: set[str] = set()  # questions whose grading reply names no grade
        self.loop = asyncio.new_event_loop()
        started = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(started,), daemon=True)
        self.thread.start()
        started.wait(10)

    def _run(self, started):
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_post("/generate", self._generate)
        app.router.add_post("/v1/chat/completions", self._chat)
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        started.set()
        self.loop.run_forever()

    def stop(self):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    def use(self, tasks, policy=lambda q: "gold", delay=0.0):
        self.answers = {t.question: t.answers for t in tasks}
        self.policy, self.delay = policy, delay
        self.calls.clear()
        self.judge_calls, self.chat_status, self.ramble = 0, 200, set()

    def reply(self, prompt: str) -> tuple[str, bool]:
        """(text, ends with EOS)."""
        if "Gold answer: " in prompt:
            self.judge_calls += 1
            if any(f"Question: {q}\n" in prompt for q in self.ramble):
                return "It depends on how one reads the question.", True
            gold = re.search(r"Gold answer: (.*)\n", prompt).group(1).split(" | ")
            predicted = re.search(r"Predicted answer: (.*)\n", prompt).group(1)
            return ("A" if exact_match(predicted, gold) else "B"), True
        m = re.search(r"Task: (.*)\nYou have \d+ steps", prompt)
        if m:  # an agent step
            q = m.group(1)
            self.calls[q] += 1
            what = self.policy(q)
            search = f"print(web_search({json.dumps(q)}, k=2))\n"
            if what == "silent":
                return f"<think>I will keep looking and not answer.</think>\n<code>{search}</code>", False
            answer = self.answers[q][0] if what == "gold" else "nobody"
            return f"<think>I know the answer to this one.</think>\n<code>{search}submit_final_answer({json.dumps(answer)})</code>", False
        m = re.search(re.escape(evaluate.DIRECT_SYSTEM) + r".*?<\|im_start\|>user\n(.*?)<\|im_end\|>", prompt, re.S)
        if m:  # a direct question
            q = m.group(1)
            self.calls[q] += 1
            what = self.policy(q)
            return {"gold": self.answers[q][0], "wrong": "nobody", "silent": "", "punct": "|"}[what], True
        raise AssertionError(f"scripted server: unknown prompt {prompt[-300:]!r}")

    async def _health(self, request):
        return web.Response(text="ok")

    async def _chat(self, request):  # an OpenAI-compatible judge endpoint
        body = await request.json()
        self.chat_auth.append(request.headers.get("Authorization", ""))
        if self.chat_status != 200:
            return web.Response(status=self.chat_status, text="the judge is down")
        assert body["model"] == "judge-x" and body["temperature"] == 0 and body["messages"][0]["role"] == "system"
        text, _ = self.reply(body["messages"][1]["content"])
        return web.json_response({"choices": [{"message": {"role": "assistant", "content": text}}]})

    async def _generate(self, request):
        body = await request.json()
        text, eos = self.reply(dec(body["input_ids"]))
        if self.delay:
            await asyncio.sleep(self.delay)
        ids = enc(text) + ([EOS] if eos else [])
        ids = ids[: body["sampling_params"]["max_new_tokens"]]
        finish = {"type": "stop", "matched": EOS if eos else "</code>"}
        return web.json_response({"text": text, "output_ids": ids, "meta_info": {
            "finish_reason": finish, "weight_version": "scripted", "prompt_tokens": len(body["input_ids"]),
            "output_token_logprobs": [[-0.1, i, None] for i in ids]}})


@pytest.fixture(scope="module")
def server():
    s = ScriptedServer()
    yield s
    s.stop()


# ---------------------------------------------------------------------------------------------
# a small HotpotQA-layout file with its paragraphs (closed corpus), and a Bamboogle-layout CSV

HOTPOT = [
    ("h1", "Were Scott Derrickson and Ed Wood of the same nationality?", "yes",
     [["Ed Wood", ["Edward Davis Wood Jr. was an American filmmaker."]],
      ["Scott Derrickson", ["Scott Derrickson is an American director."]]]),
    ("h2", "Which band recorded Abbey Road?", "The Beatles",
     [["Abbey Road", ["Abbey Road is the eleventh studio album by the English rock band the Beatles."]]]),
    ("h3", "Which country uses the abbreviation U.S.?", "U.S.",
     [["United States", ["The United States (U.S.) is a country in North America."]]]),
    ("h4", "How many metres is a kilometre?", "1,000",
     [["Kilometre", ["A kilometre is a unit of length equal to 1,000 metres."]]]),
    ("h5", "Who wrote Hamlet?", "William Shakespeare",
     [["Hamlet", ["Hamlet is a tragedy written by William Shakespeare."]]]),
    ("h6", "What is the capital of France?", "Paris",
     [["Paris", ["Paris is the capital and largest city of France."]]]),
]


def hotpot_file(tmp_path: Path) -> Path:
    rows = [{"_id": i, "question": q, "answer": a, "type": "bridge", "level": "easy", "supporting_facts": [],
             "context": ctx} for i, q, a, ctx in HOTPOT]
    path = tmp_path / "hotpot_mini.json"
    path.write_text(json.dumps(rows))
    return path


def tasks_of(path) -> list[Task]:
    from l0_min.envs.qa import load_tasks

    return list(load_tasks(str(path)))


def cli(*args, out, model="tiny-random", url=None, extra=()):
    """evaluate.main in-process (the tokenizer and tiny model load in this process once)."""
    argv = [*args, "--model", model, "--out", str(out), "kernel.pool_size=2", *extra]
    if url:
        argv += ["--inference-url", url]
    return evaluate.main(argv)


# ---------------------------------------------------------------------------------------------
# pure summary math


def test_pass_at_k_is_the_unbiased_estimator():
    # brute force: the share of k-subsets of n samples (c correct) that hold a correct one
    for n in range(1, 7):
        for c in range(n + 1):
            for k in range(1, n + 1):
                subsets = list(itertools.combinations([1] * c + [0] * (n - c), k))
                assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets), abs=1e-12)
    assert pass_at_k(3, 1, 3) == 1.0 and pass_at_k(3, 0, 3) == 0.0  # k = n: any correct
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(2, 1, 3)


def rec(qid, sample, em, f1=None, answered=True, grade=None, steps=2, status="answered", source="x"):
    f1 = em if f1 is None else f1
    return {"id": qid, "sample": sample, "official_em": em, "official_f1": f1, "em": em, "f1": f1, "answered": answered,
            "grade": grade, "steps": steps, "status": status, "source": source, "reward": em}


def test_summarize_averages_samples_then_questions():
    records = [
        rec("a", 0, 1.0, grade="correct"), rec("a", 1, 0.0, f1=0.5, grade="incorrect"),
        rec("a", 2, 0.0, f1=0.0, answered=False, grade="not_attempted", steps=4, status="max_steps"),
        rec("b", 0, 0.0, f1=0.25, grade="incorrect"), rec("b", 1, 0.0, f1=0.25, grade="incorrect"),
        rec("b", 2, 0.0, f1=0.25, grade="correct"),  # the judge may accept what EM does not
    ]
    m = summarize(records, METRICS, k=3, judged=True)
    assert (m["n"], m["samples"], m["k"], m["incomplete_questions"], m["metric"]) == (2, 6, 3, 0, "official_em")
    assert m["official_em"] == m["score"] == pytest.approx((1 / 3 + 0) / 2, abs=1e-15)
    assert m["official_f1"] == pytest.approx((1.5 / 3 + 0.75 / 3) / 2, abs=1e-15)  # 0.375
    assert m["pass_at_k"] == 0.5  # a has a correct sample, b none (by EM)
    assert m["answered"] == pytest.approx((2 / 3 + 1) / 2, abs=1e-15) and m["not_attempted"] == pytest.approx(1 / 6, abs=1e-15)
    assert m["steps"] == pytest.approx((8 / 3 + 2) / 2, abs=1e-15)
    assert m["status"] == {"answered": 5, "max_steps": 1}
    j = m["judge"]
    assert (j["accuracy"], j["incorrect"], j["not_attempted"]) == pytest.approx((1 / 3, 1 / 2, 1 / 6), abs=1e-15)
    assert j["accuracy_given_attempted"] == pytest.approx((1 / 3) / (1 / 3 + 1 / 2), abs=1e-15)  # 0.4
    assert j["f_score"] == pytest.approx(2 * 0.4 * (1 / 3) / (0.4 + 1 / 3), abs=1e-12)
    assert j["pass_at_k"] == 1.0  # both questions have a sample the judge calls correct


def test_summarize_judge_rates_are_simple_evals_aggregates():
    # one sample per question: the rates are simple-evals' (3 correct, 1 incorrect, 4 not attempted of 8)
    grades = ["correct"] * 3 + ["incorrect"] + ["not_attempted"] * 4
    j = summarize([rec(str(i), 0, 0.0, grade=g) for i, g in enumerate(grades)], METRICS, k=1, judged=True)["judge"]
    assert (j["accuracy"], j["incorrect"], j["not_attempted"]) == (0.375, 0.125, 0.5)
    assert j["accuracy_given_attempted"] == 0.75 and j["f_score"] == pytest.approx(0.5, abs=1e-15)  # 2*.375*.75/1.125
    j = summarize([rec("a", 0, 0.0, grade="not_attempted")], METRICS, judged=True)["judge"]
    assert (j["accuracy"], j["accuracy_given_attempted"], j["f_score"]) == (0.0, 0.0, 0.0)
    j = summarize([rec("a", 0, 1.0, grade="correct")], METRICS, judged=True)["judge"]
    assert (j["accuracy"], j["accuracy_given_attempted"], j["f_score"]) == (1.0, 1.0, 1.0)


def test_summarize_per_source_and_their_mean(tmp_path):  # issue 13, item 4
    records = [rec("n1", 0, 1.0, source="nq"), rec("n2", 0, 0.0, source="nq"), rec("n3", 0, 1.0, source="nq"),
               rec("b1", 0, 0.0, f1=0.5, source="bamboogle")]
    m = summarize(records, METRICS)
    assert m["official_em"] == 0.5 and set(m["sources"]) == {"nq", "bamboogle"}
    assert (m["sources"]["nq"]["n"], m["sources"]["nq"]["official_em"]) == (3, pytest.approx(2 / 3, abs=1e-15))
    assert (m["sources"]["bamboogle"]["official_em"], m["sources"]["bamboogle"]["official_f1"]) == (0.0, 0.5)
    avg = {"official_em": 1 / 3, "official_f1": (2 / 3 + 0.5) / 2}
    assert m["source_avg"] == pytest.approx(avg | {"em": 1 / 3, "f1": (2 / 3 + 0.5) / 2}, abs=1e-15)
    assert "sources" not in summarize(records[:3], METRICS)
    table = paper_table([{"model": "m", "mode": "agent", "bench": "mixed", "metrics": m}]).splitlines()
    assert table[:4] == ["EM", "| model | mode | NQ | Bamboogle | Avg. |", "| --- | --- | ---: | ---: | ---: |",
                         "| m | agent | 66.7 | 0.0 | 33.3 |"]
    assert table[5:9] == ["F1", "| model | mode | NQ | Bamboogle | Avg. |", "| --- | --- | ---: | ---: | ---: |",
                          "| m | agent | 66.7 | 50.0 | 58.3 |"]
    # a data_source may name a benchmark otherwise (Search-R1 files: tq, 2wiki): the loader gives the canonical name
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps({"id": i, "question": "q", "golden_answers": ["a"], "data_source": src}) + "\n"
                            for i, src in (("t1", "tq"), ("t2", "triviaqa"), ("w", "2wiki"))))
    m = summarize([make_record(t, 0, "a", "answered") for t in tasks_of(path)], METRICS)
    assert {s: sm["n"] for s, sm in m["sources"].items()} == {"triviaqa": 2, "2wikimultihopqa": 1}


def test_wilson_interval_and_two_proportion_z_test():
    # Wilson: the known 95% interval of 8/10 (Newcombe 1998, method 3), never outside [0, 1]
    assert wilson_interval(8, 10) == pytest.approx((0.4902, 0.9433), abs=1e-4)
    assert wilson_interval(0, 10) == (0.0, pytest.approx(0.2775, abs=1e-4)) and wilson_interval(10, 10)[1] == pytest.approx(1.0)
    lo, hi = wilson_interval(41, 100)
    assert lo < 0.41 < hi and hi - lo == pytest.approx(0.1893, abs=1e-3)
    with pytest.raises(ValueError, match="n >= 1"):
        wilson_interval(1, 0)
    diff, z, p = two_proportion_z_test(60, 100, 45, 100)
    assert (diff, z, p) == (pytest.approx(0.15), pytest.approx(2.1240, abs=1e-4), pytest.approx(0.0337, abs=1e-4))
    assert two_proportion_z_test(45, 100, 60, 100)[1] == pytest.approx(-z) and two_proportion_z_test(45, 100, 60, 100)[2] == p
    assert two_proportion_z_test(50, 100, 50, 100)[2] == 1.0 and two_proportion_z_test(0, 5, 0, 7) == (0.0, 0.0, 1.0)
    m = summarize([rec(str(i), 0, float(i < 8)) for i in range(10)], METRICS)
    assert m["score_ci"] == pytest.approx(wilson_interval(8, 10), abs=1e-12)
    assert format_summary(m) == ("official EM 80.0 (95% CI 49.0-94.3) | official F1 80.0 | EM 80.0 | F1 80.0 | "
                                 "answered 100.0 | reward 0.800 | 10 questions x 1 samples")


def test_summarize_edge_cases():
    m = summarize([rec("a", 0, 1.0), rec("b", 0, 0.0)], METRICS, k=2)  # fewer samples than k so far
    assert m["incomplete_questions"] == 2 and m["pass_at_k"] == 0.5 and "judge" not in m
    assert summarize([rec("a", 0, 1.0, steps=None)], METRICS, k=1)["steps"] is None  # direct mode
    with pytest.raises(ValueError, match="no grade"):
        summarize([rec("a", 0, 1.0)], METRICS, k=1, judged=True)
    with pytest.raises(ValueError, match="no records"):
        summarize([], METRICS, k=1)
    with pytest.raises(ValueError, match="no metrics"):
        summarize([rec("a", 0, 1.0)], ())


def test_make_record_scores_against_every_alias():
    t = Task("q", "Who?", ["Barack Obama", "Obama"], {"benchmark": "nq"})
    r = make_record(t, 2, "president Obama", "answered", steps=3, seconds=1.23456)
    assert (r["id"], r["sample"], r["official_em"], r["answered"], r["steps"], r["seconds"]) == ("q", 2, 0.0, True, 3, 1.235)
    assert r["official_f1"] == pytest.approx(2 / 3, abs=1e-15) and r["source"] == "nq"  # best alias "Obama": P 1/2, R 1
    r = make_record(t, 0, None, "max_steps")
    assert (r["official_em"], r["official_f1"], r["answered"], r["prediction"]) == (0.0, 0.0, False, None)
    r = make_record(t, 0, "|", "answered")  # punctuation only: not answered (issue 13, item 6)
    assert (r["official_em"], r["official_f1"], r["em"], r["answered"]) == (0.0, 0.0, 0.0, False)


def test_answer_split_aliases_each_score(tmp_path):  # issue 13, item 3
    path = tmp_path / "bamboogle.jsonl"
    path.write_text(json.dumps({"id": "b1", "question": "Capital?", "golden_answers": ["Tokyo<|answer_split|>Tokio"]}) + "\n")
    task = tasks_of(path)[0]
    assert [make_record(task, 0, a, "answered")["official_em"] for a in ("Tokyo", "tokio.", "Tokyo<|answer_split|>Tokio")] == [1.0, 1.0, 0.0]


def summary_row(bench, em, judge=None, model="m", mode="agent", k=1):
    m = {"n": 10, "k": k, "metric": "official_em", "official_em": em, "score": em, "score_ci": wilson_interval(10 * em, 10),
         "official_f1": em + 0.1, "em": em + 0.05, "pass_at_k": em, "answered": 0.9, "steps": 3.0}
    if judge is not None:
        m["judge"] = {"accuracy": judge, "accuracy_given_attempted": 0.5, "f_score": 0.4, "not_attempted": 0.2,
                      "unparsed": 0.1}
    return {"model": model, "mode": mode, "bench": bench, "metrics": m, "wall_s": 61.0}


def test_markdown_table_columns_and_judge_columns():
    plain = markdown_table([summary_row("hotpotqa", 0.25)]).splitlines()
    assert plain[0] == "| model | mode | bench | n | official EM | 95% CI | official F1 | EM | pass@1 | answered | steps | wall |"
    assert plain[2] == "| m | agent | hotpotqa | 10 | 25.0 | 8.1-55.8 | 35.0 | 30.0 | 25.0 | 90.0 | 3.00 | 61 s |"
    judged = markdown_table([summary_row("simpleqa", 0.0, judge=0.125), summary_row("hotpotqa", 0.25, k=4)]).splitlines()
    assert judged[0] == ("| model | mode | bench | n | official EM | 95% CI | official F1 | EM | judge acc | acc|attempted | judge F "
                         "| not attempted | unparsed | pass@k | answered | steps | wall |")  # several k: the header stays generic
    assert judged[2].split(" | ")[8:13] == ["12.5", "50.0", "40.0", "20.0", "10.0"]
    assert judged[3].split(" | ")[8:13] == ["-", "-", "-", "-", "-"]  # not judged


def test_paper_table_follows_the_papers_column_order():
    """Issue 23: Search-R1's order (NQ, TriviaQA, PopQA, HotpotQA, 2Wiki, MuSiQue, Bamboogle, Avg.) after L0's
    judged SimpleQA; EM cells, F1 in a table of its own; SimpleQA's cells are the judge's accuracy and its
    F-score, and Avg. averages EM (F1) only, never judge scores."""
    rows = [summary_row("nq", 0.3), summary_row("bamboogle", 0.2), summary_row("simpleqa", 0.05, judge=0.1),
            summary_row("hotpotqa", 0.4), summary_row("musique", 0.1), summary_row("hotpotqa", 0.5, mode="direct"),
            summary_row("tq", 0.6), summary_row("2wiki", 0.7)]
    em, f1 = (t.splitlines() for t in paper_table(rows).split("\n\n"))
    assert em[:2] == ["EM", "| model | mode | SimpleQA acc | NQ | TriviaQA | HotpotQA | 2Wiki | MuSiQue | Bamboogle | Avg. |"]
    assert em[3] == "| m | agent | 10.0 | 30.0 | 60.0 | 40.0 | 70.0 | 10.0 | 20.0 | 38.3 |"  # Avg.: (30+60+40+70+10+20)/6
    assert em[4] == "| m | direct | - | - | - | 50.0 | - | - | - | 50.0 |"
    assert f1[:2] == ["F1", "| model | mode | SimpleQA F | NQ | TriviaQA | HotpotQA | 2Wiki | MuSiQue | Bamboogle | Avg. |"]
    assert f1[3] == "| m | agent | 40.0 | 40.0 | 70.0 | 50.0 | 80.0 | 20.0 | 30.0 | 48.3 |"  # SimpleQA's F-score: 40.0
    unjudged = paper_table([summary_row("simpleqa", 0.05), summary_row("nq", 0.3)]).splitlines()
    assert unjudged[1:4:2] == ["| model | mode | SimpleQA | NQ | Avg. |", "| m | agent | 5.0 | 30.0 | 17.5 |"]


# ---------------------------------------------------------------------------------------------
# the judge


@pytest.mark.parametrize("reply, grade", [
    ("A", "correct"),
    ("B", "incorrect"),
    ("C", "not_attempted"),
    (" **B** ", "incorrect"),
    ("(A)", "correct"),
    ("C.", "not_attempted"),
    ("Grade: B", "incorrect"),
    ("The grade is A", "correct"),
    ("Answer: (C)", "not_attempted"),
    ("A) CORRECT", "correct"),
    ("B. INCORRECT - the year differs", "incorrect"),
    ("The prediction names another person.\n**B**", "incorrect"),
    ("NOT_ATTEMPTED", "not_attempted"),
    ("This is NOT ATTEMPTED.", "not_attempted"),
    ("The predicted answer is INCORRECT.", "incorrect"),
    ("A correct answer would name the city. The prediction does.\nGrade: A", "correct"),
    ("<think>Maybe B? The gold says 1990... it is A</think>\nC", "not_attempted"),
    ("<think>hmm A or B</think>B", "incorrect"),
])
def test_parse_grade(reply, grade):
    assert parse_grade(reply) == grade


@pytest.mark.parametrize("reply", ["", "I am not sure.", "D", "<think>A</think>", "a correct answer"])
def test_parse_grade_fails_loudly(reply):
    with pytest.raises(evaluation.JudgeParseError, match="no grade"):
        parse_grade(reply)


def test_judge_prompt_contents():
    p = judge_prompt("Who wrote Hamlet?", ["William Shakespeare", "Shakespeare"], " Shakespeare ")
    assert "Question: Who wrote Hamlet?" in p
    assert "Gold answer: William Shakespeare | Shakespeare" in p
    assert "Predicted answer: Shakespeare\n" in p
    assert "A, B or C" in p
    assert "Predicted answer: (no answer)" in judge_prompt("q", "g", None)


async def test_judge_record_calls_retries_and_names_the_judge():
    prompts = []
    rec = make_record(Task("h", "Who wrote Hamlet?", ["William Shakespeare"]), 0, "Shakespeare", "answered")

    async def gen(prompt):
        prompts.append(prompt)
        return ["hmm", "**A**"][len(prompts) - 1]

    assert await judge_record(rec, gen, "judge-x", judge_prompt) == {"grade": "correct", "judge": "judge-x", "judge_error": ""}
    assert len(prompts) == 2 and "Who wrote Hamlet?" in prompts[0]

    async def never(prompt):
        raise AssertionError("an unanswered prediction needs no judge call")

    for blank in ("  ", None, "|"):
        assert (await judge_record(rec | {"prediction": blank}, never, "j", judge_prompt))["grade"] == "not_attempted"

    async def garbage(prompt):
        prompts.append(prompt)
        return "no idea"

    prompts.clear()
    fields = await judge_record(rec, garbage, "j", judge_prompt, retries=2)  # no grade after the retries: counted apart
    assert fields["grade"] == "unparsed" and "no grade (A/B/C) in judge reply: 'no idea'" in fields["judge_error"]
    assert len(prompts) == 3


# ---------------------------------------------------------------------------------------------
# the results file


def test_results_file_appends_resumes_and_drops_a_torn_line(tmp_path):
    path = tmp_path / "results.jsonl"
    t = Task("q1", "Q?", ["A"])
    with ResultsFile(path) as f:
        assert f.done == set() and f.by_key == {}
        f.append(make_record(t, 0, "A", "answered"))
        f.append(make_record(t, 1, None, "env_error"))  # not the model's doing: retried on resume
        assert f.done == {("q1", 0)}
        # the line is on disk at once (flushed), before the file is closed
        assert [r["sample"] for r in read_results(path)] == [0, 1]
    size = path.stat().st_size
    with open(path, "ab") as fh:  # a write cut short by a kill
        fh.write(b'{"id": "q1", "sample": 2, "pred')
    assert len(read_results(path)) == 2
    with ResultsFile(path) as f:
        assert f.done == {("q1", 0)} and len(f.by_key) == 2
        assert path.stat().st_size == size  # the torn tail is gone, so the next line starts clean
        f.append(make_record(t, 1, "A", "answered"))
    records = read_results(path)
    assert [(r["sample"], r["status"]) for r in records] == [(0, "answered"), (1, "env_error"), (1, "answered")]
    with ResultsFile(path) as f:  # the later record of a key replaces the earlier
        assert f.by_key[("q1", 1)]["status"] == "answered" and f.done == {("q1", 0), ("q1", 1)}


def test_results_file_errors_name_file_and_line(tmp_path):
    path = tmp_path / "results.jsonl"
    path.write_text('{"id": "a", "sample": 0}\nnot json\n{"id": "b", "sample": 0}\n')
    with pytest.raises(EvalError, match=r"results.jsonl:2: not JSON.*fix or delete that line"):
        read_results(path)
    path.write_text('{"id": "a", "sample": 0}\n{"id": 3, "sample": 0}\n{"id": "b", "sample": 0}\n')
    with pytest.raises(EvalError, match=r"results.jsonl: record 2 needs a string 'id'"):
        read_results(path)
    path.write_text('{"id": "a", "sample": 0}\n{"id": "b", "sa\n')  # a bad *last* line: a torn write
    assert [r["id"] for r in read_results(path)] == ["a"]


def test_results_file_is_locked_against_a_second_writer(tmp_path):
    with ResultsFile(tmp_path / "results.jsonl"):
        with pytest.raises(EvalError, match="in use by another evaluate.py"):
            ResultsFile(tmp_path / "results.jsonl")
    ResultsFile(tmp_path / "results.jsonl").close()  # released on close


def test_run_info_must_match_to_resume(tmp_path):
    info = {"bench": "hotpotqa", "mode": "agent", "model": "a"}
    check_run_info(tmp_path / "run.json", info)
    check_run_info(tmp_path / "run.json", dict(info))  # same: fine
    with pytest.raises(EvalError, match=r"model: 'a' before, 'b' now.*another --out"):
        check_run_info(tmp_path / "run.json", info | {"model": "b"})


# ---------------------------------------------------------------------------------------------
# EM / F1 against the official HotpotQA evaluation (hotpot_evaluate_v1.py), transcribed here


def _official_normalize(s):
    def remove_articles(text):
        return re.sub(r"\b(a|an|the)\b", " ", text)

    def remove_punc(text):
        return "".join(ch for ch in text if ch not in set(string.punctuation))

    return " ".join(remove_articles(remove_punc(s.lower())).split())


def _official_f1(prediction, ground_truth):
    p, g = _official_normalize(prediction), _official_normalize(ground_truth)
    if p in ["yes", "no", "noanswer"] and p != g:
        return 0.0
    if g in ["yes", "no", "noanswer"] and p != g:
        return 0.0
    pt, gt = p.split(), g.split()
    same = sum((Counter(pt) & Counter(gt)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pt), same / len(gt)
    return 2 * precision * recall / (precision + recall)


def _official_em(prediction, ground_truth):
    return float(_official_normalize(prediction) == _official_normalize(ground_truth))


OFFICIAL_CASES = [
    ("yes", "yes"), ("Yes.", "yes"), ("no", "yes"), ("yes", "no"), ("yes indeed", "yes"), ("yes", "yes it is"),
    ("no", "no way"), ("noanswer", "no answer"), ("maybe no", "no way"), ("No!", "no"),
    ("The Beatles", "Beatles"), ("the the beatles", "Beatles"), ("An Apple a day", "apple day"),
    ("theatre", "the atre"), ("A-ha", "aha"), ("the-end", "theend"), ("a.k.a.", "aka"),
    ("U.S.", "US"), ("U.S.A", "usa"), ("1,000", "1000"), ("$5.00", "500"), ("3-4 km", "34 km"),
    ("12", "12 km"), ("July 4, 1776", "4 July 1776"), ("Barack Obama", "Obama"), ("president Barack Obama", "Barack Obama"),
    ("cat cat cat", "cat"), ("cat", "cat cat dog"), ("w x y z", "y z q"), ("a b c d", "c d e"),
    ("  Chief   of Protocol ", "Chief of Protocol"), ("chief-of-protocol", "Chief of Protocol"),
    ("O'Neil", "oneil"), ("Rock 'n' Roll", "rock n roll"), ("(1990)", "1990"), ("1990s", "1990"),
    ("Paris, France", "Paris"), ("new york city", "New York"), ("#1", "1"), ("50%", "50"),
]


UNICODE_CASES = [("“Tokyo”", "Tokyo"), ("Tokyo", "‘Tokyo’"), ("«Tokyo»", "Tokyo"), ("Ｔｏｋｙｏ", "Tokyo"), ("1990–1995", "19901995"),
                 ("Cafe\u0301", "Café"), ("Straße", "STRASSE"), ("café", "cafe"), ("東京", "東京"), ("Ｔｈｅ Ｂｅａｔｌｅｓ", "beatles")]


@pytest.mark.parametrize("pred, gold", OFFICIAL_CASES + UNICODE_CASES)
def test_reported_em_f1_are_the_official_hotpotqa_evaluation(pred, gold):  # issue 13, item 5
    assert official_em(pred, [gold]) == _official_em(pred, gold)
    assert official_f1(pred, [gold]) == _official_f1(pred, gold)  # the same float, not only close
    # best over aliases = the max of the official per-gold scores (SQuAD's metric_max_over_ground_truths)
    golds = [gold, "zzz unrelated", "Beatles"]
    assert official_f1(pred, golds) == max(_official_f1(pred, g) for g in golds)
    assert official_em(pred, golds) == max(_official_em(pred, g) for g in golds)
    # the lenient (training reward) scores agree with the official ones on plain ASCII
    if (pred + gold).isascii():
        assert (exact_match(pred, [gold]), f1_score(pred, [gold])) == (official_em(pred, [gold]), pytest.approx(official_f1(pred, [gold]), abs=1e-15))


def test_official_and_lenient_differ_where_documented():
    # Unicode: officially curly quotes, full-width letters and decomposed accents stay; the lenient score folds them
    for pred, gold in [("“Tokyo”", "Tokyo"), ("Ｔｏｋｙｏ", "Tokyo"), ("Cafe\u0301", "Café"), ("1990–1995", "19901995")]:
        r = make_record(Task("u", "?", [gold]), 0, pred, "answered")
        assert (r["official_em"], r["em"]) == (0.0, 1.0), pred
    # both: an unanswered prediction (blank, only punctuation) scores 0, where the script matches "" == ""
    assert _official_em("", "") == 1.0 and official_em("", [""]) == 0.0 and exact_match("", [""]) == 0.0
    assert _official_em("!!", "A+") == 1.0 and official_em("!!", ["A+"]) == 0.0 and official_f1(None, ["x"]) == 0.0
    # the lenient score matches a gold of only punctuation / articles ("A+" in NQ) as written
    assert exact_match("a+", ["A+"]) == 1.0 and exact_match("!!", ["A+"]) == 0.0 and official_em("a+", ["A+"]) == 1.0
    assert exact_match("cafe", ["Café"]) == 0.0 and official_em("cafe", ["Café"]) == 0.0


# ---------------------------------------------------------------------------------------------
# whole runs against the scripted server


def results_of(out: Path) -> list[dict]:
    """The latest record of each (question, sample): a judged one follows its generation (issue 23)."""
    return list({(r["id"], r["sample"]): r for r in read_results(out / "results.jsonl")}.values())


@pytest.mark.slow
def test_agent_answering_from_gold_scores_em_1_on_a_closed_corpus(server, tmp_path):
    data = hotpot_file(tmp_path)
    server.use(tasks_of(data))
    out = tmp_path / "gold"
    s = cli("--bench", "hotpotqa", "--data", str(data), "--limit", "4", "--judge-url", "self", out=out, url=server.url)
    m = s["metrics"]
    assert (m["n"], m["official_em"], m["official_f1"], m["pass_at_k"], m["answered"], m["steps"]) == (4, 1.0, 1.0, 1.0, 1.0, 1.0)
    assert m["judge"]["accuracy"] == 1.0 and m["judge"]["not_attempted"] == 0.0 and server.judge_calls == 4
    # the index holds all 6 questions' paragraphs (7 of them), not only the 4 evaluated
    assert s["search"] == "closed corpus: bm25 over the 7 paragraphs of the file's 6 questions"
    recs = results_of(out)
    assert sorted(r["id"] for r in recs) == ["h1", "h2", "h3", "h4"]
    assert {r["prediction"] for r in recs} == {"yes", "The Beatles", "U.S.", "1,000"}
    assert all(r["status"] == "answered" and r["grade"] == "correct" for r in recs)
    # the agent really searched the closed corpus from its sandbox
    eps = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    beatles = next(e for e in eps if e["task"]["id"] == "h2")
    assert "Abbey Road (ref: p-" in beatles["steps"][0]["observation"]
    assert (out / "viewer.html").is_file() and (out / "config.yaml").is_file()
    table = (out / "summary.md").read_text()
    assert ("| tiny-random | agent | hotpotqa | 4 | 100.0 | 51.0-100.0 | 100.0 | 100.0 | 100.0 | 100.0 | 100.0 | 100.0 | 0.0 "
            "| 0.0 | 100.0 | 100.0 | 1.00 |") in table
    assert table.endswith("\n- samples by status: answered 4\n- search: closed corpus: bm25 over the 7 paragraphs of the "
                          "file's 6 questions\n")  # issue 23: what the agent searched
    assert "scores: env qa's score(): official_em, official_f1, em, f1" in table  # item 5: the summary says so


@pytest.mark.slow
def test_agent_that_never_answers_scores_0_and_is_not_attempted(server, tmp_path):
    data = tmp_path / "bamboogle.csv"
    data.write_text("Question,Answer\nWho wrote Hamlet?,William Shakespeare\nWhat is the capital of France?,Paris\n")
    server.use(tasks_of(data), policy=lambda q: "silent")
    out = tmp_path / "silent"
    s = cli("--bench", "bamboogle", "--data", str(data), "--judge-url", "self", "--n-samples", "2", out=out,
            url=server.url, extra=["agent.max_steps=2"])
    m = s["metrics"]
    assert (m["official_em"], m["official_f1"], m["pass_at_k"], m["answered"], m["not_attempted"]) == (0.0, 0.0, 0.0, 0.0, 1.0)
    assert m["judge"] == {"accuracy": 0.0, "incorrect": 0.0, "not_attempted": 1.0, "accuracy_given_attempted": 0.0,
                          "f_score": 0.0, "pass_at_k": 0.0, "unparsed": 0.0, "unparsed_samples": 0}
    assert m["status"] == {"max_steps": 4} and m["steps"] == 2.0 and server.judge_calls == 0
    # two samples of each question, through collect.run_tasks (one call per sample index)
    assert sorted((r["id"], r["sample"]) for r in results_of(out)) == [("bamboogle:1", 0), ("bamboogle:1", 1), ("bamboogle:2", 0), ("bamboogle:2", 1)]
    assert sorted(server.calls.values()) == [4, 4]  # 2 samples x 2 steps each
    # Bamboogle carries no paragraphs: no search backend, and the summary says so
    assert s["search"] == "none" and any("answers from its own knowledge" in n for n in s["notes"])
    # issue 23: the report says how the samples ended, why that scores 0, and what was searched
    assert "- samples by status: max_steps 4; max_steps: the 2 steps (agent.max_steps) ran out (these score 0)" \
        in (out / "summary.md").read_text()
    assert "search: none" in s["notes"]
    eps = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    assert "no search backend is configured" in eps[0]["steps"][0]["observation"]


def test_direct_mode_and_resume_with_more_questions_and_samples(server, tmp_path):
    data = hotpot_file(tmp_path)
    tasks = tasks_of(data)
    verdict = {t.question: ["gold", "wrong", "silent"][i % 3] for i, t in enumerate(tasks)}
    server.use(tasks, policy=verdict.get, delay=0.3)
    out = tmp_path / "direct"
    first = cli("--bench", "hotpotqa", "--data", str(data), "--mode", "direct", "--limit", "3", out=out, url=server.url)
    assert (first["metrics"]["official_em"], first["metrics"]["answered"], first["metrics"]["steps"]) == (pytest.approx(1 / 3), pytest.approx(2 / 3), None)
    assert sum(server.calls.values()) == 3 and first["wall_s"] >= 0.3
    # more questions and a second sample: only the missing (question, sample) pairs run
    server.calls.clear()
    t0 = time.monotonic()
    s = cli("--bench", "hotpotqa", "--data", str(data), "--mode", "direct", "--n-samples", "2", out=out, url=server.url)
    assert sum(server.calls.values()) == 6 * 2 - 3 and s["resumed_samples"] == 3
    # item 7: wall time adds up over the invocations (the first run's, then this one's up to its last sample)
    assert first["wall_s"] + 0.3 <= s["wall_s"] <= first["wall_s"] + time.monotonic() - t0
    m = s["metrics"]
    assert (m["n"], m["samples"], m["k"]) == (6, 12, 2)
    assert (m["official_em"], m["pass_at_k"], m["answered"]) == (pytest.approx(1 / 3), pytest.approx(1 / 3), pytest.approx(2 / 3))
    assert any("temperature 0" in n for n in s["notes"])
    # a different model into the same folder is refused before anything runs
    with pytest.raises(EvalError, match="different evaluation"):
        cli("--bench", "hotpotqa", "--data", str(data), "--mode", "direct", out=out, url=server.url, model="smollm2-135m")


def test_a_gsm8k_file_is_scored_by_the_math_grader(server, tmp_path):
    """Issue 37: evaluate.py scores each record with its environment's score(): a GSM8K file's tasks are the math
    environment's, graded by numeric equality, where QA's EM counted the expert's "3.0" for gold "3" wrong. A row
    without "#### <number>" is refused with its row number (it silently took the solution text as gold)."""
    golds, said = ["3", "18", "0.75", "1200", "7"], ["3.0", "$18.00", "3/4", "1,200", "6"]  # the last one is wrong
    path = tmp_path / "gsm8k.jsonl"
    path.write_text("".join(json.dumps({"question": f"Problem {i}: how many?", "answer": f"Work: 1+2=<<1+2=3>>3\n#### {g}"})
                            + "\n" for i, g in enumerate(golds)))
    from l0_min.envs.math import load_tasks as math_tasks

    tasks = math_tasks(str(path))
    assert [t.answers for t in tasks] == [[g] for g in golds]
    server.use(tasks)
    server.answers = {t.question: [a] for t, a in zip(tasks, said)}
    s = cli("--bench", "gsm8k", "--data", str(path), "--mode", "direct", out=tmp_path / "math", url=server.url)
    m = s["metrics"]
    assert (s["env"], m["metric"], m["n"], m["correct"], m["score"]) == ("math", "correct", 5, 0.8, 0.8)
    assert [r["correct"] for r in results_of(tmp_path / "math")] == [1.0, 1.0, 1.0, 1.0, 0.0]
    assert [official_em(a, [g]) for a, g in zip(said, golds)] == [0, 0, 0, 1, 0]  # QA's EM: 1 of the 4 right ones
    assert "| model | mode | bench | n | correct | 95% CI |" in (tmp_path / "math" / "summary.md").read_text()
    path.write_text(path.read_text() + json.dumps({"question": "No gold?", "answer": "The answer is 4."}) + "\n")
    with pytest.raises(DataError, match=r"gsm8k.jsonl: row 6: GSM8K layout: field 'answer' must end with '#### <number>'"):
        math_tasks(str(path))
    with pytest.raises(DataError, match=r"gsm8k.jsonl: a GSM8K file: the math environment reads it"):
        tasks_of(path)  # the QA environment's loader


@pytest.mark.slow
def test_killed_run_resumes_to_the_uninterrupted_summary(server, tmp_path):
    data = hotpot_file(tmp_path)
    tasks = tasks_of(data)
    verdict = {t.question: ["gold", "wrong", "silent"][i % 3] for i, t in enumerate(tasks)}
    server.use(tasks, policy=verdict.get, delay=0.3)
    tasks = tasks[:5]
    args = ["--bench", "hotpotqa", "--data", str(data), "--limit", "5", "--concurrency", "2", "agent.max_steps=2"]

    # 1. evaluate.py as its own process, killed (SIGKILL: no clean-up at all) after two finished questions
    out = tmp_path / "killed"
    cmd = [sys.executable, str(ROOT / "evaluate.py"), *args, "--model", "tiny-random", "--out", str(out),
           "--inference-url", server.url, "kernel.pool_size=2"]
    log = open(tmp_path / "killed.log", "wb")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            if (out / "results.jsonl").exists() and len((out / "results.jsonl").read_text().splitlines()) >= 2:
                break
            time.sleep(0.05)
        assert proc.poll() is None, f"evaluate.py ended before it could be killed:\n{(tmp_path / 'killed.log').read_text()[-3000:]}"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(30)
        log.close()
    before = {r["id"] for r in results_of(out)}
    assert 2 <= len(before) < len(tasks) and not (out / "summary.json").exists()

    # 2. the rerun runs only the questions that had not finished; the killed run's time counts (item 7)
    wall_killed = max(r["wall_s"] for r in results_of(out))
    server.calls.clear()
    t0 = time.monotonic()
    resumed = cli(*args, out=out, url=server.url)
    assert wall_killed < resumed["wall_s"] <= wall_killed + time.monotonic() - t0
    assert not any(server.calls[t.question] for t in tasks if t.id in before)
    assert all(server.calls[t.question] for t in tasks if t.id not in before)
    assert resumed["resumed_samples"] == len(before)
    assert sorted(r["id"] for r in results_of(out)) == sorted(t.id for t in tasks)  # each exactly once

    # 3. the same numbers as a run that was never interrupted
    server.delay = 0.0
    fresh = cli(*args, out=tmp_path / "fresh", url=server.url)
    assert resumed["metrics"] == fresh["metrics"]
    assert fresh["metrics"]["official_em"] == pytest.approx(2 / 5) and fresh["metrics"]["answered"] == pytest.approx(4 / 5)
    # 4. a finished folder reruns in a moment: nothing is generated, the summary is the same
    server.calls.clear()
    again = cli(*args, out=out, url=server.url)
    assert sum(server.calls.values()) == 0 and again["metrics"] == resumed["metrics"] and again["resumed_samples"] == 5
    assert again["wall_s"] == resumed["wall_s"]  # nothing ran: no time added
    strip = lambda rs: sorted(({k: v for k, v in r.items() if k not in ("seconds", "wall_s")} for r in rs), key=lambda r: r["id"])
    assert strip(results_of(out)) == strip(results_of(tmp_path / "fresh"))


# ---------------------------------------------------------------------------------------------
# the real benchmark files


@pytest.mark.skipif(not SHARED.is_dir(), reason=f"no shared benchmark data at {SHARED}")
def test_gold_answers_score_em_1_on_every_shared_benchmark(server, tmp_path):
    files = sorted(p for p in SHARED.glob("*/*") if p.is_file())
    assert len(files) >= 6
    for path in files:
        bench = path.parent.name
        from l0_min.config import DataConfig
        from l0_min.envs import math, qa

        tasks = list((math if bench == "gsm8k" else qa).load_tasks(bench, DataConfig(data_dir=str(path)), limit=5))
        server.use(tasks)
        s = cli("--bench", bench, "--data", str(path), "--mode", "direct", "--limit", "5", out=tmp_path / bench, url=server.url)
        assert (s["metrics"]["n"], s["metrics"]["score"]) == (5, 1.0), bench  # the env's headline: official EM, correct
        server.use(tasks, policy=lambda q: "silent")
        s = cli("--bench", bench, "--data", str(path), "--mode", "direct", "--limit", "5", out=tmp_path / f"{bench}-0",
                url=server.url)
        assert (s["metrics"]["score"], s["metrics"]["answered"]) == (0.0, 0.0), bench


def test_table_of_finished_runs(server, tmp_path, capsys):
    data = hotpot_file(tmp_path)
    server.use(tasks_of(data))
    cli("--bench", "hotpotqa", "--data", str(data), "--mode", "direct", "--limit", "2", out=tmp_path / "runs" / "a", url=server.url)
    capsys.readouterr()
    evaluate.main(["--table", str(tmp_path / "runs")])
    out = capsys.readouterr().out
    assert "EM\n| model | mode | HotpotQA |\n| --- | --- | ---: |\n| tiny-random | direct | 100.0 |\n\nF1\n" in out


@pytest.mark.slow
def test_cli_errors_are_clear(tmp_path):
    data = hotpot_file(tmp_path)
    with pytest.raises(EvalError, match=r"^http://127.0.0.1:9 not ready after \d+ s \(inference.ready_timeout\); last"):
        cli("--bench", "hotpotqa", "--data", str(data), "--mode", "direct", out=tmp_path / "down", url="http://127.0.0.1:9",
            extra=["inference.ready_timeout=1"])
    with pytest.raises(config_mod.ConfigError, match="judge"):  # reward.judge is gone (it only raised)
        cli("--bench", "hotpotqa", "--data", str(data), out=tmp_path / "nojudge", extra=["reward.judge=true"])
    with pytest.raises(SystemExit):
        evaluate.parse_args(["--mode", "agent"])  # no --bench
    r = subprocess.run([sys.executable, str(ROOT / "evaluate.py"), "--bench", "nosuch", "--out", str(tmp_path / "x")],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "unknown benchmark 'nosuch'" in r.stderr


# ---------------------------------------------------------------------------------------------
# issue 13: evaluate.py as users type it


@pytest.mark.slow
def test_offline_bench_without_data_exits_fast_with_one_actionable_line(tmp_path):  # item 1
    env = {k: v for k, v in os.environ.items() if k not in ("L0_MIN_DATA", "HF_HUB_OFFLINE")}
    env |= {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": str(tmp_path / "hf")}  # a hub that refuses, an empty cache
    t0 = time.monotonic()  # the same imports, no data: how long the process itself takes on this machine now
    subprocess.run([sys.executable, str(ROOT / "evaluate.py"), "--bench", "simpleqa", "--data", str(tmp_path / "none.csv"),
                    "--out", str(tmp_path / "y")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    t1 = time.monotonic()
    r = subprocess.run([sys.executable, str(ROOT / "evaluate.py"), "--bench", "simpleqa", "--out", str(tmp_path / "x")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    took, itself = time.monotonic() - t1, t1 - t0
    assert r.returncode == 1 and took < itself + 10, (took, itself, r.stderr)  # the hub library's retries take ~25 s
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("evaluate.py: benchmark simpleqa: no --data"), r.stderr
    for part in ("Pass --data FILE", "L0_MIN_DATA", "data.data_dir", "hub cache", "http://127.0.0.1:9) is not reachable",
                 "simple_qa_test_set.csv of the dataset basicv8vc/SimpleQA"):
        assert part in r.stderr
    assert not (tmp_path / "x").exists()


@pytest.mark.slow
def test_configuration_error_before_any_sample_is_one_line(server, tmp_path):  # item 6
    data = tmp_path / "bamboogle.csv"
    data.write_text("Question,Answer\nWho wrote Hamlet?,William Shakespeare\n")
    env = {k: v for k, v in os.environ.items() if k != "SERPER_API_KEY"}
    r = subprocess.run([sys.executable, str(ROOT / "evaluate.py"), "--bench", "bamboogle", "--data", str(data),
                        "--model", "tiny-random", "--inference-url", server.url, "--out", str(tmp_path / "x"),
                        "tools.search=serper"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr and "rerun" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1] == ("evaluate.py: tools.search=serper needs an API key in the environment "
                                                 "variable SERPER_API_KEY, which is unset")


def test_mixed_file_gets_the_per_source_table(server, tmp_path, capsys):  # item 4
    rows = [("n1", "nq", "Who wrote Hamlet?", ["William Shakespeare"]), ("n2", "nq", "What is the capital of France?", ["Paris"]),
            ("b1", "bamboogle", "Which band recorded Abbey Road?", ["The Beatles"]),
            ("h1", "hotpotqa", "How many metres is a kilometre?", ["1,000<|answer_split|>1000"])]
    data = tmp_path / "test.jsonl"
    data.write_text("".join(json.dumps({"id": i, "question": q, "golden_answers": a, "data_source": src}) + "\n"
                            for i, src, q, a in rows))
    server.use(tasks_of(data), policy=lambda q: "wrong" if q.startswith("What is") else "gold")
    s = cli("--bench", "searchr1-test", "--data", str(data), "--mode", "direct", out=tmp_path / "mixed", url=server.url)
    m = s["metrics"]
    assert s["bench"] == "searchr1-test" and m["official_em"] == 0.75
    assert {src: sm["official_em"] for src, sm in m["sources"].items()} == {"nq": 0.5, "bamboogle": 1.0, "hotpotqa": 1.0}
    assert m["source_avg"]["official_em"] == pytest.approx(2.5 / 3, abs=1e-15)
    printed = capsys.readouterr().out
    assert "| tiny-random | direct | searchr1-test: nq | 2 | 50.0 | 9.5-90.5 | 50.0 | 50.0 |" in printed  # n and CI per source
    assert ("| model | mode | NQ | HotpotQA | Bamboogle | Avg. |\n| --- | --- | ---: | ---: | ---: | ---: |\n"
            "| tiny-random | direct | 50.0 | 100.0 | 100.0 | 83.3 |") in printed
    assert "per source:" in (tmp_path / "mixed" / "summary.md").read_text()


def test_punctuation_only_answers_are_not_answered(server, tmp_path):  # item 6
    data = tmp_path / "bamboogle.csv"
    data.write_text("Question,Answer\nWho wrote Hamlet?,William Shakespeare\n")
    server.use(tasks_of(data), policy=lambda q: "punct")
    s = cli("--bench", "bamboogle", "--data", str(data), "--mode", "direct", out=tmp_path / "p", url=server.url)
    assert (s["metrics"]["answered"], s["metrics"]["status"]) == (0.0, {"no_answer": 1})
    assert results_of(tmp_path / "p")[0]["prediction"] == "|"


def test_chat_endpoint_judge_with_a_key_and_cached_verdicts(server, tmp_path, monkeypatch):  # item 8
    data = hotpot_file(tmp_path)
    tasks = tasks_of(data)[:3]
    verdict = {t.question: ["gold", "wrong", "silent"][i] for i, t in enumerate(tasks)}
    server.use(tasks, policy=verdict.get)
    out, args = tmp_path / "judged", ["--bench", "hotpotqa", "--data", str(data), "--mode", "direct", "--limit", "3"]
    s = cli(*args, out=out, url=server.url)  # 1. no judge
    assert "judge" not in s["metrics"] and all("grade" not in r for r in results_of(out))
    judge = ["--judge-url", server.url + "/v1", "--judge-model", "judge-x", "--judge-api-key-env", "L0_TEST_JUDGE_KEY"]
    with pytest.raises(EvalError, match="--judge-api-key-env L0_TEST_JUDGE_KEY: that environment variable is unset"):
        cli(*args, *judge, out=out, url=server.url)
    with pytest.raises(EvalError, match="needs --judge-model"):
        cli(*args, "--judge-url", server.url + "/v1", out=out, url=server.url)
    monkeypatch.setenv("L0_TEST_JUDGE_KEY", "sk-test")
    server.calls.clear()
    s = cli(*args, *judge, out=out, url=server.url)  # 2. the judge added: grades the saved answers, generates nothing
    assert sum(server.calls.values()) == 0 and server.judge_calls == 2  # the unanswered one needs no call
    assert server.chat_auth == ["Bearer sk-test"] * 2
    j = s["metrics"]["judge"]
    assert (j["accuracy"], j["incorrect"], j["not_attempted"]) == (pytest.approx(1 / 3), pytest.approx(1 / 3), pytest.approx(1 / 3))
    assert {r["judge"] for r in results_of(out)} == {"judge-x"} and s["judge_model"] == "judge-x"
    server.judge_calls = 0
    again = cli(*args, *judge, "--n-samples", "2", out=out, url=server.url)  # 3. a resume: only new samples are judged
    assert server.judge_calls == 2 and sum(server.calls.values()) == 3 and again["metrics"]["n"] == 3
    server.judge_calls = 0
    assert cli(*args, *judge, "--n-samples", "2", out=out, url=server.url)["metrics"] == again["metrics"]
    assert server.judge_calls == 0 and sum(server.calls.values()) == 3  # nothing re-judged, nothing regenerated


# ---------------------------------------------------------------------------------------------
# issue 23: the papers' table, a judge that fails or rambles, more one-line errors


def test_a_search_r1_style_mixed_file_prints_the_papers_table(server, tmp_path, capsys):
    """data_source values as Search-R1's test file spells them (tq, 2wiki, ...), sampled in another order."""
    sources = ["hotpotqa", "musique", "bamboogle", "nq", "popqa", "2wiki", "tq"]
    rows = [{"id": f"{src}-{i}", "question": f"Question {i} of {src}?", "golden_answers": [f"answer {src} {i}"],
             "data_source": src} for src in sources for i in range(2)]
    data = tmp_path / "mixed.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    server.use(tasks_of(data), policy=lambda q: "wrong" if q == "Question 1 of tq?" else "gold")
    s = cli("--bench", "searchr1-test", "--data", str(data), "--mode", "direct", out=tmp_path / "mixed", url=server.url)
    assert set(s["metrics"]["sources"]) == {"nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle"}
    printed = capsys.readouterr().out
    header = "| model | mode | NQ | TriviaQA | PopQA | HotpotQA | 2Wiki | MuSiQue | Bamboogle | Avg. |"
    assert f"EM\n{header}\n" in printed and f"F1\n{header}\n" in printed
    assert "| tiny-random | direct | 100.0 | 50.0 | 100.0 | 100.0 | 100.0 | 100.0 | 100.0 | 92.9 |" in printed  # 6.5 / 7


def test_a_judge_outage_loses_no_generation_and_the_next_run_judges_the_rest(server, tmp_path, monkeypatch):
    """Before: a record was saved only once judged (a judge answering 503: 6 generated, 0 saved)."""
    data = hotpot_file(tmp_path)
    tasks = tasks_of(data)[:3]
    server.use(tasks, policy={t.question: ["gold", "wrong", "silent"][i] for i, t in enumerate(tasks)}.get)
    server.chat_status = 503
    import l0_min.evaluation as evaluation

    monkeypatch.setattr(evaluation, "chat_completion", functools.partial(evaluation.chat_completion, tries=1))  # no backoff
    out = tmp_path / "outage"
    args = ["--bench", "hotpotqa", "--data", str(data), "--mode", "direct", "--limit", "3", "--judge-model", "judge-x",
            "--judge-url", server.url + "/v1/chat/completions"]  # written out: accepted
    with pytest.raises(EvalError, match=r"HTTP 503: the judge is down \(3 new samples are saved in .*results.jsonl"):
        cli(*args, out=out, url=server.url)
    saved = results_of(out)
    assert [(r["id"], r.get("grade")) for r in saved] == [("h1", None), ("h2", None), ("h3", "not_attempted")]  # no call
    server.chat_status, server.calls = 200, Counter()
    s = cli(*args, out=out, url=server.url)  # judges what was saved; generates nothing
    assert sum(server.calls.values()) == 0 and s["resumed_samples"] == 3
    assert [r["grade"] for r in results_of(out)] == ["correct", "incorrect", "not_attempted"]


def test_judge_replies_that_name_no_grade_are_counted_apart_and_said(server, tmp_path):
    data = hotpot_file(tmp_path)
    tasks = tasks_of(data)[:4]
    server.use(tasks)
    server.ramble = {tasks[1].question}
    s = cli("--bench", "hotpotqa", "--data", str(data), "--mode", "direct", "--limit", "4", "--judge-url", "self",
            out=tmp_path / "ramble", url=server.url)
    j = s["metrics"]["judge"]
    assert (j["accuracy"], j["not_attempted"], j["unparsed"], j["unparsed_samples"]) == (0.75, 0.0, 0.25, 1)
    assert server.judge_calls == 4 + 1  # the rambling one was asked twice
    assert any(n.startswith("the judge's reply named no grade for 1 sample(s): counted as 'unparsed'") for n in s["notes"])
    assert "| 1 judge replies unparsed |" in format_summary(s["metrics"])
    record = next(r for r in results_of(tmp_path / "ramble") if r["id"] == tasks[1].id)
    assert record["grade"] == "unparsed" and "It depends" in record["judge_error"]


def one_line(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message, message
    return message


def test_more_errors_are_one_line_and_come_before_anything_loads(server, tmp_path):
    data = hotpot_file(tmp_path)
    server.use(tasks_of(data))
    direct = ["--bench", "hotpotqa", "--data", str(data), "--mode", "direct", "--limit", "1"]
    # a model folder without tokenizer files (before: 51 lines, two tracebacks, "requires the protobuf library")
    from l0_min.models import resolve_model

    bare = tmp_path / "bare-model"
    bare.mkdir()
    (bare / "config.json").write_text((resolve_model("tiny-random") / "config.json").read_text())
    with pytest.raises(EvalError) as e:
        cli(*direct, out=tmp_path / "bare", url=server.url, model=str(bare))
    assert one_line(e) == f"{bare} holds no tokenizer (tokenizer.json, tokenizer_config.json ...): copy the tokenizer " \
                          "files of the model it was trained from into that folder"
    # --out naming a file, or under one
    (tmp_path / "a-file").write_text("x")
    for out, said in ((tmp_path / "a-file", f"--out {tmp_path / 'a-file'} is a file: name a folder"),
                      (tmp_path / "a-file" / "run", f"--out {tmp_path / 'a-file' / 'run'}: {tmp_path / 'a-file'} is a "
                                                    "file, so no folder can be made under it")):  # fmt: skip
        with pytest.raises(EvalError) as e:
            cli(*direct, out=out, url=server.url)
        assert one_line(e) == said
    # judge settings are checked first: before the data file (missing here) and the model (missing too) load
    with pytest.raises(EvalError) as e:
        cli("--bench", "hotpotqa", "--data", str(tmp_path / "missing.json"), "--judge-url", "http://judge:8000/v1",
            out=tmp_path / "j", url=server.url, model=str(tmp_path / "no-model"))
    assert one_line(e).startswith("--judge-url http://judge:8000/v1 (an OpenAI-compatible endpoint) needs --judge-model")
    with pytest.raises(EvalError) as e:
        cli(*direct, "--judge-url", "judge:8000", out=tmp_path / "j", url=server.url)
    assert one_line(e).startswith("--judge-url judge:8000: expected an http(s) URL")


def test_a_csv_with_a_byte_order_mark_loads_and_a_bad_encoding_names_its_fix(server, tmp_path):
    import gzip

    from l0_min.data import DataError

    bom = tmp_path / "bamboogle.csv"
    bom.write_text("Question,Answer\nWho wrote Hamlet?,William Shakespeare\n", encoding="utf-8-sig")  # Excel's export
    assert [(t.question, t.answers) for t in tasks_of(bom)] == [("Who wrote Hamlet?", ["William Shakespeare"])]
    server.use(tasks_of(bom))
    assert cli("--bench", "bamboogle", "--data", str(bom), "--mode", "direct", out=tmp_path / "bom", url=server.url)[
        "metrics"]["official_em"] == 1.0
    line = '{"question": "Who said \x93yes\x94?", "answer": "Ann"}\n'.encode("latin1")  # cp1252 curly quotes
    for path, write in ((tmp_path / "q.jsonl", Path.write_bytes), (tmp_path / "q.jsonl.gz", lambda p, b: p.write_bytes(gzip.compress(b)))):
        write(path, line)
        with pytest.raises(DataError) as e:
            tasks_of(path)
        assert "row 1: not UTF-8 text (byte 0x93): fix the encoding of the file (e.g. iconv -f cp1252 -t utf-8 IN > OUT" \
               in one_line(e) and "for a .gz file: gunzip -c IN | iconv -f cp1252 -t utf-8 | gzip > OUT" in str(e.value)


def test_a_gsm8k_file_given_by_bench_name_gets_the_math_environments_row_checks(tmp_path):
    """Issue 44: `--bench gsm8k --data FILE` skipped the math environment's check that golds are numbers (a gold of
    'seven' was kept and could never score; --env math refused it), and a row with two '####' silently took the last."""
    good = {"question": "2 + 5?", "answer": "2 + 5 = <<2+5=7>>7\n#### 7"}
    for bad, why in (({"question": "How many?", "answer": "Count them.\n#### seven"}, "the gold answer 'seven' is not a number"),
                     ({"question": "Sum?", "answer": "1 + 1 = 2\n#### 2\nSo 3.\n#### 3"}, "more than one '####' mark")):
        path = tmp_path / "gsm8k.jsonl"
        path.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
        args = evaluate.parse_args(["--bench", "gsm8k", "--data", str(path)])
        with pytest.raises(DataError, match=rf"gsm8k.jsonl: row 2: [^\n]*{why}"):
            evaluate.load_tasks_and_env(args, evaluate.eval_config(args))
    path.write_text(json.dumps(good) + "\n")
    _, tasks, env = evaluate.load_tasks_and_env(args, evaluate.eval_config(args))
    assert env.name == "math" and [t.answers for t in tasks] == [["7"]]
