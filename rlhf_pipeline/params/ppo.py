"""``ppo``: the PPO run that trains the policy against the normalised reward model."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rlhf_pipeline.params import Strict, refuse


class KLParams(Strict):
    adaptive: bool = True
    init_coef: float = Field(0.15, ge=0.0)
    target: float = Field(6.0, gt=0.0)
    horizon: int = Field(10000, gt=0)
    estimator: Literal["k1", "k3"] = "k1"


class PPOParams(Strict):
    total_episodes: int = Field(1_000_000, gt=0, description="Episodes over the whole run, all processes together.")
    batch_size: int = Field(
        512,
        gt=0,
        description="Episodes per rollout/update over all processes (global, as in lm-human-preference-details): "
        "with N processes each samples and scores a contiguous batch_size/N, and the rollout is gathered, so "
        "advantages, whitening and the KL controller see the whole batch and every step equals the one-process step.",
    )
    nminibatches: int = Field(
        1, gt=0, description="Optimizer steps per PPO epoch; each minibatch (batch_size/nminibatches) is global too."
    )
    microbatch_size: int = Field(
        512,
        gt=0,
        description="Episodes per forward/backward on one process (gradient accumulation); memory, not maths. "
        "With N processes it must divide batch_size/nminibatches/N.",
    )
    ppo_epochs: int = Field(4, gt=0)
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
    freeze_layers: int = Field(0, ge=0, description="Freeze embeddings and the lowest K blocks of the policy.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    offload_frozen: bool = Field(False, description="Keep reference/reward models on CPU between uses.")
    checkpoint_every: int = Field(10, gt=0, description="Updates between checkpoints.")
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
        refuse(problems)
        return self
