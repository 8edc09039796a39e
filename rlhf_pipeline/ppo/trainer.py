"""The PPO trainer (lm-human-preferences, Ziegler et al. 2019).

The loop in :meth:`PPOTrainer.train` reads top to bottom:

1. roll out (:meth:`PPOTrainer.rollout`): sample ``task.response_length`` tokens for each of
   ``samples_per_query`` responses per query from the current policy; the sampling pass also
   yields the old logprobs and (shared value head) the old values; the reference logprobs come
   from the frozen base model (or, with LoRA, the policy with its adapter off); each response is
   scored as the task says (:func:`rlhf_pipeline.reward.normalization.task_scores`);
2. advantages (:meth:`PPOTrainer.advantages`): per-token KL penalty ``-kl_coef * kl``, score at
   the last token, whitened without mean shift; then the estimator ``ppo.advantage`` (GAE on the
   value head, or critic-free RLOO / GRPO); advantages whitened;
3. loss (:meth:`PPOTrainer.loss`): the clipped policy loss, + ``vf_coef`` * clipped value loss
   with a critic, - entropy bonus;
4. step (:meth:`PPOTrainer.optimize`): ``ppo_epochs`` passes over shuffled minibatches, one
   optimizer step each (:func:`rlhf_pipeline.training.accumulate_and_step`), LR annealed to 0;
   then the adaptive KL controller; logging; an atomic checkpoint every ``checkpoint_every``.

With ``ppo.kl.budget`` the run keeps the last policy whose KL is within the budget: when the rollouts'
KL trend says the next update may pass it, the policy's KL is read precisely, and the first policy
read over the budget ends the run: it is rolled back part of its last update's way (``kl.budget_backtracks``
tries of a line search, :meth:`PPOTrainer.backtrack`) or, when none of those is within the budget, to the policy
before that update (:meth:`PPOTrainer.budget_ends_run`).

Speed without changing the maths:
- old logprobs/values come from the sampling forward, not a second policy forward;
- the LM head is applied to response positions only;
- with ``freeze_layers = K`` the policy's lowest K blocks equal the reference model's (both are
  the frozen base), so the sampling pass also yields the hidden state entering block K; the
  reference forward and every PPO epoch run only the top blocks from that cached activation.

What an update records (``history``, checkpointed and logged to DVCLive) is a function of the
inputs alone; how long it took (``timings``) is kept apart, for the metrics file only, so a rerun
writes the same checkpoints and logs.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from accelerate.utils import gather_object
from torch import Tensor, nn
from tqdm import tqdm

from rlhf_pipeline import distributed
from rlhf_pipeline.decoding import SampleOutput, chunk_uniforms
from rlhf_pipeline.errors import LaunchConfigError, NonFiniteError, PipelineError
from rlhf_pipeline.functional import apply_penalty, linear_anneal, masked_mean, whiten
from rlhf_pipeline.models import backbone_of, freeze_lower_layers
from rlhf_pipeline.optim import adam
from rlhf_pipeline.params.ppo import PPOParams
from rlhf_pipeline.params.task import TaskParams
from rlhf_pipeline.ppo.advantages import estimate
from rlhf_pipeline.ppo.checkpoint import Checkpointer, rng_state, set_rng_state
from rlhf_pipeline.ppo.kl import (
    AdaptiveKLController,
    FixedKLController,
    budget_line_search,
    compute_rewards,
    exact_kl_by_rows,
    kl_budget_verdict,
    kl_forecast,
    kl_penalty,
)
from rlhf_pipeline.ppo.losses import policy_loss, value_loss
from rlhf_pipeline.ppo.policy import PolicyWithValue
from rlhf_pipeline.reward.model import RewardModel
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
from rlhf_pipeline.training import accumulate_and_step, mean_of, quarters, set_lr


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
    stats: dict = field(default_factory=dict)  # statistics of the batch (a function of the inputs)
    timings: dict = field(default_factory=dict)  # seconds each phase took (kept out of ``stats``)

    @property
    def query_responses(self) -> Tensor:
        return torch.cat([self.queries, self.responses], dim=1)


@dataclass(kw_only=True)
class Advantages:
    """The learning signal of a rollout, each (B, R) as the rollout's rows."""

    rewards: Tensor  # KL penalty per token + the score at the last token (whitened if ppo.whiten_rewards)
    non_score: Tensor  # the KL penalty part alone
    advantages: Tensor  # the estimator's, whitened
    returns: Tensor | None  # the value head's targets (GAE); None without a critic


