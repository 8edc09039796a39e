"""Stage corpus: the passages queries are cut from -> data/corpus (datasets, column ``text``).

``data.corpus.source``: ``generated`` (sampled from models/base on built-in topic prompts), a
local .txt/.jsonl/.parquet file, or a hub dataset id; see rlhf_pipeline/corpus.py.
"""

from __future__ import annotations

import _interpreter  # noqa: F401  (first: exit 6 when this Python lacks the project's packages)

import rlhf_pipeline.offline  # noqa: F401  (first: offline and quiet before the Hugging Face libraries load)

from datasets import Dataset

from rlhf_pipeline import paths
from rlhf_pipeline.corpus import clean_passages, generate_passages, load_hub_passages, load_local_passages
from rlhf_pipeline.devices import resolve_compute
from rlhf_pipeline.io import RAW_DATA, atomic_dir, is_local_source, require_tracked_location
from rlhf_pipeline.models import load_causal_lm, load_tokenizer, require_dir
from rlhf_pipeline.params import StageParams
from rlhf_pipeline.params.compute import ComputeParams
from rlhf_pipeline.params.data import GENERATED, DataParams
from rlhf_pipeline.params.task import TaskParams
from rlhf_pipeline.runner import run_stage

BASE, OUT = paths.BASE_MODEL, paths.CORPUS


class Params(StageParams):
    compute: ComputeParams = ComputeParams()
    data: DataParams = DataParams()
    task: TaskParams = TaskParams()


def main(params: Params) -> None:
    cfg = params.data.corpus
    plan = resolve_compute(params.compute)
    if params.task.chat:  # chat queries come from prompts (stage queries), not from passages
        texts = []
    elif cfg.source == GENERATED:
        require_dir(BASE, "base_model")
        tokenizer = load_tokenizer(BASE)
        model = load_causal_lm(BASE, plan.device).eval()
        with plan.autocast():
            texts = generate_passages(
                model,
                tokenizer,
                cfg.num_passages,
                cfg.passage_tokens,
                cfg.temperature,
                cfg.batch_size,
                params.seed,
                cfg.samples_per_prompt,
                progress="corpus",
                cuda_sampler=plan.sampler,
            )
        print(f"corpus: sampled on {plan.describe()}")
    elif is_local_source(cfg.source):
        require_tracked_location(cfg.source, "data.corpus.source", RAW_DATA)
        texts = load_local_passages(cfg.source, cfg.text_column)
    else:
        texts = load_hub_passages(cfg.source, cfg.split, cfg.text_column)
    passages = clean_passages(texts, cfg.source) if texts else []
    with atomic_dir(OUT) as tmp:
        Dataset.from_dict({"text": passages}).save_to_disk(str(tmp))
    if params.task.chat:
        print(f"corpus: task.chat is on, so no corpus is needed (the queries are chat prompts); empty {OUT}")
    else:
        print(
            f"corpus: {len(passages)} passages from {cfg.source} -> {OUT} ({len(texts) - len(passages)} empty dropped)"
        )


if __name__ == "__main__":
    run_stage("corpus", main, Params)
