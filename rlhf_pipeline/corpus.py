"""The text corpus that queries are cut from.

lm-human-preferences draws its queries from BookCorpus. This project cannot download it, so the
default (``data.corpus.source: generated``) asks the base model itself for short paragraphs on a
few hundred built-in topic prompts. A user corpus can replace it:

- ``*.txt``: passages are paragraphs separated by blank lines (the lines of a paragraph are
  joined with a space). A file without any blank line is read as one passage per line.
- ``*.jsonl`` / ``*.parquet``: one passage per row, in column ``data.corpus.text_column``.
- anything else that is not an existing path: a Hugging Face hub dataset id, loaded with
  ``datasets.load_dataset(source, split=data.corpus.split)`` (needs a warm cache or
  ``HF_DATASETS_OFFLINE=0``).

Empty and whitespace-only passages are dropped everywhere.
"""

from __future__ import annotations

from pathlib import Path

import torch

from rlhf_pipeline.decoding import SamplingRequest
from rlhf_pipeline.devices import STATIC_SAMPLER, model_device
from rlhf_pipeline.errors import PipelineError
from rlhf_pipeline.io import load_hub_dataset, read_table, read_txt_passages
from rlhf_pipeline.progress import Progress
from rlhf_pipeline.sampling import iterate_batches, sample_on_device
from rlhf_pipeline.tokens import encode_start

LOCAL_SUFFIXES = (".txt", ".jsonl", ".parquet")

SUBJECTS = [
    "the ocean",
    "a small village",
    "autumn leaves",
    "a busy train station",
    "learning to cook",
    "an old library",
    "a thunderstorm",
    "friendship",
    "a first day at school",
    "the night sky",
    "a family dinner",
    "a lost dog",
    "mountain hiking",
    "a rainy afternoon",
    "city traffic",
    "a birthday party",
    "a garden in spring",
    "a long flight",
    "a football match",
    "moving to a new home",
    "a winter morning",
    "a street market",
    "an art museum",
    "a job interview",
    "the desert",
    "a piano lesson",
    "a summer festival",
    "a broken phone",
    "a road trip",
    "a snowy forest",
    "a coffee shop",
    "a science fair",
    "grandparents",
    "a river at dawn",
    "a power outage",
    "a new neighbour",
    "a bakery",
    "a camping trip",
    "an exam",
    "a concert",
    "a lighthouse",
    "a farm",
    "a hospital waiting room",
    "a bicycle ride",
    "a quiet beach",
    "a robot",
    "a lazy Sunday",
    "an island",
]
# Opinions and reactions, happy and angry: their continuations carry sentiment words, so
# best-of-4 labels by a sentiment labeler are less often a coin flip between neutral texts
# (bench/probe_corpus.py: 40% neutral responses instead of 50%, 15% tied rows instead of 19%).
STYLES = [
    "Write five one-line customer reviews of {subject}, some delighted and some furious.",
    "Write a few short comments people posted about {subject}: some love it, some hate it.",
    "Write several short, emotional opinions about {subject}, one per sentence.",
    "List some short reactions to {subject}, from very happy to very angry.",
    "Write short tweets about {subject}: a few glowing, a few bitter.",
    "Write a short, emotional review of {subject} in simple sentences.",
    "Write a few short sentences about how {subject} made people feel, good and bad.",
    "Write short replies to the question 'How was {subject}?', each with a strong feeling.",
]


