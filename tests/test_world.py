import collections
import re

import pytest

from l0_min.envs import qa as world
from l0_min.answers import exact_match, split
from l0_min.episode import Task
from l0_min.envs.qa import expert_actions, make_world, number_words, slug


@pytest.fixture(scope="module")
def w():
    return make_world(seed=0, n_entities=60, n_tasks=256)


def test_deterministic_and_seeded(w):
    again = make_world(seed=0, n_entities=60, n_tasks=256)
    assert again.corpus == w.corpus and again.tasks == w.tasks
    other = make_world(seed=1, n_entities=60, n_tasks=256)
    assert other.corpus != w.corpus
    assert [t.question for t in other.tasks] != [t.question for t in w.tasks]


def test_n_tasks_only_adds_questions(w):
    fewer = make_world(seed=0, n_entities=60, n_tasks=50)
    assert fewer.corpus == w.corpus and fewer.tasks == w.tasks[:50]
    assert make_world(0, 60, n_tasks=0).corpus == w.corpus


def test_corpus_shape(w):
    assert len(w.corpus) == 60
    assert [d["id"] for d in w.corpus] == [slug(d["title"]) for d in w.corpus]
    assert len({d["id"] for d in w.corpus}) == 60
    assert all(set(d) == {"id", "title", "text"} and d["text"] for d in w.corpus)
    # no word of an invented name is shared by two names, so a name finds its page
    words = collections.Counter(word for d in w.corpus for word in set(d["title"].lower().split())
                                if word not in {"of", "bank", "university", "museum", "art", "natural", "history",
                                                "institute", "technology", "college", "philharmonic", "chamber",
                                                "orchestra", "savings", "shipworks", "lumber", "company", "mills",
                                                "instruments", "glassworks"})
    assert max(words.values()) == 1


def test_ids_questions_and_meta(w):
    assert len({t.id for t in w.tasks}) == 256 and w.tasks[3].id == "world0-0003"
    assert len({t.question for t in w.tasks}) == 256
    for t in w.tasks:
        m = t.meta
        assert m["seed"] == 0 and m["n_entities"] == 60 and m["source"] == "world"
        assert m["hops"] == len(m["support"]) and 1 <= m["hops"] <= 3
        assert t.answers and all(isinstance(a, str) and a for a in t.answers)


def test_mix_of_kinds(w):
    kinds = collections.Counter(t.meta["kind"] for t in w.tasks)
    assert set(kinds) == {"lookup", "multihop", "arithmetic", "comparison"}
    assert kinds["lookup"] >= 0.35 * 256  # a good share of one-page lookups for a small model
    assert all(kinds[k] >= 0.08 * 256 for k in kinds)
    hops = collections.Counter(t.meta["hops"] for t in w.tasks)
    assert hops[1] == kinds["lookup"] and hops[2] > 0 and hops[3] > 0
    assert len({t.meta["template"] for t in w.tasks}) >= 20


def _doc(w):
    return {d["id"]: d for d in w.corpus}


def test_evidence_is_in_the_supporting_pages(w):
    docs = _doc(w)
    for t in w.tasks:
        assert [doc for doc, _ in t.meta["evidence"]][0] == t.meta["support"][0]
        for doc, sentence in t.meta["evidence"]:
            assert doc in t.meta["support"]
            assert sentence in docs[doc]["text"], (t.id, doc, sentence)


def test_lookup_and_multihop_answers_are_stated_in_the_last_page(w):
    docs = _doc(w)
    for t in w.tasks:
        if t.meta["kind"] not in ("lookup", "multihop"):
            continue
        last_doc, last_sentence = t.meta["evidence"][-1]
        assert any(a in last_sentence for a in t.answers), (t.question, t.answers, last_sentence)
        # every page of the chain names the entity that leads to the next page
        for (doc, sentence), nxt in zip(t.meta["evidence"], t.meta["evidence"][1:]):
            if nxt[0] != doc:
                assert docs[nxt[0]]["title"] in sentence, (t.question, sentence, nxt[0])


def _number(text: str) -> int:
    return int(text.replace(",", ""))


