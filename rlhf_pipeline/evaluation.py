"""Evaluation: base vs policy on held-out queries, and the reward over-optimisation curve.

Metrics are computed by small functions on tensors (tested on hand-made numbers):

- per-sequence KL of the policy from the base model, estimated on policy samples:
  ``KL(x) = sum_t [log pi(y_t|x,y_<t) - log rho(y_t|x,y_<t)]`` (k1, at the sampling temperature);
- win rate: fraction of queries where the policy's score beats the base's on the same query,
  ties counting one half;
- improvement in base-std units with its paired standard error: base and policy answer the same
  queries, so the error of the difference comes from the per-query differences.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from rlhf_pipeline.functional import apply_penalty
from rlhf_pipeline.progress import Progress
from rlhf_pipeline.reward import RewardModel, score_query_responses
from rlhf_pipeline.sampling import ResponseSampler, iterate_batches, response_outputs, shared_lower_blocks


def sequence_kl(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor | None = None) -> Tensor:
    """Per-sequence KL estimate sum_t (logp_t - logp_ref_t) over real response tokens: (B,)."""
    diff = logprobs - ref_logprobs
    if mask is not None:
        diff = diff * mask
    return diff.sum(-1)


def win_rate(policy_scores: Tensor | np.ndarray, base_scores: Tensor | np.ndarray) -> float:
    """P(policy > base) on paired samples, ties counted as one half."""
    policy_scores, base_scores = np.asarray(policy_scores, dtype=float), np.asarray(base_scores, dtype=float)
    if policy_scores.shape != base_scores.shape or policy_scores.size == 0:
        raise ValueError("win_rate needs two non-empty arrays of the same shape")
    return float(np.mean((policy_scores > base_scores) + 0.5 * (policy_scores == base_scores)))


def paired_improvement(policy_scores, base_scores) -> tuple[float, float]:
    r"""Improvement of the policy over the base on the same queries, in units of the base's std,
    and its standard error.

    .. math::
        \Delta = \frac{\bar p - \bar b}{s_b},\qquad
        \mathrm{SE}(\Delta) = \frac{\mathrm{sd}(p_i - b_i)}{\sqrt n\, s_b}

    ``s_b`` is the base scores' std (population); ``sd`` of the differences is the sample std
    (n - 1). Pairing removes the between-query variance that two independent samples would carry;
    the uncertainty of ``s_b`` itself is left out (a scale, the same for every checkpoint).
    """
    policy_scores, base_scores = np.asarray(policy_scores, dtype=float), np.asarray(base_scores, dtype=float)
    if policy_scores.shape != base_scores.shape or policy_scores.size < 2:
        raise ValueError("paired_improvement needs two arrays of the same shape with at least 2 entries")
    scale = max(float(base_scores.std()), 1e-8)
    differences = policy_scores - base_scores
    return float(differences.mean() / scale), float(differences.std(ddof=1) / np.sqrt(differences.size) / scale)


@dataclass
class SampleSet:
    """Samples of one model on the evaluation queries, with their scores."""

    responses: Tensor  # truncated, as scored
    valid: Tensor
    proxy: Tensor  # normalised reward-model score (penalty applied where invalid)
    gold: np.ndarray | None
    kl: Tensor  # per-sequence KL from the base model
    texts: list[str]


@torch.no_grad()
def sample_and_score(
    model: nn.Module,
    base: nn.Module,
    reward_model: RewardModel,
    queries: Tensor,
    sampler: ResponseSampler,
    tokenizer,
    seed: int,
    batch_size: int,
    labeler=None,
    progress: str | None = None,
) -> SampleSet:
    """Sample ``model`` on ``queries`` (seeded: the same seed gives base and policy the same
    random stream), score with proxy and gold, and measure KL from ``base``.

    The KL of the base from itself is 0 without a forward pass; a model that shares its lowest
    blocks with the base (a PPO policy trained with frozen lower blocks) hands the base its
    trunk, captured while sampling, so only the blocks above it run again."""
    generator = torch.Generator().manual_seed(seed)
    responses, truncated, valids, kls = [], [], [], []
    q_len = queries.shape[1]
    shared = 0 if model is base else shared_lower_blocks(model, base)
    lines = Progress(progress, len(queries), "queries sampled")
    for rows in iterate_batches(len(queries), batch_size):
        out, trunc, valid = sampler.sample(model, queries[rows], generator, capture_layers=(shared,) if shared else ())
        if model is base:
            kls.append(torch.zeros(len(out.responses)))
        else:
            query_responses = torch.cat([queries[rows], out.responses], 1)
            mask = query_responses != sampler.pad_token_id
            ref_logprobs = response_outputs(
                base,
                query_responses,
                mask,
                q_len,
                sampler.task.temperature,
                sampler.pad_token_id,
                shared,
                out.hidden.get(shared),
            ).logprobs
            kls.append(sequence_kl(out.logprobs, ref_logprobs, out.mask))
        responses.append(out.responses)
        truncated.append(trunc)
        valids.append(valid)
        lines.update(rows.stop)
    truncated_t, valid_t = torch.cat(truncated), torch.cat(valids)
    raw = score_query_responses(reward_model, queries, truncated_t, batch_size)
    proxy = apply_penalty(raw, valid_t, sampler.task.penalty_reward)
    texts = tokenizer.batch_decode(truncated_t, skip_special_tokens=True)
    gold = np.asarray(labeler.score(texts), dtype=float) if labeler is not None else None
    return SampleSet(truncated_t, valid_t, proxy, gold, torch.cat(kls), texts)


def summarize(base: SampleSet, policy: SampleSet) -> dict:
    metrics = {
        "proxy/base_mean": base.proxy.mean().item(),
        "proxy/policy_mean": policy.proxy.mean().item(),
        "kl/mean": policy.kl.mean().item(),
        "win_rate/proxy": win_rate(policy.proxy.numpy(), base.proxy.numpy()),
        "valid/base": base.valid.float().mean().item(),
        "valid/policy": policy.valid.float().mean().item(),
    }
    proxy_gain, proxy_stderr = paired_improvement(policy.proxy.numpy(), base.proxy.numpy())
    metrics.update({"proxy/improvement_in_base_std": proxy_gain, "proxy/improvement_stderr_in_base_std": proxy_stderr})
    if base.gold is not None and policy.gold is not None:
        gold_gain, gold_stderr = paired_improvement(policy.gold, base.gold)
        metrics.update(
            {
                "gold/base_mean": float(base.gold.mean()),
                "gold/base_std": float(base.gold.std()),
                "gold/policy_mean": float(policy.gold.mean()),
                "gold/improvement_in_base_std": gold_gain,
                "gold/improvement_stderr_in_base_std": gold_stderr,
                "gold/queries": int(base.gold.size),
                "win_rate/gold": win_rate(policy.gold, base.gold),
            }
        )
    return metrics


def curve_point(update: int, sample: SampleSet, base: SampleSet) -> dict:
    """One checkpoint on the over-optimisation curve: mean KL from the base (with its standard
    error), and proxy and gold as paired improvements over the base in base-std units (with
    theirs), so the two scores share one comparable scale; raw means are kept too."""
    kl = sample.kl.double()
    point = {
        "update": update,
        "kl": kl.mean().item(),
        "kl_stderr": (kl.std() / len(kl) ** 0.5).item() if len(kl) > 1 else 0.0,
        "sqrt_kl": max(kl.mean().item(), 0.0) ** 0.5,
        "proxy": sample.proxy.mean().item(),
        "gold": None if sample.gold is None else float(sample.gold.mean()),
    }
    point["proxy_std_units"], point["proxy_stderr"] = paired_improvement(sample.proxy.numpy(), base.proxy.numpy())
    if sample.gold is not None and base.gold is not None:
        point["gold_std_units"], point["gold_stderr"] = paired_improvement(sample.gold, base.gold)
    return point


def length_stats(sample: SampleSet, pad_token_id: int) -> dict:
    lengths = (sample.responses != pad_token_id).sum(-1).float()
    return {"mean": lengths.mean().item(), "min": lengths.min().item(), "max": lengths.max().item()}


def snapshot_matches(policy_lm: nn.Module, snapshot: str | Path) -> bool:
    """True if ``policy_lm`` already holds the weights of a PPO snapshot (keys ``lm.<name>``)."""
    from safetensors.torch import load_file

    params = dict(policy_lm.named_parameters())
    return all(
        torch.equal(params[name.removeprefix("lm.")], tensor) for name, tensor in load_file(str(snapshot)).items()
    )


def load_snapshot(policy_lm: nn.Module, snapshot: str | Path) -> None:
    """Overwrite ``policy_lm``'s trained parameters with a PPO snapshot (keys ``lm.<name>``)."""
    from safetensors.torch import load_file

    params = dict(policy_lm.named_parameters())
    with torch.no_grad():
        for name, tensor in load_file(str(snapshot)).items():
            params[name.removeprefix("lm.")].copy_(tensor)


