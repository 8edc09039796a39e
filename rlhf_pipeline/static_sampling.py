"""A sampler for GPUs: the same draws as :func:`rlhf_pipeline.sampling.sample_responses`, decoded
over a static KV cache so that one decoding step is a fixed-shape graph that ``torch.compile``
(CUDA graphs, ``mode="reduce-overhead"``) replays instead of launching each kernel from Python.

Why. Eager token-by-token decoding of a small model on a GPU is bound by kernel launches, not by
the GPU (two fifths of a PPO update at batch 128, ``bench/results/ppo_throughput_h100_b128.md``). A
static cache holds every key and value slot the sampling will need from the start, so the step's
shapes never change and its graph is captured once per batch shape.

Same distribution. Each step draws its token with :func:`~rlhf_pipeline.decoding.sample_from_logits`
(the same inverse-CDF draw, one uniform per row from the caller's generator), from the logits of the
same model at the same positions: only the attention's arithmetic differs (a masked static cache
instead of a growing one), so the same token ids get the same logprobs within the precision the
model runs in (``tests/test_static_sampling.py``). It computes PPO's values too (the shared layout's
value head on each step's final hidden state). What it does not do: capture the hidden states the
trunk split reuses, or sample a share of a batch for one of several processes
(:func:`supports_static` says when this path applies).

:func:`rlhf_pipeline.sampling.sample_on_device` picks it on CUDA, unless the device plan's sampler
(``compute.cuda_sampler``) is ``eager``; on a CPU nothing is compiled and the eager sampler stays the
sampler: the graphs pay only where launches cost (``bench/sampling_throughput.py`` measures both
against ``generate``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch import Tensor, nn

from rlhf_pipeline.decoding import DecodedTokens, SampleOutput, SamplingRequest, position_ids_from_mask
from rlhf_pipeline.models import backbone_of


def supports_static(request: SamplingRequest) -> bool:
    """True when ``request`` asks nothing this sampler does not do: its own draws from the generator
    (not given ``uniforms``), no captured layers (the trunk split), one process (several processes
    sample shares of a batch, and FSDP shards the weights between forwards: the compiled step would
    see neither)."""
    return request.uniforms is None and not tuple(request.capture_layers) and request.process_share == (0, 1)


def decode_step(model: nn.Module, cache, token: Tensor, position: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """One decoding step over a static cache: the final hidden state (B, H) and the fp32 logits
    (B, V) after feeding ``token`` (B,) at ``position`` (B,), ``mask`` (B, L) marking the cache
    slots that hold real tokens. Every argument keeps its shape from step to step: the function
    ``torch.compile`` captures."""
    out = backbone_of(model)(
        input_ids=token[:, None], attention_mask=mask, position_ids=position[:, None], cache=cache, use_cache=True
    )
    hidden = out.last_hidden_state[:, -1]
    return hidden, model.get_output_embeddings()(hidden).float()


# Both caches are keyed by the model object itself, weakly: an entry goes when its model does. A key of
# id(model) outlived its model, and a later model given the same id (CPython reuses the addresses of
# freed objects) was handed the other model's cache, whose layers (a sliding window, another depth)
# need not fit it.
_compiled: weakref.WeakKeyDictionary[nn.Module, Callable] = weakref.WeakKeyDictionary()
# one cache per (model, batch, length, dtype), zeroed between calls: CUDA graphs replay on fixed
# addresses, so a new cache each call would make every call record its graph again
_caches: weakref.WeakKeyDictionary[nn.Module, dict[tuple[int, int, torch.dtype | None], object]] = (
    weakref.WeakKeyDictionary()
)


def static_cache(model: nn.Module, batch: int, length: int, dtype: torch.dtype | None):
    """A zeroed static cache of ``length`` slots for ``batch`` rows of ``model`` (kept for reuse
    while ``model`` lives)."""
    from transformers import StaticCache

    caches = _caches.setdefault(model, {})
    key = (batch, length, dtype)
    if key not in caches:
        caches[key] = StaticCache(config=model.config, max_cache_len=length)
    cache = caches[key]
    cache.reset()
    return cache


def batch_to_run(model: nn.Module, rows: int, length: int, dtype: torch.dtype | None) -> int:
    """The rows a call of ``rows`` rows runs when shapes are reused: the smallest batch of a cache
    ``model`` already holds for ``length`` slots and ``dtype`` that has room for ``rows``, else
    ``rows``. The compiled step records one graph per batch shape, tens of seconds each on a GPU, while
    running a few rows in a larger shape costs a fraction of a second: the ``gpu`` profile's preferences
    stage paused twice for about 30 s at batches whose resampled queries made smaller calls than its 512
    rows (docs/gpu.md)."""
    held = [b for b, slots, kind in _caches.get(model, {}) if slots == length and kind == dtype and b >= rows]
    return min(held, default=rows)


def compiled_step(model: nn.Module) -> Callable:
    """``decode_step`` compiled with CUDA graphs for ``model`` (one compilation per model object,
    reused by every later call: PPO samples many batches of one shape from one policy)."""
    if model not in _compiled:
        _compiled[model] = torch.compile(decode_step, mode="reduce-overhead", fullgraph=False, dynamic=False)
    return _compiled[model]


@torch.no_grad()
def sample_responses_static(
    model: nn.Module, request: SamplingRequest, compile: bool | None = None, reuse_shapes: bool | None = None
) -> SampleOutput:
    """:func:`~rlhf_pipeline.sampling.sample_responses` (without captured layers, on one process, with
    the generator's draws: :func:`supports_static`) over a static cache of ``Q + response_length`` slots.
    The queries are repeated ``num_samples`` times before the prefill (a static cache has one batch
    size), so row ``i * num_samples + k`` is sample ``k`` of query ``i``, as in the eager sampler.
    ``compile``: compile the decoding step (None: on CUDA only). ``reuse_shapes`` (None: where the step
    is compiled): run a smaller batch in the shape of a cache already held (:func:`batch_to_run`), its
    extra rows copies of the first; nothing is drawn for them, so the real rows get the draws they get
    alone."""
    if not supports_static(request):
        raise ValueError(
            "sample_responses_static: captured layers, a process share and given draws are the eager sampler's"
        )
    device, response_length, num_samples = request.queries.device, request.response_length, request.num_samples
    compile = device.type == "cuda" if compile is None else compile
    reuse_shapes = compile if reuse_shapes is None else reuse_shapes
    queries = request.queries.repeat_interleave(num_samples, 0)
    query_mask = request.query_mask.repeat_interleave(num_samples, 0).to(torch.long)
    rows, query_length = queries.shape
    dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None
    batch = batch_to_run(model, rows, query_length + response_length, dtype) if reuse_shapes else rows
    filler = batch - rows
    if filler:
        queries = torch.cat([queries, queries[:1].expand(filler, -1)])
        query_mask = torch.cat([query_mask, query_mask[:1].expand(filler, -1)])
    # every slot the sampling will fill, real from the start (causality hides the future ones);
    # the left padding of the queries stays masked
    mask = torch.cat([query_mask, torch.ones(batch, response_length, dtype=torch.long, device=device)], 1)
    cache = static_cache(model, batch, query_length + response_length, dtype)
    prefill = backbone_of(model)(
        input_ids=queries,
        attention_mask=mask,
        position_ids=position_ids_from_mask(query_mask),
        cache=cache,
        use_cache=True,
    )
    hidden = prefill.last_hidden_state[:, -1]
    logits = model.get_output_embeddings()(hidden).float()
    step = compiled_step(model) if compile else decode_step
    position = query_mask.sum(-1)
    decoded = DecodedTokens(request, rows, device)
    for t in range(response_length):
        token = decoded.take(t, decoded.scaled(logits[:rows]), hidden[:rows])
        if t == response_length - 1:
            break
        fed = torch.cat([token, token[:1].expand(filler)]) if filler else token
        hidden, logits = (x.clone() for x in step(model, cache, fed, position, mask))  # graphs reuse outputs
        position = position + 1
    return decoded.output()
