"""The KL penalty: per-token estimates of KL(policy || reference), the rewards they shape, and the
coefficient's controllers (Ziegler et al. 2019, section 2.2)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from rlhf_pipeline.functional import as_bool, first_true_indices, logprobs_from_logits

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


def exact_kl(logits: Tensor, ref_logits: Tensor, mask: Tensor | None = None) -> Tensor:
    """(B,) per-response KL(pi || pi_ref) summed over the response, each token's term exact over the
    vocabulary rather than estimated from the sampled token.

    .. math::
        \\mathrm{KL} = \\sum_t m_t \\sum_v p_t(v)\\,\\bigl(\\log p_t(v) - \\log q_t(v)\\bigr),
        \\quad p_t = \\mathrm{softmax}(z_t),\\ q_t = \\mathrm{softmax}(z^{\\text{ref}}_t)

    Why: it has the same expectation as ``k1`` summed over a sampled response, without the variance of
    which token was drawn at each position: on the default run's policy its per-response standard
    deviation was 1.9 nats against k1's 3.3 (64 responses), so a few dozen responses measure the
    policy's KL to a third of a nat. ``logits``, ``ref_logits``: (B, R, V) at the sampling temperature.
    """
    logp, logq = torch.log_softmax(logits.float(), -1), torch.log_softmax(ref_logits.float(), -1)
    per_token = (logp.exp() * (logp - logq)).sum(-1)
    if mask is not None:
        per_token = per_token * as_bool(mask)
    return per_token.sum(-1)


def exact_kl_by_rows(
    logits_of: Callable[[Tensor], Tensor],
    ref_logits_of: Callable[[Tensor], Tensor],
    hidden: Tensor,
    ref_hidden: Tensor,
    mask: Tensor,
    rows: int = 8,
    labels: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """(B,) :func:`exact_kl` of each response from both models' final hidden states at the response
    positions (B, R, H), which ``logits_of`` and ``ref_logits_of`` turn into (rows, R, V) logits (each
    model's LM head at the sampling temperature), and the responses' ``mask`` (B, R); with ``labels``
    (B, R), the sampled tokens, also the reference's log-probabilities of them (B, R), read off the same
    reference logits (else None).

    .. math:: \\log q_t(y_t) = z^{\\text{ref}}_{t, y_t} - \\log\\sum_v e^{z^{\\text{ref}}_{t,v}}

    Why by rows: the two distributions over the vocabulary take ``2 * B * R * V`` floats at once
    (1.2 GB for 128 responses of 24 tokens over SmolLM2's 49k tokens), ``rows`` of them take a
    sixteenth of that. The KL budget's reading in PPO and the evaluation's exact KL both go through
    it. Why the logprobs here: the evaluation's k1 KL needs the reference's logprobs of the sampled
    tokens beside its exact KL, so one LM-head projection serves both; a second would cost
    ``2 * R * H * V`` FLOPs a response (0.5 TFLOP over the default's 584 held-out responses)."""
    kls, logprobs = [], []
    for start in range(0, len(hidden), rows):
        part = slice(start, start + rows)
        ref_logits = ref_logits_of(ref_hidden[part])
        kls.append(exact_kl(logits_of(hidden[part]), ref_logits, mask[part]))
        if labels is not None:
            logprobs.append(logprobs_from_logits(ref_logits, labels[part]))
    return torch.cat(kls), torch.cat(logprobs) if labels is not None else None


def kl_trend(kls: Sequence[float], window: int) -> tuple[float, float]:
    """The least-squares line through the last ``window`` points ``(u, kls[u])``: its value at the last
    point and its slope per step.

    .. math::
        b = \\frac{\\sum_u (u - \\bar u)(k_u - \\bar k)}{\\sum_u (u - \\bar u)^2},\\qquad
        \\hat k_{\\text{last}} = \\bar k + b\\,(u_{\\text{last}} - \\bar u)

    One point: that point and slope 0.

    Why: one rollout's mean KL is a mean over a few dozen responses whose KL to the reference varies by
    several nats, so its standard error is about a nat; over a few updates KL grows about linearly, and
    the line through them estimates both the current policy's KL and the growth per update.
    """
    if window < 1 or not kls:
        raise ValueError("kl_trend: needs a window >= 1 and at least one KL")
    points = [float(k) for k in kls[-window:]]
    n = len(points)
    if n == 1:
        return points[0], 0.0
    u_mean, k_mean = (n - 1) / 2, sum(points) / n
    slope = sum((u - u_mean) * (k - k_mean) for u, k in enumerate(points)) / sum((u - u_mean) ** 2 for u in range(n))
    return k_mean + slope * (n - 1 - u_mean), slope


def kl_forecast(kls: Sequence[float], window: int) -> float:
    """The KL the policy will have after one more update: the current level and one more update's
    growth, from the line :func:`kl_trend` fits (a falling line adds no growth).

    .. math::
        \\hat k_{\\text{next}} = \\hat k_{\\text{last}} + \\max(b, 0)
    """
    level, slope = kl_trend(kls, window)
    return level + max(slope, 0.0)


BudgetVerdict = Literal["train", "watch", "roll back"]


def kl_budget_verdict(kls: Sequence[float], checked: float, budget: float, window: int) -> BudgetVerdict:
    """What ``ppo.kl.budget`` does with the current policy once its KL was read precisely (``checked``,
    over many more responses than a rollout's; ``kls``: every rollout's mean KL so far, the current
    one last):

    - ``checked`` > budget: **roll back** to the policy before the last update (and end the run);
    - else, if the forecast with ``checked`` for the current level passes the budget: **watch** (train,
      and read the next policy precisely too, whatever its rollout says);
    - else **train** (the rollout's reading was a false alarm).

    Why: one rollout's mean KL over a few dozen responses is off by up to two nats (heavy tails), so a
    rule on rollouts alone stops some runs a nat short of the budget and lets others past it. The precise
    reading is taken only when the cheap forecast (:func:`kl_forecast`) passes, a few times a run; and
    since the run keeps the last policy whose precise KL is within the budget, the result is within it
    without guessing the next update's growth.
    """
    if checked > budget:
        return "roll back"
    return "watch" if kl_forecast([*kls[:-1], checked], window) > budget else "train"


BUDGET_SEARCHES = ("halve", "bisect")


def budget_line_search(within: Callable[[float], bool], tries: int, search: str) -> float | None:
    """The fraction of an undone update's step to keep, from ``tries`` readings of ``within(fraction)``
    (is the policy that far along the step within the budget?), each fraction the middle of the interval
    still open, starting from [0, 1] (0 is the policy before the update, within; 1 the one after, over):

    .. math::
        f_i = (\\ell_{i-1} + h_{i-1}) / 2,\\qquad
        (\\ell_i, h_i) = (f_i, h_{i-1})\\ \\text{if within}(f_i)\\ \\text{else}\\ (\\ell_{i-1}, f_i)

    - ``halve``: keep the first fraction within (1/2, 1/4, ...: TRPO's backtracking line search);
    - ``bisect``: keep going after a fraction within, and keep the largest read within (1/2 then 3/4 or
      1/4, ...), the same number of readings.

    Why bisect: halving stops at the first fit, so when half the step fits it keeps it, however far under
    the budget it reads; bisection lands within 2^-tries of the step's largest fraction within (the KL
    grows along the step), spending the budget the run was given. None: no fraction read was within.
    """
    if search not in BUDGET_SEARCHES:
        raise ValueError(f"unknown budget search {search!r}; expected one of {BUDGET_SEARCHES}")
    low, high, kept = 0.0, 1.0, None
    for _ in range(tries):
        fraction = (low + high) / 2
        if within(fraction):
            if search == "halve":
                return fraction
            low = kept = fraction
        else:
            high = fraction
    return kept


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
