"""Math word problems solved with code: the answer is a number, graded by numeric equivalence.

(A skeleton: the grader below is final; the generator, the GSM8K source, the prompts and the expert come next.)
"""

from __future__ import annotations

import re
from fractions import Fraction

_NUMBER = re.compile(r"(?<![\w.])[-+−]?(?:\d{1,3}(?:,\d{3})+|\d+)?(?:\.\d+)?(?:\s*/\s*\d+)?(?![\w])")


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
        if den and int(den) == 0:
            return None
        found.add(Fraction(num) / (Fraction(den) if den else 1))
    return found.pop() if len(found) == 1 else None


def numbers_equal(answer: str | None, gold: str, rel_tol: float = 1e-6) -> bool:
    """Whether `answer` states the number `gold` does: exactly for integers, decimals and fractions, and
    within `rel_tol` (relative) when either side is a float or a repeating decimal was rounded
    (3.3333333 for 10/3).

    >>> numbers_equal("1,200", "1200"), numbers_equal("$18.00", "18"), numbers_equal("3.3333333", "10/3")
    (True, True, True)
    >>> numbers_equal("18 or 19", "18"), numbers_equal(None, "18"), numbers_equal("0.33", "1/3")
    (False, False, False)
    """
    a, g = parse_number(answer), parse_number(gold)
    if a is None or g is None:
        return False
    return a == g or abs(float(a) - float(g)) <= rel_tol * max(1.0, abs(float(g)))
