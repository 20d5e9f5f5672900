"""The training reward: the L0 reward terms (the answer reward of each environment: l0_min/answers.py).

The RL reward of one episode (defaults of `RewardConfig`):

    total = 0.8 * core + 0.1 * format + 0.1 * exec
    core   = the environment's answer reward, e.g. QA's 0.9 * EM + 0.1 * has_answer (l0_min.envs)
    format = mean over steps of 1[one <think> of > 10 chars and one <code> of > 5 chars, not cut off]
    exec   = mean over steps that ran code of 1[the code ran without an error]

`score_episode` also spreads that total over the steps for the learner (see its docstring).
"""

from __future__ import annotations

import re
from typing import Iterable

from l0_min.config import RewardConfig
from l0_min.episode import Episode

THINK = re.compile(r"<think>(.*?)</think>", re.S)  # the agent splits actions with it too
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
    thinks, codes = THINK.findall(text), _CODE.findall(text)
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

    An episode without steps gets only its answer term; an expert's prefix steps (Step.prefix) are not counted.
    """
    scores = env.score(ep)
    core = scores.get("core") if isinstance(scores, dict) else None
    if not (isinstance(core, (int, float)) and not isinstance(core, bool) and 0.0 <= core <= 1.0):
        raise ValueError(f"env {env.name!r}: score() of task {ep.task.id!r} returned {str(scores)[:200]}: expected a dict "
                         "whose 'core' is a number in [0, 1]")  # fmt: skip
    core = float(core)
    own = [s for s in ep.steps if not s.prefix]  # an expert prefix (rollout.resample) earns nothing: not the policy's
    n, m = len(own), sum(1 for s in own if s.exec_ok is not None)
    for s in ep.steps:
        s.format_ok = format_ok(s.action_text, cfg.min_think_chars, cfg.min_code_chars, s.finish_reason)
        s.reward = 0.0
    for i, s in enumerate(own):
        s.reward = cfg.format_weight * float(s.format_ok) / n
        if s.exec_ok is not None:
            s.reward += cfg.exec_weight * float(s.exec_ok) / m
        if i == n - 1:
            s.reward += cfg.answer_weight * core
    fmt = sum(float(s.format_ok) for s in own) / n if n else 0.0
    exe = exec_score(s.exec_ok for s in own)
    ep.reward = total = cfg.answer_weight * core + cfg.format_weight * fmt + cfg.exec_weight * exe
    ep.rewards = {**scores, "core": core, "format": fmt, "exec": exe, "total": total}
