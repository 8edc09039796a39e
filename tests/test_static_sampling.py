"""The static-cache sampler (rlhf_pipeline/static_sampling.py) samples what the eager one does: the
same token ids get the same logprobs, on the CPU here (its uncompiled path; CUDA with graphs where a
GPU runs the suite)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from conftest import sampling_request
from families import FAMILIES, tiny_causal_lm

from rlhf_pipeline.decoding import position_ids_from_mask
from rlhf_pipeline.models import load_causal_lm
from rlhf_pipeline.sampling import response_outputs, sample_responses
from rlhf_pipeline.static_sampling import (
    _caches,
    batch_to_run,
    sample_responses_static,
    static_cache,
    supports_static,
)

PAD = 0


def left_padded_queries(vocab: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Six queries of 3 to 8 real tokens, left-padded to 8 (no pad id among the real ones)."""
    rows = []
    for length in (8, 3, 5, 8, 6, 4):
        real = torch.randint(1, vocab, (length,), generator=generator)
        rows.append(torch.cat([torch.full((8 - length,), PAD), real]))
    queries = torch.stack(rows)
    return queries, queries != PAD


def devices() -> list[str]:
    return ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("num_samples, stop_at_eos", [(1, False), (3, True)])
def test_the_static_sampler_s_logprobs_are_the_model_s_for_its_tokens(tiny_base_dir, device, num_samples, stop_at_eos):
    """Teacher-forced through a plain forward (``response_outputs``, the path PPO trains on), the
    tokens the static sampler drew get the logprobs it reported: the cache, its mask and the
    positions are the model's own."""
    model = load_causal_lm(tiny_base_dir, device).eval()
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else PAD
    queries, mask = left_padded_queries(model.config.vocab_size, torch.Generator().manual_seed(0))
    queries = torch.where(mask, queries, torch.full_like(queries, pad)).to(device)
    mask = mask.to(device)
    generator = torch.Generator(device=device).manual_seed(1)
    asked = {"eos_token_id": 5, "stop_at_eos": stop_at_eos, "num_samples": num_samples}
    out = sample_responses_static(model, sampling_request(queries, mask, 12, 0.7, pad, generator, **asked))
    assert out.responses.shape == (len(queries) * num_samples, 12)
    joined = torch.cat([queries.repeat_interleave(num_samples, 0), out.responses], 1)
    forced = response_outputs(model, joined, joined != pad, queries.shape[1], 0.7, pad)
    tolerance = 1e-4 if device == "cpu" else 2e-2  # fp32 here; bf16-level where a GPU compiles it
    torch.testing.assert_close(out.logprobs * out.mask, forced.logprobs * out.mask, atol=tolerance, rtol=0)


def test_the_static_and_eager_samplers_draw_the_same_tokens_from_one_generator(tiny_base_dir):
    """One uniform per row and step from the same generator, the same inverse-CDF draw, logits equal
    up to rounding: the same responses, but for a draw that lands within rounding of a token's
    boundary (none is expected in 6 x 2 x 16 draws; a handful would still pass)."""
    model = load_causal_lm(tiny_base_dir).eval()
    pad = model.config.pad_token_id
    queries, mask = left_padded_queries(model.config.vocab_size, torch.Generator().manual_seed(2))
    queries = torch.where(mask, queries, torch.full_like(queries, pad))
    eager = sample_responses(
        model, sampling_request(queries, mask, 16, 0.7, pad, torch.Generator().manual_seed(3), num_samples=2)
    )
    static = sample_responses_static(
        model, sampling_request(queries, mask, 16, 0.7, pad, torch.Generator().manual_seed(3), num_samples=2)
    )
    agreement = (eager.responses == static.responses).float().mean().item()
    assert agreement >= 0.95, agreement
    same = eager.responses == static.responses
    torch.testing.assert_close(static.logprobs[same], eager.logprobs[same], atol=1e-4, rtol=0)


def test_the_static_path_applies_only_where_nothing_else_is_asked():
    queries = torch.ones(2, 3, dtype=torch.long)
    asked = dict(queries=queries, query_mask=queries.bool(), response_length=4, temperature=0.7, pad_token_id=0)
    assert supports_static(sampling_request(**asked))
    assert not supports_static(sampling_request(**asked, capture_layers=(3,)))  # the trunk split's captured layer
    assert not supports_static(sampling_request(**asked, process_share=(1, 2)))  # a share sampled by several processes
    assert not supports_static(sampling_request(**asked, uniforms=torch.rand(2, 4)))  # draws given from outside


