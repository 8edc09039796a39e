"""Sampling and scoring forwards shared by every stage that runs a language model.

- :func:`sample_responses`: lm-human-preferences sampling: top_k=0, top_p=1, logits divided by
  ``temperature``, a fixed number of tokens that ignores EOS (or an EOS-stop mode), with a KV cache.
  It also returns, from the same forward passes, the sampled tokens' logprobs and (when a value
  head is given) the values, so PPO needs no second policy forward to build a rollout.
- :func:`response_outputs`: one forward over query+response that applies the LM head to the
  response positions only (the vocabulary projection is ~20% of a small model's FLOPs, and the
  query positions' logits are never used), optionally from a trunk captured while sampling
  (:func:`hidden_from`: only the blocks above it run).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from rlhf_pipeline.attention import decoding
from rlhf_pipeline.conversations import end_of_turn, require_chat_template
from rlhf_pipeline.decoding import DecodedTokens, SampleOutput, SamplingRequest, never_pad, position_ids_from_mask
from rlhf_pipeline.devices import STATIC_SAMPLER, model_device
from rlhf_pipeline.functional import logprobs_and_entropy, logprobs_from_logits, truncate_response
from rlhf_pipeline.models import backbone_of, transformer_layers
from rlhf_pipeline.params.task import TaskParams
from rlhf_pipeline.progress import Progress
from rlhf_pipeline.static_sampling import sample_responses_static, supports_static
from rlhf_pipeline.tokens import single_token_id


@dataclass
class _Decoding:
    """The state of one batch of decoding: each row's KV cache, its last hidden state, mask and next position."""

    cache: object
    hidden: Tensor  # (B, H)
    mask: Tensor  # (B, Q + t) long
    next_pos: Tensor  # (B,)
    captured: list[list[Tensor]]  # per captured layer, its hidden states so far


def _prefill(backbone, queries, query_mask, config, num_samples: int, layers: list[int]) -> _Decoding:
    """Run the queries once and repeat their KV cache (and state) ``num_samples`` times per query."""
    from transformers import DynamicCache

    mask = query_mask.to(torch.long)
    capture = {"output_hidden_states": layers} if layers else {}
    out = backbone(
        input_ids=queries,
        attention_mask=mask,
        position_ids=position_ids_from_mask(mask),
        cache=DynamicCache(config=config),
        use_cache=True,
        **capture,
    )
    # output_hidden_states=[...] keeps the full-length tuple, with None where a layer is not asked for
    state = _Decoding(out.cache, out.last_hidden_state[:, -1], mask, mask.sum(-1), [])
    state.captured = [[out.hidden_states[layer]] for layer in layers]
    if num_samples > 1:
        state.cache.batch_repeat_interleave(num_samples)
        state.hidden = state.hidden.repeat_interleave(num_samples, 0)
        state.mask = state.mask.repeat_interleave(num_samples, 0)
        state.next_pos = state.next_pos.repeat_interleave(num_samples, 0)
        state.captured = [[parts[0].repeat_interleave(num_samples, 0)] for parts in state.captured]
    return state


def _feed(backbone, state: _Decoding, token: Tensor, layers: list[int]) -> object:
    """Run the backbone on one new token per row (its KV cache extended); returns the output."""
    batch = token.shape[0]
    state.mask = torch.cat([state.mask, torch.ones(batch, 1, dtype=state.mask.dtype, device=token.device)], dim=1)
    out = backbone(
        input_ids=token[:, None],
        attention_mask=state.mask,
        position_ids=state.next_pos[:, None],
        cache=state.cache,
        use_cache=True,
        **({"output_hidden_states": layers} if layers else {}),
    )
    for parts, layer in zip(state.captured, layers):
        parts.append(out.hidden_states[layer])
    return out


@torch.no_grad()
def sample_responses(model: nn.Module, request: SamplingRequest) -> SampleOutput:
    """Sample ``request.num_samples`` responses per query (rows repeat each query ``num_samples`` times).

    The query prefix is run once and its KV cache repeated, so best-of-N labelling costs one
    prefill per query, not N.

    ``capture_layers``: also return the hidden states entering these blocks at every query and
    response position (``SampleOutput.hidden``), as a plain forward over query+response would give
    them (the model is causal, so they are also those of any truncation of the response). They come
    from the sampling forwards themselves, plus one step that feeds the last sampled token, so a
    frozen lower part of the model never has to run again on these tokens.

    ``process_share``: see :func:`sample_from_logits` (the queries are that share of a batch).
    ``uniforms`` (rows, response_length): each row's draw at each step, given instead of the generator's
    (:func:`rlhf_pipeline.decoding.chunk_uniforms`: one call over several chunks of rows).
    """
    with decoding():  # each step's KV cache extends the last: the invariant attention converts new rows only
        return _sample(model, request)


