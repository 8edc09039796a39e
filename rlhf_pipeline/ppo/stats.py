"""What a PPO update measures, as typed containers, and the one place their metric names live.

The trainer fills :class:`RolloutStats` (a batch's gold score and KL readings), :class:`LossStats` (one
microbatch's loss terms) and :class:`UpdateTimes` (how long each phase took); :func:`update_record` names
them as the update's record, the ``history`` that is checkpointed (``history.json``) and logged to DVCLive.
Its keys and their order are that file's bytes: a new statistic is a new field here and a new key there.
Timings are kept apart from the record (the stage's speed metric only), so a rerun writes the same bytes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch
from torch import Tensor

from rlhf_pipeline.functional import masked_mean
from rlhf_pipeline.training import mean_of, quarters


@dataclass(kw_only=True)
class RolloutStats:
    """Scalars of a whole rollout batch (every process's rows), each None where it is not read."""

    gold: float | None = None  # mean gold score of the responses (a simulated labeler is at hand)
    kl_exact: float | None = None  # mean exact KL of the responses to the reference (ppo.kl.budget)
    kl_checked: float | None = None  # the policy's precise KL reading, over more responses (when taken)


@dataclass(kw_only=True)
class LossStats:
    """One microbatch's loss terms (:meth:`PPOTrainer.loss`); the value terms are None without a critic."""

    policy: float  # the clipped policy loss
    total: float  # what the step minimises
    entropy: float  # mean entropy of the policy at the response tokens
    approxkl: float  # 0.5 * mean (log ratio)^2 against the sampling policy
    clipfrac: float  # fraction of tokens whose ratio the clip bound
    ratio_mean: float
    ratio_max: float  # over processes: the maximum, not the mean
    value: float | None = None  # the clipped value loss
    value_clipfrac: float | None = None
    # the rollout-trainer gap (:func:`logprob_gap`): the update's, set once its microbatches are averaged
    logprob_gap_max: float | None = None
    logprob_gap_mean: float | None = None


# the record's name of each LossStats field: sorted by name, as the record has always listed them
_LOSS_NAMES = {
    "policy": "loss/policy",
    "total": "loss/total",
    "value": "loss/value",
    "approxkl": "policy/approxkl",
    "clipfrac": "policy/clipfrac",
    "entropy": "policy/entropy",
    "logprob_gap_max": "policy/logprob_gap_max",
    "logprob_gap_mean": "policy/logprob_gap_mean",
    "ratio_max": "policy/ratio_max",
    "ratio_mean": "policy/ratio_mean",
    "value_clipfrac": "val/clipfrac",
}


def mean_loss_stats(records: Sequence[LossStats], gather_rows, device: torch.device) -> LossStats:
    """Every process's microbatch statistics (``gather_rows``: one row per process, in process order)
    averaged over all microbatches (``ratio_max``: their maximum): the statistics of the one-process run."""
    present = [f.name for f in fields(LossStats) if getattr(records[0], f.name) is not None]
    sums = dict.fromkeys(present, 0.0)
    for record in records:
        for name in present:
            value = getattr(record, name)
            sums[name] = max(sums[name], value) if name == "ratio_max" else sums[name] + value
    local = torch.tensor([[sums[name] for name in present] + [len(records)]], dtype=torch.float64, device=device)
    every = gather_rows(local)
    return LossStats(
        **{
            name: every[:, i].max().item() if name == "ratio_max" else (every[:, i].sum() / every[:, -1].sum()).item()
            for i, name in enumerate(present)
        }
    )


def gap_terms(sampled: Tensor, trained: Tensor, mask: Tensor) -> Tensor:
    """One microbatch's share of :func:`logprob_gap`: (3,) float64, the largest
    ``|sampled - trained|`` over the tokens ``mask`` keeps, their sum and their count."""
    gap = (trained.detach().double() - sampled.double()).abs()[mask.bool()]
    largest = gap.max() if gap.numel() else gap.new_zeros(())
    return torch.stack([largest, gap.sum(), gap.new_tensor(float(gap.numel()))])


def logprob_gap(terms: Sequence[Tensor], gather_rows, device: torch.device) -> dict[str, float]:
    r"""The rollout-trainer gap of an update, over every process's kept response tokens in the microbatches
    whose :func:`gap_terms` are ``terms``:

    .. math:: \max_t |\log\pi_{\text{sample}}(a_t) - \log\pi_{\text{train}}(a_t)| \quad\text{and its mean,}

    the old log-probability each token was sampled with (the decoding pass over a KV cache) against the one
    the first training forward gives it, before any optimizer step moved the policy. Zero when the two
    passes compute the same bytes; ``{}`` without terms."""
    if not terms:
        return {}
    mine = torch.stack(list(terms))
    local = torch.stack([mine[:, 0].max(), mine[:, 1].sum(), mine[:, 2].sum()])[None].to(device)
    every = gather_rows(local)
    count = every[:, 2].sum().item()
    mean = every[:, 1].sum().item() / count if count else 0.0
    return {"logprob_gap_max": every[:, 0].max().item(), "logprob_gap_mean": mean}


@dataclass(kw_only=True)
class UpdateTimes:
    """Seconds each phase of one update took on this process: the stage's speed metric, never the record."""

    generation: float  # the sampling forwards
    reference: float  # the frozen forwards over query + response (and a separate value model's)
    scoring: float  # the reward model or the gold labeler
    training: float = 0.0  # advantages to the last optimizer step
    kl_check: float = 0.0  # ppo.kl.budget's precise readings
    update: float = 0.0  # the whole update
    episodes_per_second: float = 0.0

    def __add__(self, other: UpdateTimes) -> UpdateTimes:
        return UpdateTimes(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})


