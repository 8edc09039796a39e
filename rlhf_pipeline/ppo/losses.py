"""PPO's losses: the clipped surrogate objective and the clipped value loss."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from rlhf_pipeline.functional import as_bool, masked_mean


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
            ratio_max = torch.where(as_bool(mask), ratio, torch.full_like(ratio, -math.inf)).max()
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
