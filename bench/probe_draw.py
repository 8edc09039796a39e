"""The draw of one decoding step on a CPU: the shipped draw against the one it replaced, same logits, same run.

Each decoding step draws a token per row from (rows, V) logits (:func:`rlhf_pipeline.decoding.sample_from_logits`).
The draw before 2026-12-03 padded a copy of the (rows, V) weights to whole blocks and summed the blocks in float64
in one call, which casts the whole batch to float64 first (100 MB a step at 256 rows of SmolLM2's 49,153 tokens).
The shipped draw writes the weights straight into the block layout and sums a few rows at a time
(:func:`rlhf_pipeline.decoding.block_sums_float64`). This probe times both, interleaved, and checks that they
draw the same tokens with the same logprobs, bit for bit.

Workloads: 256 rows (preferences' 64 queries x 4 samples, the default's widest step) and 96 rows (the
evaluation's batch) of SmolLM2's vocabulary, and 96 rows of Gemma 3's 262,144 tokens; then, with ``models/base``
built, one whole preferences call (64 queries x 4 samples, 24 query tokens, 16 sampled) with each draw.

Usage: ``.venv/bin/python bench/probe_draw.py [--repeats 20] [--calls 3] [--profile] [--markdown] [--output FILE]``,
alone on the machine, under the stages' numerics (``portable``: AVX2 kernels, 2 threads). ``--profile`` also prints
where the shipped call's time goes, aten op by aten op (:class:`common.OpClock`).
Findings: ``bench/results/zen3_2026-12-03/README.md`` at commit def2191 (``git show def2191:PATH``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import OpClock, emit_table, environment_lines, render_table, run_as_a_stage  # noqa: E402

from rlhf_pipeline import decoding, sampling  # noqa: E402
from rlhf_pipeline.decoding import sample_from_logits, step_uniforms  # noqa: E402

BASE = "models/base"  # `dvc repro base_model`: SmolLM2-135M-Instruct, as the stages load it
QUERY, RESPONSE, QUERIES, SAMPLES = 24, 16, 64, 4  # one of preferences' calls

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


def one_reduction_sample_from_logits(logits, generator=None, block_size=256, process_share=(0, 1), uniforms=None):
    """:func:`one_reduction_draw` in the sampler's place: its uniforms drawn as the shipped draw draws them."""
    u = step_uniforms(generator, logits.shape[0], process_share, logits.device) if uniforms is None else uniforms
    return one_reduction_draw(logits, u.to(logits.device, torch.float64), block_size)


def preferences_call(model, queries: torch.Tensor, pad: int, draw) -> sampling.SampleOutput:
    """One of preferences' sampling calls (64 queries x 4 samples, 16 tokens at 0.7) with ``draw`` as the draw."""
    shipped, decoding.sample_from_logits = decoding.sample_from_logits, draw  # the decode loop's draw
    try:
        mask = torch.ones_like(queries, dtype=torch.bool)
        generator = torch.Generator().manual_seed(1)
        request = sampling.SamplingRequest(
            queries=queries,
            query_mask=mask,
            response_length=RESPONSE,
            temperature=0.7,
            pad_token_id=pad,
            generator=generator,
            num_samples=SAMPLES,
        )
        return sampling.sample_responses(model, request)
    finally:
        decoding.sample_from_logits = shipped


def base_model_and_queries() -> tuple[torch.nn.Module, int, torch.Tensor]:
    """``models/base`` in fp32, its pad id, and one preferences call's queries (random tokens, seeded)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(BASE, dtype=torch.float32).eval()
    pad = AutoTokenizer.from_pretrained(BASE).pad_token_id
    return model, pad, torch.randint(100, 40_000, (QUERIES, QUERY), generator=torch.Generator().manual_seed(3))


def sampling_row(repeats: int, profile: bool) -> list[str] | None:
    """The whole call on the real model, both draws interleaved; None without ``models/base``."""
    if not Path(BASE, "config.json").exists():
        return None
    model, pad, queries = base_model_and_queries()
    draws = {"before": one_reduction_sample_from_logits, "after": sample_from_logits}
    outputs = {side: preferences_call(model, queries, pad, draw) for side, draw in draws.items()}  # also warms up
    same = all(
        torch.equal(getattr(outputs["before"], name), getattr(outputs["after"], name))
        for name in ("responses", "logprobs")
    )
    times = {side: [] for side in draws}
    for _ in range(repeats):
        for side, draw in draws.items():
            times[side].append(milliseconds(lambda d=draw: preferences_call(model, queries, pad, d)) / 1000)
    old, new = (statistics.median(times[side]) for side in draws)
    if profile:  # where the shipped call's time goes, each aten op timed by a clock around it
        clock = OpClock()
        with clock:
            preferences_call(model, queries, pad, sample_from_logits)
        ops = [
            [name, f"{seconds:.2f}", f"{clock.flops[name] / seconds / 1e9:.0f}" if clock.flops[name] else ""]
            for name, seconds in clock.seconds.most_common(8)
        ]
        ops.append(["all ops", f"{sum(clock.seconds.values()):.2f}", ""])
        print(render_table(["aten op (the shipped call)", "s", "GFLOP/s"], ops, markdown=True) + "\n", flush=True)
    label = f"{QUERIES} x {SAMPLES} rows, {RESPONSE} tokens: a whole preferences call on {BASE}, s"
    return [label, f"{old:.2f}", f"{new:.2f}", f"{old / new:.2f}x", str(same)]


def milliseconds(draw) -> float:
    started = time.perf_counter()
    draw()
    return 1000 * (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--calls", type=int, default=3, help="timed whole sampling calls a side")
    parser.add_argument("--profile", action="store_true", help="also print the shipped call's time by aten op")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--output")
    args = parser.parse_args()
    run_as_a_stage()
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
        rows.append([f"{batch} x {vocab:,} ({label}), ms", f"{old:.1f}", f"{new:.1f}", f"{old / new:.2f}x", str(same)])
    call = sampling_row(args.calls, args.profile)
    rows += [call] if call else []
    headers = ["workload", "one reduction", "shipped", "speed-up", "same tokens and logprobs"]
    notes = [
        f"draws: median of {args.repeats} interleaved draws a side, after one untimed draw each (the byte check)",
        f"the whole call: median of {args.calls} interleaved calls a side after one each; "
        + (f"on {BASE}" if call else f"left out: no {BASE} (`dvc repro base_model`)"),
    ]
    emit_table(
        "The decoding step's draw on a CPU",
        environment_lines(f"synthetic logits for the draws; {BASE} (SmolLM2-135M-Instruct) for the whole call"),
        headers,
        rows,
        notes,
        args,
    )


if __name__ == "__main__":
    main()
