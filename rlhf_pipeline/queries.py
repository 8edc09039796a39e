"""Queries: corpus passages turned into fixed-length token prompts, as lm-human-preferences does.

OAI's query generator (``lm_tasks.py``) does, for each passage::

    tokens = encode(text)
    if start_token: keep the tokens after its first occurrence (skip the passage if absent)
    tokens = tokens[:query_length]
    if end_token:   cut after its last occurrence, inclusive (skip the passage if absent)
    pad to query_length with the padding token (this project: on the left, see build_queries)

With ``start_text = end_text = "."`` a query therefore starts at a sentence boundary and ends
with a full sentence. :func:`preprocess_query` is that procedure as a pure function on token id
lists; start and end texts may span several tokens (the token *subsequence* is matched).
"""

from __future__ import annotations

from collections import Counter
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from rlhf_pipeline.conversations import render_prompt
from rlhf_pipeline.errors import PipelineError
from rlhf_pipeline.text_rules import text_problem
from rlhf_pipeline.tokens import encode_start, special_prefix, without_prefix

# Drop reasons, in the order the rules are applied; the stage's metrics count each one.
NO_START = "no_start"  # start_text does not occur in the passage
NOTHING_AFTER_START = "nothing_after_start"  # its first occurrence is at the very end
NO_END = "no_end"  # end_text does not occur in the first query_length tokens kept
EMPTY = "empty"  # no token at all (empty passage, no start/end rule)
# The kept text fails the data contract's text rule (a control character, say): every preference
# row on this query would be refused by validate_preferences, so the query is dropped here instead.
BAD_TEXT = "bad_text"
DROP_REASONS = (NO_START, NOTHING_AFTER_START, NO_END, EMPTY, BAD_TEXT)


class QueryResult(NamedTuple):
    tokens: list[int] | None  # the kept tokens, unpadded (at most query_length); None if dropped
    reason: str | None  # one of DROP_REASONS when dropped, else None


def find_subsequence(tokens: list[int], pattern: list[int]) -> int:
    """Index where ``pattern`` first occurs in ``tokens``, or -1."""
    n = len(pattern)
    for i in range(len(tokens) - n + 1):
        if tokens[i : i + n] == pattern:
            return i
    return -1


def rfind_subsequence(tokens: list[int], pattern: list[int]) -> int:
    """Index where ``pattern`` last occurs in ``tokens``, or -1."""
    n = len(pattern)
    for i in range(len(tokens) - n, -1, -1):
        if tokens[i : i + n] == pattern:
            return i
    return -1


def preprocess_query(
    tokens: list[int], start_tokens: list[int] | None, end_tokens: list[int] | None, query_length: int
) -> QueryResult:
    """Apply the OAI query rules to one passage's token ids (see the module docstring).

    Difference from OAI, on purpose: when the start text's first occurrence is the last token,
    OAI silently keeps the *whole* passage (``if first_index < len(tokens)``), so that query
    does not start at a sentence boundary. This project's specification drops such a passage
    instead (reason ``nothing_after_start``).
    """
    if start_tokens:
        index = find_subsequence(tokens, start_tokens)
        if index < 0:
            return QueryResult(None, NO_START)
        first = index + len(start_tokens)
        if first >= len(tokens):
            return QueryResult(None, NOTHING_AFTER_START)
        tokens = tokens[first:]
    tokens = list(tokens[:query_length])
    if end_tokens:
        index = rfind_subsequence(tokens, end_tokens)
        if index < 0:
            return QueryResult(None, NO_END)
        tokens = tokens[: index + len(end_tokens)]
    if not tokens:
        return QueryResult(None, EMPTY)
    return QueryResult(tokens, None)


def pad_tokens(tokens: list[int], length: int, pad_token_id: int, side: str = "left") -> list[int]:
    """Pad ``tokens`` (at most ``length`` of them) to exactly ``length`` on ``side``."""
    if len(tokens) > length:
        raise ValueError(f"pad_tokens: {len(tokens)} tokens exceed length {length}")
    padding = [pad_token_id] * (length - len(tokens))
    return padding + list(tokens) if side == "left" else list(tokens) + padding


def tokenize_query(tokenizer, text: str, query_length: int, prefix: list[int] | None = None) -> list[int]:
    """The tokenizer's prefix (a BOS, see :mod:`rlhf_pipeline.tokens`) and the LAST tokens of
    ``text`` (the end of a prompt is what the response continues: a chat prompt keeps its
    generation prompt), ``query_length`` in all, left-padded to ``query_length``."""
    ids = encode_start(tokenizer, text, query_length, prefix)
    return pad_tokens(ids, query_length, tokenizer.pad_token_id, "left")


def is_cut(tokenizer, text: str, query_length: int, prefix: list[int]) -> bool:
    """True when :func:`tokenize_query` keeps only the end of ``text``."""
    return len(prefix) + len(without_prefix(tokenizer.encode(text, add_special_tokens=False), prefix)) > query_length


def text_tokens(tokenizer, text: str | None, key: str) -> list[int] | None:
    """Token ids of a start/end text (no special tokens); None when the rule is disabled."""
    if text is None:
        return None
    ids = tokenizer.encode(text, add_special_tokens=False)
    if not ids:
        raise PipelineError(
            f"{key} {text!r} encodes to no token at all; use a visible text such as '.' or null to disable the rule."
        )
    return ids


