"""Evaluation: base vs policy on held-out queries, and the reward over-optimisation curve.

Metrics are computed by small functions on tensors (tested on hand-made numbers):

- per-sequence KL of the policy from the base model, estimated on policy samples with the
  estimator PPO used (``ppo.kl.estimator``; k1: ``sum_t [log pi(y_t|x,y_<t) - log rho(y_t|x,y_<t)]``,
  at the sampling temperature), and k1 besides when PPO used another; and the same KL with each
  token's term exact over the vocabulary (:func:`rlhf_pipeline.ppo.kl.exact_kl`, what ``ppo.kl.budget``
  reads), whose standard error is smaller (no noise from which token was drawn): the one to judge a
  KL limit by;
- win rate: fraction of queries where the policy's score beats the base's on the same query,
  ties counting one half;
- improvement in base-std units with its paired standard error: base and policy answer the same
  queries, so the error of the difference comes from the per-query differences.

With ``evaluate.responses_per_query`` = k > 1 each model answers every query k times (rows
``i * k + j``: query i's j-th response, the prefill run once per query); the per-response scores are
averaged per query before a standard error is taken, so the error counts queries, not responses
(responses to one query are not independent draws of the test set).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from rlhf_pipeline import metric_keys as keys
from rlhf_pipeline.decoding import SampleOutput
from rlhf_pipeline.devices import model_device
from rlhf_pipeline.io import write_figure
from rlhf_pipeline.ppo.kl import exact_kl_by_rows, kl_penalty
from rlhf_pipeline.progress import Progress
from rlhf_pipeline.reward.model import RewardModel
from rlhf_pipeline.reward.normalization import task_scores
from rlhf_pipeline.sampling import (
    ResponseSampler,
    final_state_layer,
    iterate_batches,
    own_response_hidden,
    response_hidden,
    response_logits,
    shared_lower_blocks,
    zero_at_pad,
)


def sequence_kl(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor | None = None, estimator: str = "k1") -> Tensor:
    """Per-sequence KL estimate ``sum_t kl_t`` over the real response tokens, with the per-token
    estimator PPO penalises (:func:`rlhf_pipeline.ppo.kl.kl_penalty`): (B,)."""
    kl = kl_penalty(logprobs, ref_logprobs, estimator)
    if mask is not None:
        kl = kl * mask
    return kl.sum(-1)


def per_query(values: Tensor | np.ndarray, responses_per_query: int = 1):
    """Each query's mean over its ``responses_per_query`` consecutive rows: (n * k,) -> (n,)."""
    if len(values) % responses_per_query:
        raise ValueError(f"{len(values)} values are not whole groups of {responses_per_query} responses per query")
    return values.reshape(-1, responses_per_query).mean(1)


def mean_and_stderr(values: Tensor, responses_per_query: int = 1) -> tuple[float, float]:
    """The mean of ``values`` (n * k,) and its standard error over the n queries ``sd(q) / sqrt(n)``, with
    ``q`` each query's mean over its k responses (sample sd; 0 for one query)."""
    values = per_query(values.double(), responses_per_query)
    return values.mean().item(), (values.std() / len(values) ** 0.5).item() if len(values) > 1 else 0.0


def win_rate(policy_scores: Tensor | np.ndarray, base_scores: Tensor | np.ndarray) -> float:
    """P(policy > base) on paired samples, ties counted as one half."""
    policy_scores, base_scores = np.asarray(policy_scores, dtype=float), np.asarray(base_scores, dtype=float)
    if policy_scores.shape != base_scores.shape or policy_scores.size == 0:
        raise ValueError("win_rate needs two non-empty arrays of the same shape")
    return float(np.mean((policy_scores > base_scores) + 0.5 * (policy_scores == base_scores)))


# below this standard deviation (relative to the scores' scale, at least 1) the base's scores are
# all alike and a difference divided by it is float noise blown up, not an improvement
DEGENERATE_STD = 1e-6


