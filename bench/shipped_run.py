"""The shipped run's models, loaded once for a probe that samples them as `evaluate` does.

:func:`probe_parser` gives a probe its options (draws, policy, output); :func:`load_shipped_run` reads
`params.yaml`, the base model, a policy, the normalised reward model and the task's sampler from the
workspace (after `dvc repro`); :meth:`ShippedRun.evaluation` is the evaluation's setup on some queries
with a random stream of the probe's own (not the evaluation's, ``params.seed + 2``).
"""

from __future__ import annotations

import rlhf_pipeline.offline  # noqa: F401  (first: offline and quiet before transformers loads)

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rlhf_pipeline import paths
from rlhf_pipeline.evaluation import Evaluation
from rlhf_pipeline.models import load_causal_lm, load_tokenizer
from rlhf_pipeline.params.schema import Params, load_params
from rlhf_pipeline.reward.model import RewardModel
from rlhf_pipeline.reward.persistence import load_reward_model
from rlhf_pipeline.sampling import ResponseSampler

PROBE_SEED = 10_000  # a probe's draw d samples with stream PROBE_SEED + d


@dataclass
class ShippedRun:
    params: Params
    tokenizer: Any
    base: nn.Module
    policy: nn.Module
    reward_model: RewardModel
    sampler: ResponseSampler

    def evaluation(self, queries: torch.Tensor, draw: int, labeler: Any = None) -> Evaluation:
        return Evaluation(
            base=self.base,
            reward_model=self.reward_model,
            queries=queries,
            sampler=self.sampler,
            tokenizer=self.tokenizer,
            seed=PROBE_SEED + draw,
            batch_size=self.params.evaluate.batch_size,
            labeler=labeler,
        )


def probe_parser(doc: str, draws: int, draws_help: str) -> argparse.ArgumentParser:
    """A probe's options: ``--draws`` (responses per query, each from its own stream), ``--policy``
    (the policy folder) and ``--output`` (also write the report there)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draws", type=int, default=draws, help=draws_help)
    parser.add_argument("--policy", default=paths.POLICY)
    parser.add_argument("--output", type=Path)
    return parser


def load_shipped_run(policy: str = paths.POLICY) -> ShippedRun:
    torch.manual_seed(0)
    params = load_params("params.yaml")
    tokenizer = load_tokenizer(paths.BASE_MODEL)
    return ShippedRun(
        params=params,
        tokenizer=tokenizer,
        base=load_causal_lm(paths.BASE_MODEL).eval(),
        policy=load_causal_lm(policy).eval(),
        reward_model=load_reward_model(paths.REWARD, torch.device("cpu")),
        sampler=ResponseSampler.from_tokenizer(params.task, tokenizer),
    )
