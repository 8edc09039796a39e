"""The PPO trainer (lm-human-preferences, Ziegler et al. 2019).

The loop in :meth:`PPOTrainer.train` reads top to bottom:

1. roll out (:class:`~rlhf_pipeline.ppo.rollout.RolloutMaker`): the policy's responses to a batch of
   queries, their old and reference logprobs, values and scores;
2. advantages (:meth:`PPOTrainer.advantages`): per-token KL penalty ``-kl_coef * kl``, score at
   the last token, whitened without mean shift; then the estimator ``ppo.advantage`` (GAE on the
   value head, or critic-free RLOO / GRPO); advantages whitened;
3. loss (:meth:`PPOTrainer.loss`): the clipped policy loss, + ``vf_coef`` * clipped value loss
   with a critic, - entropy bonus;
4. step (:meth:`PPOTrainer.optimize`): ``ppo_epochs`` passes over shuffled minibatches, one
   optimizer step each (:func:`rlhf_pipeline.training.accumulate_and_step`), LR annealed to 0;
   then the adaptive KL controller; logging; an atomic checkpoint every ``checkpoint_every``.

With ``ppo.kl.budget`` (:class:`~rlhf_pipeline.ppo.kl_budget.KLBudget`) the run keeps the last policy
whose KL is within the budget: a rollout may end the run before its update, the policy rolled back.

What an update records (``history``: :func:`~rlhf_pipeline.ppo.stats.update_record`, checkpointed and
logged to DVCLive) is a function of the inputs alone; how long it took (``timings``) is kept apart, for
the metrics file only, so a rerun writes the same checkpoints and logs.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, replace
from functools import partial

import torch
from accelerate.utils import gather_object
from torch import Tensor
from tqdm import tqdm

from rlhf_pipeline import distributed
from rlhf_pipeline.errors import LaunchConfigError, NonFiniteError
from rlhf_pipeline.functional import linear_anneal, masked_mean, whiten
from rlhf_pipeline.models import backbone_of, freeze_lower_layers
from rlhf_pipeline.optim import adam
from rlhf_pipeline.ppo.advantages import estimate
from rlhf_pipeline.ppo.checkpoint import rng_state, set_rng_state
from rlhf_pipeline.ppo.kl import AdaptiveKLController, FixedKLController, compute_rewards, kl_penalty
from rlhf_pipeline.ppo.kl_budget import KLBudget, Weights
from rlhf_pipeline.ppo.losses import policy_loss, value_loss
from rlhf_pipeline.ppo.parts import TrainerParts
from rlhf_pipeline.ppo.rollout import Rollout, RolloutMaker
from rlhf_pipeline.ppo.stats import (
    LossStats,
    UpdateTimes,
    display,
    gap_terms,
    kl_reading,
    logprob_gap,
    mean_loss_stats,
    non_finite_values,
    update_record,
)
from rlhf_pipeline.training import accumulate_and_step, set_lr


@dataclass(kw_only=True)
class Advantages:
    """The learning signal of a rollout, each (B, R) as the rollout's rows."""

    rewards: Tensor  # KL penalty per token + the score at the last token (whitened if ppo.whiten_rewards)
    non_score: Tensor  # the KL penalty part alone
    advantages: Tensor  # the estimator's, whitened
    returns: Tensor | None  # the value head's targets (GAE); None without a critic


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


class TrainableWeights:
    """The policy's trainable weights, whole on every process (sharded or not): what the KL budget reads
    and sets."""

    def __init__(self, policy):
        self.policy = policy

    def weights(self) -> Weights:
        return distributed.full_state_copy(self.policy, trainable_only=True)

    def load(self, weights: Weights) -> None:
        distributed.load_full_state(self.policy, weights)


