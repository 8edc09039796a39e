"""Stage train_reward: fit the reward model on validated preference labels -> models/reward_unnormalized."""

from __future__ import annotations

import _interpreter  # noqa: F401  (first: exit 6 when this Python lacks the project's packages)

import rlhf_pipeline.offline  # noqa: F401  (first: offline and quiet before the Hugging Face libraries load)

from contextlib import nullcontext
from pathlib import Path

import torch
from datasets import load_from_disk

from rlhf_pipeline import paths
from rlhf_pipeline.devices import DevicePlan, resolve_compute
from rlhf_pipeline.distributed import lost_processes_reported, make_accelerator, whole_model
from rlhf_pipeline.errors import PipelineError
from rlhf_pipeline.io import atomic_dir, local_model_dir, read_json, write_json
from rlhf_pipeline.logging import open_live, step_logger
from rlhf_pipeline.model_folder import admit_model_folder
from rlhf_pipeline.modelcard import held_out_result, preference_data_line
from rlhf_pipeline.models import freeze_lower_layers, load_causal_lm, load_tokenizer, require_dir
from rlhf_pipeline.params import StageParams
from rlhf_pipeline.params.compute import ComputeParams
from rlhf_pipeline.params.data import DataParams
from rlhf_pipeline.params.reward import RewardParams
from rlhf_pipeline.params.task import TaskParams
from rlhf_pipeline.queries import load_queries
from rlhf_pipeline.reward.adoption import adopt_sequence_classifier, reward_model_on_base
from rlhf_pipeline.reward.folder import write_reward_folder
from rlhf_pipeline.reward.model import RewardModel
from rlhf_pipeline.reward.normalization import normalize_on_base_samples
from rlhf_pipeline.reward.training import (
    Labels,
    best_of_n_accuracy,
    preference_tensors,
    train_reward_model,
    training_metrics,
)
from rlhf_pipeline.runner import run_stage
from rlhf_pipeline.sampling import ResponseSampler

BASE, PREFS, QUERIES, VALIDATION = paths.BASE_MODEL, paths.PREFERENCES, paths.QUERIES, paths.VALIDATION_SUMMARY
OUT, METRICS = paths.REWARD_UNNORMALIZED, paths.REWARD_TRAIN_METRICS
RESTART = "Reward training keeps no checkpoint (one pass over the labels): launch every process again to start over."


class Params(StageParams):
    compute: ComputeParams = ComputeParams()
    data: DataParams = DataParams()
    task: TaskParams = TaskParams()
    reward: RewardParams = RewardParams()


def build(params: Params, tokenizer, generator: torch.Generator | None = None) -> RewardModel:
    cfg = params.reward.train
    return reward_model_on_base(BASE, tokenizer.pad_token_id, cfg.dropout, generator, cfg.pooling, cfg.num_layers)


def card_text(params: Params, train: Labels, test: Labels, test_accuracy: float) -> dict:
    """The card's summary, Training data and model-index (the held-out accuracy)."""
    n = test.samples.shape[1]
    accuracy = held_out_result(
        f"best-of-{n} accuracy (chance {1 / n:.2f})",
        test_accuracy,
        f"held-out preference labels ({len(test.best)} rows of {PREFS})",
        "accuracy",
    )
    data = [
        preference_data_line(params.data.preferences.source, params.data.preferences.labeler),
        f"{len(train.best)} best-of-{train.samples.shape[1]} rows of `{PREFS}` for training, {len(test.best)} held "
        "out; both splits passed the data contract (`data/validation`).",
    ]
    return {"summary": card_summary(params, train, test), "data": data, "eval_results": [accuracy]}


def card_summary(params: Params, train: Labels, test: Labels) -> str:
    """The card's first paragraph: where the model comes from and what it was trained or measured on."""
    if params.reward.pretrained:
        how = (
            f"The existing reward model `{params.reward.pretrained}` (reward.pretrained), adopted without "
            f"training and measured on {len(test.best)} held-out best-of-{test.samples.shape[1]} labels. "
        )
    else:
        how = (
            f"Scalar reward head on `{BASE}`, trained one pass over {len(train.best)} best-of-"
            f"{train.samples.shape[1]} labels with softmax cross-entropy (lm-human-preferences). "
            "Gain/bias here are from `normalize_before`; "
        )
    return how + "The `normalize_reward` stage fits gain and bias into `models/reward`."


