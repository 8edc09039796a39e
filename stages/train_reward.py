"""Stage train_reward: fit the reward model on validated preference labels -> models/reward_unnormalized."""

from __future__ import annotations

import rlhf_pipeline.offline  # noqa: F401  (first: offline and quiet before the Hugging Face libraries load)

from contextlib import nullcontext

import torch
from datasets import load_from_disk

from rlhf_pipeline.distributed import make_accelerator, whole_model
from rlhf_pipeline.errors import PipelineError
from rlhf_pipeline.io import atomic_dir, local_model_dir, read_json, write_json
from rlhf_pipeline.logging import open_live
from rlhf_pipeline.model_folder import admit_model_folder
from rlhf_pipeline.modelcard import write_card
from rlhf_pipeline.models import freeze_lower_layers, load_causal_lm, load_tokenizer, require_dir, save_tokenizer
from rlhf_pipeline.params import StageParams
from rlhf_pipeline.params.data import DataParams
from rlhf_pipeline.params.reward import RewardParams
from rlhf_pipeline.params.task import TaskParams
from rlhf_pipeline.queries import load_queries
from rlhf_pipeline.reward import (
    RewardModel,
    best_of_n_accuracy,
    fit_normalization,
    preference_tensors,
    score_query_responses,
    train_reward_model,
)
from rlhf_pipeline.runner import run_stage
from rlhf_pipeline.sampling import ResponseSampler

BASE, PREFS, QUERIES, VALIDATION = "models/base", "data/preferences", "data/queries", "data/validation/summary.json"
OUT, METRICS = "models/reward_unnormalized", "metrics/reward_train.json"


class Params(StageParams):
    data: DataParams = DataParams()
    task: TaskParams = TaskParams()
    reward: RewardParams = RewardParams()


def build(params: Params, tokenizer, generator: torch.Generator | None = None) -> RewardModel:
    cfg = params.reward.train
    return RewardModel.from_base(BASE, tokenizer.pad_token_id, cfg.dropout, generator, cfg.pooling, cfg.num_layers)


def main(params: Params) -> None:
    cfg = params.reward.train
    require_dir(BASE, "base_model")
    if not read_json(VALIDATION).get("success"):
        raise PipelineError(
            f"{VALIDATION} says the preference data failed its contract; fix the data and rerun `dvc repro`."
        )
    # one process unless `accelerate launch` started several (each then trains on its share of every batch)
    accelerator = make_accelerator(torch.device("cpu"), stage="train_reward")
    is_main = accelerator.is_main_process
    tokenizer = load_tokenizer(BASE)
    prefs = load_from_disk(PREFS)
    generator = torch.Generator().manual_seed(params.seed)
    if params.reward.pretrained:  # adopt an existing reward model: measured on the test labels, not trained
        if local_model_dir(params.reward.pretrained, "reward.pretrained") is not None:  # its files, sizes, tensors
            admit_model_folder(params.reward.pretrained, "reward.pretrained", "AutoModelForSequenceClassification")
        model, trainable = RewardModel.from_sequence_classifier(params.reward.pretrained, tokenizer), 0
    else:
        model = build(params, tokenizer, generator)
        trainable = freeze_lower_layers(model.backbone, cfg.freeze_layers)

    normalize_before = {}
    if cfg.normalize_before and not params.reward.pretrained:
        # OAI target_mean_std: start training from rewards already on the target scale (every process
        # computes the same fit from the same seed)
        base = load_causal_lm(BASE).eval()
        queries = load_queries(QUERIES, "train", tokenizer.pad_token_id, cfg.normalize_before_samples)
        sampler = ResponseSampler.from_tokenizer(params.task, tokenizer)
        responses, _ = sampler.sample_batched(
            base,
            queries,
            generator,
            params.reward.normalize.batch_size,
            params.reward.normalize.truncate,
            progress="train_reward normalize_before",
        )
        del base
        raw = score_query_responses(
            model.eval(), queries, responses, params.reward.normalize.batch_size, normalized=False
        )
        gain, bias = fit_normalization(
            model, raw, params.reward.normalize.target_mean, params.reward.normalize.target_std
        )
        normalize_before = {"gain": gain, "bias": bias, "samples": len(queries)}

    train = preference_tensors(prefs["train"])
    test = preference_tensors(prefs["test"])
    with open_live("dvclive/train_reward") if is_main else nullcontext() as live:

        def log(record: dict) -> None:
            if live is None:
                return
            for key in ("loss", "accuracy", "lr"):
                live.log_metric(f"train/{key}", record[key])
            live.next_step()

        trained = not params.reward.pretrained
        history = train_reward_model(model, train, cfg, generator, log, accelerator) if trained else []
    model = whole_model(accelerator, model, lambda: build(params, tokenizer))
    if not is_main:
        return
    test_accuracy = best_of_n_accuracy(model, *test[:3], params.reward.normalize.batch_size)
    metrics = {
        "test/accuracy": test_accuracy,
        "test/rows": len(test.best),
        "train/steps": len(history),
        "trainable_parameters": trainable,
    }
    if history:
        tail = history[-max(1, len(history) // 4) :]
        metrics["train/final_loss"] = sum(r["loss"] for r in tail) / len(tail)
        metrics["train/final_accuracy"] = sum(r["accuracy"] for r in tail) / len(tail)
    if params.reward.pretrained:
        summary = (
            f"The existing reward model `{params.reward.pretrained}` (reward.pretrained), adopted without "
            f"training and measured on {len(test.best)} held-out best-of-{test.samples.shape[1]} labels. "
        )
    else:
        summary = (
            f"Scalar reward head on `{BASE}`, trained one pass over {len(train.best)} best-of-"
            f"{train.samples.shape[1]} labels with softmax cross-entropy (lm-human-preferences). "
            "Gain/bias here are from `normalize_before`; "
        )
    with atomic_dir(OUT, checksums=True) as tmp:
        model.save(tmp)
        save_tokenizer(tokenizer, tmp)
        write_card(
            tmp,
            target=OUT,
            chat_template=tokenizer.chat_template if params.task.chat else None,
            kind="reward",
            reward_pooling=model.pooling,
            title="Reward model (before normalisation)",
            summary=summary + "The `normalize_reward` stage fits gain and bias into `models/reward`.",
            base_dir=BASE,
            datasets=[params.data.preferences.source],  # in the metadata when it is a hub id
            tags=["reward-model"],
            hyperparameters={
                "reward.pretrained": params.reward.pretrained,
                "reward.train": cfg.model_dump(),
                "task": params.task.model_dump(),
                "seed": params.seed,
                "normalize_before": normalize_before,
            },
            metrics=metrics,
            inputs=[BASE, PREFS],
        )
    write_json(METRICS, metrics)
    print(f"train_reward: test accuracy {test_accuracy:.3f} on {len(test.best)} held-out rows; saved {OUT}")


if __name__ == "__main__":
    run_stage("train_reward", main, Params)
