"""``reward``: training the reward model on the labels (or adopting one), then normalising it."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rlhf_pipeline.params import MAX_BATCH, MAX_ROWS, MAX_SMALL, Strict, refuse

RewardPooling = Literal["last", "mean"]  # reward-head input; rlhf_pipeline.reward reads the choices from here


class RewardTrainParams(Strict):
    lr: float = Field(5.0e-5, gt=0.0)
    epochs: int = Field(1, gt=0, le=MAX_SMALL, description="Reference: one epoch, LR annealed linearly to 0.")
    batch_size: int = Field(
        32,
        gt=0,
        le=MAX_BATCH,
        description="Labels per optimizer step, over all processes (global, as in the references): with N "
        "processes each takes a contiguous batch_size/N of every batch, and the step equals the one-process step.",
    )
    microbatch_size: int = Field(
        32,
        gt=0,
        le=MAX_BATCH,
        description="Labels per forward/backward on one process (gradient accumulation); memory, not maths.",
    )
    adam_eps: float = Field(1.0e-5, gt=0.0)
    tensorflow_adam: bool = Field(
        True,
        description="Adam with epsilon added to sqrt(v) before bias correction, as TensorFlow "
        "(OAI) and LHPD's use_tensorflow_adam; false: torch.optim.Adam.",
    )
    train_gain_bias: bool = Field(
        True,
        description="Train the reward gain and bias with the model (both references do); "
        "false keeps them at the normalize_before values.",
    )
    num_layers: int | None = Field(
        None,
        ge=0,
        le=MAX_SMALL,
        description="Keep only the base model's lowest N blocks (null: all, the reference); "
        "the head then reads the final norm of block N's output.",
    )
    freeze_layers: int = Field(
        0, ge=0, le=MAX_SMALL, description="Freeze embeddings and the lowest K transformer blocks."
    )
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    normalize_before: bool = True
    normalize_before_samples: int = Field(256, gt=0, le=MAX_ROWS)
    margin_column: str | None = Field("margin", description="Optional per-row margin column (pairwise data).")
    pooling: RewardPooling = Field(
        "last", description="Head input: the last token's hidden state (reference) or the mean over response tokens."
    )
    max_grad_norm: float | None = Field(None, gt=0.0)
    collective_timeout_s: float = Field(
        1800.0,
        gt=0.0,
        le=604_800.0,  # a week
        description="Several processes: seconds one process waits in a collective for the others before "
        "the stage stops with an error (as ppo.collective_timeout_s). Not a reference detail.",
    )

    @model_validator(mode="after")
    def _microbatches_fit(self) -> RewardTrainParams:
        if self.batch_size % self.microbatch_size:
            refuse(
                [
                    (
                        "microbatch_size",
                        f"must divide reward.train.batch_size ({self.batch_size})",
                        self.microbatch_size,
                    )
                ]
            )
        return self


class RewardNormalizeParams(Strict):
    normalize_samples: int = Field(
        256,
        gt=0,
        le=MAX_ROWS,
        description="Base-model samples used to fit gain and bias, on train queries drawn without replacement "
        "(reshuffled when they run out): the train split's size draws every query once.",
    )
    eval_samples: int = Field(
        256,
        gt=0,
        le=MAX_ROWS,
        description="Fresh base-model samples (fresh responses to redrawn train queries) to check the fit.",
    )
    truncate: bool = Field(
        False,
        description="Fit on responses truncated at task.truncate_token, as PPO scores them; false: on the "
        "raw fixed-length responses, as both references do (also for reward.train.normalize_before).",
    )
    target_mean: float = 0.0
    target_std: float = Field(1.0, gt=0.0)
    batch_size: int = Field(32, gt=0, le=MAX_BATCH)


class RewardParams(Strict):
    pretrained: str | None = Field(
        None,
        description="An existing sequence-classification reward model (a local directory under data/models/, a DVC "
        "dependency of train_reward, or a hub id; one label, the base model's tokenizer) to use instead of training "
        "one: train_reward adopts it (last-token pooling) and measures it on the test labels; normalize_reward then "
        "fits gain and bias as usual. null: train the reward model (the reference).",
    )
    train: RewardTrainParams = RewardTrainParams()
    normalize: RewardNormalizeParams = RewardNormalizeParams()
