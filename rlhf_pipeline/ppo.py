"""PPO policy training, following lm-human-preferences (Ziegler et al. 2019).

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
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import random
import shutil
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from safetensors.torch import save as save_safetensors
from torch import Tensor, nn

from rlhf_pipeline import distributed
from rlhf_pipeline import functional as F
from rlhf_pipeline.errors import NonFiniteError, PipelineError
from rlhf_pipeline.io import atomic_dir, atomic_file, recover_interrupted_write, sha256_file
from rlhf_pipeline.models import backbone_of, freeze_lower_layers
from rlhf_pipeline.optim import adam
from rlhf_pipeline.params import PPOParams, TaskParams
from rlhf_pipeline.reward import RewardModel, score_query_responses
from rlhf_pipeline.sampling import (
    ResponseSampler,
    hidden_from,
    response_outputs,
    supports_trunk_split,
)

VALUE_HEAD_FILE = "value_head.safetensors"


# --------------------------------------------------------------------------------------------
# the trained module: policy LM + value head (shared backbone) or a separate value model
# --------------------------------------------------------------------------------------------
class PolicyWithValue(nn.Module):
    """Policy LM with a value estimate for each response position.

    ``value_model='shared'`` (reference): a zero-initialised scalar head on the policy's final
    hidden state (OAI ``fc_layer`` with scale 0). ``'separate'``: a reward-model copy (backbone
    and head) predicts values, as TRL does.
    """

    def __init__(self, lm: nn.Module, value_backbone: nn.Module | None = None, value_head: nn.Linear | None = None):
        super().__init__()
        self.lm = lm
        self.value_backbone = value_backbone
        if value_head is None:
            value_head = nn.Linear(lm.config.hidden_size, 1)
            nn.init.zeros_(value_head.weight)
            nn.init.zeros_(value_head.bias)
        self.value_head = value_head

    @property
    def shared(self) -> bool:
        return self.value_backbone is None

    def forward(
        self,
        query_responses: Tensor,
        mask: Tensor,
        query_length: int,
        temperature: float,
        pad_token_id: int,
        freeze_layers: int = 0,
        trunk: Tensor | None = None,
    ):
        """(logprobs, entropy, values) of the response tokens: each (B, R)."""
        args = (query_responses, mask, query_length, temperature, pad_token_id, freeze_layers, trunk)
        out = response_outputs(self.lm, *args, entropy=True)
        logprobs, entropy = out.logprobs, out.entropy
        if self.shared:
            values = self.value_head(out.hidden).squeeze(-1).float()
        else:
            value_hidden = hidden_from(self.value_backbone_as_lm(), query_responses, mask)[:, query_length - 1 : -1]
            values = self.value_head(value_hidden).squeeze(-1).float()
        return logprobs, entropy, values

    def value_backbone_as_lm(self):
        return _BackboneAsModel(self.value_backbone)

    @torch.no_grad()
    def values_of(self, query_responses: Tensor, mask: Tensor, query_length: int) -> Tensor:
        value_hidden = hidden_from(self.value_backbone_as_lm(), query_responses, mask)[:, query_length - 1 : -1]
        return self.value_head(value_hidden).squeeze(-1).float()


class _BackboneAsModel:
    """Lets :func:`hidden_from` treat a bare backbone (AutoModel) like a *ForCausalLM."""

    def __init__(self, backbone: nn.Module):
        self.base_model = backbone
        self.config = backbone.config


# --------------------------------------------------------------------------------------------
# rollouts
# --------------------------------------------------------------------------------------------
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
    stats: dict = field(default_factory=dict)

    @property
    def query_responses(self) -> Tensor:
        return torch.cat([self.queries, self.responses], dim=1)


# --------------------------------------------------------------------------------------------
# checkpoints
# --------------------------------------------------------------------------------------------
def trainable_state(module: nn.Module) -> dict[str, Tensor]:
    return {name: p.detach().cpu().contiguous() for name, p in module.named_parameters() if p.requires_grad}


def rng_state() -> dict:
    """Every random generator's state as tensors, ints and lists only, so that the checkpoint
    loads with ``torch.load(weights_only=True)``: no pickle, no code run from a shared cache."""
    version, mt, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": {"version": version, "mt": list(mt), "gauss": gauss},
        "numpy": {
            "name": name,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    py, npy = state["python"], state["numpy"]
    random.setstate((py["version"], tuple(py["mt"]), py["gauss"]))
    np.random.set_state(
        (npy["name"], npy["keys"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"], npy["cached_gaussian"])
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class Checkpointer:
    """``state/`` holds everything to resume (atomic: temp dir, then rename); ``snapshots/``
    keeps the trainable weights at each checkpoint for the over-optimisation curve."""

    def __init__(self, directory: str | Path, fingerprint: str):
        self.directory = Path(directory)
        self.fingerprint = fingerprint
        self.state_dir = self.directory / "state"
        self.snapshots = self.directory / "snapshots"

    STATE_FILES = ("trainable.safetensors", "training_state.pt", "history.json")

    def prepare(self) -> bool:
        """True if a resumable state with the same fingerprint exists and its files match the
        checksums in its meta.json; else start clean (with a warning when it was damaged)."""
        recover_interrupted_write(self.state_dir)
        for leftover in self.snapshots.glob(".update_*.tmp-*"):  # a snapshot write that was killed
            leftover.unlink()
        problem = self._damage()
        if problem is None:
            return True
        if problem:
            print(
                f"train_policy: warning: the checkpoint in {self.state_dir} is unusable ({problem}); "
                "starting again from update 0.",
                file=sys.stderr,
            )
        if self.directory.exists():
            shutil.rmtree(self.directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        return False

    def _damage(self) -> str | None:
        """None if the state can be resumed; '' if there is none (or of other params); else what is wrong."""
        meta_path = self.state_dir / "meta.json"
        if not meta_path.is_file():
            return ""
        try:
            meta = json.loads(meta_path.read_text())
        except (ValueError, UnicodeDecodeError):
            return "meta.json is not valid JSON"
        if not isinstance(meta, dict) or meta.get("fingerprint") != self.fingerprint:
            return ""
        checksums = meta.get("sha256", {})
        for name in self.STATE_FILES:
            path = self.state_dir / name
            if not path.is_file():
                return f"{name} is missing"
            if checksums.get(name) != sha256_file(path):
                return f"{name} does not match the checksum in meta.json"
        return None

    def save(
        self, update: int, weights: dict[str, Tensor], optimizer_state: dict, kl_state: dict, rng: list, history: list
    ) -> None:
        """Write the state of update ``update``: the trainable weights and the optimizer state (both
        whole, keyed by parameter name, as :mod:`rlhf_pipeline.distributed` gathers them), the KL
        controller, each process's random generators, and the statistics so far."""
        bad = F.non_finite_tensors(weights)
        if bad:  # never replace a good checkpoint with a broken one
            raise NonFiniteError(
                f"The weights after update {update} are not finite ({', '.join(bad[:3])}...). {self.last_good()}"
            )
        with atomic_file(self.snapshots / f"update_{update:05d}.safetensors", "wb") as handle:
            handle.write(save_safetensors({k: v for k, v in weights.items() if k.startswith("lm.")}))
        with atomic_dir(self.state_dir) as tmp:
            save_file(weights, str(tmp / "trainable.safetensors"))
            with open(tmp / "training_state.pt", "wb") as handle:  # a handle: a full disk then surfaces as an OSError
                torch.save({"optimizer": optimizer_state, "kl": kl_state, "rng": rng}, handle)
            (tmp / "history.json").write_text(json.dumps(history))
            checksums = {name: sha256_file(tmp / name) for name in self.STATE_FILES}
            (tmp / "meta.json").write_text(
                json.dumps({"fingerprint": self.fingerprint, "update": update, "sha256": checksums})
            )

    def last_good(self) -> str:
        """What the user still has after a failure, said as it is."""
        meta = self.state_dir / "meta.json"
        if meta.is_file():
            update = json.loads(meta.read_text()).get("update")
            return (
                f"Nothing was written; the last good checkpoint (update {update}, {self.state_dir}) is kept, "
                "and `dvc repro` resumes from it once the cause is fixed."
            )
        return "Nothing was written, and no checkpoint exists yet: the next run starts from update 0."

    def read(self, trainable_names: set[str]) -> dict:
        """What :meth:`save` wrote: weights, optimizer, kl, rng, update, history."""
        weights = load_file(str(self.state_dir / "trainable.safetensors"))
        missing = trainable_names - set(weights)
        if missing:
            raise PipelineError(
                f"Checkpoint {self.state_dir} lacks weights {sorted(missing)[:3]}...; delete {self.directory} to "
                "start over."
            )
        state = torch.load(self.state_dir / "training_state.pt", weights_only=True)
        meta = json.loads((self.state_dir / "meta.json").read_text())
        history = json.loads((self.state_dir / "history.json").read_text())
        return {"weights": weights, **state, "update": meta["update"], "history": history}


