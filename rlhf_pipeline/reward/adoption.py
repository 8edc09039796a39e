"""Where a reward model comes from: built on the base model's backbone with a fresh head
(:func:`reward_model_on_base`, what train_reward trains), or adopted from an existing one-label
sequence classifier (:func:`adopt_sequence_classifier`, ``reward.pretrained``)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from rlhf_pipeline.errors import PipelineError
from rlhf_pipeline.io import LOCAL_MODELS, local_model_dir
from rlhf_pipeline.models import set_dropout, transformer_layers
from rlhf_pipeline.reward.model import RewardModel, init_reward_head
from rlhf_pipeline.reward.persistence import OFFSET_KEY


def reward_model_on_base(
    base_dir: str | Path,
    pad_token_id: int,
    dropout: float = 0.0,
    generator: torch.Generator | None = None,
    pooling: str = "last",
    num_layers: int | None = None,
) -> RewardModel:
    """A reward model on the base model's backbone, or (``num_layers``) on its lowest blocks only:
    the head then reads the final norm of the state after block ``num_layers``."""
    from transformers import AutoModel

    backbone = AutoModel.from_pretrained(str(base_dir), dtype=torch.float32)
    if num_layers is not None:
        layers = transformer_layers(backbone, "reward.train.num_layers")
        if not 0 <= num_layers <= len(layers):
            raise PipelineError(f"reward.train.num_layers is {num_layers} but the base model has {len(layers)} blocks.")
        del layers[num_layers:]
        backbone.config.num_hidden_layers = num_layers
        if isinstance(getattr(backbone.config, "layer_types", None), list):
            backbone.config.layer_types = backbone.config.layer_types[:num_layers]
    set_dropout(backbone, dropout)
    model = RewardModel(backbone, pad_token_id, pooling)
    init_reward_head(model.head, generator)
    return model


def adopt_sequence_classifier(source: str, tokenizer) -> RewardModel:
    """Adopt an existing one-label ``AutoModelForSequenceClassification`` (local directory or hub
    id) that shares the base model's tokenizer: its backbone, its ``score`` as the head (bias 0
    where it has none), gain 1 and bias ``config.reward_offset`` (0 where unset), last-token pooling.
    The pipeline's dedicated pad token gets an embedding row if the model lacks one (pads are
    never attended)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    where = f"reward.pretrained ({source!r})"
    local_model_dir(source, "reward.pretrained")  # a local folder must be one DVC tracks
    try:
        stock = AutoModelForSequenceClassification.from_pretrained(source, dtype=torch.float32)
        theirs = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as error:
        raise PipelineError(
            f"{where} could not be loaded as a sequence-classification model with its tokenizer: {error}. "
            f"Give a local directory in {LOCAL_MODELS}/ or a hub id already in the local Hugging Face cache (the "
            "pipeline runs offline) holding config.json, the weights and the tokenizer files."
        ) from None
    if stock.config.num_labels != 1:
        raise PipelineError(f"{where} has {stock.config.num_labels} labels; a reward model has one (a scalar).")
    ours = tokenizer.get_vocab()
    differing = sorted(t for t, i in theirs.get_vocab().items() if ours.get(t) != i)
    if differing:
        raise PipelineError(
            f"{where} uses a different tokenizer from the base model: {len(differing)} of its "
            f"{len(theirs)} tokens have another id or none in the base tokenizer (e.g. {differing[:5]}). "
            "The reward model scores the policy's token ids, so it must share the base model's vocabulary."
        )
    head = getattr(stock, "score", None)
    if not isinstance(head, nn.Linear):
        raise PipelineError(
            f"{where} is a {type(stock).__name__}, whose head is not a linear `score` layer on the last "
            "token's state (the decoder-model classifiers' layout), so it cannot be adopted as is."
        )
    backbone = stock.base_model
    if backbone.get_input_embeddings().num_embeddings < len(tokenizer):
        backbone.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    model = RewardModel(backbone, tokenizer.pad_token_id, "last")
    with torch.no_grad():
        model.head.weight.copy_(head.weight)
        model.head.bias.copy_(head.bias if head.bias is not None else torch.zeros(1))
        model.bias.fill_(float(getattr(stock.config, OFFSET_KEY, 0.0) or 0.0))
    return model