def overoptimization_plot(points: list[dict], path: str | Path, shipped_update: int | None = None) -> None:
    """Gold and proxy against sqrt(KL) (Gao et al. 2022), as a PNG: checkpoints joined in update
    order, both scores as improvements over the base in base-std units with +-1 standard-error
    bars (paired, same queries), each point labelled with its update, the shipped policy ringed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = sorted(points, key=lambda p: p["update"])
    xs = [p["sqrt_kl"] for p in points]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    series = [("proxy", "o-", "proxy (reward model)")]
    if all("gold_std_units" in p for p in points):
        series.append(("gold", "s-", "gold (labeler)"))
    for key, style, label in series:
        ys = [p[f"{key}_std_units"] for p in points]
        ax.errorbar(xs, ys, yerr=[p[f"{key}_stderr"] for p in points], fmt=style, capsize=3, label=label)
        for p, y in zip(points, ys):
            ax.annotate(str(p["update"]), (p["sqrt_kl"], y), fontsize=7, textcoords="offset points", xytext=(4, 3))
        shipped = [(x, y) for p, x, y in zip(points, xs, ys) if p["update"] == shipped_update]
        if shipped:
            ax.plot(
                *shipped[0],
                "o",
                markersize=14,
                markerfacecolor="none",
                markeredgecolor="black",
                label="shipped policy" if key == "proxy" else None,
            )
    ax.axhline(0.0, color="grey", linewidth=0.8)
    ax.set_xlabel("sqrt(KL(policy || base))  [nats^0.5]")
    ax.set_ylabel("improvement over the base  [base std]")
    ax.set_title("Reward over-optimisation across PPO checkpoints")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
