import gzip
import json
import sys
import time
import types
from pathlib import Path

import pytest

from l0_min.config import DataConfig
from l0_min.data import DataError, find_benchmark_file
from l0_min.envs.qa import corpus_from_tasks, load_corpus, load_tasks, make_world


def load_file(path, limit=None, skip_bad_rows=False):
    """A file of any QA layout, as data.train names one."""
    return load_tasks(str(path), DataConfig(skip_bad_rows=skip_bad_rows), limit)


def load_benchmark(name, path=None, skip_bad_rows=False):
    """A benchmark by name, from a file or folder if given (evaluate.py --bench NAME --data PATH)."""
    return load_tasks(name, DataConfig(data_dir=path or "", skip_bad_rows=skip_bad_rows))

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data"
needs_shared = pytest.mark.skipif(not SHARED.is_dir(), reason=f"shared benchmark data not present at {SHARED}")
BENCH = SHARED / "benchmarks"


# ---------------------------------------------------------------------------------------------
# every shared file: counts (SOURCES.md) and fields


@needs_shared
def test_simpleqa_file():
    ts = load_benchmark("simpleqa", str(BENCH / "simpleqa" / "simple_qa_test_set.csv"))
    assert len(ts) == 4326 and ts.skipped == 0
    t = ts[0]
    assert t.id == "simple_qa_test_set:1"
    assert t.question == "Who received the IEEE Frank Rosenblatt Award in 2010?"
    assert t.answers == ["Michio Sugeno"]
    assert t.meta["topic"] == "Science and technology" and t.meta["answer_type"] == "Person"
    assert t.meta["urls"][0].startswith("https://") and t.meta["benchmark"] == "simpleqa"
    assert len({t.id for t in ts}) == 4326


@needs_shared
def test_hotpotqa_file():
    ts = load_benchmark("hotpotqa", str(BENCH / "hotpotqa" / "hotpot_dev_distractor_first103.json"))
    assert len(ts) == 103
    t = ts[0]
    assert t.id == "5a8b57f25542995d1e6f1371" and t.answers == ["yes"]
    assert t.question == "Were Scott Derrickson and Ed Wood of the same nationality?"
    assert t.meta["type"] == "comparison" and t.meta["level"] == "hard"
    assert t.meta["supporting_facts"] == [["Scott Derrickson", 0], ["Ed Wood", 0]]
    assert all(len(x.meta["context"]) >= 2 for x in ts)
    titles = [title for title, _ in t.meta["context"]]
    assert "Scott Derrickson" in titles and "Ed Wood" in titles


@needs_shared
def test_bamboogle_file():
    ts = load_benchmark("bamboogle", str(BENCH / "bamboogle" / "test.csv"))
    assert len(ts) == 125
    assert ts[0].id == "test:1" and ts[0].answers == ["james madison"]
    assert ts[2].answers == ["1999"]


@needs_shared
def test_musique_file():
    ts = load_benchmark("musique", str(BENCH / "musique" / "musique_train_100.json"))
    assert len(ts) == 100
    t = ts[0]
    assert t.id == "2hop__150763_14904" and t.answers == ["G. Stanley Hall", "Stanley Hall"]
    assert len(t.meta["paragraphs"]) == 20 and t.meta["answerable"] is True
    assert sum(p["is_supporting"] for p in t.meta["paragraphs"]) == 2
    assert t.meta["question_decomposition"][0]["paragraph_support_idx"] == 6


@needs_shared
def test_2wiki_file():
    ts = load_benchmark("2wiki", str(BENCH / "2wikimultihopqa" / "dev_500.jsonl"))
    assert len(ts) == 500
    assert ts[0].id == "1" and ts[0].question == "Who is Ahmose-Henutemipet's paternal grandmother?"
    assert ts[1].answers == ["3 November 1929"]
    assert ts[0].meta["benchmark"] == "2wikimultihopqa"


@needs_shared
def test_nq_file():
    ts = load_benchmark("nq", str(BENCH / "nq" / "NQ-open.dev.jsonl"))
    assert len(ts) == 3610
    assert ts[0].answers == ["14 December 1972 UTC", "December 1972"]
    assert ts[0].id == "NQ-open:1"
    assert ts[290].answers == ["---"]  # a gold that normalises to "" is kept (EM compares it lightly)