def update_record(
    *,
    update: int,
    batch_size: int,
    scores: Tensor,
    valid: Tensor,
    response_lengths: Tensor,
    non_score: Tensor,
    values: Tensor | None,
    returns: Tensor | None,
    mask: Tensor,
    rollout: RolloutStats,
    loss: LossStats,
    lr: float,
    mean_kl: float,
    kl_coef: float,
) -> dict:
    """The record of update ``update`` (from 0): its batch's ``(B,)`` scores, validity and response lengths,
    ``(B, R)`` KL penalty, values, returns and mask, and the update's scalars, under their metric names."""
    record = {
        "update": update + 1,
        "episodes": (update + 1) * batch_size,
        "objective/score": scores.mean().item(),
        "objective/score_std": scores.std().item(),
        "objective/kl": mean_kl,
        "objective/kl_coef": kl_coef,
        "objective/non_score_reward": (non_score.sum(-1)).mean().item(),
        "objective/valid_fraction": valid.float().mean().item(),
        "response/length": response_lengths.float().mean().item(),
    }
    if values is not None:
        record["val/mean"] = masked_mean(values, mask).item()
        record["returns/mean"] = masked_mean(returns, mask).item()
    for name, key in (
        ("gold", "objective/gold"),
        ("kl_exact", "objective/kl_exact"),
        ("kl_checked", "objective/kl_checked"),
    ):
        if getattr(rollout, name) is not None:
            record[key] = getattr(rollout, name)
    record |= {key: getattr(loss, name) for name, key in _LOSS_NAMES.items() if getattr(loss, name) is not None}
    record["lr"] = lr
    return record


def non_finite_values(record: dict) -> bool:
    return not all(math.isfinite(v) for v in record.values() if isinstance(v, float))


def kl_reading(record: dict) -> float:
    """The KL of the policy an update started from: its precise reading where one was taken, else its rollout's."""
    return record.get("objective/kl_checked", record["objective/kl_exact"])


def display(record: dict) -> dict[str, str]:
    """What the progress bar shows of an update."""
    return {"score": f"{record['objective/score']:.3f}", "kl": f"{record['objective/kl']:.2f}"}


def history_summary(history: list[dict], with_gold: bool) -> dict:
    """The run's metrics from its per-update records: the score (and gold, ``with_gold``) averaged
    over the first and the last quarter of the updates, the KL over the last quarter, and the final
    KL coefficient. Quarters, not single updates: one update's batch mean is noisy."""
    first, last = quarters(history)
    metrics = {
        "updates": len(history),
        "episodes": history[-1]["episodes"],
        "score/first_quarter": mean_of(first, "objective/score"),
        "score/last_quarter": mean_of(last, "objective/score"),
        "kl/last_quarter": mean_of(last, "objective/kl"),
        "kl_coef/final": history[-1]["objective/kl_coef"],
    }
    if with_gold:
        metrics["gold/first_quarter"] = mean_of(first, "objective/gold")
        metrics["gold/last_quarter"] = mean_of(last, "objective/gold")
    gapped = [record for record in history if "policy/logprob_gap_max" in record]
    if gapped:  # the rollout-trainer gap over the whole run: its largest token, and its mean over the updates
        metrics["logprob_gap/max"] = max(record["policy/logprob_gap_max"] for record in gapped)
        metrics["logprob_gap/mean"] = mean_of(gapped, "policy/logprob_gap_mean")
    return metrics
