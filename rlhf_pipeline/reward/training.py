"""Reward-model training as OAI does it: softmax cross-entropy over the N candidates against the
labelled best (pairwise Bradley-Terry is N=2), one epoch, the learning rate annealed linearly to 0.

The only part of the reward model that needs the optimizer, the training-step scaffold and
:mod:`rlhf_pipeline.distributed`: train_reward imports it; normalize_reward, train_policy and
evaluate do not.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm import tqdm

from rlhf_pipeline import distributed
from rlhf_pipeline.errors import NonFiniteError, PipelineError
from rlhf_pipeline.functional import linear_anneal
from rlhf_pipeline.optim import adam
from rlhf_pipeline.params.reward import RewardTrainParams
from rlhf_pipeline.reward.model import RewardModel
from rlhf_pipeline.sampling import iterate_batches
from rlhf_pipeline.training import accumulate_and_step, mean_of, quarters, set_lr


def best_of_n_loss(rewards: Tensor, best: Tensor, margin: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Reward-model loss for "which of N responses is best" labels (OAI's ``best`` label).

    .. math::
        z_{b,i} = r_{b,i} - m_b\\,[i = y_b],\\qquad
        L = -\\frac1B \\sum_b \\log \\mathrm{softmax}(z_b)_{y_b}

    Why: Ziegler et al. train the reward model as the logits of a softmax over the ``N``
    candidates, so the labelled response gets the highest reward. For ``N = 2`` this is the
    Bradley-Terry loss ``-log sigmoid(r_c - r_r - m)`` (``pairwise_loss``). The optional margin
    (Llama-2 style) asks the chosen reward to win by at least ``m``.

    Returns:
        ``(loss, accuracy)``; accuracy is ``mean(argmax_i r_{b,i} == y_b)`` on the raw rewards,
        detached.
    """
    best = best.long()
    logits = rewards
    if margin is not None:
        one_hot = F.one_hot(best, num_classes=rewards.size(-1)).to(rewards.dtype)
        logits = rewards - margin.to(rewards.dtype).unsqueeze(-1) * one_hot
    loss = F.cross_entropy(logits, best)
    accuracy = (rewards.detach().argmax(dim=-1) == best).to(rewards.dtype).mean()
    return loss, accuracy


def pairwise_loss(chosen: Tensor, rejected: Tensor, margin: Tensor | None = None) -> Tensor:
    """Bradley-Terry pairwise loss, mean over the batch.

    .. math:: L = -\\frac1B\\sum_b \\log\\sigma(r^c_b - r^r_b - m_b)

    Why: the two-candidate case of ``best_of_n_loss`` (softmax over two logits is the
    sigmoid of their difference), written directly with ``logsigmoid`` for stability.
    """
    diff = chosen - rejected
    if margin is not None:
        diff = diff - margin.to(diff.dtype)
    return -F.logsigmoid(diff).mean()


class Labels(NamedTuple):
    """Best-of-N labels as tensors: ``queries`` (B, Q) left-padded, ``samples`` (B, N, R)
    right-padded, ``best`` (B,) the index of the preferred sample, ``margin`` (B,) or None."""

    queries: Tensor
    samples: Tensor
    best: Tensor
    margin: Tensor | None = None


def preference_tensors(split, device: torch.device | str = "cpu") -> Labels:
    """The :class:`Labels` of a preferences split (margin 0 where the data has none)."""
    return Labels(
        queries=torch.tensor(split["query_ids"], dtype=torch.long, device=device),
        samples=torch.tensor(split["sample_ids"], dtype=torch.long, device=device),
        best=torch.tensor(split["best"], dtype=torch.long, device=device),
        margin=torch.tensor(split["margin"], dtype=torch.float32, device=device)
        if "margin" in split.column_names
        else torch.zeros(len(split["best"]), device=device),
    )


@torch.no_grad()
def best_of_n_accuracy(model: RewardModel, queries: Tensor, samples: Tensor, best: Tensor, batch_size: int) -> float:
    correct = 0
    for rows in iterate_batches(len(queries), batch_size):
        rewards = model.score_best_of_n(queries[rows], samples[rows])
        correct += (rewards.argmax(-1) == best[rows]).sum().item()
    return correct / max(len(queries), 1)


class BestOfNScorer(nn.Module):
    """:meth:`RewardModel.score_best_of_n` as a module's forward: the call DDP and FSDP wrap."""

    def __init__(self, model: RewardModel):
        super().__init__()
        self.model = model

    def forward(self, queries: Tensor, samples: Tensor) -> Tensor:
        return self.model.score_best_of_n(queries, samples)


def one_process_accelerator(cfg: RewardTrainParams):
    """The accelerator of a call that passes none (tests, notebooks): this process, on the CPU."""
    return distributed.make_accelerator(
        torch.device("cpu"),
        stage="train_reward",
        collective_timeout_s=cfg.collective_timeout_s,
        timeout_key="reward.train.collective_timeout_s",
    )