@needs_shared
def test_benchmarks_by_name_from_a_data_folder(monkeypatch):
    monkeypatch.setenv("L0_MIN_DATA", str(SHARED))
    counts = {"simpleqa": 4326, "hotpotqa": 103, "bamboogle": 125, "musique": 100, "2wikimultihopqa": 500, "nq": 3610}
    for name, n in counts.items():
        assert len(load_benchmark(name)) == n
    assert len(load_tasks("bamboogle")) == 125
    assert len(load_tasks("hotpotqa", DataConfig(data_dir=str(SHARED)), limit=7)) == 7


@needs_shared
def test_load_tasks_sniffs_file_layouts():
    ts = load_tasks(str(BENCH / "musique" / "musique_train_100.json"))
    assert len(ts) == 100 and ts[0].meta["benchmark"] == "musique"
    ts = load_tasks(str(BENCH / "bamboogle" / "test.csv"))
    assert ts[0].meta["benchmark"] == "csv_qa"


@needs_shared
def test_corpus_from_hotpot_and_musique():
    hot = load_benchmark("hotpotqa", str(SHARED))
    docs = corpus_from_tasks(hot)
    assert len(docs) == 1021  # 1022 context paragraphs, one repeated
    assert len({d["id"] for d in docs}) == len(docs)
    titles = {d["title"] for d in docs}
    assert all(title in titles for t in hot for title, _ in t.meta["supporting_facts"])
    derrickson = next(d for d in docs if d["title"] == "Scott Derrickson")
    assert derrickson["text"].startswith("Scott Derrickson (born July 16, 1966) is an American director")
    mus = corpus_from_tasks(load_benchmark("musique", str(SHARED)))
    assert len(mus) == 1890 and len({d["id"] for d in mus}) == 1890
    assert len(corpus_from_tasks(load_benchmark("bamboogle", str(SHARED)))) == 0


@needs_shared
def test_kilt_and_wiki18_corpora():
    kilt = load_corpus(SHARED / "corpora" / "kilt_wikipedia_sample_99.jsonl")
    assert len({d["title"] for d in kilt}) == 99
    assert len(kilt) == 2323
    assert kilt[0]["id"] == "A#0" and kilt[0]["text"].startswith("A (named , plural")
    assert all(1 <= len(d["text"].split()) <= 100 for d in kilt)
    assert not any("Section::::" in d["text"] for d in kilt)
    wiki = load_corpus(SHARED / "corpora" / "wiki18_sample_10.jsonl")
    assert len(wiki) == 10
    assert wiki[0] == {"id": "0", "title": "Evan Morris", "text": wiki[0]["text"]}
    assert wiki[0]["text"].startswith("Evan Morris Evan L. Morris (January 26, 1977")


# ---------------------------------------------------------------------------------------------
# layouts written to tmp_path


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def jsonl(path: Path, rows: list) -> Path:
    return write(path, "".join(json.dumps(r) + "\n" for r in rows))


def test_triviaqa_rc_and_flat(tmp_path):
    rc = {"Data": [{"Question": "Which planet is red?", "QuestionId": "tc_1",
                    "Answer": {"Value": "Mars", "Aliases": ["Mars", "The Red Planet"],
                               "NormalizedAliases": ["mars", "red planet"]}}],
          "Domain": "Web", "Version": 1.0}
    ts = load_file(write(tmp_path / "wikipedia-dev.json", json.dumps(rc)))
    assert [(t.id, t.question, t.answers) for t in ts] == [("tc_1", "Which planet is red?", ["Mars", "The Red Planet"])]
    flat = [{"question": "Which planet is red?", "question_id": "q9",
             "answer": {"value": "Mars", "aliases": ["Mars", "Red planet"], "normalized_aliases": ["mars"]}}]
    ts = load_file(jsonl(tmp_path / "tqa.jsonl", flat))
    assert ts[0].id == "q9" and ts[0].answers == ["Mars", "Red planet"] and ts[0].meta["benchmark"] == "triviaqa"


