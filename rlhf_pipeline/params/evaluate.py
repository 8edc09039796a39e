"""``evaluate``: base against policy on the held-out queries."""

from __future__ import annotations

from pydantic import Field

from rlhf_pipeline.params import Strict


class EvaluateParams(Strict):
    num_queries: int = Field(256, gt=0, description="Held-out test queries to sample (capped by the split).")
    batch_size: int = Field(32, gt=0)
    num_table_rows: int = Field(32, gt=0, description="Rows in the sample table.")
