"""Advantage estimators: what each response token's policy-gradient weight is.

Each estimator is a pure function on ``(B, T)`` tensors with its equation and a test against
hand-computed numbers (tests/test_functional.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlhf_pipeline.functional import as_bool


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
        mask = as_bool(mask)
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
