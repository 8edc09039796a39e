"""The PPO trainer (lm-human-preferences, Ziegler et al. 2019).

The loop in :meth:`PPOTrainer.train` reads top to bottom:

1. roll out: sample ``task.response_length`` tokens per query from the current policy; the
   sampling pass also yields the old logprobs and (shared value head) the old values;
2. reference forward: logprobs of the frozen base model on the same tokens;
3. score: truncate at ``task.truncate_token``, score query+truncated response with the
   normalised reward model, ``penalty_reward`` where no truncate token was found;
4. rewards: per-token KL penalty ``-kl_coef * (logp - logp_ref)``, score at the last token,
   whitened without mean shift; GAE (gamma, lam); advantages whitened;
5. ``ppo_epochs`` passes over shuffled minibatches (microbatch gradient accumulation) of the
   clipped policy loss + ``vf_coef`` * clipped value loss (- entropy bonus), LR annealed to 0;
6. adaptive KL controller update; logging; atomic checkpoint every ``checkpoint_every`` updates.

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
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from accelerate.utils import gather_object
from torch import Tensor, nn
from tqdm import tqdm

from rlhf_pipeline import distributed
from rlhf_pipeline.errors import NonFiniteError, PipelineError
from rlhf_pipeline.functional import apply_penalty, linear_anneal, masked_mean, whiten
from rlhf_pipeline.models import backbone_of, freeze_lower_layers
from rlhf_pipeline.optim import adam
from rlhf_pipeline.params.ppo import PPOParams
from rlhf_pipeline.params.task import TaskParams
from rlhf_pipeline.ppo.advantages import gae
from rlhf_pipeline.ppo.checkpoint import Checkpointer, rng_state, set_rng_state
from rlhf_pipeline.ppo.kl import AdaptiveKLController, FixedKLController, compute_rewards, kl_penalty
from rlhf_pipeline.ppo.losses import policy_loss, value_loss
from rlhf_pipeline.ppo.policy import PolicyWithValue
from rlhf_pipeline.reward import RewardModel, score_query_responses
from rlhf_pipeline.sampling import ResponseSampler, response_outputs, supports_trunk_split


@dataclass
class Rollout:
    queries: Tensor
    responses: Tensor  # as sampled: the tokens PPO trains on (reference: all response tokens)
    truncated: Tensor  # as scored
    valid: Tensor
    logprobs: Tensor
    ref_logprobs: Tensor
    values: Tensor
    scores: Tensor
    mask: Tensor  # response tokens that count (all, unless stop_at_eos)
    trunk: Tensor | None
    stats: dict = field(default_factory=dict)  # statistics of the batch (a function of the inputs)
    timings: dict = field(default_factory=dict)  # seconds each phase took (kept out of ``stats``)

    @property
    def query_responses(self) -> Tensor:
        return torch.cat([self.queries, self.responses], dim=1)


def minibatch_indices(
    batch_size: int,
    nminibatches: int,
    microbatch_size: int,
    generator: torch.Generator | None,
) -> list[list[Tensor]]:
    """Index tensors for one PPO epoch: shuffled minibatches, each split into microbatches.

    The permutation is ``torch.randperm(batch_size, generator=generator)``; minibatch ``k``
    is its slice ``[k*M, (k+1)*M)`` with ``M = batch_size / nminibatches``, cut into
    consecutive chunks of ``microbatch_size``.

    Why: OAI reshuffles the rollout batch every PPO epoch and takes one optimizer step per
    minibatch; microbatches are gradient-accumulation chunks of a minibatch
    (lm-human-preference-details), so the update is the same whatever fits in memory.

    Raises:
        ValueError: unless ``nminibatches`` divides ``batch_size`` and ``microbatch_size``
        divides the minibatch size.
    """
    if batch_size <= 0 or nminibatches <= 0 or microbatch_size <= 0:
        raise ValueError("minibatch_indices: sizes must be positive")
    if batch_size % nminibatches:
        raise ValueError(f"minibatch_indices: nminibatches={nminibatches} does not divide batch_size={batch_size}")
    minibatch_size = batch_size // nminibatches
    if minibatch_size % microbatch_size:
        raise ValueError(
            f"minibatch_indices: microbatch_size={microbatch_size} does not divide minibatch size {minibatch_size}"
        )
    perm = torch.randperm(batch_size, generator=generator)
    return [
        [perm[start + m : start + m + microbatch_size] for m in range(0, minibatch_size, microbatch_size)]
        for start in range(0, batch_size, minibatch_size)
    ]


class PPOTrainer:
    def __init__(
        self,
        policy: PolicyWithValue,
        ref_model: nn.Module,
        reward_model: RewardModel,
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
        self.policy, self.ref_model, self.reward_model = policy, ref_model, reward_model
        self.queries, self.task, self.cfg, self.tokenizer = queries, task, cfg, tokenizer
        self.seed, self.device, self.checkpointer = seed, device, checkpointer
        self.gold_labeler, self.log = gold_labeler, log
        # ppo.score_source 'gold': the labeler's score, (gold - mean) / std, replaces the reward model's
        self.gold_standardization = gold_standardization
        if cfg.score_source == "gold" and (gold_labeler is None or gold_standardization is None):
            raise PipelineError(
                "ppo.score_source 'gold' needs the simulated labeler (data.preferences.source: simulated) and its "
                "base-sample statistics."
            )
        self.autocast = autocast
        self.pad_id = tokenizer.pad_token_id
        # Several processes (`accelerate launch`): each samples, scores and trains on its share of
        # the global batch; the rollout is gathered, so advantages, whitening and the KL controller
        # see the whole batch, and the gradient is the one-process gradient (sizes stay global).
        self.accelerator = accelerator or distributed.make_accelerator(device, cfg.freeze_layers > 0, "train_policy")
        self.world_size, self.rank = self.accelerator.num_processes, self.accelerator.process_index
        self.minibatch_share = cfg.batch_size // cfg.nminibatches // self.world_size
        if cfg.batch_size % (cfg.nminibatches * self.world_size) or self.minibatch_share % cfg.microbatch_size:
            raise PipelineError(
                f"ppo.batch_size ({cfg.batch_size}) must split into ppo.nminibatches ({cfg.nminibatches}) minibatches, "
                f"each shared evenly by the {self.world_size} process(es) in shares that ppo.microbatch_size "
                f"({cfg.microbatch_size}) divides."
            )
        self.sampler = ResponseSampler.from_tokenizer(task, tokenizer)
        self.query_length = queries.shape[1]
        self.num_updates = cfg.total_episodes // cfg.batch_size
        self.freeze = cfg.freeze_layers
        for frozen in (ref_model, reward_model):
            if frozen is not None:
                frozen.eval().requires_grad_(False)
        freeze_lower_layers(backbone_of(policy.lm), self.freeze)
        # lm_head is tied to the (frozen) input embeddings in most small LMs; untied heads train.
        self.use_trunk = self.freeze > 0 and supports_trunk_split(policy.lm) and supports_trunk_split(ref_model)
        optimizer = adam(
            (p for p in policy.parameters() if p.requires_grad),
            lr=cfg.lr,
            eps=cfg.adam_eps,
            tensorflow=cfg.tensorflow_adam,
        )
        # DDP wraps the policy, FSDP shards it in place (self.policy stays the module to read)
        self.train_module, self.optimizer = self.accelerator.prepare(policy, optimizer)
        self.kl_ctl = (
            AdaptiveKLController(cfg.kl.init_coef, cfg.kl.target, cfg.kl.horizon)
            if cfg.kl.adaptive
            else FixedKLController(cfg.kl.init_coef)
        )
        self.history: list[dict] = []  # one record per update: checkpointed and logged
        self.timings: list[dict] = []  # seconds per phase of each update this process ran: metrics only
        self.start_update = 0

    # ---- helpers ----------------------------------------------------------------------------
    def _ctx(self):
        return self.autocast() if self.autocast is not None else nullcontext()

    def _offload(self, module: nn.Module, to_device: bool) -> None:
        if self.cfg.offload_frozen:
            module.to(self.device if to_device else "cpu")

    def batch_queries(self, update: int) -> Tensor:
        """Episode order: a seeded permutation per pass over the train queries, so the data
        position is a pure function of the update index (exact resume)."""
        n = len(self.queries)
        start = update * self.cfg.batch_size
        rows = []
        while len(rows) < self.cfg.batch_size:
            epoch, offset = divmod(start + len(rows), n)
            order = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed * 100_003 + epoch))
            take = min(self.cfg.batch_size - len(rows), n - offset)
            rows.extend(order[offset : offset + take].tolist())
        return self.queries[rows[distributed.share(self.accelerator, len(rows))]].to(self.device)

    # ---- 1-3: rollout -----------------------------------------------------------------------
    @torch.no_grad()
    def rollout(self, update: int) -> Rollout:
        t0 = time.perf_counter()
        queries = self.batch_queries(update)
        generator = torch.Generator(device=self.device).manual_seed(self.seed * 1_000_003 + update * 1_009)
        self.policy.eval()
        with self._ctx(), distributed.full_weights(self.accelerator, self.policy):
            # with the trunk split, the sampling pass also yields the activation entering block
            # `freeze` (the policy's frozen lower blocks are the reference's), so neither the
            # reference forward nor any PPO epoch runs those blocks again
            sampled, truncated, valid = self.sampler.sample(
                self.policy.lm,
                queries,
                generator,
                value_head=self.policy.value_head if self.policy.shared else None,
                capture_layers=(self.freeze,) if self.use_trunk else (),
                process_share=(self.rank, self.world_size),
            )
            query_responses = torch.cat([queries, sampled.responses], 1)
            attn = query_responses != self.pad_id
            values = (
                sampled.values
                if self.policy.shared
                else self.policy.values_of(query_responses, attn, self.query_length)
            )
        t1 = time.perf_counter()
        self._offload(self.ref_model, True)
        with self._ctx():
            trunk = sampled.hidden[self.freeze] if self.use_trunk else None
            ref_logprobs = response_outputs(
                self.ref_model,
                query_responses,
                attn,
                self.query_length,
                self.task.temperature,
                self.pad_id,
                self.freeze if self.use_trunk else 0,
                trunk,
            ).logprobs
        self._offload(self.ref_model, False)
        t2 = time.perf_counter()
        gold = None
        if self.gold_labeler is not None:
            gold = torch.tensor(
                self.gold_labeler.score(self.tokenizer.batch_decode(truncated, skip_special_tokens=True)),
                dtype=torch.float32,
            )
        if self.cfg.score_source == "gold":
            mean, std = self.gold_standardization
            raw_scores = ((gold - mean) / std).to(self.device)
        else:
            self._offload(self.reward_model, True)
            with self._ctx():
                raw_scores = score_query_responses(self.reward_model, queries, truncated, len(queries))
            self._offload(self.reward_model, False)
        scores = apply_penalty(raw_scores, valid, self.task.penalty_reward)
        t3 = time.perf_counter()
        timings = {"time/generation": t1 - t0, "time/reference": t2 - t1, "time/scoring": t3 - t2}
        stats = {}
        # every process's share, in batch order: the rest of the update sees the whole batch
        whole = [queries, sampled.responses, truncated, valid, sampled.logprobs, ref_logprobs, values, scores]
        whole = [distributed.gather_rows(self.accelerator, t) for t in [*whole, sampled.mask]]
        trunk = distributed.gather_rows(self.accelerator, trunk) if trunk is not None else None
        if gold is not None:
            stats["objective/gold"] = distributed.gather_rows(self.accelerator, gold.to(self.device)).mean().item()
        return Rollout(*whole, trunk, stats, timings)

    # ---- 4: rewards and advantages ----------------------------------------------------------
    @torch.no_grad()
    def advantages(self, ro: Rollout) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        mask = ro.mask
        rewards, non_score = compute_rewards(
            ro.scores, ro.logprobs, ro.ref_logprobs, self.kl_ctl.value, mask, self.cfg.kl.estimator
        )
        if self.cfg.whiten_rewards:
            rewards = whiten(rewards, mask, shift_mean=False)
        advantages, returns = gae(rewards, ro.values, self.cfg.gamma, self.cfg.lam, mask)
        advantages = whiten(advantages, mask)
        return rewards, non_score, advantages, returns

    # ---- 5: PPO epochs ----------------------------------------------------------------------
    def optimize(self, ro: Rollout, advantages: Tensor, returns: Tensor, update: int) -> dict:
        """``ppo_epochs`` passes of shuffled minibatches over the whole batch, one optimizer step each.

        Each process takes its contiguous share of every minibatch, in microbatches; their gradients
        are summed (accumulated locally, then averaged over processes by DDP/FSDP), so the step is
        the one-process step on the same minibatch."""
        cfg = self.cfg
        lr = linear_anneal(update, self.num_updates, cfg.lr) if cfg.anneal_lr else cfg.lr
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        query_responses = ro.query_responses
        attn = query_responses != self.pad_id
        generator = torch.Generator().manual_seed(self.seed * 7_919 + update)
        sums: dict[str, float] = {}
        count = 0
        self.policy.train()
        trainable = [p for p in self.policy.parameters() if p.requires_grad]
        for _ in range(cfg.ppo_epochs):
            # each minibatch cut into one share per process, each share into microbatches
            for shares in minibatch_indices(cfg.batch_size, cfg.nminibatches, self.minibatch_share, generator):
                micros = shares[self.rank].split(cfg.microbatch_size)
                self.optimizer.zero_grad(set_to_none=True)
                bad_loss = None
                for i, micro in enumerate(micros):
                    micro = micro.to(self.device)
                    # gradients are averaged over processes once, after the share's last microbatch
                    last = i == len(micros) - 1
                    with nullcontext() if last else self.accelerator.no_sync(self.train_module):
                        with self._ctx():
                            logprobs, entropy, vpred = self.train_module(
                                query_responses[micro],
                                attn[micro],
                                self.query_length,
                                self.task.temperature,
                                self.pad_id,
                                self.freeze if self.use_trunk else 0,
                                ro.trunk[micro] if self.use_trunk else None,
                            )
                        mask = ro.mask[micro]
                        pg_loss, pg_stats = policy_loss(
                            logprobs.float(), ro.logprobs[micro], advantages[micro], cfg.cliprange, mask
                        )
                        vf_loss, vf_stats = value_loss(
                            vpred.float(), ro.values[micro], returns[micro], cfg.cliprange_value, mask
                        )
                        entropy_mean = masked_mean(entropy, mask)
                        loss = pg_loss + cfg.vf_coef * vf_loss - cfg.entropy_coef * entropy_mean
                        if bad_loss is None and not torch.isfinite(loss):
                            bad_loss = (pg_loss.item(), vf_loss.item())
                        self.accelerator.backward(loss * len(micro) / self.minibatch_share)
                    record = {
                        "loss/policy": pg_loss.item(),
                        "loss/value": vf_loss.item(),
                        "loss/total": loss.item(),
                        "policy/entropy": entropy_mean.item(),
                        "policy/approxkl": pg_stats["approxkl"].item(),
                        "policy/clipfrac": pg_stats["clipfrac"].item(),
                        "policy/ratio_mean": pg_stats["ratio_mean"].item(),
                        "val/clipfrac": vf_stats["clipfrac"].item(),
                    }
                    for key, value in record.items():
                        sums[key] = sums.get(key, 0.0) + value
                    sums["policy/ratio_max"] = max(sums.get("policy/ratio_max", 0.0), pg_stats["ratio_max"].item())
                    count += 1
                self.step_if_finite(trainable, bad_loss, update)
        self.policy.eval()
        # every process's microbatches: the statistics of the one-process run
        keys = sorted(sums)
        local = torch.tensor([[sums[k] for k in keys] + [count]], dtype=torch.float64, device=self.device)
        every = distributed.gather_rows(self.accelerator, local)
        stats = {
            key: every[:, i].max().item()
            if key == "policy/ratio_max"
            else (every[:, i].sum() / every[:, -1].sum()).item()
            for i, key in enumerate(keys)
        }
        stats["lr"] = lr
        return stats

    def step_if_finite(self, trainable: list[Tensor], bad_loss: tuple[float, float] | None, update: int) -> None:
        """Clip (``ppo.max_grad_norm``) and step, unless a loss or the gradient of any process is not
        finite: then every process raises, before the step, so no NaN reaches a weight."""
        if distributed.any_process(self.accelerator, bad_loss is not None):
            where = f"policy {bad_loss[0]}, value {bad_loss[1]}" if bad_loss else "on another process"
            raise NonFiniteError(
                f"PPO loss became non-finite at update {update} ({where}). {self.last_good()} "
                "Likely causes: a learning rate too high for this model (ppo.lr), fp16/bf16 overflow (run in "
                "fp32), or non-finite rewards; ppo.max_grad_norm bounds the step."
            )
        # a finite loss can still give a non-finite gradient (an fp16/bf16 overflow in the
        # backward pass); one step with it would put NaN into every trainable weight
        bad = distributed.non_finite_gradients(self.accelerator, self.policy)
        if bad:
            raise NonFiniteError(
                f"Non-finite gradient at update {update} ({', '.join(bad[:3])}...). {self.last_good()} "
                "Likely causes: fp16/bf16 overflow (run in fp32) or a learning rate too high (ppo.lr)."
            )
        if self.cfg.max_grad_norm is not None:  # the norm over every process's gradient, sharded or not
            self.accelerator.clip_grad_norm_(trainable, self.cfg.max_grad_norm)
        self.optimizer.step()

    def last_good(self) -> str:
        return (
            self.checkpointer.last_good()
            if self.checkpointer is not None
            else "Nothing was written (no checkpointing)."
        )

    # ---- the loop ---------------------------------------------------------------------------
    def resume_if_possible(self) -> None:
        if self.checkpointer is None:
            return
        # process 0 drops a checkpoint of other params/inputs; then every process reads the same one
        distributed.on_main_process(self.accelerator, self.checkpointer.prepare, "check the checkpoint")
        if not (self.checkpointer.state_dir / "meta.json").is_file():
            return
        trainable = {name for name, p in self.policy.named_parameters() if p.requires_grad}
        state = self.checkpointer.read(trainable)
        distributed.load_full_state(self.policy, state["weights"])
        distributed.load_full_optimizer_state(self.policy, self.optimizer, state["optimizer"])
        self.kl_ctl.load_state_dict(state["kl"])
        set_rng_state(state["rng"][self.rank if self.rank < len(state["rng"]) else 0])
        self.start_update, self.history = state["update"], state["history"]
        if self.accelerator.is_main_process:
            print(f"train_policy: resuming from update {self.start_update} ({self.checkpointer.state_dir})")

    def save_checkpoint(self, update: int) -> None:
        """Every process hands in its part (weights and optimizer state gathered whole, its random
        generators); process 0 writes them."""
        weights = distributed.full_state(self.policy, trainable_only=True)
        optimizer_state = distributed.full_optimizer_state(self.policy, self.optimizer)
        rng = gather_object([rng_state()])
        kl_state, history = self.kl_ctl.state_dict(), self.history

        def write() -> None:
            self.checkpointer.save(update, weights, optimizer_state, kl_state, rng, history)

        distributed.on_main_process(self.accelerator, write, "write the checkpoint")

    def train(self, progress: bool = True) -> list[dict]:
        self.resume_if_possible()
        if self.log is not None:
            # the checkpoint holds every record up to it: replaying them gives the log the same
            # series as an uninterrupted run (a resumed DVCLive log would repeat or lose steps)
            for record in self.history:
                self.log(record)
        bar = tqdm(
            total=self.num_updates, initial=self.start_update, desc="train_policy", unit="update", disable=not progress
        )
        for update in range(self.start_update, self.num_updates):
            started = time.perf_counter()
            ro = self.rollout(update)
            rewards, non_score, advantages, returns = self.advantages(ro)
            t_train = time.perf_counter()
            opt_stats = self.optimize(ro, advantages, returns, update)
            kl_per_seq = (kl_penalty(ro.logprobs, ro.ref_logprobs, self.cfg.kl.estimator) * ro.mask).sum(-1)
            mean_kl = kl_per_seq.mean().item()
            kl_coef = self.kl_ctl.value
            self.kl_ctl.update(mean_kl, self.cfg.batch_size)
            elapsed = time.perf_counter() - started
            record = {
                "update": update + 1,
                "episodes": (update + 1) * self.cfg.batch_size,
                "objective/score": ro.scores.mean().item(),
                "objective/score_std": ro.scores.std().item(),
                "objective/kl": mean_kl,
                "objective/kl_coef": kl_coef,
                "objective/non_score_reward": (non_score.sum(-1)).mean().item(),
                "objective/valid_fraction": ro.valid.float().mean().item(),
                "response/length": (ro.truncated != self.pad_id).sum(-1).float().mean().item(),
                "val/mean": masked_mean(ro.values, ro.mask).item(),
                "returns/mean": masked_mean(returns, ro.mask).item(),
                **ro.stats,
                **opt_stats,
            }
            if not all(math.isfinite(v) for v in record.values() if isinstance(v, float)):
                raise NonFiniteError(f"Non-finite statistics at update {update}: {record}. {self.last_good()}")
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
            if self.checkpointer is not None and (done % self.cfg.checkpoint_every == 0 or done == self.num_updates):
                self.save_checkpoint(done)
        bar.close()
        return self.history
