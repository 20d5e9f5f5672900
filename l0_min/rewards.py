"""The training reward: the L0 reward terms, and the answer normalisation, exact match and token F1 of QA.

The RL reward of one episode (defaults of `RewardConfig`):

    total = 0.8 * core + 0.1 * format + 0.1 * exec
    core   = the environment's answer reward, e.g. QA's 0.9 * EM + 0.1 * has_answer (l0_min.envs)
    format = mean over steps of 1[one <think> of > 10 chars and one <code> of > 5 chars, not cut off]
    exec   = mean over steps that ran code of 1[the code ran without an error]

`score_episode` also spreads that total over the steps for the learner (see its docstring).

Normalisation follows SQuAD / HotpotQA (lowercase, drop punctuation, drop a/an/the, collapse
whitespace) but is Unicode-aware, where the L0 / SQuAD code keeps only what `string.punctuation`
knows and L0 drops non-ASCII letters. Lenient on purpose, for a reward; evaluate.py reports the
official scores (`l0_min.evaluation.official_normalize`) and this one as an extra column:

    >>> normalize_answer("The  Café, Paris!")
    'café paris'
    >>> normalize_answer("U.S. $1,000")
    'us 1000'

Decisions, so that two spellings of the same answer compare equal:
- NFKC first: composed and decomposed accents become one form ("e" + U+0301 -> "é"),
  full-width and ligature forms fold ("Ｔｏｋｙｏ" -> "tokyo", "ﬁ" -> "fi"), "²" -> "2".
- `str.casefold` instead of `lower` ("Straße" == "STRASSE"); identical on ASCII.
- punctuation is every character whose Unicode category is P* or S* (on ASCII this is exactly
  `string.punctuation`), removed without inserting a space, as SQuAD does ("U.S." -> "us").
  Accented letters, CJK, digits and combining marks stay.
- no accent stripping: "café" != "cafe", as the gold spelling is what counts.
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter
from typing import Iterable

from l0_min.config import RewardConfig
from l0_min.episode import Episode

_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(s: str) -> str:
    """SQuAD/HotpotQA normalisation, Unicode-aware (see the module docstring).

    >>> normalize_answer("An Apple a day")
    'apple day'
    >>> normalize_answer("Ｔｏｋｙｏ")
    'tokyo'
    >>> normalize_answer("  ")
    ''
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
    """1.0 when the normalised prediction equals a normalised gold alias, else 0.0.

    A blank (or None) prediction never matches: nothing submitted earns nothing. A gold that
    normalises to "" (only punctuation and articles, e.g. "A+") is compared with `light_normalize`
    instead, where SQuAD's code would match it with any all-punctuation prediction.

    >>> exact_match("the Eiffel Tower.", ["Eiffel Tower", "Tour Eiffel"])
    1.0
    >>> exact_match("Eiffel", ["Eiffel Tower"])
    0.0
    >>> exact_match("", [""]), exact_match("a+", ["A+"]), exact_match("?", ["A+"])
    (0.0, 1.0, 0.0)
    """
    golds = _golds(golds)
    if not has_answer(prediction):
        return 0.0
    p, p_light = normalize_answer(prediction), light_normalize(prediction)
    for g in golds:
        g_norm = normalize_answer(g)
        if (g_norm and p == g_norm) or (not g_norm and p_light == light_normalize(g)):
            return 1.0
    return 0.0


