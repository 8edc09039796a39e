"""Candidate responses for people or a labeller to choose from: N responses per query drawn with
the task's sampling, a query whose candidates would break the data contract (:func:`sample_problem`)
drawn again. The preferences stage, `rlhf label export` and a side-by-side round all draw this way.
"""

from __future__ import annotations

import torch

from rlhf_pipeline.text_rules import BAD_CHARACTER_CHECK, EMPTY_TEXT_CHECK, text_problem

MAX_RESAMPLES = 3  # draws again of a query whose candidates would break the data contract, before it is skipped


def sample_problem(samples: list[str]) -> str | None:
    """Why a row of candidates would fail the data contract, or None.

    Simulated rows with such a problem are skipped (and counted) rather than written, so the
    default pipeline never refuses its own labels.
    """
    problems = [text_problem(s) for s in samples]
    if EMPTY_TEXT_CHECK in problems:
        return "empty_sample"
    if len(set(samples)) < len(samples):
        return "duplicate_samples"
    if BAD_CHARACTER_CHECK in problems:
        return "bad_characters"
    return None


def sample_candidates(
    model, tokenizer, sampler, query_ids: list[list[int]], num_samples: int, generator: torch.Generator
):
    """``num_samples`` truncated responses per query: (texts per query, ids per query, valid (B*N,))."""
    batch = torch.tensor(query_ids, dtype=torch.long)  # left-padded, as data/queries stores them
    _, truncated, valid = sampler.sample(model, batch, generator, num_samples=num_samples)
    texts = tokenizer.batch_decode(truncated.tolist(), skip_special_tokens=True)
    ids = truncated.view(len(batch), num_samples, -1).tolist()
    return [texts[i * num_samples : (i + 1) * num_samples] for i in range(len(batch))], ids, valid


def sample_clean_candidates(
    model, tokenizer, sampler, query_ids: list[list[int]], num_samples: int, generator, max_resamples: int
):
    """:func:`sample_candidates`, with the queries whose candidates would break the data contract
    (:func:`sample_problem`) drawn again, up to ``max_resamples`` times: (texts, ids, valid, how
    many queries were drawn again). A query still failing keeps its last draw: the caller skips it."""
    texts, ids, valid = sample_candidates(model, tokenizer, sampler, query_ids, num_samples, generator)
    resampled = 0
    for _ in range(max_resamples):
        redo = [i for i, samples in enumerate(texts) if sample_problem(samples) is not None]
        if not redo:
            break
        resampled += len(redo)
        new_texts, new_ids, new_valid = sample_candidates(
            model, tokenizer, sampler, [query_ids[i] for i in redo], num_samples, generator
        )
        valid = valid.view(-1, num_samples).clone()
        for j, i in enumerate(redo):
            texts[i], ids[i], valid[i] = new_texts[j], new_ids[j], new_valid.view(-1, num_samples)[j]
    return texts, ids, valid, resampled
