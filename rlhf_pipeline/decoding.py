"""The draw itself, shared by the eager sampler (:mod:`rlhf_pipeline.sampling`) and the static-cache
one (:mod:`rlhf_pipeline.static_sampling`): what a sampling call asks (:class:`SamplingRequest`) and
returns (:class:`SampleOutput`), the decode loop's bookkeeping (:class:`DecodedTokens`), the inverse-CDF
draw of one token per row, the rule that the pad token is never drawn, and positions that skip left
padding."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from rlhf_pipeline.functional import log_softmax_logprobs


@dataclass
class SampleOutput:
    responses: Tensor  # (B, R) token ids; after an EOS in stop mode, pad ids
    logprobs: Tensor  # (B, R) logprob of each sampled token at `temperature`
    values: Tensor | None  # (B, R) value of the state before each response token
    mask: Tensor  # (B, R) True for real response tokens
    # captured layer -> (B, Q+R, d): the hidden state entering that block (index = number of blocks
    # below it; the number of blocks itself = the final, normed state) at every query and response position
    hidden: dict[int, Tensor] = field(default_factory=dict)

    def rows(self, index: slice) -> SampleOutput:
        """These rows' samples."""
        return SampleOutput(
            self.responses[index],
            self.logprobs[index],
            None if self.values is None else self.values[index],
            self.mask[index],
            {layer: states[index] for layer, states in self.hidden.items()},
        )


@dataclass(kw_only=True)
class SamplingRequest:
    """What one sampling call needs; every sampler takes one. ``B`` queries of ``Q`` tokens, ``k =
    num_samples`` responses of ``R = response_length`` tokens to each, rows query-major (row ``i * k + j``
    is sample ``j`` of query ``i``)."""

    queries: Tensor  # (B, Q) left-padded token ids
    query_mask: Tensor  # (B, Q) True at the real tokens
    response_length: int
    temperature: float  # the logits are divided by it
    pad_token_id: int  # never drawn; fills a response after its EOS (stop_at_eos)
    generator: torch.Generator | None = None
    eos_token_id: int | None = None
    stop_at_eos: bool = False  # pad after the EOS (the EOS itself stays)
    value_head: nn.Module | None = None  # also the value of each state before a token (PPO's shared head)
    num_samples: int = 1
    capture_layers: Sequence[int] = ()  # also the hidden states entering these blocks (the trunk split)
    process_share: tuple[int, int] = (0, 1)  # (rank, processes): the queries are this share of a batch
    uniforms: Tensor | None = None  # (B * k, R) each row's draw at each step, instead of the generator's


class DecodedTokens:
    """The decode loop's bookkeeping, the same in every sampler: the (rows, R) tokens, their logprobs
    and values so far, and which rows are still alive (not past an EOS in stop mode)."""

    def __init__(self, request: SamplingRequest, rows: int, device: torch.device):
        self.request, length, pad = request, request.response_length, request.pad_token_id
        self.tokens = torch.full((rows, length), pad, dtype=torch.long, device=device)
        self.logprobs = torch.zeros(rows, length, device=device)
        self.values = torch.zeros(rows, length, device=device) if request.value_head is not None else None
        self.alive = torch.ones(rows, dtype=torch.bool, device=device)

    def scaled(self, logits: Tensor) -> Tensor:
        """A step's fresh fp32 logits (rows, V), in place: the pad token masked, divided by the temperature."""
        return never_pad(logits, self.request.pad_token_id, inplace=True).div_(self.request.temperature)

    def take(self, step: int, logits: Tensor, hidden: Tensor) -> Tensor:
        """Draw step ``step``'s token of each row from its ``scaled`` logits (rows, V), ``hidden`` (rows, H)
        being the state the logits came from (the value head reads it); returns the tokens (rows,), pad
        where a row is past its EOS."""
        request = self.request
        drawn = None if request.uniforms is None else request.uniforms[:, step : step + 1]
        token, logprob = sample_from_logits(
            logits, request.generator, process_share=request.process_share, uniforms=drawn
        )
        if self.values is not None:  # the value of the state before this token
            self.values[:, step] = request.value_head(hidden).squeeze(-1).float()
        token = torch.where(self.alive, token, torch.full_like(token, request.pad_token_id))
        self.tokens[:, step] = token
        self.logprobs[:, step] = torch.where(self.alive, logprob, 0.0)
        # the eos itself is a real token; only what comes after it is padding
        if request.stop_at_eos and request.eos_token_id is not None:
            self.alive = self.alive & (token != request.eos_token_id)
        return token

    def output(self, hidden: dict[int, Tensor] | None = None) -> SampleOutput:
        """The call's result: every response token counts unless the request stops at the EOS."""
        if self.request.stop_at_eos:
            mask = self.tokens != self.request.pad_token_id
        else:
            mask = torch.ones_like(self.tokens, dtype=torch.bool)
        return SampleOutput(self.tokens, self.logprobs, self.values, mask, hidden or {})


