"""The reward model's normalisation and the task's score, as OAI defines them.

OAI normalises the reward model before and after training so that ``gain * r + bias`` has a target
mean and std (0 and 1) on responses the base model samples; that keeps the reward scale, and so the
meaning of the KL coefficient, fixed. The task's score is the normalised reward of a response cut at
``task.truncate_token``, or a penalty where none was found: one rule for PPO's rollouts and the
evaluation.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from rlhf_pipeline.errors import PipelineError
from rlhf_pipeline.functional import apply_penalty
from rlhf_pipeline.params.reward import RewardNormalizeParams
from rlhf_pipeline.reward.model import RewardModel
from rlhf_pipeline.sampling import iterate_batches


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


def set_gain_bias(model: RewardModel, gain: float, bias: float) -> None:
    """Set the model's stored gain and bias (normalised reward = gain * head + bias)."""
    with torch.no_grad():
        model.gain.fill_(gain)
        model.bias.fill_(bias)


@torch.no_grad()
def score_query_responses(
    model: RewardModel, queries: Tensor, responses: Tensor, batch_size: int, normalized: bool = True
) -> Tensor:
    """Rewards of single responses (B, R) to queries (B, Q), batched: (B,)."""
    scores = [
        model.score_best_of_n(queries[rows], responses[rows, None, :], normalized)[:, 0]
        for rows in iterate_batches(len(queries), batch_size)
    ]
    return torch.cat(scores)


def task_scores(
    model: RewardModel, queries: Tensor, truncated: Tensor, valid: Tensor, penalty_reward: float, batch_size: int
) -> Tensor:
    """The score of each response as the task defines it (one rule for PPO's rollouts and the
    evaluation): the normalised reward model's score of query + response truncated at
    ``task.truncate_token`` (``truncated``), or ``penalty_reward`` where no truncate token was found
    (``valid`` false). ``(B, Q), (B, R), (B,) -> (B,)``."""
    return apply_penalty(score_query_responses(model, queries, truncated, batch_size), valid, penalty_reward)


def fit_normalization(
    model: RewardModel, raw_scores: Tensor, target_mean: float, target_std: float
) -> tuple[float, float]:
    """Set gain/bias so that ``gain * raw + bias`` has the target mean and std on ``raw_scores``."""
    mean, std = raw_scores.mean().item(), raw_scores.std(unbiased=False).item()
    if not math.isfinite(std) or std == 0.0:
        raise PipelineError(
            "Reward normalisation failed: the reward model gives the same score to every sample (std 0)."
        )
    gain, bias = normalization_gain_bias(mean, std, target_mean, target_std)
    set_gain_bias(model, gain, bias)
    return gain, bias


def normalize_on_base_samples(
    model: RewardModel,
    base,
    sampler,
    queries: Tensor,
    generator: torch.Generator,
    cfg: RewardNormalizeParams,
    progress: str,
) -> tuple[float, float, Tensor]:
    """OAI's reward normalisation (``target_mean_std``): the base model answers ``queries`` (a
    :class:`~rlhf_pipeline.sampling.ResponseSampler`, ``cfg.batch_size`` at a time, cut at the task's
    truncation when ``cfg.truncate``), the model scores the answers unnormalised, and its gain and bias
    are set so those scores have ``cfg.target_mean`` and ``cfg.target_std``. One rule for
    train_reward's ``normalize_before`` and the normalize_reward stage. Returns (gain, bias, raw scores)."""
    responses, _ = sampler.sample_batched(base, queries, generator, cfg.batch_size, cfg.truncate, progress=progress)
    raw = score_query_responses(model.eval(), queries, responses, cfg.batch_size, normalized=False)
    gain, bias = fit_normalization(model, raw, cfg.target_mean, cfg.target_std)
    return gain, bias, raw
