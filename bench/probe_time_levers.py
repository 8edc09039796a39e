"""Which cuts to the default run's time keep its bytes (issue 50, point 2): four probes.

1. Rows per decoding step: the sampler on ``models/base`` at 16, 32, 64 and 128 queries x 4 samples a
   call (64 to 512 rows a step), preferences' workload (24 query tokens, 16 sampled): s a label.
2. PPO's KL reading (``ppo.kl.budget_check_responses`` 128): its responses sampled in chunks of
   ``ppo.batch_size`` 32 rows, as ``PPOTrainer.extra_kl`` does, against one pass of 128, twice each.
3. Bytes: the logits of a 128-row prefill and 3 decoding steps against 4 chunks of 32 rows; and a CPU
   generator's ``rand((16, 32))`` against 16 draws of ``(32, 1)``. Both equal: one pass over several
   draw-chunks keeps every byte when its uniforms are drawn chunk by chunk first.
4. Bytes: SmolLM2's MLP run only at the positions a loss reads (PPO's response positions, the reward
   head's pooled ones) against every position: forward and input gradient, and the weights' gradients.

Usage: ``.venv/bin/python bench/probe_time_levers.py`` from the project root, after ``dvc repro base_model``,
alone on the machine. Findings: ``bench/results/default_run_time_levers.md``.
"""

from __future__ import annotations

import rlhf_pipeline.offline  # noqa: F401,I001  (first: offline before the Hugging Face libraries load)

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import render_table, run_as_a_stage  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, LlamaConfig  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaMLP  # noqa: E402

from rlhf_pipeline.decoding import SamplingRequest  # noqa: E402
from rlhf_pipeline.sampling import sample_responses  # noqa: E402

BASE = "models/base"
QUERY, RESPONSE = 24, 16


def timed(run) -> float:
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


def request(queries, mask, pad: int, generator, num_samples: int = 1) -> SamplingRequest:
    return SamplingRequest(
        queries=queries,
        query_mask=mask,
        response_length=RESPONSE,
        temperature=0.7,
        pad_token_id=pad,
        generator=generator,
        num_samples=num_samples,
    )


def rows_per_step(model, pad: int, queries: torch.Tensor) -> None:
    def call(n: int):
        mask = torch.ones(n, QUERY, dtype=torch.bool)
        generator = torch.Generator().manual_seed(1)
        return sample_responses(model, request(queries[:n], mask, pad, generator, num_samples=4))

    call(16)  # warm-up
    rows = []
    for n in (16, 32, 64, 128):
        best = min(timed(lambda n=n: call(n)) for _ in range(2))
        rows.append([str(n), str(4 * n), f"{best:.2f}", f"{1000 * best / n:.0f}"])
    headers = ["queries x 4 samples", "rows a step", "s a call (best of 2)", "ms a label"]
    print(render_table(headers, rows, markdown=True), flush=True)


def kl_reading(model, pad: int, queries: torch.Tensor) -> None:
    def reading(chunk: int):
        generator = torch.Generator().manual_seed(1)
        mask = torch.ones(chunk, QUERY, dtype=torch.bool)
        for start in range(0, 128, chunk):
            sample_responses(model, request(queries[start : start + chunk], mask, pad, generator))

    reading(128)  # warm-up
    times = {chunk: [] for chunk in (32, 128)}
    for _ in range(2):
        for chunk in times:
            times[chunk].append(timed(lambda chunk=chunk: reading(chunk)))
    rows = [[f"chunks of {chunk} rows", ", ".join(f"{t:.2f}" for t in runs)] for chunk, runs in times.items()]
    print("\n" + render_table(["128 responses sampled", "s (two runs, interleaved)"], rows, markdown=True), flush=True)


@torch.no_grad()
def chunking_bytes(model, queries: torch.Tensor) -> None:
    steps = torch.randint(100, 40_000, (128, 3), generator=torch.Generator().manual_seed(2))

    def logits(rows: slice) -> torch.Tensor:
        out = model(input_ids=queries[rows], cache=DynamicCache(config=model.config), use_cache=True)
        found = [out.logits[:, -1]]
        for t in range(3):
            out = model(input_ids=steps[rows, t : t + 1], cache=out.cache, use_cache=True)
            found.append(out.logits[:, -1])
        return torch.stack(found, 1)

    one_pass = logits(slice(0, 128))
    chunks = torch.cat([logits(slice(start, start + 32)) for start in range(0, 128, 32)])
    drawn = torch.Generator().manual_seed(5)
    singly = torch.cat([torch.rand((32, 1), generator=drawn, dtype=torch.float64).view(-1) for _ in range(16)])
    at_once = torch.rand((16, 32), generator=torch.Generator().manual_seed(5), dtype=torch.float64).view(-1)
    print(f"\n128-row prefill + 3 steps, logits equal to 4 chunks of 32: {torch.equal(one_pass, chunks)}")
    print(f"rand((16, 32)) equal to 16 draws of (32, 1): {torch.equal(singly, at_once)}")


def gathered_rows_bytes() -> None:
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=576, intermediate_size=1536, hidden_act="silu")
    rows = []
    for batch, positions, read, label in (
        (16, 88, slice(63, 87), "PPO's response positions"),
        (16, 40, slice(23, 39), "the default's 24 + 16 tokens"),
        (8, 112, [55, 111], "a best-of-2 row's two pooled positions"),
    ):
        mlp = LlamaMLP(config)
        x, weights = torch.randn(batch, positions, 576), torch.randn(batch, positions, 576)
        results = []
        for gather in (False, True):
            mlp.zero_grad()
            inputs = x.clone().requires_grad_(True)
            out = mlp(inputs[:, read]) if gather else mlp(inputs)[:, read]
            (out * weights[:, read]).sum().backward()
            results.append((out.detach(), inputs.grad, {n: p.grad.clone() for n, p in mlp.named_parameters()}))
        (y1, gx1, g1), (y2, gx2, g2) = results
        diff = max((g1[n] - g2[n]).abs().max().item() for n in g1)
        equal = all(torch.equal(g1[n], g2[n]) for n in g1)
        same = (torch.equal(y1, y2), torch.equal(gx1, gx2), equal)
        rows.append([f"{batch} x {positions}, {label}", *map(str, same), f"{diff:.2e}"])
    headers = [
        "rows x positions, read",
        "forward",
        "input gradient",
        "weight gradients",
        "largest weight-gradient diff",
    ]
    print("\n" + render_table(headers, rows, markdown=True))


def main() -> None:
    run_as_a_stage()
    tokenizer = AutoTokenizer.from_pretrained(BASE)
    model = AutoModelForCausalLM.from_pretrained(BASE, dtype=torch.float32).eval()
    queries = torch.randint(100, 40_000, (128, QUERY), generator=torch.Generator().manual_seed(0))
    rows_per_step(model, tokenizer.pad_token_id, queries)
    kl_reading(model, tokenizer.pad_token_id, queries)
    chunking_bytes(model, queries)
    gathered_rows_bytes()


if __name__ == "__main__":
    main()
