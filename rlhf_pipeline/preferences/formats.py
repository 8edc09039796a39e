"""The preference data's formats: the pipeline's internal best-of-N format, and the user formats
read into it.

One row per query, in both splits:

=============  ====================  ===========================================================
column         type                  meaning
=============  ====================  ===========================================================
query          str                   the prompt text
query_ids      list[int]             query_length ids, left-padded (as data/queries)
samples        list[str]             the N candidate responses
sample_ids     list[list[int]]       N x response_length ids, right-padded with the pad id
best           int                   index of the preferred sample
gold           list[float] | None    the labeler's scores (simulated labels only)
margin         float                 optional pairwise margin (0.0 when not given)
=============  ====================  ===========================================================

Two ways to fill it:

- **simulated** (default): sample N responses per query from the frozen base model exactly as the
  task samples them (fixed length, OAI truncation), score them with a programmatic labeler
  (:mod:`rlhf_pipeline.labelers`) and pick ``best ~ softmax(score / label_temperature)``
  (argmax at temperature 0).
- **user data**: a .jsonl/.parquet file or a hub dataset in *pairwise* format (``prompt``,
  ``chosen``, ``rejected``, optional ``margin``) -> N=2 with ``samples=[chosen, rejected]`` and
  ``best=0``; in *conversational* format (the same columns holding ``{"role", "content"}``
  messages, or ``chosen``/``rejected`` conversations with an implicit shared prompt; see
  :mod:`rlhf_pipeline.conversations`) -> the same, the prompt rendered with the chat template;
  or in *best-of-N* format (``query``, ``sample0`` .. ``sampleK``, ``best``).
  The format is detected from the columns. A ``split`` column (``train``/``test``) is honoured.
"""

from __future__ import annotations

import re

import numpy as np

from rlhf_pipeline.conversations import as_messages, content_length, end_of_turn, is_conversational, to_text_pairs
from rlhf_pipeline.errors import DataContractError, PipelineError
from rlhf_pipeline.queries import is_cut, pad_tokens, tokenize_query
from rlhf_pipeline.text_rules import text_problem
from rlhf_pipeline.tokens import special_prefix

PAIRWISE, BEST_OF_N, CONVERSATIONAL = "pairwise", "best_of_n", "conversational"
PAIRED_FORMATS = (PAIRWISE, CONVERSATIONAL)  # one chosen against one rejected: best is 0 by construction
PAIRWISE_COLUMNS = ("prompt", "chosen", "rejected")
SAMPLE_COLUMN = re.compile(r"^sample(0|[1-9]\d*)$")  # sample0, sample1, ...: no leading zeros
LOOKS_LIKE_SAMPLE = re.compile(r"^sample\d+$")
TASK_ID = "task_id"  # human labels: the labelling task a row answers (rlhf_pipeline.label_studio)
LABEL_KEY = (TASK_ID, "annotator")  # human labels: one answer per task and annotator
FILE_ROWS = "file_rows"  # DataFrame.attrs key: the file's row number of each row of a split
VALIDATE_HINT = "Run `rlhf validate-preferences FILE` for a full report of the problems in a preference file."


def features(human: bool = False):
    """The datasets Features of the internal format; ``human``: with each row's labelling task and
    annotator (:data:`LABEL_KEY`), so that two people who chose alike are two labels, not a duplicate."""
    from datasets import Features, List, Value

    columns = {
        "query": Value("string"),
        "query_ids": List(Value("int64")),
        "samples": List(Value("string")),
        "sample_ids": List(List(Value("int64"))),
        "best": Value("int64"),
        "gold": List(Value("float64")),
        "margin": Value("float64"),
    }
    return Features(columns | ({key: Value("string") for key in LABEL_KEY} if human else {}))


def sample_columns(columns) -> list[str]:
    """``sample0``, ``sample1``, ... present in ``columns``, ordered by their number."""
    found = [(int(m.group(1)), c) for c in map(str, columns) if (m := SAMPLE_COLUMN.match(c))]
    return [c for _, c in sorted(found)]


