"""The task-environment seam (l0_min/envs): loading by name or module path, sources and their weights, the
hidden setup cell, tools a task does not get, and the fork story: the README's own environment file trained
through train.py on the tiny model, and a mixed run of several environments."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from l0_min import config as configlib
from l0_min.collect import TaskStream
from l0_min.collect import setup_cells
from l0_min.envs import load_env, load_sources
from tests.test_train import ROOT, _env

README_ENV = re.search(r"### Write your own environment.*?```python\n(.*?)```", (ROOT / "README.md").read_text(),
                       re.S).group(1)


def test_the_readme_environment_is_one_short_file():
    assert README_ENV.startswith('"""letters_env.py') and len(README_ENV.splitlines()) <= 80


def test_load_env_by_name_or_module_path_with_one_line_errors(tmp_path, monkeypatch):
    cfg = configlib.Config()
    assert load_env("qa", cfg).metrics[0] == "em" and load_env("qa", cfg).tools == ("web_search", "read_page")
    (tmp_path / "letters_env.py").write_text(README_ENV)
    (tmp_path / "no_factory.py").write_text("x = 1\n")
    (tmp_path / "bad_tools.py").write_text(README_ENV.replace('metrics = ("correct",)', 'tools = ("shell",)'))
    monkeypatch.syspath_prepend(str(tmp_path))
    env = load_env("letters_env", configlib.resolve(["env=letters_env", "agent.system_prompt=Be brief."]))
    assert env.name == "letters_env" and env.system_prompt == "Be brief."  # the run's own env takes the override
    assert load_env("qa", configlib.resolve(["env=letters_env", "agent.system_prompt=Be brief."])).system_prompt != "Be brief."
    for spec, message in (("no_such_env", "no module 'no_such_env'"), ("no_factory", "defines no make_env"),
                          ("bad_tools", "unknown host tools ['shell']")):
        with pytest.raises(ValueError, match=re.escape(message)):
            load_env(spec, cfg)


def test_sources_carry_their_environment_and_weights(tmp_path, monkeypatch):
    (tmp_path / "letters_env.py").write_text(README_ENV)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = configlib.resolve(["data.train=[{source: synthetic:train}, {source: 'words:train', env: letters_env, weight: 3}]",
                             "data.synthetic_tasks=40", "envs.qa.entities=20"])
    parts, weights, envs = load_sources(cfg.data.train, cfg)
    assert sorted(envs) == ["letters_env", "qa"] and weights == [1.0, 3.0]
    assert {t.env for t in parts[0]} == {"qa"} and {t.env for t in parts[1]} == {"letters_env"}
    stream = TaskStream(parts, weights, seed=1)
    drawn = [stream.next().env for _ in range(400)]
    assert 0.68 < drawn.count("letters_env") / 400 < 0.82  # 3:1, and binomial sd 0.022 at n = 400
    only, _, _ = load_sources(configlib.resolve(["data.train=[{source: synthetic:train, kinds: [lookup]}]"]).data.train,
                              cfg, limit=5)
    assert len(only[0]) == 5 and {t.meta["kind"] for t in only[0]} == {"lookup"}  # a source keeps its own kinds
    sft_only = configlib.resolve(["data.train=[{source: synthetic:train}, {source: 'words:train', env: letters_env, "
                                  "weight: 0, sft_weight: 1}]"]).data.train
    parts, weights, _ = load_sources(sft_only, cfg)  # weight 0: SFT episodes only, never an RL task
    stream = TaskStream(parts, weights, seed=2)
    assert weights == [1.0, 0.0] and {stream.next().env for _ in range(200)} == {"qa"}
    for bad, message in (("{source: 'words:train', env: letters_env, weight: 0}", "one > 0; got 0.0, -1.0"),
                         ("{source: 'words:train', env: letters_env, sft_weight: -2}", "must be >= 0 (sft_weight -1: the "),
                         ("{source: 'words:train', env: letters_env, weight: -1, sft_weight: 1}", "got -1.0, 1.0"),
                         ("{source: 'words:train', env: letters_env, weight: 0, sft_weight: 1}", "no source has weight > 0"),
                         ("{source: /no/such/file.jsonl}", "qa source '/no/such/file.jsonl'")):
        with pytest.raises(ValueError, match=re.escape(message)):
            load_sources(configlib.resolve([f"data.train=[{bad}]"]).data.train, cfg)


