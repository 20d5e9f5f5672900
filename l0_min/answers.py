"""What every environment shares about answers: SQuAD-style normalisation (Unicode-aware), exact match and F1
over gold aliases, numbers and their equality, the L0 answer reward, the held-out split of synthetic tasks.
"""

from __future__ import annotations

import hashlib
import math
import re
import unicodedata
from collections import Counter
from fractions import Fraction
from typing import Iterable

from l0_min.episode import Task


def has_answer(prediction: str | None) -> bool:
    """A final answer was submitted and has a letter or a digit (not blank, not only punctuation).

    >>> has_answer("  "), has_answer(None), has_answer("|"), has_answer("0"), has_answer("A+")
    (False, False, False, True, True)
    """
    return prediction is not None and any(ch.isalnum() for ch in prediction)


def answer_reward(prediction: str | None, correct: float, em_weight: float = 0.9, has_answer_weight: float = 0.1) -> float:
    """L0's final-answer reward: 0.9 * correct (QA: EM) + 0.1 * has_answer, the `core` of the environments.

    >>> answer_reward("Paris", 1.0), answer_reward("Lyon", 0.0), answer_reward(None, 0.0)
    (1.0, 0.1, 0.0)
    """
    return em_weight * float(correct) + has_answer_weight * float(has_answer(prediction))


# SQuAD / HotpotQA normalisation made Unicode-aware (lenient on purpose, for a reward; QA's tables also report the
# official scores, `envs.qa.official_normalize`): NFKC folds accents' forms, full-width and ligatures; casefold
# ("Straße" == "STRASSE"); punctuation is every P* or S* character (on ASCII `string.punctuation`), removed
# without a space ("U.S." -> "us"); accents stay ("café" != "cafe": the gold spelling counts).

_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(s: str) -> str:
    """SQuAD/HotpotQA normalisation, Unicode-aware (the comment above).

    >>> [normalize_answer(s) for s in ("The  Café, Paris!", "U.S. $1,000", "An Apple a day", "Ｔｏｋｙｏ", "  ")]
    ['café paris', 'us 1000', 'apple day', 'tokyo', '']
    """
    if not isinstance(s, str):
        raise TypeError(f"normalize_answer expects a str, got {type(s).__name__}: {s!r}")
    s = unicodedata.normalize("NFKC", s).casefold()
    s = "".join(ch for ch in s if unicodedata.category(ch)[0] not in "PS")  # punctuation and symbols
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def light_normalize(s: str) -> str:
    """NFKC, casefold and collapse whitespace only: used for a gold that `normalize_answer` maps to
    "" (NQ has "A+" and "---"), so such a gold can still be matched exactly.

    >>> normalize_answer("A+"), light_normalize(" A+ ")
    ('', 'a+')
    """
    return " ".join(unicodedata.normalize("NFKC", s).casefold().split())


def _golds(golds: str | Iterable[str]) -> list[str]:
    golds = [golds] if isinstance(golds, str) else list(golds)
    if not golds:
        raise ValueError("no gold answers given")
    return golds


def exact_match(prediction: str | None, golds: str | Iterable[str]) -> float:
    """1.0 when the normalised prediction equals a normalised gold alias; a blank one never does. A gold that
    normalises to "" ("A+") is compared by `light_normalize` (SQuAD's code would match any all-punctuation answer).

    >>> exact_match("the Eiffel Tower.", ["Eiffel Tower", "Tour Eiffel"]), exact_match("Eiffel", ["Eiffel Tower"])
    (1.0, 0.0)
    >>> exact_match("", [""]), exact_match("a+", ["A+"]), exact_match("?", ["A+"])
    (0.0, 1.0, 0.0)
    """
    golds = _golds(golds)
    if not has_answer(prediction):
        return 0.0
    p, p_light = normalize_answer(prediction), light_normalize(prediction)
    return float(any(p == g if (g := normalize_answer(gold)) else p_light == light_normalize(gold) for gold in golds))


