"""Which function computes a model's scaled dot-product attention in this process (``compute.attention``).

- ``sdpa``: torch's ``scaled_dot_product_attention`` (transformers' default). On the CPU its fused kernel
  decodes one token against a KV cache in another order of sums than a forward over the whole sequence,
  so a token's log-probability while sampling and in PPO's training forward differ in the last bits
  (the rollout-trainer gap, ``policy/logprob_gap_max``), and it calls MKL's small products from its
  own parallel loop, where MKL rounds otherwise on Intel and on AMD CPUs (docs/numerics.md).
- ``invariant``: :func:`invariant_attention`, whose two products are exact float64 sums of terms on
  power-of-two grids (:func:`exact_product`): BLAS computes them, but no BLAS, vendor, blocking or thread
  count can change their bytes, and a query row's output does not depend on the other rows or on the
  masked keys that follow it, so decoding with a KV cache and a full forward agree exactly
  (bench/results/logprob_gap_probe.md has what it costs).

:func:`use_attention` installs one of them under transformers' ``sdpa`` name, so every model this
process loads with its default attention uses it, whichever loader made it.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from contextlib import contextmanager

import torch
from torch import Tensor, nn

SDPA = "sdpa"
INVARIANT = "invariant"
ATTENTIONS = (SDPA, INVARIANT)
# torch's softmax sums a row shorter than one vector register (8 floats at AVX2, 16 at AVX-512) in another
# order than a longer row, masked zeros and all: a query decoded over its first few keys would round otherwise
# than in the full forward. Rows are padded with masked keys to at least this many (measured: any row of 8
# keys or more gets the same bytes whatever masked keys follow it; bench/results/logprob_gap_probe.md).
MIN_KEYS = 32
DOUBLE_BITS = 53  # float64's significand: multiples of one power of two add exactly below 2**53 of it
# The output product's grid may not depend on how many keys a call has (a decoding step has fewer than the full
# forward): 23 bits, so every 2**(53 - 2 * 23) = 128 keys make one exact sum; longer rows add their 128-key
# sums in key order.
VALUE_BITS = 23
KEY_BLOCK = 2 ** (DOUBLE_BITS - 2 * VALUE_BITS)
_EXPONENT = 0x7F800000  # a float32's exponent bits
_TINY = 2.0**-100


def _bits(terms: int) -> int:
    """The finest grid (bits per factor) on which ``terms`` products add exactly in float64 (at most float32's
    24): each factor below 2**(e + 1) on the multiples of 2**(1 + e - bits)."""
    return min(24, (DOUBLE_BITS - math.ceil(math.log2(max(terms, 2)))) // 2)


def _row_grid(x: Tensor, bits: int) -> tuple[Tensor, Tensor]:
    """Each row of ``x`` (..., K) rounded to the multiples of 2**(1 + e - bits), 2**e (..., 1) the power of two
    at or below its largest magnitude, as float64 (exact); and 2**e as float32. A row's result depends on that
    row alone. 2**e is the largest magnitude's exponent bits (no pow or exp2, whose vector lanes and scalar tails
    may round otherwise; rows below 2**-100 count as 2**-100); the rounding adds and takes away 1.5 * 2**(53 + e
    - bits), which leaves exactly the grid's bits (round to nearest even)."""
    top = x.abs().amax(-1, keepdim=True).clamp_min(_TINY).view(torch.int32).bitwise_and(_EXPONENT).view(torch.float32)
    shift = top.double() * (1.5 * 2.0 ** (53 - bits))
    return (x.double() + shift) - shift, top


def _bmm(a: Tensor, b: Tensor) -> Tensor:
    """a (..., M, K) @ b (..., K, N) as one bmm over the flattened leading dims (a 4-D matmul would copy a
    transposed operand first)."""
    out = torch.bmm(a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:]))
    return out.reshape(*a.shape[:-2], *out.shape[-2:])


