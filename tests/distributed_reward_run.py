"""Reward-model training as the train_reward stage runs it, on whatever `accelerate launch` started:
``python tests/distributed_reward_run.py BASE OUT``. Process 0 saves the trained model to OUT
(gathered by ``whole_model``, as the stage does) and its history to OUT/history.json."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from rlhf_pipeline.distributed import make_accelerator, whole_model
from rlhf_pipeline.models import freeze_lower_layers, load_tokenizer
from rlhf_pipeline.params.reward import RewardTrainParams
from rlhf_pipeline.reward.adoption import reward_model_on_base
from rlhf_pipeline.reward.model import RewardModel
from rlhf_pipeline.reward.persistence import save_reward_model
from rlhf_pipeline.reward.training import Labels, train_reward_model


def main(base: str, out: str) -> None:
    accelerator = make_accelerator(torch.device("cpu"), stage="train_reward")
    pad = load_tokenizer(base).pad_token_id

    def build(seed: int = 0) -> RewardModel:
        return reward_model_on_base(base, pad, generator=torch.Generator().manual_seed(seed), pooling="mean")

    model = build()
    freeze_lower_layers(model.backbone, 1)  # frozen and trained weights side by side in the FSDP units
    data = torch.Generator().manual_seed(1)
    queries = torch.randint(0, 250, (32, 5), generator=data)
    queries[:4, :2] = pad  # left padding
    samples = torch.randint(0, 250, (32, 4, 4), generator=data)
    best = torch.randint(0, 4, (32,), generator=data)
    cfg = RewardTrainParams(lr=3e-3, epochs=1, batch_size=8, microbatch_size=2, adam_eps=1e-5, max_grad_norm=1.0)
    labels = Labels(queries, samples, best)
    history = train_reward_model(model, labels, cfg, torch.Generator().manual_seed(2), accelerator=accelerator)
    model = whole_model(accelerator, model, lambda: build(seed=99))  # another head init: the gathered weights count
    if model is not None:
        save_reward_model(model, out)
        (Path(out) / "history.json").write_text(json.dumps(history))


if __name__ == "__main__":
    main(*sys.argv[1:])