def detect_format(frame, where: str) -> str:
    """``pairwise``, ``conversational`` or ``best_of_n`` from the columns (and, for the first two, the
    kind of value in ``chosen``); PipelineError naming the columns if none fits."""
    columns = [str(c) for c in frame.columns]
    odd = [c for c in columns if LOOKS_LIKE_SAMPLE.match(c) and not SAMPLE_COLUMN.match(c)]
    if odd:
        raise DataContractError(
            f"{where}: column(s) {', '.join(odd)} look like sample columns but are not named sample0, sample1, ... "
            "(no leading zeros); rename them, so that each sample has one column."
        )
    pairwise = [c for c in PAIRWISE_COLUMNS if c in columns]
    best_of_n = [c for c in ("query", "best", *sample_columns(columns)) if c in columns]
    if pairwise and best_of_n:
        raise DataContractError(
            f"{where}: mixes pairwise columns ({', '.join(pairwise)}) and best-of-N columns "
            f"({', '.join(best_of_n[:4])}{', ...' if len(best_of_n) > 4 else ''}): one file holds one format; split "
            "it into a pairwise file (prompt, chosen, rejected) and a best-of-N one (query, sample0, ..., best)."
        )
    if pairwise:
        return CONVERSATIONAL if is_conversational(frame) else PAIRWISE
    if "query" in columns or sample_columns(columns):
        return BEST_OF_N
    raise DataContractError(
        f"{where}: cannot tell the preference format from its columns {columns}. Use pairwise columns "
        f"(prompt, chosen, rejected, optional margin; texts, or lists of role/content messages) or best-of-N "
        "columns (query, sample0, sample1, ..., best)."
    )


def to_flat_frame(frame, fmt: str, tokenizer=None, where: str = "preferences"):
    """The uniform flat frame the contract checks: ``query``, ``sample0..``, ``best`` (+ ``margin``).

    Lenient on purpose: missing columns stay missing and nulls stay null, so the contract can
    report them. Pairwise data becomes ``query=prompt, sample0=chosen, sample1=rejected, best=0``;
    conversational data first becomes pairwise text (its messages checked; the prompt rendered
    with ``tokenizer``'s chat template, or as ``role: content`` lines without one).
    """
    if fmt == CONVERSATIONAL:
        frame, fmt = to_text_pairs(frame, where, tokenizer), PAIRWISE
    flat = frame.copy(deep=False)  # pandas copies on write: the caller's frame is never changed
    if fmt == PAIRWISE:
        flat = flat.rename(columns={"prompt": "query", "chosen": "sample0", "rejected": "sample1"})
        flat["best"] = 0
    extra = ("margin", *LABEL_KEY)
    keep = ["query", *sample_columns(flat.columns), "best"] + [c for c in extra if c in flat.columns]
    return flat[[c for c in keep if c in flat.columns]].reset_index(drop=True)


def display_names(fmt: str) -> dict[str, str]:
    """Flat column -> the user's column name, for messages (None: not the user's, not shown)."""
    if fmt in PAIRED_FORMATS:
        return {"query": "prompt", "sample0": "chosen", "sample1": "rejected", "best": None}
    return {}