@pytest.mark.parametrize("device", devices())
def test_the_static_sampler_s_values_are_the_value_head_s_on_each_state(tiny_base_dir, device):
    """PPO's shared layout: the value of the state before each response token, as the eager
    sampler computes it (the value head on the final hidden state of the last fed token)."""
    model = load_causal_lm(tiny_base_dir, device).eval()
    pad = model.config.pad_token_id
    torch.manual_seed(6)
    value_head = torch.nn.Linear(model.config.hidden_size, 1).to(device)
    queries, mask = left_padded_queries(model.config.vocab_size, torch.Generator().manual_seed(7))
    queries = torch.where(mask, queries, torch.full_like(queries, pad)).to(device)
    mask = mask.to(device)
    draws = torch.Generator(device=device).manual_seed(8)
    out = sample_responses_static(model, sampling_request(queries, mask, 10, 0.7, pad, draws, value_head=value_head))
    joined = torch.cat([queries, out.responses], 1)
    real = joined != pad
    hidden = model.model(input_ids=joined, attention_mask=real, position_ids=position_ids_from_mask(real))
    hidden = hidden.last_hidden_state  # the final, normed state
    expected = value_head(hidden[:, queries.shape[1] - 1 : -1]).squeeze(-1)
    tolerance = 1e-4 if device == "cpu" else 2e-2
    torch.testing.assert_close(out.values, expected, atol=tolerance, rtol=0)


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_every_family_s_static_cache_gives_the_model_s_logprobs(model_type):
    """The same teacher-forced check on a tiny model of each family the pipeline supports, sliding
    windows (Mistral, Gemma 2/3: 8 tokens here, shorter than query + response) and learned absolute
    positions (GPT-2, OPT) included."""
    model = tiny_causal_lm(model_type)
    pad = 0
    queries, mask = left_padded_queries(model.config.vocab_size, torch.Generator().manual_seed(4))
    request = sampling_request(queries, mask, 12, 0.7, pad, torch.Generator().manual_seed(5), num_samples=2)
    out = sample_responses_static(model, request)
    joined = torch.cat([queries.repeat_interleave(2, 0), out.responses], 1)
    forced = response_outputs(model, joined, joined != pad, queries.shape[1], 0.7, pad)
    torch.testing.assert_close(out.logprobs, forced.logprobs, atol=1e-4, rtol=0)


def test_a_model_s_static_cache_goes_with_the_model():
    """The sampler keeps a model's cache for its next call, and no longer than the model lives: a cache
    kept under ``id(model)`` outlived it, and the next model CPython placed at the freed address (a
    GPT-2 after a Gemma 3 here, in CI) was handed a sliding-window cache its attention did not fit."""
    model = tiny_causal_lm("gemma3_text")
    cache = static_cache(model, 6, 20, None)
    assert static_cache(model, 6, 20, None) is cache  # reused while the model lives
    assert static_cache(tiny_causal_lm("gpt2"), 6, 20, None) is not cache
    gone = weakref.ref(cache)
    del model, cache
    gc.collect()
    assert gone() is None


def test_a_smaller_batch_runs_in_a_shape_already_held_and_gets_its_own_draws(tiny_base_dir):
    """Where shapes are reused (a compiled step: one graph per batch shape), a call of fewer rows
    runs in the cache of a larger batch already held, and its rows get what they get alone: the
    filler rows draw nothing from the generator, so the draws are the same uniforms."""
    model = load_causal_lm(tiny_base_dir).eval()
    pad = model.config.pad_token_id
    queries, mask = left_padded_queries(model.config.vocab_size, torch.Generator().manual_seed(9))
    queries = torch.where(mask, queries, torch.full_like(queries, pad))
    sample_responses_static(
        model, sampling_request(queries, mask, 10, 0.7, pad, torch.Generator().manual_seed(1), num_samples=2)
    )
    held = set(_caches[model])
    assert batch_to_run(model, 4, queries.shape[1] + 10, None) == 12
    assert batch_to_run(model, 13, queries.shape[1] + 10, None) == 13  # no cache has room
    assert batch_to_run(model, 4, queries.shape[1] + 11, None) == 4  # nor one of other slots
    small_q, small_m = queries[1:3], mask[1:3]
    small = {"response_length": 10, "temperature": 0.7, "pad_token_id": pad, "num_samples": 2}
    reused = sample_responses_static(
        model,
        sampling_request(small_q, small_m, generator=torch.Generator().manual_seed(3), **small),
        reuse_shapes=True,
    )
    assert set(_caches[model]) == held  # ran in the 12-row cache, no new shape
    alone = sample_responses_static(
        model,
        sampling_request(small_q, small_m, generator=torch.Generator().manual_seed(3), **small),
        reuse_shapes=False,
    )
    assert (4, queries.shape[1] + 10, None) in _caches[model]  # without reuse, a shape of its own
    assert reused.responses.shape == alone.responses.shape == (4, 10)
    same = reused.responses == alone.responses
    assert same.float().mean().item() >= 0.95
    torch.testing.assert_close(reused.logprobs[same], alone.logprobs[same], atol=1e-4, rtol=0)
