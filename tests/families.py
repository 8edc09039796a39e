"""Tiny random models of the common decoder families, built in-process from `transformers` config
classes (nothing downloaded): the architectures users bring, small enough for unit tests.

``WINDOW`` is the sliding attention window of the families that have one, small on purpose so
that test rows are longer than it."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

VOCAB = 300
WINDOW = 8

# model_type -> config fields beyond the shared ones (vocab, width, depth, heads)
FAMILIES: dict[str, dict] = {
    "llama": {},
    "gpt2": {"n_embd": 32, "n_layer": 2, "n_head": 2, "n_positions": 128},
    "opt": {"ffn_dim": 64, "word_embed_proj_dim": 32},
    "gpt_neox": {},
    "qwen2": {},
    "phi3": {"pad_token_id": 0},
    "mistral": {"sliding_window": WINDOW},
    "gemma2": {"sliding_window": WINDOW, "head_dim": 16},
    "gemma3_text": {"sliding_window": WINDOW, "head_dim": 16},
}
SLIDING = ("mistral", "gemma2", "gemma3_text")


def tiny_config(model_type: str):
    shared = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
    }
    if model_type == "gpt2":
        shared = {"vocab_size": VOCAB}
    config = AutoConfig.for_model(model_type, **shared, **FAMILIES[model_type])
    if model_type in ("gemma2", "gemma3_text"):  # alternate sliding and full layers, as the real ones do
        config.layer_types = ["sliding_attention", "full_attention"]
    return config


def tiny_backbone(model_type: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return AutoModel.from_config(tiny_config(model_type), dtype=torch.float32).eval()


def tiny_causal_lm(model_type: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(model_type), dtype=torch.float32).eval()
