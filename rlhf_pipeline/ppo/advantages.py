"""Advantage estimators (``ppo.advantage``): each response token's weight in the policy gradient.

- ``gae``: generalised advantage estimation on a learned value function (the reference);
- ``rloo``, ``grpo``: critic-free, from each response's return against the other samples of its
  query (``ppo.samples_per_query`` of them, consecutive rows).

Each estimator is a pure function on tensors with its equation and a test against hand-computed
numbers (tests/test_functional.py); :func:`estimate` picks one by name. A new estimator is a new
function here and a name in ``ppo.advantage``.
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


# --------------------------------------------------------------------------------------------
# critic-free: each response's return against the other samples of its query
# --------------------------------------------------------------------------------------------
def sequence_returns(rewards: Tensor, mask: Tensor | None = None) -> Tensor:
    """Each response's return, the sum of its per-token rewards (``gamma = 1``): ``(B, T) -> (B,)``.

    .. math:: R_i = \\sum_t m_{i,t}\\, r_{i,t}

    Why: the critic-free estimators judge a whole response; with the KL penalty kept per token in
    the rewards (the reference's placement), the return carries both the score and the response's
    summed penalty.
    """
    if mask is not None:
        rewards = torch.where(as_bool(mask), rewards, torch.zeros((), dtype=rewards.dtype, device=rewards.device))
    return rewards.sum(-1)


def _groups(returns: Tensor, samples_per_query: int) -> Tensor:
    if samples_per_query < 2 or returns.numel() % samples_per_query:
        raise ValueError(
            f"{returns.numel()} returns do not split into groups of samples_per_query={samples_per_query} >= 2"
        )
    return returns.view(-1, samples_per_query)


def rloo(returns: Tensor, samples_per_query: int) -> Tensor:
    """REINFORCE leave-one-out (Kool et al. 2019; Ahmadian et al. 2024): each response's return minus
    the mean return of the other ``k - 1`` samples of the same query. ``(B,) -> (B,)``; rows are
    query-major (the ``k`` samples of a query are consecutive).

    .. math:: A_i = R_i - \\frac{1}{k-1} \\sum_{j \\ne i} R_j = \\frac{k}{k-1}\\,(R_i - \\bar R)

    Why: an unbiased baseline that needs no value function: the other samples of the same prompt
    estimate how good a response to it usually is.
    """
    groups = _groups(returns, samples_per_query)
    others = (groups.sum(-1, keepdim=True) - groups) / (samples_per_query - 1)
    return (groups - others).reshape(returns.shape)


def grpo(returns: Tensor, samples_per_query: int, eps: float = 1e-4) -> Tensor:
    """Group-relative advantage (GRPO, Shao et al. 2024): each response's return standardised by the
    mean and the (unbiased) standard deviation of its query's ``k`` samples. ``(B,) -> (B,)``,
    query-major rows.

    .. math:: A_i = \\frac{R_i - \\bar R_g}{s_g + \\epsilon},\\qquad
              s_g = \\sqrt{\\tfrac{1}{k-1} \\sum_{j \\in g} (R_j - \\bar R_g)^2}

    Why: no value function; dividing by the group's spread makes every prompt weigh alike, whatever
    the scale of its rewards. A group whose samples all score alike gets advantage 0.
    """
    groups = _groups(returns, samples_per_query)
    centred = groups - groups.mean(-1, keepdim=True)
    return (centred / (groups.std(-1, keepdim=True) + eps)).reshape(returns.shape)


# ppo.advantage's critic-free names (rlhf_pipeline.params.ppo.CRITIC_FREE), each with its function
CRITIC_FREE_ESTIMATORS = {"rloo": rloo, "grpo": grpo}


def per_token(advantages: Tensor, mask: Tensor) -> Tensor:
    """A response-level advantage ``(B,)`` on each of its tokens that count: ``(B, T)``, 0 elsewhere."""
    zero = torch.zeros((), dtype=advantages.dtype, device=advantages.device)
    return torch.where(as_bool(mask), advantages.unsqueeze(-1), zero)


def estimate(
    estimator: str,
    rewards: Tensor,
    values: Tensor | None,
    mask: Tensor,
    gamma: float,
    lam: float,
    samples_per_query: int,
) -> tuple[Tensor, Tensor | None]:
    """``(advantages (B, T), returns (B, T) for the value loss, or None)`` by ``ppo.advantage``: GAE
    on the value head's estimates, or a critic-free estimator of each response's summed reward."""
    if estimator == "gae":
        return gae(rewards, values, gamma, lam, mask)
    if estimator not in CRITIC_FREE_ESTIMATORS:
        expected = ["gae", *CRITIC_FREE_ESTIMATORS]
        raise ValueError(f"unknown advantage estimator {estimator!r}; expected one of {expected}")
    returns = sequence_returns(rewards, mask)
    return per_token(CRITIC_FREE_ESTIMATORS[estimator](returns, samples_per_query), mask), None