def test_flashrag_jsonl_with_metadata_paragraphs(tmp_path):
    rows = [{"id": "test_0", "question": "q?", "golden_answers": ["x", "X.", "y"],
             "metadata": {"type": "bridge", "context": {"title": ["T"], "sentences": [["s1.", " s2."]]}}}]
    ts = load_benchmark("hotpotqa", str(jsonl(tmp_path / "dev.jsonl", rows)))
    t = ts[0]
    assert (t.id, t.answers, t.meta["type"], t.meta["benchmark"]) == ("test_0", ["x", "X.", "y"], "bridge", "hotpotqa")
    assert t.meta["context"] == [["T", ["s1.", " s2."]]]
    assert [d["text"] for d in corpus_from_tasks(ts)] == ["s1. s2."]


def test_nq_style_answers_and_dpr_tsv(tmp_path):
    ts = load_file(jsonl(tmp_path / "nq.jsonl", [{"question": "q1", "answer": ["a1", 1999]},
                                                 {"question": "q2", "answers": ["b"]}]))
    assert [t.answers for t in ts] == [["a1", "1999"], ["b"]]
    ts = load_file(write(tmp_path / "trivia-test.qa.tsv", "who is x?\t['Ann', 'Anne']\nwhat is y?\tplain\n"))
    assert [(t.id, t.answers) for t in ts] == [("trivia-test:1", ["Ann", "Anne"]), ("trivia-test:2", ["plain"])]


def test_hotpot_hf_context_and_gzip(tmp_path):
    rows = [{"id": "h1", "question": "q", "answer": "a", "type": "bridge", "level": "easy",
             "context": {"title": ["A", "B"], "sentences": [["a1"], ["b1", " b2"]]}}]
    path = tmp_path / "hotpot.jsonl.gz"
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.write(json.dumps(rows[0]) + "\n")
    t = load_file(path)[0]
    assert t.meta["context"] == [["A", ["a1"]], ["B", ["b1", " b2"]]] and t.meta["level"] == "easy"


def test_limit_and_ids(tmp_path):
    path = jsonl(tmp_path / "x.jsonl", [{"question": f"q{i}", "answer": "a"} for i in range(5)])
    ts = load_file(path, limit=2)
    assert [t.id for t in ts] == ["x:1", "x:2"] and [t.meta["row"] for t in ts] == [1, 2]


def test_malformed_csv_names_file_and_row(tmp_path):
    path = write(tmp_path / "bam.csv", "Question,Answer\nq1,a1\nq2,\nq3,a3\n")
    # the hint is the command-line spelling (issue 13, item 6)
    with pytest.raises(DataError, match=r"bam\.csv: row 2: field 'Answer' must be a non-empty string, got '' "
                                        r"\(data\.skip_bad_rows=true skips bad rows\)"):
        load_file(path)
    ts = load_file(path, skip_bad_rows=True)
    assert [t.question for t in ts] == ["q1", "q3"] and ts.skipped == 1
    assert ts.errors == [f"{path}: row 2: field 'Answer' must be a non-empty string, got ''"]
    path = write(tmp_path / "extra.csv", "Question,Answer\nq1,a1,oops\n")
    with pytest.raises(DataError, match=r"extra\.csv: row 1: more fields than the 2 of the header"):
        load_file(path)


def test_malformed_jsonl_rows(tmp_path):
    path = write(tmp_path / "m.jsonl", '{"question": "q1", "answer": "a"}\n\n{"question": "q2", "answer"\n'
                                       '{"question": "q3"}\n{"question": "q4", "answer": ["x"]}\n')
    with pytest.raises(DataError, match=r"m\.jsonl: row 3: not valid JSON"):
        load_file(path)
    ts = load_file(path, skip_bad_rows=True)
    assert [t.question for t in ts] == ["q1"] and ts.skipped == 3
    assert "row 4: missing field 'answer'" in ts.errors[1]
    assert "row 5: field 'answer' must be a non-empty string" in ts.errors[2]  # layout is fixed by row 1


