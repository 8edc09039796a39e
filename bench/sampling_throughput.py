"""Sampling throughput: this project's sampler vs ``transformers``' ``generate``, same model, batch and lengths.

Both sample ``--response-tokens`` tokens after ``--query-tokens`` fixed-seed random query tokens for
``--batch`` rows, the lm-human-preferences way: temperature 0.7, top_k 0, top_p 1, no stop token
(every row gets exactly ``--response-tokens`` new tokens), fp32, with a KV cache.

- ours: :func:`rlhf_pipeline.sampling.sample_responses` (prefill without the LM head except at the
  last position, one uniform per row per step through a two-level inverse-CDF search).
- transformers: ``model.generate(do_sample=True, top_k=0, top_p=1.0, temperature=0.7,
  min_new_tokens=max_new_tokens=R)`` with eos disabled.

Each side runs once to warm up, then ``--repeats`` times, interleaved; the table gives the median.
For reference, two floors of one decoding step measured on this machine in the same run: the
memory-bandwidth floor (every weight read once per step: bytes / a measured copy bandwidth) and
the compute floor (2 x parameters x batch FLOPs / a measured fp32 matrix-product rate).

Usage: .venv/bin/python bench/sampling_throughput.py [--batch 64] [--query-tokens 24] [--response-tokens 16] [--repeats 3] [--markdown] [--output FILE]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import MODEL_NAMES, benchmark_parser, emit, environment_lines, prepare, random_token_ids, render_report, render_table  # noqa: E402

import torch  # noqa: E402


def measured_bandwidth(megabytes: int = 512) -> float:
    """Bytes per second of a large tensor copy (read + write counted)."""
    source = torch.ones(megabytes * 2**20 // 4)
    target = torch.empty_like(source)
    target.copy_(source)
    runs = []
    for _ in range(5):
        started = time.perf_counter()
        target.copy_(source)
        runs.append(time.perf_counter() - started)
    return 2 * source.numel() * 4 / min(runs)


def measured_matmul_flops(n: int = 2048) -> float:
    """FLOP/s of an fp32 n x n matrix product."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    runs = []
    for _ in range(5):
        started = time.perf_counter()
        a @ b
        runs.append(time.perf_counter() - started)
    return 2 * n**3 / min(runs)


def time_ours(model, queries, args, pad_id) -> float:
    from rlhf_pipeline.sampling import sample_responses

    started = time.perf_counter()
    with torch.no_grad():
        out = sample_responses(model, queries, queries != pad_id, args.response_tokens, 0.7, pad_id, generator=torch.Generator().manual_seed(args.seed))
    assert out.responses.shape == (len(queries), args.response_tokens)
    return time.perf_counter() - started


def time_transformers(model, queries, args, pad_id) -> float:
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=True, top_k=0, top_p=1.0, temperature=0.7, max_new_tokens=args.response_tokens,
                              min_new_tokens=args.response_tokens, eos_token_id=None, pad_token_id=pad_id, bos_token_id=None)
    torch.manual_seed(args.seed)
    started = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=queries, attention_mask=torch.ones_like(queries), generation_config=config)
    assert out.shape == (len(queries), queries.shape[1] + args.response_tokens)
    return time.perf_counter() - started


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--query-tokens", type=int, default=24)
    parser.add_argument("--response-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model_dir, tokenizer = prepare(args)
    from rlhf_pipeline.models import load_causal_lm

    model = load_causal_lm(model_dir).eval()
    pad_id = tokenizer.pad_token_id
    queries = random_token_ids(tokenizer, (args.batch, args.query_tokens), torch.Generator().manual_seed(args.seed))
    sides = {"this project (sample_responses)": time_ours, "transformers generate": time_transformers}
    times = {name: [] for name in sides}
    for name, run in sides.items():  # warm-up
        run(model, queries, args, pad_id)
    for _ in range(args.repeats):
        for name, run in sides.items():
            times[name].append(run(model, queries, args, pad_id))
    bandwidth, flops = measured_bandwidth(), measured_matmul_flops()
    params = sum(p.numel() for p in model.parameters())  # the LM head shares the embedding matrix
    step_bytes = params * 4
    step_flops = 2 * params * args.batch
    reference = statistics.median(times["transformers generate"])
    rows = []
    for name, runs in times.items():
        median = statistics.median(runs)
        tokens = args.batch * args.response_tokens
        rows.append([name, f"{tokens / median:.0f}", f"{median:.2f}", f"{1000 * median / args.response_tokens:.0f}", f"{reference / median:.2f}x"])
    rows.append(["floor: weights read once per step", "", "", f"{1000 * step_bytes / bandwidth:.0f}", ""])
    rows.append(["floor: matrix products at the measured rate", "", "", f"{1000 * step_flops / flops:.0f}", ""])
    table = render_table(["implementation", "new tokens/s", "s per call", "ms per new token step", "vs transformers"], rows, args.markdown)
    notes = [
        f"batch {args.batch}, query {args.query_tokens} tokens, {args.response_tokens} new tokens, temperature 0.7, top_k 0, no stop token; "
        f"median of {args.repeats} interleaved runs after one warm-up each (all runs: "
        + "; ".join(f"{name}: {', '.join(f'{t:.2f}' for t in runs)} s" for name, runs in times.items()) + ")",
        "'ms per new token step' is the whole call (prefill included) divided by the new tokens per row",
        f"measured here: copy bandwidth {bandwidth / 1e9:.1f} GB/s, fp32 matrix products {flops / 1e9:.0f} GFLOP/s; "
        f"a decoding step reads {step_bytes / 1e6:.0f} MB of weights and does {step_flops / 1e9:.1f} GFLOP at this batch",
    ]
    emit(render_report("Sampling throughput", environment_lines(MODEL_NAMES[args.model]), table, notes, args.markdown), args.output)


if __name__ == "__main__":
    main()
