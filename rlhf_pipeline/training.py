"""One optimizer step, as both trainers take it (the reward model's and PPO's).

A step covers this process's share of a global minibatch, cut into microbatches for memory. Each
microbatch's loss is backpropagated scaled by its share of the rows, so the accumulated gradient is
the share's mean; gradients are averaged over processes once, after the last microbatch (the others
run under ``no_sync``). Then every process refuses the step together if any of them saw a non-finite
loss or gradient (one fp16/bf16 overflow would put NaN into every weight), and otherwise the
gradient is clipped and applied. Learning-rate schedules set the rate before each step
(:func:`set_lr`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

import torch
from torch import Tensor, nn

from rlhf_pipeline import distributed

# loss_of(microbatch indices) -> (loss, a record of the microbatch's statistics)
LossOf = Callable[[Tensor], tuple[Tensor, Any]]
# refusal("loss", the first bad record) or refusal("gradient", the parameter names): the error to raise
Refusal = Callable[[str, Any], Exception]


def mean_of(records: Sequence[dict], key: str) -> float:
    """The mean of ``key`` over a run's per-step (or per-update) ``records``."""
    return sum(record[key] for record in records) / len(records)


def quarters(records: Sequence[dict]) -> tuple[Sequence[dict], Sequence[dict]]:
    """The first and the last quarter of a run's records (at least one record each): what a run's
    metrics average over, since one step's batch mean is noisy."""
    quarter = max(1, len(records) // 4)
    return records[:quarter], records[-quarter:]


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def accumulate_and_step(
    accelerator,
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    micros: Sequence[Tensor],
    loss_of: LossOf,
    refusal: Refusal,
    max_grad_norm: float | None = None,
    model: nn.Module | None = None,
) -> list[Any]:
    """One step over ``micros`` (the index tensors of this process's share, in microbatches) of
    ``module`` (as ``accelerator.prepare`` returned it: what ``loss_of`` calls); returns each
    microbatch's record. ``model``: the unwrapped module whose gradients are checked, clipped and
    named in a refusal (default ``module``)

    .. math:: g = \\sum_m \\frac{|m|}{\\sum_{m'} |m'|}\\, \\nabla L_m

    Raises ``refusal(...)`` on every process, before the step, when any process's loss or gradient
    is not finite."""
    optimizer.zero_grad(set_to_none=True)
    rows = sum(len(micro) for micro in micros)
    records, bad_loss = [], None
    for i, micro in enumerate(micros):
        with nullcontext() if i == len(micros) - 1 else accelerator.no_sync(module):
            loss, record = loss_of(micro)
            if bad_loss is None and not torch.isfinite(loss):
                bad_loss = record
            accelerator.backward(loss * len(micro) / rows)
        records.append(record)
    if distributed.any_process(accelerator, bad_loss is not None):
        raise refusal("loss", bad_loss)
    model = module if model is None else model
    bad_gradients = distributed.non_finite_gradients(accelerator, model)
    if bad_gradients:  # a finite loss can still overflow in the backward pass
        raise refusal("gradient", bad_gradients)
    if max_grad_norm is not None:  # the norm over every process's gradient, sharded or not
        accelerator.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], max_grad_norm)
    optimizer.step()
    return records
