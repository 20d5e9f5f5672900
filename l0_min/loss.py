"""The learner's losses, on tensors of shape [tokens] (`mask` is 0 off the action tokens and carries
sample weights). Pure functions with worked examples; the learner (l0_min/learner.py) calls them.
"""

from __future__ import annotations

import torch


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimators on tokens sampled from pi (Schulman's k1, k2, k3; L0 used k3).

    >>> lp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-2.0, -2.0])
    >>> [[round(x, 6) for x in kl_penalty(lp, ref, k).tolist()] for k in ("k1", "k2", "k3")]
    [[1.0, 0.0], [0.5, 0.0], [0.367879, 0.0]]
    """
    d = logp - ref_logp
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        return torch.exp(-d) - 1.0 + d
    raise ValueError(f"algo.kl_estimator: unknown estimator {estimator!r} (k1 | k2 | k3)")


def chunks(mask: torch.Tensor) -> torch.Tensor:
    """Each token's chunk: the index of the run of action tokens (mask > 0) it is in, -1 off them. A chunk is one
    agent step's action (observations lie between two actions), ROLL's unit of credit.

    >>> chunks(torch.tensor([0.0, 1, 1, 0, 0, 1, 0, 1, 1])).tolist()
    [-1, 0, 0, -1, -1, 1, -1, 2, 2]
    """
    on = mask > 0
    starts = on & ~torch.cat([on.new_zeros(1), on[:-1]])
    return torch.where(on, torch.cumsum(starts.long(), 0) - 1, -1)


def chunk_mean(x: torch.Tensor, chunk: torch.Tensor) -> torch.Tensor:
    """Each token's chunk's mean of `x` (0 off the chunks); differentiable in `x`; nothing read back from the device.

    >>> chunk_mean(torch.tensor([5.0, 1, 3, 9, 2]), torch.tensor([-1, 0, 0, -1, 1])).tolist()
    [0.0, 2.0, 2.0, 0.0, 2.0]
    """
    on, idx = chunk >= 0, chunk.clamp(min=0)
    sums = x.new_zeros(len(x)).index_add(0, idx[on], x[on])
    counts = x.new_zeros(len(x)).index_add(0, idx[on], torch.ones_like(x[on]))
    return torch.where(on, (sums / counts.clamp(min=1))[idx], 0.0)


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                n_tokens_global: float, clip_eps: float | None = None, chunk: torch.Tensor | None = None) -> torch.Tensor:
    """DAPO token-level policy-gradient loss: the sum over action tokens divided by the action tokens of the WHOLE
    global batch, so trajectories weigh per token and micro-batching does not change the gradient. clip_eps None
    (on-policy): -sum(mask * A * logp) / N; else PPO's -sum(mask * min(ratio * A, clip(ratio) * A)) / N.

    >>> lp = torch.tensor([-1.0, -2.0, -3.0])
    >>> round(policy_loss(lp, lp, torch.tensor([1.0, 1.0, -2.0]), torch.tensor([1.0, 1.0, 0.0]), 4.0).item(), 6)
    0.75

    Token 1's ratio e^-1 = 0.37 with A = -1: min(-0.37, clip(0.37) * -1) = -0.8; surrogates [-1, -0.8, 1]:

    >>> old = torch.tensor([-1.0, -1.0, -3.0])
    >>> round(policy_loss(lp, old, torch.tensor([-1.0, -1.0, 1.0]), torch.ones(3), 3.0, 0.2).item(), 6)
    0.266667

    With `chunk` (`chunks(mask)`) a token's ratio is its chunk's geometric mean, clipped as one (GSPO's sequence
    ratio, per agent step): tokens 0-1 have exp(-1/2) = 0.61, clipped to 0.8: surrogates [-0.8, -0.8, 1]:

    >>> round(policy_loss(lp, old, torch.tensor([-1.0, -1.0, 1.0]), torch.ones(3), 3.0, 0.2,
    ...                   torch.tensor([0, 0, 1])).item(), 6)
    0.2
    """
    if clip_eps is None:
        surrogate = logp * adv
    else:
        ratio = torch.exp(logp - old_logp if chunk is None else chunk_mean(logp - old_logp, chunk))
        surrogate = torch.minimum(ratio * adv, torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * adv)
    return -(surrogate * mask).sum() / max(n_tokens_global, 1.0)


# ---- the behaviour policy: the sampler's log-probs (behav) against the learner's at the start of the step (prox)
def behaviour_weights(prox_logp: torch.Tensor, behav_logp: torch.Tensor, cap: float = 0.0,
                      band: tuple[float, float] | None = None, chunk: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token correction for tokens the sampler drew: (weight, keep), from ratio = pi_prox / pi_behav.
    Truncated importance sampling: weight = min(ratio, cap) (cap 0: weight 1); IcePop-style masking: keep = 0
    where the ratio is outside `band` = (low, high).

    >>> prox, behav = torch.tensor([-1.0, -1.0, -1.0]), torch.tensor([-1.0, -2.0, -0.2])
    >>> w, keep = behaviour_weights(prox, behav, cap=2.0, band=(0.5, 2.0))
    >>> [round(x, 6) for x in w.tolist()], keep.tolist()
    ([1.0, 2.0, 0.449329], [1.0, 0.0, 0.0])

    Per chunk (`chunk`, ROLL's IPA): one ratio per agent step, the geometric mean of its tokens', weighted and
    masked whole:

    >>> w, keep = behaviour_weights(prox, behav, cap=2.0, band=(0.5, 2.0), chunk=torch.tensor([0, 0, 1]))
    >>> [round(x, 6) for x in w.tolist()], keep.tolist()
    ([1.648721, 1.648721, 0.449329], [1.0, 1.0, 0.0])
    """
    ratio = torch.exp(prox_logp - behav_logp if chunk is None else chunk_mean(prox_logp - behav_logp, chunk))
    weight = ratio.clamp(max=cap) if cap > 0 else torch.ones_like(ratio)
    keep = torch.ones_like(ratio) if band is None else ((ratio >= band[0]) & (ratio <= band[1])).to(ratio.dtype)
    return weight, keep


