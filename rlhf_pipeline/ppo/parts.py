"""What the PPO trainer works with, in one typed container, and the one factory that builds it.

The ``train_policy`` stage and ``bench/ppo_throughput.py`` both call :func:`trainer_parts`, so the bench
times the trainer the stage runs: the same policy (``build_policy``: LoRA, the value model), the same
reference (none with LoRA: the policy with its adapter off) and the same checks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from rlhf_pipeline.devices import STATIC_SAMPLER
from rlhf_pipeline.errors import PipelineError
from rlhf_pipeline.models import load_causal_lm
from rlhf_pipeline.params.ppo import PPOParams
from rlhf_pipeline.params.task import TaskParams
from rlhf_pipeline.ppo.checkpoint import Checkpointer
from rlhf_pipeline.ppo.policy import PolicyWithValue, build_policy
from rlhf_pipeline.reward.model import RewardModel


@dataclass(kw_only=True)
class TrainerParts:
    """The models, data, params and hooks of one PPO run (``N`` train queries of ``Q`` tokens)."""

    policy: PolicyWithValue  # trained: the LM, its value estimate and (optionally) a LoRA adapter
    ref_model: nn.Module | None  # the frozen reference policy; None with LoRA (the adapter off is the reference)
    reward_model: RewardModel | None  # None with ppo.score_source 'gold'
    queries: Tensor  # (N, Q) left-padded train query ids
    tokenizer: object  # the base model's tokenizer (its pad token pads queries and responses)
    task: TaskParams
    cfg: PPOParams
    seed: int
    device: torch.device
    checkpointer: Checkpointer | None = None  # None: no checkpoints (benches, tests)
    gold_labeler: object | None = None  # the simulated labeler: each response's gold score, when at hand
    gold_standardization: tuple[float, float] | None = None  # (mean, std) of the base samples' gold scores
    log: Callable[[dict], None] | None = None  # called with each update's record
    autocast: Callable | None = None  # the device plan's autocast context (None: full precision)
    cuda_sampler: str = STATIC_SAMPLER  # the device plan's sampler on CUDA (DevicePlan.sampler)

    @property
    def pad_id(self) -> int:
        """The token that pads queries and responses (``query_responses != pad_id`` is the attention mask)."""
        return self.tokenizer.pad_token_id

    @property
    def query_length(self) -> int:
        """``Q``: a query's tokens, where each response starts in ``query_responses``."""
        return self.queries.shape[1]

    def __post_init__(self) -> None:
        if self.cfg.score_source == "gold" and (self.gold_labeler is None or self.gold_standardization is None):
            raise PipelineError(
                "ppo.score_source 'gold' needs the simulated labeler (data.preferences.source: simulated) and its "
                "base-sample statistics."
            )


def trainer_parts(
    base_dir: str | Path,
    cfg: PPOParams,
    task: TaskParams,
    seed: int,
    device: torch.device,
    queries: Tensor,
    tokenizer,
    *,
    reward_model: RewardModel | None,
    value_from: str | Path | RewardModel | None = None,
    frozen_device: torch.device | str | None = None,
    **hooks,
) -> TrainerParts:
    """The parts of a run on the base model in ``base_dir``: the reference loaded first (on ``frozen_device``,
    default ``device``; none with LoRA), then the policy (:func:`build_policy`; ``value_from``: the reward
    model, or its folder, a separate value model starts from). ``hooks``: :class:`TrainerParts`' optional
    fields (checkpointer, gold_labeler, gold_standardization, log, autocast, cuda_sampler)."""
    ref_model = load_causal_lm(base_dir, frozen_device or device) if cfg.lora is None else None
    policy = build_policy(base_dir, cfg, device, value_from)
    return TrainerParts(
        policy=policy,
        ref_model=ref_model,
        reward_model=reward_model,
        queries=queries,
        tokenizer=tokenizer,
        task=task,
        cfg=cfg,
        seed=seed,
        device=device,
        **hooks,
    )
