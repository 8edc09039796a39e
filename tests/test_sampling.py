"""sample_from_logits: the two-level inverse-CDF sampler behind every decoding step."""

from __future__ import annotations

import pytest
import torch
from conftest import sampling_request

from rlhf_pipeline.decoding import sample_from_logits


def test_frequencies_match_softmax_across_blocks_and_tail():
    """V=10 with blocks of 4 (two full blocks and a tail of 2): empirical frequencies of 60k draws
    are within 4 standard errors of softmax; zero-probability tokens (one mid-block, the very last)
    are never drawn."""
    logits = torch.tensor([0.0, 1.0, -1e9, 2.0, -0.5, 0.3, 1.5, -2.0, 0.7, -1e9])
    probs = torch.softmax(logits, -1)
    draws = 60_000
    tokens, _ = sample_from_logits(
        logits.expand(draws, -1).contiguous(), torch.Generator().manual_seed(0), block_size=4
    )
    counts = torch.bincount(tokens, minlength=10).double()
    assert counts[2] == 0 and counts[9] == 0
    freq = counts / draws
    stderr = (probs.double() * (1 - probs.double()) / draws).sqrt()
    assert ((freq - probs.double()).abs() <= 4 * stderr + 1e-12).all(), (freq, probs)


def test_logprob_is_log_softmax_of_the_drawn_token():
    logits = torch.randn(32, 1000, generator=torch.Generator().manual_seed(1)) * 4
    tokens, logprobs = sample_from_logits(logits, torch.Generator().manual_seed(2))
    expected = torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1)
    torch.testing.assert_close(logprobs, expected, atol=1e-5, rtol=1e-5)


def test_seeded_and_certain_draws():
    logits = torch.randn(8, 700, generator=torch.Generator().manual_seed(3))
    first, _ = sample_from_logits(logits, torch.Generator().manual_seed(7))
    again, _ = sample_from_logits(logits, torch.Generator().manual_seed(7))
    assert torch.equal(first, again)
    # a (numerically) one-hot row picks its token, also when it is the last id of a partial block
    certain = torch.full((3, 700), -1e9)
    certain[0, 0] = certain[1, 300] = certain[2, 699] = 0.0
    tokens, logprobs = sample_from_logits(certain, torch.Generator().manual_seed(0))
    assert tokens.tolist() == [0, 300, 699]
    assert torch.allclose(logprobs, torch.zeros(3))


