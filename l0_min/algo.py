"""The RL mathematics of L0 as small pure functions on plain lists (the rollout side imports it without torch),
each with a worked example. train.py: per-step rewards -> `step_advantages` -> `shape_advantages`,
`sample_weights` -> action tokens (`episode.segment_rows`) -> the losses of `l0_min/loss.py`.
"""

from __future__ import annotations

import math


# ----------------------------------------------------------------------- returns and advantages
def discounted_returns(rewards: list[float], gamma: float) -> list[float]:
    """REINFORCE++ step returns of one trajectory: R_t = r_t + gamma * R_{t+1}.

    >>> discounted_returns([0.0, 0.0, 1.0], gamma=0.5)
    [0.25, 0.5, 1.0]
    >>> discounted_returns([0.1, 0.1, 0.9], gamma=1.0)
    [1.1, 1.0, 0.9]
    """
    out, running = [0.0] * len(rewards), 0.0
    for t in range(len(rewards) - 1, -1, -1):
        running = rewards[t] + gamma * running
        out[t] = round(running, 12)
    return out


def zscore(values: list[float], eps: float = 1e-6) -> list[float]:
    """(x - mean) / (std + eps) with the population std; all-equal values give zeros.

    >>> zscore([0.0, 0.0, 1.0, 1.0], eps=0.0), zscore([3.0, 3.0])
    ([-1.0, -1.0, 1.0, 1.0], [0.0, 0.0])
    >>> zscore([0.0, 0.0, 1.0, 1.0])  # the default eps shrinks it a hair
    [-0.999998, -0.999998, 0.999998, 0.999998]
    """
    if not values:
        return []
    n = len(values)
    mean = sum(values) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / n)
    if std == 0.0:
        return [0.0] * n
    return [round((v - mean) / (std + eps), 6) for v in values]


def reinforce_pp_advantages(step_rewards: list[list[float]], gamma: float = 1.0, eps: float = 1e-6) -> list[list[float]]:
    """REINFORCE++ with batch-step-wise normalisation (L0, section 3): discounted returns per trajectory, then
    one z-score over ALL steps of ALL trajectories. A long trajectory weighs by its number of steps.

    >>> reinforce_pp_advantages([[0.0, 1.0], [0.0, 0.0]], gamma=1.0, eps=0.0)
    [[1.0, 1.0], [-1.0, -1.0]]
    >>> reinforce_pp_advantages([[1.0], [0.0, 0.0, 0.0]], gamma=1.0, eps=0.0)
    [[1.732051], [-0.57735, -0.57735, -0.57735]]
    """
    norm = iter(zscore([r for traj in step_rewards for r in discounted_returns(traj, gamma)], eps))
    return [[next(norm) for _ in traj] for traj in step_rewards]  # back into trajectories


def _by_group(values: list[float], groups: list[int]) -> dict[int, list[int]]:
    if len(values) != len(groups):
        raise ValueError(f"{len(values)} values but {len(groups)} group ids")
    idx: dict[int, list[int]] = {}
    for i, g in enumerate(groups):
        idx.setdefault(g, []).append(i)
    return idx


def grpo_advantages(outcomes: list[float], groups: list[int], eps: float = 1e-6) -> list[float]:
    """GRPO: outcome reward normalised within its group, (r - mean_g) / (std_g + eps).

    >>> grpo_advantages([0.0, 0.0, 1.0, 1.0, 0.5, 0.5], [0, 0, 0, 0, 1, 1], eps=0.0)
    [-1.0, -1.0, 1.0, 1.0, 0.0, 0.0]
    """
    out = [0.0] * len(outcomes)
    for idx in _by_group(outcomes, groups).values():
        for i, a in zip(idx, zscore([outcomes[i] for i in idx], eps)):
            out[i] = a
    return out