def token_f1(p: str, g: str) -> float:
    """Token F1 of two normalised answers, as HotpotQA's official f1_score (yes / no / noanswer match exactly).

    >>> token_f1("barack obama", "obama"), token_f1("no", "no way"), token_f1("", "x")
    (0.6666666666666666, 0.0, 0.0)
    """
    if (p in ("yes", "no", "noanswer") or g in ("yes", "no", "noanswer")) and p != g:
        return 0.0
    same = sum((Counter(p.split()) & Counter(g.split())).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(p.split()), same / len(g.split())
    return 2 * precision * recall / (precision + recall)


def f1_score(prediction: str | None, golds: str | Iterable[str]) -> float:
    """Best token F1 over the gold aliases, 0.0 unanswered; a gold such as "A+" scores as in exact_match.

    >>> f1_score("the president Barack Obama", ["Obama", "Barack Obama"]), f1_score("a+", ["A+"])
    (0.8, 1.0)
    """
    golds = _golds(golds)
    if not has_answer(prediction):
        return 0.0
    p = normalize_answer(prediction)
    return max(token_f1(p, g_norm) if (g_norm := normalize_answer(g)) else exact_match(prediction, [g]) for g in golds)


def split(tasks: list[Task], held_out: float = 0.2) -> tuple[list[Task], list[Task]]:
    """(train, held-out) by a hash of each task id: stable when tasks are added or reordered.

    >>> tr, ho = split([Task(f"t{i}", "q", ["a"]) for i in range(100)], 0.25)
    >>> len(tr), len(ho), not set(t.id for t in tr) & set(t.id for t in ho)
    (77, 23, True)
    """
    if not 0.0 <= held_out <= 1.0:
        raise ValueError(f"held_out must be in [0, 1], got {held_out}")
    train, test = [], []
    for t in tasks:
        h = int(hashlib.sha1(t.id.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
        (test if h < held_out else train).append(t)
    return train, test


# ----------------------------------------------------------------------------------------- numbers
# a number starts with a digit or "." (a match from blank space scanned "\s*/" ahead: quadratic in the text)
_NUMBER = re.compile(r"(?<![\w.])[-+−]?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)(?:\s*/\s*\d+)?(?![\w])")


def parse_number(text: str | None) -> Fraction | float | None:
    """The one number an answer states, or None when it states none or several different ones. Thousands
    separators, currency signs, units and trailing words go; "3/4" is a fraction, "75%" is 75.

    >>> [parse_number(s) for s in ("42", "$1,200.50", "3/4", "-7 apples", "The answer is 18.", "about 2 or 3", "")]
    [Fraction(42, 1), Fraction(2401, 2), Fraction(3, 4), Fraction(-7, 1), Fraction(18, 1), None, None]
    >>> parse_number("1.5e3"), parse_number("x2 = 18"), parse_number("5 (5 apples)")
    (1500.0, Fraction(18, 1), Fraction(5, 1))
    """
    if text is None:
        return None
    text = str(text).replace("−", "-")
    if m := re.fullmatch(r"\s*[-+]?\d+(?:\.\d+)?[eE][-+]?\d+\s*", text):
        return float(m.group())
    found = set()
    for m in _NUMBER.finditer(text):
        s = m.group().replace(",", "").replace(" ", "")
        if not any(ch.isdigit() for ch in s):
            continue
        num, _, den = s.partition("/")
        try:  # (a numeral of more digits than int() reads, 4,300, is no number it can state)
            if den and int(den) == 0:
                return None
            found.add(Fraction(num) / (Fraction(den) if den else 1))
        except ValueError:
            return None
    return found.pop() if len(found) == 1 else None


def numbers_equal(answer: str | None, gold: str, rel_tol: float = 1e-6) -> bool:
    """Whether `answer` states the number `gold` does, as exact fractions (no overflow); within `rel_tol` only
    where a side was rounded (a float "1.5e3", or a repeating decimal); none, several or "1e999" is unequal.

    >>> numbers_equal("1,200", "1200"), numbers_equal("$18.00", "18"), numbers_equal("3.3333333", "10/3")
    (True, True, True)
    >>> numbers_equal("18 or 19", "18"), numbers_equal(None, "18"), numbers_equal("0.33", "1/3")
    (False, False, False)
    >>> numbers_equal("2000001", "2000000"), numbers_equal("1" * 400, "1" * 400), numbers_equal("1e999", "1")
    (False, True, False)
    """
    a, g = parse_number(answer), parse_number(gold)
    if a is None or g is None or any(isinstance(x, float) and not math.isfinite(x) for x in (a, g)):
        return False
    rounded = isinstance(a, float) or isinstance(g, float) or not (_ends(Fraction(a)) and _ends(Fraction(g)))
    a, g = Fraction(a), Fraction(g)
    return a == g or (rounded and abs(a - g) <= Fraction(rel_tol) * max(1, abs(g)))


def _ends(x: Fraction) -> bool:
    """Whether x has a finite decimal expansion: its denominator divides a power of 10 (2^a 5^b divides
    10^max(a, b), and max(a, b) < its bit length)."""
    return 10 ** x.denominator.bit_length() % x.denominator == 0
