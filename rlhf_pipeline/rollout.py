"""Sampling with the task's post-processing: fixed-length responses, OAI truncation, penalty flag.

Shared by reward normalisation, PPO rollouts and evaluation so all three see responses processed
the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from rlhf_pipeline.errors import PipelineError
from rlhf_pipeline.functional import truncate_response
from rlhf_pipeline.params import TaskParams
from rlhf_pipeline.sampling import is_left_padded, iterate_batches, sample_responses


def single_token_id(tokenizer, text: str | None, key: str) -> int | None:
    """Token id of ``text`` (e.g. task.truncate_token '.'), which must encode to exactly one token."""
    if text is None:
        return None
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) != 1:
        raise PipelineError(
            f"{key} {text!r} encodes to {len(ids)} tokens {ids} with this tokenizer; it must be a single token."
        )
    return ids[0]


@dataclass
class TaskSampler:
    """Samples responses for the task and post-processes them like lm-human-preferences."""

    task: TaskParams
    pad_token_id: int
    eos_token_id: int | None
    truncate_token_id: int | None

    @classmethod
    def from_tokenizer(cls, task: TaskParams, tokenizer) -> TaskSampler:
        return cls(
            task,
            tokenizer.pad_token_id,
            tokenizer.eos_token_id,
            single_token_id(tokenizer, task.truncate_token, "task.truncate_token"),
        )

    def sample(
        self,
        model: nn.Module,
        queries: Tensor,
        generator: torch.Generator,
        value_head: nn.Module | None = None,
        num_samples: int = 1,
        capture_layers: tuple[int, ...] = (),
    ):
        out = sample_responses(
            model,
            queries,
            queries != self.pad_token_id,
            self.task.response_length,
            self.task.temperature,
            self.pad_token_id,
            generator=generator,
            eos_token_id=self.eos_token_id,
            stop_at_eos=self.task.stop_at_eos,
            value_head=value_head,
            num_samples=num_samples,
            capture_layers=capture_layers,
        )
        truncated, valid = self.truncate(out.responses)
        return out, truncated, valid

    def truncate(self, responses: Tensor) -> tuple[Tensor, Tensor]:
        return truncate_response(responses, self.truncate_token_id, self.task.truncate_after, self.pad_token_id)

    @torch.no_grad()
    def sample_batched(
        self, model: nn.Module, queries: Tensor, generator: torch.Generator, batch_size: int, truncate: bool = True
    ) -> tuple[Tensor, Tensor]:
        """Responses (truncated unless ``truncate`` is false: the raw fixed-length samples) and
        their validity for many queries, in batches: ((B, R), (B,))."""
        responses, valids = [], []
        for rows in iterate_batches(len(queries), batch_size):
            out, truncated, valid = self.sample(model, queries[rows], generator)
            responses.append(truncated if truncate else out.responses)
            valids.append(valid)
        return torch.cat(responses), torch.cat(valids)


def load_queries(path: str, split: str, pad_token_id: int, limit: int | None = None) -> Tensor:
    """Query ids of a split of the queries dataset as a left-padded (B, Q) tensor."""
    from datasets import load_from_disk

    rows = load_from_disk(path)[split]["query_ids"]
    queries = torch.tensor(rows[:limit] if limit is not None else rows, dtype=torch.long)
    if not is_left_padded(queries, pad_token_id):
        raise PipelineError(
            f"{path} ({split}) holds queries that are not left-padded (written by an older version?); rerun `dvc "
            "repro queries`."
        )
    return queries


def draw_queries(queries: Tensor, n: int, generator: torch.Generator) -> Tensor:
    """``n`` rows of ``queries`` drawn without replacement, reshuffled whenever all have been drawn.

    With ``n == len(queries)`` every query appears exactly once, so a mean over the draws has no
    query-sampling error with respect to that (finite) query set, only the responses' noise.
    """
    passes = -(-n // len(queries))
    order = torch.cat([torch.randperm(len(queries), generator=generator) for _ in range(passes)])
    return queries[order[:n]]
