"""Stage normalize_reward: refit gain/bias on base-model samples -> models/reward.

Samples always come from the frozen base model, never from a trained policy
(lm-human-preference-details issue #8), on the train queries (those PPO optimises over). The fit is
checked on a fresh sample (fresh responses to freshly drawn train queries), whose mean is reported
with its standard error, and, with the default labeler, the Spearman correlation of the reward
with the gold score is measured on that same fresh sample.
"""

from __future__ import annotations

import _interpreter  # noqa: F401  (first: exit 6 when this Python lacks the project's packages)

import rlhf_pipeline.offline  # noqa: F401  (first: offline and quiet before the Hugging Face libraries load)

import math

import torch
from scipy.stats import spearmanr

from rlhf_pipeline import paths
from rlhf_pipeline.devices import resolve_compute
from rlhf_pipeline.io import atomic_dir, write_json
from rlhf_pipeline.labelers import gold_labeler
from rlhf_pipeline.modelcard import held_out_result, preference_data_line
from rlhf_pipeline.models import load_causal_lm, load_tokenizer, require_dir
from rlhf_pipeline.params import StageParams
from rlhf_pipeline.params.compute import ComputeParams
from rlhf_pipeline.params.data import DataParams
from rlhf_pipeline.params.reward import RewardParams
from rlhf_pipeline.params.task import TaskParams
from rlhf_pipeline.queries import draw_queries, load_queries
from rlhf_pipeline.reward.folder import write_reward_folder
from rlhf_pipeline.reward.normalization import normalize_on_base_samples, score_query_responses
from rlhf_pipeline.reward.persistence import HEAD_FILE, load_reward_model
from rlhf_pipeline.runner import run_stage
from rlhf_pipeline.sampling import ResponseSampler

BASE, TRAINED, QUERIES = paths.BASE_MODEL, paths.REWARD_UNNORMALIZED, paths.QUERIES
OUT, METRICS = paths.REWARD, paths.REWARD_METRICS


class Params(StageParams):
    compute: ComputeParams = ComputeParams()
    data: DataParams = DataParams()
    task: TaskParams = TaskParams()
    reward: RewardParams = RewardParams()


def gold_correlation(labeler, texts: list[str], scores: torch.Tensor) -> dict:
    """Spearman's correlation of the reward model's ``scores`` with the gold labeller's on ``texts``."""
    gold = labeler.score(texts)
    correlation = float(spearmanr(scores.cpu().numpy(), gold).statistic)
    if math.isfinite(correlation):
        return {"gold_correlation": correlation}
    # undefined (NaN) when either side is constant, e.g. when the gold labeller scores every sample
    # alike; JSON has no NaN, so the metric is null with the reason beside it
    return {
        "gold_correlation": None,
        "gold_correlation_undefined": f"on the {len(gold)} samples the gold labeller gave {len(set(gold))} distinct "
        f"score(s) and the reward model {len(set(scores.tolist()))}: a rank correlation needs both to vary",
    }


def correlation_result(metrics: dict) -> list:
    """The card's model-index: the Spearman correlation with the gold labeller on fresh base-model
    samples, where there is a gold labeller and the correlation is defined."""
    if metrics.get("gold_correlation") is None:
        return []
    samples = f"{metrics['normalized/samples']} fresh base-model samples of train queries, gold-labelled"
    return [
        held_out_result(
            "Spearman correlation with the gold labeller", metrics["gold_correlation"], samples, "spearmanr"
        )
    ]


def main(params: Params) -> None:
    cfg = params.reward.normalize
    require_dir(BASE, "base_model")
    require_dir(TRAINED, "train_reward", HEAD_FILE)
    plan = resolve_compute(params.compute)
    tokenizer = load_tokenizer(BASE)
    model = load_reward_model(TRAINED, plan.device)
    base = load_causal_lm(BASE, plan.device).eval()
    sampler = ResponseSampler.from_tokenizer(params.task, tokenizer, plan.sampler)
    # Queries come from the train split, the set PPO optimises over; drawing each of them once
    # (normalize_samples = its size) removes query-sampling error from the fit. The check redraws
    # the queries and samples fresh responses, with a different seed stream from train_reward.
    train_queries = load_queries(QUERIES, "train", tokenizer.pad_token_id)
    generator = torch.Generator().manual_seed(params.seed + 1)
    fit_queries = draw_queries(train_queries, cfg.normalize_samples, generator)
    eval_queries = draw_queries(train_queries, cfg.eval_samples, generator)

    with plan.autocast():
        gain, bias, raw = normalize_on_base_samples(
            model, base, sampler, fit_queries, generator, cfg, "normalize_reward fit"
        )
        eval_responses, _ = sampler.sample_batched(
            base, eval_queries, generator, cfg.batch_size, cfg.truncate, progress="normalize_reward check"
        )
        fresh = score_query_responses(model, eval_queries, eval_responses, cfg.batch_size).float().cpu()
    raw = raw.float().cpu()
    metrics = {
        "device": plan.describe(),
        "gain": gain,
        "bias": bias,
        "fit/raw_mean": raw.mean().item(),
        "fit/raw_std": raw.std(unbiased=False).item(),
        "normalized/mean": fresh.mean().item(),
        "normalized/std": fresh.std(unbiased=False).item(),
        # sampling error of the fresh mean: |mean| below ~2 of these is what a correct fit gives
        "normalized/mean_stderr": fresh.std().item() / len(fresh) ** 0.5,
        "normalized/samples": len(fresh),
    }
    labeler = gold_labeler(params.data.preferences.source, params.data.preferences.labeler)
    if labeler is not None:
        metrics.update(
            gold_correlation(labeler, tokenizer.batch_decode(eval_responses.tolist(), skip_special_tokens=True), fresh)
        )

    with atomic_dir(OUT, checksums=True) as tmp:
        write_reward_folder(
            tmp,
            model,
            tokenizer,
            chat=params.task.chat,
            target=OUT,
            title="Reward model",
            summary=f"The trained reward model of `{TRAINED}` with gain {gain:.4f} and bias {bias:.4f} fitted so that "
            f"rewards of {len(fit_queries)} base-model samples have mean {cfg.target_mean} and std {cfg.target_std} "
            "(reward = gain * head + bias). This is the reward PPO optimises.",
            base_dir=BASE,
            datasets=[params.data.preferences.source],  # in the metadata when it is a hub id
            data=[
                preference_data_line(params.data.preferences.source, params.data.preferences.labeler),
                f"Trained by train_reward (the card of `{TRAINED}`); gain and bias fitted here on "
                f"{len(fit_queries)} base-model answers to train queries.",
            ],
            eval_results=correlation_result(metrics),
            tags=["reward-model", "normalized"],
            hyperparameters={
                "reward.normalize": cfg.model_dump(),
                "task": params.task.model_dump(),
                "seed": params.seed,
            },
            metrics=metrics,
            inputs=[TRAINED, BASE, QUERIES],
            device=plan.describe(),
        )
    write_json(METRICS, metrics)
    print(
        f"normalize_reward: gain {gain:.4f} bias {bias:.4f}; fresh sample mean {metrics['normalized/mean']:.3f} std "
        f"{metrics['normalized/std']:.3f}"
    )


if __name__ == "__main__":
    run_stage("normalize_reward", main, Params)