def encode_response(tokenizer, text: str, response_length: int) -> tuple[list[int], bool]:
    """The FIRST ``response_length`` tokens of ``text``, right-padded, and whether any was cut."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return pad_tokens(ids[:response_length], response_length, tokenizer.pad_token_id, "right"), len(
        ids
    ) > response_length


def tokenize_response(tokenizer, text: str, response_length: int) -> list[int]:
    """The FIRST ``response_length`` tokens of ``text``, right-padded."""
    return encode_response(tokenizer, text, response_length)[0]


class InternalColumns(dict):
    """Internal columns of a user's rows, with ``cuts``: how many prompts lost their beginning
    (``truncated_prompts``) and replies their end (``truncated_responses``) to fit
    ``data.queries.query_length`` and ``task.response_length``."""

    cuts: dict[str, int]


def _require_text(frame, columns: list[str], where: str) -> None:
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise DataContractError(
            f"{where}: missing column(s) {missing}; its columns are {list(map(str, frame.columns))}. {VALIDATE_HINT}"
        )
    for column in columns:
        bad = [i for i, v in enumerate(frame[column].tolist()) if not isinstance(v, str)]
        if bad:
            raise DataContractError(
                f"{where}: column {column!r} has {len(bad)} null or non-text value(s) (first at row {bad[0]}). "
                f"{VALIDATE_HINT}"
            )


def _margins(frame) -> list[float]:
    if "margin" not in frame.columns:
        return [0.0] * len(frame)
    return [0.0 if v is None or v != v else float(v) for v in frame["margin"].tolist()]


def _internal(
    tokenizer, queries, samples, best, margins, query_length, response_length, response_end="", rows=None, where=""
) -> InternalColumns:
    """The internal columns; refuses (exit 3) a row whose different replies become the same ids
    once cut to ``response_length`` (it would train as a tie labelled a preference). ``rows``: the
    file's row number of each row, for that message."""
    prefix = special_prefix(tokenizer)
    encoded = [[encode_response(tokenizer, t + response_end, response_length) for t in row] for row in samples]
    sample_ids = [[ids for ids, _ in row] for row in encoded]
    rows = list(range(len(samples))) if rows is None else list(rows)
    collide = [
        rows[i]
        for i, (texts, ids) in enumerate(zip(samples, sample_ids))
        if len({tuple(x) for x in ids}) < len(ids) and len(set(texts)) == len(texts)
    ]
    if collide:
        raise DataContractError(
            f"{where or 'preferences'}: {len(collide)} row(s) whose replies differ only after their first "
            f"{response_length} tokens (task.response_length), so they would train as identical replies: rows "
            f"{collide[:10]}{' ...' if len(collide) > 10 else ''} (row numbers of the file, from 0). Raise "
            "task.response_length (and rerun from preferences), or shorten those replies so they differ early; "
            "nothing was written."
        )
    columns = InternalColumns(
        query=list(queries),
        query_ids=[tokenize_query(tokenizer, q, query_length, prefix) for q in queries],
        samples=[list(s) for s in samples],
        sample_ids=sample_ids,
        best=[int(b) for b in best],
        gold=[None] * len(queries),
        margin=list(margins),
    )
    columns.cuts = {
        "truncated_prompts": sum(is_cut(tokenizer, q, query_length, prefix) for q in queries),
        "truncated_responses": sum(cut for row in encoded for _, cut in row),
    }
    return columns


def pairwise_to_internal(
    frame,
    tokenizer,
    query_length: int,
    response_length: int,
    where: str = "preferences",
    response_end: str = "",
    rows=None,
) -> InternalColumns:
    """Pairwise rows (``prompt``, ``chosen``, ``rejected``, optional ``margin``) -> internal
    columns with N=2, ``samples=[chosen, rejected]`` and ``best=0``; each response's tokens end
    with ``response_end`` (a chat template's end-of-turn text)."""
    _require_text(frame, list(PAIRWISE_COLUMNS), where)
    samples = list(zip(frame["chosen"].tolist(), frame["rejected"].tolist()))
    prompts, margins = frame["prompt"].tolist(), _margins(frame)
    return _internal(
        tokenizer, prompts, samples, [0] * len(frame), margins, query_length, response_length, response_end, rows, where
    )


def conversational_to_internal(
    frame, tokenizer, query_length: int, response_length: int, where: str = "preferences", rows=None
) -> InternalColumns:
    """Conversational rows -> internal columns: the prompt rendered with the chat template (its
    last ``query_length`` tokens, left-padded), each reply ending with the template's end of turn."""
    pairs = to_text_pairs(frame, where, tokenizer)
    end = end_of_turn(tokenizer)
    return pairwise_to_internal(pairs, tokenizer, query_length, response_length, where, end, rows)


def best_of_n_to_internal(
    frame, tokenizer, query_length: int, response_length: int, where: str = "preferences", rows=None
) -> InternalColumns:
    """Best-of-N rows (``query``, ``sample0`` .. ``sampleK``, ``best``) -> internal columns."""
    names = sample_columns(frame.columns)
    expected = [f"sample{i}" for i in range(max(len(names), 2))]
    _require_text(frame, ["query", *expected], where)
    if "best" not in frame.columns:
        raise DataContractError(
            f"{where}: missing column 'best' (index of the preferred sample); its columns are "
            f"{list(map(str, frame.columns))}. {VALIDATE_HINT}"
        )
    best = frame["best"].tolist()
    if any(not isinstance(b, (int, np.integer)) or not 0 <= b < len(expected) for b in best):
        raise DataContractError(f"{where}: column 'best' must hold integers in [0, {len(expected)}). {VALIDATE_HINT}")
    samples = list(zip(*(frame[c].tolist() for c in expected)))
    return _internal(
        tokenizer,
        frame["query"].tolist(),
        samples,
        best,
        _margins(frame),
        query_length,
        response_length,
        "",
        rows,
        where,
    )


