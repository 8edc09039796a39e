"""Preference labels in the pipeline's internal best-of-N format.

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
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from rlhf_pipeline.conversations import as_messages, content_length, end_of_turn, is_conversational, to_text_pairs
from rlhf_pipeline.errors import DataContractError, PipelineError
from rlhf_pipeline.io import atomic_file, is_local_source, load_hub_dataset, read_table
from rlhf_pipeline.progress import Progress
from rlhf_pipeline.queries import is_cut, pad_tokens, split_indices, tokenize_query
from rlhf_pipeline.tokens import special_prefix

PAIRWISE, BEST_OF_N, CONVERSATIONAL = "pairwise", "best_of_n", "conversational"
PAIRED_FORMATS = (PAIRWISE, CONVERSATIONAL)  # one chosen against one rejected: best is 0 by construction
PAIRWISE_COLUMNS = ("prompt", "chosen", "rejected")
SAMPLE_COLUMN = re.compile(r"^sample(0|[1-9]\d*)$")  # sample0, sample1, ...: no leading zeros
LOOKS_LIKE_SAMPLE = re.compile(r"^sample\d+$")
MAX_RESAMPLES = 3  # draws again of a query whose candidates would break the data contract, before it is skipped
TASK_ID = "task_id"  # human labels: the labelling task a row answers (rlhf_pipeline.labelling)
LABEL_KEY = (TASK_ID, "annotator")  # human labels: one answer per task and annotator
FILE_ROWS = "file_rows"  # DataFrame.attrs key: the file's row number of each row of a split
VALIDATE_HINT = "Run `rlhf validate-preferences FILE` for a full report of the problems in a preference file."

# Characters the data contract refuses: C0/C1 control characters other than \t and \n, DEL, the
# bidirectional embeddings, overrides and isolates (U+202A-U+202E, U+2066-U+2069: they reorder how
# the text around them displays, so a reviewer reads other text than the model gets), and the marks
# of invalid UTF-8: U+FFFD (what undecodable bytes become) and lone surrogates.
BAD_CHARACTERS = r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069\ud800-\udfff\ufffd]"
_BAD_CHARACTERS_RE = re.compile(BAD_CHARACTERS)
# A text must hold at least one character that shows: not whitespace and not a format character
# that renders as nothing (soft hyphen, zero-width space/joiners, directional marks, word joiner,
# BOM), so a row of only U+200B is as empty as a row of spaces.
INVISIBLE_CHARACTERS = r"\u00ad\u180e\u200b-\u200f\u202a-\u202e\u2060-\u2064\u206a-\u206f\ufeff"
VISIBLE_CHARACTER = rf"[^\s{INVISIBLE_CHARACTERS}]"
_VISIBLE_CHARACTER_RE = re.compile(VISIBLE_CHARACTER)
# The contract's two text checks, by the names its report gives them.
EMPTY_TEXT_CHECK = "no empty, whitespace-only or invisible-only text"
BAD_CHARACTER_CHECK = "no invalid UTF-8, control or bidirectional-override characters"


def text_problem(text: str) -> str | None:
    """The contract check ``text`` fails (:data:`EMPTY_TEXT_CHECK`, :data:`BAD_CHARACTER_CHECK`), or None.

    The one statement of the rule every text obeys: the contract runs these two regexes as its
    Great Expectations text checks; the preferences stage (on a user's file) and the simulated
    labeller (on its samples) call this, so nothing one accepts the other refuses."""
    if not _VISIBLE_CHARACTER_RE.search(text):
        return EMPTY_TEXT_CHECK
    if _BAD_CHARACTERS_RE.search(text):
        return BAD_CHARACTER_CHECK
    return None


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


# --------------------------------------------------------------------------------------------
# labels from scores
# --------------------------------------------------------------------------------------------
def pick_best(scores: np.ndarray, temperature: float, rng: np.random.Generator) -> np.ndarray:
    """Index of the preferred sample per row of ``scores`` (B, N).

    temperature 0: argmax, with exact ties broken uniformly at random (VADER gives many
    neutral texts the same 0.0; "always the first" would plant a positional label that no
    reward model can learn and skew the label distribution). Otherwise one draw from
    ``softmax(scores / temperature)``, which simulates a noisy labeler.
    """
    scores = np.asarray(scores, dtype=np.float64)
    if temperature == 0:
        best = []
        for row in scores:
            maxima = np.flatnonzero(row == row.max())
            best.append(maxima[0] if len(maxima) == 1 else rng.choice(maxima))
        return np.array(best, dtype=np.int64)
    # torch's softmax, not numpy's exp: numpy picks its exp kernel by the CPU (AVX-512 rounds otherwise)
    # and compute.cpu_numerics pins torch's, so the labels are the same on any host
    probs = torch.softmax(torch.from_numpy(scores / temperature), dim=1).numpy()
    return np.array([rng.choice(scores.shape[1], p=p) for p in probs], dtype=np.int64)


def ceiling_accuracy(gold: np.ndarray, best: np.ndarray) -> float:
    """Fraction of rows whose label is the gold argmax (first index on ties): about the best
    accuracy a reward model can reach on these labels. 1.0 at label_temperature 0 unless gold
    scores tie (a tied row counts as 1/k in expectation, as it would for any reward model)."""
    gold = np.asarray(gold)
    return float((gold.argmax(axis=1) == np.asarray(best)).mean()) if len(gold) else float("nan")


def sample_problem(samples: list[str]) -> str | None:
    """Why a row of candidates would fail the data contract, or None.

    Simulated rows with such a problem are skipped (and counted) rather than written, so the
    default pipeline never refuses its own labels.
    """
    problems = [text_problem(s) for s in samples]
    if EMPTY_TEXT_CHECK in problems:
        return "empty_sample"
    if len(set(samples)) < len(samples):
        return "duplicate_samples"
    if BAD_CHARACTER_CHECK in problems:
        return "bad_characters"
    return None


# --------------------------------------------------------------------------------------------
# simulated labels
# --------------------------------------------------------------------------------------------
@dataclass
class SimulatedSplit:
    columns: dict[str, list]
    skipped: dict[str, int] = field(default_factory=dict)  # queries given up on, by reason
    resampled: int = 0  # queries whose candidates were drawn again
    queries_used: int = 0
    valid_responses: int = 0
    responses: int = 0


def sample_candidates(
    model, tokenizer, sampler, query_ids: list[list[int]], num_samples: int, generator: torch.Generator
):
    """``num_samples`` truncated responses per query: (texts per query, ids per query, valid (B*N,))."""
    batch = torch.tensor(query_ids, dtype=torch.long)  # left-padded, as data/queries stores them
    _, truncated, valid = sampler.sample(model, batch, generator, num_samples=num_samples)
    texts = tokenizer.batch_decode(truncated.tolist(), skip_special_tokens=True)
    ids = truncated.view(len(batch), num_samples, -1).tolist()
    return [texts[i * num_samples : (i + 1) * num_samples] for i in range(len(batch))], ids, valid


def sample_clean_candidates(
    model, tokenizer, sampler, query_ids: list[list[int]], num_samples: int, generator, max_resamples: int
):
    """:func:`sample_candidates`, with the queries whose candidates would break the data contract
    (:func:`sample_problem`) drawn again, up to ``max_resamples`` times: (texts, ids, valid, how
    many queries were drawn again). A query still failing keeps its last draw: the caller skips it."""
    texts, ids, valid = sample_candidates(model, tokenizer, sampler, query_ids, num_samples, generator)
    resampled = 0
    for _ in range(max_resamples):
        redo = [i for i, samples in enumerate(texts) if sample_problem(samples) is not None]
        if not redo:
            break
        resampled += len(redo)
        new_texts, new_ids, new_valid = sample_candidates(
            model, tokenizer, sampler, [query_ids[i] for i in redo], num_samples, generator
        )
        valid = valid.view(-1, num_samples).clone()
        for j, i in enumerate(redo):
            texts[i], ids[i], valid[i] = new_texts[j], new_ids[j], new_valid.view(-1, num_samples)[j]
    return texts, ids, valid, resampled


@torch.no_grad()
def simulate_preferences(
    model,
    tokenizer,
    sampler,
    query_ids: list[list[int]],
    queries: list[str],
    num_rows: int,
    num_samples: int,
    labeler,
    label_temperature: float,
    batch_size: int,
    generator: torch.Generator,
    rng: np.random.Generator,
    split_name: str = "train",
    max_resamples: int = MAX_RESAMPLES,
    progress: bool = True,
) -> SimulatedSplit:
    """Label ``num_rows`` rows with best-of-``num_samples`` choices.

    ``sampler`` is a :class:`rlhf_pipeline.sampling.ResponseSampler` (task sampling + truncation).
    Queries are taken in order, ``batch_size`` at a time; when there are more rows to label than
    queries, the list starts over and the same queries are labelled again on fresh samples. When a
    query's candidates would break the data contract (see :func:`sample_problem`: e.g. two
    identical responses), its candidates are drawn again, up to ``max_resamples`` times; a query
    that still fails is skipped and the next one is used. Deterministic for given generators.
    """
    result = SimulatedSplit({k: [] for k in ("query", "query_ids", "samples", "sample_ids", "best", "gold", "margin")})
    cols = result.columns
    start = 0  # position in the endless stream query 0, 1, ..., n-1, 0, 1, ...
    lines = Progress(f"preferences {split_name}" if progress else None, num_rows, "rows labelled")
    while len(cols["best"]) < num_rows:
        if start >= len(query_ids) * (1 + num_rows // max(len(query_ids), 1)) + len(query_ids):
            raise PipelineError(
                f"data.preferences: {split_name} cannot label {num_rows} rows (data.preferences."
                f"{'num_labels' if split_name == 'train' else 'num_test_labels'}): the candidates of "
                f"{sum(result.skipped.values())} "
                f"of the {start} queries sampled from data/queries/{split_name} ({len(query_ids)} queries) break "
                "the data contract "
                f"({result.skipped}). Lower the count, or use a model that writes distinct, clean responses."
            )
        stop = start + min(batch_size, num_rows - len(cols["best"]))
        batch_ids = [query_ids[i % len(query_ids)] for i in range(start, stop)]
        texts, ids, valid, resampled = sample_clean_candidates(
            model, tokenizer, sampler, batch_ids, num_samples, generator, max_resamples
        )
        result.resampled += resampled
        scores = np.asarray(labeler.score([t for samples in texts for t in samples]), dtype=np.float64).reshape(
            len(texts), num_samples
        )
        result.responses += valid.numel()
        result.valid_responses += int(valid.sum())
        for row, samples in enumerate(texts):
            if len(cols["best"]) == num_rows:
                break
            result.queries_used = start + row + 1
            problem = sample_problem(samples)
            if problem is not None:
                result.skipped[problem] = result.skipped.get(problem, 0) + 1
                continue
            cols["query"].append(queries[(start + row) % len(queries)])
            cols["query_ids"].append(batch_ids[row])
            cols["samples"].append(samples)
            cols["sample_ids"].append(ids[row])
            cols["best"].append(int(pick_best(scores[row : row + 1], label_temperature, rng)[0]))
            cols["gold"].append(scores[row].tolist())
            cols["margin"].append(0.0)
        start = stop
        lines.update(len(cols["best"]))
    return result


# --------------------------------------------------------------------------------------------
# user data
# --------------------------------------------------------------------------------------------
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


def _numbered(part):
    """``part`` of a file's frame re-indexed from 0, the file's row numbers kept in ``attrs``."""
    rows = part.index.tolist()
    part = part.reset_index(drop=True)
    part.attrs[FILE_ROWS] = rows
    return part


def split_by_column(frame, source: str) -> dict[str, list[int]]:
    """The row numbers of the train and test rows of a file with a ``split`` column, which must hold
    both and nothing else."""
    values = set(map(str, frame["split"].unique()))
    if not values <= {"train", "test"} or "train" not in values or "test" not in values:
        raise DataContractError(
            f"{source}: column 'split' must hold both 'train' and 'test' (and nothing else); found {sorted(values)}. "
            "Rename other values (e.g. 'validation') or drop the column to hold out data.queries.test_fraction at "
            "random."
        )
    return {name: np.flatnonzero((frame["split"] == name).to_numpy()).tolist() for name in ("train", "test")}


def load_user_frames(source: str, split: str, test_fraction: float, seed: int) -> tuple[dict[str, pd.DataFrame], str]:  # noqa: F821
    """Raw train/test frames of a user preference source and its format.

    A ``split`` column (train/test) or the hub dataset's ``test`` split is used when present;
    otherwise a seeded ``test_fraction`` of the rows is held out.
    """
    if is_local_source(source):
        frame = read_table(source)
        frames = {"all": frame}
    else:
        dataset = load_hub_dataset(source, None, "data.preferences.source")
        if split not in dataset:
            raise PipelineError(
                f"data.preferences.split: hub dataset {source!r} has no split {split!r}; it has {list(dataset)}."
            )
        frames = {"train": dataset[split].to_pandas()}
        if "test" in dataset and split != "test":
            frames["test"] = dataset["test"].to_pandas()
        else:
            frames = {"all": frames["train"]}
    first = next(iter(frames.values()))
    if len(first) == 0:
        raise DataContractError(f"data.preferences.source: {source} has no rows.")
    fmt = detect_format(first, source)
    if "all" not in frames:
        return frames, fmt
    return split_rows(frames["all"], source, test_fraction, seed), fmt


def split_positions(frame, source: str, test_fraction: float, seed: int) -> dict[str, list[int]]:
    """The row numbers of the train and test rows of one user file: those its ``split`` column
    names, else a seeded ``test_fraction`` held out at random (the rule ``rlhf validate-preferences``
    applies too, counting rows without copying them). Rows of one human-labelling task (its
    ``task_id``: several annotators answered it) are held out together, so that no test row has a
    twin in training."""
    if "split" in frame.columns:
        return split_by_column(frame, source)
    if len(frame) < 2:
        raise DataContractError(f"{source}: at least 2 rows are needed to hold out a test split.")
    if TASK_ID not in frame.columns:
        train_idx, test_idx = split_indices(len(frame), test_fraction, seed)
        return {"train": train_idx, "test": test_idx}
    import pandas as pd

    # a row without a task id is a task of its own
    keys = [f"row {i}" if pd.isna(t) else str(t) for i, t in enumerate(frame[TASK_ID])]
    groups, tasks = pd.factorize(pd.Series(keys))
    if len(tasks) < 2:
        raise DataContractError(
            f"{source}: every row answers one task ({TASK_ID} {tasks[0]}); 2 tasks are needed to hold one out."
        )
    held_out = set(split_indices(len(tasks), test_fraction, seed)[1])
    return {
        "train": [i for i, g in enumerate(groups) if g not in held_out],
        "test": [i for i, g in enumerate(groups) if g in held_out],
    }


def label_rounds(frame, where: str) -> list[dict] | None:
    """Where human labels came from, round by round (``rlhf label import`` rows carry ``round``,
    ``model``, ``model_sha256``, ``task_id`` and ``annotator``): rows, tasks, annotators and the
    model(s) that sampled the responses. None for data without rounds. A ``round`` that is not a
    whole number from 0 (a text, a fraction, a negative number) is refused (exit 3), naming it."""
    if "round" not in frame.columns:
        return None
    bad = [
        value
        for value in frame["round"].dropna().unique()
        if isinstance(value, (bool, str)) or not float(value).is_integer() or not 0 <= value < 10**6
    ]
    if bad:
        shown = ", ".join(repr(v)[:40] for v in bad[:3])
        raise DataContractError(
            f"{where}: the round column holds {shown}{' and more' if len(bad) > 3 else ''}, where each row's labelling "
            "round is a whole number (0 to 999999) or empty. Fix those rows (rlhf label import writes the round), "
            "then rerun; nothing was written."
        )
    rounds = []  # a row without a round (a file that mixes sources) is counted under round None
    for number, part in frame.groupby(frame["round"].fillna(-1).astype(int), sort=True):
        entry = {"round": int(number) if number >= 0 else None, "rows": len(part)}
        for column, name in ((TASK_ID, "tasks"), ("annotator", "annotators")):
            if column in part.columns:
                entry[name] = int(part[column].nunique())
        for column in ("model", "model_sha256"):
            if column in part.columns:
                entry[column] = sorted(map(str, part[column].dropna().unique()))
        rounds.append(entry)
    return rounds


def split_rows(frame, source: str, test_fraction: float, seed: int) -> dict[str, pd.DataFrame]:  # noqa: F821
    """The train and test frames of one user file (:func:`split_positions`), without the ``split``
    column, the file's row numbers kept for messages."""
    rows = split_positions(frame, source, test_fraction, seed)
    frame = frame.drop(columns="split", errors="ignore")
    return {name: _numbered(frame.iloc[positions]) for name, positions in rows.items()}


