"""Which settings torch's CPU wheel obeys: each op's output bytes under each setting, one process each.

Each row runs the same ops on the same fixed-seed inputs in a fresh process whose environment sets one
variable (or thread count) and prints a short hash of each output: a hash that changes means the
setting reaches that op's kernel. The last columns read back what torch and MKL run, and time one
SmolLM2-shaped GEMM (so the cost of MKL's COMPATIBLE branch shows). Findings: docs/numerics.md.

    .venv/bin/python bench/probe_numerics.py [--markdown] [--output FILE]
"""

from __future__ import annotations

import rlhf_pipeline.offline  # noqa: F401  (first: offline and quiet before the libraries load)

import argparse
import json
import os
import subprocess
import sys

from common import emit_table, environment_lines

# (row label, environment, torch threads); the first row is the reference the others are compared with
SETTINGS = [
    ("unset, 2 threads", {}, 2),
    ("unset, 1 thread", {}, 1),
    ("ATEN_CPU_CAPABILITY=default", {"ATEN_CPU_CAPABILITY": "default"}, 2),
    ("ATEN_CPU_CAPABILITY=avx2", {"ATEN_CPU_CAPABILITY": "avx2"}, 2),
    ("ATEN_CPU_CAPABILITY=default set after import torch", {"LATE_ATEN_CPU_CAPABILITY": "default"}, 2),
    ("MKL_CBWR=AVX2", {"MKL_CBWR": "AVX2"}, 2),
    ("MKL_CBWR=AVX2,STRICT", {"MKL_CBWR": "AVX2,STRICT"}, 2),
    ("MKL_CBWR=AVX2,STRICT, 1 thread", {"MKL_CBWR": "AVX2,STRICT"}, 1),
    (
        "portable's variables with MKL_CBWR=AVX2,STRICT",
        {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2,STRICT", "ONEDNN_MAX_CPU_ISA": "AVX2"},
        2,
    ),
    ("MKL_CBWR=AVX512 (Intel AVX-512 hosts)", {"MKL_CBWR": "AVX512"}, 2),
    (
        "portable's variables with MKL_CBWR=AVX512",
        {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX512", "ONEDNN_MAX_CPU_ISA": "AVX2"},
        2,
    ),
    (
        "every variable at AVX-512",
        {"ATEN_CPU_CAPABILITY": "avx512", "MKL_CBWR": "AVX512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE"},
        2,
    ),
    ("MKL_CBWR=SSE4_2", {"MKL_CBWR": "SSE4_2"}, 2),
    ("MKL_CBWR=COMPATIBLE", {"MKL_CBWR": "COMPATIBLE"}, 2),
    ("MKL_ENABLE_INSTRUCTIONS=SSE4_2", {"MKL_ENABLE_INSTRUCTIONS": "SSE4_2"}, 2),
    ("ONEDNN_MAX_CPU_ISA=SSE41", {"ONEDNN_MAX_CPU_ISA": "SSE41"}, 2),
    ("compute.cpu_numerics: portable, 2 threads", {"PIN": "portable"}, 2),
    ("compute.cpu_numerics: compatible, 2 threads", {"PIN": "compatible"}, 2),
]
OPS = ["linear", "wgrad", "sdpa", "softmax", "rmsnorm", "silu", "gelu", "sum4M", "cholesky"]

CHILD = r"""
import hashlib, json, os, sys, time
from rlhf_pipeline import numerics
if os.environ.get("PIN"):
    numerics.pin(os.environ["PIN"], int(sys.argv[1]))
import torch
if os.environ.get("LATE_ATEN_CPU_CAPABILITY"):  # after torch is imported, before its first kernel
    os.environ["ATEN_CPU_CAPABILITY"] = os.environ["LATE_ATEN_CPU_CAPABILITY"]
torch.set_num_threads(int(sys.argv[1]))
F = torch.nn.functional
def h(t):
    return hashlib.sha256(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:6]
g = torch.Generator().manual_seed(0)
x = torch.randn(16, 40, 576, generator=g, requires_grad=True)
w = torch.randn(1536, 576, generator=g) / 24
q = torch.randn(16, 9, 40, 64, generator=g)
y = F.linear(x, w)
y.square().sum().backward()
out = {
    "linear": h(y), "wgrad": h(y.detach().flatten(0, 1).T @ x.detach().flatten(0, 1)),
    "sdpa": h(F.scaled_dot_product_attention(q, q, q, is_causal=True)),
    "softmax": h(torch.softmax(y.detach(), -1)), "rmsnorm": h(F.rms_norm(x.detach(), (576,))),
    "silu": h(F.silu(y.detach())), "gelu": h(F.gelu(y.detach())),
    "sum4M": h(torch.randn(4_000_000, generator=g).sum()),
}
e = torch.randn(4096, 576, generator=g)  # the base model's pad token: its mean resizing factors a covariance
out["cholesky"] = h(torch.linalg.cholesky(e.T @ e / 4096 + torch.eye(576)))
a, b = torch.randn(640, 576, generator=g), torch.randn(576, 1536, generator=g)
a @ b
start = time.perf_counter()
for _ in range(50):
    a @ b
out["gemm_ms"] = (time.perf_counter() - start) / 50 * 1000
out["torch"] = torch.backends.cpu.get_cpu_capability()
out["mkl"] = numerics.mkl_branch()
print(json.dumps(out))
"""


def probe(env: dict[str, str], threads: int) -> dict:
    clean = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "ONEDNN_MAX_CPU_ISA")}
    result = subprocess.run(
        [sys.executable, "-c", CHILD, str(threads)], env={**clean, **env}, capture_output=True, text=True
    )
    if result.returncode:
        raise SystemExit(f"the probe failed under {env}, {threads} threads:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--output")
    args = parser.parse_args()
    results = [(label, probe(env, threads)) for label, env, threads in SETTINGS]
    reference = results[0][1]
    rows = []
    for label, found in results:
        cells = [found[op] + ("" if found[op] == reference[op] else " *") for op in OPS]
        rows.append([label, *cells, found["torch"], found["mkl"] or "?", f"{found['gemm_ms']:.1f}"])
    notes = [
        "each cell: the first 6 hex digits of the sha256 of that op's output; * = other bytes than the first row",
        "linear, wgrad: fp32 GEMMs (MKL); sdpa, softmax, rmsnorm, silu: ATen's vectorised kernels; gelu: oneDNN "
        "(torch routes fp32 GELU there); sum4M: one 4 M-element sum, which torch splits between its threads; "
        "cholesky: LAPACK's (MKL's) factorisation of a 576x576 covariance, as the base model's mean resizing runs",
        "GEMM ms: one 640x576 @ 576x1536 matmul (a SmolLM2 MLP projection of a 16x40 batch), mean of 50",
    ]
    env = [
        line for line in environment_lines("none (fixed-seed random tensors)") if not line.startswith("cpu numerics")
    ]
    headers = ["setting", *OPS, "torch runs", "MKL branch", "GEMM ms"]
    emit_table("Which CPU settings torch 2.13's wheel obeys", env, headers, rows, notes, args)


if __name__ == "__main__":
    main()
