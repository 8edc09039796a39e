"""The KL penalty: per-token estimates of KL(policy || reference), the rewards they shape, and the
coefficient's controllers (Ziegler et al. 2019, section 2.2)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from rlhf_pipeline.functional import as_bool, first_true_indices

KL_ESTIMATORS = ("k1", "k3")


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
        mask = as_bool(mask)
        non_score = torch.where(mask, non_score, torch.zeros((), dtype=non_score.dtype, device=non_score.device))
        from_end = first_true_indices(mask.flip(-1))  # == length when the row is all False
        last = torch.where(from_end < length, length - 1 - from_end, torch.full_like(from_end, length - 1))
    rewards = non_score.clone()
    rows = torch.arange(rewards.size(0), device=rewards.device)
    rewards[rows, last] += scores.to(rewards.dtype)
    return rewards, non_score


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