def fingerprint_of(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


# --------------------------------------------------------------------------------------------
# the trainer
# --------------------------------------------------------------------------------------------
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
            F.AdaptiveKLController(cfg.kl.init_coef, cfg.kl.target, cfg.kl.horizon)
            if cfg.kl.adaptive
            else F.FixedKLController(cfg.kl.init_coef)
        )
        self.history: list[dict] = []
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
        scores = F.apply_penalty(raw_scores, valid, self.task.penalty_reward)
        t3 = time.perf_counter()
        stats = {"time/generation": t1 - t0, "time/reference": t2 - t1, "time/scoring": t3 - t2}
        # every process's share, in batch order: the rest of the update sees the whole batch
        whole = [queries, sampled.responses, truncated, valid, sampled.logprobs, ref_logprobs, values, scores]
        whole = [distributed.gather_rows(self.accelerator, t) for t in [*whole, sampled.mask]]
        trunk = distributed.gather_rows(self.accelerator, trunk) if trunk is not None else None
        if gold is not None:
            stats["objective/gold"] = distributed.gather_rows(self.accelerator, gold.to(self.device)).mean().item()
        return Rollout(*whole, trunk, stats)

    # ---- 4: rewards and advantages ----------------------------------------------------------
    @torch.no_grad()
    def advantages(self, ro: Rollout) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        mask = ro.mask
        rewards, non_score = F.compute_rewards(
            ro.scores, ro.logprobs, ro.ref_logprobs, self.kl_ctl.value, mask, self.cfg.kl.estimator
        )
        if self.cfg.whiten_rewards:
            rewards = F.whiten(rewards, mask, shift_mean=False)
        advantages, returns = F.gae(rewards, ro.values, self.cfg.gamma, self.cfg.lam, mask)
        advantages = F.whiten(advantages, mask)
        return rewards, non_score, advantages, returns

    # ---- 5: PPO epochs ----------------------------------------------------------------------
    def optimize(self, ro: Rollout, advantages: Tensor, returns: Tensor, update: int) -> dict:
        """``ppo_epochs`` passes of shuffled minibatches over the whole batch, one optimizer step each.

        Each process takes its contiguous share of every minibatch, in microbatches; their gradients
        are summed (accumulated locally, then averaged over processes by DDP/FSDP), so the step is
        the one-process step on the same minibatch."""
        cfg = self.cfg
        lr = F.linear_anneal(update, self.num_updates, cfg.lr) if cfg.anneal_lr else cfg.lr
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
            for shares in F.minibatch_indices(cfg.batch_size, cfg.nminibatches, self.minibatch_share, generator):
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
                        pg_loss, pg_stats = F.policy_loss(
                            logprobs.float(), ro.logprobs[micro], advantages[micro], cfg.cliprange, mask
                        )
                        vf_loss, vf_stats = F.value_loss(
                            vpred.float(), ro.values[micro], returns[micro], cfg.cliprange_value, mask
                        )
                        entropy_mean = F.masked_mean(entropy, mask)
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
        from accelerate.utils import gather_object

        weights = distributed.full_state(self.policy, trainable_only=True)
        optimizer_state = distributed.full_optimizer_state(self.policy, self.optimizer)
        rng = gather_object([rng_state()])
        kl_state, history = self.kl_ctl.state_dict(), self.history

        def write() -> None:
            self.checkpointer.save(update, weights, optimizer_state, kl_state, rng, history)

        distributed.on_main_process(self.accelerator, write, "write the checkpoint")

    def train(self, progress: bool = True) -> list[dict]:
        from tqdm import tqdm

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
            kl_per_seq = (F.kl_penalty(ro.logprobs, ro.ref_logprobs, self.cfg.kl.estimator) * ro.mask).sum(-1)
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
                "val/mean": F.masked_mean(ro.values, ro.mask).item(),
                "returns/mean": F.masked_mean(returns, ro.mask).item(),
                "time/training": time.perf_counter() - t_train,
                "time/update": elapsed,
                "episodes_per_second": self.cfg.batch_size / elapsed,
                **ro.stats,
                **opt_stats,
            }
            if not all(math.isfinite(v) for v in record.values() if isinstance(v, float)):
                raise NonFiniteError(f"Non-finite statistics at update {update}: {record}. {self.last_good()}")
            self.history.append(record)
            if self.log is not None:
                self.log(record)
            bar.update(1)
            bar.set_postfix(score=f"{record['objective/score']:.3f}", kl=f"{mean_kl:.2f}")
            done = update + 1
            if self.checkpointer is not None and (done % self.cfg.checkpoint_every == 0 or done == self.num_updates):
                self.save_checkpoint(done)
        bar.close()
        return self.history