def test_duplicate_ids_and_empty_answers(tmp_path):
    path = jsonl(tmp_path / "d.jsonl", [{"id": "7", "question": "q", "golden_answers": ["a"]},
                                        {"id": "7", "question": "q", "golden_answers": ["b"]}])
    with pytest.raises(DataError, match=r"row 2: duplicate id '7' \(first at row 1\)"):
        load_file(path)
    path = jsonl(tmp_path / "e.jsonl", [{"question": "q", "golden_answers": ["", "  "]}])
    with pytest.raises(DataError, match="row 1: no non-empty answer"):
        load_file(path)
    path = jsonl(tmp_path / "f.jsonl", [{"question": "q", "golden_answers": [{"text": "a"}]}])
    with pytest.raises(DataError, match="non-string answer"):
        load_file(path)


def test_unknown_layouts_and_files(tmp_path):
    with pytest.raises(DataError, match=r"row 1: unknown layout, fields: \['prompt', 'target'\]"):
        load_file(jsonl(tmp_path / "u.jsonl", [{"prompt": "p", "target": "t"}]))
    with pytest.raises(DataError, match="missing.jsonl: file not found"):
        load_file(tmp_path / "missing.jsonl")
    with pytest.raises(DataError, match="unsupported file type"):
        load_file(write(tmp_path / "x.txt", "hi"))
    with pytest.raises(DataError, match="not valid JSON"):
        load_file(write(tmp_path / "bad.json", "[{"))
    with pytest.raises(DataError, match="expected a JSON list"):
        load_file(write(tmp_path / "obj.json", '{"a": 1}'))
    with pytest.raises(DataError, match="no tasks"):
        load_file(write(tmp_path / "empty.jsonl", "\n"))
    with pytest.raises(DataError, match="empty CSV"):
        load_file(write(tmp_path / "empty.csv", ""))
    with pytest.raises(DataError, match="metadata' is not a Python-literal dict"):
        load_file(write(tmp_path / "s.csv", 'metadata,problem,answer\n"{oops",q,a\n'))


def test_benchmark_names_and_folders(tmp_path, monkeypatch):
    with pytest.raises(DataError, match=r"unknown benchmark 'squad': expected 'synthetic\[:train\|:heldout\]', a benchmark name \(simpleqa"):
        load_benchmark("squad")
    (tmp_path / "bamboogle").mkdir()
    write(tmp_path / "bamboogle" / "test.csv", "Question,Answer\nq,a\n")
    assert len(load_benchmark("bamboogle", str(tmp_path))) == 1
    write(tmp_path / "bamboogle" / "dev.csv", "Question,Answer\nq,a\n")
    with pytest.raises(DataError, match="several data files .* dev.csv, test.csv"):
        find_benchmark_file("bamboogle", tmp_path)
    with pytest.raises(DataError, match="no data file"):
        find_benchmark_file("nq", tmp_path / "bamboogle" / "..")
    # no path, no data dir, no hub library: a clear error, no download attempt
    monkeypatch.delenv("L0_MIN_DATA", raising=False)
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    with pytest.raises(DataError, match="nq: no --data, data.data_dir or .L0_MIN_DATA given, and huggingface_hub is not "
                                        "installed to download it. Pass --data FILE"):
        load_benchmark("nq")
    with pytest.raises(DataError, match="unknown benchmark 'no-such-thing': expected 'synthetic"):
        load_tasks("no-such-thing")


def test_parquet_with_fake_pyarrow(tmp_path, monkeypatch):
    rows = [{"id": "p1", "question": "q", "golden_answers": ["a", "b"]}]
    pq = types.ModuleType("pyarrow.parquet")
    pq.read_table = lambda path: types.SimpleNamespace(to_pylist=lambda: rows)
    pa = types.ModuleType("pyarrow")
    pa.parquet = pq
    monkeypatch.setitem(sys.modules, "pyarrow", pa)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", pq)
    path = write(tmp_path / "x.parquet", "")
    ts = load_file(path)
    assert (ts[0].id, ts[0].answers) == ("p1", ["a", "b"])


def test_parquet_without_libraries_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(DataError, match=r"x\.parquet: reading parquet needs pyarrow"):
        load_file(write(tmp_path / "x.parquet", ""))


# ---------------------------------------------------------------------------------------------
# synthetic and corpora


