"""Math word problems solved with code: the answer is a number, graded by numeric equivalence (0.9 * correct
+ 0.1 for answering). No search tools: the kernel is a calculator the agent must think to use.

    env = make_env(cfg)
    env.tasks("synthetic:train")   # the seeded generator below (data.synthetic_*), or "synthetic:heldout"
    env.tasks("gsm8k")             # GSM8K by name, or any file of {question, answer: "<solution>\n#### 42"}

The generator draws word problems of 1-3 operations on 2-3 digit numbers (sums, differences, products,
equal shares, unit prices, change, rates, percentages, discounts, averages, fractions of a whole): easy
with code, hard in the head for a small model. Each task's meta keeps `kind` (its template), `expr` (the
Python expression of the answer) and `plan` (a sentence: the numbers the question gives and what to
compute), from which the expert writes its one step. GSM8K's expert runs the solution's <<a*b=c>>
annotations (and the plain equations after the last one) as Python.

    >>> t = make_tasks(seed=0, n=50)[2]
    >>> t.question
    'A lamp costs $261. It is on sale at 35% off. What is the sale price in dollars?'
    >>> t.id, t.answers, t.meta["kind"], t.meta["expr"]
    ('math0-0002', ['169.65'], 'discount', '261 - 261 * 35 / 100')
"""

from __future__ import annotations

import random
import re
from fractions import Fraction

from l0_min import data
from l0_min.answers import answer_reward, numbers_equal, parse_number
from l0_min.envs import TaskEnvBase
from l0_min.episode import Episode, Task

# ------------------------------------------------------------------- exact arithmetic on expressions


def _clean(expr: str) -> str:
    """An arithmetic expression as Python writes it: no "$" or thousands commas, "x" / "×" as "*"."""
    e = expr.replace(",", "").replace("$", "").replace("×", "*").replace("x", "*").replace("−", "-")
    return re.sub(r"(?<![\d.])0+(\d)", r"\1", e).strip()  # "05" -> "5" (a syntax error in Python 3)


def calc(expr: str) -> Fraction | None:
    """The exact value of an arithmetic expression (numbers, + - * / and parentheses), else None. Nothing
    else gets to eval: a data file's expression cannot run code or raise a power.

    >>> calc("16-3-4"), calc("$80,000*1.5"), calc("3/5*700"), calc("1/0"), calc("2**99"), calc("open('x')")
    (Fraction(9, 1), Fraction(120000, 1), Fraction(420, 1), None, None, None)
    """
    e = _clean(expr)
    if len(e) > 300 or "**" in e or not re.fullmatch(r"[\d.+\-*/()\s]+", e):
        return None
    try:
        exact = re.sub(r"\d*\.?\d+", lambda m: f"F('{m.group()}')", e)  # every number a Fraction
        return Fraction(eval(exact, {"__builtins__": {}, "F": Fraction}))
    except (SyntaxError, ZeroDivisionError, ValueError, TypeError):
        return None


