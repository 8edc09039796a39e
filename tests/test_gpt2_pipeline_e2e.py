"""The whole pipeline on a second family: a tiny GPT-2 (absolute position embeddings, blocks in
``h``, no pad token, eos = bos), given as a raw local source the way a user brings a model."""

from __future__ import annotations

import json

import pytest
import torch
from families import tiny_config
from test_pipeline_e2e import ALL_STAGES, build_project, ran_stages, sh
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlhf_pipeline.sources import build_tiny_tokenizer, warm_up

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def gpt2_source(tmp_path_factory):
    """A warmed-up tiny GPT-2 with the tiny tokenizer, saved as transformers writes it: no pad token
    of its own (the tokenizer's pad is its eos, which is also its bos)."""
    tokenizer = build_tiny_tokenizer()
    config = tiny_config("gpt2")
    config.vocab_size = len(tokenizer)
    config.bos_token_id = config.eos_token_id = tokenizer.eos_token_id
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    warm_up(model, tokenizer)
    directory = tmp_path_factory.mktemp("gpt2") / "source"
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def test_a_gpt2_base_model_runs_every_stage(gpt2_source, tmp_path):
    smaller = {  # half the tiny run: the mechanics on a second family, not a second measurement
        "data": {
            "corpus": {"num_passages": 120, "passage_tokens": 40, "batch_size": 40},
            # the warmed-up tiny GPT-2 seldom writes "." (0 of 120 passages pass the reference's rules):
            # queries are plain prefixes here; the rules themselves run in the Llama end-to-end test
            "queries": {"start_text": None, "end_text": None},
            "preferences": {"num_labels": 32, "num_test_labels": 8, "batch_size": 32},
            "validation": {"min_rows": 16},
        },
        "ppo": {"total_episodes": 32, "freeze_layers": 1},
        "evaluate": {"num_queries": 8, "batch_size": 8, "num_table_rows": 4},
    }
    root = build_project(tmp_path / "proj", gpt2_source, smaller)
    assert ran_stages(sh(["dvc", "repro"], root)) == ALL_STAGES
    assert sh(["dvc", "status"], root).stdout.strip() in ("", "Data and pipelines are up to date.")

    base = AutoTokenizer.from_pretrained(root / "models/base")
    assert base.pad_token == "<|pad|>" and base.pad_token_id not in (base.eos_token_id, base.bos_token_id)
    policy = AutoModelForCausalLM.from_pretrained(root / "models/policy")
    tokenizer = AutoTokenizer.from_pretrained(root / "models/policy")
    assert type(policy).__name__ == "GPT2LMHeadModel" and tokenizer.padding_side == "left"
    # left padding with absolute positions: the card's batched generate continues a padded row as it
    # does the row alone
    inputs = tokenizer(["The weather is fine.", "A good friend"], return_tensors="pt", padding=True)
    alone = tokenizer(["A good friend"], return_tensors="pt")
    settings = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": tokenizer.pad_token_id}
    batched = policy.generate(**inputs, **settings)[1, inputs["input_ids"].shape[1] :]
    single = policy.generate(**alone, **settings)[0, alone["input_ids"].shape[1] :]
    assert batched.tolist() == single.tolist()

    metrics = json.loads((root / "metrics/evaluate.json").read_text())
    assert metrics["queries"] > 0 and 0.0 <= metrics["valid/policy"] <= 1.0
    policy_metrics = json.loads((root / "metrics/policy.json").read_text())
    assert policy_metrics["updates"] == 2  # 32 episodes of 16
