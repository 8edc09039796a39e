"""The decoding step's matrix products at preferences' 256 rows, timed alone under the stages' numerics and malloc
setting; then the LM head three ways (a fresh output, a reused one, 4,096 tokens at a time), interleaved, with a
check that each gives the same bytes. Run: `.venv/bin/python bench/results/zen3_2026-12-03/product_shapes.py`."""

import statistics
import time

import torch

from rlhf_pipeline import allocator, numerics

numerics.pin(numerics.PORTABLE, 2)
allocator.keep_freed_memory()
torch.manual_seed(0)


def median_ms(call, reps):
    for _ in range(3):
        call()
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times)


a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
print(f"2048^2 product: {2 * 2048**3 / median_ms(lambda: a @ b, 10) / 1e6:.0f} GFLOP/s")
for k, n, name in [
    (576, 576, "q, o"),
    (576, 192, "k, v"),
    (576, 1536, "gate, up"),
    (1536, 576, "down"),
    (576, 49152, "LM head"),
]:
    x, w = torch.randn(256, k), torch.randn(n, k)
    ms = median_ms(lambda x=x, w=w: torch.nn.functional.linear(x, w), 7 if n > 10_000 else 50)
    print(f"(256, {k}) x ({k}, {n}) {name}: {ms:.2f} ms, {2 * 256 * k * n / ms / 1e6:.0f} GFLOP/s")

x, w = torch.randn(256, 576), torch.randn(49152, 576) * 0.05
reference, out = torch.nn.functional.linear(x, w), torch.empty(256, 49152)


def chunked():
    for start in range(0, 49152, 4096):
        torch.mm(x, w[start : start + 4096].t(), out=out[:, start : start + 4096])


ways = {
    "fresh output": lambda: torch.nn.functional.linear(x, w),
    "reused output": lambda: torch.mm(x, w.t(), out=out),
    "4,096 tokens at a time": chunked,
}
times = {name: [] for name in ways}
for _ in range(15):  # interleaved
    for name, call in ways.items():
        started = time.perf_counter()
        call()
        times[name].append(1000 * (time.perf_counter() - started))
for name, call in ways.items():
    result = call() if name == "fresh output" else (call(), out)[1]
    print(f"LM head, {name}: {statistics.median(times[name]):.1f} ms, same bytes: {torch.equal(result, reference)}")
