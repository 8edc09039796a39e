"""Can attention keep BLAS and still give the same bytes on every CPU and in every batch? A probe of exact splits.

`compute.attention: invariant` (rlhf_pipeline/attention.py) first got its bytes by computing attention without BLAS,
at 1.6-2.5x a training step (the "invariant" column of the committed report; it now takes this probe's finding
further: one float64 product whose sums are exact, instead of several float32 slice products). This probe tries
the other way (the Ozaki scheme): cut each row of both factors into
slices of s bits under the row's power-of-two scale, so that every product of two slices, summed over the K terms
of a matrix product in any order, is exact in fp32 (2s + log2 K <= 23 bits). Any BLAS, any blocking, any vendor
then returns the same bytes for each slice product; the slice products are added elementwise in a fixed order.
It reports, at SmolLM2's attention shapes (9 query heads over 3 key heads, head dim 64):

1. whether a row decoded alone equals the same row in a full forward, and whether the bytes stay under MKL's
   COMPATIBLE branch (another process) as under `portable`, for torch's sdpa, the invariant attention and the split;
2. the error against a float64 attention;
3. the forward's time, medians of 7.

    .venv/bin/python bench/probe_exact_split.py [--markdown] [--output FILE]
"""

from __future__ import annotations

import rlhf_pipeline.offline  # noqa: F401  (first: offline and quiet before the libraries load)

import argparse
import hashlib
import json
import math
import os
import statistics
import subprocess
import sys
import time

from rlhf_pipeline import numerics

if __name__ == "__main__":
    numerics.pin(os.environ.get("PROBE_NUMERICS", "portable"), 2)  # before torch's first kernel

import torch  # noqa: E402
from torch import nn  # noqa: E402

from rlhf_pipeline.attention import MIN_KEYS, invariant_attention  # noqa: E402

F = nn.functional
MANTISSA = 24  # fp32's significant bits
KEYS_BOUND = 128  # the most keys a row may have: fixes the value slices' width whatever the call's length


