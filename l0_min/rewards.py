"""The training reward (defaults of `RewardConfig`): total = 0.8 * core + 0.1 * format + 0.1 * exec, where core is
the environment's answer reward (QA: 0.9 * EM + 0.1 * has_answer), format the mean over steps of `format_ok`, exec
the share of the steps that ran code without an error, + step_weight * the environment's step rewards (0 by default);
`score_episode` spreads the total over the steps.
"""

from __future__ import annotations

import math
import re

from l0_min.config import RewardConfig, is_number
from l0_min.episode import Episode

THINK = re.compile(r"<think>(.*?)</think>", re.S)  # the agent splits actions with it too
_CODE = re.compile(r"<code>(.*?)</code>", re.S)


def format_ok(action: str, min_think_chars: int = 10, min_code_chars: int = 5, finish_reason: str = "stop") -> bool:
    """The one definition of a well-formed step: one `<think>` block of more than `min_think_chars` (stripped), then
    one `<code>` block of more than `min_code_chars`, not cut off by the token limit. The server may leave the stop
    string "</code>" out, so an action that ends inside an open `<code>` block counts as closed.

    >>> t = "<think>look it up first</think>"
    >>> format_ok(t + "<code>web_search('x')</code>"), format_ok(t + "<code>web_search('x')")
    (True, True)
    >>> format_ok(t + "<code>print(123", finish_reason="length"), format_ok(t + "<code>1</code><code>print(1)</code>")
    (False, False)
    >>> format_ok("<think>short</think><code>web_search('x')</code>")
    False
    """
    opened = action.count("<code>") == action.count("</code>") + 1
    text = action + "</code>" if opened and action.rfind("<code>") > action.rfind("</code>") else action
    thinks, codes = THINK.findall(text), _CODE.findall(text)
    return (finish_reason != "length" and len(thinks) == 1 and len(codes) == 1 and text.count("<think>") == 1
            and text.count("<code>") == 1 and text.index("</think>") < text.index("<code>")
            and len(thinks[0].strip()) > min_think_chars and len(codes[0].strip()) > min_code_chars)


def score_episode(ep: Episode, cfg: RewardConfig, env) -> None:
    """Fill `ep.reward`, `ep.rewards` and every `step.reward` (in place); `env` (l0_min.envs) scores the
    outcome: its "core" in [0, 1] is the answer term, its other scores are kept as metrics.

    Step i of n gets format_weight * format_ok_i / n, exec_weight * exec_ok_i / m where it ran code (m such
    steps), step_weight * env.step_rewards(ep)[i] (only with step_weight != 0; their sum is ep.rewards["step"]), and
    the last step answer_weight * core, so sum(step.reward) == ep.reward. An episode without steps gets only its
    answer term; an expert's prefix steps (Step.prefix) are not counted.
    """
    scores = env.score(ep)
    core = scores.get("core") if isinstance(scores, dict) else None
    if not (is_number(core) and 0.0 <= core <= 1.0):
        raise ValueError(f"env {env.name!r}: score() of task {ep.task.id!r} returned {str(scores)[:200]}: expected a dict "
                         "whose 'core' is a number in [0, 1]")  # fmt: skip
    if (head := getattr(env, "metrics", ("core",))[0]) not in scores:
        raise ValueError(f"env {env.name!r}: score() of task {ep.task.id!r} returned {', '.join(map(repr, scores))}: "
                         f"no {head!r}, its headline metric (metrics[0])")
    parts = env.step_rewards(ep) if cfg.step_weight and hasattr(env, "step_rewards") else [0.0] * len(ep.steps)
    if not (isinstance(parts, (list, tuple)) and len(parts) == len(ep.steps)
            and all(is_number(x) and math.isfinite(x) for x in parts)):
        raise ValueError(f"env {env.name!r}: step_rewards() of task {ep.task.id!r} returned {str(parts)[:200]}: "
                         f"expected a list of {len(ep.steps)} finite numbers, one per step")
    core = float(core)
    own = [s for s in ep.steps if not s.prefix]  # an expert prefix (rollout.resample) earns nothing: not the policy's
    step = [float(x) for s, x in zip(ep.steps, parts) if not s.prefix]
    n, m = len(own), sum(1 for s in own if s.exec_ok is not None)
    for s in ep.steps:
        s.format_ok = format_ok(s.action_text, cfg.min_think_chars, cfg.min_code_chars, s.finish_reason)
        s.reward = 0.0
    for i, s in enumerate(own):
        s.reward = cfg.format_weight * float(s.format_ok) / n + cfg.step_weight * step[i]
        if s.exec_ok is not None:
            s.reward += cfg.exec_weight * float(s.exec_ok) / m
        if i == n - 1:
            s.reward += cfg.answer_weight * core
    fmt = sum(float(s.format_ok) for s in own) / n if n else 0.0
    exe = sum(1 for s in own if s.exec_ok) / m if m else 0.0  # 1 - errored / ran, over the steps that ran code
    ep.reward = total = (cfg.answer_weight * core + cfg.format_weight * fmt + cfg.exec_weight * exe
                         + cfg.step_weight * sum(step))
    ep.rewards = {**scores, "core": core, "format": fmt, "exec": exe, "total": total}
    ep.rewards |= {"step": sum(step)} if cfg.step_weight else {}
