"""The benchmarks' FLOP count of fused attention with grouped key/value heads (bench/common.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.utils.flop_counter import flop_registry

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # the benchmarks are scripts, not a package

from common import grouped_query_attention_formulas  # noqa: E402


def test_grouped_key_value_heads_count_as_the_query_heads_they_serve():
    """SmolLM2 reaches CUDA's fused attention with 9 query heads and 3 key/value heads: the count is that
    of 3 heads repeated to 9 (what the kernel computes), forward and backward, for each fused op."""
    formulas = grouped_query_attention_formulas()
    assert sorted(op.__name__ for op in formulas) == sorted(
        f"_scaled_dot_product_{kind}_attention{part}"
        for kind in ("efficient", "flash", "cudnn")
        for part in ("", "_backward")
    )
    query = torch.empty(2, 9, 5, 64, device="meta")
    grouped, repeated = torch.empty(2, 3, 5, 64, device="meta"), torch.empty(2, 9, 5, 64, device="meta")
    for op, count in formulas.items():
        if op.__name__.endswith("_backward"):  # (grad_out, query, key, value, ...)
            args, expected = (query, query, grouped, grouped), (query, query, repeated, repeated)
            out = (query, repeated, repeated)
        else:  # (query, key, value, ...)
            args, expected, out = (query, grouped, grouped), (query, repeated, repeated), (query,)
        assert count(*args, out_val=out) == flop_registry[op](*expected, out_val=out) > 0