def number_text(v: Fraction) -> str:
    """An exact number as an answer is written: "42", "3.45", or "1/3" when no decimal ends.

    >>> number_text(Fraction(42)), number_text(Fraction(69, 20)), number_text(Fraction(-1, 3))
    ('42', '3.45', '-1/3')
    """
    k = next((k for k in range(64) if (v * 10**k).denominator == 1), None)  # decimal places, if it ends
    if k is None:
        return f"{v.numerator}/{v.denominator}"
    n = abs(v.numerator * 10**k // v.denominator)
    return ("-" if v < 0 else "") + (f"{n // 10**k}.{n % 10**k:0{k}d}" if k else str(n))


# --------------------------------------------------------------------------------- the generator

_NAMES = ["Ava", "Ben", "Chloe", "Dev", "Elena", "Farid", "Grace", "Hugo", "Ines", "Jonas", "Kira", "Liam", "Maya",
          "Noah", "Omar", "Priya", "Rosa", "Sam", "Tariq", "Yuki"]
_THINGS = ["pencil", "sticker", "marble", "cookie", "stamp", "card", "bottle", "book", "egg", "shell", "bead",
           "candle", "ticket", "brick", "balloon", "button"]
_GOODS = ["notebook", "ticket", "mug", "lamp", "towel", "plant", "game", "kite", "puzzle", "backpack"]
_WHOLES = [("A farm has {} animals", "are sheep", "animals are not sheep"),
           ("A school has {} students", "walk to school", "students do not walk to school"),
           ("A library has {} books", "are novels", "books are not novels"),
           ("A garden has {} flowers", "are roses", "flowers are not roses")]


def _templates(r: random.Random, who: str, thing: str, good: str) -> dict:
    """Template name -> a function drawing (question, what the question gives, what to compute, expression)."""
    R = r.randint

    def sum_():
        a, b = R(120, 899), R(45, 699)
        return (f"{who} has {a} {thing}s and buys {b} more. How many {thing}s does {who} have now?",
                f"{a} {thing}s and {b} more", "The total is", f"{a} + {b}")

    def difference():
        a = R(300, 999)
        b = R(101, a - 50)
        return (f"A shop has {a} {thing}s and sells {b} of them. How many {thing}s are left?",
                f"{a} {thing}s, {b} sold", "What is left is", f"{a} - {b}")

    def product():
        a, b = R(12, 98), R(13, 99)
        return (f"{who} fills {a} boxes with {b} {thing}s in each box. How many {thing}s is that in total?",
                f"{a} boxes of {b} {thing}s", "The total is", f"{a} * {b}")

    def share():
        k, each = R(4, 19), R(13, 97)
        return (f"{who} shares {k * each} {thing}s equally among {k} friends. How many {thing}s does each friend get?",
                f"{k * each} {thing}s for {k} friends", "Each gets", f"{k * each} / {k}")

    def unit_price():
        n, cents = R(12, 36), R(105, 1995)
        total = number_text(Fraction(n * cents, 100))
        return (f"{who} pays ${total} for {n} {good}s. What does one {good} cost, in dollars?",
                f"${total} for {n} {good}s", "One costs", f"{total} / {n}")

    def change():
        n, p = R(6, 19), R(12, 49)
        bill = (n * p // 100 + 1) * 100
        ask = f"How many dollars of change does {who} get?"
        return (f"{who} buys {n} {good}s at ${p} each and pays with ${bill}. {ask}",
                f"{n} {good}s at ${p}, paid with ${bill}", "The change is", f"{bill} - {n} * {p}")

    def rate():
        s, t = R(35, 95), R(3, 12)
        return (f"A train travels {s * t} km at {s} km per hour. How many hours does the trip take?",
                f"{s * t} km at {s} km per hour", "The time is", f"{s * t} / {s}")

    def work():
        a, h = R(24, 180), R(6, 40)
        return (f"A machine makes {a} {thing}s per hour. How many {thing}s does it make in {h} hours?",
                f"{a} {thing}s per hour for {h} hours", "The total is", f"{a} * {h}")

    def percent():
        a, p = R(120, 980), R(1, 9) * 5
        return (f"{who} earns ${a} and saves {p}% of it. How many dollars does {who} save?",
                f"${a} and {p}%", "The savings are", f"{a} * {p} / 100")

    def discount():
        a, p = R(40, 600), R(2, 8) * 5
        return (f"A {good} costs ${a}. It is on sale at {p}% off. What is the sale price in dollars?",
                f"${a} and {p}% off", "The sale price is", f"{a} - {a} * {p} / 100")

    def average():
        a, b, c = R(60, 300), R(60, 300), R(60, 297)
        c += -(a + b + c) % 3
        return (f"{who} scores {a}, {b} and {c} points in three games. What is the average score per game?",
                f"{a}, {b} and {c} points in 3 games", "The average is", f"({a} + {b} + {c}) / 3")

    def fraction():
        d = r.choice([3, 4, 5, 6, 8])
        k, n = R(1, d - 1), d * R(15, 120)
        whole, part, rest = r.choice(_WHOLES)
        return (f"{whole.format(n)} and {k}/{d} of them {part}. How many {rest}?",
                f"{n} in all and {k}/{d} of them", "The rest is", f"{n} - {n} * {k} / {d}")

    def packs():
        a, b, c = R(12, 60), R(12, 48), R(5, 95)
        return (f"{who} buys {a} packs of {b} {thing}s and {c} single {thing}s. How many {thing}s does {who} buy?",
                f"{a} packs of {b} and {c} single {thing}s", "The total is", f"{a} * {b} + {c}")

    def restock():
        a = R(200, 900)
        b, c = R(50, a - 50), R(40, 400)
        return (f"A store has {a} {thing}s. It sells {b} and gets {c} more. How many {thing}s does it have now?",
                f"{a} {thing}s, {b} sold and {c} more", "Now it has", f"{a} - {b} + {c}")

    return {"sum": sum_, "difference": difference, "product": product, "share": share, "unit_price": unit_price,
            "change": change, "rate": rate, "work": work, "percent": percent, "discount": discount,
            "average": average, "fraction": fraction, "packs": packs, "restock": restock}


KINDS = tuple(_templates(random.Random(0), "", "", ""))


def make_tasks(seed: int = 0, n: int = 256) -> list[Task]:
    """`n` distinct word problems, the same for the same seed (the first k do not depend on n); a uniform
    draw over the templates. meta: kind (the template), expr (the answer's Python expression), plan."""
    r = random.Random(f"l0-math-{seed}")
    tasks, seen = [], set()
    for _ in range(50 * n + 100):
        if len(tasks) == n:
            break
        draw = _templates(r, r.choice(_NAMES), r.choice(_THINGS), r.choice(_GOODS))
        kind = r.choice(KINDS)
        question, given, what, expr = draw[kind]()
        if question in seen:
            continue
        seen.add(question)
        meta = {"kind": kind, "expr": expr, "plan": f"The question gives {given}. {what} {expr}.", "seed": seed,
                "source": "math-synthetic"}
        tasks.append(Task(f"math{seed}-{len(tasks):04d}", question, [number_text(calc(expr))], meta, env="math"))
    if len(tasks) < n:
        raise ValueError(f"make_tasks(seed={seed}): only {len(tasks)} distinct problems, {n} asked")
    return tasks


# ------------------------------------------------------------------ the expert: compute in code, submit

_ANNOTATION = re.compile(r"<<([^<>=]*)=[^<>]*>>")  # GSM8K's calculator annotations: <<16-3-4=9>>
_TERM = r"[($\s]*\d+(?:\.\d+)?[)\s]*"
_EQUATION = re.compile(rf"((?:{_TERM}[-+*/x×−])+{_TERM})=")  # a plain "9 * 2 = 18" in a solution's text


def solution_steps(solution: str) -> list[str]:
    """The calculations of a GSM8K worked solution, in order, as Python: its <<a*b=c>> annotations, then the
    plain equations written after the last one (a final step left unannotated). Those that do not compute go.

    >>> solution_steps("She has 16 - 3 = <<16-3=13>>13 eggs.\\nShe makes 13 x $2 = $26.")
    ['16-3', '13 * 2']
    """
    anns = list(_ANNOTATION.finditer(solution))
    tail = solution[anns[-1].end():] if anns else solution
    steps = [m.group(1) for m in anns] + [m.group(1) for m in _EQUATION.finditer(tail.replace(",", ""))]
    return [_clean(s) for s in steps if calc(s) is not None]


def expert_actions(task: Task) -> list[str] | None:
    """One step that computes the answer in code and submits it: a synthetic task's expression (its plan as
    the thought), or a GSM8K solution's calculations when the last gives the gold; else None (no demo).

    >>> print(expert_actions(make_tasks(0, 1)[0])[0])
    <think>The question gives 25 stamps per hour for 28 hours. The total is 25 * 28.</think>
    <code>answer = 25 * 28
    submit_final_answer(answer)</code>
    >>> t = Task("g1", "16 eggs, 3 eaten, sold at $2. Dollars?", ["26"], {"solution": "16-3=<<16-3=13>>13. 13*2=26"})
    >>> print(expert_actions(t)[0])
    <think>The question gives 16, 3, 2. I compute 16-3, then 13*2.</think>
    <code>print(16-3)
    answer = 13*2
    submit_final_answer(answer)</code>
    """
    if "expr" in task.meta:
        plan, steps = task.meta["plan"], [task.meta["expr"]]
    else:
        steps = solution_steps(task.meta.get("solution", ""))
        if not steps or not numbers_equal(number_text(calc(steps[-1])), task.answers[0]):
            return None
        numbers = (m.group().replace(",", "") for m in re.finditer(r"\d[\d,]*(?:\.\d+)?", task.question))
        given = ", ".join(dict.fromkeys(numbers))
        plan = f"The question gives {given or 'no digits'}. I compute {', then '.join(steps)}."
    code = [f"print({s})" for s in steps[:-1]] + [f"answer = {steps[-1]}", "submit_final_answer(answer)"]
    return [f"<think>{plan}</think>\n<code>" + "\n".join(code) + "</code>"]


# --------------------------------------------------------------------------------- GSM8K files
BENCHMARKS = {"gsm8k": ("openai/gsm8k", "main/test-00000-of-00001.parquet")}  # name -> (hub dataset repo, file)


def load_tasks(spec: str, cfg=None, limit: int | None = None) -> data.Tasks:
    """GSM8K by name (data.data_dir, $L0_MIN_DATA or the hub), or a file of {question, answer} rows."""
    spec = "gsm8k" if spec.strip().lower() == "gsm8k" else spec
    return data.load(spec, BENCHMARKS, parser, cfg, limit)


def parser(benchmark: str | None, path):
    """The row parser of one file: GSM8K's rows (a worked solution ending "#### <number>", the number the gold) where
    its first row is one, else rows whose answer is a number.

    >>> parser("gsm8k", "x")({"question": "2 + 2?", "answer": "2 + 2 = <<2+2=4>>4\\n#### 4"})
    ('2 + 2?', ['4'], {'solution': '2 + 2 = <<2+2=4>>4', 'benchmark': 'gsm8k'})
    """
    gsm8k = None

    def parse(row: dict) -> tuple[str, list[str], dict]:
        nonlocal gsm8k
        q, answer = data.text_field(row, "question"), data.text_field(row, "answer")
        gsm8k = ("####" in answer) if gsm8k is None else gsm8k
        solution, mark, gold = answer.rpartition("#### ") if gsm8k else ("", "", answer)
        if gsm8k and (not mark or not gold.strip()):
            raise data.RowError("GSM8K layout: field 'answer' must end with '#### <number>' (the gold)")
        if "####" in solution:
            raise data.RowError("GSM8K layout: field 'answer' has more than one '####' mark (which one is the gold?)")
        if parse_number(gold := gold.replace(",", "").strip()) is None:
            raise data.RowError(f"the gold answer {gold!r} is not a number (env math grades numbers)")
        return q, [gold], {"solution": solution.rstrip("\n"), "benchmark": benchmark or "gsm8k" * gsm8k or None}
    return parse


# ------------------------------------------------------------------------------- the environment

SYSTEM_PROMPT = """\
You solve math word problems with Python. Each step, write <think>...</think> then one <code>...</code> cell; \
you see its output.
Compute the answer in code, then submit_final_answer(answer) ends the task with that number."""

WORKED_EXAMPLE = (
    {"role": "user", "content": "Task: A bakery bakes 148 rolls a day. How many rolls does it bake in 26 days?\n"
                                "You have 2 steps."},
    {"role": "assistant", "content": "<think>The question gives 148 rolls a day for 26 days. The total is 148 * 26."
                                     "</think>\n<code>answer = 148 * 26\nsubmit_final_answer(answer)</code>"},
)  # fmt: skip


class Math(TaskEnvBase):
    metrics = ("correct",)
    system_prompt, worked_example = SYSTEM_PROMPT, WORKED_EXAMPLE

    def synthetic(self, seed: int, n: int) -> list[Task]:  # the generator above (data.synthetic_*)
        return make_tasks(seed, n)

    def load(self, source: str, limit: int | None = None) -> list[Task]:
        return load_tasks(source, self.cfg.data, limit)

    def score(self, ep: Episode) -> dict[str, float]:
        """L0's answer reward with numeric equivalence in place of exact match: 0.9 * correct + 0.1 * answered."""
        r = self.cfg.reward
        correct = float(any(numbers_equal(ep.final_answer, g) for g in ep.task.answers))
        return {"core": answer_reward(ep.final_answer, correct, r.em_weight, r.has_answer_weight),
                "correct": correct}

    def expert(self, task: Task) -> list[str] | None:
        return expert_actions(task)


def make_env(cfg) -> Math:
    return Math(cfg)
