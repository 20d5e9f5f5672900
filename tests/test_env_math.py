"""The math environment (l0_min/envs/math.py): the numeric grader, the seeded generator and its held-out split,
GSM8K files, the score, and the expert solving tasks through the real kernels."""

import json
import os
import re
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest

from l0_min import config as configlib
from l0_min.envs import load_env
from l0_min.answers import numbers_equal, parse_number
from l0_min.envs.math import KINDS, calc, expert_actions, make_tasks, number_text
from l0_min.episode import Episode

ROOT = Path(__file__).resolve().parents[1]
GSM8K = ROOT.parent / "shared" / "data" / "benchmarks" / "gsm8k" / "test.jsonl"


def env(*overrides):
    return load_env("math", configlib.resolve(["env=math", *overrides]))


def submitted(action: str) -> str:
    """What an action's code submits when Python runs it (the kernel's submit_final_answer stubbed)."""
    got = []
    exec(action.split("<code>")[1].removesuffix("</code>"),  # noqa: S102 (the expert's own code)
         {"submit_final_answer": lambda a: got.append(str(a)), "print": lambda *a: None})
    return got[0]


# ---------------------------------------------------------------------------------------------- the grader


@pytest.mark.parametrize("answer, number", [
    ("42", Fraction(42)), ("-7", Fraction(-7)), ("+3", Fraction(3)), ("1,234,567", Fraction(1234567)),
    ("$1,200.50", Fraction(240100, 200)), ("0.25", Fraction(1, 4)), (".5", Fraction(1, 2)), ("3/4", Fraction(3, 4)),
    ("3 / 4 cups", Fraction(3, 4)), ("75%", Fraction(75)), ("18 apples.", Fraction(18)), ("−5", Fraction(-5)),
    ("The answer is 1,000 dollars", Fraction(1000)), ("1e3", 1000.0), ("2.5E-1", 0.25),
    ("x = 12, so 12", Fraction(12)),  # the same number twice is one number
    ("12 or 13", None), ("1/0", None), ("no idea", None), ("", None), (None, None), ("1,23", None),
])  # fmt: skip
def test_parse_number_reads_the_one_number_an_answer_states(answer, number):
    got = parse_number(answer)
    assert got == number and type(got) is type(number), (answer, got)


def test_numbers_equal_is_exact_for_exact_numbers_and_tolerant_for_floats():
    assert numbers_equal("1200", "1,200") and numbers_equal("$18.00", "18") and numbers_equal("0.75", "3/4")
    assert numbers_equal("36.0", "36") and numbers_equal("-4", "−4")
    assert not numbers_equal("19", "18") and not numbers_equal("18.01", "18") and not numbers_equal("0.33", "1/3")
    # rel_tol 1e-6: a rounded repeating decimal, and Python's float error in 19.99 * 3 = 59.97000000000001
    assert numbers_equal("3.3333333", "10/3") and numbers_equal(str(19.99 * 3), "59.97")
    assert not numbers_equal("3.33", "10/3")  # 1e-3 relative off: a wrong answer, not a rounding
    assert not numbers_equal(None, "1") and not numbers_equal("", "1") and not numbers_equal("1", "one")


def test_calc_is_exact_and_evaluates_arithmetic_only():
    assert calc("0.1 + 0.2") == Fraction(3, 10) and calc("(12 + 30) / 4") == Fraction(21, 2)
    assert calc("05 * 1.05") == Fraction(21, 4) and calc("12 x 4") == 48 and calc("$1,000 − 1") == 999
    for bad in ("2 ** 9999", "__import__('os')", "1 +", "1/0", "(1", "a * 2", "1" * 400):
        assert calc(bad) is None, bad
    texts = [number_text(Fraction(n, d)) for n, d in ((7, 1), (-7, 4), (1, 3), (1, 1000))]
    assert texts == ["7", "-1.75", "1/3", "0.001"]


# ------------------------------------------------------------------------------------------- the generator


