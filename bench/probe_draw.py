"""The draw of one decoding step on a CPU: the shipped draw against the one it replaced, same logits, same run.

Each decoding step draws a token per row from (rows, V) logits (:func:`rlhf_pipeline.decoding.sample_from_logits`).
The draw before 2026-12-03 padded a copy of the (rows, V) weights to whole blocks and summed the blocks in float64
in one call, which casts the whole batch to float64 first (100 MB a step at 256 rows of SmolLM2's 49,153 tokens).
The shipped draw writes the weights straight into the block layout and sums a few rows at a time
(:func:`rlhf_pipeline.decoding.block_sums_float64`). This probe times both, interleaved, and checks that they
draw the same tokens with the same logprobs, bit for bit.

Workloads: 256 rows (preferences' 64 queries x 4 samples, the default's widest step) and 96 rows (the
evaluation's batch) of SmolLM2's vocabulary, and 96 rows of Gemma 3's 262,144 tokens.

Usage: ``.venv/bin/python bench/probe_draw.py [--repeats 20] [--markdown] [--output FILE]``, alone on the machine,
under the stages' numerics (``portable``: AVX2 kernels, 2 threads). Findings: ``bench/results/zen3_2026-12-03/``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import emit_table, environment_lines  # noqa: E402

from rlhf_pipeline import numerics  # noqa: E402
from rlhf_pipeline.decoding import sample_from_logits  # noqa: E402

WORKLOADS = [
    (256, 49_153, "SmolLM2, preferences' 64 x 4"),
    (96, 49_153, "SmolLM2, the evaluation's batch"),
    (96, 262_144, "Gemma 3, the evaluation's batch"),
]


def one_reduction_draw(logits: torch.Tensor, uniforms: torch.Tensor, block_size: int = 256):
    """The draw as it was before 2026-12-03: a padded (B, V) copy, its float64 block sums in one call."""
    batch, vocab = logits.shape
    peak = logits.amax(-1, keepdim=True)
    weights = (logits - peak).exp_()
    num_blocks = -(-vocab // block_size)
    blocks = torch.nn.functional.pad(weights, (0, num_blocks * block_size - vocab)).view(batch, num_blocks, block_size)
    block_sums = blocks.sum(-1, dtype=torch.float64)
    block_cdf = block_sums.cumsum(-1)
    total = block_cdf[:, -1:]
    target = torch.minimum(uniforms * total, torch.nextafter(total, torch.zeros_like(total)))
    block = torch.searchsorted(block_cdf, target, right=True)
    rest = target - (block_cdf.gather(-1, block) - block_sums.gather(-1, block))
    inner_cdf = blocks[torch.arange(batch), block.squeeze(-1)].cumsum(-1, dtype=torch.float64)
    rest = torch.minimum(rest.clamp(min=0.0), torch.nextafter(inner_cdf[:, -1:], torch.zeros_like(inner_cdf[:, -1:])))
    token = (block * block_size + torch.searchsorted(inner_cdf, rest, right=True)).squeeze(-1)
    drawn = logits.gather(-1, token[:, None]).squeeze(-1)
    return token, drawn - peak.squeeze(-1) - total.squeeze(-1).log().to(logits.dtype)


def milliseconds(draw) -> float:
    started = time.perf_counter()
    draw()
    return 1000 * (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--output")
    args = parser.parse_args()
    numerics.pin(numerics.PORTABLE, 2)
    rows = []
    for batch, vocab, label in WORKLOADS:
        logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(vocab)) * 3
        uniforms = torch.rand((batch, 1), generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        before, after = one_reduction_draw(logits, uniforms), sample_from_logits(logits, uniforms=uniforms)
        same = torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])
        times = {"before": [], "after": []}
        for _ in range(args.repeats):  # interleaved, so a drift in the machine's rate falls on both
            times["before"].append(milliseconds(lambda x=logits, u=uniforms: one_reduction_draw(x, u)))
            times["after"].append(milliseconds(lambda x=logits, u=uniforms: sample_from_logits(x, uniforms=u)))
        old, new = (statistics.median(times[side]) for side in ("before", "after"))
        rows.append([f"{batch} x {vocab:,} ({label})", f"{old:.1f}", f"{new:.1f}", f"{old / new:.2f}x", str(same)])
    headers = ["rows x vocabulary", "one reduction, ms", "shipped, ms", "speed-up", "same tokens and logprobs"]
    notes = [f"median of {args.repeats} interleaved draws a side, after one untimed draw each (the byte check)"]
    emit_table("The decoding step's draw on a CPU", environment_lines("synthetic logits"), headers, rows, notes, args)


if __name__ == "__main__":
    main()
