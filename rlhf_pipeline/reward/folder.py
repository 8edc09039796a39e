"""A reward-model stage's output folder: the model (:func:`~rlhf_pipeline.reward.persistence.save_reward_model`),
its tokenizer and its model card, written together by :func:`write_reward_folder`.

Its own module, not :mod:`rlhf_pipeline.reward.persistence`: ``evaluate``, which only loads a reward
model and writes no card, would otherwise depend on the model card's code too, and an edit to the card
would rerun it.
"""

from __future__ import annotations

import os

from rlhf_pipeline.modelcard import write_card
from rlhf_pipeline.models import save_tokenizer
from rlhf_pipeline.reward.model import RewardModel
from rlhf_pipeline.reward.persistence import save_reward_model


def write_reward_folder(directory: str | os.PathLike, model: RewardModel, tokenizer, *, chat: bool, **card) -> None:
    """Write ``model``, ``tokenizer`` and a ``reward`` model card into ``directory`` (a stage's
    temporary folder: :func:`rlhf_pipeline.io.atomic_dir`). ``chat``: the prompts were rendered with
    the tokenizer's chat template (``task.chat``), which the card then records; ``card``: the rest of
    :func:`rlhf_pipeline.modelcard.write_card`'s keywords (``target``, ``title``, ``summary``, ...)."""
    save_reward_model(model, directory)
    save_tokenizer(tokenizer, directory)
    write_card(
        directory,
        kind="reward",
        reward_pooling=model.pooling,
        chat_template=tokenizer.chat_template if chat else None,
        **card,
    )