def undefined_scale(base_scores) -> str | None:
    """Why base-σ units are undefined for ``base_scores`` (their spread is ~0), or None."""
    base_scores = np.asarray(base_scores, dtype=float)
    std = float(base_scores.std())
    if std > DEGENERATE_STD * max(1.0, float(np.abs(base_scores).mean())):
        return None
    return (
        f"the base's scores have a standard deviation of {std:.3g} (every base response scored alike), "
        "so an improvement in units of the base's standard deviation is undefined"
    )


def paired_improvement(
    policy_scores, base_scores, responses_per_query: int = 1
) -> tuple[float, float] | tuple[None, None]:
    r"""Improvement of the policy over the base on the same queries, in units of the base's std,
    and its standard error.

    .. math::
        \Delta = \frac{\bar p - \bar b}{s_b},\qquad
        \mathrm{SE}(\Delta) = \frac{\mathrm{sd}(d_i)}{\sqrt n\, s_b},\qquad
        d_i = \frac1k \sum_j (p_{ij} - b_{ij})

    over n queries with k responses each (rows ``i * k + j``). ``s_b`` is the std (population) of the
    base's scores of single responses, the scale a user meets, whatever k; ``sd`` of the per-query
    differences is the sample std (n - 1). Pairing removes the between-query variance that two
    independent samples would carry; the uncertainty of ``s_b`` itself is left out (a scale, the same
    for every checkpoint). ``(None, None)`` when ``s_b`` is ~0 (:func:`undefined_scale` says why).
    """
    policy_scores, base_scores = np.asarray(policy_scores, dtype=float), np.asarray(base_scores, dtype=float)
    if policy_scores.shape != base_scores.shape or policy_scores.size < 2 * responses_per_query:
        raise ValueError("paired_improvement needs two arrays of the same shape with at least 2 queries")
    if undefined_scale(base_scores):
        return None, None
    scale = float(base_scores.std())
    differences = per_query(policy_scores - base_scores, responses_per_query)
    return float(differences.mean() / scale), float(differences.std(ddof=1) / np.sqrt(differences.size) / scale)


@dataclass(kw_only=True)
class SampleSet:
    """Samples of one model on the evaluation queries (``n`` of them, ``k`` responses each: row
    ``i * k + j`` is query i's j-th response), with their scores."""

    responses: Tensor  # (n * k, R) truncated, as scored
    valid: Tensor  # (n * k,) bool
    proxy: Tensor  # (n * k,) the task's score: normalised reward model, penalty where invalid
    gold: np.ndarray | None  # (n * k,) the labeler's score, when labels are simulated
    kl: Tensor  # (n * k,) per-sequence KL from the base model, by ppo.kl.estimator
    kl_k1: Tensor  # (n * k,) the same with k1 (the same tensor when the estimator is k1)
    kl_exact: Tensor  # (n * k,) the same with each token's term exact over the vocabulary
    texts: list[str]
    responses_per_query: int = 1  # k

    @property
    def num_queries(self) -> int:
        return len(self.proxy) // self.responses_per_query

    def first(self, n: int) -> SampleSet:
        """The samples of the first ``n`` queries (all their responses)."""
        rows = n * self.responses_per_query
        return SampleSet(
            responses=self.responses[:rows],
            valid=self.valid[:rows],
            proxy=self.proxy[:rows],
            gold=None if self.gold is None else self.gold[:rows],
            kl=self.kl[:rows],
            kl_k1=self.kl_k1[:rows],
            kl_exact=self.kl_exact[:rows],
            texts=self.texts[:rows],
            responses_per_query=self.responses_per_query,
        )