def exact_product(a: Tensor, b: Tensor) -> Tensor:
    r"""``a`` (..., M, K) @ ``b`` (..., K, N) in float32, the same bytes from any BLAS on any CPU or device.

    .. math:: \hat a_{mk} = 2^{\alpha_m - w} \,\mathrm{round}(a_{mk} 2^{w - \alpha_m}), \quad
              \hat b_{kn} = 2^{\beta_n - w} \,\mathrm{round}(b_{kn} 2^{w - \beta_n}), \qquad
              (ab)_{mn} \approx \mathrm{fl}_{32}\big(\textstyle\sum_k \hat a_{mk} \hat b_{kn}\big)

    (rows of a and columns of b each on its own grid of w bits). Every term of one output is a multiple of
    2^{\alpha_m + \beta_n - 2w} below 2^{\alpha_m + \beta_n}, and there are K of them: their float64 sum is
    exact in any order, blocking or thread count, so the one rounding is to float32. Error about 2^-w of the
    largest terms, near float32's own."""
    return _product_with_grid_rows(a, _grid_rows(b.mT)[0])


def _grid_rows(x: Tensor) -> tuple[Tensor]:
    """Each row of ``x`` (..., N, K) on the grid :func:`exact_product` puts a factor's rows or columns of K terms."""
    return (_row_grid(x, _bits(x.shape[-1]))[0],)


def _product_with_grid_rows(a: Tensor, grid_rows: Tensor) -> Tensor:
    """:func:`exact_product` of ``a`` (..., M, K) and the matrix whose columns are ``grid_rows`` (..., N, K),
    already on their grids (:func:`_grid_rows`)."""
    return _bmm(_row_grid(a, _bits(a.shape[-1]))[0], grid_rows.mT).to(a.dtype)


