"""A tiny randomly initialised Llama and byte-level BPE tokenizer, built in-process.

Tests, the end-to-end check and the quick-look profile (``base_model.source: tiny-llama``) use
it instead of downloading anything. Like SmolLM2, its
tokenizer ships with pad == eos, so the base_model stage's pad-token handling is exercised.
"""

from __future__ import annotations

import os
from pathlib import Path

TINY_TEXT = [
    "The movie was wonderful. I loved every minute of it. The actors were great.",
    "This was a terrible day. Everything went wrong. I hate the rain and the cold.",
    "She walked to the market. He bought bread and milk. They went home happy.",
    "The weather is fine. The sky is blue. Birds sing in the trees every morning.",
    "What a sad and awful story. Nobody was kind. The end was bad and boring.",
    "A good friend is a great gift. We laughed a lot. It was the best night ever.",
]


def build_tiny_tokenizer(vocab_size: int = 320):
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(TINY_TEXT * 20, vocab_size=vocab_size, min_frequency=1, special_tokens=["<|endoftext|>"])
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe._tokenizer,
        eos_token="<|endoftext|>",
        bos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
    )


def build_tiny_model(directory: str | os.PathLike, seed: int = 0, layers: int = 2, hidden: int = 64) -> Path:
    """Save a tiny Llama (``layers`` blocks, hidden ``hidden``) and its tokenizer to ``directory``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def warm_up(model, tokenizer, steps: int = 100, seed: int = 0) -> None:
    """A few optimizer steps on the tiny corpus, so the tiny model writes words and periods.

    A randomly initialised byte-level model samples control bytes and broken UTF-8 about half
    the time, which the preference data contract (rightly) refuses and which never yields a
    query; a model that has seen TINY_TEXT for a second behaves like a (very small) real one.
    """
    import torch

    torch.manual_seed(seed)
    batch = tokenizer(TINY_TEXT, add_special_tokens=False, padding=True, return_tensors="pt")
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-2)
    model.train()
    for _ in range(steps):
        loss = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