def _sample(model: nn.Module, request: SamplingRequest) -> SampleOutput:
    backbone = backbone_of(model)
    lm_head = model.get_output_embeddings()
    layers = sorted(set(request.capture_layers))
    state = _prefill(backbone, request.queries, request.query_mask, model.config, request.num_samples, layers)
    decoded = DecodedTokens(request, state.hidden.shape[0], request.queries.device)
    last = request.response_length - 1
    for t in range(request.response_length):
        token = decoded.take(t, decoded.scaled(lm_head(state.hidden).float()), state.hidden)
        if t == last and not layers:
            break
        out = _feed(backbone, state, token, layers)  # the last step only captures the final token's states
        if t == last:
            break
        state.cache, state.hidden = out.cache, out.last_hidden_state[:, -1]
        state.next_pos = state.next_pos + 1
    return decoded.output({layer: torch.cat(parts, dim=1) for layer, parts in zip(layers, state.captured)})


def samples_statically(request: SamplingRequest, cuda_sampler: str) -> bool:
    """Whether ``request`` goes to the static-cache sampler: on CUDA, where the device plan's sampler
    (``compute.cuda_sampler``) is ``static`` and the call asks nothing that sampler lacks (its own draws,
    no captured layers, one process)."""
    return request.queries.device.type == "cuda" and cuda_sampler == STATIC_SAMPLER and supports_static(request)


def sample_on_device(model: nn.Module, request: SamplingRequest, cuda_sampler: str = STATIC_SAMPLER) -> SampleOutput:
    """:func:`sample_responses`, or on CUDA the static-cache sampler with the same draws
    (:func:`samples_statically`): the one entry every sampling stage and PPO's rollouts go through.
    ``cuda_sampler``: the device plan's choice (:attr:`rlhf_pipeline.devices.DevicePlan.sampler`)."""
    if samples_statically(request, cuda_sampler):
        return sample_responses_static(model, request)
    return sample_responses(model, request)


# Architectures whose backbone accepts ``inputs_embeds`` without adding position embeddings
# (rotary), so running a slice of ``layers`` from a cached activation is exact.
TRUNK_SPLIT_MODEL_TYPES = {"llama", "mistral", "qwen2", "qwen3", "olmo", "olmo2", "granite", "smollm3"}


@contextmanager
def only_layers(backbone: nn.Module, layers: nn.ModuleList):
    """Temporarily make ``backbone`` run ``layers`` only (its norm and rotary stay)."""
    original = backbone.layers
    backbone.layers = layers
    try:
        yield
    finally:
        backbone.layers = original


def supports_trunk_split(model: nn.Module) -> bool:
    return getattr(model.config, "model_type", "") in TRUNK_SPLIT_MODEL_TYPES and hasattr(backbone_of(model), "layers")


def hidden_from(
    model: nn.Module,
    query_responses: Tensor,
    mask: Tensor,
    start_layer: int = 0,
    trunk: Tensor | None = None,
    return_trunk_at: int = 0,
):
    """Final hidden states of ``model`` on ``query_responses``.

    ``trunk`` (the activation entering block ``start_layer``) skips the blocks below it.
    ``return_trunk_at`` > 0 also returns the activation entering that block.
    """
    backbone = backbone_of(model)
    kwargs = dict(attention_mask=mask.long(), position_ids=position_ids_from_mask(mask), use_cache=False)
    if trunk is not None:
        with only_layers(backbone, transformer_layers(backbone)[start_layer:]):
            return backbone(inputs_embeds=trunk, **kwargs).last_hidden_state
    out = backbone(input_ids=query_responses, output_hidden_states=return_trunk_at > 0, **kwargs)
    if return_trunk_at > 0:
        return out.last_hidden_state, out.hidden_states[return_trunk_at]
    return out.last_hidden_state


