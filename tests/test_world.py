import collections
import hashlib
import json
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
    three = collections.Counter(t.meta["kind"] for t in w.tasks if t.meta["hops"] == 3)  # in every long kind
    assert set(three) == {"multihop", "arithmetic", "comparison"} and 0.25 < hops[3] / (hops[2] + hops[3]) < 0.45, three


def test_three_hop_variants_leave_every_other_task_where_it_was():
    """The 3-hop variants come from a random stream of their own: the demo's world keeps every lookup (id,
    question, answers, expert) and the kind of every task as they were before the variants (hashes taken then)."""
    w = make_world(0, 160, 1024)
    lookups = [(t.id, t.question, t.answers, expert_actions(t)) for t in w.tasks if t.meta["kind"] == "lookup"]
    digest = lambda x: hashlib.sha1(json.dumps(x).encode()).hexdigest()[:16]  # noqa: E731
    assert len(lookups) == 396 and digest(lookups) == "51a48dc5db4a9f92"
    assert digest([t.meta["kind"] for t in w.tasks]) == "ad15b400733f23b3"


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
    docs, checked = _doc(w), 0
    for t in w.tasks:
        if t.meta["kind"] != "arithmetic":
            continue
        a, b = t.meta["operands"]
        sentences = [s for _, s in t.meta["evidence"]]  # 2 pages, or 3: the first named through a founder
        assert all(any(f"{x:,}" in s or str(x) in s for s in sentences) for x in (a, b))
        assert len(sentences) == 2 or docs[t.meta["support"][0]]["title"] in t.question
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
        (d1, s1), (d2, s2) = t.meta["evidence"][-2:]  # the two compared; a 3-hop variant names the first through
        n1, n2 = docs[d1]["title"], docs[d2]["title"]  # the page before (an organisation's founder or headquarters)
        assert (n1 in t.question or t.meta["hops"] == 3 and n1 in t.meta["evidence"][0][1]) and n2 in t.question
        assert t.answers in ([n1], [n2])
        v1, v2 = t.meta["operands"]
        assert v1 != v2
        template = t.meta["template"]
        if template in ("older_org", "born_first", "founder_born_first"):
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
    the tool socket: every lookup answered right in two steps, real search output in the observations. Where
    results show 40 characters of a page, the long tasks too: each page found by its search and read by its
    ref (what the tool server served recorded with the step that called it: every hop found, the step rewards'
    chain seen once), and where the context window filled, the rebuilt context holds the notepad's facts."""
    import subprocess
    import sys
    from pathlib import Path

    from transformers import AutoTokenizer

    from l0_min.models import resolve_model

    root = Path(__file__).resolve().parents[1]
    args = ["rollout.py", "--expert", "--data", "synthetic:train", "--limit", "4", "--model", "tiny-random",
            "--out", str(tmp_path), "data.synthetic_kinds=[lookup]", "kernel.pool_size=2"]  # fmt: skip
    p = subprocess.run([sys.executable, *args], cwd=root, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    eps = [json.loads(line) for line in (tmp_path / "trajectories.jsonl").read_text().splitlines()]
    assert len(eps) == 4 and all(e["rewards"]["em"] == 1.0 and len(e["steps"]) == 2 for e in eps)
    assert all("(ref: " in e["steps"][0]["observation"] for e in eps)
    # the long form (tiny-random's tokens are bytes: a 2,600-token window fills in the 3-hop episodes)
    args = ["rollout.py", "--expert", "--data", "synthetic:train", "--limit", "3", "--model", "tiny-random", "--out",
            str(tmp_path / "long"), "data.synthetic_kinds=[multihop,comparison,arithmetic]", "kernel.pool_size=2",
            "tools.snippet_chars=40", "tools.top_k=2", "agent.max_steps=8", "agent.max_context_tokens=2600",
            "agent.min_action_tokens=200"]  # fmt: skip
    p = subprocess.run([sys.executable, *args], cwd=root, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    eps = [json.loads(line) for line in (tmp_path / "long" / "trajectories.jsonl").read_text().splitlines()]
    tok, docs = AutoTokenizer.from_pretrained(resolve_model("tiny-random")), world._docs(0, 60)
    assert len(eps) == 3 and {e["task"]["meta"]["hops"] for e in eps} == {2, 3}
    for e in eps:
        m, steps = e["task"]["meta"], e["steps"]
        assert e["rewards"]["em"] == 1.0 and len(steps) == 2 * m["hops"] + 1 and all(s["exec_ok"] for s in steps), e
        for i, page in enumerate(m["support"]):
            assert f"(ref: {page})" in steps[2 * i]["observation"]  # the search found the page ...
            assert docs[page]["text"] in steps[2 * i + 1]["observation"]  # ... and read_page showed all of it
            assert ["web_search", page] in steps[2 * i]["served"]  # as the tool server recorded it, step by step
            assert steps[2 * i + 1]["served"] == [["read_page", docs[page]["title"]]]
        assert all(e["rewards"][f"hop{k}"] == 1.0 for k in range(1, m["hops"] + 1)) and e["rewards"]["ref_missed"] == 0
        assert sum(world.info_gain(world.Episode.from_json(e), 40)) == pytest.approx(1.0)  # the whole chain, once
        if e["truncations"]:
            rebuilt = next(s for s in steps if s["segment"] == 1)
            written = [s["code"].split('"')[1] for s in steps[: steps.index(rebuilt)] if "notepad.facts" in s["code"]]
            assert written and all(f"- {f}" in tok.decode(rebuilt["context_ids"]) for f in written), e
    assert any(e["truncations"] for e in eps if e["task"]["meta"]["hops"] == 3)
    (tmp_path / "qa.jsonl").write_text('{"question": "Who wrote it?", "answer": "Someone"}\n')
    args = ["rollout.py", "--expert", "--data", str(tmp_path / "qa.jsonl"), "--out", str(tmp_path)]
    p = subprocess.run([sys.executable, *args], cwd=root, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "tools.search=bm25 needs documents" in p.stderr.splitlines()[-1], p.stderr


def test_expert_of_a_file_task_submits_its_first_gold_answer_in_one_step():
    task = Task("f1", "Say a word.", ["grape", "apple"], {"benchmark": "file"})
    assert expert_actions(task) == ['<think>The answer is grape.</think>\n<code>submit_final_answer("grape")</code>']


def test_the_long_expert_reads_each_page_notes_what_it_needs_and_computes_the_answer(w):
    """Where snippets cut the pages (tools.snippet_chars=40), each page is searched, then read by its ref, and the
    sentence needed goes into the notepad in the next search's cell; the last cell computes the answer. Its cells,
    run in order with stand-ins for the tools, read the support pages in order, keep every needed sentence in the
    notepad (but the last, used at once) and submit a gold answer: 5 steps for 2 pages, 7 for 3."""
    from l0_min.sandbox.toolbox.notepad import Notepad

    docs, steps = _doc(w), collections.Counter()
    for t in w.tasks:
        if t.meta["kind"] == "lookup":
            continue
        actions, searched, read, submitted = expert_actions(t, snippet_chars=40), [], [], []
        scope = {"web_search": searched.append, "read_page": lambda ref: read.append(ref) or docs[ref]["text"],
                 "notepad": Notepad(), "submit_final_answer": submitted.append, "print": lambda *a: None}
        for action in actions:
            assert re.fullmatch(r"<think>[^<>]{10,}</think>\n<code>(?s:.+)</code>", action), action
            exec(action.split("<code>")[1].removesuffix("</code>"), scope)
        pages = t.meta["support"]
        assert len(actions) == 2 * len(pages) + 1 and read == pages and searched == [docs[p]["title"] for p in pages]
        assert scope["notepad"].facts == [" ".join(s for d, s in t.meta["evidence"] if d == p) for p in pages[:-1]]
        assert len(submitted) == 1 and exact_match(str(submitted[0]), t.answers), (t.question, submitted, t.answers)
        steps[len(actions)] += 1
    assert set(steps) == {5, 7}


def test_the_expert_reads_pages_only_where_search_results_cut_them():
    """The form follows tools.snippet_chars: configs/cpu_demo.yaml's results show whole pages, so its expert is the
    two-step one, as before, for every task of the demo; configs/cpu_long.yaml's show 40 characters, so every long
    task of its held-out evaluation (64 QA, 64 files) is read page by page; a lookup there would take 3 steps."""
    from l0_min import config
    from l0_min.envs import load_sources
    from l0_min.envs.files import LONG_KINDS

    configs = world.Path(__file__).parents[1] / "configs"
    demo = config.resolve(config_file=configs / "cpu_demo.yaml")
    (train,), _, envs = load_sources(demo.data.train, demo)
    (held,), _, _ = load_sources(demo.data.eval, demo)
    assert len(train) + len(held) == 396
    assert all(envs["qa"].expert(t) == expert_actions(t) and len(expert_actions(t)) == 2 for t in train + held)
    long = config.resolve(config_file=configs / "cpu_long.yaml")
    (qa, files), _, envs = load_sources(long.data.eval, long, limit=long.data.eval_limit)
    assert len(qa) == len(files) == 64 and {t.meta["kind"] for t in files} == set(LONG_KINDS)
    assert all(len(envs["qa"].expert(t)) == 2 * t.meta["hops"] + 1 for t in qa)
    assert [a.count("read_page(") for a in expert_actions(train[0], snippet_chars=40)] == [0, 1, 0]


# ---- step rewards (reward.step_weight): information gain over the gold chain, from what the tools served
STEP_WEIGHT = 0.4  # the recommended reward.step_weight (bench/ablate.py's :step arm)
GOOD = "<think>I look the pages up one by one.</think><code>print(web_search('x'))</code>"


def _scripted(task, served_per_step, answer, weight=STEP_WEIGHT, snippet_chars=40):
    """An episode of well-formed steps that all ran, each with what the tool server served in it, scored by QA."""
    from l0_min.config import Config, RewardConfig
    from l0_min.envs.qa import QA
    from l0_min.episode import Episode, Step
    from l0_min.rewards import score_episode

    cfg = Config(reward=RewardConfig(step_weight=weight))
    cfg.tools.snippet_chars = snippet_chars
    steps = [Step([], [], [], action_text=GOOD, exec_ok=True, served=list(s)) for s in served_per_step]
    ep = Episode(task, steps, final_answer=answer, status="answered" if answer is not None else "max_steps")
    score_episode(ep, cfg.reward, QA(cfg))
    return ep


def _chain(task, docs):
    """What a search-then-read of each page of the chain serves: the page listed with one other hit, then read."""
    other = next(p for p in docs if p not in task.meta["support"])
    return [s for p in task.meta["support"] for s in ([("web_search", p), ("web_search", other)],
                                                      [("read_page", docs[p]["title"])])]


@pytest.mark.parametrize("template", ["older_org", "org_founder_birth_year", "org_founder_birth_country"])
def test_step_rewards_cannot_make_reading_beat_answering(w, template):
    """The order of episode totals at the recommended step_weight (0.4), for 2- and 3-hop tasks whose snippets cut
    the pages (the long config): reading the chain and answering right > answering right without reading (a
    guess) > reading the chain and answering wrong > the same after re-reading pages (each re-read costs) >
    answering wrong without reading > no answer > reading without ever answering (no gain is paid without an
    answer; re-reads cost). The bound: gains sum to at most step_weight, and a wrong answer's reward is 0.72 below a
    right one's (0.8 x 0.9): at step_weight 0.75 a wrong answer after reading would beat a right guess."""
    docs, task = world._docs(0, 60), next(t for t in w.tasks if t.meta["template"] == template)
    gold, chain = task.answers[0], _chain(task, docs)
    reread = [[("read_page", docs[task.meta["support"][0]]["title"])]] * 2
    totals = {name: _scripted(task, served, answer).reward for name, served, answer in [
        ("read, right", chain + [[]], gold), ("right", [[]], gold), ("read, wrong", chain + [[]], "nobody"),
        ("read much, wrong", chain + reread + [[]], "nobody"), ("wrong", [[]], "nobody"),
        ("no answer", [[]] * (len(chain) + 2), None), ("read, no answer", chain + reread, None)]}
    order = list(totals)
    assert [totals[a] > totals[b] for a, b in zip(order, order[1:])] == [True] * 6, totals
    hops = len(task.meta["support"])
    assert totals["read, right"] - totals["right"] == pytest.approx(STEP_WEIGHT, abs=1e-9)  # the whole chain: 1 x weight
    assert totals["read, wrong"] - totals["read much, wrong"] == pytest.approx(2 * 0.1 * STEP_WEIGHT, abs=1e-9)
    ep = _scripted(task, chain + [[]], "nobody")
    gains = world.info_gain(ep, 40)  # per page: half at its search, half at its read; all at the search where the
    assert sum(gains) == pytest.approx(1.0) and min(gains) == 0.0 == gains[-1]  # fact fits in the snippet
    for search, read in zip(gains[:-1:2], gains[1::2]):
        assert (search, read) in ((pytest.approx(0.5 / hops), pytest.approx(0.5 / hops)), (pytest.approx(1 / hops), 0.0))
    assert ep.rewards["step"] == pytest.approx(1.0) and ep.rewards["core"] == pytest.approx(0.1)
    assert {k: ep.rewards[k] for k in ep.rewards if k.startswith(("hop", "ref_"))} == {
        **{f"hop{k}": 1.0 for k in range(1, hops + 1)}, "ref_missed": 0.0, "ref_recovered": 0.0}
    bound = {name: _scripted(task, served, answer, weight=0.75).reward
             for name, served, answer in [("right", [[]], gold), ("read, wrong", chain + [[]], "nobody")]}
    assert bound["read, wrong"] > bound["right"]


def test_what_the_agent_prints_earns_nothing_and_hops_count_only_facts_served(w):
    """Only the tool server's record counts (Step.served): an observation that prints every gold ref earns nothing.
    A page only listed by a search (its 40-character snippet lacks the fact) is half seen: not a found hop; with
    whole pages in the snippets (the demo's 300 characters) the search alone finds it. A read_page of a mistyped ref
    (the server's not-found line) then of the page: ref_missed and ref_recovered."""
    from l0_min.episode import Step

    docs, task = world._docs(0, 60), next(t for t in w.tasks if t.meta["template"] == "older_org")
    p1, p2 = task.meta["support"]
    ep = _scripted(task, [[]], task.answers[0])
    ep.steps[0].observation = " ".join(f"(ref: {p}) {docs[p]['title']}\n{docs[p]['text']}" for p in (p1, p2))
    assert world.info_gain(ep, 40) == [0.0] and world.hop_metrics(ep, 40)["hop1"] == 0.0
    listed = _scripted(task, [[("web_search", p1)], [("web_search", p2)]], "x")
    assert [listed.rewards[k] for k in ("hop1", "hop2")] == [0.0, 0.0] and world.info_gain(listed, 40) == [0.25, 0.25]
    whole = _scripted(task, [[("web_search", p1)], [("web_search", p2)]], "x", snippet_chars=300)
    assert [whole.rewards[k] for k in ("hop1", "hop2")] == [1.0, 1.0] and world.info_gain(whole, 300) == [0.5, 0.5]
    missed = f"No page found for {p1[:6]!r}. Use a document id or an exact title from web_search results."
    ep = _scripted(task, [[("read_page", missed)], [("read_page", docs[p1]["title"])]], "x")
    assert (ep.rewards["ref_missed"], ep.rewards["ref_recovered"], ep.rewards["hop1"]) == (1.0, 1.0, 1.0)
    assert world.info_gain(ep, 40) == [0.0, 0.5]
    again = _scripted(task, [[("read_page", missed)], [("read_page", missed)]], "x")  # the same miss twice: a cost
    assert world.info_gain(again, 40) == [0.0, -0.1] and again.rewards["ref_recovered"] == 0.0
    plain = Task("f", "Who?", ["Someone"], {"benchmark": "file"})  # a task of a file: no chain, no step rewards
    assert world.info_gain(world.Episode(plain, [Step([], [], [])]), 40) == [0.0] and world.hop_metrics(
        world.Episode(plain), 40) == {}