def test_setup_cells_write_files_in_pieces_and_drop_tools_and_refuse_odd_paths(tmp_path, monkeypatch):
    """Issue 37: a workspace over the kernel's 2 MiB message cap is written in cells of at most SETUP_CHUNK
    characters (one cell stalled to kernel.exec_timeout before); a name over 255 bytes is refused with that
    reason (the error's echo of the file cut the cause off)."""
    from l0_min.collect import SETUP_CHUNK
    from l0_min.sandbox.kernel import MAX_FRAME

    monkeypatch.chdir(tmp_path)
    ns = {"web_search": 1, "read_page": 2}
    for cell in setup_cells({"logs/app.log": "a\nb\n", "x.csv": "q,'\"\\n"}, ("web_search",)):
        exec(cell, ns)
    assert (tmp_path / "logs/app.log").read_text() == "a\nb\n" and (tmp_path / "x.csv").read_text() == "q,'\"\\n"
    assert "web_search" not in ns and ns["read_page"] == 2 and "_l0_write" not in ns
    big = {"data/big.txt": "0123456789\n" * 300_000, "small.txt": "s", "u.txt": "\u2028" * SETUP_CHUNK}  # 3.5 MB
    cells = setup_cells(big)
    assert len(cells) == 18 and max(len(json.dumps(c)) for c in cells) < MAX_FRAME  # the echo of the worst one fits
    ns = {}  # one kernel namespace across the cells
    for cell in cells:
        exec(cell, ns)
    assert all((tmp_path / p).read_text() == text for p, text in big.items())
    assert setup_cells({}, ("read_page",)) == ["del read_page"] and setup_cells({}) == []
    for bad in ("/etc/passwd", "../up.txt", "a/../../b", "a b.txt", "", ".", "a/./b", "./x"):  # '.': issue 44
        with pytest.raises(ValueError, match="not a relative path"):
            setup_cells({bad: "x"})
    with pytest.raises(ValueError, match=r"setup: workspace file name 'aaaa.*'... is 256 bytes \(at most 255\)"):
        setup_cells({"d/" + "a" * 256: "x"})


def hostile_answers() -> list[str]:
    """Answers a grader must survive: integers past float's range and past int's 4,300 digits, inf and nan
    spelled every way, 10^5 characters of fractions and of blank space, unicode digits, lone surrogates, NUL,
    then seeded random strings over digits and the characters numbers are written with."""
    import random

    fixed = ["1" * 400, "-" + "9" * 309, "9" * 4301, "1" * 100_000, "1e999", "-1e999", "1e-999", "nan", "NaN", "inf",
             "-inf", "Infinity", "-0", "+0.0", "0/0", "1/0", "1/3 " * 25_000, "1" * 400 + "/" + "3" * 400,
             " " * 100_000 + "1/", "1" + " " * 100_000 + "x", "٤٢", "４２", "²³", "১২৩/৪", "\ud800", "4\x002",
             "1,000,000," * 10_000, "." * 100_000, "$" + "9" * 2000 + ".5", "", "   ", None]
    rng = random.Random(0)
    return fixed + ["".join(rng.choice("0123456789 ./,-+eE$%٣") for _ in range(rng.randrange(1, 3000)))
                    for _ in range(50)]


