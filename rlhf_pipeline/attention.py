"""Which function computes a model's scaled dot-product attention in this process (``compute.attention``).

- ``sdpa``: torch's ``scaled_dot_product_attention`` (transformers' default). On the CPU its fused kernel
  decodes one token against a KV cache in another order of sums than a forward over the whole sequence,
  so a token's log-probability while sampling and in PPO's training forward differ in the last bits
  (the rollout-trainer gap, ``policy/logprob_gap_max``), and it calls MKL's small products from its
  own parallel loop, where MKL rounds otherwise on Intel and on AMD CPUs (docs/numerics.md).
- ``invariant``: :func:`invariant_attention`, written with torch's own elementwise products, sums and
  softmax, no BLAS: each query row's output is the same bytes whatever the other rows are, how many
  keys follow it under the mask, or how many threads run it, so decoding with a KV cache and a full
  forward agree exactly; slower (bench/results/logprob_gap_probe.md).

:func:`use_attention` installs one of them under transformers' ``sdpa`` name, so every model this
process loads with its default attention uses it, whichever loader made it.
"""

from __future__ import annotations

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

    Each sum is one of torch's reductions over a tensor that holds only that row's terms: the score's
    over the head dimension (contiguous), the output's over the keys in their order. A key masked out
    has probability exactly 0, so the keys that follow a row under a causal mask add exact zeros: a row
    decoded alone against a KV cache and the same row in a forward over the whole sequence get the same
    bytes. ``attention_mask``: boolean (True: attend) or additive, broadcastable to (B, 1, T, L); None:
    causal when ``is_causal`` (aligned to the last key, as a KV cache's new queries are) and T > 1.
    """
    if kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None:
        raise NotImplementedError("compute.attention: invariant has no attention sinks; use sdpa for this model")
    batch, heads, length, dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    scaling = dim**-0.5 if scaling is None else scaling
    # (B, H_kv, G, T, 1, D) x (B, H_kv, 1, 1, L, D) -> (B, H_kv, G, T, L): no repeated keys are made
    scores = (query.reshape(batch, kv_heads, groups, length, 1, dim) * key[:, :, None, None]).sum(-1) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    if attention_mask is None and causal and length > 1:
        rows = torch.arange(length, device=query.device)[:, None] + (keys - length)
        attention_mask = rows >= torch.arange(keys, device=query.device)[None, :]
    if keys < MIN_KEYS:  # masked keys up to MIN_KEYS: every row's softmax is summed by the vector loop
        if attention_mask is None:
            attention_mask = torch.ones(length, keys, dtype=torch.bool, device=query.device)
        masked = False if attention_mask.dtype == torch.bool else torch.finfo(scores.dtype).min
        attention_mask = nn.functional.pad(attention_mask, (0, MIN_KEYS - keys), value=masked)
        scores = nn.functional.pad(scores, (0, MIN_KEYS - keys))
        value = nn.functional.pad(value, (0, 0, 0, MIN_KEYS - keys))
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
    # (B, H_kv, G, T, L, 1) x (B, H_kv, 1, 1, L, D) summed over L -> (B, H_kv, G, T, D)
    out = (probs.unsqueeze(-1) * value[:, :, None, None]).sum(-2)
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

    return INVARIANT if AttentionInterface._global_mapping.get(SDPA) is invariant_attention else SDPA