def test_generator_is_seeded_varied_and_its_answers_recompute():
    a, b = make_tasks(3, 300), make_tasks(3, 300)
    assert [(t.id, t.question, t.answers) for t in a] == [(t.id, t.question, t.answers) for t in b]
    assert make_tasks(3, 20) == a[:20] and make_tasks(4, 20)[0].question != a[0].question
    assert a[1].id == "math3-0001" and len({t.question for t in a}) == 300
    assert {t.meta["kind"] for t in a} == set(KINDS) and 10 <= len(KINDS) <= 14
    assert len({t.question.split()[0] for t in a}) >= 10  # varied names and openings
    big = 0
    for t in a:
        value = eval(t.meta["expr"])  # recomputed in floats: the gold is that number, to the cent
        assert abs(value - float(t.answers[0])) < 1e-9 and re.fullmatch(r"\d+(\.\d\d?)?", t.answers[0]), t.meta
        operands = [float(n) for n in re.findall(r"\d+(?:\.\d+)?", t.meta["expr"])]
        assert all(n in (3, 100) or f"{n:g}" in t.question.replace(",", "") for n in operands), t.question
        assert max(operands) >= 20, t.question  # 2-3 digit numbers: easy with code, hard in the head
        big += max(operands) >= 100
    assert big >= 0.7 * len(a)


def test_synthetic_split_is_disjoint_stable_and_filters_kinds():
    e = env("data.synthetic_tasks=400", "data.synthetic_heldout=0.25", "data.synthetic_seed=2")
    train, held, every = e.tasks("synthetic:train"), e.tasks("synthetic:heldout"), e.tasks("synthetic")
    assert len(train) + len(held) == len(every) == 400 and not {t.id for t in train} & {t.id for t in held}
    assert 60 <= len(held) <= 140  # 25% of 400 by a hash of the id
    assert not {t.question for t in train} & {t.question for t in held}
    more = env("data.synthetic_tasks=800", "data.synthetic_heldout=0.25", "data.synthetic_seed=2")
    more = more.tasks("synthetic:heldout")
    assert {t.id for t in held} <= {t.id for t in more}  # more tasks keep the held-out ones held out
    only = env("data.synthetic_kinds=[share,percent]").tasks("synthetic:train", limit=10)
    assert len(only) == 10 and {t.meta["kind"] for t in only} == {"share", "percent"}
    with pytest.raises(ValueError, match="synthetic:heldout"):
        e.tasks("synthetic:test")


def test_score_is_0_9_correct_plus_0_1_answered():
    e, t = env(), make_tasks(0, 1)[0]

    def score(answer):
        return e.score(Episode(t, final_answer=answer))

    assert score(t.answers[0]) == {"core": 1.0, "correct": 1.0}
    assert score(f"{t.answers[0]}.0 stamps") == {"core": 1.0, "correct": 1.0}
    assert score("12") == {"core": pytest.approx(0.1), "correct": 0.0}  # 0.1: answered
    assert score(None) == {"core": 0.0, "correct": 0.0}
    halves = env("reward.em_weight=0.5", "reward.has_answer_weight=0.5")
    assert halves.score(Episode(t, final_answer="1"))["core"] == 0.5
    assert e.metrics == ("correct",) and e.tools == () and e.name == "math"


def test_expert_states_the_numbers_and_computes_in_code():
    for t in make_tasks(1, 60):
        (action,) = expert_actions(t)
        think = action.split("</think>")[0]
        assert think.startswith("<think>The question gives ") and think.endswith(f"{t.meta['expr']}.")
        assert numbers_equal(submitted(action), t.answers[0]), (t.question, action)


# ------------------------------------------------------------------------------------------------ GSM8K


def test_gsm8k_file_loads_and_its_expert_runs_the_annotations(tmp_path):
    rows = [{"question": "Janet's ducks lay 16 eggs a day. She eats 3 and sells the rest at $2 each. Dollars a day?",
             "answer": "She sells 16 - 3 = <<16-3=13>>13 eggs.\nShe makes 13 * 2 = $<<13*2=26>>26.\n#### 26"},
            {"question": "A tank holds 1,200 liters and loses 45 a day. How much is left after 4 days?",
             "answer": "It loses 45 * 4 = <<45*4=180>>180 liters.\nSo 1,200 - 180 = 1,020 liters are left.\n"
                       "#### 1,020"},
            {"question": "Sam has 5 apples and eats 2. How many are left?",
             "answer": "He has 5 + 2 = <<5+2=7>>7 left.\n#### 3"}]  # a solution that does not compute the gold: no demo
    path = tmp_path / "grade.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tasks = env().tasks(str(path))
    assert [t.answers for t in tasks] == [["26"], ["1020"], ["3"]] and tasks[0].id == "grade:1"
    assert tasks[1].meta["solution"].endswith("1,020 liters are left.")
    assert expert_actions(tasks[0]) == [("<think>The question gives 16, 3, 2. I compute 16-3, then 13*2.</think>\n"
                                         "<code>print(16-3)\nanswer = 13*2\nsubmit_final_answer(answer)</code>")]
    assert "answer = 1200 - 180\n" in expert_actions(tasks[1])[0]  # the unannotated last step
    assert expert_actions(tasks[2]) is None
    (tmp_path / "words.jsonl").write_text('{"question": "Capital of France?", "answer": "Paris"}\n')
    with pytest.raises(ValueError, match=r"words.jsonl: row 1: the gold answer 'Paris' is not a number"):
        env().tasks(str(tmp_path / "words.jsonl"))