def test_property_no_answer_makes_a_built_in_environment_score_raise():
    """Issue 34: submit_final_answer("1" * 400) made math's grader raise OverflowError and ended the run. Every
    built-in environment scores every hostile answer: no exception, core in [0, 1], each within a second of this
    process's CPU time (a guard against a grader's quadratic or exponential path, not a speed target: CPU time, so
    other work on the machine does not count)."""
    import time

    from l0_min.envs.files import make_tasks as file_tasks
    from l0_min.episode import Episode, Task

    tasks = {"qa": [Task("q", "Capital?", ["Paris", "42", "A+"])],
             "math": [Task("m", "?", [g], env="math") for g in ("42", "-1/3", "0")],
             "files": list({t.meta["kind"]: t for t in file_tasks(0, 12)}.values())}  # one of each kind
    for name, ts in tasks.items():
        env = load_env(name, configlib.resolve([f"env={name}"]))
        for t in ts:
            for answer in hostile_answers():
                t0 = time.process_time()
                core = env.score(Episode(t, final_answer=answer))["core"]
                assert 0.0 <= core <= 1.0 and time.process_time() - t0 < 1.0, (name, t.answers, str(answer)[:40], core)


@pytest.mark.slow
def test_a_new_environment_from_the_readme_trains_through_train_py_mixed_with_qa(tmp_path):
    """The fork story: the README's environment file, named by module path, in one run with QA: SFT on both
    experts through the real kernels (the letters' workspace file written by the setup cell, QA's searches
    answered by the tool server), RL steps whose batches mix them, held-out numbers per environment."""
    (tmp_path / "letters_env.py").write_text(README_ENV)
    args = ["data.train=[{source: synthetic:train}, {source: 'words:train', env: letters_env, sft_weight: 3}]",
            "data.eval=[{source: synthetic:heldout}, {source: 'words:heldout', env: letters_env}]",
            "data.synthetic_kinds=[lookup]", "data.eval_limit=3", "run.eval_every=0", "sft.episodes=8", "sft.steps=2",
            "run.steps=2", "rollout.batch_size=4", f"run.out_dir={tmp_path / 'runs'}"]
    env = _env() | {"PYTHONPATH": str(tmp_path)}
    p = subprocess.run([sys.executable, "train.py", "--config", "configs/tiny_test.yaml", *args], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "SFT: 8 expert episodes of 8 tasks" in p.stdout, p.stdout[-3000:]  # every expert episode solved its task
    for name in ("qa", "letters_env"):
        assert f"eval @ step 4 (sampled, {name}): " in p.stdout and f"RL phase (sampled, {name}): held-out" in p.stdout
    assert "eval @ step 4 (sampled): solved " in p.stdout and "RL phase (sampled, all): held-out solved" in p.stdout
    header = next(line for line in p.stdout.splitlines() if line.lstrip().startswith("step  reward"))
    assert header.split()[2:4] == ["letters_env", "qa"], header  # one headline column per environment
    run = Path(p.stdout.split("run folder: ")[1].split()[0])
    run = run if run.is_absolute() else ROOT / run
    read = lambda name: [json.loads(line) for line in (run / "trajectories" / name).read_text().splitlines()]
    demos = read("sft_00000.jsonl")
    assert {d["task"]["env"] for d in demos} == {"qa", "letters_env"} and all(d["rewards"]["core"] == 1.0 for d in demos)
    letters = [d for d in demos if d["task"]["env"] == "letters_env"]
    assert len(letters) == 6  # sft_weight 3 : 1 of sft.episodes = 8 (the stream's weights stay 1 : 1)
    assert all("Final answer submitted: " + d["task"]["answers"][0] in d["steps"][0]["observation"] for d in letters)
    for step in (3, 4):
        eps = read(f"step_{step:05d}.jsonl")
        groups = {}
        for e in eps:
            groups.setdefault(e["group"], set()).add((e["task"]["id"], e["task"]["env"]))
        assert all(len(g) == 1 for g in groups.values())  # a group is the samples of one task
    metrics = {m["step"]: m for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
    assert "eval/letters_env/score" in metrics[4] and "eval/qa/score" in metrics[4] and "eval/score" in metrics[4]