class PPOTrainer:
    def __init__(self, parts: TrainerParts, accelerator=None):
        """``parts``: the run's models, data, params and hooks (:func:`~rlhf_pipeline.ppo.parts.trainer_parts`);
        ``accelerator``: the processes (default: one made for this run)."""
        cfg = self.cfg = parts.cfg
        self.parts, self.policy, self.device = parts, parts.policy, parts.device
        self.checkpointer, self.log = parts.checkpointer, parts.log
        self.pad_id, self.query_length = parts.pad_id, parts.query_length
        self.num_updates = cfg.total_episodes // cfg.batch_size
        self._split_over_processes(accelerator)
        for frozen in (parts.ref_model, parts.reward_model):
            if frozen is not None:
                frozen.eval().requires_grad_(False)
        freeze_lower_layers(backbone_of(self.policy.lm), cfg.freeze_layers)
        # lm_head is tied to the (frozen) input embeddings in most small LMs; untied heads train.
        self.rollouts = RolloutMaker(parts, self.accelerator, self._ctx)
        trainable = (p for p in self.policy.parameters() if p.requires_grad)
        optimizer = adam(trainable, lr=cfg.lr, eps=cfg.adam_eps, tensorflow=cfg.tensorflow_adam)
        # DDP wraps the policy, FSDP shards it in place (self.policy stays the module to read)
        self.train_module, self.optimizer = self.accelerator.prepare(self.policy, optimizer)
        controller = AdaptiveKLController if cfg.kl.adaptive else FixedKLController
        self.kl_ctl = controller(cfg.kl.init_coef, cfg.kl.target, cfg.kl.horizon)
        self.budget = KLBudget(cfg.kl)
        self.history: list[dict] = []  # one record per update: checkpointed and logged
        self.timings: list[UpdateTimes] = []  # each update this process ran: metrics only
        self.start_update = 0

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

    def _ctx(self):
        return self.parts.autocast() if self.parts.autocast is not None else nullcontext()

    # ---- 1: rollout -------------------------------------------------------------------------
    def rollout(self, update: int) -> Rollout:
        return self.rollouts.rollout(update)

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
            cfg.advantage, rewards, ro.values, mask, cfg.gamma, cfg.lam, cfg.samples_per_query
        )
        return Advantages(rewards=rewards, non_score=non_score, advantages=whiten(advantages, mask), returns=returns)

    # ---- 3: the loss ------------------------------------------------------------------------
    def loss(
        self, ro: Rollout, adv: Advantages, micro: Tensor, attn: Tensor, gaps: list[Tensor] | None = None
    ) -> tuple[Tensor, LossStats]:
        """The PPO loss of the rows ``micro`` and their statistics: the clipped policy loss,
        + ``vf_coef`` * the clipped value loss with a critic, - ``entropy_coef`` * the entropy.
        ``gaps``: where this forward's log-probabilities meet the sampled ones (:func:`gap_terms`)."""
        cfg, use_trunk = self.cfg, self.rollouts.use_trunk
        with self._ctx():
            logprobs, entropy, vpred = self.train_module(
                ro.query_responses[micro],
                attn[micro],
                self.query_length,
                self.parts.task.temperature,
                self.pad_id,
                self.rollouts.trunk_start,
                ro.trunk[micro] if use_trunk else None,
            )
        mask = ro.mask[micro]
        if gaps is not None:
            gaps.append(gap_terms(ro.logprobs[micro], logprobs, mask))
        pg_loss, pg = policy_loss(logprobs.float(), ro.logprobs[micro], adv.advantages[micro], cfg.cliprange, mask)
        entropy_mean = masked_mean(entropy, mask)
        value = {}
        if vpred is None:
            loss = pg_loss - cfg.entropy_coef * entropy_mean
        else:
            vf_loss, vf = value_loss(vpred.float(), ro.values[micro], adv.returns[micro], cfg.cliprange_value, mask)
            loss = pg_loss + cfg.vf_coef * vf_loss - cfg.entropy_coef * entropy_mean
            value = {"value": vf_loss.item(), "value_clipfrac": vf["clipfrac"].item()}
        stats = LossStats(
            policy=pg_loss.item(),
            total=loss.item(),
            entropy=entropy_mean.item(),
            **{name: pg[name].item() for name in ("approxkl", "clipfrac", "ratio_mean", "ratio_max")},
            **value,
        )
        return loss, stats

    # ---- 4: the step ------------------------------------------------------------------------
    def lr_at(self, update: int) -> float:
        return linear_anneal(update, self.num_updates, self.cfg.lr) if self.cfg.anneal_lr else self.cfg.lr

    def optimize(self, ro: Rollout, adv: Advantages, update: int) -> LossStats:
        """``ppo_epochs`` passes of shuffled minibatches over the whole batch, one optimizer step each.

        Each process takes its contiguous share of every minibatch, in microbatches; their gradients
        are summed (accumulated locally, then averaged over processes by DDP/FSDP), so the step is
        the one-process step on the same minibatch."""
        cfg = self.cfg
        set_lr(self.optimizer, self.lr_at(update))
        attn = ro.query_responses != self.pad_id
        generator = torch.Generator().manual_seed(self.parts.seed * 7_919 + update)
        records: list[LossStats] = []
        first_forwards: list[Tensor] = []  # the first minibatch's forwards run before the update's first step
        self.policy.train()
        for epoch in range(cfg.ppo_epochs):
            # each minibatch cut into one share per process, each share into microbatches
            minibatches = minibatch_indices(cfg.batch_size, cfg.nminibatches, self.minibatch_share, generator)
            for index, shares in enumerate(minibatches):
                gaps = first_forwards if epoch == index == 0 else None
                records += accumulate_and_step(
                    self.accelerator,
                    self.train_module,
                    self.optimizer,
                    [micro.to(self.device) for micro in shares[self.rank].split(cfg.microbatch_size)],
                    lambda micro, gaps=gaps: self.loss(ro, adv, micro, attn, gaps),
                    lambda what, detail: self.non_finite(what, detail, update),
                    cfg.max_grad_norm,
                    self.policy,
                )
        self.policy.eval()
        gather = partial(distributed.gather_rows, self.accelerator)
        return replace(
            mean_loss_stats(records, gather, self.device), **logprob_gap(first_forwards, gather, self.device)
        )

    def non_finite(self, what: str, detail, update: int) -> NonFiniteError:
        """The error every process raises when a loss (``detail``: the microbatch's statistics, or
        None when another process saw it) or a gradient (the parameters) is not finite."""
        if what == "loss":
            where = f"policy {detail.policy}, value {detail.value}" if detail else "on another process"
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
        if self.checkpointer is None:
            return "Nothing was written (no checkpointing)."
        return self.checkpointer.last_good()

    # ---- checkpoints ------------------------------------------------------------------------
    def resume_if_possible(self) -> None:
        if self.checkpointer is None:
            return
        # process 0 drops a checkpoint of other params/inputs; then every process reads the same one
        distributed.on_main_process(self.accelerator, self.checkpointer.prepare, "check the checkpoint")
        if not (self.checkpointer.state_dir / "meta.json").is_file():
            return
        state = self.checkpointer.read(distributed.trainable_names(self.policy))
        distributed.load_full_state(self.policy, state["weights"])
        distributed.load_full_optimizer_state(self.policy, self.optimizer, state["optimizer"])
        self.kl_ctl.load_state_dict(state["kl"])
        set_rng_state(state["rng"][self.rank if self.rank < len(state["rng"]) else 0])
        self.start_update, self.history = state["update"], state["history"]
        self.budget.load_state_dict(state.get("budget"))
        if self.accelerator.is_main_process:
            print(f"train_policy: resuming from update {self.start_update} ({self.checkpointer.state_dir})")

    def save_checkpoint(self, update: int) -> None:
        """Every process hands in its part (weights and optimizer state gathered whole, its random
        generators); process 0 writes them, with a snapshot of the LM weights training changed."""
        weights = distributed.full_state(self.policy, trainable_only=True)
        optimizer_state = distributed.full_optimizer_state(self.policy, self.optimizer)
        rng = gather_object([rng_state()])
        kl_state, history, budget = self.kl_ctl.state_dict(), self.history, self.budget.state_dict()

        def write() -> None:
            snapshot = self.policy.lm_snapshot(weights)
            self.checkpointer.save(update, weights, snapshot, optimizer_state, kl_state, rng, history, budget)

        distributed.on_main_process(self.accelerator, write, "write the checkpoint")

    # ---- the KL budget ----------------------------------------------------------------------
    def budget_ends_run(self, ro: Rollout, update: int) -> bool:
        """Whether ``ppo.kl.budget`` ends the run on this rollout (of the policy after ``update`` updates):
        when the budget asks, the policy's KL is read precisely; read over the budget, the policy rolls
        back (:meth:`roll_back`), which is the result."""
        if not self.budget.active:
            return False
        kls = [*map(kl_reading, self.history), ro.stats.kl_exact]
        if not self.budget.wants_reading(kls):
            return False
        started = time.perf_counter()
        ro.stats.kl_checked = checked = self.rollouts.checked_kl(ro, update)
        ro.timings.kl_check = time.perf_counter() - started
        if not self.budget.rolls_back(kls, checked):
            return False
        self.roll_back(update, checked)
        return True

    def roll_back(self, update: int, checked: float) -> None:
        """End the run with the policy the budget keeps, and write it as the run's last checkpoint: a
        resumed run ends there too."""
        read_kl = lambda draw: self.rollouts.extra_kl(update, draw=draw)  # noqa: E731
        kept = self.budget.roll_back(update, checked, self.history, TrainableWeights(self.policy), read_kl)
        self.history = kept.history
        if self.checkpointer is not None:
            self.save_checkpoint(kept.updates)
            discard = lambda: self.checkpointer.discard_snapshots_after(kept.updates)  # noqa: E731
            distributed.on_main_process(self.accelerator, discard, "discard a snapshot")
        if self.accelerator.is_main_process:
            kept_as = (
                f"the policy {kept.fraction:g} of the way through update {update}"
                if kept.fraction is not None
                else f"the policy after update {kept.updates} of {self.num_updates}"
            )
            tqdm.write(
                f"train_policy: the policy after update {update} read KL {checked:.2f}, past ppo.kl.budget "
                f"{self.cfg.kl.budget}: {kept_as} (KL {kept.kl:.2f}) is the result"
            )

    # ---- the loop ---------------------------------------------------------------------------
    def record(self, update: int, ro: Rollout, adv: Advantages, loss: LossStats) -> dict:
        """The update's record (a function of the inputs alone: no timing), after the KL controller's step."""
        mean_kl = (kl_penalty(ro.logprobs, ro.ref_logprobs, self.cfg.kl.estimator) * ro.mask).sum(-1).mean().item()
        kl_coef = self.kl_ctl.value
        self.kl_ctl.update(mean_kl, self.cfg.batch_size)
        record = update_record(
            update=update,
            batch_size=self.cfg.batch_size,
            scores=ro.scores,
            valid=ro.valid,
            response_lengths=(ro.truncated != self.pad_id).sum(-1),
            non_score=adv.non_score,
            values=ro.values,
            returns=adv.returns,
            mask=ro.mask,
            rollout=ro.stats,
            loss=loss,
            lr=self.lr_at(update),
            mean_kl=mean_kl,
            kl_coef=kl_coef,
        )
        if non_finite_values(record):
            raise NonFiniteError(f"Non-finite statistics at update {update}: {record}. {self.last_good()}")
        return record

    def train(self, progress: bool = True) -> list[dict]:
        self.resume_if_possible()
        if self.log is not None:
            # the checkpoint holds every record up to it: replaying them gives the log the same
            # series as an uninterrupted run (a resumed DVCLive log would repeat or lose steps)
            discarded = [self.budget.discarded] if self.budget.discarded is not None else []
            for record in self.history + discarded:
                self.log(record)
        bar = tqdm(
            total=self.num_updates, initial=self.start_update, desc="train_policy", unit="update", disable=not progress
        )
        with bar:  # closed on an error too: the stage's error message then starts a line of its own
            for update in range(self.start_update, self.num_updates):
                if self.budget.stopped is not None:  # resumed from the checkpoint the budget's stop wrote
                    break
                started = time.perf_counter()
                ro = self.rollout(update)
                if self.budget_ends_run(ro, update):
                    break
                adv = self.advantages(ro)
                t_train = time.perf_counter()
                if self.budget.active:  # what a reading over the budget rolls back to
                    self.budget.remember(TrainableWeights(self.policy).weights())
                loss = self.optimize(ro, adv, update)
                record = self.record(update, ro, adv, loss)
                self.history.append(record)
                elapsed = time.perf_counter() - started
                times = ro.timings
                times.training, times.update = time.perf_counter() - t_train, elapsed
                times.episodes_per_second = self.cfg.batch_size / elapsed
                self.timings.append(times)
                if self.log is not None:
                    self.log(record)
                bar.update(1)
                bar.set_postfix(display(record))
                done = update + 1
                if self.checkpointer is not None and (
                    done % self.cfg.checkpoint_every == 0 or done == self.num_updates
                ):
                    self.save_checkpoint(done)
        return self.history