def refuse_overlong_texts(frame, max_chars: int, where: str) -> None:
    """Refuse a text over ``max_chars`` before anything tokenizes it: a tokenizer given a 50 MB
    row takes minutes and gigabytes, and the contract would refuse the row anyway."""
    for column in frame.columns:
        lengths = [content_length(v) for v in frame[column].tolist()]
        over = [row for row, n in enumerate(lengths) if n > max_chars]
        if over:
            raise DataContractError(
                f"{where}: column {column!r}, row {over[0]}: a text of {lengths[over[0]]} characters, over "
                f"data.validation.max_text_chars ({max_chars}); {len(over)} such row(s) in this column. Shorten or "
                "drop them "
                "(nothing was tokenized or written)."
            )


def refuse_bad_texts(frame, where: str) -> None:
    """Refuse (the contract's exit code) a text of a user's file that fails :func:`text_problem`,
    naming the column and row, before anything converts or writes it: the stage and
    ``rlhf validate-preferences`` refuse the same files."""
    for column in frame.columns:
        if column not in ("prompt", "chosen", "rejected", "query") and not SAMPLE_COLUMN.match(str(column)):
            continue
        failing = []
        for row, value in enumerate(frame[column].tolist()):
            texts = (
                [value]
                if isinstance(value, str)
                else [m.get("content") for m in as_messages(value) or [] if isinstance(m, dict)]
            )
            problem = next((p for p in map(text_problem, [t for t in texts if isinstance(t, str)]) if p), None)
            if problem:
                failing.append((row, problem))
        if failing:
            row, problem = failing[0]
            raise DataContractError(
                f"{where}: column {column!r}, row {row} fails the data contract's check '{problem}'; {len(failing)} "
                f"such row(s) in this column. {VALIDATE_HINT} Nothing was written."
            )


def chat_format(fmt: str, chat: bool, source: str) -> str:
    """The format to read a user file in under ``task.chat``: chat mode reads plain pairwise
    prompts as one user message each (rendered with the chat template like every chat query);
    conversational data needs chat mode, and best-of-N rows have no chat form."""
    if fmt == CONVERSATIONAL and not chat:
        raise PipelineError(
            f"data.preferences.source ({source}) holds conversational data, whose prompts are rendered with the chat "
            "template, but task.chat is false, so PPO would sample from untemplated corpus queries. Set task.chat: "
            "true (PPO then takes its prompts from this data or data.queries.prompts)."
        )
    if chat and fmt == BEST_OF_N:
        raise PipelineError(
            f"data.preferences.source ({source}): task.chat reads pairwise or conversational preference data "
            "(prompt, chosen, rejected), not best-of-N rows."
        )
    return CONVERSATIONAL if chat else fmt


def user_to_internal(
    frame, fmt: str, tokenizer, query_length: int, response_length: int, where: str
) -> InternalColumns:
    """A user's frame in the internal columns; messages name the file's rows (``FILE_ROWS``). Human
    labels keep their task and annotator (:data:`LABEL_KEY`)."""
    convert = {PAIRWISE: pairwise_to_internal, CONVERSATIONAL: conversational_to_internal}.get(
        fmt, best_of_n_to_internal
    )
    columns = convert(frame, tokenizer, query_length, response_length, where, rows=frame.attrs.get(FILE_ROWS))
    if set(LABEL_KEY) <= set(frame.columns):
        for key in LABEL_KEY:
            columns[key] = [None if v is None or v != v else str(v) for v in frame[key].tolist()]
    return columns


def internal_to_flat(columns) -> pd.DataFrame:  # noqa: F821
    """Internal rows (a datasets split or a dict of columns) -> the contract's flat frame."""
    import pandas as pd

    samples = list(columns["samples"])
    width = max((len(s) for s in samples), default=0)
    data = {"query": list(columns["query"])}
    for i in range(width):
        data[f"sample{i}"] = [s[i] if i < len(s) else None for s in samples]
    data["best"] = list(columns["best"])
    names = columns.column_names if hasattr(columns, "column_names") else columns
    for extra in ("margin", *LABEL_KEY):
        if extra in names:
            data[extra] = list(columns[extra])
    return pd.DataFrame(data)
