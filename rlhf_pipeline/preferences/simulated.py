"""Simulated labels: N responses per query sampled from the frozen base model as the task samples
them, scored by a programmatic labeller (:mod:`rlhf_pipeline.labelers`), the best picked by
``softmax(score / label_temperature)`` (argmax at temperature 0)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from rlhf_pipeline.candidates import MAX_RESAMPLES, sample_clean_candidates, sample_problem
from rlhf_pipeline.errors import PipelineError
from rlhf_pipeline.progress import Progress


def pick_best(scores: np.ndarray, temperature: float, rng: np.random.Generator) -> np.ndarray:
    """Index of the preferred sample per row of ``scores`` (B, N).

    temperature 0: argmax, with exact ties broken uniformly at random (VADER gives many
    neutral texts the same 0.0; "always the first" would plant a positional label that no
    reward model can learn and skew the label distribution). Otherwise one draw from
    ``softmax(scores / temperature)``, which simulates a noisy labeler.
    """
    scores = np.asarray(scores, dtype=np.float64)
    if temperature == 0:
        best = []
        for row in scores:
            maxima = np.flatnonzero(row == row.max())
            best.append(maxima[0] if len(maxima) == 1 else rng.choice(maxima))
        return np.array(best, dtype=np.int64)
    # torch's softmax, not numpy's exp: numpy picks its exp kernel by the CPU (AVX-512 rounds otherwise)
    # and compute.cpu_numerics pins torch's, so the labels are the same on any host
    probs = torch.softmax(torch.from_numpy(scores / temperature), dim=1).numpy()
    return np.array([rng.choice(scores.shape[1], p=p) for p in probs], dtype=np.int64)


def ceiling_accuracy(gold: np.ndarray, best: np.ndarray) -> float:
    """Fraction of rows whose label is the gold argmax (first index on ties): about the best
    accuracy a reward model can reach on these labels. 1.0 at label_temperature 0 unless gold
    scores tie (a tied row counts as 1/k in expectation, as it would for any reward model)."""
    gold = np.asarray(gold)
    return float((gold.argmax(axis=1) == np.asarray(best)).mean()) if len(gold) else float("nan")


@dataclass
class SimulatedSplit:
    columns: dict[str, list]
    skipped: dict[str, int] = field(default_factory=dict)  # queries given up on, by reason
    resampled: int = 0  # queries whose candidates were drawn again
    queries_used: int = 0
    valid_responses: int = 0
    responses: int = 0


@torch.no_grad()
def simulate_preferences(
    model,
    tokenizer,
    sampler,
    query_ids: list[list[int]],
    queries: list[str],
    num_rows: int,
    num_samples: int,
    labeler,
    label_temperature: float,
    batch_size: int,
    generator: torch.Generator,
    rng: np.random.Generator,
    split_name: str = "train",
    max_resamples: int = MAX_RESAMPLES,
    progress: bool = True,
) -> SimulatedSplit:
    """Label ``num_rows`` rows with best-of-``num_samples`` choices.

    ``sampler`` is a :class:`rlhf_pipeline.sampling.ResponseSampler` (task sampling + truncation).
    Queries are taken in order, ``batch_size`` at a time; when there are more rows to label than
    queries, the list starts over and the same queries are labelled again on fresh samples. When a
    query's candidates would break the data contract (see :func:`sample_problem`: e.g. two
    identical responses), its candidates are drawn again, up to ``max_resamples`` times; a query
    that still fails is skipped and the next one is used. Deterministic for given generators.
    """
    result = SimulatedSplit({k: [] for k in ("query", "query_ids", "samples", "sample_ids", "best", "gold", "margin")})
    cols = result.columns
    start = 0  # position in the endless stream query 0, 1, ..., n-1, 0, 1, ...
    lines = Progress(f"preferences {split_name}" if progress else None, num_rows, "rows labelled")
    while len(cols["best"]) < num_rows:
        if start >= len(query_ids) * (1 + num_rows // max(len(query_ids), 1)) + len(query_ids):
            raise PipelineError(
                f"data.preferences: {split_name} cannot label {num_rows} rows (data.preferences."
                f"{'num_labels' if split_name == 'train' else 'num_test_labels'}): the candidates of "
                f"{sum(result.skipped.values())} "
                f"of the {start} queries sampled from data/queries/{split_name} ({len(query_ids)} queries) break "
                "the data contract "
                f"({result.skipped}). Lower the count, or use a model that writes distinct, clean responses."
            )
        stop = start + min(batch_size, num_rows - len(cols["best"]))
        batch_ids = [query_ids[i % len(query_ids)] for i in range(start, stop)]
        texts, ids, valid, resampled = sample_clean_candidates(
            model, tokenizer, sampler, batch_ids, num_samples, generator, max_resamples
        )
        result.resampled += resampled
        scores = np.asarray(labeler.score([t for samples in texts for t in samples]), dtype=np.float64).reshape(
            len(texts), num_samples
        )
        result.responses += valid.numel()
        result.valid_responses += int(valid.sum())
        for row, samples in enumerate(texts):
            if len(cols["best"]) == num_rows:
                break
            result.queries_used = start + row + 1
            problem = sample_problem(samples)
            if problem is not None:
                result.skipped[problem] = result.skipped.get(problem, 0) + 1
                continue
            cols["query"].append(queries[(start + row) % len(queries)])
            cols["query_ids"].append(batch_ids[row])
            cols["samples"].append(samples)
            cols["sample_ids"].append(ids[row])
            cols["best"].append(int(pick_best(scores[row : row + 1], label_temperature, rng)[0]))
            cols["gold"].append(scores[row].tolist())
            cols["margin"].append(0.0)
        start = stop
        lines.update(len(cols["best"]))
    return result
