"""A user's model folder (``base_model.source``, ``reward.pretrained``), admitted before it loads.

transformers loads whatever a folder holds, and sizes nothing first: an ``adapter_config.json``
beside the weights is applied on top of them, a ``model.safetensors`` holding none of the model's
tensors gives a randomly initialised model without a word, a ``config.json`` claiming wide, deep
layers takes gigabytes before anything refuses it, and a pickled ``.bin`` runs code when torch
unpickles it (or fails with a traceback). :func:`admit_model_folder` reads only names, sizes,
``config.json`` and the safetensors headers: transformers itself loads the model on the meta
device (no weight in memory) and reports what the weights miss or add. It refuses, with
params.yaml's exit code and one paragraph naming the file:

1. a file a transformers model folder does not hold (adapters, pickles, remote code, anything
   else): the folder is a dependency DVC tracks, so what it holds is what gets loaded;
2. a ``config.json`` over :data:`MAX_CONFIG_BYTES`, a tokenizer file over
   :data:`MAX_TOKENIZER_BYTES`, a model deeper than :data:`MAX_BLOCKS` blocks, or weights whose
   fp32 size exceeds the memory available or :data:`MAX_WEIGHT_BYTES`;
3. safetensors files that cannot be read, or whose tensors are not the model's (missing, extra,
   or of another shape), naming a few.
"""

from __future__ import annotations

import fnmatch
import os
from pathlib import Path

from torch import nn

from rlhf_pipeline.errors import ParamsError

MAX_CONFIG_BYTES = 1 << 20  # a config.json is a few kilobytes
MAX_TOKENIZER_BYTES = 256 << 20  # the largest tokenizer.json of current open models is ~35 MB (262k tokens)
MAX_WEIGHT_BYTES = 64 << 30  # 16 B parameters in fp32: beyond what this pipeline trains
MAX_BLOCKS = 1024  # the deepest open models have ~130 blocks
SHOWN = 5  # names listed in a message

MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "README.md",
    "SHA256SUMS",
    ".gitattributes",
    "LICENSE*",
    "NOTICE*",
    "USE_POLICY.md",
    ".cache/huggingface/*",  # what `hf download --local-dir` keeps beside the files
)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "chat_template.jinja",
    "chat_template.json",
)
# why a file that is not a model file is refused, by kind
REFUSED_KINDS = (
    (
        ("adapter_config.json", "adapter_model.*"),
        "a peft adapter, which transformers would apply on top of the weights",
    ),
    (
        ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl", "*.pickle"),
        "pickled weights, which run code when unpickled: save the model with safetensors (`save_pretrained`) instead",
    ),
    (("*.py",), "remote code, which this pipeline never runs (no trust_remote_code)"),
    (
        ("*.gguf",),
        "a GGUF file beside other weights: give base_model.source the .gguf file itself (or a folder holding "
        "only it), which the base_model stage dequantises; other keys read safetensors folders",
    ),
)
# besides its .gguf, what a folder given as a GGUF source may hold (a card, a licence)
GGUF_COMPANION_FILES = ("README.md", "SHA256SUMS", ".gitattributes", "LICENSE*", "NOTICE*", "USE_POLICY.md")


def _matches(name: str, patterns) -> bool:
    return any(fnmatch.fnmatch(name, pattern) for pattern in patterns)


def _refuse(key: str, path: Path, problem: str) -> ParamsError:
    return ParamsError("params.yaml", [f"{key}: the model folder {path} {problem}; nothing was loaded"])


def _listed(names) -> str:
    names = sorted(names)
    return ", ".join(names[:SHOWN]) + (f" and {len(names) - SHOWN} more" if len(names) > SHOWN else "")