def rloo_advantages(outcomes: list[float], groups: list[int]) -> list[float]:
    """RLOO: reward minus the mean of the OTHER samples of its group (0 for a group of one).

    >>> rloo_advantages([1.0, 0.0, 0.0, 0.5], [0, 0, 0, 1])
    [1.0, -0.5, -0.5, 0.0]
    """
    out = [0.0] * len(outcomes)
    for idx in _by_group(outcomes, groups).values():
        total = sum(outcomes[i] for i in idx)
        for i in idx if len(idx) > 1 else ():
            out[i] = round(outcomes[i] - (total - outcomes[i]) / (len(idx) - 1), 12)
    return out


def step_advantages(step_rewards: list[list[float]], groups: list[int], method: str = "reinforce++", gamma: float = 1.0,
                    eps: float = 1e-6) -> list[list[float]]:
    """Per-step advantages by `method`; GRPO and RLOO give every step the trajectory's outcome advantage.

    >>> step_advantages([[0.0, 1.0], [0.0, 0.0]], [0, 0], "grpo", eps=0.0)
    [[1.0, 1.0], [-1.0, -1.0]]
    >>> step_advantages([[0.0, 1.0], [0.0, 0.0]], [0, 0], "rloo")
    [[1.0, 1.0], [-1.0, -1.0]]
    """
    if method == "reinforce++":
        return reinforce_pp_advantages(step_rewards, gamma, eps)
    outcomes = [sum(traj) for traj in step_rewards]
    if method == "grpo":
        per_traj = grpo_advantages(outcomes, groups, eps)
    elif method == "rloo":
        per_traj = rloo_advantages(outcomes, groups)
    else:
        raise ValueError(f"algo.advantage: unknown method {method!r} (reinforce++ | grpo | rloo)")
    return [[a] * len(traj) for a, traj in zip(per_traj, step_rewards)]


# ---------------------------------------------------------------------- filters and stabilisers
def dynamic_sampling_keep(core_rewards: list[float], groups: list[int]) -> list[bool]:
    """DAPO dynamic sampling: False for every sample of a group whose core reward has no variance (no learning
    signal under group baselines; a graded core reward drops a group that answered, all wrong, alike too).

    >>> dynamic_sampling_keep([0, 0, 1, 1, 0, 1, 0.1, 0.1], [0, 0, 1, 1, 2, 2, 3, 3])
    [False, False, False, False, True, True, False, False]
    """
    varied = {g for g, idx in _by_group(core_rewards, groups).items() if len({core_rewards[i] for i in idx}) > 1}
    return [g in varied for g in groups]


def sample_weights(env_failed: list[bool], failed: list[bool], n_tokens: list[int], *,
                   mask_env_failures: bool = False, max_failed_tokens: int = 0) -> list[float]:
    """Per-trajectory loss weights from ROLL's stabilisers (off by default): weight 0 for an environment failure
    (`mask_env_failures`) and for a failed trajectory longer than `max_failed_tokens` (> 0).

    >>> sample_weights([False, True, False], [False, True, True], [10, 10, 500],
    ...                mask_env_failures=True, max_failed_tokens=100)
    [1.0, 0.0, 0.0]
    >>> sample_weights([False, True], [False, True], [10, 10])
    [1.0, 1.0]
    """
    return [0.0 if (mask_env_failures and env) or (fail and 0 < max_failed_tokens < n) else 1.0
            for env, fail, n in zip(env_failed, failed, n_tokens)]


def shape_advantages(advs: list[list[float]], neg_weight: float = 1.0, positive_only: bool = False) -> list[list[float]]:
    """Down-weight negative step advantages by `neg_weight`; `positive_only` zeroes them.

    >>> shape_advantages([[1.0, -1.0, 0.0]], neg_weight=0.5), shape_advantages([[1.0, -1.0]], positive_only=True)
    ([[1.0, -0.5, 0.0]], [[1.0, 0.0]])
    """
    return [[a if a >= 0 else 0.0 if positive_only else a * neg_weight for a in traj] for traj in advs]