def shared_lower_blocks(model: nn.Module, other: nn.Module) -> int:
    """How many of the lowest blocks (embeddings included) ``model`` and ``other`` share weight for
    weight: a trunk captured while sampling ``model`` is then also ``other``'s. 0 if none or if
    either cannot run from a captured trunk."""
    if not (supports_trunk_split(model) and supports_trunk_split(other)):
        return 0
    mine, theirs = backbone_of(model), backbone_of(other)
    if not torch.equal(mine.get_input_embeddings().weight, theirs.get_input_embeddings().weight):
        return 0
    count = 0
    for a, b in zip(transformer_layers(mine), transformer_layers(theirs)):
        if not all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters())):
            break
        count += 1
    return count


# Past this size, a (B, R, V) fp32 logits block is made a few responses at a time. Why: Gemma 3's
# 262,144-token vocabulary makes 96 responses of 16 tokens 1.6 GB a block, which the pad mask and the
# temperature each copy. Blocks that large fragment glibc's heap: `evaluate` on Gemma peaked at 7 to 12 GB
# with at most 3.7 GB in use (bench/results/gemma3_270m.md). The CPU
# profile's largest block on SmolLM2 (evaluate: 96 x 16 x 49,153) is 302 MB, under it: that run computes
# as before.
LOGITS_BLOCK_BYTES = 2**29
# Recomputed blocks are smaller: their backward makes one block's logits (and their gradient) at a time, and a
# head forward per block costs the same FLOPs whatever the block, so small blocks buy memory for nothing but calls.
RECOMPUTED_LOGITS_BLOCK_BYTES = 2**26