def never_pad(logits: Tensor, pad_token_id: int, inplace: bool = False) -> Tensor:
    """The pad token was added to the vocabulary for bookkeeping only; like OAI (which slices the
    logits to the original vocabulary) it is never sampled and gets no probability mass.
    ``inplace`` writes into ``logits`` (the sampler's fresh, no-grad logits: saves a (B, V) copy per step)."""
    if pad_token_id < logits.shape[-1]:
        logits = logits if inplace else logits.clone()
        # finite (not -inf or finfo.min) so temperature scaling cannot overflow and p*log(p) stays 0, not nan
        logits[..., pad_token_id] = -1e9
    return logits


def sample_from_logits(
    logits: Tensor,
    generator: torch.Generator | None = None,
    block_size: int = 256,
    process_share: tuple[int, int] = (0, 1),
    uniforms: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """One token per row of ``logits`` (B, V) drawn from softmax(logits), and its log-probability.

    Inverse-CDF sampling: with w_i = exp(l_i - max l), C_i = sum_{j<=i} w_j and u ~ U[0, 1), the
    token is the smallest i with C_i > u * C_V, so P(i) = w_i / C_V = softmax(l)_i. Its log-probability
    is :func:`~rlhf_pipeline.functional.log_softmax_logprobs`'s, the training forward's own formula.

    Why not ``torch.multinomial``: it draws V exponentials per row, which on CPU at a 49k vocabulary
    was half of every decoding step. This draws one uniform per row. A plain cumulative sum over V
    is slow on CPU too (sequential), so the search runs in two levels: the vocabulary is cut into
    blocks of ``block_size``, the uniform picks a block from the cumulative block sums, then a token
    inside that block. Sums are accumulated in float64 so that tail tokens keep their mass.

    ``process_share = (i, n)``: these rows are share ``i`` of a batch split evenly over ``n``
    processes; the uniforms are drawn for the whole batch and this share's taken, so every row
    gets the draw it gets when one process samples the whole batch.

    ``uniforms`` (B, 1), float64: each row's u, given instead of drawn (:func:`chunk_uniforms`).
    """
    batch, vocab = logits.shape
    peak = logits.amax(-1, keepdim=True)
    num_blocks = -(-vocab // block_size)
    # the weights are written straight into the padded block layout: no (B, V) copy to pad them
    padded = logits.new_empty(batch, num_blocks * block_size)
    padded[:, vocab:] = 0.0
    torch.sub(logits, peak, out=padded[:, :vocab]).exp_()
    blocks = padded.view(batch, num_blocks, block_size)
    block_sums = block_sums_float64(blocks)
    block_cdf = block_sums.cumsum(-1)
    total = block_cdf[:, -1:]
    if uniforms is None:
        u = step_uniforms(generator, batch, process_share, logits.device).to(logits.device)
    else:
        u = uniforms.to(device=logits.device, dtype=torch.float64)
    # u * total may round up to total itself; the largest float below it keeps the draw in the support
    target = torch.minimum(u * total, _just_below(total))
    block = torch.searchsorted(block_cdf, target, right=True)  # (B, 1): a block with positive mass
    rest = target - (block_cdf.gather(-1, block) - block_sums.gather(-1, block))
    inner_cdf = blocks[torch.arange(batch, device=logits.device), block.squeeze(-1)].cumsum(-1, dtype=torch.float64)
    rest = torch.minimum(rest.clamp(min=0.0), _just_below(inner_cdf[:, -1:]))
    token = (block * block_size + torch.searchsorted(inner_cdf, rest, right=True)).squeeze(-1)
    # the training forward's formula, not l_i - max l - log C_V: the same bytes as its log-probability
    return token, log_softmax_logprobs(logits, token)[0]


# Rows of float64 block sums made at once on a CPU: their float64 copy of the weights (about 2 MB) stays in
# cache. One reduction over a whole (256, 49,153) step casts 100 MB first, and took about half as long
# again as the chunks, which give the same bytes (bench/probe_draw.py); either is a small share of a
# decoding step. The stages pin the AVX2 kernels on every host (compute.cpu_numerics: portable), where
# tests/test_sampling.py checks the bytes.
FLOAT64_SUM_BYTES = 2**21


def block_sums_float64(blocks: Tensor) -> Tensor:
    """(B, K) float64 sum of each block of ``blocks`` (B, K, S). On a CPU a few rows at a time, into one
    output: each block's sum is the reduction a single call makes of it, the same bytes, without the
    whole batch's float64 copy passing through memory. Elsewhere one call."""
    if blocks.device.type != "cpu":
        return blocks.sum(-1, dtype=torch.float64)
    batch, num_blocks, block_size = blocks.shape
    rows = max(1, FLOAT64_SUM_BYTES // max(1, num_blocks * block_size * 8))
    sums = blocks.new_empty((batch, num_blocks), dtype=torch.float64)
    for start in range(0, batch, rows):
        torch.sum(blocks[start : start + rows], -1, dtype=torch.float64, out=sums[start : start + rows])
    return sums


def step_uniforms(
    generator: torch.Generator | None, rows: int, process_share: tuple[int, int] = (0, 1), device=None
) -> Tensor:
    """(rows, 1) float64: one decoding step's u for each of this process's ``rows``, drawn for all ``n``
    processes' rows and this share's taken (:func:`share_rows`); the one draw every sampler makes.

    Drawn where the generator lives (``device`` without one): the sampling stages seed a CPU generator on
    every device, so their uniforms are the same stream on a CPU and a GPU host (PPO's rollouts use one
    on the GPU)."""
    where = generator.device if generator is not None else device
    u = torch.rand((rows * process_share[1], 1), generator=generator, dtype=torch.float64, device=where)
    return u[share_rows(process_share, rows)]


def chunk_uniforms(
    generator: torch.Generator, chunk_rows: Sequence[int], steps: int, process_share: tuple[int, int] = (0, 1)
) -> Tensor:
    """(sum(chunk_rows), steps) float64, on the generator's device: the uniforms :func:`sample_from_logits`
    draws for each row at each decoding step when chunks of ``chunk_rows`` rows (this process's share of
    each) are sampled one call after another from ``generator``, drawn here first by the same calls, so
    that the rows can be sampled in other groupings and still each get its draw: one call over all the
    chunks (on a CPU a decoding step over more rows is faster: up to 128 rows at least,
    bench/results/default_run_time_levers.md), or one chunk's rows in several calls
    (``ppo.rollout_microbatch_size``)."""
    return torch.cat(
        [torch.cat([step_uniforms(generator, rows, process_share) for _ in range(steps)], 1) for rows in chunk_rows]
    )


def share_rows(process_share: tuple[int, int], rows: int) -> slice:
    """Share ``i`` of ``(i, n)``'s rows in a draw made for all ``n`` processes' ``rows`` each: every
    process draws for the whole batch and takes its own, so a row's draw does not depend on ``n``."""
    index, _ = process_share
    return slice(index * rows, (index + 1) * rows)


def _just_below(x: Tensor) -> Tensor:
    """The largest float of x's dtype below each element of x."""
    return torch.nextafter(x, torch.zeros_like(x))


def position_ids_from_mask(mask: Tensor) -> Tensor:
    """Positions that skip left padding: 0 at the first real token."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)