def check_files(path: Path, key: str) -> list[Path]:
    """The folder's safetensors files, after refusing any file a model folder does not hold and any
    config or tokenizer file over its size cap."""
    weights = []
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        name = file.relative_to(path).as_posix()
        for patterns, why in REFUSED_KINDS:
            if _matches(file.name, patterns):
                raise _refuse(key, path, f"holds {name}: {why}")
        if not _matches(name, MODEL_FILES + TOKENIZER_FILES):
            raise _refuse(
                key,
                path,
                f"holds {name}, which is not a file of a transformers model folder (config, safetensors weights, "
                "tokenizer, generation config, card, licence); move it out, since what the folder holds is loaded",
            )
        size = file.stat().st_size
        cap = MAX_CONFIG_BYTES if name == "config.json" else MAX_TOKENIZER_BYTES if name in TOKENIZER_FILES else None
        if cap is not None and size > cap:
            raise _refuse(key, path, f"holds a {name} of {size:,} bytes, over the {cap:,} bytes such a file can need")
        if name.endswith(".safetensors"):
            weights.append(file)
    return weights


def read_config(path: Path, key: str):
    """``path``'s config, refused when transformers cannot read it or it describes more than
    :data:`MAX_BLOCKS` blocks (building that many modules, even without weights, takes gigabytes)."""
    import transformers

    try:
        config = transformers.AutoConfig.from_pretrained(str(path))
    except (OSError, ValueError) as error:
        raise _refuse(key, path, f"has no config.json transformers can read ({_first_line(error)})") from None
    depth = getattr(config.get_text_config(), "num_hidden_layers", None)
    if isinstance(depth, int) and depth > MAX_BLOCKS:
        raise _refuse(key, path, f"describes {depth:,} blocks (config.json num_hidden_layers), over {MAX_BLOCKS}")
    return config


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def load_on_meta(path: Path, key: str, auto_class: str) -> tuple[nn.Module, dict]:
    """The model as transformers would load it from ``path``, on the meta device (no weight is read
    into memory: only config.json and the safetensors headers), with transformers' own loading
    report (missing, unexpected and mismatched tensors, after its checkpoint key conversions)."""
    import transformers

    try:
        return getattr(transformers, auto_class).from_pretrained(str(path), device_map="meta", output_loading_info=True)
    except Exception as error:  # noqa: BLE001 - safetensors, torch and transformers raise many types here
        raise _refuse(
            key, path, f"cannot be read as a {auto_class} ({type(error).__name__}: {_first_line(error)})"
        ) from None


def check_size(config, path: Path, key: str, auto_class: str) -> int:
    """The fp32 bytes of the model ``config`` describes (built on the meta device, before any weight
    file is read), refused over the memory available or :data:`MAX_WEIGHT_BYTES`."""
    import torch
    import transformers

    try:
        with torch.device("meta"):
            model = getattr(transformers, auto_class).from_config(config)
    except Exception as error:  # noqa: BLE001 - a config the class cannot build fails in many ways
        raise _refuse(key, path, f"has a config.json {auto_class} cannot build ({_first_line(error)})") from None
    unique = {id(p): p for p in model.parameters()}.values()
    size = 4 * sum(p.numel() for p in unique)
    require_fits(size, path, key)
    return size


def check_tensors(model: nn.Module, report: dict, path: Path, key: str) -> None:
    """Refuse weights that miss one of the model's tensors, hold one it has no place for, or give
    one another shape: transformers would initialise a missing one at random and drop an extra one,
    with a log line at most."""
    kind = type(model).__name__
    missing, extra = sorted(report.get("missing_keys") or ()), sorted(report.get("unexpected_keys") or ())
    shapes = [str(item[0]) if isinstance(item, tuple) else str(item) for item in report.get("mismatched_keys") or ()]
    if missing:
        raise _refuse(
            key,
            path,
            f"holds weights without {len(missing)} of the tensors of the {kind} its config.json describes "
            f"({_listed(missing)}); transformers would initialise them at random",
        )
    if shapes:
        raise _refuse(
            key, path, f"holds {len(shapes)} tensor(s) of another shape than its config.json's: {_listed(shapes)}"
        )
    if extra:
        raise _refuse(
            key, path, f"holds {len(extra)} tensor(s) the {kind} of its config.json has no place for: {_listed(extra)}"
        )