def cat_or_none(parts: Sequence[Tensor | None]) -> Tensor | None:
    """The pieces' rows in order (no copy of a single piece); None where the pieces have none."""
    if parts[0] is None:
        return None
    return parts[0] if len(parts) == 1 else torch.cat(list(parts))


def minibatch_indices(
    batch_size: int,
    nminibatches: int,
    chunk_size: int,
    generator: torch.Generator | None,
) -> list[list[Tensor]]:
    """Index tensors for one PPO epoch: shuffled minibatches, each cut into chunks of ``chunk_size``
    rows (the trainer's chunk is one process's share of the minibatch, which that process then
    cuts into microbatches of ``ppo.microbatch_size``).

    The permutation is ``torch.randperm(batch_size, generator=generator)``; minibatch ``k``
    is its slice ``[k*M, (k+1)*M)`` with ``M = batch_size / nminibatches``, cut into
    consecutive chunks of ``chunk_size``.

    Why: OAI reshuffles the rollout batch every PPO epoch and takes one optimizer step per
    minibatch; the chunks of a minibatch are summed into that one step (processes, then gradient
    accumulation, as in lm-human-preference-details), so the update is the same whatever fits.

    Raises:
        ValueError: unless ``nminibatches`` divides ``batch_size`` and ``chunk_size`` divides the
        minibatch size.
    """
    if batch_size <= 0 or nminibatches <= 0 or chunk_size <= 0:
        raise ValueError("minibatch_indices: sizes must be positive")
    if batch_size % nminibatches:
        raise ValueError(f"minibatch_indices: nminibatches={nminibatches} does not divide batch_size={batch_size}")
    minibatch_size = batch_size // nminibatches
    if minibatch_size % chunk_size:
        raise ValueError(f"minibatch_indices: chunk_size={chunk_size} does not divide minibatch size {minibatch_size}")
    perm = torch.randperm(batch_size, generator=generator)
    return [
        [perm[start + m : start + m + chunk_size] for m in range(0, minibatch_size, chunk_size)]
        for start in range(0, batch_size, minibatch_size)
    ]


