"""compute.attention: the invariant attention computes what torch's sdpa computes, and gives a row the same bytes
whatever else is in the call (decoding with a KV cache against a full forward, threads, MKL's branch)."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import get_args

import pytest
import torch
from torch import nn

from rlhf_pipeline import attention
from rlhf_pipeline.attention import invariant_attention, use_attention
from rlhf_pipeline.params.compute import ComputeParams

F = nn.functional


class Causal(nn.Module):
    is_causal = True


def tensors(batch=3, heads=6, kv_heads=2, length=7, dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, length, dim, generator=g)
    k = torch.randn(batch, kv_heads, length, dim, generator=g)
    v = torch.randn(batch, kv_heads, length, dim, generator=g)
    return q, k, v


def padded_causal(batch: int, length: int, pads: list[int]) -> torch.Tensor:
    """(B, 1, T, T) boolean: causal, and each row's first ``pads[b]`` keys (left padding) masked."""
    keys = torch.arange(length)
    mask = torch.tril(torch.ones(length, length, dtype=torch.bool))[None, None].repeat(batch, 1, 1, 1)
    for b, pad in enumerate(pads):
        mask[b, :, :, keys < pad] = False
        mask[b, :, keys < pad, pad] = True  # a padded query row attends somewhere, as transformers' masks do
    return mask


def test_it_computes_torch_s_attention_for_every_mask_form():
    q, k, v = tensors()
    module = Causal()
    reference = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2)
    for mask in (None, torch.tril(torch.ones(7, 7, dtype=torch.bool))):
        out, weights = invariant_attention(module, q, k, v, mask)
        assert weights is None and out.shape == (3, 7, 6, 8)
        torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5)
    boolean = padded_causal(3, 7, [0, 2, 4])
    additive = torch.zeros(boolean.shape).masked_fill(~boolean, torch.finfo(torch.float32).min)
    reference = F.scaled_dot_product_attention(q, k, v, attn_mask=boolean, enable_gqa=True).transpose(1, 2)
    for mask in (boolean, additive):
        torch.testing.assert_close(invariant_attention(module, q, k, v, mask)[0], reference, atol=1e-5, rtol=1e-5)
    scaled = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3, enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(invariant_attention(module, q, k, v, None, scaling=0.3)[0], scaled, atol=1e-5, rtol=1e-5)


def test_a_row_decoded_against_a_cache_is_the_same_bytes_as_in_the_full_forward():
    """Step t of decoding: one query over the t + 1 keys so far; the full forward: every query over all T keys
    under the causal mask. Each row's output is the same bytes, left padding included; torch's sdpa kernel
    gives other bytes for some row on these shapes (so this test can see a difference)."""
    pads = [0, 3, 5, 11]
    q, k, v = tensors(batch=4, heads=9, kv_heads=3, length=40, dim=64, seed=1)
    mask = padded_causal(4, 40, pads)
    module = Causal()
    full = invariant_attention(module, q, k, v, mask)[0]
    sdpa_full = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True).transpose(1, 2)
    sdpa_differs = False
    for t in range(40):  # rows of 1 to 40 keys: shorter and longer than a vector register and than MIN_KEYS
        step_mask = mask[:, :, t : t + 1, : t + 1]
        step = invariant_attention(module, q[:, :, t : t + 1], k[:, :, : t + 1], v[:, :, : t + 1], step_mask)[0]
        real = [b for b, pad in enumerate(pads) if t >= pad]  # a padding position's own row is never read
        assert torch.equal(step[real, 0], full[real, t]), f"row {t}"
        sdpa_step = F.scaled_dot_product_attention(
            q[:, :, t : t + 1], k[:, :, : t + 1], v[:, :, : t + 1], attn_mask=step_mask, enable_gqa=True
        ).transpose(1, 2)
        sdpa_differs |= not torch.equal(sdpa_step[:, 0], sdpa_full[:, t])
    assert sdpa_differs


def test_a_row_is_the_same_bytes_in_any_batch_and_on_any_thread_count():
    q, k, v = tensors(batch=8, heads=9, kv_heads=3, length=16, dim=64, seed=2)
    module, threads = Causal(), torch.get_num_threads()
    whole = invariant_attention(module, q, k, v, None)[0]
    try:
        torch.set_num_threads(1)
        alone = invariant_attention(module, q[5:6], k[5:6], v[5:6], None)[0]
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone[0], whole[5])


def test_the_tensors_it_trains_get_torch_s_gradients():
    q, k, v = (t.requires_grad_() for t in tensors(seed=3))
    invariant_attention(Causal(), q, k, v, None)[0].square().sum().backward()
    ours = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).square().sum().backward()
    for mine, theirs in zip(ours, (q.grad, k.grad, v.grad)):
        torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4)