def mismatch(prox_logp: torch.Tensor, behav_logp: torch.Tensor, mask: torch.Tensor,
             chunk: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """How far the sampler's log-probs are from the learner's on the action tokens: sums (0-dim tensors, so ranks
    can add them) of |log ratio| and of k3 = exp(d) - 1 - d (d = prox - behav, an estimate of KL(sampler || learner)),
    and with `chunk` (`chunks(mask)`) the same per agent step: |its mean log ratio| (chunk-level IS's log ratio).
    Below, d = [0, 1, -0.8]: chunk 0 (tokens 0-1) has mean 0.5, chunk 1 -0.8.

    >>> m = mismatch(torch.tensor([-1.0, -1.0, -1.0, 0.0]), torch.tensor([-1.0, -2.0, -0.2, 5.0]), torch.tensor([1.0, 1, 1, 0]),
    ...              torch.tensor([0, 0, 1, -1]))
    >>> {k: round(float(v), 6) for k, v in m.items()}  # doctest: +NORMALIZE_WHITESPACE
    {'tokens': 3.0, 'abs_log_ratio_sum': 1.8, 'abs_log_ratio_max': 1.0, 'k3_sum': 0.967611, 'chunks': 2.0,
     'chunk_abs_log_ratio_sum': 1.3, 'chunk_abs_log_ratio_max': 0.8}
    """
    on = mask > 0
    d = torch.where(on, prox_logp - behav_logp, 0.0)
    zero = d.new_zeros(())
    out = {"tokens": on.sum().to(d.dtype), "abs_log_ratio_sum": d.abs().sum(),
           "abs_log_ratio_max": d.abs().amax() if d.numel() else zero, "k3_sum": (torch.exp(d) - 1 - d).sum()}
    if chunk is not None:  # each chunk's mean, read at its first token
        first = (chunk >= 0) & (chunk != torch.cat([chunk.new_full((1,), -1), chunk[:-1]]))
        per = torch.where(first, chunk_mean(d, chunk).abs(), 0.0)
        out |= {"chunks": first.sum().to(d.dtype), "chunk_abs_log_ratio_sum": per.sum(),
                "chunk_abs_log_ratio_max": per.amax() if d.numel() else zero}
    return out