def train_reward_model(
    model: RewardModel,
    labels: Labels,
    cfg: RewardTrainParams,
    generator: torch.Generator,
    log=None,
    accelerator=None,
    autocast=contextlib.nullcontext,
) -> list[dict]:
    """OAI reward training: ``cfg.epochs`` passes (reference: 1) over shuffled labels, the learning
    rate annealed linearly from ``cfg.lr`` to 0 by label index, Adam (TensorFlow-style epsilon
    unless ``cfg.tensorflow_adam`` is false), microbatches of ``cfg.microbatch_size`` accumulated
    into steps of ``cfg.batch_size`` labels. The reward gain and bias train with the model unless
    ``cfg.train_gain_bias`` is false (the softmax loss is invariant to the bias, so only the gain, a
    temperature of the N-way choice, actually moves).

    Several processes (``accelerator``, from :func:`rlhf_pipeline.distributed.make_accelerator`):
    ``cfg.batch_size`` stays the global batch; each process takes its contiguous share of every
    batch and the gradients are averaged, so every step is the one-process step. With FSDP ``model``
    is left sharded: :func:`rlhf_pipeline.distributed.whole_model` gathers it. ``autocast``: the
    device plan's (:meth:`rlhf_pipeline.devices.DevicePlan.autocast`), around each forward.

    Returns one record per optimizer step (step, loss, accuracy, lr); ``log(record)`` is called too.
    """
    accelerator = accelerator or one_process_accelerator(cfg)
    if cfg.batch_size % accelerator.num_processes:
        raise PipelineError(
            f"reward.train.batch_size ({cfg.batch_size}) must split evenly over the {accelerator.num_processes} "
            "processes."
        )
    model.gain.requires_grad_(cfg.train_gain_bias)
    model.bias.requires_grad_(cfg.train_gain_bias)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = adam(trainable, lr=cfg.lr, eps=cfg.adam_eps, tensorflow=cfg.tensorflow_adam)
    scorer, optimizer = accelerator.prepare(BestOfNScorer(model), optimizer)
    num_labels = len(labels.best)
    steps_per_epoch = num_labels // cfg.batch_size
    history: list[dict] = []
    model.train()
    bar = tqdm(
        total=steps_per_epoch * cfg.epochs, desc="train_reward", unit="step", disable=not accelerator.is_main_process
    )
    with bar:  # closed on an error too: the stage's error message then starts a line of its own
        for epoch in range(cfg.epochs):
            order = torch.randperm(num_labels, generator=generator)
            for start in range(0, steps_per_epoch * cfg.batch_size, cfg.batch_size):
                lr = linear_anneal(epoch * num_labels + start, num_labels * cfg.epochs, cfg.lr)
                set_lr(optimizer, lr)
                batch = order[start : start + cfg.batch_size]
                share = batch[distributed.share(accelerator, len(batch))]
                records = accumulate_and_step(
                    accelerator,
                    scorer,
                    optimizer,
                    share.split(cfg.microbatch_size),
                    lambda micro: _label_loss(scorer, labels, micro, autocast),
                    lambda what, detail: _non_finite(what, len(history), detail),
                    cfg.max_grad_norm,
                    model,
                )
                # loss and correct choices summed over every process's rows: the one-process figures
                sums = torch.zeros(2, dtype=torch.float64, device=accelerator.device)
                for loss, accuracy, rows in records:
                    sums += torch.tensor([loss, accuracy], dtype=torch.float64, device=accelerator.device) * rows
                loss_sum, correct = distributed.sum_over_processes(accelerator, sums).tolist()
                record = {
                    "step": len(history),
                    "loss": loss_sum / len(batch),
                    "accuracy": correct / len(batch),
                    "lr": lr,
                }
                history.append(record)
                if log is not None:
                    log(record)
                bar.update(1)
                bar.set_postfix(loss=f"{record['loss']:.3f}", acc=f"{record['accuracy']:.2f}")
    model.eval()
    return history


def _label_loss(
    scorer: nn.Module, labels: Labels, micro: Tensor, autocast=contextlib.nullcontext
) -> tuple[Tensor, tuple[float, float, int]]:
    """The best-of-N loss of the labels ``micro`` indexes, and (loss, accuracy, rows) for the record."""
    with autocast():
        rewards = scorer(labels.queries[micro], labels.samples[micro]).float()
    margin = labels.margin[micro] if labels.margin is not None else None
    loss, accuracy = best_of_n_loss(rewards, labels.best[micro], margin)
    return loss, (loss.item(), accuracy.item(), len(micro))


def _non_finite(what: str, step: int, detail) -> NonFiniteError:
    if what == "loss":
        where, causes = "", "reward.train.lr too high, or extreme values in the preference data's margin column"
    else:
        where, causes = f" ({', '.join(detail[:3])}...)", "fp16/bf16 overflow (run in fp32) or reward.train.lr too high"
    return NonFiniteError(
        f"Reward-model {what} became non-finite at step {step}{where}; nothing was written. Likely causes: {causes}."
    )


def training_metrics(history: list[dict], test_accuracy: float, test_rows: int, trainable: int) -> dict:
    """train_reward's metrics: the held-out best-of-N accuracy, the steps, the trainable parameters,
    and (when it trained) the loss and accuracy averaged over the last quarter of the steps."""
    metrics = {
        "test/accuracy": test_accuracy,
        "test/rows": test_rows,
        "train/steps": len(history),
        "trainable_parameters": trainable,
    }
    if history:
        _, last = quarters(history)
        metrics["train/final_loss"] = mean_of(last, "loss")
        metrics["train/final_accuracy"] = mean_of(last, "accuracy")
    return metrics