@pytest.mark.skipif(not GSM8K.is_file(), reason=f"no shared GSM8K test file at {GSM8K}")
def test_shared_gsm8k_golds_parse_and_the_expert_solves_95_percent():
    tasks = env().tasks(str(GSM8K))
    assert len(tasks) == 1319 and all(parse_number(t.answers[0]) is not None for t in tasks)
    solved = [t for t in tasks if expert_actions(t) is not None]
    # 1257 of 1319 (95.3%): the rest state their last step in words or algebra ("x = 18"), not arithmetic
    assert len(solved) >= 0.95 * len(tasks), len(solved)
    for t in solved[:200]:  # its code gives the gold when Python runs it
        assert numbers_equal(submitted(expert_actions(t)[0]), t.answers[0]), t.id


# ---------------------------------------------------------------------------- through the real kernels

PROBE = '''
from l0_min.envs.math import Math


class Probe(Math):  # the math environment; its expert first looks at which host tools the kernel has
    def expert(self, task):
        look = ("<think>Which host tools does this kernel have?</think>\\n<code>import sys\\n"
                "print([n for n in ('web_search', 'read_page', 'submit_final_answer') if n in globals()])\\n"
                "sys.modules[submit_final_answer.__module__].web_search('x')</code>")
        return [look] + super().expert(task)


def make_env(cfg):
    return Probe(cfg)
'''


@pytest.mark.slow
def test_rollout_expert_solves_math_tasks_through_the_real_kernels_without_search(tmp_path):
    """`rollout.py env=math --expert`: every task answered right in one step of real kernel output; the
    kernel has no web_search / read_page, and the tool server refuses a call made around the namespace."""
    args = ["rollout.py", "--expert", "--data", "synthetic:train", "--limit", "4", "--model", "tiny-random",
            "--out", str(tmp_path / "math"), "env=math", "kernel.pool_size=2"]  # fmt: skip
    p = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    eps = [json.loads(line) for line in (tmp_path / "math" / "trajectories.jsonl").read_text().splitlines()]
    assert len(eps) == 4 and all(e["rewards"]["correct"] == 1.0 and len(e["steps"]) == 1 for e in eps)
    assert all(e["steps"][0]["observation"].startswith(f"<output>\nFinal answer submitted: {e['final_answer']}\n")
               for e in eps)  # the kernel's own output: the answer was computed there
    (tmp_path / "probe_env.py").write_text(PROBE)
    args = ["rollout.py", "--expert", "--data", "synthetic:train", "--limit", "1", "--model", "tiny-random",
            "--out", str(tmp_path / "probe"), "env=probe_env", "kernel.pool_size=1"]  # fmt: skip
    p = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": f"{tmp_path}:{ROOT}"})
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    (ep,) = [json.loads(line) for line in (tmp_path / "probe" / "trajectories.jsonl").read_text().splitlines()]
    seen = ep["steps"][0]["observation"]
    assert "['submit_final_answer']" in seen and "web_search is not available in this task" in seen, seen
    assert ep["rewards"]["correct"] == 1.0 and len(ep["steps"]) == 2


@pytest.mark.slow
def test_cpu_math_recipe_runs_end_to_end_on_the_tiny_model(tmp_path):
    """configs/cpu_math.yaml through `bench/agent_learns.py --env math --quick` (train.py: evaluate, SFT on the
    math expert's episodes, RL, evaluate; tiny-random: the machinery, not learning)."""
    p = subprocess.run([sys.executable, "bench/agent_learns.py", "--env", "math", "--quick", f"run.out_dir={tmp_path}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    assert "SFT: 8 expert episodes of 8 tasks" in p.stdout, p.stdout[-3000:]
    assert "RESULT rl_gain_sampled=" in p.stdout and "RESULT rl_gain_greedy=" in p.stdout
