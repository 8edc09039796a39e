"""Label Studio tasks sampled from a model, for people to label (`rlhf label export`): N responses per
query, drawn as the preferences stage draws them. A module of its own because it loads torch and
transformers, which the interface, the client and reading exports back (the package's other modules) do
not need."""

from __future__ import annotations

from pathlib import Path

import torch

from rlhf_pipeline.candidates import MAX_RESAMPLES, sample_clean_candidates, sample_problem
from rlhf_pipeline.errors import PipelineError
from rlhf_pipeline.label_studio.interface import task_id, weights_sha256
from rlhf_pipeline.models import load_causal_lm, load_tokenizer
from rlhf_pipeline.params.task import TaskParams
from rlhf_pipeline.sampling import ResponseSampler
from rlhf_pipeline.saved_datasets import read_split


@torch.no_grad()
def export_tasks(
    model_dir: str | Path,
    queries_dir: str | Path,
    task: TaskParams,
    split: str,
    num_queries: int,
    n: int,
    seed: int,
    round_: int,
    model_name: str | None = None,
    batch_size: int = 16,
) -> list[dict]:
    """Label Studio tasks for the first ``num_queries`` queries of ``split``: ``n`` responses each,
    sampled from ``model_dir`` with the task's sampling (as the preferences stage samples them).
    A query whose responses would break the data contract (e.g. two identical) is drawn again, up to
    :data:`MAX_RESAMPLES` times as the stage does, then left out."""
    part = read_split(queries_dir, split, "dvc repro queries", columns=("query", "query_ids"))
    if num_queries > len(part):
        raise PipelineError(f"{queries_dir} ({split}) has {len(part)} queries; {num_queries} were asked for.")
    tokenizer = load_tokenizer(str(model_dir))
    model = load_causal_lm(str(model_dir)).eval()
    ids = part.select(range(num_queries))["query_ids"]
    vocabulary = model.get_input_embeddings().num_embeddings
    if (problem := query_vocabulary_problem(queries_dir, ids, vocabulary, model_dir)) is not None:
        raise PipelineError(problem)
    sampler = ResponseSampler.from_tokenizer(task, tokenizer)
    generator = torch.Generator().manual_seed(seed)
    model_sha = weights_sha256(model_dir)
    name = model_name or str(model_dir)
    tasks = []
    for start in range(0, num_queries, batch_size):
        indices = list(range(start, min(start + batch_size, num_queries)))
        ids = [part[i]["query_ids"] for i in indices]
        texts = sample_clean_candidates(model, tokenizer, sampler, ids, n, generator, MAX_RESAMPLES)[0]
        for i, samples in zip(indices, texts):
            if sample_problem(samples) is not None:
                continue
            data = {
                "task_id": task_id(model_sha, split, i, seed, n, round_),
                "query": part[i]["query"],
                **{f"sample{k}": text for k, text in enumerate(samples)},
                "split": split,
                "query_index": i,
                "seed": seed,
                "model": name,
                "model_sha256": model_sha,
                "round": round_,
            }
            tasks.append({"data": data})
    return tasks


def query_vocabulary_problem(
    queries_dir: str | Path, ids: list[list[int]], vocabulary: int, model_dir: str | Path
) -> str | None:
    """Why ``model_dir`` (``vocabulary`` embeddings) cannot sample from these queries: another tokenizer
    made them (another base model's project); None when it can."""
    highest = max(max(row) for row in ids)
    if highest < vocabulary:
        return None
    return (
        f"{queries_dir} was tokenized for another model: its token ids reach {highest}, and {model_dir}'s "
        f"vocabulary has {vocabulary}. Sample from the base model whose tokenizer made the queries (or a "
        "policy trained from it), or rerun `dvc repro queries` for this one; nothing was written."
    )
