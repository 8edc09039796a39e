"""The base_model stage on the tiny model: pad token, dropout, fp32 safetensors, model card."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import add_pipeline_definition, full_params

from rlhf_pipeline.modelcard import read_card as read_model_card
from rlhf_pipeline.models import load_tokenizer
from rlhf_pipeline.tiny import build_tiny_model

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def stage_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("base_stage")
    build_tiny_model(root / "tiny_src")
    # the source's own card says where it came from: the base model's card carries that on, in hub form
    (root / "tiny_src/README.md").write_text("---\nbase_model: example-org/tiny-llama\nlicense: mit\n---\n\n# Tiny\n")
    (root / "params.yaml").write_text(
        yaml.safe_dump(full_params({"base_model": {"source": str(root / "tiny_src"), "dropout": 0.0}}))
    )
    add_pipeline_definition(root)
    result = subprocess.run(
        [sys.executable, str(REPO / "stages/base_model.py")], cwd=root, capture_output=True, text=True, timeout=300
    )
    return root, result


def test_stage_adds_a_dedicated_pad_token(stage_run):
    root, result = stage_run
    assert result.returncode == 0, result.stderr
    tokenizer = load_tokenizer(root / "models/base")
    assert tokenizer.pad_token == "<|pad|>" and tokenizer.pad_token_id != tokenizer.eos_token_id
    config = json.loads((root / "models/base/config.json").read_text())
    assert config["pad_token_id"] == tokenizer.pad_token_id
    assert config["vocab_size"] >= tokenizer.pad_token_id + 1
    assert "quantization_config" not in config
    assert (root / "models/base/model.safetensors").is_file()


def test_model_card_front_matter(stage_run):
    root, _ = stage_run
    card = read_model_card(root / "models/base")
    source_weights = root / "tiny_src/model.safetensors"
    import hashlib

    assert card["source"] == str(root / "tiny_src")
    assert card["source_sha256"] == hashlib.sha256(source_weights.read_bytes()).hexdigest()
    assert card["parameters"] > 10_000
    assert card["base_model"] == "example-org/tiny-llama" and card["license"] == "mit"  # from the source's card
    assert card["pipeline_tag"] == "text-generation" and "tmp-" not in (root / "models/base/README.md").read_text()
    assert 'AutoModelForCausalLM.from_pretrained("models/base")' in (root / "models/base/README.md").read_text()
    assert not list((root / "models").glob(".base.tmp-*")), "no temporary directory left behind"


def test_missing_local_source_fails_fast_with_a_clear_message(tmp_path):
    (tmp_path / "params.yaml").write_text(
        yaml.safe_dump(full_params({"base_model": {"source": "no-such-org/no-such-model"}}))
    )
    add_pipeline_definition(tmp_path)
    result = subprocess.run(
        [sys.executable, str(REPO / "stages/base_model.py")], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 1
    assert "no-such-org/no-such-model" in result.stderr and "HF_HUB_OFFLINE" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "models").exists()


def test_dropout_param_is_applied(tmp_path):
    build_tiny_model(tmp_path / "src")
    (tmp_path / "params.yaml").write_text(
        yaml.safe_dump(full_params({"base_model": {"source": str(tmp_path / "src"), "dropout": 0.25}}))
    )
    add_pipeline_definition(tmp_path)
    result = subprocess.run(
        [sys.executable, str(REPO / "stages/base_model.py")], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert json.loads((tmp_path / "models/base/config.json").read_text())["attention_dropout"] == 0.25
