"""Exact-number tests of the RL math (l0_min/algo.py), its doctests, and the row builders."""


import math

import pytest
import torch

from l0_min import algo, learner, loss
from l0_min.config import AlgoConfig
from l0_min.episode import ENV_ERROR, Episode, Row, Step, Task, segment_rows, training_rows


def test_discounted_returns_exact():
    assert algo.discounted_returns([1.0, 2.0, 3.0], 0.9) == [1.0 + 0.9 * (2.0 + 0.9 * 3.0), 2.0 + 0.9 * 3.0, 3.0]
    assert algo.discounted_returns([], 0.9) == []


def test_reinforce_pp_normalises_over_all_steps_of_the_batch():
    adv = algo.reinforce_pp_advantages([[0.0, 0.0, 1.0], [0.0]], gamma=1.0, eps=0.0)
    # returns: [1, 1, 1] and [0] -> mean 0.75, std sqrt(3)/4
    assert adv == [[0.57735, 0.57735, 0.57735], [-1.732051]]
    flat = torch.tensor([a for t in adv for a in t])
    assert abs(flat.mean().item()) < 1e-6


def test_rloo_and_grpo_are_zero_for_uniform_groups():
    assert algo.rloo_advantages([1.0, 1.0, 1.0], [0, 0, 0]) == [0.0, 0.0, 0.0]
    assert algo.grpo_advantages([1.0, 1.0], [0, 0]) == [0.0, 0.0]
    with pytest.raises(ValueError, match="algo.advantage"):
        algo.step_advantages([[1.0]], [0], "ppo")


def test_dapo_normalisation_is_independent_of_micro_batching():
    torch.manual_seed(0)
    logp = torch.randn(10, requires_grad=True)
    adv, mask = torch.randn(10), (torch.rand(10) > 0.3).float()
    n = mask.sum().item()
    whole = loss.policy_loss(logp, logp.detach(), adv, mask, n)
    parts = sum(loss.policy_loss(logp[i : i + 3], logp[i : i + 3].detach(), adv[i : i + 3], mask[i : i + 3], n) for i in range(0, 10, 3))
    assert torch.allclose(whole, parts)
    (g1,) = torch.autograd.grad(whole, logp)
    assert torch.allclose(g1, -(adv * mask) / n)


def test_kl_estimators_exact_and_k3_nonnegative():
    lp, ref = torch.tensor([0.0, -1.0]), torch.tensor([-1.0, 0.0])
    assert torch.allclose(loss.kl_penalty(lp, ref, "k1"), torch.tensor([1.0, -1.0]))
    assert torch.allclose(loss.kl_penalty(lp, ref, "k2"), torch.tensor([0.5, 0.5]))
    e = torch.exp(torch.tensor(1.0))
    assert torch.allclose(loss.kl_penalty(lp, ref, "k3"), torch.tensor([1 / e - 1 + 1, e - 1 - 1]))
    assert (loss.kl_penalty(torch.randn(100), torch.randn(100), "k3") >= 0).all()
    with pytest.raises(ValueError, match="kl_estimator"):
        loss.kl_penalty(lp, ref, "k4")


def test_dynamic_sampling_and_stabilisers():
    keep = algo.dynamic_sampling_keep([0.0, 0.0, 0.3, 1.0, 1.0, 1.0, 0.5], [0, 0, 1, 1, 2, 2, 3])
    assert keep == [False, False, True, True, False, False, False]  # a group of one has no variance
    assert algo.shape_advantages([[2.0, -2.0]], neg_weight=0.25) == [[2.0, -0.5]]


def _ep(rewards, group=0, status="answered"):
    steps, ctx = [], [1]
    for i, r in enumerate(rewards):
        steps.append(Step(context_ids=list(ctx), action_ids=[10 + i, 20 + i], action_logprobs=[-1.0, -2.0], reward=r))
        ctx = ctx + [10 + i, 20 + i, 99]
    return Episode(Task("t", "q", ["a"]), steps, group=group, status=status)


def test_training_rows_broadcast_step_advantages_to_action_tokens():
    eps = [_ep([0.0, 1.0]), _ep([0.0, 0.0])]
    rows = training_rows(eps, AlgoConfig(eps=0.0))
    assert [len(r) for r in rows] == [6, 6]
    assert rows[0].ids == [1, 10, 20, 99, 11, 21]
    assert rows[0].mask == [0.0, 1.0, 1.0, 0.0, 1.0, 1.0]
    assert rows[0].adv == [0.0, 1.0, 1.0, 0.0, 1.0, 1.0]
    assert rows[1].adv == [0.0, -1.0, -1.0, 0.0, -1.0, -1.0]
    assert rows[0].old_logp == [0.0, -1.0, -2.0, 0.0, -1.0, -2.0]