def responses_per_logits_block(responses: int, response_length: int, vocabulary: int, limit: int | None = None) -> int:
    """Responses per block when ``responses`` responses' fp32 logits over the ``vocabulary`` are made in
    blocks of at most ``limit`` bytes (:data:`LOGITS_BLOCK_BYTES`; at least one response a block). The
    blocks are as equal as the count allows, so each one reuses the memory its predecessor freed."""
    limit = LOGITS_BLOCK_BYTES if limit is None else limit
    fits = max(1, limit // max(1, response_length * vocabulary * 4))
    blocks = -(-responses // fits)
    return max(1, -(-responses // max(1, blocks)))


def vocabulary_size(model: nn.Module) -> int:
    """Rows of ``model``'s LM head: the size of its logits' last dimension."""
    return model.get_output_embeddings().weight.shape[0]


def response_logits(model: nn.Module, hidden: Tensor, temperature: float, pad_token_id: int) -> Tensor:
    """(B, R, V) fp32 logits at ``temperature`` of the response positions' final hidden states (B, R, H):
    ``model``'s LM head, the pad token never drawn."""
    return never_pad(model.get_output_embeddings()(hidden).float(), pad_token_id) / temperature


@dataclass
class ResponseOutputs:
    logprobs: Tensor  # (B, R) of the response tokens, 0 at pad positions
    entropy: Tensor | None  # (B, R), when asked for
    hidden: Tensor  # (B, R, H): the final hidden state that predicts each response token


def response_hidden(
    model: nn.Module,
    query_responses: Tensor,
    attention_mask: Tensor,
    query_length: int,
    start_layer: int = 0,
    trunk: Tensor | None = None,
) -> Tensor:
    """(B, R, H) final hidden states of ``model`` at the positions that predict the response tokens (the
    last query position and all response positions but the last), from block ``start_layer`` on given
    the ``trunk`` entering it. Without the LM head: the exact KL turns them into logits a few rows at a
    time (:func:`rlhf_pipeline.ppo.kl.exact_kl_by_rows`), so a caller that needs only them skips the
    (B, R, V) projection."""
    return hidden_from(model, query_responses, attention_mask, start_layer, trunk)[:, query_length - 1 : -1]


def final_state_layer(model: nn.Module) -> int:
    """The capture index of ``model``'s final, normed hidden state (its number of blocks): in a sampling
    call's ``capture_layers`` it keeps, from the sampling forwards, the states the LM head drew each token from."""
    return len(transformer_layers(backbone_of(model)))


def sampled_response_hidden(samples: SampleOutput, model: nn.Module, query_length: int) -> Tensor | None:
    """(B, R, H) ``model``'s final hidden states at the positions that predicted the response tokens, as
    the sampling forwards made them (the last query position and every response position but the last:
    :func:`response_hidden`'s positions); None unless the call captured :func:`final_state_layer`.

    Why: with the trunk split, the exact KL otherwise runs the policy's top blocks over query and response
    again for states the KV-cache decoding already made. These are those states, not a recomputation
    that rounds differently (within about 1e-5 on SmolLM2): the distribution the tokens were drawn from."""
    states = samples.hidden.get(final_state_layer(model))
    return None if states is None else states[:, query_length - 1 : -1]


def own_response_hidden(
    model: nn.Module,
    samples: SampleOutput,
    query_responses: Tensor,
    attention_mask: Tensor,
    query_length: int,
    start_layer: int = 0,
    trunk: Tensor | None = None,
) -> Tensor:
    """(B, R, H) :func:`response_hidden` of ``model`` on its own ``samples`` (``query_responses``: the queries
    and those responses): the states its sampling forwards kept (:func:`sampled_response_hidden`), else a
    forward from block ``start_layer`` given the ``trunk``. The one place the exact KL's callers (PPO's
    rollout and budget reading, the evaluation) choose between the two."""
    kept = sampled_response_hidden(samples, model, query_length)
    if kept is not None:
        return kept
    return response_hidden(model, query_responses, attention_mask, query_length, start_layer, trunk)


def response_outputs(
    model: nn.Module,
    query_responses: Tensor,
    attention_mask: Tensor,
    query_length: int,
    temperature: float,
    pad_token_id: int,
    start_layer: int = 0,
    trunk: Tensor | None = None,
    entropy: bool = False,
    recompute_logits: bool = False,
) -> ResponseOutputs:
    """The one path from a forward over query+response to the response tokens' logprobs under
    ``model`` at ``temperature`` (and their entropy when asked): from block ``start_layer`` on,
    given the ``trunk`` entering it, with the LM head on the response positions only. PPO's
    training forward, its reference pass and the evaluation's KL all go through it. The head runs on
    :func:`responses_per_logits_block` responses at a time, so no logits block passes
    :data:`LOGITS_BLOCK_BYTES` (a batch under it is one block, computed as a whole).

    ``recompute_logits`` (``ppo.recompute_logits``; only where autograd records): each block's head runs
    under activation checkpointing, in blocks of at most :data:`RECOMPUTED_LOGITS_BLOCK_BYTES`. The graph
    then keeps the (B, R, H) states instead of several (B, R, V) fp32 copies per block (the logits, their
    log-softmax, its exponential), and the backward makes them again one block at a time: a microbatch's
    peak memory loses its logits for one more head forward. Each block's recomputation repeats its own
    forward op for op, so the gradient is the one the kept logits give for the same blocks."""
    hidden = response_hidden(model, query_responses, attention_mask, query_length, start_layer, trunk)
    labels = query_responses[:, query_length:]
    recompute = recompute_logits and torch.is_grad_enabled()
    limit = RECOMPUTED_LOGITS_BLOCK_BYTES if recompute else None
    per_block = responses_per_logits_block(*labels.shape, vocabulary_size(model), limit)

    def block_outputs(block_hidden: Tensor, block_labels: Tensor) -> tuple[Tensor, Tensor | None]:
        logits = response_logits(model, block_hidden, temperature, pad_token_id)
        if entropy:
            return logprobs_and_entropy(logits, block_labels)
        return logprobs_from_logits(logits, block_labels), None  # gather minus logsumexp: no log-softmax kept

    parts = []
    for block_hidden, block_labels in zip(hidden.split(per_block), labels.split(per_block)):
        if recompute:
            parts.append(checkpoint(block_outputs, block_hidden, block_labels, use_reentrant=False))
        else:  # the block's logits are freed on return, before the next block's are made
            parts.append(block_outputs(block_hidden, block_labels))
    if len(parts) == 1:
        logprobs, entropies = parts[0]
    else:
        logprobs = torch.cat([part[0] for part in parts])
        entropies = torch.cat([part[1] for part in parts]) if entropy else None
    return ResponseOutputs(zero_at_pad(logprobs, labels, pad_token_id), entropies, hidden)


def zero_at_pad(logprobs: Tensor, labels: Tensor, pad_token_id: int) -> Tensor:
    """``logprobs`` (B, R) with 0 where the response token is the pad: padding after an EOS (stop mode)
    is masked downstream, and its logprob (of a token never drawn) is kept finite here."""
    return torch.where(labels == pad_token_id, torch.zeros_like(logprobs), logprobs)


def iterate_batches(n: int, batch_size: int):
    for start in range(0, n, batch_size):
        yield slice(start, min(start + batch_size, n))


@dataclass
class ResponseSampler:
    """Samples responses to queries with the task's settings and post-processes them like
    lm-human-preferences (fixed length, truncation after the truncate token, validity flag).

    Shared by reward normalisation, PPO rollouts and evaluation so all three see responses
    processed the same way."""

    task: TaskParams
    pad_token_id: int
    eos_token_id: int | None
    truncate_token_id: int | None
    stop_at_eos: bool | None = None  # None: task.stop_at_eos
    cuda_sampler: str = STATIC_SAMPLER  # the device plan's sampler on CUDA (DevicePlan.sampler)

    @classmethod
    def from_tokenizer(cls, task: TaskParams, tokenizer, cuda_sampler: str = STATIC_SAMPLER) -> ResponseSampler:
        """The task's sampler; in chat mode a response stops at the chat template's end-of-turn
        token (which stays in the response, as in the preference data), not at the tokenizer's EOS.
        ``cuda_sampler``: the device plan's (:attr:`rlhf_pipeline.devices.DevicePlan.sampler`)."""
        truncate_token_id = single_token_id(tokenizer, task.truncate_token, "task.truncate_token")
        if not task.chat:
            return cls(task, tokenizer.pad_token_id, tokenizer.eos_token_id, truncate_token_id, None, cuda_sampler)
        require_chat_template(tokenizer, "task.chat")
        end = single_token_id(tokenizer, end_of_turn(tokenizer), "the chat template's end-of-turn text")
        return cls(task, tokenizer.pad_token_id, end, truncate_token_id, stop_at_eos=True, cuda_sampler=cuda_sampler)

    def request(self, queries: Tensor, generator: torch.Generator | None, **asked) -> SamplingRequest:
        """The task's sampling request for ``queries`` (``asked``: the request's other fields)."""
        return SamplingRequest(
            queries=queries,
            query_mask=queries != self.pad_token_id,
            response_length=self.task.response_length,
            temperature=self.task.temperature,
            pad_token_id=self.pad_token_id,
            generator=generator,
            eos_token_id=self.eos_token_id,
            stop_at_eos=self.task.stop_at_eos if self.stop_at_eos is None else self.stop_at_eos,
            **asked,
        )

    def sample(
        self,
        model: nn.Module,
        queries: Tensor,
        generator: torch.Generator,
        value_head: nn.Module | None = None,
        num_samples: int = 1,
        capture_layers: tuple[int, ...] = (),
        process_share: tuple[int, int] = (0, 1),
        uniforms: Tensor | None = None,
    ):
        queries = queries.to(model_device(model))  # the caller's queries may sit on the CPU
        asked = {"value_head": value_head, "num_samples": num_samples, "capture_layers": capture_layers}
        request = self.request(queries, generator, **asked, process_share=process_share, uniforms=uniforms)
        out = sample_on_device(model, request, self.cuda_sampler)
        truncated, valid = self.truncate(out.responses)
        return out, truncated, valid

    def truncate(self, responses: Tensor) -> tuple[Tensor, Tensor]:
        return truncate_response(responses, self.truncate_token_id, self.task.truncate_after, self.pad_token_id)

    @torch.no_grad()
    def sample_batched(
        self,
        model: nn.Module,
        queries: Tensor,
        generator: torch.Generator,
        batch_size: int,
        truncate: bool = True,
        progress: str | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Responses (truncated unless ``truncate`` is false: the raw fixed-length samples) and
        their validity for many queries, in batches: ((B, R), (B,)); ``progress`` labels a line per batch."""
        responses, valids = [], []
        lines = Progress(progress, len(queries), "responses sampled")
        for rows in iterate_batches(len(queries), batch_size):
            out, truncated, valid = self.sample(model, queries[rows], generator)
            responses.append(truncated if truncate else out.responses)
            valids.append(valid)
            lines.update(rows.stop)
        return torch.cat(responses), torch.cat(valids)