@dataclass(kw_only=True)
class Evaluation:
    """What every model is measured against: the base model, the reward model, the held-out
    queries, the task's sampler, and how (seed, batch size, gold labeler, KL estimator, responses
    per query)."""

    base: nn.Module
    reward_model: RewardModel
    queries: Tensor  # (n, Q) left-padded
    sampler: ResponseSampler
    tokenizer: Any
    seed: int  # the same for every model: base and policy draw the same random stream
    batch_size: int  # responses sampled at once: batch_size // responses_per_query queries
    labeler: Any = None
    kl_estimator: str = "k1"
    responses_per_query: int = 1

    @property
    def queries_per_batch(self) -> int:
        return max(1, self.batch_size // self.responses_per_query)


@torch.no_grad()
def sample_and_score(model: nn.Module, setup: Evaluation, progress: str | None = None) -> SampleSet:
    """Sample ``model`` on the queries, score with proxy and gold, and measure KL from the base.

    The KL of the base from itself is 0 without a forward pass. For another model, the base and the
    model each run one forward over query and response (the exact KL needs both distributions at every
    response position); a model that shares its lowest blocks with the base (a PPO policy trained with
    frozen lower blocks) hands both its trunk, captured while sampling, so only the blocks above it run,
    and its own final states at the response positions come from the sampling forwards too, so only the
    base runs them."""
    base, queries, sampler = setup.base, setup.queries.to(model_device(model)), setup.sampler
    per_query_rows = setup.responses_per_query
    generator = torch.Generator().manual_seed(setup.seed)
    truncated, valids, kls, kls_k1, kls_exact = [], [], [], [], []
    shared = 0 if model is base else shared_lower_blocks(model, base)
    capture = (shared, final_state_layer(model)) if shared else ()
    lines = Progress(progress, len(queries), "queries sampled")
    for rows in iterate_batches(len(queries), setup.queries_per_batch):
        out, trunc, valid = sampler.sample(
            model, queries[rows], generator, num_samples=per_query_rows, capture_layers=capture
        )
        if model is base:
            kls.append(torch.zeros(len(out.responses)))
            kls_k1.append(kls[-1])  # used only with another estimator, where k1 of the base is 0 too
            kls_exact.append(kls[-1])
        else:
            kl_exact, reference_logprobs = exact_kl_and_reference_logprobs(
                model,
                base,
                repeat_rows(queries[rows], per_query_rows),
                out,
                sampler.task.temperature,
                sampler.pad_token_id,
                shared,
            )
            kls.append(sequence_kl(out.logprobs, reference_logprobs, out.mask, setup.kl_estimator))
            kls_k1.append(
                kls[-1] if setup.kl_estimator == "k1" else sequence_kl(out.logprobs, reference_logprobs, out.mask)
            )
            kls_exact.append(kl_exact)
        truncated.append(trunc)
        valids.append(valid)
        lines.update(rows.stop)
    truncated_t, valid_t = torch.cat(truncated), torch.cat(valids)
    proxy = task_scores(
        setup.reward_model,
        repeat_rows(queries, per_query_rows),
        truncated_t,
        valid_t,
        sampler.task.penalty_reward,
        setup.batch_size,
    )
    texts = setup.tokenizer.batch_decode(truncated_t, skip_special_tokens=True)
    gold = np.asarray(setup.labeler.score(texts), dtype=float) if setup.labeler is not None else None
    kl = torch.cat(kls).cpu()
    kl_k1 = kl if setup.kl_estimator == "k1" else torch.cat(kls_k1).cpu()
    # on the CPU whatever the model ran on: the summary reads them with numpy
    return SampleSet(
        responses=truncated_t.cpu(),
        valid=valid_t.cpu(),
        proxy=proxy.cpu(),
        gold=gold,
        kl=kl,
        kl_k1=kl_k1,
        kl_exact=torch.cat(kls_exact).cpu(),
        texts=texts,
        responses_per_query=per_query_rows,
    )


def exact_kl_and_reference_logprobs(
    model: nn.Module,
    reference: nn.Module,
    queries: Tensor,
    samples: SampleOutput,
    temperature: float,
    pad_token_id: int,
    shared: int = 0,
) -> tuple[Tensor, Tensor]:
    """The exact KL of ``model`` from ``reference`` on ``model``'s own ``samples`` of ``queries`` (one
    query row per response), (B,), and the reference's logprobs of the sampled tokens, 0 at pad, (B, R).

    Both models run to their final hidden states over query and response; with ``shared`` > 0 lower
    blocks both start from the trunk the sampler captured at that block. The model's own logprobs came
    with its samples, so only its hidden states are needed, and where the sampler captured its final states
    (:func:`own_response_hidden`) not even a forward of it; one projection of the reference's head, a
    few rows at a time, serves both the exact KL and the sampled tokens' logprobs."""
    query_responses = torch.cat([queries, samples.responses], 1)
    mask, trunk, query_length = query_responses != pad_token_id, samples.hidden.get(shared), queries.shape[1]
    own = own_response_hidden(model, samples, query_responses, mask, query_length, shared, trunk)
    theirs = response_hidden(reference, query_responses, mask, query_length, shared, trunk)
    model_logits, reference_logits = (
        partial(response_logits, m, temperature=temperature, pad_token_id=pad_token_id) for m in (model, reference)
    )
    kl_exact, reference_logprobs = exact_kl_by_rows(
        model_logits, reference_logits, own, theirs, samples.mask, labels=samples.responses
    )
    return kl_exact, zero_at_pad(reference_logprobs, samples.responses, pad_token_id)


def repeat_rows(queries: Tensor, times: int) -> Tensor:
    """Each query row ``times`` times in a row, as the sampler lays out its responses (the queries
    themselves, not a copy, for one)."""
    return queries if times == 1 else queries.repeat_interleave(times, 0)


def summarize(base: SampleSet, policy: SampleSet) -> dict:
    """The evaluation's metrics: means over every response, standard errors over queries."""
    k = policy.responses_per_query
    kl_exact, kl_exact_se = mean_and_stderr(policy.kl_exact, k)
    metrics = {
        keys.PROXY_BASE_MEAN: base.proxy.mean().item(),
        keys.PROXY_POLICY_MEAN: policy.proxy.mean().item(),
        keys.KL: policy.kl.mean().item(),
        keys.KL_SE: mean_and_stderr(policy.kl, k)[1],
        **({"kl/k1_mean": policy.kl_k1.mean().item()} if policy.kl_k1 is not policy.kl else {}),
        keys.KL_EXACT: kl_exact,
        keys.KL_EXACT_SE: kl_exact_se,
        keys.WIN_RATE_PROXY: win_rate(policy.proxy.numpy(), base.proxy.numpy()),
        "valid/base": base.valid.float().mean().item(),
        "valid/policy": policy.valid.float().mean().item(),
    }
    metrics.update(_improvement("proxy", policy.proxy.numpy(), base.proxy.numpy(), k))
    if base.gold is not None and policy.gold is not None:
        metrics.update(
            {
                keys.GOLD_BASE_MEAN: float(base.gold.mean()),
                keys.GOLD_BASE_STD: float(base.gold.std()),
                keys.GOLD_POLICY_MEAN: float(policy.gold.mean()),
                **_improvement("gold", policy.gold, base.gold, k),
                keys.GOLD_QUERIES: policy.num_queries,
                keys.WIN_RATE_GOLD: win_rate(policy.gold, base.gold),
            }
        )
    metrics[keys.RESPONSES_PER_QUERY] = k
    return metrics


def _improvement(score: str, policy_scores, base_scores, responses_per_query: int = 1) -> dict:
    """``score``'s paired improvement metrics: null, with ``<score>/improvement_undefined`` saying
    why, when the base's scores have no spread."""
    gain, stderr = paired_improvement(policy_scores, base_scores, responses_per_query)
    reason = {keys.gain_undefined(score): undefined_scale(base_scores)} if gain is None else {}
    return {keys.gain(score): gain, keys.gain_se(score): stderr, **reason}


def curve_queries(num_queries: int, wanted: int | None, queries_per_batch: int) -> int:
    """How many of the ``num_queries`` evaluation queries a curve checkpoint is sampled on
    (``evaluate.curve_queries``): the first ``wanted`` rounded up to whole batches, so that each row
    gets the uniform the base's row got (the sampler draws a batch's uniforms together); all when null."""
    if wanted is None:
        return num_queries
    return min(num_queries, -(-wanted // queries_per_batch) * queries_per_batch)


def curve_point(update: int, sample: SampleSet, base: SampleSet) -> dict:
    """One checkpoint on the over-optimisation curve: mean KL from the base (with its standard
    error), and proxy and gold as paired improvements over the base in base-std units (with
    theirs), so the two scores share one comparable scale; raw means are kept too. ``base`` holds
    the base's samples on the queries ``sample`` was drawn on (the first ones: :meth:`SampleSet.first`)."""
    base, k = base.first(sample.num_queries), sample.responses_per_query
    kl, kl_stderr = mean_and_stderr(sample.kl, k)
    kl_exact, kl_exact_stderr = mean_and_stderr(sample.kl_exact, k)
    point = {
        "update": update,
        "kl": kl,
        "kl_stderr": kl_stderr,
        "kl_exact": kl_exact,
        "kl_exact_stderr": kl_exact_stderr,
        "sqrt_kl": max(kl, 0.0) ** 0.5,
        "proxy": sample.proxy.mean().item(),
        "gold": None if sample.gold is None else float(sample.gold.mean()),
        "queries": sample.num_queries,
    }
    scored = {"proxy": (sample.proxy.numpy(), base.proxy.numpy())}
    if sample.gold is not None and base.gold is not None:
        scored["gold"] = (sample.gold, base.gold)
    for key, (mine, theirs) in scored.items():  # null where base-σ is undefined (charts skip nulls)
        point[f"{key}_std_units"], point[f"{key}_stderr"] = paired_improvement(mine, theirs, k)
    return point


def length_stats(sample: SampleSet, pad_token_id: int) -> dict:
    lengths = (sample.responses != pad_token_id).sum(-1).float()
    return {"mean": lengths.mean().item(), "min": lengths.min().item(), "max": lengths.max().item()}


def snapshot_matches(policy_lm: nn.Module, snapshot: str | Path) -> bool:
    """True if ``policy_lm`` already holds the weights of a PPO snapshot (keys ``lm.<name>``)."""
    from safetensors.torch import load_file

    params = dict(policy_lm.named_parameters())
    return all(
        torch.equal(params[name.removeprefix("lm.")], tensor)
        for name, tensor in load_file(str(snapshot), device=str(model_device(policy_lm))).items()
    )


def load_snapshot(policy_lm: nn.Module, snapshot: str | Path) -> None:
    """Overwrite ``policy_lm``'s trained parameters with a PPO snapshot (keys ``lm.<name>``)."""
    from safetensors.torch import load_file

    params = dict(policy_lm.named_parameters())
    with torch.no_grad():
        for name, tensor in load_file(str(snapshot)).items():
            params[name.removeprefix("lm.")].copy_(tensor)


def overoptimization_plot(points: list[dict], path: str | Path, shipped_update: int | None = None) -> None:
    """Gold and proxy against sqrt(KL) (Gao et al. 2022), as a PNG written atomically: checkpoints joined in update
    order, both scores as improvements over the base in base-std units with +-1 standard-error
    bars (paired, same queries), each point labelled with its update, the shipped policy ringed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = sorted(points, key=lambda p: p["update"])
    xs = [p["sqrt_kl"] for p in points]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    series = [("proxy", "o-", "proxy (reward model)"), ("gold", "s-", "gold (labeler)")]
    series = [s for s in series if all(p.get(f"{s[0]}_std_units") is not None for p in points)]
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
                label="shipped policy" if key == series[0][0] else None,
            )
    if not series:
        note = "undefined: the base's scores have no spread (see metrics/evaluation.json)"
        ax.text(0.5, 0.5, note, transform=ax.transAxes, ha="center", va="center", fontsize=8, wrap=True)
    ax.axhline(0.0, color="grey", linewidth=0.8)
    ax.set_xlabel("sqrt(KL(policy || base))  [nats^0.5]")
    ax.set_ylabel("improvement over the base  [base std]")
    ax.set_title("Reward over-optimisation across PPO checkpoints")
    if series:
        ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    write_figure(fig, path, dpi=110)
    plt.close(fig)
