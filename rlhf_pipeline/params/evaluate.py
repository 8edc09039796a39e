"""``evaluate``: base against policy on the held-out queries."""

from __future__ import annotations

from pydantic import Field

from rlhf_pipeline.params import MAX_BATCH, MAX_ROWS, MAX_SMALL, Strict


class EvaluateParams(Strict):
    num_queries: int = Field(
        256, gt=0, le=MAX_ROWS, description="Held-out test queries to sample (capped by the split)."
    )
    batch_size: int = Field(
        32, gt=0, le=MAX_BATCH, description="Responses sampled at once (batch_size // responses_per_query queries)."
    )
    responses_per_query: int = Field(
        1,
        gt=0,
        le=MAX_SMALL,
        description="Responses each model (base, policy, every curve checkpoint) draws for every held-out query, "
        "the query's prefill run once. Scores and KLs are averaged over a query's responses before a standard "
        "error is taken: more responses shrink the gold gain's paired SE almost as more queries would, since "
        "most of its variance lies between the responses to one query (bench/results/eval_variance_probe.md).",
    )
    curve_queries: int | None = Field(
        None,
        gt=0,
        le=MAX_ROWS,
        description="Held-out queries each PPO checkpoint on the over-optimisation curve is sampled on: the "
        "first N, rounded up to whole batches (each checkpoint then draws the base's random stream row for row, "
        "and is paired with the base on the same queries); null: all of them. The base and the shipped policy are "
        "measured on every query either way.",
    )
    num_table_rows: int = Field(32, gt=0, le=MAX_SMALL, description="Rows in the sample table.")
