"""Stage preferences: best-of-N labels in the internal format -> data/preferences (train/test).

``data.preferences.source``: ``simulated`` (labeler on base-model samples of data/queries), or a
user file (.jsonl/.parquet under data/labels/) / hub dataset in pairwise or best-of-N format. Human
labels (``rlhf label import``) keep their rounds: data/preferences/format.json says which rows came
from which round and model, for ``rlhf lineage``.
See rlhf_pipeline/preferences.py for the formats.
"""

from __future__ import annotations

import _interpreter  # noqa: F401  (first: exit 6 when this Python lacks the project's packages)

import rlhf_pipeline.offline  # noqa: F401  (first: offline and quiet before the Hugging Face libraries load)

import numpy as np
import pandas as pd
import torch
from datasets import Dataset, DatasetDict, load_from_disk

from rlhf_pipeline import paths
from rlhf_pipeline.devices import resolve_compute
from rlhf_pipeline.errors import PipelineError
from rlhf_pipeline.io import LABELS, atomic_dir, is_local_source, require_tracked_location, write_json
from rlhf_pipeline.labelers import get_labeler
from rlhf_pipeline.models import load_causal_lm, load_tokenizer, require_context, require_dir
from rlhf_pipeline.params import StageParams
from rlhf_pipeline.params.compute import ComputeParams
from rlhf_pipeline.params.data import SIMULATED, DataParams
from rlhf_pipeline.params.task import TaskParams
from rlhf_pipeline.preferences.formats import (
    LABEL_KEY,
    chat_format,
    features,
    refuse_bad_texts,
    refuse_overlong_texts,
    user_to_internal,
)
from rlhf_pipeline.preferences.simulated import ceiling_accuracy, simulate_preferences
from rlhf_pipeline.preferences.splits import label_rounds, load_user_frames
from rlhf_pipeline.runner import run_stage
from rlhf_pipeline.sampling import ResponseSampler

BASE, QUERIES, OUT, METRICS = paths.BASE_MODEL, paths.QUERIES, paths.PREFERENCES, paths.PREFERENCES_METRICS


class Params(StageParams):
    compute: ComputeParams = ComputeParams()
    data: DataParams = DataParams()
    task: TaskParams = TaskParams()


def simulated_splits(params: Params, tokenizer) -> tuple[dict[str, dict], dict, dict]:
    cfg = params.data.preferences
    try:
        queries = load_from_disk(QUERIES)
    except FileNotFoundError:
        raise PipelineError(f"{QUERIES} is missing; run `dvc repro queries` first.") from None
    width = len(queries["train"][0]["query_ids"])
    if width != params.data.queries.query_length:
        raise PipelineError(
            f"{QUERIES} holds queries of {width} tokens but data.queries.query_length is "
            f"{params.data.queries.query_length}; rerun `dvc repro queries`."
        )
    plan = resolve_compute(params.compute)
    model = load_causal_lm(BASE, plan.device).eval()
    sampler = ResponseSampler.from_tokenizer(params.task, tokenizer, plan.sampler)
    labeler = get_labeler(cfg.labeler)
    generator = torch.Generator().manual_seed(params.seed)
    rng = np.random.default_rng(params.seed)
    splits, metrics, gold, best = {}, {"format": SIMULATED, "labeler": labeler.name, "device": plan.describe()}, [], []
    valid = total = 0
    for name, count in (("train", cfg.num_labels), ("test", cfg.num_test_labels)):
        part = queries[name]
        with plan.autocast():
            result = simulate_preferences(
                model,
                tokenizer,
                sampler,
                list(part["query_ids"]),
                list(part["query"]),
                count,
                cfg.num_samples,
                labeler,
                cfg.label_temperature,
                cfg.batch_size,
                generator,
                rng,
                split_name=name,
            )
        splits[name] = result.columns
        gold.extend(result.columns["gold"])
        best.extend(result.columns["best"])
        valid, total = valid + result.valid_responses, total + result.responses
        metrics[f"{name}/queries_used"] = result.queries_used
        metrics[f"{name}/ceiling_accuracy"] = ceiling_accuracy(
            np.array(result.columns["gold"]), np.array(result.columns["best"])
        )
        metrics[f"{name}/resampled"] = result.resampled
        for reason, n in sorted(result.skipped.items()):
            metrics[f"{name}/skipped/{reason}"] = n
    metrics["labels/ceiling_accuracy"] = ceiling_accuracy(np.array(gold), np.array(best))
    metrics["labels/mean_gold"] = float(np.mean(gold))
    metrics["labels/tied_fraction"] = float(
        np.mean([g.count(max(g)) > 1 for g in gold])
    )  # rows whose best is a coin flip
    metrics["labels/truncation_valid_fraction"] = valid / total
    return splits, metrics, {}


