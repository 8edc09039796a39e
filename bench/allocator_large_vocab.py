"""Peak memory and time of an evaluation's large blocks under each malloc setting: what keeping freed
memory costs on a 262k-token vocabulary (Gemma 3's), and what the bound on it gives back.

Each setting runs in its own process, on the same tiny random ``gemma3_text`` model whose only large
part is Gemma's vocabulary (hidden size 64, 2 blocks): ``--rounds`` times, a perturbed copy of the base
samples ``--rows`` queries for ``--response-length`` tokens, then both models' final hidden states and the
exact KL by rows, whose reference logits also give the sampled tokens' logprobs: the function ``evaluate``
calls for each checkpoint's batch (``evaluation.exact_kl_and_reference_logprobs``; before 2026-12-02 the
base's head ran once more over every response, in blocks of up to 512 MiB). Each block of 8 responses'
(8, 16, 262,144) fp32 logits is 134 MB a model; sampling's (rows, 262,144) are 100 MB a step. Settings:

- ``system``, the reference: glibc's own malloc settings (``RLHF_MALLOC=system``);
- ``keep, unbounded``: no block mapped apart, trim at 2 GiB, no bound on what is kept (as shipped on
  2026-11-28; ``allocator.KEPT_BOUND`` raised past any memory);
- ``keep, bounded``: as shipped, at most ``allocator.KEPT_BOUND`` kept.

The table gives each process's peak RSS (its own ``VmHWM``), wall seconds, minor page faults, system
seconds, the times the bound gave memory back, ratios to the reference, and a hash of the responses, the
reference's logprobs and the KLs (the setting must change no byte).

Each setting runs ``--repeats`` times (3), the settings in turn: how far the heap grows depends on the order in
which the threads free and take blocks, so one run's peak is a draw (unbounded, on one Intel machine on one
morning: 3.8 GB in one run, 9.6 GB in the next).

Usage (nothing else running; about 13 minutes on 2 cores):

    .venv/bin/python bench/allocator_large_vocab.py --markdown --output bench/results/allocator_large_vocab.md
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import cpu_name, emit_table, measured_matmul_flops

REPO = Path(__file__).resolve().parents[1]

CHILD = """
import copy, hashlib, json, resource, sys
from rlhf_pipeline import allocator
rounds, rows, response_length, bounded = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
if not bounded:
    allocator.KEPT_BOUND = 1 << 60  # the 2026-11-28 allocator: everything freed is kept
kept = allocator.keep_freed_memory()
import rlhf_pipeline.offline
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from rlhf_pipeline import numerics
from rlhf_pipeline.evaluation import exact_kl_and_reference_logprobs
from rlhf_pipeline.decoding import SamplingRequest
from rlhf_pipeline.sampling import sample_on_device
numerics.pin(numerics.PORTABLE, 2)
vocab, query_length, pad, temperature = 262_144, 64, 0, 0.7
config = AutoConfig.for_model(
    "gemma3_text", vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=256, sliding_window=512,
)
torch.manual_seed(0)
base = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
generator = torch.Generator().manual_seed(0)
queries = torch.randint(1, vocab, (rows, query_length), generator=generator)
digest = hashlib.sha256()
with torch.no_grad():
    for _ in range(rounds):
        policy = copy.deepcopy(base)
        for weight in policy.parameters():
            weight.add_(0.01 * torch.randn(weight.shape, generator=generator))
        request = SamplingRequest(
            queries=queries, query_mask=queries != pad, response_length=response_length, temperature=temperature,
            pad_token_id=pad, generator=generator,
        )
        out = sample_on_device(policy, request)
        # the function evaluation.sample_and_score calls for each checkpoint's batch
        kl, logprobs = exact_kl_and_reference_logprobs(policy, base, queries, out, temperature, pad)
        digest.update(out.responses.numpy().tobytes() + logprobs.numpy().tobytes() + kl.numpy().tobytes())
usage = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({
    "kept": kept, "peak_mb": allocator.peak_rss_mb(), "faults": usage.ru_minflt, "system_s": usage.ru_stime,
    "given_back": allocator.times_given_back(), "digest": digest.hexdigest()[:12],
}))
"""

SETTINGS = {  # name: (RLHF_MALLOC, bounded)
    "system (reference)": ("system", True),
    "keep, unbounded": ("keep", False),
    "keep, bounded (shipped)": ("keep", True),
}


def measure(malloc: str, bounded: bool, args) -> dict:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "RLHF_MALLOC": malloc, "HOME": "/tmp"}
    command = [
        sys.executable,
        "-c",
        CHILD,
        str(args.rounds),
        str(args.rows),
        str(args.response_length),
        str(int(bounded)),
    ]
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1]) | {"seconds": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="checkpoints evaluated, each a sample and a KL")
    parser.add_argument("--rows", type=int, default=96, help="queries in the batch (the gemma profile: 96)")
    parser.add_argument("--response-length", type=int, default=16)
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="processes per setting, the settings taken in turn: one run's peak is a draw (3.8 or 9.6 GB unbounded)",
    )
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--output")
    args = parser.parse_args()
    env = [f"device: CPU ({cpu_name()}), 2 threads; 2048x2048 fp32 product {measured_matmul_flops() / 1e9:.0f} GFLOP/s"]
    runs: dict[str, list[dict]] = {name: [] for name in SETTINGS}
    for _ in range(args.repeats):  # the settings in turn, so that the machine's drift falls on all of them
        for name, (malloc, bounded) in SETTINGS.items():
            runs[name].append(measure(malloc, bounded, args))
    median = lambda name, key: statistics.median(run[key] for run in runs[name])  # noqa: E731
    reference = "system (reference)"
    headers = [
        "setting",
        "peak RSS MB, median",
        "each run's peak MB",
        "wall s",
        "minor faults",
        "system s",
        "given back",
        "peak / ref",
        "time / ref",
    ]
    rows = [
        [
            name,
            f"{median(name, 'peak_mb'):,.0f}",
            ", ".join(f"{run['peak_mb']:,.0f}" for run in runs[name]),
            f"{median(name, 'seconds'):.1f}",
            f"{median(name, 'faults'):,.0f}",
            f"{median(name, 'system_s'):.1f}",
            ", ".join("-" if run["given_back"] is None else str(run["given_back"]) for run in runs[name]),
            f"{median(name, 'peak_mb') / median(reference, 'peak_mb'):.2f}",
            f"{median(name, 'seconds') / median(reference, 'seconds'):.2f}",
        ]
        for name in runs
    ]
    digests = sorted({run["digest"] for name in runs for run in runs[name]})
    same = len(digests) == 1
    notes = [
        f"{args.rounds} rounds of {args.rows} queries x {args.response_length} tokens on a tiny gemma3_text with "
        f"262,144 tokens; each setting in its own process, {args.repeats} per setting, the settings taken in turn; "
        "wall s, faults and system s are medians",
        "responses, reference logprobs and KLs the same bytes in every run: "
        f"{'yes' if same else 'NO'} ({', '.join(digests)})",
    ]
    emit_table("Malloc settings on a 262k vocabulary", env, headers, rows, notes, args)
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
