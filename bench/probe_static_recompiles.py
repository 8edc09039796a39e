"""Does the static sampler's compiled decoding step compile again for each new batch shape, and does
running a smaller batch in a shape already held (``static_sampling.batch_to_run``) avoid it?

One process, the step compiled with ``torch.compile`` as on CUDA (here inductor on the CPU: no CUDA graphs,
the same one-graph-per-shape rule, since the step is compiled with ``dynamic=False``). A sequence of calls
of one model, each row counting the graphs dynamo made (``counters["stats"]["unique_graphs"]``) and the
seconds it took, then the tokens of the same small call with and without reuse compared. Why it exists:
on an H200 the ``gpu`` profile's ``preferences`` stage paused about 30 s twice where it drew a few queries
again in smaller calls (docs/gpu.md, 2026-11-30). The seconds depend on inductor's on-disk cache (a second run
of this probe compiles faster); the graph counts do not.

    .venv/bin/python bench/probe_static_recompiles.py [--model tiny] [--markdown] [--output FILE]
"""

from __future__ import annotations

import rlhf_pipeline.offline  # noqa: F401  (first: offline and quiet before the libraries load)

import time

import torch
from common import benchmark_parser, emit_table, environment_lines, prepare, random_token_ids
from torch._dynamo.utils import counters

from rlhf_pipeline.decoding import SamplingRequest
from rlhf_pipeline.models import load_causal_lm
from rlhf_pipeline.static_sampling import sample_responses_static

SAMPLES = 4  # responses per query, as the preferences stage draws them
# (queries, reuse shapes, seed): a full batch, it again, then a resample-sized call with and without reuse
CALLS = [(8, True, 1), (8, True, 2), (2, True, 3), (2, False, 3), (1, False, 4)]


def left_padded(tokenizer, rows: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` queries of 3 to ``length`` real tokens (no special token among them), left-padded to ``length``."""
    generator = torch.Generator().manual_seed(seed)
    real = torch.randint(3, length + 1, (rows,), generator=generator)
    tokens = random_token_ids(tokenizer, (rows, length), generator)
    mask = torch.arange(length)[None, :] >= (length - real)[:, None]
    return torch.where(mask, tokens, torch.full_like(tokens, tokenizer.pad_token_id)), mask


def main(argv=None) -> None:
    parser = benchmark_parser(__doc__)
    parser.set_defaults(model="tiny")
    parser.add_argument("--response-length", type=int, default=6)
    args = parser.parse_args(argv)
    model_dir, tokenizer = prepare(args)
    model = load_causal_lm(model_dir).eval()
    pad = tokenizer.pad_token_id
    rows, drawn = [], {}
    for queries, reuse, seed in CALLS:
        batch, mask = left_padded(tokenizer, queries, 8, seed)
        graphs = counters["stats"]["unique_graphs"]
        start = time.perf_counter()
        draws = torch.Generator().manual_seed(seed)
        request = SamplingRequest(
            queries=batch,
            query_mask=mask,
            response_length=args.response_length,
            temperature=0.7,
            pad_token_id=pad,
            generator=draws,
            num_samples=SAMPLES,
        )
        out = sample_responses_static(
            model,
            request,
            compile=True,
            reuse_shapes=reuse,
        )
        seconds = time.perf_counter() - start
        drawn.setdefault(seed, []).append(out.responses)
        made = counters["stats"]["unique_graphs"] - graphs
        rows.append([str(queries * SAMPLES), "yes" if reuse else "no", str(made), f"{seconds:.2f}"])
    same = [(a == b).float().mean().item() for a, b in (d for d in drawn.values() if len(d) == 2)]
    emit_table(
        "The compiled decoding step: graphs made per call",
        environment_lines(args.model),
        ["rows in the call", "shapes reused", "graphs compiled", "seconds"],
        rows,
        [
            "calls in order on one model; a graph is compiled for the first shape and, without reuse, for each new one",
            f"the same small call with and without reuse drew the same tokens: {', '.join(f'{s:.3f}' for s in same)}",
        ],
        args,
    )


if __name__ == "__main__":
    main()