def test_arithmetic_answers_follow_from_the_evidence(w):
    checked = 0
    for t in w.tasks:
        if t.meta["kind"] != "arithmetic":
            continue
        a, b = t.meta["operands"]
        (d1, s1), (d2, s2) = t.meta["evidence"]
        assert f"{a:,}" in s1 or str(a) in s1
        assert f"{b:,}" in s2 or str(b) in s2
        expected = a + b if t.meta["template"] == "combined_population" else b - a
        assert expected > 0
        assert t.answers[0] == str(expected)
        assert exact_match(f"{expected} years", t.answers) or exact_match(f"{expected} people", t.answers)
        if expected < 1000:
            assert number_words(expected) in t.answers
        checked += 1
    assert checked >= 20


def test_comparison_answers_follow_from_the_evidence(w):
    docs = _doc(w)
    for t in w.tasks:
        if t.meta["kind"] != "comparison":
            continue
        (d1, s1), (d2, s2) = t.meta["evidence"]
        n1, n2 = docs[d1]["title"], docs[d2]["title"]
        assert n1 in t.question and n2 in t.question and t.answers in ([n1], [n2])
        v1, v2 = t.meta["operands"]
        assert v1 != v2
        template = t.meta["template"]
        if template in ("older_org", "born_first"):
            assert t.answers == ([n1] if v1 < v2 else [n2])
            years = [v1, v2] if template == "older_org" else [v1[0], v2[0]]
            assert str(years[0]) in s1 and str(years[1]) in s2
        else:
            assert t.answers == ([n1] if v1 > v2 else [n2])
            assert f"{v1:,}" in s1 and f"{v2:,}" in s2


def test_number_aliases():
    assert world._num_answers(12, "years") == ["12", "twelve", "12 years", "twelve years"]
    assert world._num_answers(1200) == ["1200", "1,200"]
    assert number_words(0) == "zero" and number_words(90) == "ninety" and number_words(999) == "nine hundred ninety-nine"


def test_split_is_stable_and_disjoint(w):
    train, held = split(w.tasks, 0.2)
    assert len(train) + len(held) == 256 and not {t.id for t in train} & {t.id for t in held}
    assert 0.1 < len(held) / 256 < 0.3
    assert split(list(reversed(w.tasks)), 0.2)[1] == list(reversed(held))
    assert split(w.tasks, 0.0) == (w.tasks, []) and split(w.tasks, 1.0)[0] == []
    assert w.split(0.2) == (train, held)
    with pytest.raises(ValueError, match="held_out"):
        split(w.tasks, 1.5)


def test_bad_sizes():
    with pytest.raises(ValueError, match="at least 6"):
        make_world(0, 5)
    with pytest.raises(ValueError, match=r"only \d+ distinct questions, 400 asked"):
        make_world(0, 6, n_tasks=400)
    small = make_world(0, 6, n_tasks=20)
    assert len(small.tasks) == 20 and len(small.corpus) == 6


def test_questions_name_their_entities(w):
    docs = _doc(w)
    for t in w.tasks:
        first = docs[t.meta["support"][0]]["title"]
        assert first in t.question, (t.question, first)
        assert re.search(r"\?$", t.question)


@pytest.mark.slow
def test_rollout_expert_solves_world_tasks_through_the_real_kernels(tmp_path):
    """`rollout.py --expert`: the SFT episodes of train.py, written by the expert through bwrap'd kernels and
    the tool socket: every lookup answered right in two steps, real search output in the observations."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    args = ["rollout.py", "--expert", "--data", "synthetic:train", "--limit", "4", "--model", "tiny-random",
            "--out", str(tmp_path), "data.synthetic_kinds=[lookup]", "kernel.pool_size=2"]  # fmt: skip
    p = subprocess.run([sys.executable, *args], cwd=root, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    eps = [json.loads(line) for line in (tmp_path / "trajectories.jsonl").read_text().splitlines()]
    assert len(eps) == 4 and all(e["rewards"]["em"] == 1.0 and len(e["steps"]) == 2 for e in eps)
    assert all("(ref: " in e["steps"][0]["observation"] for e in eps)
    (tmp_path / "qa.jsonl").write_text('{"question": "Who wrote it?", "answer": "Someone"}\n')
    args = ["rollout.py", "--expert", "--data", str(tmp_path / "qa.jsonl"), "--out", str(tmp_path)]
    p = subprocess.run([sys.executable, *args], cwd=root, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "tools.search=bm25 needs documents" in p.stderr.splitlines()[-1], p.stderr


def test_expert_of_a_file_task_submits_its_first_gold_answer_in_one_step():
    task = Task("f1", "Say a word.", ["grape", "apple"], {"benchmark": "file"})
    assert expert_actions(task) == ['<think>The answer is grape.</think>\n<code>submit_final_answer("grape")</code>']