def fit_normalize_before(
    params: Params, plan: DevicePlan, model: RewardModel, tokenizer, generator: torch.Generator
) -> dict:
    """OAI target_mean_std: start training from rewards already on the target scale, fitted on the
    base model's responses (every process computes the same fit from the same seed)."""
    samples = params.reward.train.normalize_before_samples
    queries = load_queries(QUERIES, "train", tokenizer.pad_token_id, samples)
    sampler = ResponseSampler.from_tokenizer(params.task, tokenizer, plan.sampler)
    with plan.autocast():
        gain, bias, _ = normalize_on_base_samples(
            model,
            load_causal_lm(BASE, plan.device).eval(),
            sampler,
            queries,
            generator,
            params.reward.normalize,
            "train_reward normalize_before",
        )
    return {"gain": gain, "bias": bias, "samples": len(queries)}


def main(params: Params) -> None:
    cfg = params.reward.train
    require_dir(BASE, "base_model")
    if not Path(VALIDATION).is_file():
        raise PipelineError(
            f"{VALIDATION} is missing: validate_preferences writes it (the data contract's verdict on "
            f"{PREFS}); run `dvc repro validate_preferences` first."
        )
    if not read_json(VALIDATION).get("success"):
        raise PipelineError(
            f"{VALIDATION} says the preference data failed its contract; fix the data and rerun `dvc repro`."
        )
    plan = resolve_compute(params.compute)
    # one process unless `accelerate launch` started several (each then trains on its share of every batch)
    accelerator = make_accelerator(
        plan.device,
        stage="train_reward",
        collective_timeout_s=cfg.collective_timeout_s,
        timeout_key="reward.train.collective_timeout_s",
    )
    is_main = accelerator.is_main_process
    tokenizer = load_tokenizer(BASE)
    prefs = load_from_disk(PREFS)
    generator = torch.Generator().manual_seed(params.seed)
    if params.reward.pretrained:  # adopt an existing reward model: measured on the test labels, not trained
        if local_model_dir(params.reward.pretrained, "reward.pretrained") is not None:  # its files, sizes, tensors
            admit_model_folder(params.reward.pretrained, "reward.pretrained", "AutoModelForSequenceClassification")
        model, trainable = adopt_sequence_classifier(params.reward.pretrained, tokenizer), 0
    else:
        model = build(params, tokenizer, generator)
        trainable = freeze_lower_layers(model.backbone, cfg.freeze_layers)
    model.to(plan.device)  # built on the CPU from the CPU generator: the same initial head on every device

    normalize_before = {}
    if cfg.normalize_before and not params.reward.pretrained:
        normalize_before = fit_normalize_before(params, plan, model, tokenizer, generator)

    train = preference_tensors(prefs["train"], plan.device)
    test = preference_tensors(prefs["test"], plan.device)
    # a process that dies or hangs stops the others with a clear error
    with lost_processes_reported(accelerator, "train_reward", RESTART):
        with open_live("dvclive/train_reward") if is_main else nullcontext() as live:
            log = step_logger(live, ("loss", "accuracy", "lr"), prefix="train/")
            trained = not params.reward.pretrained
            history = (
                train_reward_model(model, train, cfg, generator, log, accelerator, plan.autocast) if trained else []
            )
        model = whole_model(accelerator, model, lambda: build(params, tokenizer))
    if not is_main:
        return
    with plan.autocast():
        test_accuracy = best_of_n_accuracy(model.to(plan.device), *test[:3], params.reward.normalize.batch_size)
    metrics = {"device": plan.describe(), **training_metrics(history, test_accuracy, len(test.best), trainable)}
    with atomic_dir(OUT, checksums=True) as tmp:
        write_reward_folder(
            tmp,
            model,
            tokenizer,
            chat=params.task.chat,
            target=OUT,
            title="Reward model (before normalisation)",
            **card_text(params, train, test, test_accuracy),
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
            device=plan.describe(),
        )
    write_json(METRICS, metrics)
    print(f"train_reward: test accuracy {test_accuracy:.3f} on {len(test.best)} held-out rows; saved {OUT}")


if __name__ == "__main__":
    run_stage("train_reward", main, Params)
