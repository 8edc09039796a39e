"""Text to token ids the way the model was trained to read it: the tokenizer's own prefix.

Tokenizers of Gemma, Llama and Mistral put a BOS token before every text they encode; SmolLM2's
and GPT-2's put nothing. A model trained with a BOS and fed without one writes noise (Gemma 3
270M: ``'<h2><h2><h2>'``), so every *start* of a sequence the project builds (a query, a corpus
prompt, a text scored by the reward model) begins with exactly the ids the tokenizer itself would
add, once: a chat template that already writes the BOS is not given a second one. A response is
a continuation, so it never gets one.

The prefix is found by asking the tokenizer (:func:`special_prefix`), not by a flag per family,
so a tokenizer without one (the default) encodes to the same ids as before.
"""

from __future__ import annotations

from rlhf_pipeline.errors import PipelineError

# a probe text every tokenizer encodes to at least one token
_PROBE = "a"


def special_prefix(tokenizer) -> list[int]:
    """The ids ``tokenizer`` puts before any text it encodes with its special tokens (``[bos]``
    for Gemma/Llama/Mistral, ``[]`` for SmolLM2/GPT-2)."""
    plain = tokenizer.encode(_PROBE, add_special_tokens=False)
    full = tokenizer.encode(_PROBE, add_special_tokens=True)
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return list(full[:start])
    return []


def without_prefix(ids: list[int], prefix: list[int]) -> list[int]:
    """``ids`` with a leading ``prefix`` removed (a chat template may have written it already)."""
    return list(ids[len(prefix) :]) if prefix and ids[: len(prefix)] == prefix else list(ids)


def encode_start(tokenizer, text: str, max_length: int | None = None, prefix: list[int] | None = None) -> list[int]:
    """Ids of ``text`` as the start of a sequence: the tokenizer's prefix, then the text's ids —
    the LAST ``max_length - len(prefix)`` of them when ``max_length`` is given (the end of a prompt
    is what a response continues), so the result is at most ``max_length`` ids and always starts
    with the prefix. ``prefix`` saves asking the tokenizer again in a loop."""
    prefix = special_prefix(tokenizer) if prefix is None else prefix
    ids = without_prefix(tokenizer.encode(text, add_special_tokens=False), prefix)
    if max_length is not None:
        keep = max_length - len(prefix)
        if keep < 1:
            raise ValueError(f"encode_start: max_length {max_length} leaves no room after the prefix {prefix}")
        ids = ids[-keep:]
    return prefix + ids


def describe_prefix(tokenizer) -> dict:
    """What the model card and lineage record: the prefix's ids and their text."""
    prefix = special_prefix(tokenizer)
    return {"ids": prefix, "tokens": tokenizer.convert_ids_to_tokens(prefix)}


def single_token_problem(tokenizer, text: str, key: str) -> str | None:
    """Why ``text`` (e.g. ``task.truncate_token`` '.') is not exactly one token of ``tokenizer``, or None."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) != 1:
        return f"{key} {text!r} encodes to {len(ids)} tokens {ids} with this tokenizer; it must be a single token."
    return None


def single_token_id(tokenizer, text: str | None, key: str) -> int | None:
    """Token id of ``text``, which must encode to exactly one token; None when ``text`` is None."""
    if text is None:
        return None
    problem = single_token_problem(tokenizer, text, key)
    if problem:
        raise PipelineError(problem)
    return tokenizer.encode(text, add_special_tokens=False)[0]
