"""Each function of rlhf_pipeline.functional, alone, against numbers computed by hand.

Expected values are literals (worked out in the comments) or tiny independent math/numpy
computations; none is produced by calling the function under test.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rlhf_pipeline import functional as fn
from rlhf_pipeline.ppo import advantages, kl, losses, trainer
from rlhf_pipeline.reward import normalization, training


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=torch.float64),
        torch.as_tensor(expected, dtype=torch.float64),
        atol=atol,
        rtol=0,
    )


# --------------------------------------------------------------------------------------------
# masked statistics
# --------------------------------------------------------------------------------------------
def test_masked_mean_plain_masked_and_dim():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    m = torch.tensor([[1, 1, 0], [0, 1, 0]])
    close(fn.masked_mean(x), 3.5)
    close(fn.masked_mean(x, dim=0), [2.5, 3.5, 4.5])
    close(fn.masked_mean(x, m), 8.0 / 3.0)  # (1 + 2 + 5) / 3
    close(fn.masked_mean(x, m.bool(), dim=1), [1.5, 5.0])
    per_col = fn.masked_mean(x, m.float(), dim=0)
    close(per_col[:2], [1.0, 3.5])
    assert torch.isnan(per_col[2])  # empty column: 0 / 0


def test_masked_mean_ignores_nan_in_masked_out_positions():
    x = torch.tensor([1.0, float("nan"), 3.0, float("inf")])
    m = torch.tensor([True, False, True, False])
    close(fn.masked_mean(x, m), 2.0)


def test_masked_var_biased_unbiased_and_errors():
    x = torch.tensor([1.0, 2.0, 3.0, 4.0])
    close(fn.masked_var(x), 1.25)  # mean 2.5; (2.25 + .25 + .25 + 2.25) / 4
    close(fn.masked_var(x, unbiased=True), 5.0 / 3.0)
    m = torch.tensor([1, 1, 1, 0])
    close(fn.masked_var(x, m), 2.0 / 3.0)  # mean 2; (1 + 0 + 1) / 3
    close(fn.masked_var(x, m, unbiased=True), 1.0)  # (1 + 0 + 1) / 2
    with pytest.raises(ValueError):
        fn.masked_var(x, torch.zeros(4, dtype=torch.bool))
    with pytest.raises(ValueError):
        fn.masked_var(x, torch.tensor([0, 1, 0, 0]), unbiased=True)


def test_whiten_shift_mean_true():
    x = torch.tensor([1.0, 2.0, 3.0, 4.0])
    # mean 2.5, biased var 1.25: (x - 2.5) / sqrt(1.25)
    s = math.sqrt(1.25 + 1e-8)
    w = fn.whiten(x)
    close(w, [-1.5 / s, -0.5 / s, 0.5 / s, 1.5 / s])
    close(w, [-1.3416408, -0.4472136, 0.4472136, 1.3416408])
    close(w.mean(), 0.0)
    close(w.var(unbiased=False), 1.0, atol=1e-5)


def test_whiten_shift_mean_false_keeps_the_mean():
    x = torch.tensor([1.0, 2.0, 3.0, 4.0])
    w = fn.whiten(x, shift_mean=False)
    close(w, [1.1583592, 2.0527864, 2.9472136, 3.8416408])
    close(w.mean(), 2.5)
    close(w.var(unbiased=False), 1.0, atol=1e-5)


def test_whiten_with_mask_zeroes_masked_out_and_uses_masked_stats():
    x = torch.tensor([[1.0, 2.0], [3.0, 100.0]])
    m = torch.tensor([[True, True], [True, False]])
    # masked mean 2, biased var 2/3
    s = math.sqrt(2.0 / 3.0 + 1e-8)
    close(fn.whiten(x, m), [[-1.0 / s, 0.0], [1.0 / s, 0.0]])
    close(fn.whiten(x, m, shift_mean=False), [[2.0 - 1.0 / s, 2.0], [2.0 + 1.0 / s, 0.0]])


# --------------------------------------------------------------------------------------------
# response post-processing
# --------------------------------------------------------------------------------------------
def test_first_true_indices():
    b = torch.tensor([[False, True, True], [False, False, False], [True, False, False]])
    out = fn.first_true_indices(b)
    assert out.tolist() == [1, 3, 0]
    assert out.dtype == torch.long
    assert fn.first_true_indices(b.int(), dtype=torch.int32).dtype == torch.int32
    assert fn.first_true_indices(torch.tensor([[[0, 0, 1]], [[1, 1, 1]]])).tolist() == [[2], [0]]


PAD, DOT = 99, 13


def test_truncate_response_examples():
    responses = torch.tensor(
        [
            [DOT, 5, 6, DOT, 7, 8],  # DOT at 0 < truncate_after ignored; cut after index 3
            [5, 6, DOT, 7, DOT, 8],  # DOT exactly at truncate_after=2 is kept
            [5, DOT, 6, 7, 8, 9],  # only DOT is too early -> invalid, unchanged
            [1, 2, 3, 4, 5, DOT],  # DOT at the last position: nothing to pad
            [1, 2, 3, 4, 5, 6],  # no DOT at all -> invalid, unchanged
        ]
    )
    before = responses.clone()
    out, valid = fn.truncate_response(responses, DOT, truncate_after=2, pad_token_id=PAD)
    assert out.tolist() == [
        [DOT, 5, 6, DOT, PAD, PAD],
        [5, 6, DOT, PAD, PAD, PAD],
        [5, DOT, 6, 7, 8, 9],
        [1, 2, 3, 4, 5, DOT],
        [1, 2, 3, 4, 5, 6],
    ]
    assert valid.tolist() == [True, True, False, True, False]
    assert valid.dtype == torch.bool
    assert torch.equal(responses, before)  # not modified in place


def test_truncate_response_truncate_after_zero_and_disabled():
    responses = torch.tensor([[DOT, 5, DOT], [4, 5, 6]])
    out, valid = fn.truncate_response(responses, DOT, truncate_after=0, pad_token_id=PAD)
    assert out.tolist() == [[DOT, PAD, PAD], [4, 5, 6]]
    assert valid.tolist() == [True, False]
    out, valid = fn.truncate_response(responses, None, truncate_after=0, pad_token_id=PAD)
    assert out.tolist() == [[DOT, 5, DOT], [4, 5, 6]]
    assert valid.tolist() == [True, True]


def test_apply_penalty():
    out = fn.apply_penalty(torch.tensor([0.5, 2.0, -0.3]), torch.tensor([True, False, True]), -1.0)
    close(out, [0.5, -1.0, -0.3])
    assert out.dtype == torch.float32
    out = fn.apply_penalty(torch.tensor([0.5, 2.0]), torch.tensor([0, 1]), -3)
    close(out, [-3.0, 2.0])


def test_response_mask_after_eos():
    r = torch.tensor([[3, 0, 4, 0], [3, 4, 5, 6], [0, 1, 2, 3]])
    m = fn.response_mask_after_eos(r, eos_token_id=0)
    assert m.dtype == torch.bool
    assert m.tolist() == [[True, True, False, False], [True, True, True, True], [True, False, False, False]]
    assert fn.response_mask_after_eos(r, None).tolist() == [[True] * 4] * 3


# --------------------------------------------------------------------------------------------
# rewards and advantages
# --------------------------------------------------------------------------------------------
def test_kl_penalty_k1_and_k3_by_hand():
    logp = torch.tensor([-1.0, -2.0, -0.7])
    ref = torch.tensor([-1.5, -1.0, -0.7])
    close(kl.kl_penalty(logp, ref), [0.5, -1.0, 0.0])
    close(kl.kl_penalty(logp, ref, "k1"), [0.5, -1.0, 0.0])
    # log r = ref - logp = [-0.5, 1, 0]; k3 = e^{log r} - 1 - log r
    close(kl.kl_penalty(logp, ref, "k3"), [0.60653066 - 1 + 0.5, 2.71828183 - 1 - 1, 0.0])
    with pytest.raises(ValueError):
        kl.kl_penalty(logp, ref, "k2")


def test_kl_penalty_k3_is_nonnegative():
    g = torch.Generator().manual_seed(0)
    logp = torch.randn(64, 16, generator=g) * 3
    ref = torch.randn(64, 16, generator=g) * 3
    k3 = kl.kl_penalty(logp, ref, "k3")
    assert (k3 >= 0).all()
    assert (k3 > 0).any()
    assert (kl.kl_penalty(logp, ref, "k1") < 0).any()  # k1 can be negative per token


def test_compute_rewards_score_at_last_column_without_mask():
    scores = torch.tensor([1.0, 2.0])
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0]])
    ref = torch.tensor([[-1.5, -1.5, -1.5], [-1.0, -2.0, -0.5]])
    # k1 = [[.5, -.5, -1.5], [0, 1, -.5]]; -0.1 * k1
    rewards, non_score = kl.compute_rewards(scores, logp, ref, kl_coef=0.1)
    close(non_score, [[-0.05, 0.05, 0.15], [0.0, -0.1, 0.05]])
    close(rewards, [[-0.05, 0.05, 1.15], [0.0, -0.1, 2.05]])


def test_compute_rewards_score_at_last_mask_position():
    scores = torch.tensor([1.0, 2.0, 3.0])
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
    ref = torch.tensor([[-1.5, -1.5, -1.5], [-1.0, -2.0, -0.5], [-2.0, -2.0, -2.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0]])
    rewards, non_score = kl.compute_rewards(scores, logp, ref, kl_coef=0.1, mask=mask)
    close(non_score, [[-0.05, 0.05, 0.15], [0.0, 0.0, 0.0], [-0.1, -0.1, 0.0]])
    close(rewards, [[-0.05, 0.05, 1.15], [2.0, 0.0, 0.0], [-0.1, 2.9, 0.0]])


def test_compute_rewards_k3_and_tensor_coef():
    scores = torch.tensor([0.0])
    logp = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -1.0]])
    rewards, non_score = kl.compute_rewards(scores, logp, ref, torch.tensor(2.0), estimator="k3")
    k3 = [math.exp(-0.5) - 1 + 0.5, math.exp(1.0) - 1 - 1]
    close(non_score, [[-2 * k3[0], -2 * k3[1]]])
    close(rewards, [[-2 * k3[0], -2 * k3[1]]])


def test_gae_three_steps_gamma_one_lam_095():
    r = torch.tensor([[0.0, 0.0, 1.0]])
    v = torch.tensor([[0.5, 0.4, 0.8]])
    # t=2: delta = 1 - .8 = .2;            A2 = .2
    # t=1: delta = 0 + .8 - .4 = .4;       A1 = .4 + .95 * .2 = .59
    # t=0: delta = 0 + .4 - .5 = -.1;      A0 = -.1 + .95 * .59 = .4605
    adv, ret = advantages.gae(r, v, gamma=1.0, lam=0.95)
    close(adv, [[0.4605, 0.59, 0.2]])
    close(ret, [[0.9605, 0.99, 1.0]])


def test_gae_with_discount():
    r = torch.tensor([[1.0, 2.0]])
    v = torch.tensor([[1.0, 1.0]])
    # t=1: delta = 2 - 1 = 1; A1 = 1.   t=0: delta = 1 + .5 - 1 = .5; A0 = .5 + .25 * 1 = .75
    adv, ret = advantages.gae(r, v, gamma=0.5, lam=0.5)
    close(adv, [[0.75, 1.0]])
    close(ret, [[1.75, 2.0]])


def test_gae_with_mask_ends_the_episode_at_the_mask():
    r = torch.tensor([[0.0, 1.0, 5.0]])
    v = torch.tensor([[0.5, 0.8, 9.0]])
    m = torch.tensor([[True, True, False]])
    # masked -> r = [0, 1, 0], V = [.5, .8, 0]
    # t=2: 0.  t=1: delta = 1 - .8 = .2; A1 = .2.  t=0: delta = .8 - .5 = .3; A0 = .3 + .95*.2 = .49
    adv, ret = advantages.gae(r, v, gamma=1.0, lam=0.95, mask=m)
    close(adv, [[0.49, 0.2, 0.0]])
    close(ret, [[0.99, 1.0, 0.0]])


def test_sequence_returns_sum_the_tokens_that_count():
    r = torch.tensor([[0.1, -0.2, 1.0], [0.5, 2.0, 9.0]])
    m = torch.tensor([[True, True, True], [True, True, False]])
    close(advantages.sequence_returns(r, m), [0.9, 2.5])  # .1 - .2 + 1;  .5 + 2 (the 9 is padding)
    close(advantages.sequence_returns(r), [0.9, 11.5])


def test_rloo_subtracts_the_mean_of_the_other_samples_of_the_query():
    # two queries, k = 3, query-major rows: [1, 2, 6] and [0, 0, 3]
    #   1 - (2 + 6)/2 = -3;  2 - (1 + 6)/2 = -1.5;  6 - (1 + 2)/2 = 4.5
    #   0 - (0 + 3)/2 = -1.5 (twice);  3 - 0 = 3
    returns = torch.tensor([1.0, 2.0, 6.0, 0.0, 0.0, 3.0])
    close(advantages.rloo(returns, 3), [-3.0, -1.5, 4.5, -1.5, -1.5, 3.0])
    # = k/(k-1) (R - mean): the leave-one-out baseline is the group mean, rescaled
    close(advantages.rloo(returns, 3), 1.5 * (returns - returns.view(2, 3).mean(-1).repeat_interleave(3)))
    with pytest.raises(ValueError, match="samples_per_query=4"):
        advantages.rloo(returns, 4)
    with pytest.raises(ValueError, match="samples_per_query=1"):
        advantages.rloo(returns, 1)


def test_grpo_standardises_within_the_query_s_samples():
    # group [1, 2, 6]: mean 3, unbiased std sqrt((4 + 1 + 9)/2) = sqrt(7) = 2.6458
    #   (1-3)/2.6458 = -0.7559;  (2-3)/2.6458 = -0.3780;  (6-3)/2.6458 = 1.1339
    # group [5, 5, 5]: every sample alike -> 0 (no signal), not a division by zero
    returns = torch.tensor([1.0, 2.0, 6.0, 5.0, 5.0, 5.0])
    close(advantages.grpo(returns, 3, eps=0.0)[:3], [-0.755929, -0.377964, 1.133893])
    close(advantages.grpo(returns, 3), [-0.755901, -0.377950, 1.133851, 0.0, 0.0, 0.0])


def test_critic_free_advantages_weigh_every_token_of_the_response():
    r = torch.tensor([[0.0, 1.0], [0.0, 3.0], [0.5, 0.5], [0.0, 0.0]])
    m = torch.tensor([[True, True], [True, True], [True, False], [True, True]])
    # returns [1, 3, .5, 0]; RLOO with k = 2: [1 - 3, 3 - 1, .5 - 0, 0 - .5] = [-2, 2, .5, -.5]
    adv, returns = advantages.estimate("rloo", r, None, m, gamma=1.0, lam=0.95, samples_per_query=2)
    close(adv, [[-2.0, -2.0], [2.0, 2.0], [0.5, 0.0], [-0.5, -0.5]])
    assert returns is None
    adv, returns = advantages.estimate("gae", r, torch.zeros(4, 2), m, gamma=1.0, lam=1.0, samples_per_query=1)
    close(adv, [[1.0, 1.0], [3.0, 3.0], [0.5, 0.0], [0.0, 0.0]])  # lam 1, V 0: the return-to-go
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'"):
        advantages.estimate("ppo", r, None, m, 1.0, 0.95, 2)


# --------------------------------------------------------------------------------------------
# PPO losses
# --------------------------------------------------------------------------------------------
def _policy_case():
    # ratios [1, 1.5, .5, .5] with advantages [1, 2, -1, 1], cliprange .2:
    #   1: pg1 = -1,   pg2 = -1     -> -1    (not clipped)
    #   2: pg1 = -3,   pg2 = -2.4   -> -2.4  (clipped)
    #   3: pg1 = .5,   pg2 = .8     -> .8    (clipped)
    #   4: pg1 = -.5,  pg2 = -.8    -> -.5   (not clipped)
    old = torch.tensor([-1.0, -2.0, -0.5, -1.0])
    logp = old + torch.log(torch.tensor([1.0, 1.5, 0.5, 0.5]))
    adv = torch.tensor([1.0, 2.0, -1.0, 1.0])
    return logp.clone().requires_grad_(True), old, adv


def test_policy_loss_values_and_stats():
    logp, old, adv = _policy_case()
    loss, stats = losses.policy_loss(logp, old, adv, cliprange=0.2)
    close(loss, (-1.0 - 2.4 + 0.8 - 0.5) / 4)  # -0.775
    close(stats["clipfrac"], 0.5)
    close(stats["approxkl"], 0.5 * (math.log(1.5) ** 2 + 2 * math.log(0.5) ** 2) / 4)
    close(stats["ratio_mean"], 0.875)
    close(stats["ratio_max"], 1.5)
    assert set(stats) == {"clipfrac", "approxkl", "ratio_mean", "ratio_max"}
    assert all(not s.requires_grad and s.dim() == 0 for s in stats.values())


def test_policy_loss_gradient_flows_only_through_unclipped_terms():
    logp, old, adv = _policy_case()
    loss, _ = losses.policy_loss(logp, old, adv, cliprange=0.2)
    loss.backward()
    # d/dlogp (-A * ratio) / 4 = -A * ratio / 4 where unclipped; 0 where the clip is active
    close(logp.grad, [-0.25, 0.0, 0.0, -0.125])


def test_policy_loss_with_mask():
    logp, old, adv = _policy_case()
    loss, stats = losses.policy_loss(logp, old, adv, 0.2, mask=torch.tensor([1, 0, 1, 1]))
    close(loss, (-1.0 + 0.8 - 0.5) / 3)
    close(stats["clipfrac"], 1.0 / 3.0)
    close(stats["ratio_max"], 1.0)  # the 1.5 is masked out
    close(stats["ratio_mean"], 2.0 / 3.0)
    close(stats["approxkl"], 0.5 * (2 * math.log(0.5) ** 2) / 3)


def _value_case():
    # 1: v=1,   old=1, R=2:  vclip=1,   e1=1,   e2=1    -> 1    (not clipped)
    # 2: v=1.5, old=1, R=2:  vclip=1.2, e1=.25, e2=.64  -> .64  (clipped)
    # 3: v=1.5, old=1, R=1:  vclip=1.2, e1=.25, e2=.04  -> .25
    # 4: v=0,   old=1, R=.5: vclip=.8,  e1=.25, e2=.09  -> .25
    v = torch.tensor([1.0, 1.5, 1.5, 0.0], requires_grad=True)
    old = torch.tensor([1.0, 1.0, 1.0, 1.0])
    ret = torch.tensor([2.0, 2.0, 1.0, 0.5])
    return v, old, ret


def test_value_loss_values_and_clipfrac():
    v, old, ret = _value_case()
    loss, stats = losses.value_loss(v, old, ret, cliprange_value=0.2)
    close(loss, 0.5 * (1.0 + 0.64 + 0.25 + 0.25) / 4)  # 0.2675
    close(stats["clipfrac"], 0.25)
    assert not stats["clipfrac"].requires_grad
    loss.backward()
    # d/dv .5 * mean((v-R)^2) = (v - R) / 4 where unclipped; 0 on the clipped entry
    close(v.grad, [-0.25, 0.0, 0.125, -0.125])


def test_value_loss_with_mask():
    v, old, ret = _value_case()
    loss, stats = losses.value_loss(v, old, ret, 0.2, mask=torch.tensor([False, True, True, False]))
    close(loss, 0.5 * (0.64 + 0.25) / 2)
    close(stats["clipfrac"], 0.5)


# --------------------------------------------------------------------------------------------
# logits
# --------------------------------------------------------------------------------------------
def test_logprobs_and_entropy():
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [0.0, math.log(3.0), -1e9, -1e9]]])
    logprobs, h = fn.logprobs_and_entropy(logits, torch.tensor([[2, 1]]))
    assert h.shape == logprobs.shape == (1, 2)
    # uniform over 4: ln 4; p = [.25, .75]: -(.25 ln .25 + .75 ln .75)
    close(h, [[math.log(4.0), 0.25 * math.log(4.0) + 0.75 * math.log(4.0 / 3.0)]])
    close(logprobs, [[math.log(0.25), math.log(0.75)]])
    close(logprobs, fn.logprobs_from_logits(logits, torch.tensor([[2, 1]])))  # the same as the gather path


def test_entropy_of_a_masked_token_is_finite_with_its_gradient():
    logits = torch.tensor([[0.0, 0.0, -1e9]], requires_grad=True)  # masked the way never_pad masks
    logprobs, h = fn.logprobs_and_entropy(logits, torch.tensor([0]))
    close(h, [math.log(2.0)])
    close(logprobs, [math.log(0.5)])
    (h.sum() + logprobs.sum()).backward()
    assert torch.isfinite(logits.grad).all()


def test_logprobs_from_logits():
    logits = torch.tensor([[[0.0, math.log(3.0)], [1.0, 1.0]], [[2.0, 0.0], [0.0, 0.0]]])
    labels = torch.tensor([[1, 0], [0, 1]])
    lp = fn.logprobs_from_logits(logits, labels)
    assert lp.shape == (2, 2)
    e2 = math.exp(2.0)
    close(lp, [[math.log(0.75), math.log(0.5)], [math.log(e2 / (e2 + 1)), math.log(0.5)]])
    lp16 = fn.logprobs_from_logits(logits.bfloat16(), labels)
    assert lp16.dtype == torch.float32
    close(lp16, [[math.log(0.75), math.log(0.5)], [math.log(e2 / (e2 + 1)), math.log(0.5)]], atol=1e-2)


# --------------------------------------------------------------------------------------------
# KL controllers
# --------------------------------------------------------------------------------------------
def test_adaptive_kl_controller_clipped_high():
    ctl = kl.AdaptiveKLController(0.15, target=6.0, horizon=10000)
    ctl.update(9.0, n_steps=512)  # 9/6 - 1 = .5 -> clipped to .2
    close(ctl.value, 0.15 * (1 + 0.2 * 512 / 10000))  # 0.151536
    close(ctl.value, 0.151536)


def test_adaptive_kl_controller_clipped_low_and_inside_range():
    ctl = kl.AdaptiveKLController(0.15, target=6.0, horizon=10000)
    ctl.update(0.0, n_steps=512)  # -1 -> clipped to -.2
    close(ctl.value, 0.148464)
    ctl = kl.AdaptiveKLController(0.15, target=6.0, horizon=10000)
    ctl.update(torch.tensor(6.6), n_steps=512)  # .1, not clipped
    close(ctl.value, 0.15 * 1.00512)
    ctl.update(6.6, n_steps=512)  # multiplicative
    close(ctl.value, 0.15 * 1.00512**2)


def test_adaptive_kl_controller_state_dict_round_trip():
    ctl = kl.AdaptiveKLController(0.15, target=6.0, horizon=10000)
    ctl.update(9.0, 512)
    state = ctl.state_dict()
    restored = kl.AdaptiveKLController(1.0, target=1.0, horizon=1.0)
    restored.load_state_dict(state)
    assert restored.value == ctl.value
    assert restored.target == 6.0 and restored.horizon == 10000.0
    restored.update(9.0, 512)
    ctl.update(9.0, 512)
    assert restored.value == ctl.value
    assert isinstance(state["value"], float)


def test_fixed_kl_controller():
    ctl = kl.FixedKLController(0.2)
    ctl.update(100.0, 512)
    assert ctl.value == 0.2
    other = kl.FixedKLController(0.9, target=6.0, horizon=10000)
    other.load_state_dict(ctl.state_dict())
    assert other.value == 0.2


# --------------------------------------------------------------------------------------------
# schedules, reward model, batching
# --------------------------------------------------------------------------------------------
def test_linear_anneal():
    assert fn.linear_anneal(0, 10, 3e-4) == pytest.approx(3e-4)
    assert fn.linear_anneal(5, 10, 1.0) == pytest.approx(0.5)
    assert fn.linear_anneal(9, 10, 2.0) == pytest.approx(0.2)
    assert fn.linear_anneal(10, 10, 2.0) == pytest.approx(0.0)
    with pytest.raises(ValueError):
        fn.linear_anneal(0, 0, 1.0)


def test_best_of_n_loss_by_hand():
    rewards = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, math.log(2.0)], [1.0, 0.0, 0.0]], requires_grad=True)
    best = torch.tensor([0, 2, 1])
    # row 0: -log(e / (e + 2)) = log(e + 2) - 1;  row 1: -log(2 / 4) = log 2;  row 2: log(e + 2)
    loss, acc = training.best_of_n_loss(rewards, best)
    e = math.e
    close(loss, (math.log(e + 2) - 1 + math.log(2.0) + math.log(e + 2)) / 3)  # 0.9320122
    close(acc, 2.0 / 3.0)
    assert not acc.requires_grad
    loss.backward()
    # d/dr_i of CE / B = (softmax_i - onehot_i) / 3
    close(rewards.grad[1], [0.25 / 3, 0.25 / 3, -0.5 / 3])


def test_best_of_n_loss_margin():
    rewards = torch.tensor([[math.log(3.0), 0.0]])
    loss, acc = training.best_of_n_loss(rewards, torch.tensor([0]), margin=torch.tensor([math.log(3.0)]))
    close(loss, math.log(2.0))  # logits become [0, 0]
    close(acc, 1.0)  # accuracy on the raw rewards


def test_pairwise_loss_by_hand():
    close(training.pairwise_loss(torch.tensor([1.0]), torch.tensor([0.0])), math.log(1 + math.exp(-1.0)))
    close(
        training.pairwise_loss(
            torch.tensor([math.log(3.0), 2.0]), torch.tensor([0.0, 2.0]), torch.tensor([math.log(3.0), 0.0])
        ),
        math.log(2.0),
    )


def test_pairwise_loss_equals_best_of_two():
    g = torch.Generator().manual_seed(1)
    chosen, rejected, margin = torch.randn(3, 7, generator=g)
    close(
        training.pairwise_loss(chosen, rejected),
        training.best_of_n_loss(torch.stack([chosen, rejected], dim=1), torch.zeros(7, dtype=torch.long))[0],
    )
    # chosen in column 1 this time, with a margin
    close(
        training.pairwise_loss(chosen, rejected, margin),
        training.best_of_n_loss(torch.stack([rejected, chosen], dim=1), torch.ones(7, dtype=torch.long), margin)[0],
    )


def test_normalization_gain_bias():
    assert normalization.normalization_gain_bias(2.0, 4.0) == pytest.approx((0.25, -0.5))
    gain_bias = normalization.normalization_gain_bias(torch.tensor(2.0), torch.tensor(4.0), 1.0, 2.0)
    assert gain_bias == pytest.approx((0.5, 0.0))
    rng = np.random.default_rng(0)
    samples = rng.normal(3.0, 5.0, size=1000)
    gain, bias = normalization.normalization_gain_bias(samples.mean(), samples.std())
    normed = gain * samples + bias
    assert normed.mean() == pytest.approx(0.0, abs=1e-9)
    assert normed.std() == pytest.approx(1.0)
    with pytest.raises(ValueError):
        normalization.normalization_gain_bias(1.0, 0.0)


def test_minibatch_indices():
    out = trainer.minibatch_indices(8, 2, 2, torch.Generator().manual_seed(0))
    expected = torch.randperm(8, generator=torch.Generator().manual_seed(0))
    assert len(out) == 2 and all(len(mb) == 2 for mb in out)
    assert all(micro.shape == (2,) for mb in out for micro in mb)
    flat = torch.cat([micro for mb in out for micro in mb])
    assert torch.equal(flat, expected)
    assert sorted(flat.tolist()) == list(range(8))
    # one minibatch of one microbatch is the whole permutation
    whole = trainer.minibatch_indices(6, 1, 6, torch.Generator().manual_seed(3))
    assert len(whole) == 1 and len(whole[0]) == 1 and sorted(whole[0][0].tolist()) == list(range(6))


def test_minibatch_indices_rejects_uneven_splits():
    with pytest.raises(ValueError):
        trainer.minibatch_indices(8, 3, 1, None)
    with pytest.raises(ValueError):
        trainer.minibatch_indices(8, 2, 3, None)


def test_non_finite_tensors_names_each_bad_tensor_and_skips_none():
    named = {
        "a": torch.ones(3),
        "b": torch.tensor([1.0, float("nan")]),
        "c": None,
        "d": torch.tensor(float("-inf")),
        "e": torch.zeros(2, 2),
    }
    assert fn.non_finite_tensors(named) == ["b", "d"]
    assert fn.non_finite_tensors({"c": None}) == [] and fn.non_finite_tensors({}) == []


def test_non_finite_tensors_is_exact_where_a_sum_would_mislead():
    """The check reads sums first: opposite infinities (a NaN sum) are still named, and finite values
    whose float32 sum overflows are not (the element-by-element check decides)."""
    big = torch.full((4,), 3.0e38)
    assert torch.isinf(big.sum())  # the sum overflows although every value is finite
    named = {
        "overflowing": big,
        "opposite_infinities": torch.tensor([float("inf"), float("-inf")]),
        "half": torch.tensor([1.0, float("inf")], dtype=torch.bfloat16),
        "fine": torch.randn(5, 5),
    }
    assert fn.non_finite_tensors(named) == ["opposite_infinities", "half"]
    assert fn.non_finite_tensors({"overflowing": big}) == []


def test_kl_trend_is_the_least_squares_line_at_the_last_point():
    # exactly linear: the line itself; one point: that point and slope 0
    assert kl.kl_trend([0.0, 1.0, 2.0, 3.0, 4.0], window=3) == pytest.approx((4.0, 1.0))
    assert kl.kl_trend([2.5], window=4) == (2.5, 0.0)
    # noisy: numpy's least-squares fit of the last four points, evaluated at the last one
    points = [1.64, 1.53, 1.66, 3.28, 3.50, 5.16, 4.02]
    slope, intercept = np.polyfit(np.arange(4), points[-4:], 1)
    assert kl.kl_trend(points, window=4) == pytest.approx((intercept + 3 * slope, slope))
    with pytest.raises(ValueError):
        kl.kl_trend([], window=4)


def test_kl_forecast_adds_one_update_of_growth_to_the_level():
    # level 4.0 + growth 1.0; a falling trend adds no growth: the level alone
    assert kl.kl_forecast([2.0, 3.0, 4.0], window=3) == pytest.approx(5.0)
    assert kl.kl_forecast([5.0, 4.5, 4.0], window=3) == pytest.approx(4.0)


@pytest.mark.parametrize(
    ("largest_within", "search", "tried", "kept"),
    [
        (0.6, "halve", [0.5], 0.5),  # the first fit ends the search
        (0.6, "bisect", [0.5, 0.75, 0.625], 0.5),  # 0.75 and 0.625 over: the largest within is 0.5
        (0.8, "bisect", [0.5, 0.75, 0.875], 0.75),
        (0.3, "halve", [0.5, 0.25], 0.25),
        (0.3, "bisect", [0.5, 0.25, 0.375], 0.25),  # below half, bisection refines upwards too
        (0.1, "halve", [0.5, 0.25, 0.125], None),
        (0.1, "bisect", [0.5, 0.25, 0.125], None),  # nothing within: the policy before the update
    ],
)
def test_the_budget_line_search_keeps_the_largest_fraction_its_search_read_within(largest_within, search, tried, kept):
    # the KL grows along the step: fractions up to largest_within are within the budget
    reads = []

    def within(fraction):
        reads.append(fraction)
        return fraction <= largest_within

    assert kl.budget_line_search(within, 3, search) == kept and reads == tried
    with pytest.raises(ValueError, match="unknown budget search 'linear'"):
        kl.budget_line_search(within, 3, "linear")


def test_the_budget_verdict_rolls_back_over_the_budget_and_watches_close_to_it():
    # the precise reading replaces the rollout's last one in the forecast
    rollouts = [2.0, 3.0, 6.0]  # the last rollout read high: the cheap forecast passed 5.0
    assert kl.kl_budget_verdict(rollouts, checked=5.2, budget=5.0, window=3) == "roll back"
    assert kl.kl_budget_verdict(rollouts, checked=4.5, budget=5.0, window=3) == "watch"  # 4.42 + 1.25 > 5
    assert kl.kl_budget_verdict(rollouts, checked=3.5, budget=5.0, window=3) == "train"  # 3.58 + 0.75 <= 5
    assert kl.kl_budget_verdict(rollouts, checked=5.0, budget=5.0, window=3) == "watch"  # at the budget: kept


def test_exact_kl_by_hand_and_its_mean_is_k1s_expectation():
    # one position, two tokens: p = (0.75, 0.25), q = (0.5, 0.5)
    logits = torch.log(torch.tensor([[[0.75, 0.25]]]))
    ref = torch.zeros(1, 1, 2)
    expected = 0.75 * math.log(0.75 / 0.5) + 0.25 * math.log(0.25 / 0.5)
    assert kl.exact_kl(logits, ref).item() == pytest.approx(expected)
    # masked positions add nothing; identical distributions give 0
    two = torch.cat([logits, logits], 1)
    assert kl.exact_kl(two, torch.zeros(1, 2, 2), torch.tensor([[True, False]])).item() == pytest.approx(expected)
    assert kl.exact_kl(two, two).abs().max().item() < 1e-7
    # k1 of tokens drawn from p averages to the exact value (one position, many draws)
    p, q = torch.tensor([0.75, 0.25]), torch.tensor([0.5, 0.5])
    draws = torch.multinomial(p, 200_000, replacement=True, generator=torch.Generator().manual_seed(0))
    k1 = kl.kl_penalty(p.log()[draws], q.log()[draws])
    assert k1.mean().item() == pytest.approx(expected, abs=0.01)


def test_exact_kl_by_rows_is_exact_kl_of_the_whole_batch_however_the_rows_split():
    """Hidden states (B, R, H) through each model's head, a few rows at a time: the same values as the
    whole batch's logits at once, for a batch the row count does not divide."""
    gen = torch.Generator().manual_seed(0)
    hidden, ref_hidden = torch.randn(7, 5, 4, generator=gen), torch.randn(7, 5, 4, generator=gen)
    head, ref_head = torch.randn(4, 11, generator=gen), torch.randn(4, 11, generator=gen)
    mask = torch.rand(7, 5, generator=gen) > 0.3
    whole = kl.exact_kl(hidden @ head, ref_hidden @ ref_head, mask)
    for rows in (1, 3, 7, 8):
        by_rows, no_logprobs = kl.exact_kl_by_rows(
            lambda h: h @ head, lambda h: h @ ref_head, hidden, ref_hidden, mask, rows
        )
        assert no_logprobs is None
        assert by_rows.shape == (7,)
        torch.testing.assert_close(by_rows, whole)
    assert (whole > 0).all()  # two different heads: every row with a kept position has KL


