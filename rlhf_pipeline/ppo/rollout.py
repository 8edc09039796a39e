"""PPO's rollout: the policy's responses to a batch of queries, with everything the update needs of them.

:meth:`RolloutMaker.rollout` samples ``task.response_length`` tokens for each of ``samples_per_query``
responses per query from the current policy; the sampling pass also yields the old logprobs and (shared
value head) the old values; the reference logprobs come from the frozen base model (or, with LoRA, the
policy with its adapter off); each response is scored as the task says
(:func:`rlhf_pipeline.reward.normalization.task_scores`), or by the gold labeler itself.

Speed without changing the maths:
- old logprobs/values come from the sampling forward, not a second policy forward;
- the LM head is applied to response positions only;
- with ``freeze_layers = K`` the policy's lowest K blocks equal the reference model's (both are
  the frozen base), so the sampling pass also yields the hidden state entering block K; the
  reference forward and every PPO epoch run only the top blocks from that cached activation.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor, nn

from rlhf_pipeline import distributed
from rlhf_pipeline.decoding import SampleOutput, chunk_uniforms
from rlhf_pipeline.functional import apply_penalty
from rlhf_pipeline.ppo.kl import exact_kl_by_rows
from rlhf_pipeline.ppo.parts import TrainerParts
from rlhf_pipeline.ppo.stats import RolloutStats, UpdateTimes
from rlhf_pipeline.reward.normalization import task_scores
from rlhf_pipeline.sampling import (
    ResponseSampler,
    final_state_layer,
    own_response_hidden,
    response_hidden,
    response_logits,
    response_outputs,
    supports_trunk_split,
)


@dataclass(kw_only=True)
class Rollout:
    """One update's episodes, gathered from every process: ``B = ppo.batch_size`` rows, query-major
    (the ``k = ppo.samples_per_query`` responses to a query are consecutive rows), ``Q`` query and
    ``R`` response tokens, ``H`` the hidden size."""

    queries: Tensor  # (B, Q) left-padded query ids (each query repeated k times)
    responses: Tensor  # (B, R) as sampled: the tokens PPO trains on (reference: all response tokens)
    truncated: Tensor  # (B, R) as scored: cut after task.truncate_token, pad after
    valid: Tensor  # (B,) bool: a truncate token was found (else the score is task.penalty_reward)
    mask: Tensor  # (B, R) bool: response tokens that count (all, unless stop_at_eos)
    logprobs: Tensor  # (B, R) under the sampling policy, at task.temperature
    ref_logprobs: Tensor  # (B, R) under the reference policy
    values: Tensor | None  # (B, R) the value head's estimates; None without a critic
    scores: Tensor  # (B,) the task's score of each response
    trunk: Tensor | None  # (B, Q + R, H) activation entering block freeze_layers (trunk split), or None
    stats: RolloutStats  # scalars of the batch (a function of the inputs)
    timings: UpdateTimes  # seconds each phase took on this process (kept out of ``stats``)

    @property
    def query_responses(self) -> Tensor:
        return torch.cat([self.queries, self.responses], dim=1)


def cat_or_none(parts: Sequence[Tensor | None]) -> Tensor | None:
    """The pieces' rows in order (no copy of a single piece); None where the pieces have none."""
    if parts[0] is None:
        return None
    return parts[0] if len(parts) == 1 else torch.cat(list(parts))