def split_indices(n: int, test_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Seeded shuffle of ``range(n)`` split into (train, test); both non-empty when ``n >= 2``."""
    order = np.random.default_rng(seed).permutation(n).tolist()
    n_test = min(max(1, round(n * test_fraction)), n - 1)
    return order[n_test:], order[:n_test]


def build_queries(
    texts: list[str],
    tokenizer,
    query_length: int,
    start_text: str | None,
    end_text: str | None,
    test_fraction: float,
    seed: int,
) -> tuple[dict[str, dict[str, list]], dict[str, int]]:
    """Preprocess every passage and split the kept queries.

    Returns ``({"train": columns, "test": columns}, counts)`` where ``columns`` has
    ``query_ids`` (left-padded to ``query_length``: sampling continues from the last position, so
    every consumer reads queries in this layout) and ``query`` (decoded, no pads),
    and ``counts`` has ``passages``, ``kept``, ``dropped_<reason>``, ``train`` and ``test``.
    A query whose decoded text fails the data contract's text rule is dropped (``bad_text``).
    """
    start_tokens = text_tokens(tokenizer, start_text, "data.queries.start_text")
    end_tokens = text_tokens(tokenizer, end_text, "data.queries.end_text")
    pad_id, prefix = tokenizer.pad_token_id, special_prefix(tokenizer)
    encoded = tokenizer(list(texts), add_special_tokens=False)["input_ids"] if texts else []
    cut: list[list[int]] = []
    drops: Counter[str] = Counter()
    for tokens in encoded:
        # the passage's tokens fill what the prefix (a BOS) leaves of the query
        result = preprocess_query(tokens, start_tokens, end_tokens, query_length - len(prefix))
        if result.tokens is None:
            drops[result.reason] += 1
        else:
            cut.append(result.tokens)
    kept: list[list[int]] = []
    kept_texts: list[str] = []
    for tokens, text in zip(cut, tokenizer.batch_decode(cut, skip_special_tokens=False)):
        if text_problem(text):
            drops[BAD_TEXT] += 1
        else:
            kept.append(tokens)
            kept_texts.append(text)
    counts = {"passages": len(encoded), "kept": len(kept), **{f"dropped_{r}": drops[r] for r in DROP_REASONS}}
    if len(kept) < 2:
        raise PipelineError(
            f"Only {len(kept)} of {len(encoded)} corpus passages survive the query rules (data.queries.start_text="
            f"{start_text!r}, end_text={end_text!r}, query_length={query_length}; drops: {dict(drops)}); at least 2 "
            "are "
            "needed for a train/test split. Use a bigger corpus (data.corpus.num_passages / passage_tokens) or "
            "relax the rules."
        )
    train_idx, test_idx = split_indices(len(kept), test_fraction, seed)
    splits = {}
    for name, indices in (("train", train_idx), ("test", test_idx)):
        splits[name] = {
            "query_ids": [pad_tokens(prefix + kept[i], query_length, pad_id, "left") for i in indices],
            "query": [kept_texts[i] for i in indices],
        }
        counts[name] = len(indices)
    return splits, counts


def build_chat_queries(
    prompts: list[list[dict]], tokenizer, query_length: int, test_fraction: float, seed: int
) -> tuple[dict[str, dict[str, list]], dict[str, int]]:
    """Chat-mode queries: each prompt rendered with the chat template and its generation prompt,
    its last ``query_length`` tokens left-padded (see :func:`tokenize_query`), repeated prompts
    kept once, then split like :func:`build_queries` (same columns; counts ``prompts``, ``kept``,
    ``duplicates``, ``truncated``, ``train``, ``test``)."""
    texts = list(dict.fromkeys(render_prompt(tokenizer, messages) for messages in prompts))
    if len(texts) < 2:
        raise PipelineError(
            f"Only {len(texts)} distinct chat prompt(s) found; at least 2 are needed for a train/test split."
        )
    prefix = special_prefix(tokenizer)
    counts = {
        "prompts": len(prompts),
        "kept": len(texts),
        "duplicates": len(prompts) - len(texts),
        "truncated": sum(is_cut(tokenizer, text, query_length, prefix) for text in texts),
    }
    train_idx, test_idx = split_indices(len(texts), test_fraction, seed)
    splits = {}
    for name, indices in (("train", train_idx), ("test", test_idx)):
        splits[name] = {
            "query_ids": [tokenize_query(tokenizer, texts[i], query_length, prefix) for i in indices],
            "query": [texts[i] for i in indices],
        }
        counts[name] = len(indices)
    return splits, counts


def is_left_padded(queries: Tensor, pad_token_id: int) -> bool:
    """True if no row has padding after a real token. Sampling continues from the last position
    and PPO reads the state that predicts response token 0 at index query_length - 1, so every
    query tensor is left-padded (data/queries stores them so)."""
    real = queries != pad_token_id
    return not bool((real[:, :-1] & ~real[:, 1:]).any())


def load_queries(path: str, split: str, pad_token_id: int, limit: int | None = None) -> Tensor:
    """Query ids of a split of the queries dataset as a left-padded (B, Q) tensor."""
    from datasets import load_from_disk

    rows = load_from_disk(path)[split]["query_ids"]
    queries = torch.tensor(rows[:limit] if limit is not None else rows, dtype=torch.long)
    if not is_left_padded(queries, pad_token_id):
        raise PipelineError(
            f"{path} ({split}) holds queries that are not left-padded (written by an older version?); rerun `dvc "
            "repro queries`."
        )
    return queries


def draw_queries(queries: Tensor, n: int, generator: torch.Generator) -> Tensor:
    """``n`` rows of ``queries`` drawn without replacement, reshuffled whenever all have been drawn.

    With ``n == len(queries)`` every query appears exactly once, so a mean over the draws has no
    query-sampling error with respect to that (finite) query set, only the responses' noise.
    """
    passes = -(-n // len(queries))
    order = torch.cat([torch.randperm(len(queries), generator=generator) for _ in range(passes)])
    return queries[order[:n]]