def save_policy(
    policy: PolicyWithValue, tokenizer, directory: str | Path, temperature: float, response_length: int
) -> None:
    """save_pretrained layout (loads with AutoModelForCausalLM) plus the value head.

    ``generation_config.json`` holds the sampling PPO trained with (pure sampling at ``temperature``,
    no top-k/top-p, ``response_length`` new tokens), so a plain ``generate`` samples as in training
    instead of decoding greedily; the tokenizer is saved padding on the left, as batched
    generation needs."""
    directory = Path(directory)
    bad = F.non_finite_tensors(trainable_state(policy))
    if bad:
        raise NonFiniteError(
            f"The trained policy's weights are not finite ({', '.join(bad[:3])}...); {directory} was not written."
        )
    policy.lm.save_pretrained(directory)
    sampling = copy.deepcopy(policy.lm.generation_config)
    sampling.update(
        do_sample=True,
        temperature=temperature,
        top_k=0,
        top_p=1.0,
        max_new_tokens=response_length,
        pad_token_id=tokenizer.pad_token_id,
    )
    sampling.save_pretrained(directory)
    padding_side, tokenizer.padding_side = tokenizer.padding_side, "left"
    try:
        tokenizer.save_pretrained(directory)
    finally:
        tokenizer.padding_side = padding_side
    save_file(
        {k: v.detach().cpu().contiguous() for k, v in policy.value_head.state_dict().items()},
        str(directory / VALUE_HEAD_FILE),
    )