def row_slices(x: torch.Tensor, bits: int, count: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """``x`` (..., K) as ``count`` slices whose sum is x / scale to within 2^-(bits * count), each an integer times
    2^-(bits * (i + 1)) of magnitude at most 2^bits; ``scale`` (..., 1) the row's power of two (|x| < scale)."""
    _, exponent = torch.frexp(x.abs().amax(-1, keepdim=True))
    scale = torch.ldexp(torch.ones_like(x[..., :1]), exponent)
    rest, slices = x / scale, []
    for i in range(count):
        unit = 2.0 ** (bits * (i + 1))
        piece = torch.round(rest * unit) / unit  # powers of two and a rounding: exact
        slices.append(piece)
        rest = rest - piece  # exact: piece holds rest's leading bits
    return slices, scale


def exact_split_product(a: torch.Tensor, b: torch.Tensor, order: int) -> torch.Tensor:
    """a (..., M, K) @ b (..., N, K)^T from the slice products (i, j) with i + j < ``order``, each exact in fp32
    whatever the BLAS, added smallest first."""
    k = a.shape[-1]
    bits = (MANTISSA - 1 - math.ceil(math.log2(max(k, 2)))) // 2
    count = math.ceil(MANTISSA / bits)
    sa, scale_a = row_slices(a, bits, count)
    sb, scale_b = row_slices(b, bits, count)
    pairs = sorted(((i, j) for i in range(count) for j in range(count) if i + j < order), key=lambda p: -sum(p))
    total = None
    for i, j in pairs:
        part = sa[i] @ sb[j].transpose(-1, -2)
        total = part if total is None else total + part
    return total * scale_a * scale_b.transpose(-1, -2)


def fixed_slices(x: torch.Tensor, bits: int, count: int) -> list[torch.Tensor]:
    """``x`` (|x| < 1) as ``count`` slices on the fixed grid 2^-(bits * (i + 1)): no scale read from the data."""
    rest, slices = x, []
    for i in range(count):
        unit = 2.0 ** (bits * (i + 1))
        piece = torch.round(rest * unit) / unit
        slices.append(piece)
        rest = rest - piece
    return slices


def split_output(probs: torch.Tensor, value: torch.Tensor, order: int) -> torch.Tensor:
    """probs (..., T, L) @ value (..., L, D), each slice product exact, a row's bytes independent of the keys it
    does not see. Each key's value row is taken under its own power of two (so a key's scale never depends on
    another's); each probability is moved onto the largest scale among the keys its row sees (p > 0), which the
    row shares with the same row decoded alone. Slices of ``bits`` for up to KEYS_BOUND keys, fixed."""
    _, key_exponent = torch.frexp(value.abs().amax(-1, keepdim=True))  # (..., L, 1)
    key_exponent = key_exponent.transpose(-1, -2)  # (..., 1, L)
    seen = torch.where(probs > 0, key_exponent, torch.full_like(key_exponent, -(2**30)))
    row_exponent = seen.amax(-1, keepdim=True)  # (..., T, 1)
    moved = torch.ldexp(probs, key_exponent - row_exponent)
    unit_values = torch.ldexp(value, -key_exponent.transpose(-1, -2))  # |.| < 1
    bits = (MANTISSA - 1 - math.ceil(math.log2(KEYS_BOUND))) // 2
    count = math.ceil(MANTISSA / bits)
    sp, scale_p = row_slices(moved, bits, count)
    sv = fixed_slices(unit_values.transpose(-1, -2), bits, count)  # (..., D, L)
    pairs = sorted(((i, j) for i in range(count) for j in range(count) if i + j < order), key=lambda p: -sum(p))
    total = None
    for i, j in pairs:
        part = sp[i] @ sv[j].transpose(-1, -2)
        total = part if total is None else total + part
    return torch.ldexp(total * scale_p, row_exponent)


def split_attention(query, key, value, mask, order: int) -> torch.Tensor:
    """Causal attention (B, H, T, D) over (B, H_kv, L, D) with both products exact splits; (B, T, H, D)."""
    batch, heads, length, dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    q = query.reshape(batch, kv_heads, heads // kv_heads * length, dim)
    scores = exact_split_product(q, key, order).view(batch, kv_heads, heads // kv_heads, length, keys) * dim**-0.5
    if keys < MIN_KEYS:
        mask = F.pad(mask, (0, MIN_KEYS - keys), value=False)
        scores = F.pad(scores, (0, MIN_KEYS - keys))
        value = F.pad(value, (0, 0, 0, MIN_KEYS - keys))
    probs = torch.softmax(scores.masked_fill(~mask[:, :, None], torch.finfo(scores.dtype).min), -1)
    out = split_output(probs.reshape(batch, kv_heads, -1, probs.shape[-1]), value, order)
    return out.view(batch, heads, length, dim).transpose(1, 2)


def causal(batch: int, length: int, keys: int) -> torch.Tensor:
    rows = torch.arange(length)[:, None] + (keys - length)
    return (rows >= torch.arange(keys)[None, :])[None, None].expand(batch, 1, length, keys)


class Causal(nn.Module):
    is_causal = True


def kinds() -> dict:
    module = Causal()
    return {
        "sdpa": lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True).transpose(
            1, 2
        ),
        "invariant": lambda q, k, v, m: invariant_attention(module, q, k, v, m)[0],
        "split, 6 slice products": lambda q, k, v, m: split_attention(q, k, v, m, 3),
        "split, 8 slice products": lambda q, k, v, m: split_attention(q, k, v, m, 4),
    }


def inputs(batch: int, length: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, h, length, 64, generator=g) for h in (9, 3, 3))


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:8]


def hashes() -> dict[str, str]:
    """Each kind's output bytes on a (4, 40) causal batch, in this process's numerics."""
    q, k, v = inputs(4, 40)
    return {name: digest(fn(q, k, v, causal(4, 40, 40))) for name, fn in kinds().items()}


def decoded_equals_full() -> dict[str, bool]:
    q, k, v = inputs(4, 40, seed=1)
    found = {}
    for name, fn in kinds().items():
        full = fn(q, k, v, causal(4, 40, 40))
        steps = [fn(q[:, :, t : t + 1], k[:, :, : t + 1], v[:, :, : t + 1], causal(4, 1, t + 1)) for t in range(40)]
        found[name] = all(torch.equal(step[:, 0], full[:, t]) for t, step in enumerate(steps))
    return found


