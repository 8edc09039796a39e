"""A reward model on disk: the folder :func:`save_reward_model` writes and :func:`load_reward_model`
reads, and the stock Hugging Face sequence classifier it exports (:func:`stock_classifier`).

The folder holds the backbone as Hugging Face files, the project's head file (raw head, gain, bias)
and ``reward_config.json`` (pad id, gain, bias, pooling). ``pooling='last'`` is saved as a stock
``<Arch>ForSequenceClassification``, so ``AutoModelForSequenceClassification`` loads it too;
``pooling='mean'`` has no stock class and keeps its backbone in ``backbone/``.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from rlhf_pipeline.errors import PipelineError
from rlhf_pipeline.reward.model import RewardModel

HEAD_FILE = "reward_head.safetensors"
CONFIG_FILE = "reward_config.json"
BACKBONE_DIR = "backbone"  # where a mean-pooling model's backbone goes (no stock class computes it)
POOLING_DESCRIPTIONS = {"last": "last non-pad token", "mean": "mean over response tokens"}
# config.json of a mean-pooling model: no stock class computes its score, so a stock load must fail.
# transformers' refusal quotes the model type first, then suggests upgrading transformers: the type
# says first that no version reads it and which loader does.
UNLOADABLE_MODEL_TYPE = (
    "rlhf_pipeline mean-pooled reward model: no transformers version loads it; "
    "use rlhf_pipeline.reward.persistence.load_reward_model(path)"
)
OFFSET_KEY = "reward_offset"  # in config.json of a stock export: normalised score = logits + this


def save_reward_model(model: RewardModel, directory: str | Path) -> None:
    """Write ``model`` to ``directory``: the backbone and head as Hugging Face files, and the
    project's own head file (raw head, gain, bias), which :func:`load_reward_model` reads.

    ``pooling='last'`` writes a stock ``<Arch>ForSequenceClassification`` (see
    :func:`stock_classifier`), so ``AutoModelForSequenceClassification`` loads it.
    ``pooling='mean'`` has no stock class: the backbone goes in ``backbone/`` and the folder's
    ``config.json`` names a model type no library knows, so a stock load fails loudly, naming the
    loader, instead of adding a random head.
    """
    directory = Path(directory)
    if model.pooling == "last":
        stock_classifier(model).save_pretrained(directory)
    else:
        model.backbone.save_pretrained(directory / BACKBONE_DIR)
        (directory / "config.json").write_text(json.dumps({"model_type": UNLOADABLE_MODEL_TYPE}, indent=2) + "\n")
    tensors = {
        "head.weight": model.head.weight.detach().cpu().contiguous(),
        "head.bias": model.head.bias.detach().cpu().contiguous(),
        "gain": model.gain.detach().cpu().reshape(1),
        "bias": model.bias.detach().cpu().reshape(1),
    }
    save_file(tensors, str(directory / HEAD_FILE))
    stock = {"stock_class": f"AutoModelForSequenceClassification, plus config.{OFFSET_KEY}"}
    (directory / CONFIG_FILE).write_text(
        json.dumps(
            {
                "pad_token_id": model.pad_token_id,
                "gain": model.gain.item(),
                "bias": model.bias.item(),
                "pooling": model.pooling,
                "head": POOLING_DESCRIPTIONS[model.pooling],
                **(stock if model.pooling == "last" else {"backbone": BACKBONE_DIR}),
            },
            indent=2,
        )
        + "\n"
    )


def load_reward_model(directory: str | Path, device: torch.device | str = "cpu") -> RewardModel:
    """The reward model :func:`save_reward_model` wrote to ``directory``, in eval mode on ``device``,
    with the folder's tokenizer (so :meth:`RewardModel.score` takes text) when it has one."""
    from transformers import AutoModel, AutoTokenizer  # heavy: loaded when a model is

    directory = Path(directory)
    if not (directory / HEAD_FILE).is_file():
        raise PipelineError(
            f"'{directory}' is not a reward model directory (no {HEAD_FILE}); run `dvc repro train_reward` first."
        )
    config = json.loads((directory / CONFIG_FILE).read_text())
    # mean pooling keeps the backbone in backbone/; last pooling is a stock sequence classifier,
    # whose backbone AutoModel reads (its score.weight is the head file's gain * weight)
    backbone_dir = directory / BACKBONE_DIR if (directory / BACKBONE_DIR).is_dir() else directory
    backbone = AutoModel.from_pretrained(str(backbone_dir), dtype=torch.float32)
    model = RewardModel(backbone, config["pad_token_id"], config.get("pooling", "last"))
    tensors = load_file(str(directory / HEAD_FILE))
    with torch.no_grad():
        model.head.weight.copy_(tensors["head.weight"])
        model.head.bias.copy_(tensors["head.bias"])
        model.gain.copy_(tensors["gain"][0])
        model.bias.copy_(tensors["bias"][0])
    if (directory / "tokenizer_config.json").is_file():
        model.tokenizer = AutoTokenizer.from_pretrained(str(directory))
    return model.to(device).eval()


def reward_offset(model: RewardModel) -> float:
    """The constant of the normalised score: ``gain * head.bias + bias``."""
    return (model.gain * model.head.bias[0] + model.bias).item()


def stock_classifier(model: RewardModel):
    """The stock ``<Arch>ForSequenceClassification`` (one label) on ``model``'s backbone, scoring the
    last non-pad token with ``score.weight = gain * head.weight``: the normalised score minus
    :func:`reward_offset`, which ``config.reward_offset`` records. The stock head of Llama-family
    models has no bias, and the final RMSNorm before it leaves no constant direction to carry one, so
    the constant cannot be folded into the weights. Inputs must not be left-padded: the stock
    class numbers positions from the first column, this model from the first real token.
    """
    from transformers import AutoModelForSequenceClassification

    if model.pooling != "last":
        raise ValueError(f"pooling={model.pooling!r} has no stock Hugging Face class; only 'last' does")
    config = copy.deepcopy(model.backbone.config)
    config.num_labels, config.architectures, config.pad_token_id = 1, None, model.pad_token_id
    setattr(config, OFFSET_KEY, reward_offset(model))
    stock = AutoModelForSequenceClassification.from_config(config, dtype=model.head.weight.dtype)
    stock.base_model.load_state_dict(model.backbone.state_dict())
    with torch.no_grad():
        stock.score.weight.copy_(model.gain * model.head.weight)
    return stock.eval()