def topic_prompts() -> list[str]:
    """The built-in prompts: every subject in every style (48 x 8 = 384)."""
    return [style.format(subject=subject) for subject in SUBJECTS for style in STYLES]


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    """Token ids of a user turn asking for ``prompt``: the chat template when the tokenizer
    has one (instruct models answer in paragraphs), else the plain text; either way after the
    tokenizer's own prefix (a BOS), once."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        return encode_start(tokenizer, text)
    return encode_start(tokenizer, prompt + "\n")


def left_pad(rows: list[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack token lists into (ids, mask), padded on the left (the sampler reads the last position)."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, row in enumerate(rows):
        if row:
            ids[i, width - len(row) :] = torch.tensor(row, dtype=torch.long)
            mask[i, width - len(row) :] = True
    return ids, mask


@torch.no_grad()
def generate_passages(
    model,
    tokenizer,
    num_passages: int,
    passage_tokens: int,
    temperature: float,
    batch_size: int,
    seed: int,
    samples_per_prompt: int = 1,
    progress: str | None = None,
    cuda_sampler: str = STATIC_SAMPLER,
) -> list[str]:
    """Sample ``num_passages`` passages from ``model``, deterministic for a given seed and model.

    Prompt ``j`` is ``order[j % P]`` of :func:`topic_prompts` (``order`` a seeded permutation, so
    a small corpus still spans many topics) and is answered ``samples_per_prompt`` times from one
    prefill of its (chat-templated) text; sampling stops at EOS or after ``passage_tokens`` tokens.
    ``batch_size`` counts passages; ``progress`` labels a line per batch; ``cuda_sampler``: the device
    plan's sampler.
    """
    prompts = topic_prompts()
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(prompts), generator=generator).tolist()
    num_prompts = -(-num_passages // samples_per_prompt)
    encoded = [encode_prompt(tokenizer, prompts[order[j % len(prompts)]]) for j in range(num_prompts)]
    pad_id = tokenizer.pad_token_id
    texts: list[str] = []
    lines = Progress(progress, num_passages, "passages")
    for rows in iterate_batches(num_prompts, max(1, batch_size // samples_per_prompt)):
        ids, mask = (tensor.to(model_device(model)) for tensor in left_pad(encoded[rows], pad_id))
        request = SamplingRequest(
            queries=ids,
            query_mask=mask,
            response_length=passage_tokens,
            temperature=temperature,
            pad_token_id=pad_id,
            generator=generator,
            eos_token_id=tokenizer.eos_token_id,
            stop_at_eos=True,
            num_samples=samples_per_prompt,
        )
        out = sample_on_device(model, request, cuda_sampler)
        texts.extend(tokenizer.batch_decode(out.responses.tolist(), skip_special_tokens=True))
        lines.update(len(texts))
    return texts[:num_passages]


# --------------------------------------------------------------------------------------------
# local files and hub datasets
# --------------------------------------------------------------------------------------------
def column_texts(values, column: str, where: str) -> list[str]:
    """The string values of ``column``; non-strings (other than nulls) are refused."""
    texts = []
    for value in values:
        if value is None or (isinstance(value, float) and value != value):
            continue
        if not isinstance(value, str):
            raise PipelineError(
                f"{where}: column {column!r} must hold text, found a {type(value).__name__} ({value!r})."
            )
        texts.append(value)
    return texts


def load_local_passages(source: str, text_column: str) -> list[str]:
    path = Path(source)
    if path.is_dir():
        raise PipelineError(f"data.corpus.source: {source} is a folder; give a .txt, .jsonl or .parquet file.")
    if not path.is_file():
        raise PipelineError(
            f"data.corpus.source: {source} not found (paths are relative to the project root; put corpora in "
            "data/raw/)."
        )
    if path.suffix.lower() == ".txt":
        return read_txt_passages(path)
    if path.suffix.lower() not in LOCAL_SUFFIXES:
        raise PipelineError(
            f"data.corpus.source: {source} has unsupported type {path.suffix!r}; use .txt, .jsonl or .parquet."
        )
    frame = read_table(path)
    if frame.empty:
        raise PipelineError(f"data.corpus.source: {source} holds no data: no row with any column.")
    if text_column not in frame.columns:
        raise PipelineError(
            f"data.corpus.text_column: column {text_column!r} is not in {source}; its columns are "
            f"{list(map(str, frame.columns))}. Set data.corpus.text_column to one of them."
        )
    return column_texts(frame[text_column].tolist(), text_column, source)


def load_hub_passages(source: str, split: str, text_column: str) -> list[str]:
    dataset = load_hub_dataset(source, split, "data.corpus.source")
    if text_column not in dataset.column_names:
        raise PipelineError(
            f"data.corpus.text_column: column {text_column!r} is not in hub dataset {source!r}; its columns are "
            f"{dataset.column_names}. Set data.corpus.text_column to one of them."
        )
    return column_texts(dataset[text_column], text_column, source)


def clean_passages(texts: list[str], source: str) -> list[str]:
    """Strip passages and drop empty ones; refuse a corpus with nothing left."""
    kept = [t.strip() for t in texts if t and t.strip()]
    if not kept:
        raise PipelineError(f"data.corpus.source: {source} holds no non-empty passage.")
    return kept