def admit_model_folder(path: str | os.PathLike, key: str, auto_class: str = "AutoModelForCausalLM") -> int:
    """Check the user's model folder ``path`` (named by params key ``key``) before it loads, as the
    module docstring says; returns its fp32 size in bytes. ParamsError (exit 2) otherwise."""
    path = Path(path)
    if not check_files(path, key):
        raise _refuse(key, path, "holds no safetensors weights (model.safetensors, or shards with their index)")
    size = check_size(read_config(path, key), path, key, auto_class)
    model, report = load_on_meta(path, key, auto_class)
    check_tensors(model, report, path, key)
    return size


def is_gguf_source(path: str | os.PathLike) -> bool:
    """True when ``path`` is a ``.gguf`` file, or a folder holding a ``.gguf`` and no safetensors
    (a folder with both is a safetensors folder, whose check refuses the GGUF beside the weights)."""
    path = Path(path)
    if path.is_file():
        return path.suffix == ".gguf"
    return path.is_dir() and any(path.glob("*.gguf")) and not any(path.glob("*.safetensors"))


def find_gguf(path: Path) -> Path | None:
    """The GGUF file a source names: ``path`` itself, or the one ``.gguf`` of a folder; else None."""
    if path.is_file():
        return path if path.suffix == ".gguf" else None
    found = sorted(path.glob("*.gguf")) if path.is_dir() else []
    return found[0] if len(found) == 1 else None


def admit_gguf(path: str | os.PathLike, key: str) -> Path:
    """Check a user's GGUF source before it loads: the folder holds nothing but the file and its
    card/licence, the header reads (gguf's own reader maps the file, reading no weight), its
    architecture is one transformers dequantises, and the fp32 model fits as :func:`check_size`
    requires. Returns the .gguf file; ParamsError (exit 2) otherwise."""
    from gguf import GGUFReader
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    path = Path(path)
    gguf = find_gguf(path)
    if gguf is None:
        raise _refuse(key, path, "is not a .gguf file nor a folder holding exactly one")
    if path.is_dir():
        for file in sorted(p for p in path.rglob("*") if p.is_file() and p != gguf):
            name = file.relative_to(path).as_posix()
            if not _matches(name, GGUF_COMPANION_FILES):
                raise _refuse(key, path, f"holds {name} beside {gguf.name}; a GGUF source folder holds only the .gguf")
    try:
        reader = GGUFReader(str(gguf))
        architecture = reader.get_field("general.architecture").contents()
        elements = sum(int(t.n_elements) for t in reader.tensors)
    except Exception as error:  # noqa: BLE001 - a damaged header fails in many ways inside gguf
        raise _refuse(
            key, gguf, f"is not a GGUF file gguf can read ({type(error).__name__}: {_first_line(error)})"
        ) from None
    if architecture not in GGUF_CONFIG_MAPPING:
        raise _refuse(
            key,
            gguf,
            f"holds a {architecture!r} model, which transformers does not dequantise from GGUF (it does: "
            f"{', '.join(sorted(k for k in GGUF_CONFIG_MAPPING if k not in ('general', 'tokenizer')))})",
        )
    require_fits(4 * elements, gguf, key)
    return gguf


def require_fits(size: int, path: Path, key: str) -> None:
    """Refuse ``size`` fp32 bytes over the memory available or :data:`MAX_WEIGHT_BYTES`."""
    import psutil

    limit = min(MAX_WEIGHT_BYTES, psutil.virtual_memory().available)
    if size > limit:
        raise _refuse(
            key,
            path,
            f"describes {size // 4:,} parameters ({size / 2**30:.1f} GiB in fp32, as the pipeline loads them), more "
            f"than {'the memory available' if limit < MAX_WEIGHT_BYTES else 'the cap'} ({limit / 2**30:.1f} GiB)",
        )