def _value_rows(value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """What :func:`keyed_product` needs of each value row: the row on its grid (float64), 2**e (float32) and
    2**-e (float64), 2**e its power of two (:func:`_row_grid`)."""
    grid, top = _row_grid(value, VALUE_BITS)
    return grid, top, 1.0 / top.double()


def keyed_product(probs: Tensor, value: tuple[Tensor, Tensor, Tensor]) -> Tensor:
    r"""``probs`` (..., T, L) @ the value rows (..., L, D) like :func:`exact_product`, but with no grid that
    depends on a key a row does not see: each value row (a key) takes its own grid, that key's probabilities
    are scaled by the row's power of two before each probability row is put on its own grid, and a masked key
    (probability 0) moves no row's grid. A row decoded against its KV cache so gets its full forward's bytes.

    .. math:: \hat v_{ld} = 2^{\nu_l - w} \,\mathrm{round}(v_{ld} 2^{w - \nu_l}), \quad
              \hat p_{tl} = 2^{-\nu_l}\, 2^{\pi_t - w} \,\mathrm{round}(p_{tl} 2^{\nu_l} 2^{w - \pi_t}), \qquad
              o_{td} \approx \mathrm{fl}_{32}\big(\textstyle\sum_l \hat p_{tl} \hat v_{ld}\big)

    (w = VALUE_BITS, \pi_t the exponent of row t of p 2^\nu): each term a multiple of 2^{\pi_t - 2w}.
    Rows over KEY_BLOCK keys add their blocks' exact sums in order. ``value``: :func:`_value_rows`."""
    grid, top, inverse = value
    folded = probs * top.mT
    out = None
    for start in range(0, probs.shape[-1], KEY_BLOCK):
        end = start + KEY_BLOCK
        block = _bmm(
            _row_grid(folded[..., start:end], VALUE_BITS)[0] * inverse[..., start:end, :].mT, grid[..., start:end, :]
        )
        out = block if out is None else out + block
    return out.to(probs.dtype)


class _ExactProduct(torch.autograd.Function):
    """:func:`exact_product` or, with ``keyed``, :func:`keyed_product`; the gradients are exact products too."""

    @staticmethod
    def forward(ctx, a: Tensor, b: Tensor, keyed: bool) -> Tensor:
        ctx.save_for_backward(a, b)
        return keyed_product(a, _value_rows(b)) if keyed else exact_product(a, b)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        a, b = ctx.saved_tensors
        grad_a = exact_product(grad, b.mT) if ctx.needs_input_grad[0] else None
        grad_b = exact_product(a.mT, grad) if ctx.needs_input_grad[1] else None
        return grad_a, grad_b, None


def _tracks_grad(*tensors: Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


# Decoding runs one query row per step against a KV cache that grows by appending rows: putting all its rows
# on their grids again at every step would cost more than the step's products. Inside decoding(), each
# attention module keeps what it computed of each cache tensor's rows (with the source and its version) and
# computes only the rows a call appends.
_DECODED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_decoding = False


@contextmanager
def decoding():
    """A sampler's promise for the calls inside: each attention module's key and value tensors either extend
    the ones of its previous call by appended rows (a DynamicCache's step) or differ in shape (a new prefill, a
    batch repeated); the invariant attention then computes only the appended rows. They are dropped on exit."""
    global _decoding
    outer, _decoding = _decoding, True
    try:
        yield
    finally:
        _decoding = outer
        if not outer:
            _DECODED.clear()


def _cache_rows(module: nn.Module, x: Tensor, rows: Callable[[Tensor], tuple[Tensor, ...]]) -> tuple[Tensor, ...]:
    """``rows(x)`` for ``x`` (..., L, D), a function whose outputs' row l depends on x's row l alone. Inside
    :func:`decoding`, the rows this module computed for the last ``x`` are reused when the new one extends it,
    so the bytes are those of ``rows(x)``; they live in buffers with room to grow, so a step writes only its
    own. Checked, not assumed: the shapes, the source's version (no in-place write since, as a static cache's)
    and its last row."""
    if not _decoding or x.is_inference():  # an inference tensor has no version counter
        return rows(x)
    memos = _DECODED.setdefault(module, {})
    last, length = memos.get(rows), x.shape[-2]
    if last is not None:
        source, version, parts = last
        seen = source.shape[-2]
        if (
            source._version == version
            and x.shape[:-2] == source.shape[:-2]
            and x.shape[-1] == source.shape[-1]
            and length > seen
            and x.dtype == source.dtype
            and x.device == source.device
            and torch.equal(x[..., seen - 1, :], source[..., -1, :])
        ):
            if length > parts[0].shape[-2]:  # room for as many rows again
                parts = tuple(
                    torch.cat([p[..., :seen, :], p.new_empty(*p.shape[:-2], length, p.shape[-1])], -2) for p in parts
                )
            for part, new in zip(parts, rows(x[..., seen:, :])):
                part[..., seen:length, :] = new
            memos[rows] = (x, x._version, parts)
            return tuple(p[..., :length, :] for p in parts)
    parts = rows(x)
    memos[rows] = (x, x._version, parts)
    return parts


def _scores(module: nn.Module, rows: Tensor, key: Tensor) -> Tensor:
    """rows (..., M, D) @ key (..., L, D)^T by :func:`exact_product`, the key rows cached while decoding."""
    if _tracks_grad(rows, key):
        return _ExactProduct.apply(rows, key.mT, False)
    return _product_with_grid_rows(rows, _cache_rows(module, key, _grid_rows)[0])


def _output(module: nn.Module, probs: Tensor, value: Tensor) -> Tensor:
    """probs (..., M, L) @ value (..., L, D) by :func:`keyed_product`, the value rows cached while decoding."""
    if _tracks_grad(probs, value):
        return _ExactProduct.apply(probs, value, True)
    return keyed_product(probs, _cache_rows(module, value, _value_rows))


def invariant_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    r"""Attention for ``query`` (B, H, T, D) over ``key``, ``value`` (B, H_kv, L, D), H a multiple of H_kv
    (grouped-query attention: query head h reads key head h // (H / H_kv)); returns (B, T, H, D).

    .. math:: s_{tl} = \mathrm{scaling} \sum_d q_{td} k_{ld}, \qquad
              p_{tl} = \mathrm{softmax}_l(s_{tl}\ \text{or the dtype's min where masked}), \qquad
              o_{td} = \sum_l p_{tl} v_{ld}

    Both sums are exact sums in float64 (:func:`exact_product` for the scores, :func:`keyed_product`
    for the output), so BLAS keeps its speed but not its say: every vendor's library, blocking and thread
    count give the same bytes, and so does a row decoded alone against a KV cache and the same row in a
    forward over the whole sequence (a key masked out has probability exactly 0). ``attention_mask``: boolean
    (True: attend) or additive, broadcastable to (B, 1, T, L); None: causal when ``is_causal`` (aligned to the
    last key, as a KV cache's new queries are) and T > 1.
    """
    if kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None:
        raise NotImplementedError("compute.attention: invariant has no attention sinks; use sdpa for this model")
    batch, heads, length, dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    scaling = dim**-0.5 if scaling is None else scaling
    # each key head's G query heads as one (G * T, D) matrix: no repeated keys are made
    rows = query.reshape(batch, kv_heads, groups * length, dim)
    scores = (_scores(module, rows, key) * scaling).reshape(batch, kv_heads, groups, length, keys)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    if attention_mask is None and causal and length > 1:
        positions = torch.arange(length, device=query.device)[:, None] + (keys - length)
        attention_mask = positions >= torch.arange(keys, device=query.device)[None, :]
    if keys < MIN_KEYS:  # masked keys up to MIN_KEYS: every row's softmax is summed by the vector loop
        if attention_mask is None:
            attention_mask = torch.ones(length, keys, dtype=torch.bool, device=query.device)
        masked = False if attention_mask.dtype == torch.bool else torch.finfo(scores.dtype).min
        attention_mask = nn.functional.pad(attention_mask, (0, MIN_KEYS - keys), value=masked)
        scores = nn.functional.pad(scores, (0, MIN_KEYS - keys))
        keys = MIN_KEYS
    if attention_mask is not None:
        if attention_mask.dim() == 2:  # (T, L), for every row and head
            attention_mask = attention_mask[None, None]
        mask = attention_mask[:, :, None]  # (B, 1 or H, 1, T, L) against (B, H_kv, G, T, L)
        if mask.shape[1] == heads and heads != kv_heads:
            mask = mask.reshape(mask.shape[0], kv_heads, groups, length, keys)
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + mask
    probs = torch.softmax(scores, dim=-1)
    if dropout > 0.0 and module.training:
        probs = nn.functional.dropout(probs, p=dropout, training=True)
    probs = probs.reshape(batch, kv_heads, groups * length, keys)
    if probs.shape[-1] > value.shape[-2]:  # the padding keys: probability 0, any value; 0 keeps the cache's rows
        probs = probs[..., : value.shape[-2]]
    out = _output(module, probs, value)
    return out.reshape(batch, heads, length, dim).transpose(1, 2).contiguous(), None


def use_attention(kind: str) -> None:
    """Make ``kind`` (:data:`ATTENTIONS`) the attention of every model this process runs with transformers'
    default (``sdpa``) implementation: its masks stay sdpa's, so callers that build their own boolean masks
    (the reward model's packed best-of-N rows) are unchanged."""
    from transformers import AttentionInterface  # seconds to import: only where a model runs
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if kind not in ATTENTIONS:
        raise ValueError(f"attention {kind!r}: one of {', '.join(ATTENTIONS)}")
    AttentionInterface.register(SDPA, invariant_attention if kind == INVARIANT else sdpa_attention_forward)


def attention_in_use() -> str:
    """Which of :data:`ATTENTIONS` transformers' ``sdpa`` name runs in this process."""
    from transformers import AttentionInterface  # as in use_attention

    return INVARIANT if AttentionInterface()[SDPA] is invariant_attention else SDPA
