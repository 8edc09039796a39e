"""Would computing the last block's MLP and output projection at the read positions only keep the bytes?

The reward head reads two positions of each packed row, PPO's heads the response positions; the last
block's MLP and attention output projection act on each position alone, so only those rows need them
(`bench/results/reward_speed_profile.md`, "What would move it"). This probe runs each of those linear
layers, at SmolLM2-135M's widths, on every row and on the read rows alone, and compares what training
uses: the read rows' outputs, the gradient reaching their inputs, and the weight's gradient. Each
setting runs in a fresh process (torch reads ATEN_CPU_CAPABILITY once).

    .venv/bin/python bench/probe_read_rows.py [--markdown] [--output FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch
import torch.nn.functional as F
from common import emit_table

HIDDEN, MLP = 576, 1536  # SmolLM2-135M
LAYERS = {"o_proj": (HIDDEN, HIDDEN), "up_proj": (HIDDEN, MLP), "down_proj": (MLP, HIDDEN)}
SETTINGS = [("avx2, 2 threads", "avx2", 2), ("default, 2 threads", "default", 2), ("avx2, 1 thread", "avx2", 1)]


def read_rows(rows: int, length: int, read: list[int]) -> torch.Tensor:
    """Flat indices of the positions ``read`` in each of ``rows`` packed rows of ``length`` tokens."""
    return torch.tensor([r * length + p for r in range(rows) for p in read])


# the reward model's step (8 rows of 64 + 2 x 24 tokens, the last token of each response read) and a PPO
# epoch's microbatch (16 rows of 64 + 24 tokens, the logits of the last query and 23 response positions read)
WORKLOADS = {
    "reward model": (8, 112, [87, 111]),
    "PPO": (16, 88, list(range(63, 87))),
}


def compare(workload: str) -> dict[str, list[bool]]:
    rows, length, read = WORKLOADS[workload]
    index = read_rows(rows, length, read)
    out = {}
    for name, (fan_in, fan_out) in LAYERS.items():
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(rows * length, fan_in, generator=gen)
        weight = torch.randn(fan_out, fan_in, generator=gen) * 0.02
        grad_out = torch.randn(len(index), fan_out, generator=gen)
        results = []
        for subset in (False, True):
            xs = x.clone().requires_grad_(True)
            ws = weight.clone().requires_grad_(True)
            y = F.linear(xs[index], ws) if subset else F.linear(xs, ws)[index]
            (y * grad_out).sum().backward()
            results.append((y.detach(), xs.grad[index], ws.grad))
        (full, sub) = results
        out[name] = [torch.equal(a, b) for a, b in zip(full, sub)]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--output")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        torch.set_num_threads(int(os.environ["PROBE_THREADS"]))
        print(json.dumps({workload: compare(workload) for workload in WORKLOADS}))
        return 0
    differ = "**differ**" if args.markdown else "DIFFER"
    table = []
    for label, capability, threads in SETTINGS:
        env = {**os.environ, "ATEN_CPU_CAPABILITY": capability, "MKL_CBWR": "AVX2", "PROBE_THREADS": str(threads)}
        result = json.loads(
            subprocess.run(
                [sys.executable, __file__, "--child"], env=env, capture_output=True, text=True, check=True
            ).stdout
        )
        for workload, layers in result.items():
            for layer, flags in layers.items():  # outputs, input gradient, weight gradient
                table.append([label, workload, layer, *("same" if flag else differ for flag in flags)])
    headers = ["setting", "workload", "layer", "read rows' outputs", "their input gradient", "weight gradient"]
    notes = [
        "full: the layer on every row, then the read rows; subset: the layer on the read rows alone; the same inputs, "
        "weights and output gradient (fixed seed), compared with torch.equal.",
        "MKL_CBWR=AVX2 in every setting, as compute.cpu_numerics: portable sets it.",
    ]
    env = [f"torch {torch.__version__}", f"cpu: {os.cpu_count()} logical CPUs"]
    emit_table("Last block at the read rows only: the same bytes?", env, headers, table, notes, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