def token_f1(p: str, g: str) -> float:
    """Token F1 of two normalised answers, as HotpotQA's official f1_score (also used by the official
    scores of l0_min.evaluation): yes / no / noanswer on either side must match exactly.

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
    """Best token F1 over the gold aliases, 0.0 unanswered. A gold of only punctuation / articles
    ("A+") scores all or nothing, as in exact_match.

    >>> f1_score("the president Barack Obama", ["Obama", "Barack Obama"]), f1_score("a+", ["A+"])
    (0.8, 1.0)
    """
    golds = _golds(golds)
    if not has_answer(prediction):
        return 0.0
    p = normalize_answer(prediction)
    return max(token_f1(p, g_norm) if (g_norm := normalize_answer(g)) else exact_match(prediction, [g]) for g in golds)


def has_answer(prediction: str | None) -> bool:
    """A final answer was submitted and has a letter or a digit (not blank, not only punctuation).

    >>> has_answer("  "), has_answer(None), has_answer("|"), has_answer("0"), has_answer("A+")
    (False, False, False, True, True)
    """
    return prediction is not None and any(ch.isalnum() for ch in prediction)


def answer_reward(prediction: str | None, golds: str | Iterable[str], em_weight: float = 0.9,
                  has_answer_weight: float = 0.1, correct: float | None = None) -> float:
    """L0's final-answer reward: 0.9 * EM + 0.1 * has_answer; `correct` (e.g. F1) replaces EM when given.

    >>> answer_reward("Paris", ["Paris"]), answer_reward("Lyon", ["Paris"]), answer_reward(None, ["Paris"])
    (1.0, 0.1, 0.0)
    """
    score = exact_match(prediction, golds) if correct is None else float(correct)
    return em_weight * score + has_answer_weight * float(has_answer(prediction))


_THINK = re.compile(r"<think>(.*?)</think>", re.S)
_CODE = re.compile(r"<code>(.*?)</code>", re.S)


def format_ok(action: str, min_think_chars: int = 10, min_code_chars: int = 5, finish_reason: str = "stop") -> bool:
    """The one definition of a well-formed step: one `<think>` block with more than `min_think_chars`
    characters (stripped) and one `<code>` block with more than `min_code_chars`, the think block first,
    and not cut off by the token limit (`finish_reason` "length").

    The inference server stops at "</code>" and may leave that stop string out of the text, so an
    action that ends inside an open `<code>` block counts as closed, unless the token limit cut it.

    >>> format_ok("<think>look it up first</think><code>web_search('x')</code>")
    True
    >>> format_ok("<think>look it up first</think><code>web_search('x')")
    True
    >>> format_ok("<think>look it up first</think><code>print(123", finish_reason="length")
    False
    >>> format_ok("<think>short</think><code>web_search('x')</code>")
    False
    >>> format_ok("<think>look it up first</think><code>1</code><code>web_search('x')</code>")
    False
    """
    opened = action.count("<code>") == action.count("</code>") + 1
    text = action + "</code>" if opened and action.rfind("<code>") > action.rfind("</code>") else action
    thinks, codes = _THINK.findall(text), _CODE.findall(text)
    return (finish_reason != "length" and len(thinks) == 1 and len(codes) == 1 and text.count("<think>") == 1
            and text.count("<code>") == 1 and text.index("</think>") < text.index("<code>")
            and len(thinks[0].strip()) > min_think_chars and len(codes[0].strip()) > min_code_chars)


def exec_score(exec_oks: Iterable[bool | None]) -> float:
    """1 - errored / executed over the steps that ran code (None: no code ran). 0.0 if none ran,
    so a policy that never runs code gets no execution credit.

    >>> exec_score([True, False, None, True, True])
    0.75
    >>> exec_score([None, None])
    0.0
    """
    ran = [ok for ok in exec_oks if ok is not None]
    return sum(1 for ok in ran if ok) / len(ran) if ran else 0.0


def score_episode(ep: Episode, cfg: RewardConfig, env) -> None:
    """Fill `ep.reward`, `ep.rewards` and every `step.reward` (in place); `env` (l0_min.envs) scores the
    outcome: its "core" in [0, 1] is the answer term, its other scores are kept as metrics.

    Per step i of n steps, with fmt_i = 1[format_ok], ok_i = 1[exec_ok] and m steps that ran code:

        step.reward_i = format_weight * fmt_i / n
                      + exec_weight * ok_i / m        (only on steps that ran code)
                      + answer_weight * core          (only on the last step)

    so sum(step.reward) == ep.reward == answer_weight * core + format_weight * format
    + exec_weight * exec. `step.format_ok` is recomputed from the step's text and finish reason with the
    config's thresholds (`format_ok`, the one rule the agent also applies); `step.exec_ok` is taken as the
    agent recorded it.

    Worked example (default weights 0.8 / 0.1 / 0.1; QA: EM weight 0.9, has_answer weight 0.1),
    4 steps, gold "Paris", submitted "paris":
        step  format  exec_ok   step.reward
        0     1       True      0.1*1/4 + 0.1*1/3             = 0.058333
        1     0       False     0.1*0/4 + 0.1*0/3             = 0.0
        2     1       None      0.1*1/4                       = 0.025
        3     1       True      0.1*1/4 + 0.1*1/3 + 0.8*1.0   = 0.858333
    format = 3/4, exec = 2/3, core = 0.9*1 + 0.1*1 = 1.0
    ep.reward = 0.8*1.0 + 0.1*0.75 + 0.1*0.666667 = 0.941667 (= the sum of the column).

    An episode without steps gets only its answer term.
    """
    scores = env.score(ep)
    core = float(scores["core"])
    if not 0.0 <= core <= 1.0:
        raise ValueError(f"env {env.name!r}: score()['core'] must be in [0, 1], got {core}")
    n, m = len(ep.steps), sum(1 for s in ep.steps if s.exec_ok is not None)
    for i, s in enumerate(ep.steps):
        s.format_ok = format_ok(s.action_text, cfg.min_think_chars, cfg.min_code_chars, s.finish_reason)
        r = cfg.format_weight * float(s.format_ok) / n
        if s.exec_ok is not None:
            r += cfg.exec_weight * float(s.exec_ok) / m
        if i == n - 1:
            r += cfg.answer_weight * core
        s.reward = r
    fmt = sum(float(s.format_ok) for s in ep.steps) / n if n else 0.0
    exe = exec_score(s.exec_ok for s in ep.steps)
    ep.reward = total = cfg.answer_weight * core + cfg.format_weight * fmt + cfg.exec_weight * exe
    ep.rewards = {**scores, "core": core, "format": fmt, "exec": exe, "total": total}
