"""The maths shared by sampling, reward modelling, PPO and evaluation, as small pure functions on
torch tensors.

Each function does one step of the algorithm of Ziegler et al. (2019), as implemented by
OpenAI's ``lm-human-preferences`` and reproduced in PyTorch by ``lm-human-preference-details``.
Nothing here touches a model, an optimizer or the file system, so every step can be tested
alone against numbers computed by hand. What only one algorithm uses lives with it: PPO's
rewards, advantages and losses in :mod:`rlhf_pipeline.ppo`, the reward model's loss and
normalisation in :mod:`rlhf_pipeline.reward`; this module sits below both and below sampling,
so it holds only what they share (an edit here reruns every stage that samples).

Conventions
-----------
* Shapes: ``B`` rows (episodes), ``T`` response tokens, ``V`` vocabulary, ``N`` candidates.
* Masks are bool or 0/1 float tensors with the shape of the values they select; ``True`` (1)
  means "this position counts". ``mask=None`` means every position counts, which is the
  original fixed-length OAI setting.
* Inputs are never modified in place.
* Functions that are used to build targets (``whiten``) do not detach: call them under
  ``torch.no_grad()`` (as the trainer does) when the inputs carry gradients.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "as_bool",
    "masked_mean",
    "masked_var",
    "whiten",
    "first_true_indices",
    "truncate_response",
    "apply_penalty",
    "response_mask_after_eos",
    "logprobs_and_entropy",
    "logprobs_from_logits",
    "linear_anneal",
    "non_finite_tensors",
]


def as_bool(mask: Tensor) -> Tensor:
    """``mask`` as a bool tensor (itself when it already is one)."""
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
    mask = as_bool(mask)
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
    count = values.numel() if mask is None else int(as_bool(mask).sum().item())
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
        whitened = torch.where(as_bool(mask), whitened, torch.zeros((), dtype=whitened.dtype, device=whitened.device))
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
    not_b = (~as_bool(bools)).to(dtype)
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
    return torch.where(as_bool(valid), scores, penalty)


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
    logprobs, logp = log_softmax_logprobs(logits, labels)
    entropy = -(logp.exp() * logp).sum(dim=-1)
    return logprobs, entropy


def log_softmax_logprobs(logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    r"""Log-probability of ``labels`` (shape ``labels.shape``) and the whole ``log_softmax(logits)``.

    .. math:: \log p(y) = \log\mathrm{softmax}(z)_y

    Why one function: the sampler's log-probability of each token it draws is PPO's old log-probability,
    and the training forward's (:func:`logprobs_and_entropy`) is the new one; computed by two formulas
    (a log-normaliser summed otherwise) they differ in the last bits before any step, which the
    rollout-trainer gap (``policy/logprob_gap_max``) reports. torch's log-softmax treats each row alone,
    so a row gets the same bytes in a (B, V) decoding step and in a (B, R, V) training block.
    Half-precision logits are upcast first, as in :func:`logprobs_from_logits`.
    """
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1), logp


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
# schedules and checks
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


def non_finite_tensors(named: dict[str, Tensor | None]) -> list[str]:
    """Names of the tensors holding a NaN or an infinity (None entries, e.g. absent gradients, are skipped).

    It runs before every optimizer step, so it reads each tensor once with one plain reduction: a
    tensor's sum is NaN or infinite whenever one of its values is (NaN and an infinity propagate;
    opposite infinities give NaN), and summing needs no per-element flag tensor, which made the check
    ~5 % of a reward-model step (bench/results/reward_speed_profile.md). The sums are gathered and read
    once (one device synchronisation). Only when one is not finite, which a finite tensor can also give
    by overflowing float32, are those tensors checked element by element, to name exactly the bad ones."""
    present = [(name, tensor) for name, tensor in named.items() if tensor is not None]
    if not present:
        return []
    device = present[0][1].device
    sums = torch.stack([tensor.sum(dtype=torch.float32).to(device) for _, tensor in present])
    suspects = torch.nonzero(~torch.isfinite(sums)).flatten().tolist()  # the one read; usually empty
    return [present[i][0] for i in suspects if not bool(torch.isfinite(present[i][1]).all())]