@pytest.mark.parametrize(
    ("batch", "vocab", "sum_bytes", "reductions"),
    [(37, 49_153, 2**21, 8), (9, 1000, 2**13, 9), (5, 512, 1, 5), (3, 100, 2**21, 1)],
)
def test_the_draw_is_the_padded_single_reduction_draw(monkeypatch, batch, vocab, sum_bytes, reductions):
    """The weights written into the block layout and the float64 block sums made a few rows at a time (on
    a CPU) give the very bytes of padding a (B, V) copy and summing it in one call: the same tokens and
    logprobs. Cases: SmolLM2's vocabulary over row chunks that do not divide the batch; a vocabulary split
    into blocks with a partial one; one row a chunk; a vocabulary under one block."""
    from rlhf_pipeline import decoding

    monkeypatch.setattr(decoding, "FLOAT64_SUM_BYTES", sum_bytes)
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(vocab)) * 3
    num_blocks = -(-vocab // 256)
    weights = (logits - logits.amax(-1, keepdim=True)).exp()
    blocks = torch.nn.functional.pad(weights, (0, num_blocks * 256 - vocab)).view(batch, num_blocks, 256)
    calls, real_sum = [], torch.sum
    monkeypatch.setattr(torch, "sum", lambda *a, **k: calls.append(1) or real_sum(*a, **k))
    chunked = decoding.block_sums_float64(blocks)
    monkeypatch.setattr(torch, "sum", real_sum)
    assert len(calls) == reductions  # the case splits the batch as it says
    assert torch.equal(chunked, blocks.sum(-1, dtype=torch.float64))
    u = torch.rand((batch, 1), generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    block_sums = blocks.sum(-1, dtype=torch.float64)
    block_cdf = block_sums.cumsum(-1)
    total = block_cdf[:, -1:]
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    block = torch.searchsorted(block_cdf, target, right=True)
    rest = target - (block_cdf.gather(-1, block) - block_sums.gather(-1, block))
    inner = blocks[torch.arange(batch), block.squeeze(-1)].cumsum(-1, dtype=torch.float64)
    rest = torch.minimum(rest.clamp(min=0.0), torch.nextafter(inner[:, -1:], torch.zeros_like(inner[:, -1:])))
    expected = (block * 256 + torch.searchsorted(inner, rest, right=True)).squeeze(-1)
    tokens, logprobs = sample_from_logits(logits, uniforms=u)
    assert torch.equal(tokens, expected)
    # the log-probability is the training forward's formula: the same bytes as its log-softmax's
    assert torch.equal(logprobs, torch.log_softmax(logits, -1).gather(-1, expected[:, None]).squeeze(-1))


def test_draw_queries_covers_the_pool_before_repeating():
    from rlhf_pipeline.queries import draw_queries

    pool = torch.arange(10)[:, None].repeat(1, 3)  # 10 distinct "queries"
    g = torch.Generator().manual_seed(0)
    once = draw_queries(pool, 10, g)[:, 0]
    assert sorted(once.tolist()) == list(range(10))
    fewer = draw_queries(pool, 7, g)[:, 0]
    assert len(set(fewer.tolist())) == 7
    counts = torch.bincount(draw_queries(pool, 25, g)[:, 0], minlength=10)
    assert counts.min() == 2 and counts.max() == 3 and counts.sum() == 25


def two_queries_sampled(model, pad: int, **options):
    """Two queries (the first left-padded) and 6 tokens sampled for each at temperature 0.7, seed 0."""
    from rlhf_pipeline.sampling import sample_responses

    queries = torch.tensor([[pad, pad, 5, 6, 7], [8, 9, 10, 11, 12]])
    generator = torch.Generator().manual_seed(0)
    return queries, sample_responses(
        model, sampling_request(queries, queries != pad, 6, 0.7, pad, generator=generator, **options)
    )


def test_captured_hidden_states_equal_a_plain_forward(tiny_model, tiny_tokenizer):
    """The hidden states captured while sampling (prefill + decoding steps, best-of-2 with a shared
    prefix) are those of one forward over each left-padded query + response."""
    from rlhf_pipeline.sampling import position_ids_from_mask

    pad = tiny_tokenizer.pad_token_id
    queries, out = two_queries_sampled(tiny_model, pad, num_samples=2, capture_layers=(0, 2))
    assert sorted(out.hidden) == [0, 2]
    full = torch.cat([queries.repeat_interleave(2, 0), out.responses], dim=1)
    mask = full != pad
    reference = tiny_model.model(
        input_ids=full, attention_mask=mask.long(), position_ids=position_ids_from_mask(mask), output_hidden_states=True
    ).hidden_states
    for layer, states in out.hidden.items():
        assert states.shape == (4, 11, tiny_model.config.hidden_size)
        torch.testing.assert_close(states[mask], reference[layer][mask], atol=1e-5, rtol=1e-4)


def test_normalisation_samples_are_raw_unless_truncation_is_asked(tiny_model, tiny_tokenizer):
    """reward.normalize.truncate: false (both references) scores the raw fixed-length responses;
    true scores them cut after the first truncate token, as PPO does. The truncate token is one the
    model sampled mid-response, so the cut happens on any CPU (which tokens a random model samples
    depends on the CPU's rounding)."""
    from rlhf_pipeline.params.task import TaskParams
    from rlhf_pipeline.sampling import ResponseSampler

    task = TaskParams(response_length=12, truncate_after=1, temperature=1.0)
    pad = tiny_tokenizer.pad_token_id
    queries = torch.tensor([[pad, 5, 6, 7]] * 16)
    untruncated = ResponseSampler(task, pad, tiny_tokenizer.eos_token_id, None)
    raw, _ = untruncated.sample_batched(tiny_model, queries, torch.Generator().manual_seed(0), 8, truncate=False)
    sampler = ResponseSampler(task, pad, tiny_tokenizer.eos_token_id, int(raw[0, 3]))
    raw, valid = sampler.sample_batched(tiny_model, queries, torch.Generator().manual_seed(0), 8, truncate=False)
    cut, valid_cut = sampler.sample_batched(tiny_model, queries, torch.Generator().manual_seed(0), 8, truncate=True)
    assert torch.equal(valid, valid_cut) and valid[0], "row 0 holds the truncate token after truncate_after"
    assert (raw != pad).all()  # fixed length, nothing cut
    assert torch.equal(cut, sampler.truncate(raw)[0])
    stop = next(j for j in range(task.truncate_after, 4) if raw[0, j] == raw[0, 3])  # its first place, <= 3
    assert (cut[0, stop + 1 :] == pad).all() and torch.equal(cut[0, : stop + 1], raw[0, : stop + 1])


def test_the_sampler_passes_the_kv_cache_by_its_current_name(tiny_model, tiny_tokenizer, caplog):
    """transformers 5.24 renamed the forward's ``past_key_values`` to ``cache`` (and the output's field with
    it) and drops the old name in 5.40: the eager sampler passes and reads ``cache``, as the static one does,
    so sampling raises no deprecation (a FutureWarning is an error here)."""
    import warnings

    from rlhf_pipeline.sampling import sample_responses

    pad = tiny_tokenizer.pad_token_id
    queries = torch.tensor([[pad, 5, 6, 7], [8, 9, 10, 11]])
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        request = sampling_request(
            queries, queries != pad, 4, 0.7, pad, torch.Generator().manual_seed(0), num_samples=2
        )
        out = sample_responses(tiny_model, request)
    assert out.responses.shape == (4, 4)
    assert "deprecated" not in caplog.text


def test_response_hidden_is_response_outputs_hidden_without_the_head(tiny_model, tiny_tokenizer):
    """The hidden states the exact KL reads are the same bytes whether or not the LM head runs after them,
    from the embeddings or from a captured trunk."""
    from rlhf_pipeline.sampling import response_hidden, response_outputs

    pad = tiny_tokenizer.pad_token_id
    queries, out = two_queries_sampled(tiny_model, pad, capture_layers=(1,))
    full = torch.cat([queries, out.responses], dim=1)
    with torch.no_grad():
        for start, trunk in ((0, None), (1, out.hidden[1])):
            args = (full, full != pad, queries.shape[1])
            hidden = response_hidden(tiny_model, *args, start, trunk)
            assert hidden.shape == (2, 6, tiny_model.config.hidden_size)
            assert torch.equal(hidden, response_outputs(tiny_model, *args, 0.7, pad, start, trunk).hidden)


def test_logits_blocks_are_equal_and_under_the_limit():
    """Gemma 3's 262,145 tokens (its pad added): 96 responses of 16 tokens are 1.6 GB of fp32 logits, made
    in four equal blocks of 24 (403 MB each) under 512 MiB; SmolLM2's 49,153 keep the CPU profile's 96 in
    one block (302 MB), as before the limit existed; a response too large alone still gets a block."""
    from rlhf_pipeline.sampling import LOGITS_BLOCK_BYTES, responses_per_logits_block

    assert responses_per_logits_block(96, 16, 262_145) == 24
    assert 24 * 16 * 262_145 * 4 <= LOGITS_BLOCK_BYTES < 96 * 16 * 262_145 * 4
    assert responses_per_logits_block(96, 16, 49_153) == 96
    assert responses_per_logits_block(7, 3, 10, limit=2 * 3 * 10 * 4) == 2  # 4 blocks: 2, 2, 2, 1
    assert responses_per_logits_block(3, 16, 10**9) == 1


@pytest.mark.parametrize("entropy", [False, True])
def test_response_outputs_in_blocks_runs_the_head_on_a_block_at_a_time_and_gives_the_whole_batch(
    tiny_model, tiny_tokenizer, monkeypatch, entropy
):
    """With the limit at two responses' logits, the LM head sees two rows at a time (three calls for five
    responses: 2, 2, 1), and the logprobs and entropies are those of one block over the whole batch."""
    from rlhf_pipeline import sampling
    from rlhf_pipeline.sampling import response_outputs, sample_responses

    pad = tiny_tokenizer.pad_token_id
    queries = torch.tensor([[pad, pad, 5, 6, 7], [8, 9, 10, 11, 12], [pad, 13, 14, 15, 16]]).repeat(2, 1)[:5]
    generator = torch.Generator().manual_seed(0)
    responses = sample_responses(
        tiny_model, sampling_request(queries, queries != pad, 6, 0.7, pad, generator)
    ).responses
    full = torch.cat([queries, responses], dim=1)
    args = (full, full != pad, queries.shape[1], 0.7, pad)
    with torch.no_grad():
        whole = response_outputs(tiny_model, *args, entropy=entropy)
        rows_seen = []
        hook = tiny_model.get_output_embeddings().register_forward_hook(
            lambda module, inputs, output: rows_seen.append(inputs[0].shape[0])
        )
        monkeypatch.setattr(sampling, "LOGITS_BLOCK_BYTES", 2 * 6 * sampling.vocabulary_size(tiny_model) * 4)
        try:
            blocks = response_outputs(tiny_model, *args, entropy=entropy)
        finally:
            hook.remove()
    assert rows_seen == [2, 2, 1]
    torch.testing.assert_close(blocks.logprobs, whole.logprobs, rtol=0, atol=1e-6)
    assert (blocks.logprobs[responses == pad] == 0).all()
    if entropy:
        torch.testing.assert_close(blocks.entropy, whole.entropy, rtol=0, atol=1e-6)
    else:
        assert blocks.entropy is None and whole.entropy is None
    assert torch.equal(blocks.hidden, whole.hidden)


@pytest.mark.parametrize("blocks", [1, 3])
def test_recomputed_logits_leave_no_vocabulary_sized_tensor_in_the_graph(
    tiny_base_dir, tiny_tokenizer, monkeypatch, blocks
):
    """recompute_logits: autograd keeps the (B, R, H) states, no (B, R, V) tensor, and the backward makes each
    block's logits again. In one block the logprobs, entropies and every gradient are the kept logits' to the
    bit; in three blocks (the recomputed limit at two responses) the same within rounding. Without a graph
    (no_grad) the flag changes nothing: the head sees the whole batch."""
    from rlhf_pipeline import sampling
    from rlhf_pipeline.models import load_causal_lm
    from rlhf_pipeline.sampling import response_outputs

    model = load_causal_lm(tiny_base_dir).train()
    vocabulary = sampling.vocabulary_size(model)
    pad = tiny_tokenizer.pad_token_id
    ids = torch.randint(0, 250, (5, 11), generator=torch.Generator().manual_seed(2))
    ids[:2, :2] = pad
    args = (ids, ids != pad, 5, 0.7, pad)
    if blocks > 1:
        monkeypatch.setattr(sampling, "RECOMPUTED_LOGITS_BLOCK_BYTES", 2 * 6 * vocabulary * 4)

    def forward_and_backward(recompute: bool):
        model.zero_grad()
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
            out = response_outputs(model, *args, entropy=True, recompute_logits=recompute)
        (out.logprobs.sum() + out.entropy.sum()).backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
        return out, grads, saved

    kept, kept_grads, kept_saved = forward_and_backward(False)
    recomputed, recomputed_grads, recomputed_saved = forward_and_backward(True)
    assert any(shape[-1] == vocabulary for shape in kept_saved)
    assert not any(shape[-1] == vocabulary for shape in recomputed_saved)
    assert kept_grads.keys() == recomputed_grads.keys() and kept_grads
    if blocks == 1:
        assert torch.equal(recomputed.logprobs, kept.logprobs) and torch.equal(recomputed.entropy, kept.entropy)
        assert all(torch.equal(recomputed_grads[name], kept_grads[name]) for name in kept_grads)
    else:
        torch.testing.assert_close(recomputed.logprobs, kept.logprobs, rtol=0, atol=1e-6)
        torch.testing.assert_close(recomputed.entropy, kept.entropy, rtol=0, atol=1e-6)
        for name in kept_grads:
            torch.testing.assert_close(recomputed_grads[name], kept_grads[name], rtol=1e-5, atol=1e-6)
    rows_seen = []
    hook = model.get_output_embeddings().register_forward_hook(lambda m, i, o: rows_seen.append(i[0].shape[0]))
    try:
        with torch.no_grad():
            plain = response_outputs(model, *args, entropy=True, recompute_logits=True)
    finally:
        hook.remove()
    assert rows_seen == [5] and torch.equal(plain.logprobs, kept.logprobs.detach())


@pytest.mark.parametrize("process_share", [(0, 1), (1, 2)])
def test_one_call_over_chunks_samples_what_the_chunks_sample_one_by_one(tiny_model, tiny_tokenizer, process_share):
    """chunk_uniforms draws, chunk after chunk, what each chunk's call would draw step by step (this
    process's share of each), so one call over all the rows gets every row its draw."""
    from rlhf_pipeline.decoding import chunk_uniforms
    from rlhf_pipeline.sampling import sample_responses

    pad = tiny_tokenizer.pad_token_id
    queries = torch.randint(0, 250, (7, 5), generator=torch.Generator().manual_seed(3))
    queries[:2, :2] = pad
    chunks = [queries[:3], queries[3:6], queries[6:]]

    def sample(rows, generator, uniforms=None):
        request = sampling_request(
            rows, rows != pad, 6, 0.7, pad, generator, process_share=process_share, uniforms=uniforms
        )
        return sample_responses(tiny_model, request)

    generator = torch.Generator().manual_seed(11)
    one_by_one = [sample(chunk, generator) for chunk in chunks]
    generator = torch.Generator().manual_seed(11)
    uniforms = chunk_uniforms(generator, [len(chunk) for chunk in chunks], 6, process_share)
    assert uniforms.shape == (7, 6) and uniforms.dtype == torch.float64
    together = sample(queries, generator, uniforms)
    assert torch.equal(together.responses, torch.cat([out.responses for out in one_by_one]))
    # the same draws; the logprobs to fp32 rounding: a matrix product over 7 rows may round unlike one over 3
    # (on the default run's model, 128 rows and 4 x 32 gave the same bytes: default_run_time_levers.md)
    torch.testing.assert_close(together.logprobs, torch.cat([out.logprobs for out in one_by_one]), atol=1e-4, rtol=1e-4)
    second = together.rows(slice(3, 6))
    assert torch.equal(second.responses, one_by_one[1].responses) and second.values is None