def test_qa_env_synthetic_splits():
    from l0_min.config import Config
    from l0_min.envs.qa import QA

    cfg = Config(data=DataConfig(synthetic_seed=1, synthetic_tasks=80), envs={"qa": {"entities": 30}})
    env = QA(cfg)
    all_ = env.tasks("synthetic")
    train, held = env.tasks("synthetic:train"), env.tasks("synthetic:heldout")
    assert len(all_) == 80 and len(train) + len(held) == 80 and held
    assert {t.id for t in train} | {t.id for t in held} == {t.id for t in all_}
    assert not {t.id for t in train} & {t.id for t in held}
    assert len(env.tasks("synthetic", limit=5)) == 5
    assert corpus_from_tasks(held) == env.corpus(held) == make_world(1, 30).corpus  # the whole world's pages
    with pytest.raises(ValueError, match="synthetic:train or synthetic:heldout"):
        env.tasks("synthetic:dev")


def test_load_corpus_forms_and_errors(tmp_path):
    path = jsonl(tmp_path / "c.jsonl", [{"id": "d1", "title": "T", "text": "x"}, {"title": "U", "text": "y"},
                                        {"id": "9", "contents": '"Title"\nbody'},
                                        {"wikipedia_id": "12", "wikipedia_title": "K",
                                         "text": ["K\n", "one two three\n", "Section::::S.\n", "four\n"]}])
    docs = load_corpus(path, passage_words=3)
    assert docs == [{"id": "d1", "title": "T", "text": "x"}, {"id": "c:2", "title": "U", "text": "y"},
                    {"id": "9", "title": "Title", "text": "body"},
                    {"id": "12#0", "title": "K", "text": "one two three"}, {"id": "12#1", "title": "K", "text": "four"}]
    with pytest.raises(DataError, match=r"row 2: duplicate document id 'd1' \(first at row 1\)"):
        load_corpus(jsonl(tmp_path / "dup.jsonl", [{"id": "d1", "title": "T", "text": "x"}] * 2))
    with pytest.raises(DataError, match=r"bad\.jsonl: row 1: not a corpus row"):
        load_corpus(jsonl(tmp_path / "bad.jsonl", [{"question": "q"}]))
    with pytest.raises(DataError, match="row 1: KILT row"):
        load_corpus(jsonl(tmp_path / "k.jsonl", [{"wikipedia_title": "K", "text": "flat"}]))
    with pytest.raises(DataError, match="no documents"):
        load_corpus(write(tmp_path / "none.jsonl", "\n"))


# ---------------------------------------------------------------------------------------------
# issue 13: how users meet the loaders


def test_offline_without_data_fails_fast_with_one_actionable_line(tmp_path, monkeypatch):  # item 1
    calls = []

    def hf_hub_download(repo, filename, repo_type=None, local_files_only=False):
        calls.append((repo, filename, local_files_only))
        raise OSError("not in the cache") if local_files_only else AssertionError("no download attempt offline")

    hub = types.ModuleType("huggingface_hub")
    hub.hf_hub_download = hf_hub_download
    hub.constants = types.SimpleNamespace(HF_HUB_OFFLINE=False, ENDPOINT="http://127.0.0.1:9", HF_HUB_CACHE=str(tmp_path / "hub"))
    monkeypatch.setitem(sys.modules, "huggingface_hub", hub)
    monkeypatch.delenv("L0_MIN_DATA", raising=False)
    t0 = time.monotonic()
    with pytest.raises(DataError) as e:
        load_benchmark("simpleqa")  # the hub's port refuses: a fast probe says offline
    assert time.monotonic() - t0 < 5 and calls == [("basicv8vc/SimpleQA", "simple_qa_test_set.csv", True)]
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("benchmark simpleqa: no --data, data.data_dir or $L0_MIN_DATA given")
    for part in (f"not in the hub cache ({tmp_path / 'hub'})", "(http://127.0.0.1:9) is not reachable (offline)",
                 "Pass --data FILE", "set L0_MIN_DATA (or data.data_dir=DIR) to a folder holding simpleqa/simple_qa_test_set.csv",
                 "simple_qa_test_set.csv of the dataset basicv8vc/SimpleQA (https://huggingface.co/datasets/basicv8vc/SimpleQA)"):
        assert part in msg
    hub.constants.HF_HUB_OFFLINE = True  # HF_HUB_OFFLINE=1: not even a probe
    hub.constants.ENDPOINT = "http://unused.invalid"
    with pytest.raises(DataError, match="is not reachable"):
        load_tasks("nq")
    cached = write(tmp_path / "simple_qa_test_set.csv", "metadata,problem,answer\n,Who?,Ann\n")
    hub.hf_hub_download = lambda *a, **kw: str(cached)  # a file in the hub cache is used offline
    assert [t.answers for t in load_benchmark("simpleqa")] == [["Ann"]]


