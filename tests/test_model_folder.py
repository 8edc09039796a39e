"""A user's model folder built to hurt (base_model.source, reward.pretrained): refused before it
loads, exit 2 and one paragraph naming the file, within 1 GB of memory."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from rlhf_pipeline.errors import ParamsError
from rlhf_pipeline.model_folder import admit_model_folder
from rlhf_pipeline.sources import build_tiny_model

PEAK_LIMIT_MB = 1024


def hostile_folders(root: Path) -> dict[str, tuple[Path, str, str]]:
    """case -> (folder, auto class, what the refusal must say)."""
    good = build_tiny_model(root / "good")
    cases: dict[str, tuple[Path, str, str]] = {}

    def variant(name: str, message: str, auto_class: str = "AutoModelForCausalLM") -> Path:
        folder = root / name.replace(" ", "_")
        shutil.copytree(good, folder)
        cases[name] = (folder, auto_class, message)
        return folder

    folder = variant("an adapter beside the weights", "holds adapter_config.json: a peft adapter")
    (folder / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8, "target_modules": ["q_proj"]}')
    save_file(
        {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(8, 64)},
        str(folder / "adapter_model.safetensors"),
    )
    config = json.loads((good / "config.json").read_text())
    huge = {**config, "hidden_size": 16384, "intermediate_size": 65536, "num_hidden_layers": 200}
    huge["num_attention_heads"] = 128
    folder = variant("a config of wide, deep layers and no weights", "holds no safetensors weights")
    (folder / "config.json").write_text(json.dumps(huge))
    (folder / "model.safetensors").unlink()
    folder = variant("a config of wide, deep layers", "GiB in fp32, as the pipeline loads them), more than")
    (folder / "config.json").write_text(json.dumps(huge))
    folder = variant("a config of a million blocks", "describes 1,000,000 blocks")
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1_000_000}))
    folder = variant("a 500 MB tokenizer.json", "holds a tokenizer.json of 524,288,000 bytes")
    with open(folder / "tokenizer.json", "r+b") as handle:
        handle.truncate(500 << 20)  # sparse: the size is what counts
    folder = variant("weights holding none of the model's tensors", "holds weights without")
    save_file({"something.else": torch.zeros(3)}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    folder = variant(
        "an extra tensor", "tensor(s) the LlamaForCausalLM of its config.json has no place for: extra.bias"
    )
    from safetensors.torch import load_file

    weights = load_file(str(folder / "model.safetensors"))
    save_file({**weights, "extra.bias": torch.zeros(2)}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    folder = variant("pickled weights", "holds pytorch_model.bin: pickled weights")
    torch.save({"model.norm.weight": torch.ones(64)}, folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    folder = variant("a safetensors header bomb", "cannot be read as a AutoModelForCausalLM")
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + b"{" + b" " * 64)
    folder = variant(
        "a pickled reward model", "holds pytorch_model.bin: pickled weights", "AutoModelForSequenceClassification"
    )
    torch.save({"score.weight": torch.ones(1, 64)}, folder / "pytorch_model.bin")
    return cases


def test_hostile_model_folders_are_refused_before_loading_within_1_gb(tmp_path):
    cases = hostile_folders(tmp_path)
    script = (
        "import json, sys\n"
        "from rlhf_pipeline.errors import ParamsError\n"
        "from rlhf_pipeline.model_folder import admit_model_folder\n"
        "results = {}\n"
        "for name, (folder, auto_class) in json.loads(sys.argv[1]).items():\n"
        "    try:\n"
        "        admit_model_folder(folder, 'base_model.source', auto_class)\n"
        "        results[name] = [0, 'admitted']\n"
        "    except ParamsError as error:\n"
        "        results[name] = [error.exit_code, str(error)]\n"
        # this process's own peak (not ru_maxrss, which under xdist read the pytest worker's 1 GB)
        "from rlhf_pipeline.allocator import peak_rss_mb\n"
        "print(json.dumps({'results': results, 'peak_mb': peak_rss_mb()}))\n"
    )
    arguments = json.dumps({name: [str(folder), auto_class] for name, (folder, auto_class, _) in cases.items()})
    done = subprocess.run([sys.executable, "-c", script, arguments], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    for name, (_, _, message) in cases.items():
        code, text = report["results"][name]
        assert code == 2 and message in text, (name, text)
        assert "Traceback" not in text and "\n" not in text
    assert report["peak_mb"] <= PEAK_LIMIT_MB, report["peak_mb"]


def test_a_real_model_folder_is_admitted_and_its_fp32_size_returned(tmp_path):
    folder = build_tiny_model(tmp_path / "tiny")
    assert admit_model_folder(folder, "base_model.source") == 4 * sum(
        p.numel() for p in __import__("transformers").AutoModelForCausalLM.from_pretrained(folder).parameters()
    )


def test_the_base_model_stage_refuses_a_planted_adapter_with_exit_2(tmp_path, monkeypatch):
    from rlhf_pipeline.sources import load_source_model

    monkeypatch.chdir(tmp_path)
    folder = build_tiny_model(tmp_path / "data/models/tiny")
    (folder / "adapter_config.json").write_text("{}")
    with pytest.raises(ParamsError, match="data/models/tiny holds adapter_config.json: a peft adapter") as info:
        load_source_model("data/models/tiny")
    assert info.value.exit_code == 2


def test_every_tiny_family_and_its_classifier_is_admitted(tmp_path):
    """No false refusal: each architecture the pipeline supports, saved by transformers, passes as a
    base model and as a sequence-classification reward model (key conversions, tied heads)."""
    from families import FAMILIES, tiny_causal_lm, tiny_config
    from transformers import AutoModelForSequenceClassification

    for family in FAMILIES:
        tiny_causal_lm(family).save_pretrained(tmp_path / family)
        assert admit_model_folder(tmp_path / family, "base_model.source") > 0, family
        config = tiny_config(family)
        config.num_labels = 1
        AutoModelForSequenceClassification.from_config(config).save_pretrained(tmp_path / f"{family}-reward")
        auto_class = "AutoModelForSequenceClassification"
        assert admit_model_folder(tmp_path / f"{family}-reward", "reward.pretrained", auto_class) > 0, family
