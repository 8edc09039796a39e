"""``ppo``: the PPO run that trains the policy against the normalised reward model."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rlhf_pipeline.params import MAX_BATCH, MAX_ROWS, MAX_SMALL, Strict, refuse


class KLParams(Strict):
    adaptive: bool = True
    init_coef: float = Field(0.15, ge=0.0)
    target: float = Field(6.0, gt=0.0)
    horizon: int = Field(10000, gt=0, le=MAX_ROWS)
    estimator: Literal["k1", "k3"] = "k1"


class LoraParams(Strict):
    """A LoRA adapter (peft) on the policy instead of a full fine-tune: the reference log-probs come
    from the same model with the adapter off (no second copy), and models/policy is saved merged."""

    rank: int = Field(8, gt=0, le=MAX_SMALL, description="LoRA rank r.")
    alpha: float = Field(
        16.0,
        gt=0.0,
        le=MAX_SMALL,
        description="LoRA alpha: the update is scaled by alpha / rank (peft's default is 8; a scale in the "
        "thousands already overflows the first steps).",
    )
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the adapter's input.")
    target_modules: Literal["all-linear"] | list[str] = Field(
        "all-linear",
        description="'all-linear': every linear layer of the transformer blocks (not the LM head); or a list of "
        "module names (e.g. [q_proj, v_proj]). Only the blocks above ppo.freeze_layers get an adapter.",
    )


ADVANTAGE_ESTIMATORS = ("gae", "rloo", "grpo")
CRITIC_FREE = ("rloo", "grpo")  # estimators that learn no value function


class PPOParams(Strict):
    total_episodes: int = Field(
        1_000_000, gt=0, le=MAX_ROWS, description="Episodes over the whole run, all processes together."
    )
    batch_size: int = Field(
        512,
        gt=0,
        le=MAX_BATCH,
        description="Episodes per rollout/update over all processes (global, as in lm-human-preference-details): "
        "with N processes each samples and scores a contiguous batch_size/N, and the rollout is gathered, so "
        "advantages, whitening and the KL controller see the whole batch and every step equals the one-process step.",
    )
    nminibatches: int = Field(
        1,
        gt=0,
        le=MAX_BATCH,
        description="Optimizer steps per PPO epoch; each minibatch (batch_size/nminibatches) is global too.",
    )
    microbatch_size: int = Field(
        512,
        gt=0,
        le=MAX_BATCH,
        description="Episodes per forward/backward on one process (gradient accumulation); memory, not maths. "
        "With N processes it must divide batch_size/nminibatches/N.",
    )
    ppo_epochs: int = Field(4, gt=0, le=MAX_SMALL)
    lr: float = Field(1.0e-5, gt=0.0)
    anneal_lr: bool = True
    adam_eps: float = Field(1.0e-5, gt=0.0)
    tensorflow_adam: bool = Field(
        True,
        description="Adam with epsilon added to sqrt(v) before bias correction (TensorFlow, OAI); false: "
        "torch.optim.Adam.",
    )
    max_grad_norm: float | None = Field(None, gt=0.0)
    gamma: float = Field(1.0, ge=0.0, le=1.0)
    lam: float = Field(0.95, ge=0.0, le=1.0)
    cliprange: float = Field(0.2, gt=0.0)
    cliprange_value: float = Field(0.2, gt=0.0)
    vf_coef: float = Field(0.1, ge=0.0)
    entropy_coef: float = Field(0.0, ge=0.0)
    whiten_rewards: bool = True
    advantage: Literal["gae", "rloo", "grpo"] = Field(
        "gae",
        description="Advantage estimator: gae (a value head and GAE, the reference); rloo (each response's return "
        "minus the mean return of the other samples of its query) or grpo (the return standardised within its "
        "query's samples): critic-free, no value head, no value loss; both need samples_per_query >= 2.",
    )
    samples_per_query: int = Field(
        1,
        gt=0,
        le=MAX_SMALL,
        description="Responses sampled per query in a rollout (sharing one prefill); batch_size counts responses, "
        "so an update sees batch_size / samples_per_query queries. Reference: 1.",
    )
    lora: LoraParams | None = Field(None, description="null: full fine-tune (the reference); else a LoRA adapter.")
    seed: int | None = Field(
        None,
        ge=0,
        le=2**32 - 1,
        description="PPO's own random streams (episode order, sampling, minibatches); null: the root seed. Another "
        "value reruns PPO alone, on the same reward model and evaluation queries.",
    )
    kl: KLParams = KLParams()
    score_source: Literal["reward_model", "gold"] = Field(
        "reward_model",
        description="What scores a response: the trained reward model, or (an ablation, as Gao et al. 2022 do "
        "with their gold model) the simulated labeler's own score, standardised on the labelled base-model samples: "
        "what PPO "
        "reaches with a perfect reward on this budget. 'gold' needs data.preferences.source: simulated.",
    )
    value_model: Literal["shared", "separate"] = Field(
        "shared",
        description="shared: zero-init scalar head on the policy backbone (reference); "
        "separate: a value model initialised from the reward model (TRL style).",
    )
    freeze_layers: int = Field(
        0, ge=0, le=MAX_SMALL, description="Freeze embeddings and the lowest K blocks of the policy."
    )
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    offload_frozen: bool = Field(False, description="Keep reference/reward models on CPU between uses.")
    checkpoint_every: int = Field(10, gt=0, le=MAX_ROWS, description="Updates between checkpoints.")
    deterministic: bool = Field(True, description="torch deterministic algorithms (bit-identical resume on CPU).")

    @model_validator(mode="after")
    def _batches_fit(self) -> PPOParams:
        problems = []
        if self.batch_size % self.nminibatches:
            problems.append(("nminibatches", f"must divide ppo.batch_size ({self.batch_size})", self.nminibatches))
        elif (minibatch := self.batch_size // self.nminibatches) % self.microbatch_size:
            problems.append(
                (
                    "microbatch_size",
                    f"must divide the minibatch size batch_size/nminibatches ({minibatch})",
                    self.microbatch_size,
                )
            )
        if self.total_episodes < self.batch_size:
            problems.append(("total_episodes", f"must be >= ppo.batch_size ({self.batch_size})", self.total_episodes))
        if self.advantage in CRITIC_FREE and self.samples_per_query < 2:
            problems.append(
                (
                    "samples_per_query",
                    f"must be >= 2 for ppo.advantage {self.advantage!r} (its baseline is the other samples of the "
                    "same query)",
                    self.samples_per_query,
                )
            )
        if self.batch_size % self.samples_per_query:
            problems.append(
                (
                    "samples_per_query",
                    f"must divide ppo.batch_size ({self.batch_size}): a rollout holds whole groups of samples",
                    self.samples_per_query,
                )
            )
        if self.advantage in CRITIC_FREE and self.value_model == "separate":
            problems.append(
                (
                    "value_model",
                    f"'separate' builds a value model, which ppo.advantage {self.advantage!r} has no use "
                    "for; set it to 'shared' (ignored) or use ppo.advantage 'gae'",
                    self.value_model,
                )
            )
        refuse(problems)
        return self

    @property
    def critic_free(self) -> bool:
        return self.advantage in CRITIC_FREE

    def process_split_problem(self, world_size: int) -> str | None:
        """Why the batch cannot be shared by ``world_size`` processes (None when it can): each
        process takes an equal share of every minibatch, in microbatches, and whole groups of a
        query's ``samples_per_query`` responses (the critic-free baselines need the group together)."""
        share, rest = divmod(self.batch_size, self.nminibatches * world_size)
        queries = self.batch_size // self.samples_per_query
        if not rest and not share % self.microbatch_size and not queries % world_size:
            return None
        return (
            f"ppo.batch_size ({self.batch_size}) must split into ppo.nminibatches ({self.nminibatches}) minibatches, "
            f"each shared evenly by the {world_size} process(es) in shares that ppo.microbatch_size "
            f"({self.microbatch_size}) divides, and its {queries} queries (of ppo.samples_per_query "
            f"{self.samples_per_query} responses each) evenly over the processes"
        )