class PPOTrainer:
    def __init__(
        self,
        policy: PolicyWithValue,
        ref_model: nn.Module | None,
        reward_model: RewardModel | None,
        queries: Tensor,
        task: TaskParams,
        cfg: PPOParams,
        tokenizer,
        seed: int,
        device: torch.device,
        checkpointer: Checkpointer | None = None,
        gold_labeler=None,
        log=None,
        autocast=None,
        gold_standardization: tuple[float, float] | None = None,
        accelerator=None,
    ):
        """``ref_model``: the frozen reference policy; None when ``policy`` has a LoRA adapter, whose
        base model (the adapter off) is the reference. ``reward_model``: None with ``score_source``
        'gold', whose labeler (``gold_labeler``, standardised by ``gold_standardization``) scores."""
        self.policy, self.ref_model, self.reward_model = policy, ref_model, reward_model
        self.queries, self.task, self.cfg, self.tokenizer = queries, task, cfg, tokenizer
        self.seed, self.device, self.checkpointer = seed, device, checkpointer
        self.gold_labeler, self.log, self.autocast = gold_labeler, log, autocast
        # ppo.score_source 'gold': the labeler's score, (gold - mean) / std, replaces the reward model's
        self.gold_standardization = gold_standardization
        if cfg.score_source == "gold" and (gold_labeler is None or gold_standardization is None):
            raise PipelineError(
                "ppo.score_source 'gold' needs the simulated labeler (data.preferences.source: simulated) and its "
                "base-sample statistics."
            )
        self.pad_id, self.query_length = tokenizer.pad_token_id, queries.shape[1]
        self.sampler = ResponseSampler.from_tokenizer(task, tokenizer)
        self.num_updates = cfg.total_episodes // cfg.batch_size
        self.samples_per_query = cfg.samples_per_query
        self._split_over_processes(accelerator)
        self.freeze = cfg.freeze_layers
        for frozen in (ref_model, reward_model):
            if frozen is not None:
                frozen.eval().requires_grad_(False)
        freeze_lower_layers(backbone_of(policy.lm), self.freeze)
        # lm_head is tied to the (frozen) input embeddings in most small LMs; untied heads train.
        reference = ref_model if ref_model is not None else policy.lm
        self.use_trunk = self.freeze > 0 and supports_trunk_split(policy.lm) and supports_trunk_split(reference)
        trainable = (p for p in policy.parameters() if p.requires_grad)
        optimizer = adam(trainable, lr=cfg.lr, eps=cfg.adam_eps, tensorflow=cfg.tensorflow_adam)
        # DDP wraps the policy, FSDP shards it in place (self.policy stays the module to read)
        self.train_module, self.optimizer = self.accelerator.prepare(policy, optimizer)
        kl = cfg.kl
        controller = AdaptiveKLController if kl.adaptive else FixedKLController
        self.kl_ctl = controller(kl.init_coef, kl.target, kl.horizon)
        self.history: list[dict] = []  # one record per update: checkpointed and logged
        self.timings: list[dict] = []  # seconds per phase of each update this process ran: metrics only
        self.start_update = 0
        # ppo.kl.budget: where it ended the run, if it did; whether the next policy's KL is read precisely;
        # the trainable weights before the last update (what a reading over the budget rolls back to)
        self.stopped: dict | None = None
        self.watching = False
        self.previous: dict[str, Tensor] | None = None
        self.discarded: dict | None = None  # the record of the update a roll-back undid (logged, not kept)

    def _split_over_processes(self, accelerator) -> None:
        """Several processes (`accelerate launch`): each samples, scores and trains on its share of
        the global batch (whole groups of a query's samples); the rollout is gathered, so advantages,
        whitening and the KL controller see the whole batch, and the gradient is the one-process
        gradient (sizes stay global)."""
        cfg = self.cfg
        self.accelerator = accelerator or distributed.make_accelerator(
            self.device,
            cfg.freeze_layers > 0,
            "train_policy",
            cfg.lora is not None,
            cfg.collective_timeout_s,
            timeout_key="ppo.collective_timeout_s",
        )
        self.world_size, self.rank = self.accelerator.num_processes, self.accelerator.process_index
        self.minibatch_share = cfg.batch_size // cfg.nminibatches // self.world_size
        problem = cfg.process_split_problem(self.world_size)
        if problem:
            raise LaunchConfigError(problem + ".")

    # ---- helpers ----------------------------------------------------------------------------
    def _ctx(self):
        return self.autocast() if self.autocast is not None else nullcontext()

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
            order = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed * 100_003 + epoch))
            take = min(wanted - len(rows), n - offset)
            rows.extend(order[offset : offset + take].tolist())
        return self.queries[rows[distributed.share(self.accelerator, len(rows))]].to(self.device)

    def response_outputs(self, model: nn.Module, query_responses: Tensor, trunk: Tensor | None):
        """``model``'s outputs at the response positions: from the trunk when the split applies."""
        return response_outputs(
            model,
            query_responses,
            query_responses != self.pad_id,
            self.query_length,
            self.task.temperature,
            self.pad_id,
            self.trunk_start,
            trunk,
        )

    def response_hidden(self, model: nn.Module, query_responses: Tensor, trunk: Tensor | None) -> Tensor:
        """``model``'s final hidden states at the positions that predict the response tokens, without its LM
        head: from the trunk when the split applies."""
        return response_hidden(
            model, query_responses, query_responses != self.pad_id, self.query_length, self.trunk_start, trunk
        )

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
                ref_hidden = self.response_hidden(reference, query_responses, trunk)
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
        gold = None
        if self.gold_labeler is not None:
            texts = self.tokenizer.batch_decode(truncated, skip_special_tokens=True)
            gold = torch.tensor(self.gold_labeler.score(texts), dtype=torch.float32)
        if self.cfg.score_source == "gold":
            mean, std = self.gold_standardization
            return apply_penalty(((gold - mean) / std).to(self.device), valid, self.task.penalty_reward), gold
        self._offload(self.reward_model, True)
        with self._ctx():
            scores = task_scores(self.reward_model, queries, truncated, valid, self.task.penalty_reward, len(queries))
        self._offload(self.reward_model, False)
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

    def sample_chunks(self, chunks: Sequence[Tensor], generator: torch.Generator):
        """(queries, their samples), one response each, for this process's share of ``chunks`` (chunks of
        queries over all processes, each shared as a rollout's batch is): every row gets the draw it gets
        when one process samples the chunks one after another from ``generator``, whatever the number of
        processes. The draws are made first (:func:`chunk_uniforms`), then the rows are sampled in one pass
        on a CPU (a decoding step over 128 rows costs less than four over 32: 11.2 s against 15.7 s for the
        KL reading's 128 responses, bench/results/default_run_time_levers.md) and handed out chunk by
        chunk, or in pieces of ``ppo.rollout_microbatch_size`` rows when that is set. On a GPU without it,
        each chunk is sampled with its own draws (the static sampler can serve it)."""
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

    def checked_kl(self, ro: Rollout, update: int) -> float:
        """The current policy's mean exact KL over its rollout's responses and ``kl.budget_check_responses``
        more (:meth:`extra_kl`)."""
        extra = self.cfg.kl.budget_check_responses
        rollout_kl, rollout_n = ro.stats["objective/kl_exact"], len(ro.scores)
        if extra == 0:
            return rollout_kl
        return (rollout_kl * rollout_n + self.extra_kl(update) * extra) / (rollout_n + extra)

    @torch.no_grad()
    def extra_kl(self, update: int, draw: int = 0) -> float:
        """The current policy's mean exact KL over ``kl.budget_check_responses`` responses, one to each of as
        many train queries, drawn by a generator of its own (``update`` and ``draw`` seed it), so training's
        random streams are untouched and a resumed run reads the same."""
        extra = self.cfg.kl.budget_check_responses
        stream = self.seed * 31_337 + update + draw * 7_919
        order = torch.randperm(len(self.queries), generator=torch.Generator().manual_seed(stream))
        rows = order.repeat(-(-extra // len(self.queries)))[:extra]
        # chunks of a rollout's size (its memory), each shared by the processes as a rollout's batch is
        chunks = [self.queries[chunk].to(self.device) for chunk in rows.split(self.cfg.batch_size)]
        generator = torch.Generator(device=self.device).manual_seed(self.seed * 1_000_033 + update * 10_007 + draw)
        exact = []
        with self._ctx(), distributed.full_weights(self.accelerator, self.policy):
            for queries, sampled in self.sample_chunks(chunks, generator):
                query_responses = torch.cat([queries, sampled.responses], 1)
                trunk = sampled.hidden[self.freeze] if self.use_trunk else None
                hidden = self.policy_hidden(sampled, query_responses, trunk)
                exact.append(self.reference_logprobs(query_responses, trunk, hidden, sampled.mask, logprobs=False)[1])
        return distributed.gather_rows(self.accelerator, torch.cat(exact)).mean().item()

    # ---- 1: rollout -------------------------------------------------------------------------
    @torch.no_grad()
    def rollout(self, update: int) -> Rollout:
        """This process's share of the update's episodes, in pieces of ``ppo.rollout_microbatch_size``
        responses (null: one piece), then every process's share gathered in batch order."""
        queries = self.batch_queries(update)
        generator = torch.Generator(device=self.device).manual_seed(self.seed * 1_000_003 + update * 1_009)
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
        timings = {name: sum(times[name] for _, times in pieces) for name in pieces[0][1]}
        # every process's share, in batch order: the rest of the update sees the whole batch
        whole = {
            name: None if part is None else distributed.gather_rows(self.accelerator, part)
            for name, part in local.items()
        }
        stats = {} if whole["gold"] is None else {"objective/gold": whole["gold"].mean().item()}
        if whole["exact"] is not None:
            stats["objective/kl_exact"] = whole["exact"].mean().item()
        episodes = {name: part for name, part in whole.items() if name not in ("gold", "exact")}
        return Rollout(**episodes, stats=stats, timings=timings)

    def rollout_piece(
        self, queries: Tensor, generator: torch.Generator, uniforms: Tensor | None
    ) -> tuple[dict[str, Tensor | None], dict[str, float]]:
        """One piece of this process's rollout, rows as :class:`Rollout`'s (and each response's ``gold``
        score and ``exact`` KL when they are read): the responses to ``queries`` sampled (``uniforms``:
        their draws, else drawn from ``generator``), their old logprobs and values, reference logprobs
        and scores; and the seconds each phase took."""
        t0 = time.perf_counter()
        with self._ctx(), distributed.full_weights(self.accelerator, self.policy):
            value_head = self.policy.value_head if self.policy.critic and self.policy.shared else None
            sampled, truncated, valid = self.sample(queries, generator, value_head, uniforms=uniforms)
            # sampling ends here: a separate value model's forward below counts with the reference's
            # (the frozen forwards over query + response), as TRL's timings count it
            t1 = time.perf_counter()
            queries = queries.repeat_interleave(self.samples_per_query, 0) if self.samples_per_query > 1 else queries
            query_responses = torch.cat([queries, sampled.responses], 1)
            values = sampled.values
            if self.policy.critic and not self.policy.shared:
                values = self.policy.values_of(query_responses, query_responses != self.pad_id, self.query_length)
            trunk = sampled.hidden[self.freeze] if self.use_trunk else None
            policy_hidden = self.policy_hidden(sampled, query_responses, trunk)
        ref_logprobs, exact = self.reference_logprobs(query_responses, trunk, policy_hidden, sampled.mask)
        t2 = time.perf_counter()
        scores, gold = self.scores(queries, truncated, valid)
        timings = {"time/generation": t1 - t0, "time/reference": t2 - t1, "time/scoring": time.perf_counter() - t2}
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

    # ---- 2: rewards and advantages ----------------------------------------------------------
    @torch.no_grad()
    def advantages(self, ro: Rollout) -> Advantages:
        cfg, mask = self.cfg, ro.mask
        rewards, non_score = compute_rewards(
            ro.scores, ro.logprobs, ro.ref_logprobs, self.kl_ctl.value, mask, cfg.kl.estimator
        )
        if cfg.whiten_rewards:
            rewards = whiten(rewards, mask, shift_mean=False)
        advantages, returns = estimate(
            cfg.advantage, rewards, ro.values, mask, cfg.gamma, cfg.lam, self.samples_per_query
        )
        return Advantages(rewards=rewards, non_score=non_score, advantages=whiten(advantages, mask), returns=returns)

    # ---- 3: the loss ------------------------------------------------------------------------
    def loss(self, ro: Rollout, adv: Advantages, micro: Tensor, attn: Tensor) -> tuple[Tensor, dict[str, float]]:
        """The PPO loss of the rows ``micro`` and their statistics: the clipped policy loss,
        + ``vf_coef`` * the clipped value loss with a critic, - ``entropy_coef`` * the entropy."""
        cfg = self.cfg
        with self._ctx():
            logprobs, entropy, vpred = self.train_module(
                ro.query_responses[micro],
                attn[micro],
                self.query_length,
                self.task.temperature,
                self.pad_id,
                self.trunk_start,
                ro.trunk[micro] if self.use_trunk else None,
            )
        mask = ro.mask[micro]
        pg_loss, pg_stats = policy_loss(
            logprobs.float(), ro.logprobs[micro], adv.advantages[micro], cfg.cliprange, mask
        )
        entropy_mean = masked_mean(entropy, mask)
        if vpred is None:
            loss = pg_loss - cfg.entropy_coef * entropy_mean
            value = {}
        else:
            vf_loss, vf_stats = value_loss(
                vpred.float(), ro.values[micro], adv.returns[micro], cfg.cliprange_value, mask
            )
            loss = pg_loss + cfg.vf_coef * vf_loss - cfg.entropy_coef * entropy_mean
            value = {"loss/value": vf_loss.item(), "val/clipfrac": vf_stats["clipfrac"].item()}
        stats = {"loss/policy": pg_loss.item(), **value, "loss/total": loss.item()}
        stats |= {"policy/entropy": entropy_mean.item()}
        stats |= {f"policy/{k}": pg_stats[k].item() for k in ("approxkl", "clipfrac", "ratio_mean", "ratio_max")}
        return loss, stats

    # ---- 4: the step ------------------------------------------------------------------------
    def optimize(self, ro: Rollout, adv: Advantages, update: int) -> dict:
        """``ppo_epochs`` passes of shuffled minibatches over the whole batch, one optimizer step each.

        Each process takes its contiguous share of every minibatch, in microbatches; their gradients
        are summed (accumulated locally, then averaged over processes by DDP/FSDP), so the step is
        the one-process step on the same minibatch."""
        cfg = self.cfg
        lr = linear_anneal(update, self.num_updates, cfg.lr) if cfg.anneal_lr else cfg.lr
        set_lr(self.optimizer, lr)
        attn = ro.query_responses != self.pad_id
        generator = torch.Generator().manual_seed(self.seed * 7_919 + update)
        records: list[dict[str, float]] = []
        self.policy.train()
        for _ in range(cfg.ppo_epochs):
            # each minibatch cut into one share per process, each share into microbatches
            for shares in minibatch_indices(cfg.batch_size, cfg.nminibatches, self.minibatch_share, generator):
                records += accumulate_and_step(
                    self.accelerator,
                    self.train_module,
                    self.optimizer,
                    [micro.to(self.device) for micro in shares[self.rank].split(cfg.microbatch_size)],
                    lambda micro: self.loss(ro, adv, micro, attn),
                    lambda what, detail: self.non_finite(what, detail, update),
                    cfg.max_grad_norm,
                    self.policy,
                )
        self.policy.eval()
        return {**self.mean_over_processes(records), "lr": lr}

    def mean_over_processes(self, records: list[dict[str, float]]) -> dict[str, float]:
        """Every process's microbatch statistics: their means (``policy/ratio_max``: their maximum),
        the statistics of the one-process run."""
        keys = sorted(records[0])
        sums = {key: 0.0 for key in keys}
        for record in records:
            for key in keys:
                sums[key] = max(sums[key], record[key]) if key == "policy/ratio_max" else sums[key] + record[key]
        local = torch.tensor([[sums[k] for k in keys] + [len(records)]], dtype=torch.float64, device=self.device)
        every = distributed.gather_rows(self.accelerator, local)
        return {
            key: every[:, i].max().item()
            if key == "policy/ratio_max"
            else (every[:, i].sum() / every[:, -1].sum()).item()
            for i, key in enumerate(keys)
        }

    def non_finite(self, what: str, detail: Any, update: int) -> NonFiniteError:
        """The error every process raises when a loss (``detail``: the microbatch's statistics, or
        None when another process saw it) or a gradient (the parameters) is not finite."""
        if what == "loss":
            where = (
                f"policy {detail['loss/policy']}, value {detail.get('loss/value')}" if detail else "on another process"
            )
            return NonFiniteError(
                f"PPO loss became non-finite at update {update} ({where}). {self.last_good()} "
                "Likely causes: a learning rate too high for this model (ppo.lr), fp16/bf16 overflow (run in "
                "fp32), or non-finite rewards; ppo.max_grad_norm bounds the step."
            )
        return NonFiniteError(
            f"Non-finite gradient at update {update} ({', '.join(detail[:3])}...). {self.last_good()} "
            "Likely causes: fp16/bf16 overflow (run in fp32) or a learning rate too high (ppo.lr)."
        )

    def last_good(self) -> str:
        return (
            self.checkpointer.last_good()
            if self.checkpointer is not None
            else "Nothing was written (no checkpointing)."
        )

    # ---- checkpoints ------------------------------------------------------------------------
    def resume_if_possible(self) -> None:
        if self.checkpointer is None:
            return
        # process 0 drops a checkpoint of other params/inputs; then every process reads the same one
        distributed.on_main_process(self.accelerator, self.checkpointer.prepare, "check the checkpoint")
        if not (self.checkpointer.state_dir / "meta.json").is_file():
            return
        trainable = distributed.trainable_names(self.policy)
        state = self.checkpointer.read(trainable)
        distributed.load_full_state(self.policy, state["weights"])
        distributed.load_full_optimizer_state(self.policy, self.optimizer, state["optimizer"])
        self.kl_ctl.load_state_dict(state["kl"])
        set_rng_state(state["rng"][self.rank if self.rank < len(state["rng"]) else 0])
        self.start_update, self.history = state["update"], state["history"]
        budget = state.get("budget") or {}
        self.watching, self.previous = budget.get("watching", False), budget.get("previous")
        self.stopped, self.discarded = budget.get("stopped"), budget.get("discarded")
        if self.accelerator.is_main_process:
            print(f"train_policy: resuming from update {self.start_update} ({self.checkpointer.state_dir})")

    def save_checkpoint(self, update: int) -> None:
        """Every process hands in its part (weights and optimizer state gathered whole, its random
        generators); process 0 writes them, with a snapshot of the LM weights training changed."""
        weights = distributed.full_state(self.policy, trainable_only=True)
        optimizer_state = distributed.full_optimizer_state(self.policy, self.optimizer)
        rng = gather_object([rng_state()])
        kl_state, history = self.kl_ctl.state_dict(), self.history
        budget = None
        if self.cfg.kl.budget is not None:
            budget = {
                "watching": self.watching,
                "previous": self.previous,
                "stopped": self.stopped,
                "discarded": self.discarded,
            }

        def write() -> None:
            snapshot = self.policy.lm_snapshot(weights)
            self.checkpointer.save(update, weights, snapshot, optimizer_state, kl_state, rng, history, budget)

        distributed.on_main_process(self.accelerator, write, "write the checkpoint")

    # ---- the loop ---------------------------------------------------------------------------
    def record(
        self, update: int, ro: Rollout, adv: Advantages, opt_stats: dict, mean_kl: float, kl_coef: float
    ) -> dict:
        """What the update logs and checkpoints (a function of the inputs alone: no timing)."""
        record = {
            "update": update + 1,
            "episodes": (update + 1) * self.cfg.batch_size,
            "objective/score": ro.scores.mean().item(),
            "objective/score_std": ro.scores.std().item(),
            "objective/kl": mean_kl,
            "objective/kl_coef": kl_coef,
            "objective/non_score_reward": (adv.non_score.sum(-1)).mean().item(),
            "objective/valid_fraction": ro.valid.float().mean().item(),
            "response/length": (ro.truncated != self.pad_id).sum(-1).float().mean().item(),
        }
        if ro.values is not None:
            record["val/mean"] = masked_mean(ro.values, ro.mask).item()
            record["returns/mean"] = masked_mean(adv.returns, ro.mask).item()
        record |= {**ro.stats, **opt_stats}
        if not all(math.isfinite(v) for v in record.values() if isinstance(v, float)):
            raise NonFiniteError(f"Non-finite statistics at update {update}: {record}. {self.last_good()}")
        return record

    def kl_readings(self) -> list[float]:
        """The KL of the policy before each update so far: its precise reading where one was taken, else
        its rollout's."""
        return [record.get("objective/kl_checked", record["objective/kl_exact"]) for record in self.history]

    def budget_ends_run(self, ro: Rollout, update: int) -> bool:
        """Whether ``ppo.kl.budget`` ends the run on this rollout (of the policy after ``update`` updates):
        when the forecast passes the budget, or the last reading was close to it, the policy's KL is read
        precisely; read over the budget, the policy rolls back (:meth:`roll_back`), which is the result
        (:func:`rlhf_pipeline.ppo.kl.kl_budget_verdict`)."""
        kl = self.cfg.kl
        if kl.budget is None:
            return False
        kls = [*self.kl_readings(), ro.stats["objective/kl_exact"]]
        if not (self.watching or kl_forecast(kls, kl.budget_window) > kl.budget):
            return False
        started = time.perf_counter()
        checked = self.checked_kl(ro, update)
        ro.stats["objective/kl_checked"] = checked
        ro.timings["time/kl_check"] = time.perf_counter() - started
        verdict = kl_budget_verdict(kls, checked, kl.budget, kl.budget_window)
        self.watching = verdict == "watch"
        if verdict == "roll back":
            self.roll_back(update, checked)
        return verdict == "roll back"

    def backtrack(self, update: int) -> tuple[float, float] | None:
        """``kl.budget_backtracks`` tries of policies part of the last update's way from the one before it,
        each read precisely, the fractions chosen by ``kl.budget_search``
        (:func:`rlhf_pipeline.ppo.kl.budget_line_search`): (fraction, KL) of the one kept, whose weights the
        policy then holds; None when none is within the budget (the policy is then the one after the update)."""
        kl = self.cfg.kl
        if not kl.budget_backtracks or self.previous is None:
            return None
        after = distributed.full_state_copy(self.policy, trainable_only=True)

        def load(fraction: float) -> None:
            step = {name: self.previous[name] + fraction * (after[name] - self.previous[name]) for name in after}
            distributed.load_full_state(self.policy, step)

        readings: dict[float, float] = {}

        def within(fraction: float) -> bool:
            load(fraction)
            # bisection reads every fraction on one draw (the same queries and generator seed): where it
            # puts the boundary between within and over is then the step's, not the samples'; halving
            # reads each try on a draw of its own
            draw = 1 if kl.budget_search == "bisect" else len(readings) + 1
            readings[fraction] = self.extra_kl(update, draw=draw)
            return readings[fraction] <= kl.budget

        kept = budget_line_search(within, kl.budget_backtracks, kl.budget_search)
        if kept is None:
            distributed.load_full_state(self.policy, after)
            return None
        if kept != list(readings)[-1]:  # bisection read further along after it: back to the kept fraction
            load(kept)
        return kept, readings[kept]

    def roll_back(self, update: int, checked: float) -> None:
        """End the run with a policy within the budget (``checked``: the KL the one after update ``update``
        was read at, over it): part of the way back (:meth:`backtrack`), else the policy before the update;
        and write it as the run's last checkpoint: a resumed run ends there too."""
        budget = self.cfg.kl.budget
        within = self.backtrack(update)
        if within is not None:  # the undone part of the update is a fraction of its step, not its record
            fraction, kept_kl = within
            kept = update
            self.stopped = {"updates": kept, "step_fraction": fraction, "kl": kept_kl}
        else:
            kept = update - 1 if self.previous is not None else update  # no update yet: nothing to go back to
            if self.previous is not None:
                distributed.load_full_state(self.policy, self.previous)
                kept_kl = self.kl_readings()[kept]  # the record of update `kept + 1` read the kept policy
                self.history, self.discarded = self.history[:kept], self.history[kept]
            else:
                kept_kl = checked
            self.stopped = {"updates": kept, "kl": kept_kl}
        self.stopped |= {"rolled_back_kl": checked, "budget": budget}
        if self.checkpointer is not None:
            self.save_checkpoint(kept)
            distributed.on_main_process(
                self.accelerator, lambda: self.checkpointer.discard_snapshots_after(kept), "discard a snapshot"
            )
        if self.accelerator.is_main_process:
            kept_as = (
                f"the policy {within[0]:g} of the way through update {update}"
                if within is not None
                else f"the policy after update {kept} of {self.num_updates}"
            )
            tqdm.write(
                f"train_policy: the policy after update {update} read KL {checked:.2f}, past ppo.kl.budget "
                f"{budget}: {kept_as} (KL {kept_kl:.2f}) is the result"
            )

    def train(self, progress: bool = True) -> list[dict]:
        self.resume_if_possible()
        if self.log is not None:
            # the checkpoint holds every record up to it: replaying them gives the log the same
            # series as an uninterrupted run (a resumed DVCLive log would repeat or lose steps)
            for record in self.history + ([self.discarded] if self.discarded is not None else []):
                self.log(record)
        bar = tqdm(
            total=self.num_updates, initial=self.start_update, desc="train_policy", unit="update", disable=not progress
        )
        with bar:  # closed on an error too: the stage's error message then starts a line of its own
            for update in range(self.start_update, self.num_updates):
                if self.stopped is not None:  # resumed from the checkpoint the budget's stop wrote
                    break
                started = time.perf_counter()
                ro = self.rollout(update)
                if self.budget_ends_run(ro, update):
                    break
                adv = self.advantages(ro)
                t_train = time.perf_counter()
                if self.cfg.kl.budget is not None:  # what a reading over the budget rolls back to
                    self.previous = distributed.full_state_copy(self.policy, trainable_only=True)
                opt_stats = self.optimize(ro, adv, update)
                mean_kl = (
                    (kl_penalty(ro.logprobs, ro.ref_logprobs, self.cfg.kl.estimator) * ro.mask).sum(-1).mean().item()
                )
                kl_coef = self.kl_ctl.value
                self.kl_ctl.update(mean_kl, self.cfg.batch_size)
                elapsed = time.perf_counter() - started
                record = self.record(update, ro, adv, opt_stats, mean_kl, kl_coef)
                self.history.append(record)
                self.timings.append(
                    {
                        **ro.timings,
                        "time/training": time.perf_counter() - t_train,
                        "time/update": elapsed,
                        "episodes_per_second": self.cfg.batch_size / elapsed,
                    }
                )
                if self.log is not None:
                    self.log(record)
                bar.update(1)
                bar.set_postfix(score=f"{record['objective/score']:.3f}", kl=f"{mean_kl:.2f}")
                done = update + 1
                if self.checkpointer is not None and (
                    done % self.cfg.checkpoint_every == 0 or done == self.num_updates
                ):
                    self.save_checkpoint(done)
        return self.history


def history_summary(history: list[dict], with_gold: bool) -> dict:
    """The run's metrics from its per-update records: the score (and gold, ``with_gold``) averaged
    over the first and the last quarter of the updates, the KL over the last quarter, and the final
    KL coefficient. Quarters, not single updates: one update's batch mean is noisy."""
    first, last = quarters(history)
    metrics = {
        "updates": len(history),
        "episodes": history[-1]["episodes"],
        "score/first_quarter": mean_of(first, "objective/score"),
        "score/last_quarter": mean_of(last, "objective/score"),
        "kl/last_quarter": mean_of(last, "objective/kl"),
        "kl_coef/final": history[-1]["objective/kl_coef"],
    }
    if with_gold:
        metrics["gold/first_quarter"] = mean_of(first, "objective/gold")
        metrics["gold/last_quarter"] = mean_of(last, "objective/gold")
    return metrics