def errors() -> dict[str, float]:
    q, k, v = inputs(16, 40, seed=2)
    mask = causal(16, 40, 40)
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask, enable_gqa=True)
    exact = exact.transpose(1, 2)
    return {name: (fn(q, k, v, mask).double() - exact).abs().max().item() for name, fn in kinds().items()}


def timings() -> dict[str, dict[str, float]]:
    shapes = {
        "a decoding step: 32 rows, 1 query over 40 keys": (32, 1, 40),
        "PPO's training forward: 16 x 40": (16, 40, 40),
        "a reward-model row: 16 x 88": (16, 88, 88),
    }
    found = {}
    for label, (batch, length, keys) in shapes.items():
        g = torch.Generator().manual_seed(3)
        q = torch.randn(batch, 9, length, 64, generator=g)
        k, v = (torch.randn(batch, 3, keys, 64, generator=g) for _ in range(2))
        mask = causal(batch, length, keys)
        found[label] = {}
        for name, fn in kinds().items():
            fn(q, k, v, mask)
            times = []
            for _ in range(7):
                start = time.perf_counter()
                fn(q, k, v, mask)
                times.append(time.perf_counter() - start)
            found[label][name] = statistics.median(times) * 1000
    return found


def main() -> None:
    if os.environ.get("PROBE_CHILD"):
        print(json.dumps(hashes()))
        return
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common import emit, environment_lines, render_report, render_table

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--output")
    args = parser.parse_args()

    def child(mode: str) -> dict[str, str]:
        pinned = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "ONEDNN_MAX_CPU_ISA")
        env = {k: v for k, v in os.environ.items() if k not in pinned} | {"PROBE_CHILD": "1", "PROBE_NUMERICS": mode}
        done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, check=True)
        return json.loads(done.stdout.strip().splitlines()[-1])

    portable, compatible = child("portable"), child("compatible")
    same_rows, error, cost = decoded_equals_full(), errors(), timings()
    names = list(kinds())
    rows = [
        [
            name,
            "yes" if same_rows[name] else "no",
            "yes" if portable[name] == compatible[name] else "no",
            f"{error[name]:.2e}",
        ]
        for name in names
    ]
    bytes_table = render_table(
        [
            "attention",
            "a decoded row = the full forward's",
            "the same bytes under MKL's COMPATIBLE branch",
            "max |error|",
        ],
        rows,
        args.markdown,
    )
    cost_rows = [[label, *(f"{found[name]:.2f}" for name in names)] for label, found in cost.items()]
    cost_table = render_table(["forward, ms", *names], cost_rows, args.markdown)
    heading = "## " if args.markdown else ""
    body = "\n\n".join(
        [f"{heading}1-2. The same bytes, and the error", bytes_table, f"{heading}3. The forward's time", cost_table]
    )
    notes = [
        "rows decoded: 4 rows x 40 steps, each step one query over the keys so far, against a causal forward over 40",
        "MKL's branch: the same (4, 40) batch in two processes, one pinned portable, one compatible (MKL's "
        "COMPATIBLE branch: every MKL product changes its bytes; docs/numerics.md)",
        "error: against the same attention in float64, on a (16, 40) causal batch of unit normal q, k, v",
        "split: the scores' product over the head dimension (64) and the output's over the keys (at most "
        "KEYS_BOUND = 128), slices of 8 bits, 3 of them; 6 slice products keep pairs i + j < 3, 8 keep i + j < 4. "
        "The output's value rows are each under their own power of two and each probability moved onto the "
        "largest one among the keys its row sees, so no scale depends on a key the row does not see",
        "forward only: training would need the backward's four products split the same way (a custom autograd "
        "function), not written",
    ]
    env = environment_lines("SmolLM2's attention shapes on random tensors")
    title = "Exact split products for attention: the same bytes with BLAS?"
    emit(render_report(title, env, body, notes, args.markdown), args.output)


if __name__ == "__main__":
    main()