def test_step_rewards_enter_reinforce_pp_returns_and_grpo_outcomes_by_hand():
    """reward.step_weight 0.5, answer weight 1 (format and exec 0): two right answers, A's steps with parts
    [0.2, 0, 0.6], B's [0, -0.1, 0]. Per-step rewards A [0.1, 0, 0.3 + 1], B [0, -0.05, 1]; REINFORCE++ returns:
    gamma 1: A [1.4, 1.3, 1.3], B [0.95, 0.95, 1.0]; gamma 0.5: A [0.1 + 0.5 * 0.65, 0 + 0.5 * 1.3, 1.3] =
    [0.425, 0.65, 1.3], B [0.225, 0.45, 1.0]; then one z-score over the six. GRPO's outcome is the total (1.4 and
    0.95: A +1, B -1 in their group of two), where without step rewards both are 1.0 (advantage 0)."""
    from l0_min.config import RewardConfig
    from l0_min.rewards import score_episode

    class Env:
        name = "stepped"
        score = staticmethod(lambda ep: {"core": 1.0})
        step_rewards = staticmethod(lambda ep: ep.parts)

    def scored(parts, weight):
        ep = _ep([0.0] * len(parts))
        ep.parts, ep.final_answer = parts, "a"
        score_episode(ep, RewardConfig(answer_weight=1.0, format_weight=0.0, exec_weight=0.0, step_weight=weight), Env)
        return ep

    a, b = scored([0.2, 0.0, 0.6], 0.5), scored([0.0, -0.1, 0.0], 0.5)
    assert [s.reward for s in a.steps] == pytest.approx([0.1, 0.0, 1.3], abs=1e-12) and a.reward == pytest.approx(1.4)
    assert [s.reward for s in b.steps] == pytest.approx([0.0, -0.05, 1.0], abs=1e-12) and b.reward == pytest.approx(0.95)
    for gamma, want in ((1.0, [[1.4, 1.3, 1.3], [0.95, 0.95, 1.0]]), (0.5, [[0.425, 0.65, 1.3], [0.225, 0.45, 1.0]])):
        got = [algo.discounted_returns([s.reward for s in ep.steps], gamma) for ep in (a, b)]
        assert got == [pytest.approx(w, abs=1e-12) for w in want]
        rows = training_rows([a, b], AlgoConfig(advantage="reinforce++", gamma=gamma, eps=0.0))
        z = algo.zscore(want[0] + want[1], eps=0.0)
        assert [r.adv[1 + 3 * i] for r in rows for i in range(3)] == pytest.approx(z, abs=1e-6), gamma
    assert algo.step_advantages([[s.reward for s in ep.steps] for ep in (a, b)], [0, 0], "grpo", eps=0.0) == \
        [[1.0] * 3, [-1.0] * 3]
    plain = [scored(p, 0.0) for p in ([0.2, 0.0, 0.6], [0.0, -0.1, 0.0])]  # outcome only: nothing to tell them apart
    assert algo.step_advantages([[s.reward for s in ep.steps] for ep in plain], [0, 0], "grpo") == [[0.0] * 3] * 2


def test_env_failures_masked_only_when_asked():
    eps = [_ep([1.0]), _ep([0.0], status=ENV_ERROR)]
    assert training_rows(eps, AlgoConfig())[1].mask == [0.0, 1.0, 1.0]
    assert training_rows(eps, AlgoConfig(mask_env_failures=True))[1].mask == [0.0, 0.0, 0.0]


def test_segment_rows_rejects_a_broken_prefix():
    s0 = Step(context_ids=[1, 2], action_ids=[3], action_logprobs=[-1.0])
    s1 = Step(context_ids=[1, 7, 3, 9], action_ids=[4], action_logprobs=[-1.0])
    with pytest.raises(ValueError, match="not a prefix"):
        segment_rows(Episode(Task("t", "q", []), [s0, s1]), [1.0, 1.0])


def test_pack_rows_fills_budget_without_padding():
    rows = [Row([0] * n, [0.0] * n, [0.0] * n, [0.0] * n) for n in [300, 200, 500, 100, 400, 250, 250]]
    packed = learner.pack_rows(rows, budget=1000)
    assert sorted(len(r) for mb in packed for r in mb) == sorted(len(r) for r in rows)
    assert all(sum(len(r) for r in mb) <= 1000 for mb in packed)
    assert len(packed) == 2  # 2000 tokens in two full micro-batches


