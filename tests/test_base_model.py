"""The base_model stage on the tiny model: pad token, dropout, fp32 safetensors, model card."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import add_pipeline_definition, full_params, run_stage_script

from rlhf_pipeline.io import content_hash
from rlhf_pipeline.modelcard import read_card as read_model_card
from rlhf_pipeline.models import load_tokenizer
from rlhf_pipeline.sources import build_tiny_model, embedded_gguf_path, gguf_memoised

pytestmark = pytest.mark.e2e  # each test runs the base_model stage

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def stage_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("base_stage")
    build_tiny_model(root / "data/models/tiny")
    # the source's own card says where it came from: the base model's card carries that on, in hub form
    (root / "data/models/tiny/README.md").write_text(
        "---\nbase_model: example-org/tiny-llama\nlicense: mit\n---\n\n# Tiny\n"
    )
    (root / "params.yaml").write_text(
        yaml.safe_dump(full_params({"base_model": {"source": "data/models/tiny", "dropout": 0.0}}))
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
    # every file's sha256, in the format `sha256sum -c` checks (what later stages verify before loading)
    check = subprocess.run(["sha256sum", "--check", "--strict", "SHA256SUMS"], cwd=root / "models/base", text=True)
    assert check.returncode == 0
    listed = {line.split("  ", 1)[1] for line in (root / "models/base/SHA256SUMS").read_text().splitlines()}
    assert listed == {p.name for p in (root / "models/base").iterdir()} - {"SHA256SUMS"}


def test_model_card_front_matter(stage_run):
    root, _ = stage_run
    card = read_model_card(root / "models/base")
    assert card["source"] == "data/models/tiny"
    assert card["source_sha256"] == content_hash(root / "data/models/tiny")  # every file of the folder
    assert (
        f"`{card['source_sha256']}` (a local folder: over every file in it)"
        in (root / "models/base/README.md").read_text()
    )
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


def test_a_local_source_outside_data_models_is_refused(tmp_path):
    """DVC tracks data/models/ for the stage: a folder elsewhere could change unseen."""
    build_tiny_model(tmp_path / "elsewhere")
    (tmp_path / "params.yaml").write_text(
        yaml.safe_dump(full_params({"base_model": {"source": str(tmp_path / "elsewhere")}}))
    )
    add_pipeline_definition(tmp_path)
    result = subprocess.run(
        [sys.executable, str(REPO / "stages/base_model.py")], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 2, result.stderr
    assert "base_model.source" in result.stderr and "outside data/models/" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "models").exists()


def test_dropout_param_is_applied(tmp_path):
    build_tiny_model(tmp_path / "data/models/src")
    (tmp_path / "params.yaml").write_text(
        yaml.safe_dump(full_params({"base_model": {"source": "data/models/src", "dropout": 0.25}}))
    )
    add_pipeline_definition(tmp_path)
    result = subprocess.run(
        [sys.executable, str(REPO / "stages/base_model.py")], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert json.loads((tmp_path / "models/base/config.json").read_text())["attention_dropout"] == 0.25


def test_a_saved_tokenizer_pads_as_asked_and_forgets_how_it_was_loaded(tmp_path):
    """The embedded GGUF's tokenizer (the CPU default's): transformers keeps `local_files_only` and
    `is_local` among its init arguments and saves a padding side only if it was one; the saved
    policy tokenizer must pad on the left and carry no flag of this machine."""
    from transformers import AutoTokenizer

    from rlhf_pipeline.models import save_tokenizer
    from rlhf_pipeline.sources import embedded_gguf_path

    gguf = embedded_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    assert tokenizer.init_kwargs.get("local_files_only") and tokenizer.padding_side == "right"
    save_tokenizer(tokenizer, tmp_path, padding_side="left")
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["padding_side"] == "left" and not {"local_files_only", "is_local"} & set(config)
    assert AutoTokenizer.from_pretrained(tmp_path).padding_side == "left"
    assert tokenizer.padding_side == "right" and tokenizer.init_kwargs.get("local_files_only")  # the caller's as it was


def test_a_gguf_is_parsed_once_and_its_name_map_built_once_while_it_loads(monkeypatch):
    """transformers parses a GGUF anew for each config, tokenizer and weights it reads from it, and builds
    gguf's tensor-name map anew for each module: within gguf_memoised the embedded file is parsed once, by
    whichever path names it, a name map is built once per architecture and depth, and gguf's own functions
    are back after the block, also when the block raises."""
    import gguf
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    parses, builds = [], []

    class CountingReader(gguf.GGUFReader):
        def __init__(self, path, mode="r"):
            parses.append(path)
            super().__init__(path, mode)

    def counting_name_map(arch, n_blocks, build=gguf.get_tensor_name_map):
        builds.append((arch, n_blocks))
        return build(arch, n_blocks)

    monkeypatch.setattr(gguf, "GGUFReader", CountingReader)
    monkeypatch.setattr(gguf, "get_tensor_name_map", counting_name_map)
    path = embedded_gguf_path()
    with gguf_memoised():
        configs = [load_gguf_checkpoint(str(path), return_tensors=False)["config"] for _ in range(2)]
        assert gguf.GGUFReader(path) is gguf.GGUFReader(str(path.parent / ".." / path.parent.name / path.name))
        maps = [gguf.get_tensor_name_map(arch, 30) for arch in (gguf.MODEL_ARCH.LLAMA,) * 2 + (gguf.MODEL_ARCH.GEMMA3,)]
    assert len(parses) == 1 and configs[0] == configs[1] and configs[0]["model_type"] == "llama"
    assert maps[0] is maps[1] and maps[2] is not maps[0] and len(builds) == 2
    assert maps[0].get_name("model.layers.3.self_attn.q_proj") == "blk.3.attn_q"
    assert gguf.GGUFReader is CountingReader and gguf.get_tensor_name_map is counting_name_map
    with pytest.raises(RuntimeError, match="inside"), gguf_memoised():
        raise RuntimeError("inside")
    assert gguf.GGUFReader is CountingReader and gguf.get_tensor_name_map is counting_name_map


def run_base_model(root: Path, source: str) -> subprocess.CompletedProcess:
    (root / "params.yaml").write_text(yaml.safe_dump(full_params({"base_model": {"source": source}})))
    add_pipeline_definition(root)
    return subprocess.run(
        [sys.executable, str(REPO / "stages/base_model.py")], cwd=root, capture_output=True, text=True, timeout=300
    )


def test_a_users_gguf_is_a_source_like_the_default(tmp_path):
    """The default's own GGUF file, copied into data/models/ as a user would bring one: dequantised
    to fp32 safetensors, its sha256 and format on the card (SmolLM2 puts no BOS: no prefix noted)."""
    import hashlib
    import os

    from rlhf_pipeline.sources import embedded_gguf_path

    gguf = embedded_gguf_path()
    (tmp_path / "data/models").mkdir(parents=True)
    os.link(gguf, tmp_path / "data/models" / gguf.name)  # the same bytes, no copy
    result = run_base_model(tmp_path, f"data/models/{gguf.name}")
    assert result.returncode == 0, result.stderr
    card = read_model_card(tmp_path / "models/base")
    assert card["source_sha256"] == hashlib.sha256(gguf.read_bytes()).hexdigest()
    assert card["source_format"] == f"GGUF Q4_1 ({gguf.name}), dequantised to fp32" and card["source_file"] == gguf.name
    assert "sequence_prefix" not in card and card.get("base_model") is None  # "SmolLM2 135M Instruct" is no hub id
    text = (tmp_path / "models/base/README.md").read_text()  # the hash said to be the file's, not a folder's
    assert f"`{card['source_sha256']}` (of the file `{gguf.name}`)" in text and "a local folder" not in text
    assert (tmp_path / "models/base/model.safetensors").is_file() and not list(
        (tmp_path / "models/base").glob("*.gguf")
    )
    assert load_tokenizer(tmp_path / "models/base").pad_token == "<|pad|>"


@pytest.mark.parametrize(
    "case, message",
    [
        ("not a gguf", "is not a GGUF file gguf can read"),
        ("two ggufs", "is not a .gguf file nor a folder holding exactly one"),
        ("a file beside it", "holds notes.txt beside model.gguf; a GGUF source folder holds only the .gguf"),
        ("a gguf beside safetensors", "holds model.gguf: a GGUF file beside other weights"),
    ],
)
def test_a_bad_gguf_source_is_refused_before_loading(tmp_path, case, message):
    folder = tmp_path / "data/models/src"
    if case == "a gguf beside safetensors":
        build_tiny_model(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.gguf").write_bytes(b"GGUF" + b"\x00" * 12 if case == "not a gguf" else b"not a gguf")
    if case == "two ggufs":
        (folder / "other.gguf").write_bytes(b"GGUF")
    if case == "a file beside it":
        (folder / "notes.txt").write_text("hi")
    result = run_base_model(tmp_path, "data/models/src/model.gguf" if case == "not a gguf" else "data/models/src")
    assert result.returncode == 2, result.stderr
    assert "base_model.source" in result.stderr and message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "models").exists()


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            {"ppo": {"freeze_layers": 2}},
            "ppo.freeze_layers: 2, but the base model (tiny-llama, LlamaForCausalLM) has 2",
        ),
        ({"reward": {"train": {"num_layers": 3}}}, "reward.train.num_layers: 3, but the base model (tiny-llama"),
        (
            {"data": {"queries": {"query_length": 200}}, "task": {"response_length": 100}},
            "200 + 100 = 300 tokens, more than the 256 positions",
        ),
        ({"task": {"truncate_token": "a full stop"}}, "task.truncate_token 'a full stop' encodes to"),
    ],
)
def test_values_the_model_cannot_take_stop_the_first_stage(tmp_path, monkeypatch, capsys, overrides, message):
    """The tiny Llama has 2 blocks, 256 positions and a byte-level vocabulary: a value that depends
    on the model is refused by base_model as soon as the model is built (exit 2, nothing written),
    not at train_policy."""
    # in this process, whose kernels are already chosen: native (a pin would refuse under another dispatch)
    compute = {"cpu_numerics": "native", "cpu_threads": 1}
    params = full_params({"base_model": {"source": "tiny-llama"}, "compute": compute, **overrides})
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    add_pipeline_definition(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert run_stage_script("base_model") == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err
    assert not (tmp_path / "models").exists()