class RolloutMaker:
    """Samples and scores the policy's episodes (``parts``: the models, queries and params; ``accelerator``:
    the processes, each of which makes its share of every batch)."""

    def __init__(self, parts: TrainerParts, accelerator, autocast: Callable):
        self.parts, self.cfg, self.task = parts, parts.cfg, parts.task
        self.policy, self.ref_model, self.queries = parts.policy, parts.ref_model, parts.queries
        self.accelerator, self.device, self._ctx = accelerator, parts.device, autocast
        self.world_size, self.rank = accelerator.num_processes, accelerator.process_index
        self.pad_id, self.query_length = parts.pad_id, parts.query_length
        self.sampler = ResponseSampler.from_tokenizer(parts.task, parts.tokenizer, parts.cuda_sampler)
        self.samples_per_query, self.freeze = self.cfg.samples_per_query, self.cfg.freeze_layers
        reference = self.ref_model if self.ref_model is not None else self.policy.lm
        self.use_trunk = self.freeze > 0 and supports_trunk_split(self.policy.lm) and supports_trunk_split(reference)

    def _offload(self, module: nn.Module | None, to_device: bool) -> None:
        if self.cfg.offload_frozen and module is not None:
            module.to(self.device if to_device else "cpu")

    @property
    def trunk_start(self) -> int:
        """The block a forward from the trunk starts at: ``freeze_layers`` with the trunk split, else 0."""
        return self.freeze if self.use_trunk else 0

    def batch_queries(self, update: int) -> Tensor:
        """This process's queries of an update: a seeded permutation per pass over the train queries,
        so the data position is a pure function of the update index (exact resume)."""
        n, wanted = len(self.queries), self.cfg.batch_size // self.samples_per_query
        start = update * wanted
        rows = []
        while len(rows) < wanted:
            epoch, offset = divmod(start + len(rows), n)
            order = torch.randperm(n, generator=torch.Generator().manual_seed(self.parts.seed * 100_003 + epoch))
            take = min(wanted - len(rows), n - offset)
            rows.extend(order[offset : offset + take].tolist())
        return self.queries[rows[distributed.share(self.accelerator, len(rows))]].to(self.device)

    def response_outputs(self, model: nn.Module, query_responses: Tensor, trunk: Tensor | None):
        """``model``'s outputs at the response positions: from the trunk when the split applies."""
        mask = query_responses != self.pad_id
        temperature, start = self.task.temperature, self.trunk_start
        return response_outputs(model, query_responses, mask, self.query_length, temperature, self.pad_id, start, trunk)

    def reference_logprobs(
        self,
        query_responses: Tensor,
        trunk: Tensor | None,
        policy_hidden: Tensor | None = None,
        mask=None,
        logprobs: bool = True,
    ) -> tuple[Tensor | None, Tensor | None]:
        """(B, R) logprobs of the responses under the reference policy: the frozen base model, or
        the policy with its LoRA adapter off (one copy of the weights); and, given the policy's final
        hidden states at the response positions, each response's exact KL (the budget's measure).
        ``logprobs=False`` (the KL reading, which needs only the KL): no logprobs (None), so the
        reference's LM head runs only inside the exact KL, not a second time over every response token;
        the KL is the same bytes, being made from the same hidden states."""
        if policy_hidden is not None and mask is None:
            raise ValueError("reference_logprobs: the exact KL needs the responses' mask")
        if not logprobs and policy_hidden is None:
            raise ValueError("reference_logprobs: asked for neither logprobs nor the exact KL")
        reference = self.ref_model if self.ref_model is not None else self.policy.lm
        self._offload(self.ref_model, True)
        with self._ctx(), self.policy.adapter_disabled() if self.ref_model is None else nullcontext():
            if logprobs:
                out = self.response_outputs(reference, query_responses, trunk)
                ref_logprobs, ref_hidden = out.logprobs, out.hidden
            else:
                ref_logprobs = None
                attn = query_responses != self.pad_id
                ref_hidden = response_hidden(
                    reference, query_responses, attn, self.query_length, self.trunk_start, trunk
                )
            kl = None
            if policy_hidden is not None:
                mine, theirs = (
                    partial(response_logits, lm, temperature=self.task.temperature, pad_token_id=self.pad_id)
                    for lm in (self.policy.lm, reference)
                )
                kl, _ = exact_kl_by_rows(mine, theirs, policy_hidden, ref_hidden, mask)
        self._offload(self.ref_model, False)
        return ref_logprobs, kl

    def scores(self, queries: Tensor, truncated: Tensor, valid: Tensor) -> tuple[Tensor, Tensor | None]:
        """(B,) the task's score of each response, and (B,) its gold score when a labeler is at hand."""
        gold, labeler = None, self.parts.gold_labeler
        if labeler is not None:
            texts = self.parts.tokenizer.batch_decode(truncated, skip_special_tokens=True)
            gold = torch.tensor(labeler.score(texts), dtype=torch.float32)
        if self.cfg.score_source == "gold":
            mean, std = self.parts.gold_standardization
            return apply_penalty(((gold - mean) / std).to(self.device), valid, self.task.penalty_reward), gold
        reward_model = self.parts.reward_model
        self._offload(reward_model, True)
        with self._ctx():
            scores = task_scores(reward_model, queries, truncated, valid, self.task.penalty_reward, len(queries))
        self._offload(reward_model, False)
        return scores, gold

    def sample(
        self,
        queries: Tensor,
        generator: torch.Generator,
        value_head: nn.Module | None = None,
        num_samples=None,
        uniforms: Tensor | None = None,
    ):
        """The policy's ``num_samples`` (default ``samples_per_query``) responses to each of this process's
        ``queries``: (sampled, truncated, valid). With the trunk split, the sampling pass also yields the
        activation entering block `freeze` (the policy's frozen lower blocks are the reference's), so
        neither the reference forward nor any PPO epoch runs those blocks again."""
        return self.sampler.sample(
            self.policy.lm,
            queries,
            generator,
            value_head=value_head,
            num_samples=num_samples or self.samples_per_query,
            capture_layers=self.capture_layers,
            process_share=(self.rank, self.world_size),
            uniforms=uniforms,
        )

    def sample_chunks(self, chunks: Sequence[Tensor], generator: torch.Generator) -> Iterator:
        """(queries, their samples), one response each, for this process's share of ``chunks`` (chunks of
        queries over all processes, each shared as a rollout's batch is): every row gets the draw it gets
        when one process samples the chunks one after another from ``generator``, whatever the number of
        processes. The draws are made first (:func:`chunk_uniforms`), then the rows are sampled in one pass
        on a CPU (one decoding step over 128 rows costs less than four over 32,
        bench/results/default_run_time_levers.md) and handed out chunk by chunk, or in pieces of
        ``ppo.rollout_microbatch_size`` rows when that is set. On a GPU without it, each chunk is sampled
        with its own draws (the static sampler can serve it)."""
        mine = [chunk[distributed.share(self.accelerator, len(chunk))] for chunk in chunks]
        piece_rows = self.cfg.rollout_microbatch_size
        if piece_rows is None and (generator.device.type != "cpu" or len(mine) < 2):
            for queries in mine:
                yield queries, self.sample(queries, generator, num_samples=1)[0]
            return
        rows = [len(queries) for queries in mine]
        uniforms = chunk_uniforms(generator, rows, self.task.response_length, (self.rank, self.world_size))
        if piece_rows is not None:
            for queries, drawn in zip(torch.cat(mine).split(piece_rows), uniforms.split(piece_rows)):
                yield queries, self.sample(queries, generator, num_samples=1, uniforms=drawn)[0]
            return
        sampled = self.sample(torch.cat(mine), generator, num_samples=1, uniforms=uniforms)[0]
        start = 0
        for queries in mine:
            yield queries, sampled.rows(slice(start, start + len(queries)))
            start += len(queries)

    @property
    def capture_layers(self) -> tuple[int, ...]:
        """What the sampling forwards keep besides the tokens: with the trunk split, the state entering block
        ``freeze`` (where the reference's forward and the epochs start) and, with ``ppo.kl.budget``, the
        policy's final states (its half of the exact KL: :meth:`policy_hidden`)."""
        if not self.use_trunk:
            return ()
        return (self.freeze,) if self.cfg.kl.budget is None else (self.freeze, final_state_layer(self.policy.lm))

    def policy_hidden(self, sampled: SampleOutput, query_responses: Tensor, trunk: Tensor | None) -> Tensor | None:
        """The policy's final hidden states at the response positions, which the exact KL needs (its full
        distributions at each response token): only with ``ppo.kl.budget``. Those the sampling forwards
        kept (:attr:`capture_layers`), else a forward over query and response."""
        if self.cfg.kl.budget is None:
            return None
        mask = query_responses != self.pad_id
        return own_response_hidden(
            self.policy.lm, sampled, query_responses, mask, self.query_length, self.trunk_start, trunk
        )

    @torch.no_grad()
    def extra_kl(self, update: int, draw: int = 0) -> float:
        """The current policy's mean exact KL over ``kl.budget_check_responses`` responses, one to each of as
        many train queries, drawn by a generator of its own (``update`` and ``draw`` seed it), so training's
        random streams are untouched and a resumed run reads the same."""
        extra, seed = self.cfg.kl.budget_check_responses, self.parts.seed
        order = torch.randperm(
            len(self.queries), generator=torch.Generator().manual_seed(seed * 31_337 + update + draw * 7_919)
        )
        rows = order.repeat(-(-extra // len(self.queries)))[:extra]
        # chunks of a rollout's size (its memory), each shared by the processes as a rollout's batch is
        chunks = [self.queries[chunk].to(self.device) for chunk in rows.split(self.cfg.batch_size)]
        generator = torch.Generator(device=self.device).manual_seed(seed * 1_000_033 + update * 10_007 + draw)
        exact = []
        with self._ctx(), distributed.full_weights(self.accelerator, self.policy):
            for queries, sampled in self.sample_chunks(chunks, generator):
                query_responses = torch.cat([queries, sampled.responses], 1)
                trunk = sampled.hidden[self.freeze] if self.use_trunk else None
                hidden = self.policy_hidden(sampled, query_responses, trunk)
                exact.append(self.reference_logprobs(query_responses, trunk, hidden, sampled.mask, logprobs=False)[1])
        return distributed.gather_rows(self.accelerator, torch.cat(exact)).mean().item()

    def checked_kl(self, ro: Rollout, update: int) -> float:
        """The current policy's mean exact KL over its rollout's responses and ``kl.budget_check_responses``
        more (:meth:`extra_kl`)."""
        extra = self.cfg.kl.budget_check_responses
        rollout_kl, rollout_n = ro.stats.kl_exact, len(ro.scores)
        if extra == 0:
            return rollout_kl
        return (rollout_kl * rollout_n + self.extra_kl(update) * extra) / (rollout_n + extra)

    @torch.no_grad()
    def rollout(self, update: int) -> Rollout:
        """This process's share of the update's episodes, in pieces of ``ppo.rollout_microbatch_size``
        responses (null: one piece), then every process's share gathered in batch order."""
        queries = self.batch_queries(update)
        generator = torch.Generator(device=self.device).manual_seed(self.parts.seed * 1_000_003 + update * 1_009)
        self.policy.eval()
        rows = len(queries) * self.samples_per_query
        piece_rows = self.cfg.rollout_microbatch_size or rows
        uniforms: Sequence[Tensor | None] = [None]
        if piece_rows < rows:
            # every row's draws first, as one pass over the share draws them: a row's response does not
            # depend on the piece it is sampled in
            share = (self.rank, self.world_size)
            uniforms = chunk_uniforms(generator, [rows], self.task.response_length, share).split(piece_rows)
        piece_queries = queries.split(piece_rows // self.samples_per_query)
        pieces = [self.rollout_piece(part, generator, drawn) for part, drawn in zip(piece_queries, uniforms)]
        local = {name: cat_or_none([piece[name] for piece, _ in pieces]) for name in pieces[0][0]}
        timings = pieces[0][1]
        for _, times in pieces[1:]:
            timings = timings + times
        # every process's share, in batch order: the rest of the update sees the whole batch
        whole = {
            name: None if part is None else distributed.gather_rows(self.accelerator, part)
            for name, part in local.items()
        }
        gold, exact = whole.pop("gold"), whole.pop("exact")
        stats = RolloutStats(
            gold=None if gold is None else gold.mean().item(), kl_exact=None if exact is None else exact.mean().item()
        )
        return Rollout(**whole, stats=stats, timings=timings)

    def rollout_piece(
        self, queries: Tensor, generator: torch.Generator, uniforms: Tensor | None
    ) -> tuple[dict[str, Tensor | None], UpdateTimes]:
        """One piece of this process's rollout, rows as :class:`Rollout`'s (and each response's ``gold``
        score and ``exact`` KL when they are read): the responses to ``queries`` sampled (``uniforms``:
        their draws, else drawn from ``generator``), their old logprobs and values, reference logprobs
        and scores; and the seconds each phase took."""
        t0 = time.perf_counter()
        policy = self.policy
        with self._ctx(), distributed.full_weights(self.accelerator, policy):
            value_head = policy.value_head if policy.critic and policy.shared else None
            sampled, truncated, valid = self.sample(queries, generator, value_head, uniforms=uniforms)
            # sampling ends here: a separate value model's forward below counts with the reference's
            # (the frozen forwards over query + response), as TRL's timings count it
            t1 = time.perf_counter()
            queries = queries.repeat_interleave(self.samples_per_query, 0) if self.samples_per_query > 1 else queries
            query_responses = torch.cat([queries, sampled.responses], 1)
            values = sampled.values
            if policy.critic and not policy.shared:
                values = policy.values_of(query_responses, query_responses != self.pad_id, self.query_length)
            trunk = sampled.hidden[self.freeze] if self.use_trunk else None
            policy_hidden = self.policy_hidden(sampled, query_responses, trunk)
        ref_logprobs, exact = self.reference_logprobs(query_responses, trunk, policy_hidden, sampled.mask)
        t2 = time.perf_counter()
        scores, gold = self.scores(queries, truncated, valid)
        timings = UpdateTimes(generation=t1 - t0, reference=t2 - t1, scoring=time.perf_counter() - t2)
        piece = {
            "queries": queries,
            "responses": sampled.responses,
            "truncated": truncated,
            "valid": valid,
            "mask": sampled.mask,
            "logprobs": sampled.logprobs,
            "ref_logprobs": ref_logprobs,
            "values": values,
            "scores": scores,
            "trunk": trunk,
            "gold": None if gold is None else gold.to(self.device),
            "exact": exact,
        }
        return piece, timings