def test_its_products_are_exact_sums_whatever_the_order_or_the_blocking():
    """exact_product's float64 sums are exact: a product split by rows and by columns, and the same grid values
    summed elementwise in reverse order, give the same bytes; within float32's error bound of the float64
    product."""
    g = torch.Generator().manual_seed(4)
    a, b = torch.randn(5, 40, 64, generator=g), torch.randn(5, 64, 24, generator=g) * 1e3
    whole = attention.exact_product(a, b)
    assert torch.equal(torch.cat([attention.exact_product(a[:, i : i + 8], b) for i in range(0, 40, 8)], 1), whole)
    assert torch.equal(attention.exact_product(a, b[..., 7:9]), whole[..., 7:9])
    bits = attention._bits(64)
    rows, columns = attention._row_grid(a, bits)[0], attention._row_grid(b.mT, bits)[0]
    reversed_sum = (rows.flip(-1)[:, :, None, :] * columns.flip(-1)[:, None, :, :]).sum(-1, dtype=torch.float64)
    assert torch.equal(reversed_sum.float(), whole)
    error = (whole.double() - a.double() @ b.double()).abs()
    assert (error <= 2.0**-21 * (a.double().abs() @ b.double().abs())).all()  # within float32's worst case (K * 2**-24)


def test_decoding_converts_only_the_new_cache_rows_and_gets_the_same_bytes():
    """Inside decoding(), a module's KV cache rows are kept and only appended rows converted; each step's
    output is the bytes of a call outside it. A cache written over in place (a static cache) is converted again,
    and the kept rows go when the block ends."""
    q, k, v = tensors(batch=4, heads=9, kv_heads=3, length=48, dim=64, seed=5)
    module = Causal()
    with torch.no_grad():
        plain = [
            invariant_attention(module, q[:, :, t : t + 1], k[:, :, : t + 1], v[:, :, : t + 1], None)[0]
            for t in range(30, 48)
        ]
        converted = []
        real = attention._row_grid
        try:
            attention._row_grid = lambda x, bits: (converted.append(x.shape[-2]), real(x, bits))[1]
            with attention.decoding():
                cached = [
                    invariant_attention(
                        module, q[:, :, t : t + 1], k[:, :, : t + 1].clone(), v[:, :, : t + 1].clone(), None
                    )[0]
                    for t in range(30, 48)
                ]
                assert module in attention._DECODED
                static_k, static_v = k[:, :, :40].clone(), v[:, :, :40].clone()
                first = invariant_attention(module, q[:, :, 39:40], static_k, static_v, None)[0]
                static_k[:, :, 39] += 1.0  # written over in place, as a static cache's step writes
                again = invariant_attention(module, q[:, :, 39:40], static_k, static_v, None)[0]
            assert module not in attention._DECODED
        finally:
            attention._row_grid = real
    assert all(torch.equal(a, b) for a, b in zip(plain, cached))
    # the first call converts its 31 key and value rows, and its 3 query and probability rows (9 heads over 3);
    # each later one a key and a value row (and its own 3 and 3)
    assert converted[:4] == [31, 3, 31, 3] and set(converted[4 : 4 * 18]) == {1, 3}
    assert not torch.equal(first, again)
    moved = invariant_attention(module, q[:, :, 39:40], static_k, static_v, None)[0]
    assert torch.equal(again, moved)


MKL_PROBE = r"""
import json, os, sys
from rlhf_pipeline import numerics
numerics.pin(sys.argv[1], 2)
import torch
from torch import nn
from rlhf_pipeline.attention import invariant_attention
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(4, 9 if i == 0 else 3, 40, 64, generator=g) for i in range(3))
class M(nn.Module):
    is_causal = True
ours = invariant_attention(M(), q, k, v, None)[0]
theirs = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
print(json.dumps({"invariant": ours.flatten().tolist()[::97], "sdpa": theirs.flatten().tolist()[::97]}))
"""


def test_no_mkl_product_is_in_it():
    """MKL's COMPATIBLE branch changes every MKL product's bytes (compute.cpu_numerics: compatible against
    portable, docs/numerics.md); it leaves the invariant attention's unchanged, so no vendor's BLAS decides
    them. torch's sdpa kernel, which calls MKL, changes: the check can see a difference."""

    def run(mode: str) -> dict:
        done = subprocess.run([sys.executable, "-c", MKL_PROBE, mode], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    portable, compatible = run("portable"), run("compatible")
    assert portable["invariant"] == compatible["invariant"]
    assert portable["sdpa"] != compatible["sdpa"]


def test_use_attention_installs_it_under_sdpa_and_the_schema_names_the_same_choices(tiny_base_dir):
    from rlhf_pipeline.models import load_causal_lm

    field = ComputeParams.model_fields["attention"]
    assert get_args(field.annotation) == attention.ATTENTIONS and field.default == attention.SDPA
    model = load_causal_lm(tiny_base_dir).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    try:
        use_attention(attention.INVARIANT)
        assert attention.attention_in_use() == attention.INVARIANT
        with torch.no_grad():
            ours = model(input_ids=ids).logits
    finally:
        use_attention(attention.SDPA)
    assert attention.attention_in_use() == attention.SDPA
    with torch.no_grad():
        theirs = model(input_ids=ids).logits
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="sdpa, invariant"):
        use_attention("flash")
