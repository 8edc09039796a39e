"""Sampling a side-by-side round (:mod:`rlhf_pipeline.side_by_side`): both models answer the same
held-out queries with the same seed, and each task's Response A is drawn at random.

It is kept apart from the round files, verdicts and tally (:mod:`rlhf_pipeline.side_by_side`), so that
the commands that only read or count a round (`rlhf models`, `rlhf label verdicts`) start without torch
and transformers.
"""

from __future__ import annotations

import secrets
from datetime import UTC, datetime
from pathlib import Path

import torch

from rlhf_pipeline.candidates import MAX_RESAMPLES, sample_clean_candidates, sample_problem
from rlhf_pipeline.errors import PipelineError
from rlhf_pipeline.label_studio.interface import weights_sha256
from rlhf_pipeline.label_studio.tasks import query_vocabulary_problem
from rlhf_pipeline.models import load_causal_lm, load_tokenizer
from rlhf_pipeline.params.task import TaskParams
from rlhf_pipeline.sampling import ResponseSampler
from rlhf_pipeline.saved_datasets import read_split
from rlhf_pipeline.side_by_side import CHALLENGER, INCUMBENT, Round, task_id


@torch.no_grad()
def _responses(
    model_dir: str, queries_dir: str | Path, queries: list[list[int]], task: TaskParams, seed: int, batch_size: int
):
    """One response per query from ``model_dir`` (None where it still breaks the contract after
    :data:`MAX_RESAMPLES` draws), with the same seed as the other side."""
    tokenizer = load_tokenizer(model_dir)
    model = load_causal_lm(model_dir).eval()
    vocabulary = model.get_input_embeddings().num_embeddings
    if (problem := query_vocabulary_problem(queries_dir, queries, vocabulary, model_dir)) is not None:
        raise PipelineError(problem)
    sampler = ResponseSampler.from_tokenizer(task, tokenizer)
    generator = torch.Generator().manual_seed(seed)
    out: list[str | None] = []
    for start in range(0, len(queries), batch_size):
        batch = queries[start : start + batch_size]
        texts = sample_clean_candidates(model, tokenizer, sampler, batch, 1, generator, MAX_RESAMPLES)[0]
        out += [samples[0] if sample_problem(samples) is None else None for samples in texts]
    return out


def sample_round(
    challenger: tuple[str, str],
    incumbent: tuple[str, str],
    queries_dir: str | Path,
    task: TaskParams,
    num_queries: int,
    seed: int,
    split: str = "test",
    batch_size: int = 16,
) -> tuple[list[dict], Round]:
    """(Label Studio tasks, the round) for ``challenger`` and ``incumbent``, each ``(model folder,
    name)``, on the first ``num_queries`` queries of ``split``. A query either side cannot answer within
    the contract's text rule is left out. Which response is A is drawn per task with :mod:`secrets`
    (no seed an annotator could replay) and kept in the round only."""
    part = read_split(queries_dir, split, "dvc repro queries", columns=("query", "query_ids"))
    if not 1 <= num_queries <= len(part):
        raise PipelineError(
            f"{queries_dir} ({split}) has {len(part)} queries; {num_queries} were asked for (from 1 to {len(part)})."
        )
    c_name, i_name = challenger[1], incumbent[1]
    if c_name == i_name:
        raise PipelineError(f"rlhf label compare: both sides are {c_name}; compare two different models.")
    ids = [part[i]["query_ids"] for i in range(num_queries)]
    shas, answers = {}, {}
    for folder, name in (challenger, incumbent):
        shas[name] = weights_sha256(folder)
        answers[name] = _responses(folder, queries_dir, ids, task, seed, batch_size)
    created = datetime.now(UTC).isoformat(timespec="seconds")
    versions = sorted([c_name, i_name])
    record = Round(c_name, shas[c_name], i_name, shas[i_name], seed, split, created, {}, {})
    tasks = []
    for index, (mine, theirs) in enumerate(zip(answers[c_name], answers[i_name])):
        if mine is None or theirs is None:
            continue
        tid = task_id(record.name, [shas[c_name], shas[i_name]], split, index, seed)
        a_is = CHALLENGER if secrets.randbelow(2) else INCUMBENT
        a, b = (mine, theirs) if a_is == CHALLENGER else (theirs, mine)
        record.order[tid], record.queries[tid] = a_is, index
        data = {
            "task_id": tid,
            "comparison": record.name,
            "query": part[index]["query"],
            "response_a": a,
            "response_b": b,
            "versions": versions,
            "sha256": [shas[v] for v in versions],
            "split": split,
            "query_index": index,
            "seed": seed,
        }
        tasks.append({"data": data})
    if not tasks:
        raise PipelineError(f"no held-out query of {queries_dir} gave both models a response within the contract.")
    return tasks, record
