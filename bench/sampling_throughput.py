"""Sampling throughput: this project's samplers vs ``transformers``' ``generate``, same model, batch and lengths.

Both sample ``--response-tokens`` tokens after ``--query-tokens`` fixed-seed random query tokens for
``--batch`` rows, the lm-human-preferences way: temperature 0.7, top_k 0, top_p 1, no stop token
(every row gets exactly ``--response-tokens`` new tokens), fp32, with a KV cache.

- ours: :func:`rlhf_pipeline.sampling.sample_responses` (prefill without the LM head except at the
  last position, one uniform per row per step through a two-level inverse-CDF search).
- ours, static cache: :func:`rlhf_pipeline.static_sampling.sample_responses_static`, the same draws
  over a static KV cache, its decoding step compiled with CUDA graphs on ``--device cuda`` (on the
  CPU it runs uncompiled: what the static cache alone costs there).
- transformers: ``model.generate(do_sample=True, top_k=0, top_p=1.0, temperature=0.7,
  min_new_tokens=max_new_tokens=R)`` with eos disabled.

Each side runs once to warm up, then ``--repeats`` times, interleaved; the table gives the median.
Two workloads of ``--batch`` rows: distinct queries, and ``--samples-per-query`` samples of each
query (what best-of-N labelling and the corpus run). For reference, measured on this machine in the
same run: the memory-bandwidth floor of one decoding step (every weight read once: bytes / a
measured copy bandwidth) and each call's compute floor (its unavoidable matrix-product FLOPs / a
measured fp32 matrix-product rate).

``--device cuda``: every side on the GPU under bf16 autocast (``compute.cuda_precision: bf16``), timed
with the GPU synchronised; the CPU floors are then left out.

Usage::

    .venv/bin/python bench/sampling_throughput.py [--batch 64] [--query-tokens 24] [--response-tokens 16]
        [--samples-per-query 4] [--repeats 3] [--device cpu|cuda] [--markdown] [--output FILE]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import (
    MODEL_NAMES,
    benchmark_parser,
    emit,
    environment_lines,
    measured_matmul_flops,
    prepare,
    random_token_ids,
    render_report,
    render_table,
)  # noqa: E402


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


def synchronised() -> float:
    """The clock, once the GPU (if any) has finished what it was given."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


def time_ours(model, queries, args, pad_id, samples, sampler=None) -> float:
    from rlhf_pipeline.decoding import SamplingRequest
    from rlhf_pipeline.sampling import sample_responses

    sampler = sampler or sample_responses
    request = SamplingRequest(
        queries=queries,
        query_mask=queries != pad_id,
        response_length=args.response_tokens,
        temperature=0.7,
        pad_token_id=pad_id,
        generator=torch.Generator(device=queries.device).manual_seed(args.seed),
        num_samples=samples,
    )
    started = synchronised()
    with torch.no_grad():
        out = sampler(model, request)
    assert out.responses.shape == (len(queries) * samples, args.response_tokens)
    return synchronised() - started


def time_static(model, queries, args, pad_id, samples) -> float:
    from rlhf_pipeline.static_sampling import sample_responses_static

    return time_ours(model, queries, args, pad_id, samples, sample_responses_static)


def time_transformers(model, queries, args, pad_id, samples) -> float:
    from transformers import GenerationConfig

    config = GenerationConfig(
        do_sample=True,
        top_k=0,
        top_p=1.0,
        temperature=0.7,
        max_new_tokens=args.response_tokens,
        min_new_tokens=args.response_tokens,
        eos_token_id=None,
        pad_token_id=pad_id,
        bos_token_id=None,
        num_return_sequences=samples,
    )
    torch.manual_seed(args.seed)
    started = synchronised()
    with torch.no_grad():
        out = model.generate(input_ids=queries, attention_mask=torch.ones_like(queries), generation_config=config)
    assert out.shape == (len(queries) * samples, queries.shape[1] + args.response_tokens)
    return synchronised() - started