def test_non_utf8_bytes_name_file_and_row_and_skip_works(tmp_path):  # item 2
    files = {"bam.csv": b"Question,Answer\nq1,a1\nq2,caf\xe9\nq3,a3\n",
             "nq.jsonl": b'{"question": "q1", "answer": ["a1"]}\n{"question": "q2\xff", "answer": ["a"]}\n'
                         b'{"question": "q3", "answer": ["a3"]}\n',
             "hot.json": b'[{"question": "q1", "answer": "a1"}, {"question": "q2", "answer": "\xe9t\xe9"}, '
                         b'{"question": "q3", "answer": "a3"}]',
             "trivia.qa.tsv": b"q1\ta1\nq2\t\xe9\nq3\ta3\n"}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(DataError, match=rf"{name}: row 2: not UTF-8 text \(byte 0x(e9|ff)\): fix the encoding"):
            load_file(tmp_path / name)
        ts = load_file(tmp_path / name, skip_bad_rows=True)
        assert [t.question for t in ts] == ["q1", "q3"] and ts.skipped == 1, name
    gz = tmp_path / "nq2.jsonl.gz"
    gz.write_bytes(gzip.compress(files["nq.jsonl"]))
    assert [t.question for t in load_file(gz, skip_bad_rows=True)] == ["q1", "q3"]
    corpus = tmp_path / "docs.jsonl"
    corpus.write_bytes(b'{"id": "d1", "title": "T", "text": "x"}\n{"id": "d2", "title": "T", "text": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"docs\.jsonl: row 2: not UTF-8 text \(byte 0xe9\)"):
        load_corpus(corpus)


def test_answer_split_aliases(tmp_path):  # item 3
    ts = load_file(jsonl(tmp_path / "fr.jsonl", [{"id": "1", "question": "q", "golden_answers": ["Tokyo<|answer_split|>Tokio", "Edo"]}]))
    assert ts[0].answers == ["Tokyo", "Tokio", "Edo"]
    ts = load_file(jsonl(tmp_path / "r1.jsonl", [{"question": "q", "answer": "1999<|answer_split|> 1999 <|answer_split|>MCMXCIX"}]))
    assert ts[0].answers == ["1999", "MCMXCIX"]
    with pytest.raises(DataError, match="no non-empty answer"):
        load_file(jsonl(tmp_path / "e.jsonl", [{"question": "q", "answer": "<|answer_split|> "}]))


def test_mixed_file_keeps_each_rows_data_source(tmp_path):  # item 4
    rows = [{"id": "nq_1", "question": "q1", "golden_answers": ["a"], "data_source": "nq"},
            {"id": "bam_1", "question": "q2", "golden_answers": ["b"], "data_source": "Bamboogle"},
            {"id": "x_1", "question": "q3", "golden_answers": ["c"]}]
    ts = load_benchmark("searchr1-test", str(jsonl(tmp_path / "test.jsonl", rows)))
    assert [t.meta["benchmark"] for t in ts] == ["nq", "bamboogle", "searchr1-test"]


def test_corpus_and_folder_mistakes_point_to_the_right_setting(tmp_path):  # item 6
    corpus = jsonl(tmp_path / "wiki.jsonl", [{"id": "d1", "title": "T", "text": "x"}])
    with pytest.raises(DataError, match=rf"wiki\.jsonl: a corpus \(documents with a title and text\), not questions: "
                                        rf"pass it as tools.corpus={corpus}$"):
        load_benchmark("nq", str(corpus), skip_bad_rows=True)
    with pytest.raises(DataError, match="a corpus"):
        load_file(jsonl(tmp_path / "kilt.jsonl", [{"wikipedia_title": "K", "text": ["K"]}]))
    with pytest.raises(DataError, match=rf"{tmp_path}: a folder, expected a file"):
        load_corpus(tmp_path)
