"""Loading and adapting the pipeline's own model folders (``models/*``) for training and sampling.

Every stage reads a model folder through here: :func:`require_dir` refuses a folder that is
missing, incomplete or damaged (its ``SHA256SUMS``, written with the folder, must match every
file), so nothing is trained on bytes other than the ones the producing stage wrote. Where base
models come from in the first place (the embedded GGUF, a local folder, a hub id) is
:mod:`rlhf_pipeline.sources`.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from rlhf_pipeline.errors import ParamsError, PipelineError
from rlhf_pipeline.io import verify_checksums

# The folders this process has checked: a stage loads the base model's tokenizer and weights
# separately, and hashing half a gigabyte twice would buy nothing.
_VERIFIED: set[Path] = set()


def require_dir(path: str | os.PathLike, produced_by: str, marker: str = "config.json") -> Path:
    """``path``, if it holds ``marker`` (a reward model's is its head file: a mean-pooling one has no
    top-level config.json) and every file its ``SHA256SUMS`` lists, unchanged; PipelineError naming
    the stage that writes it otherwise (:class:`~rlhf_pipeline.errors.DamagedArtifactError` when
    its bytes differ from the recorded ones)."""
    path = Path(path)
    if not (path / marker).is_file():
        raise PipelineError(
            f"Model directory '{path}' is missing or incomplete (no {marker}); run `dvc repro {produced_by}` first."
        )
    resolved = path.resolve()
    if resolved not in _VERIFIED:
        rebuild = f"`dvc checkout --force {path}` restores it from the DVC cache, `dvc repro --force {produced_by}`"
        verify_checksums(path, rebuild + " rebuilds it")
        _VERIFIED.add(resolved)
    return path


def load_tokenizer(path: str | os.PathLike):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    if tokenizer.pad_token_id is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
        raise PipelineError(f"Tokenizer in '{path}' has no dedicated pad token; rebuild it with the base_model stage.")
    return tokenizer


def save_tokenizer(tokenizer, directory: str | os.PathLike, padding_side: str | None = None) -> None:
    """``tokenizer.save_pretrained(directory)``, minus the flags of how this machine loaded it that
    transformers keeps among its init arguments (``local_files_only``, ``is_local``: they say
    nothing of the tokenizer), and with ``padding_side`` when given: transformers saves an attribute
    only if it was an init argument, which a GGUF-born tokenizer's padding side is not."""
    kept, side = dict(tokenizer.init_kwargs), tokenizer.padding_side
    for flag in ("local_files_only", "is_local"):
        tokenizer.init_kwargs.pop(flag, None)
    if padding_side is not None:
        tokenizer.init_kwargs["padding_side"] = tokenizer.padding_side = padding_side
    try:
        tokenizer.save_pretrained(str(directory))
    finally:
        tokenizer.init_kwargs.clear()
        tokenizer.init_kwargs.update(kept)
        tokenizer.padding_side = side


def load_causal_lm(path: str | os.PathLike, device: torch.device | str = "cpu", dropout: float | None = 0.0):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    if dropout is not None:
        set_dropout(model, dropout)
    return model.to(device)


def require_context(path: str | os.PathLike, query_length: int, response_length: int) -> None:
    """Refuse (params.yaml's exit code) queries + responses longer than the model at ``path`` can
    attend to: positions past ``max_position_embeddings`` would index past its position table, or
    past the context its rotary embeddings were trained for."""
    from transformers import AutoConfig

    problem = context_problem(AutoConfig.from_pretrained(str(path)), query_length, response_length, str(path))
    if problem:
        raise ParamsError("params.yaml", [problem])


def context_problem(config, query_length: int, response_length: int, where: str) -> str | None:
    """Why queries + responses do not fit the context of the model ``config`` describes, or None."""
    limit = getattr(config.get_text_config(), "max_position_embeddings", None)
    if limit and query_length + response_length > limit:
        return (
            f"data.queries.query_length + task.response_length: {query_length} + {response_length} = "
            f"{query_length + response_length} tokens, more than the {limit} positions the base model "
            f"attends to ({where}/config.json max_position_embeddings); shorten one of them"
        )
    return None


def model_skeleton(path: str | os.PathLike) -> nn.Module:
    """The causal LM that ``path``/config.json describes, built on the meta device: its module
    names, classes and shapes, with no weight read and no memory taken (checks before a load)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(path))
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


# --------------------------------------------------------------------------------------------
# adapting a model
# --------------------------------------------------------------------------------------------
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


def backbone_of(model: nn.Module) -> nn.Module:
    """The transformer body of a *ForCausalLM (``model.model`` for Llama, ``transformer`` for GPT-2)."""
    return model.base_model


# where the common families keep their blocks, relative to the backbone (``model.base_model``)
BLOCK_PATHS = ("layers", "h", "blocks", "decoder.layers", "language_model.layers", "transformer.h")


def transformer_layers(backbone: nn.Module, parameter: str = "ppo.freeze_layers") -> nn.ModuleList:
    """The backbone's stack of transformer blocks, lowest first.

    The usual attribute paths first (Llama, Qwen, Mistral, Gemma: ``layers``; GPT-2, Falcon, Bloom: ``h``;
    OPT: ``decoder.layers``); else the shallowest module list with ``num_hidden_layers`` blocks of one
    class. ``parameter`` names the setting that needs the blocks, for the message when none are found."""
    for path in BLOCK_PATHS:
        found = backbone
        for name in path.split("."):
            found = getattr(found, name, None)
        if isinstance(found, nn.ModuleList) and len(found) > 0:
            return found
    config = getattr(backbone, "config", None)
    expected = getattr(getattr(config, "get_text_config", lambda: config)(), "num_hidden_layers", None)
    stacks = [
        (name.count("."), module)
        for name, module in backbone.named_modules()
        if isinstance(module, nn.ModuleList) and len(module) == expected and len({type(block) for block in module}) == 1
    ]
    if stacks:
        return min(stacks, key=lambda depth_module: depth_module[0])[1]
    raise PipelineError(
        f"{parameter} needs the transformer blocks of {type(backbone).__name__}, but none were found (looked "
        f"for {', '.join(BLOCK_PATHS)}, and for any list of {expected} blocks of one class). Set {parameter} "
        "to its no-split value (0, or null for reward.train.num_layers) to train this model whole, or report "
        "the architecture so its block path can be added to rlhf_pipeline.models.BLOCK_PATHS."
    )


def freeze_lower_layers(backbone: nn.Module, num_layers: int, parameter: str = "ppo.freeze_layers") -> int:
    """Freeze the input embeddings and the lowest ``num_layers`` blocks; returns trainable params."""
    if num_layers <= 0:
        return sum(p.numel() for p in backbone.parameters() if p.requires_grad)
    layers = transformer_layers(backbone, parameter)
    if num_layers > len(layers):
        raise PipelineError(f"{parameter} is {num_layers} but the model has only {len(layers)} blocks.")
    backbone.get_input_embeddings().weight.requires_grad_(False)
    for layer in layers[:num_layers]:
        layer.requires_grad_(False)
    return sum(p.numel() for p in backbone.parameters() if p.requires_grad)