def test_the_exact_kl_and_the_reference_logprobs_come_from_one_pass_of_the_reference_head():
    """exact_kl_by_rows with labels: the same KL and the reference's logprobs of the labels, as from the
    whole batch's logits, however the rows split; the reference head runs once per row."""
    gen = torch.Generator().manual_seed(1)
    hidden, ref_hidden = torch.randn(7, 5, 4, generator=gen), torch.randn(7, 5, 4, generator=gen)
    head, ref_head = torch.randn(4, 11, generator=gen), torch.randn(4, 11, generator=gen)
    mask, labels = torch.rand(7, 5, generator=gen) > 0.3, torch.randint(0, 11, (7, 5), generator=gen)
    whole_kl = kl.exact_kl(hidden @ head, ref_hidden @ ref_head, mask)
    whole_logprobs = torch.log_softmax(ref_hidden @ ref_head, -1).gather(-1, labels[..., None])[..., 0]
    for rows in (1, 3, 7, 8):
        projected = []

        def ref_logits_of(h, projected=projected):
            projected.append(len(h))
            return h @ ref_head

        kls, logprobs = kl.exact_kl_by_rows(
            lambda h: h @ head, ref_logits_of, hidden, ref_hidden, mask, rows, labels=labels
        )
        assert sum(projected) == 7 and kls.shape == (7,) and logprobs.shape == (7, 5)
        torch.testing.assert_close(kls, whole_kl)
        torch.testing.assert_close(logprobs, whole_logprobs)