def to_pairwise(columns) -> pd.DataFrame:  # noqa: F821
    """Internal rows -> TRL's pairwise preference format (``prompt``, ``chosen``, ``rejected``), which
    TRL's ``RewardTrainer`` and DPO-style trainers read: each best-of-N row gives N-1 pairs, the
    labelled best against each other sample. ``margin`` comes along when the labels carry one."""
    import pandas as pd

    names = columns.column_names if hasattr(columns, "column_names") else list(columns)
    margins = list(columns["margin"]) if "margin" in names else None
    keep_margin = margins is not None and any(m for m in margins)
    rows = []
    for index, (query, samples, best) in enumerate(zip(columns["query"], columns["samples"], columns["best"])):
        for other, rejected in enumerate(samples):
            if other != best:
                pair = {"prompt": query, "chosen": samples[best], "rejected": rejected}
                rows.append({**pair, "margin": margins[index]} if keep_margin else pair)
    return pd.DataFrame(rows, columns=["prompt", "chosen", "rejected", *(["margin"] if keep_margin else [])])


def export_pairwise(source: str, split: str, target: str) -> int:
    """Write split ``split`` of the preference dataset at ``source`` to ``target`` (.jsonl or
    .parquet) in TRL's pairwise format; returns the number of pairs."""
    from datasets import load_from_disk

    suffix = Path(target).suffix.lower()
    if suffix not in (".jsonl", ".parquet"):
        raise PipelineError(f"{target}: write .jsonl or .parquet (TRL's load_dataset reads both).")
    try:
        dataset = load_from_disk(source)
    except FileNotFoundError:
        raise PipelineError(f"{source} is missing; run `dvc repro preferences` first.") from None
    if split not in dataset:
        raise PipelineError(f"{source} has no split {split!r}; its splits are {sorted(dataset)}.")
    pairs = to_pairwise(dataset[split])
    with atomic_file(target, "wb") as handle:
        if suffix == ".jsonl":
            handle.write(pairs.to_json(orient="records", lines=True, force_ascii=False).encode())
        else:
            pairs.to_parquet(handle, index=False)
    return len(pairs)