def user_splits(params: Params, tokenizer) -> tuple[dict[str, dict], dict, dict]:
    """The user's labels, and what they record of where they came from (human labels: by round)."""
    cfg, q = params.data.preferences, params.data.queries
    if is_local_source(cfg.source):
        require_tracked_location(cfg.source, "data.preferences.source", LABELS)
    frames, fmt = load_user_frames(cfg.source, cfg.split, q.test_fraction, params.seed)
    fmt = chat_format(fmt, params.task.chat, cfg.source)
    for name, frame in frames.items():
        refuse_overlong_texts(frame, params.data.validation.max_text_chars, f"{cfg.source} ({name} split)")
        refuse_bad_texts(frame, f"{cfg.source} ({name} split)")
    splits = {
        name: user_to_internal(
            frame, fmt, tokenizer, q.query_length, params.task.response_length, f"{cfg.source} ({name} split)"
        )
        for name, frame in frames.items()
    }
    metrics = {"format": fmt, "labels/ceiling_accuracy": None}
    rounds = label_rounds(pd.concat(frames.values(), ignore_index=True), cfg.source)
    if rounds:
        metrics["labels/rounds"] = len(rounds)
    for name, columns in splits.items():
        for what, n in columns.cuts.items():
            metrics[f"{what}/{name}"] = n
        if any(columns.cuts.values()):
            print(
                f"preferences: {cfg.source} ({name} split): {columns.cuts['truncated_prompts']} prompt(s) keep only "
                f"their last tokens (data.queries.query_length {q.query_length}) and "
                f"{columns.cuts['truncated_responses']} repl(ies) only their first (task.response_length "
                f"{params.task.response_length})"
            )
    return splits, metrics, {"rounds": rounds} if rounds else {}


def main(params: Params) -> None:
    cfg = params.data.preferences
    require_dir(BASE, "base_model")
    require_context(BASE, params.data.queries.query_length, params.task.response_length)
    tokenizer = load_tokenizer(BASE)
    splits, metrics, provenance = (
        simulated_splits(params, tokenizer) if cfg.source == SIMULATED else user_splits(params, tokenizer)
    )
    for name, columns in splits.items():
        metrics[f"rows/{name}"] = len(columns["best"])
        counts = np.bincount(columns["best"], minlength=len(columns["samples"][0]) if columns["samples"] else 0)
        for index, n in enumerate(counts):
            metrics[f"labels/best_share/{name}/{index}"] = float(n / max(1, len(columns["best"])))
    with atomic_dir(OUT) as tmp:
        DatasetDict(
            {
                name: Dataset.from_dict(columns, features=features(human=LABEL_KEY[0] in columns))
                for name, columns in splits.items()
            }
        ).save_to_disk(str(tmp))
        info = {"format": metrics["format"], "source": cfg.source, **provenance}
        if cfg.source != SIMULATED:  # what was cut to fit, for the validation report
            info["truncated"] = {name: columns.cuts for name, columns in splits.items()}
        write_json(tmp / "format.json", info)
    write_json(METRICS, metrics)
    print(
        f"preferences: {metrics['rows/train']} train + {metrics['rows/test']} test rows ({metrics['format']}) -> "
        f"{OUT}; "
        f"ceiling accuracy {metrics['labels/ceiling_accuracy']}"
    )


if __name__ == "__main__":
    run_stage("preferences", main, Params)