def test_pack_rows_spreads_rows_evenly_over_as_many_micro_batches_as_first_fit_needs():
    import random

    row = lambda n: Row([0] * n, [0.0] * n, [0.0] * n, [0.0] * n)
    load = lambda bins: sorted(sum(map(len, mb)) for mb in bins)
    # 65,536 tokens at 32,768 (issue 27's shape): first fit makes 32,600 + 22,936 + a 10,000 pass; even: ~21.8k each
    rows = [row(n) for n in (20000, 12600, 12000, 10936, 10000)]
    assert load(learner.pack_rows(rows, 32768, balance=False)) == [10000, 22936, 32600]
    assert load(learner.pack_rows(rows, 32768)) == [20000, 22600, 22936]
    rng = random.Random(0)
    for trial in range(300):  # any rows (some longer than the budget): as many micro-batches, each row once,
        budget = rng.choice([64, 100, 512])  # each within the budget (or a row alone)
        rows = [row(rng.randint(1, budget * 5 // 4)) for _ in range(rng.randint(1, 40))]
        first_fit, even = learner.pack_rows(rows, budget, balance=False), learner.pack_rows(rows, budget)
        assert len(even) == len(first_fit), trial
        assert sorted(map(id, (r for mb in even for r in mb))) == sorted(map(id, rows)), trial
        assert all(sum(map(len, mb)) <= budget or len(mb) == 1 for mb in even), trial


def test_chunk_level_ratio_loss_and_gradient_by_hand():
    """Issue 36, algo.ratio_level chunk: one importance ratio per agent step's action, the geometric mean of its
    tokens' ratios (ROLL's IPA, GSPO's sequence ratio per chunk). By hand, two chunks [0, 1] and [3], N = 3:
    - behaviour correction: chunk 0's ratio exp((0 + 1) / 2) = 1.6487 (TIS cap 1.5 -> weight 1.5 on both tokens),
      chunk 1's exp(-1) = 0.3679, outside the band (0.5, 2): masked whole;
    - PPO (old = logp + [0.2, -0.2, 0, 0.4]): chunk 0's ratio is exp of the mean of -0.2 and +0.2, 1, unclipped;
      both its tokens carry ratio * A, and d ratio / d logp_t = ratio / |chunk|, so d loss / d logp_t =
      -|chunk| * A * ratio / |chunk| / N = -A / N = -2 / 3, where per token ratio exp(+0.2) = 1.22 > 1.2 clips;
    - on-policy (no clip) the chunk and token levels have the same gradient: -A_t / N per action token."""
    import torch

    from l0_min import loss

    mask = torch.tensor([1.0, 1.0, 0.0, 1.0])
    chunk = loss.chunks(mask)
    assert chunk.tolist() == [0, 0, -1, 1]
    prox, behav = torch.tensor([-1.0, -1.0, 0.0, -2.0]), torch.tensor([-1.0, -2.0, 0.0, -1.0])
    w, keep = loss.behaviour_weights(prox, behav, cap=1.5, band=(0.5, 2.0), chunk=chunk)
    assert w.tolist() == pytest.approx([1.5, 1.5, 1.0, math.exp(-1)], abs=1e-6) and keep.tolist() == [1, 1, 1, 0]
    tw, tkeep = loss.behaviour_weights(prox, behav, cap=1.5, band=(0.5, 2.0))  # per token: token 1 alone is e^1
    assert tw.tolist() == pytest.approx([1.0, 1.5, 1.0, math.exp(-1)], abs=1e-6) and tkeep.tolist() == [1, 0, 1, 0]

    adv = torch.tensor([2.0, 2.0, 0.0, -1.0])
    logp = torch.tensor([-0.5, -1.5, 0.0, -0.7], requires_grad=True)
    old = logp.detach() + torch.tensor([0.2, -0.2, 0.0, 0.4])
    g = torch.autograd.grad(loss.policy_loss(logp, old, adv, mask, 3.0, 0.2, chunk), logp)[0]
    # chunk 1: ratio exp(-0.4) = 0.670, A = -1 < 0: the clipped -0.8 is the min of -0.670 and -0.8, no gradient
    assert g.tolist() == pytest.approx([-2 / 3, -2 / 3, 0.0, 0.0], abs=1e-6)
    g_token = torch.autograd.grad(loss.policy_loss(logp, old, adv, mask, 3.0, 0.2), logp)[0]
    # per token: ratios exp(-0.2) = 0.819 and exp(0.2) = 1.221 (A = 2 > 0: 1.221 is clipped to 1.2, no gradient)
    assert g_token.tolist() == pytest.approx([-2 * math.exp(-0.2) / 3, 0.0, 0.0, 0.0], abs=1e-6)
    for c in (chunk, None):  # on-policy: the REINFORCE gradient, -A / N on every action token, either level
        g = torch.autograd.grad(loss.policy_loss(logp, logp.detach(), adv, mask, 3.0, None, c), logp)[0]
        assert g.tolist() == pytest.approx([-2 / 3, -2 / 3, 0.0, 1 / 3], abs=1e-6)