def call_flops(model, distinct_queries: int, rows: int, args) -> float:
    """Matrix-product FLOPs a sampler cannot avoid: the transformer body once per distinct query
    token and once per sampled token, the LM head (tied to the embedding) once per sampled token.
    Attention score products are left out (under 3% at these lengths)."""
    head = model.get_output_embeddings().weight.numel()
    body = sum(p.numel() for p in model.parameters()) - head
    return (
        2 * body * (distinct_queries * args.query_tokens + rows * args.response_tokens)
        + 2 * head * rows * args.response_tokens
    )


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--batch", type=int, default=64, help="rows sampled per call")
    parser.add_argument("--query-tokens", type=int, default=24)
    parser.add_argument("--response-tokens", type=int, default=16)
    parser.add_argument(
        "--samples-per-query",
        type=int,
        default=4,
        help="the shared-query workload: best-of-N labelling samples N per query",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args()
    model_dir, tokenizer = prepare(args)
    from rlhf_pipeline.devices import resolve_device
    from rlhf_pipeline.models import load_causal_lm

    plan = resolve_device(args.device)
    model = load_causal_lm(model_dir, plan.device).eval()
    pad_id = tokenizer.pad_token_id
    workloads = {  # name: (distinct queries, samples per query)
        f"{args.batch} distinct queries": (args.batch, 1),
        f"{args.batch // args.samples_per_query} queries x {args.samples_per_query} samples": (
            args.batch // args.samples_per_query,
            args.samples_per_query,
        ),
    }
    static = "this project, static cache" + (" + CUDA graphs" if plan.device.type == "cuda" else " (uncompiled)")
    sides = {
        "this project (sample_responses)": time_ours,
        static: time_static,
        "transformers generate": time_transformers,
    }
    queries = {
        name: random_token_ids(tokenizer, (n, args.query_tokens), torch.Generator().manual_seed(args.seed)).to(
            plan.device
        )
        for name, (n, _) in workloads.items()
    }
    times = {(w, side): [] for w in workloads for side in sides}
    with plan.autocast():
        for w, side in times:  # warm-up (and the static sampler's compilation)
            sides[side](model, queries[w], args, pad_id, workloads[w][1])
        for _ in range(args.repeats):
            for (w, side), runs in times.items():
                runs.append(sides[side](model, queries[w], args, pad_id, workloads[w][1]))
    on_cpu = plan.device.type == "cpu"
    bandwidth, flops = (measured_bandwidth(), measured_matmul_flops()) if on_cpu else (None, None)
    step_bytes = sum(p.numel() for p in model.parameters()) * 4  # the LM head shares the embedding matrix
    rows = []
    for w, (distinct, samples) in workloads.items():
        reference = statistics.median(times[(w, "transformers generate")])
        tokens = distinct * samples * args.response_tokens
        for side in sides:
            median = statistics.median(times[(w, side)])
            rows.append([w, side, f"{tokens / median:.0f}", f"{median:.2f}", f"{reference / median:.2f}x"])
        if not on_cpu:  # the floors below are measured with the CPU's copy and matrix-product rates
            continue
        floor = call_flops(model, distinct, distinct * samples, args) / flops
        rows.append(
            [
                w,
                "floor: matrix products at the measured rate",
                f"{tokens / floor:.0f}",
                f"{floor:.2f}",
                f"{reference / floor:.2f}x",
            ]
        )
    table = render_table(
        ["workload", "implementation", "new tokens/s", "s per call", "vs transformers"], rows, args.markdown
    )
    notes = [
        f"{args.batch} rows per call, query {args.query_tokens} tokens, {args.response_tokens} new tokens, "
        "temperature 0.7, top_k 0, no stop token; "
        f"median of {args.repeats} interleaved runs after one warm-up each (all runs: "
        + "; ".join(f"{w} / {side}: {', '.join(f'{t:.2f}' for t in runs)} s" for (w, side), runs in times.items())
        + ")",
        f"the shared-query workload is what best-of-{args.samples_per_query} labelling and the corpus sample: this "
        "project runs each query's "
        "prefill once and repeats its KV cache; `generate(num_return_sequences=N)` repeats the query before the "
        "prefill",
    ]
    if on_cpu:
        notes.append(
            f"measured here: copy bandwidth {bandwidth / 1e9:.1f} GB/s, fp32 matrix products {flops / 1e9:.0f} "
            "GFLOP/s (2048x2048); "
            f"reading every weight once per decoding step ({step_bytes / 1e6:.0f} MB) takes "
            f"{1000 * step_bytes / bandwidth:.0f} ms, so at this batch "
            "a step is compute-bound, and the floor row is the call's unavoidable matrix-product FLOPs at the "
            "measured rate"
        )
    else:
        notes.append(f"on {plan.describe()}; the static sampler's warm-up call includes its compilation")
    emit(
        render_report(
            "Sampling throughput",
            environment_lines(MODEL_NAMES[args.model], plan.device.type),
            table,
            notes,
            args.markdown,
        ),
        args.output,
    )


if __name__ == "__main__":
    main()
