"""The RLHF-with-PPO algorithm as small pure functions on torch tensors.

Each function does one step of the algorithm of Ziegler et al. (2019), as implemented by
OpenAI's ``lm-human-preferences`` and reproduced in PyTorch by ``lm-human-preference-details``.
Nothing here touches a model, an optimizer or the file system, so every step can be tested
alone against numbers computed by hand.

Conventions
-----------
* Shapes: ``B`` rows (episodes), ``T`` response tokens, ``V`` vocabulary, ``N`` candidates.
* Masks are bool or 0/1 float tensors with the shape of the values they select; ``True`` (1)
  means "this position counts". ``mask=None`` means every position counts, which is the
  original fixed-length OAI setting.
* Inputs are never modified in place.
* Functions that are used to build targets (``compute_rewards``, ``gae``, ``whiten``) do not
  detach: call them under ``torch.no_grad()`` (as the trainer does) when the inputs carry
  gradients. Loss functions return their statistics detached.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "masked_mean",
    "masked_var",
    "whiten",
    "first_true_indices",
    "truncate_response",
    "apply_penalty",
    "response_mask_after_eos",
    "kl_penalty",
    "compute_rewards",
    "gae",
    "policy_loss",
    "value_loss",
    "logprobs_and_entropy",
    "logprobs_from_logits",
    "AdaptiveKLController",
    "FixedKLController",
    "linear_anneal",
    "best_of_n_loss",
    "pairwise_loss",
    "normalization_gain_bias",
    "minibatch_indices",
]

KL_ESTIMATORS = ("k1", "k3")


def _as_bool(mask: Tensor) -> Tensor:
    return mask if mask.dtype == torch.bool else mask != 0


# --------------------------------------------------------------------------------------------
# masked statistics
# --------------------------------------------------------------------------------------------
def masked_mean(values: Tensor, mask: Tensor | None = None, dim: int | None = None) -> Tensor:
    """Mean of ``values`` over the positions where ``mask`` is True.

    .. math:: \\bar x = \\frac{\\sum_i m_i x_i}{\\sum_i m_i}

    Why: with EOS-stopped responses the padding after the end of a response must not dilute
    the per-token averages of losses and statistics. Masked-out entries are selected away
    (``torch.where``), so a NaN or inf stored there cannot leak into the result. An empty
    mask gives NaN (0/0), as ``torch.mean`` of an empty tensor does.

    Args:
        values: any shape.
        mask: same shape as ``values``, or None for a plain mean.
        dim: reduce over this dimension only; None reduces over everything (scalar).
    """
    if mask is None:
        return values.mean() if dim is None else values.mean(dim=dim)
    mask = _as_bool(mask)
    selected = torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))
    count = mask.to(values.dtype)
    if dim is None:
        return selected.sum() / count.sum()
    return selected.sum(dim=dim) / count.sum(dim=dim)


def masked_var(values: Tensor, mask: Tensor | None = None, unbiased: bool = False) -> Tensor:
    """Scalar variance of ``values`` over the positions where ``mask`` is True.

    .. math:: \\sigma^2 = \\frac{\\sum_i m_i (x_i - \\bar x)^2}{n - \\delta},
              \\quad n = \\sum_i m_i,\\ \\delta = 1 \\text{ if unbiased else } 0

    Why: ``whiten`` needs the variance of the tokens that count. OAI uses the biased
    (population) variance (``tf.nn.moments``), hence the default ``unbiased=False``.

    Raises:
        ValueError: if the mask selects nothing, or a single element with ``unbiased=True``.
    """
    mean = masked_mean(values, mask)
    centered_sq = (values - mean) ** 2
    var = masked_mean(centered_sq, mask)
    count = values.numel() if mask is None else int(_as_bool(mask).sum().item())
    if count == 0:
        raise ValueError("masked_var: the mask selects no element")
    if unbiased:
        if count < 2:
            raise ValueError("masked_var: the unbiased variance needs at least two elements")
        var = var * (count / (count - 1))
    return var


def whiten(values: Tensor, mask: Tensor | None = None, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """Normalise ``values`` to zero mean and unit variance (over the mask).

    .. math:: w = (x - \\mu)\\,/\\sqrt{\\sigma^2 + \\epsilon}, \\qquad
              w \\mathrel{+}= \\mu \\text{ if not shift\\_mean}

    Why: OAI whitens the advantages of every minibatch (``shift_mean=True``) so the policy
    gradient has a stable scale, and optionally whitens the rewards with ``shift_mean=False``:
    their scale is normalised but their mean is kept, because the mean reward carries the
    signal of "how good" the batch is. ``sigma^2`` is the biased variance, as in OAI.
    With a mask, the statistics use only the masked-in entries and masked-out entries are
    returned as 0.
    """
    mean = masked_mean(values, mask)
    var = masked_var(values, mask, unbiased=False)
    whitened = (values - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    if mask is not None:
        whitened = torch.where(_as_bool(mask), whitened, torch.zeros((), dtype=whitened.dtype, device=whitened.device))
    return whitened


# --------------------------------------------------------------------------------------------
# response post-processing
# --------------------------------------------------------------------------------------------
def first_true_indices(bools: Tensor, dtype: torch.dtype = torch.long) -> Tensor:
    """Index of the first True along the last dimension of each row; the row length if none.

    .. math:: i^* = \\min(\\{ j : b_j \\} \\cup \\{ L \\})

    Why: truncation at the first stop token, the EOS mask and the "last position of the mask"
    are all "first index where" questions; computing them branch-free (a ``min`` over
    ``L * (1 - b_j) + j``) keeps them vectorised, as in OAI's ``first_true_indices``.
    """
    row_len = bools.size(-1)
    not_b = (~_as_bool(bools)).to(dtype)
    positions = torch.arange(row_len, dtype=dtype, device=bools.device)
    return torch.min(row_len * not_b + positions, dim=-1).values


def truncate_response(
    responses: Tensor,
    truncate_token_id: int | None,
    truncate_after: int,
    pad_token_id: int,
) -> tuple[Tensor, Tensor]:
    """OAI's ``postprocess`` + ``filter``: cut each response after its first stop token.

    For each row find the first ``j >= truncate_after`` with ``responses[j] == truncate_token_id``;
    keep tokens ``0..j`` (the stop token included) and replace every later token by
    ``pad_token_id``. ``valid[b]`` is True iff such a ``j`` exists; rows without one are
    returned unchanged.

    Why: Ziegler et al. sample a fixed number of tokens and then "use rejection sampling to
    ensure there is a period between tokens 16 and 24 and then truncate at that period"; the
    reward model scores the truncated response, and an invalid row gets a fixed penalty score
    (see ``apply_penalty``). A stop token before ``truncate_after`` is ignored so that
    responses are not cut too short.

    If ``truncate_token_id`` is None, truncation is off: responses are returned unchanged and
    all rows are valid.

    Returns:
        ``(truncated_responses, valid)`` with shapes ``(B, T)`` and ``(B,)`` bool.
    """
    batch, length = responses.shape[0], responses.shape[-1]
    if truncate_token_id is None:
        return responses, torch.ones(batch, dtype=torch.bool, device=responses.device)
    positions = torch.arange(length, device=responses.device)
    stop = (responses == truncate_token_id) & (positions >= truncate_after)
    first_stop = first_true_indices(stop)
    valid = first_stop < length
    after = positions > first_stop.unsqueeze(-1)
    truncated = torch.where(after, torch.full_like(responses, pad_token_id), responses)
    return truncated, valid


def apply_penalty(scores: Tensor, valid: Tensor, penalty_reward: float) -> Tensor:
    """Replace the score of invalid responses by a fixed penalty.

    .. math:: s'_b = s_b \\text{ if valid}_b \\text{ else } r_{\\text{penalty}}

    Why: OAI's ``penalize``; responses that fail the filter (no stop token in the allowed
    window) get ``penalty_reward_value`` (-1 in the paper) instead of the reward-model score,
    which teaches the policy to produce well-formed responses.
    """
    penalty = torch.full_like(scores, float(penalty_reward))
    return torch.where(_as_bool(valid), scores, penalty)


def response_mask_after_eos(responses: Tensor, eos_token_id: int | None) -> Tensor:
    """Mask that is True up to and including the first EOS token of each row, False after.

    .. math:: m_j = [\\, j \\le i^*_{\\text{eos}} \\,]

    Why: in EOS-stop mode the tokens generated after the end of the response are padding and
    must not contribute to the KL penalty, GAE, losses or statistics. A row without EOS is
    all True. ``eos_token_id=None`` (OAI's fixed-length mode) gives an all-True mask.
    """
    if eos_token_id is None:
        return torch.ones_like(responses, dtype=torch.bool)
    first_eos = first_true_indices(responses == eos_token_id)
    positions = torch.arange(responses.size(-1), device=responses.device)
    return positions <= first_eos.unsqueeze(-1)


# --------------------------------------------------------------------------------------------
# rewards and advantages
# --------------------------------------------------------------------------------------------
def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, estimator: str = "k1") -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from the log-probabilities of sampled tokens.

    .. math::
        k_1 = \\log\\pi(y_t) - \\log\\pi_{\\text{ref}}(y_t)
        \\qquad
        k_3 = (r - 1) - \\log r,\\quad r = \\pi_{\\text{ref}}(y_t) / \\pi(y_t)

    Why: the reward of Ziegler et al. is ``R = r(x, y) - beta * KL``; OAI uses the unbiased
    estimator ``k1`` (can be negative per token). ``k3`` (Schulman's "approximating KL"
    note) is also unbiased, is always ``>= 0`` and has lower variance.
    """
    if estimator == "k1":
        return logprobs - ref_logprobs
    if estimator == "k3":
        log_ratio = ref_logprobs - logprobs
        return torch.expm1(log_ratio) - log_ratio
    raise ValueError(f"unknown KL estimator {estimator!r}; expected one of {KL_ESTIMATORS}")


def compute_rewards(
    scores: Tensor,
    logprobs: Tensor,
    ref_logprobs: Tensor,
    kl_coef: float | Tensor,
    mask: Tensor | None = None,
    estimator: str = "k1",
) -> tuple[Tensor, Tensor]:
    """Per-token rewards: a KL penalty at every token plus the score at the last token.

    .. math::
        n_t = -\\beta\\, \\mathrm{kl}_t \\cdot m_t, \\qquad
        r_t = n_t + s \\cdot [\\, t = t_{\\text{last}} \\,]

    where ``t_last`` is the last True position of ``mask`` in the row (the last column if
    ``mask`` is None; also the last column for a row whose mask is all False).

    Why: the reward model scores the whole response once, so its score is a terminal reward;
    the KL penalty keeps the policy close to the reference model at every token (OAI's
    ``compute_rewards``: ``rewards[:, -1] += scores``). With EOS-stopped responses the
    terminal token is the EOS, not the padded last column.

    Returns:
        ``(rewards, non_score_rewards)``, both ``(B, T)``.
    """
    kl = kl_penalty(logprobs, ref_logprobs, estimator)
    non_score = -kl_coef * kl
    length = non_score.size(-1)
    if mask is None:
        last = torch.full((non_score.size(0),), length - 1, dtype=torch.long, device=non_score.device)
    else:
        mask = _as_bool(mask)
        non_score = torch.where(mask, non_score, torch.zeros((), dtype=non_score.dtype, device=non_score.device))
        from_end = first_true_indices(mask.flip(-1))  # == length when the row is all False
        last = torch.where(from_end < length, length - 1 - from_end, torch.full_like(from_end, length - 1))
    rewards = non_score.clone()
    rows = torch.arange(rewards.size(0), device=rewards.device)
    rewards[rows, last] += scores.to(rewards.dtype)
    return rewards, non_score


def gae(
    rewards: Tensor,
    values: Tensor,
    gamma: float,
    lam: float,
    mask: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016), backwards over the tokens.

    .. math::
        \\delta_t = r_t + \\gamma V_{t+1} - V_t,\\qquad
        A_t = \\delta_t + \\gamma\\lambda A_{t+1},\\qquad
        V_T = A_T = 0,\\qquad R_t = A_t + V_t

    Why: the return target for the value head and the advantage for the policy gradient;
    ``lambda`` trades bias for variance. OAI uses ``gamma = 1`` (no discount within a
    response) and ``lambda = 0.95``, and bootstraps with 0 after the last token because the
    episode ends there. With a mask, rewards and values at masked-out positions are treated
    as 0 (so an EOS-stopped episode ends at its EOS) and their advantages (hence returns)
    are 0.

    Returns:
        ``(advantages, returns)``, both ``(B, T)``.
    """
    if mask is not None:
        mask = _as_bool(mask)
        zero = torch.zeros((), dtype=values.dtype, device=values.device)
        rewards = torch.where(mask, rewards, zero)
        values = torch.where(mask, values, zero)
    length = rewards.size(-1)
    last_gae = torch.zeros_like(rewards[..., 0])
    reversed_advantages = []
    for t in reversed(range(length)):
        next_values = values[..., t + 1] if t < length - 1 else torch.zeros_like(values[..., t])
        delta = rewards[..., t] + gamma * next_values - values[..., t]
        last_gae = delta + gamma * lam * last_gae
        reversed_advantages.append(last_gae)
    advantages = torch.stack(reversed_advantages[::-1], dim=-1)
    if mask is not None:
        advantages = torch.where(mask, advantages, torch.zeros((), dtype=advantages.dtype, device=advantages.device))
    returns = advantages + values
    return advantages, returns


# --------------------------------------------------------------------------------------------
# PPO losses
# --------------------------------------------------------------------------------------------
def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    cliprange: float,
    mask: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate objective (Schulman et al. 2017, eq. 7), as a loss to minimise.

    .. math::
        \\rho_t = \\exp(\\log\\pi - \\log\\pi_{\\text{old}}),\\qquad
        L = \\overline{\\max(-A_t\\rho_t,\\; -A_t\\,\\mathrm{clip}(\\rho_t, 1-c, 1+c))}

    Why: the max of the two negated terms is the pessimistic bound: the policy gets no
    incentive to move the ratio outside ``[1-c, 1+c]`` in the direction the advantage favours,
    which keeps each update close to the sampling policy.

    Stats (detached scalars, means over the mask):
        ``clipfrac``: fraction of tokens where the clipped term is active (> unclipped).
        ``approxkl``: ``0.5 * mean((logp - old)^2)``, OAI's cheap KL(old || new) estimate.
        ``ratio_mean``, ``ratio_max``: of ``rho`` (to spot exploding ratios).
    """
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    loss = masked_mean(torch.maximum(unclipped, clipped), mask)
    with torch.no_grad():
        clipfrac = masked_mean((clipped > unclipped).to(ratio.dtype), mask)
        approxkl = 0.5 * masked_mean(log_ratio**2, mask)
        ratio_mean = masked_mean(ratio, mask)
        if mask is None:
            ratio_max = ratio.max()
        else:
            ratio_max = torch.where(_as_bool(mask), ratio, torch.full_like(ratio, -math.inf)).max()
    stats = {
        "clipfrac": clipfrac.detach(),
        "approxkl": approxkl.detach(),
        "ratio_mean": ratio_mean.detach(),
        "ratio_max": ratio_max.detach(),
    }
    return loss, stats


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    cliprange_value: float,
    mask: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value-function loss (OAI / baselines ppo2).

    .. math::
        V^{\\text{clip}} = V_{\\text{old}} + \\mathrm{clip}(V - V_{\\text{old}}, -c, c),\\qquad
        L = \\tfrac12\\,\\overline{\\max((V - R)^2,\\; (V^{\\text{clip}} - R)^2)}

    Why: like the policy clip, it stops the value head moving far from its rollout-time
    predictions in one update; taking the max makes the loss pessimistic.

    Stats (detached): ``clipfrac``, the fraction of tokens where the clipped error is larger.
    """
    clipped_values = old_values + torch.clamp(values - old_values, -cliprange_value, cliprange_value)
    err_unclipped = (values - returns) ** 2
    err_clipped = (clipped_values - returns) ** 2
    loss = 0.5 * masked_mean(torch.maximum(err_unclipped, err_clipped), mask)
    with torch.no_grad():
        clipfrac = masked_mean((err_clipped > err_unclipped).to(values.dtype), mask)
    return loss, {"clipfrac": clipfrac.detach()}


# --------------------------------------------------------------------------------------------
# logits
# --------------------------------------------------------------------------------------------
def logprobs_and_entropy(logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    r"""Log-probability of ``labels`` and the entropy of ``softmax(logits)`` at every position,
    both from one ``log_softmax``; each of shape ``labels.shape``.

    .. math:: \log p(y) = \log\mathrm{softmax}(z)_y, \qquad H = -\sum_v p_v \log p_v

    Why: PPO's training forward needs both (the ratio, and the entropy as a health statistic: a
    collapsing entropy signals mode collapse); one ``(B, T, V)`` log-softmax serves the two.
    The logits must be finite: mask a token with a large negative value (``never_pad`` uses
    -1e9), not ``-inf``, whose ``0 * -inf`` would make the entropy NaN. Guarding against that here
    would cost one more pass over ``(B, T, V)`` in every training step (+35 % for this function,
    measured). Half-precision logits are upcast first, as in :func:`logprobs_from_logits`.
    """
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    logp = torch.log_softmax(logits, dim=-1)
    logprobs = logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(dim=-1)
    return logprobs, entropy


def logprobs_from_logits(logits: Tensor, labels: Tensor) -> Tensor:
    """Log-probability of ``labels`` under ``softmax(logits)``; shape ``labels.shape``.

    .. math:: \\log p(y) = z_y - \\log\\sum_v e^{z_v}

    Why: PPO needs the log-probability of the sampled tokens only. Gathering the label logit
    and subtracting ``logsumexp`` avoids materialising a full ``(B, T, V)`` log-softmax.
    Half-precision logits are upcast to float32 first: a bf16 ``logsumexp`` over a large
    vocabulary is too coarse for the PPO ratio. Callers divide the logits by the sampling
    temperature first (OAI's detail) if one was used.
    """
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    label_logits = torch.gather(logits, -1, labels.unsqueeze(-1)).squeeze(-1)
    return label_logits - torch.logsumexp(logits, dim=-1)


# --------------------------------------------------------------------------------------------
# KL coefficient controllers
# --------------------------------------------------------------------------------------------
class AdaptiveKLController:
    """Adaptive KL coefficient of Ziegler et al. (2019), section 2.2.

    .. math::
        e = \\mathrm{clip}(\\mathrm{KL}/\\mathrm{KL}_{\\text{target}} - 1, -0.2, 0.2),\\qquad
        \\beta \\leftarrow \\beta\\,(1 + e \\cdot n_{\\text{steps}} / \\text{horizon})

    Why: a proportional controller steers the observed KL towards the target; clipping the
    error bounds how fast ``beta`` can change, and ``n_steps / horizon`` makes the rate
    independent of the batch size (``n_steps`` is the number of episodes in the batch).
    """

    kind = "adaptive"

    def __init__(self, init_coef: float, target: float, horizon: float):
        if target <= 0 or horizon <= 0:
            raise ValueError("AdaptiveKLController: target and horizon must be positive")
        self.value = float(init_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])
        self.target = float(state.get("target", self.target))
        self.horizon = float(state.get("horizon", self.horizon))


class FixedKLController:
    """Constant KL coefficient with the ``AdaptiveKLController`` interface.

    ``target`` and ``horizon`` are accepted and ignored so both controllers can be built from
    the same arguments; ``update`` does nothing.
    """

    kind = "fixed"

    def __init__(self, init_coef: float, target: float | None = None, horizon: float | None = None):
        self.value = float(init_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])


# --------------------------------------------------------------------------------------------
# schedules
# --------------------------------------------------------------------------------------------
def linear_anneal(step: int, total_steps: int, initial: float) -> float:
    """Learning rate for the 0-based ``step`` of a linear decay to 0 over ``total_steps``.

    .. math:: \\eta_k = \\eta_0\\,(1 - k / K)

    Why: OAI anneals both the reward-model lr (``(1 - start_index / num_train) * lr``) and the
    policy lr (``(1 - (update - 1) / num_updates) * lr``, 1-based) linearly to zero; step 0
    gets the full lr and the last step ``eta_0 / K``.
    """
    if total_steps <= 0:
        raise ValueError("linear_anneal: total_steps must be positive")
    return float(initial) * (1.0 - step / total_steps)


# --------------------------------------------------------------------------------------------
# reward model
# --------------------------------------------------------------------------------------------
def best_of_n_loss(rewards: Tensor, best: Tensor, margin: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Reward-model loss for "which of N responses is best" labels (OAI's ``best`` label).

    .. math::
        z_{b,i} = r_{b,i} - m_b\\,[i = y_b],\\qquad
        L = -\\frac1B \\sum_b \\log \\mathrm{softmax}(z_b)_{y_b}

    Why: Ziegler et al. train the reward model as the logits of a softmax over the ``N``
    candidates, so the labelled response gets the highest reward. For ``N = 2`` this is the
    Bradley-Terry loss ``-log sigmoid(r_c - r_r - m)`` (``pairwise_loss``). The optional margin
    (Llama-2 style) asks the chosen reward to win by at least ``m``.

    Returns:
        ``(loss, accuracy)``; accuracy is ``mean(argmax_i r_{b,i} == y_b)`` on the raw rewards,
        detached.
    """
    best = best.long()
    logits = rewards
    if margin is not None:
        one_hot = F.one_hot(best, num_classes=rewards.size(-1)).to(rewards.dtype)
        logits = rewards - margin.to(rewards.dtype).unsqueeze(-1) * one_hot
    loss = F.cross_entropy(logits, best)
    accuracy = (rewards.detach().argmax(dim=-1) == best).to(rewards.dtype).mean()
    return loss, accuracy


def pairwise_loss(chosen: Tensor, rejected: Tensor, margin: Tensor | None = None) -> Tensor:
    """Bradley-Terry pairwise loss, mean over the batch.

    .. math:: L = -\\frac1B\\sum_b \\log\\sigma(r^c_b - r^r_b - m_b)

    Why: the two-candidate case of ``best_of_n_loss`` (softmax over two logits is the
    sigmoid of their difference), written directly with ``logsigmoid`` for stability.
    """
    diff = chosen - rejected
    if margin is not None:
        diff = diff - margin.to(diff.dtype)
    return -F.logsigmoid(diff).mean()


def normalization_gain_bias(
    mean: float | Tensor,
    std: float | Tensor,
    target_mean: float = 0.0,
    target_std: float = 1.0,
) -> tuple[float, float]:
    """Gain and bias that map rewards with ``(mean, std)`` to ``(target_mean, target_std)``.

    .. math:: g = \\sigma_T / \\sigma_D,\\qquad b = \\mu_T - g\\,\\mu_D

    Why: OAI normalises the reward model before and after training so that ``g r + b`` has
    mean 0 and std 1 on responses sampled from the reference policy, which keeps the reward
    scale (and so the meaning of the KL coefficient) fixed.
    """
    mean = float(mean)
    std = float(std)
    if not std > 0:
        raise ValueError(f"normalization_gain_bias: std must be positive, got {std}")
    gain = float(target_std) / std
    bias = float(target_mean) - gain * mean
    return gain, bias


# --------------------------------------------------------------------------------------------
# batching
# --------------------------------------------------------------------------------------------
def minibatch_indices(
    batch_size: int,
    nminibatches: int,
    microbatch_size: int,
    generator: torch.Generator | None,
) -> list[list[Tensor]]:
    """Index tensors for one PPO epoch: shuffled minibatches, each split into microbatches.

    The permutation is ``torch.randperm(batch_size, generator=generator)``; minibatch ``k``
    is its slice ``[k*M, (k+1)*M)`` with ``M = batch_size / nminibatches``, cut into
    consecutive chunks of ``microbatch_size``.

    Why: OAI reshuffles the rollout batch every PPO epoch and takes one optimizer step per
    minibatch; microbatches are gradient-accumulation chunks of a minibatch
    (lm-human-preference-details), so the update is the same whatever fits in memory.

    Raises:
        ValueError: unless ``nminibatches`` divides ``batch_size`` and ``microbatch_size``
        divides the minibatch size.
    """
    if batch_size <= 0 or nminibatches <= 0 or microbatch_size <= 0:
        raise ValueError("minibatch_indices: sizes must be positive")
    if batch_size % nminibatches:
        raise ValueError(f"minibatch_indices: nminibatches={nminibatches} does not divide batch_size={batch_size}")
    minibatch_size = batch_size // nminibatches
    if minibatch_size % microbatch_size:
        raise ValueError(
            f"minibatch_indices: microbatch_size={microbatch_size} does not divide minibatch size {minibatch_size}"
        )
    perm = torch.randperm(batch_size, generator=generator)
    return [
        [perm[start + m : start + m + microbatch_size] for m in range(0, minibatch_size, microbatch_size)]
        for start in range(0, batch_size, minibatch_size)
    ]


def non_finite_tensors(named: dict[str, Tensor | None]) -> list[str]:
    """Names of the tensors holding a NaN or an infinity (None entries, e.g. absent gradients, are skipped).

    It runs before every optimizer step, so the per-tensor flags are gathered into one tensor and
    read once: one device synchronisation, not one per parameter."""
    present = [(name, tensor) for name, tensor in named.items() if tensor is not None]
    if not present:
        return []
    device = present[0][1].device
    finite = torch.stack([torch.isfinite(tensor).all().to(device) for _, tensor in present]).tolist()
    return [name for (name, _), ok in zip(present, finite) if not ok]
