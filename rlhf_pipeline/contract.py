"""The data contract of preference labels: a Great Expectations suite written in code.

It runs on a *flat* pandas frame, the same for every source (see
:func:`~rlhf_pipeline.preferences.formats.to_flat_frame` and
:func:`~rlhf_pipeline.preferences.formats.internal_to_flat`):
``query``, ``sample0`` .. ``sample{N-1}``, ``best`` (and ``margin`` when present). Pairwise data
is ``query=prompt, sample0=chosen, sample1=rejected, best=0``; messages use the user's names.

Checks (each expectation carries a readable ``meta.check`` name used in the summary):

- every required column exists; texts are strings, ``best`` is an integer; no nulls;
- no empty or whitespace-only text; no invalid UTF-8 (U+FFFD / lone surrogates) and no control
  characters other than newline and tab;
- all samples of a row differ (chosen != rejected); ``best`` in ``[0, N)``; no duplicate rows;
- text length <= ``max_text_chars``; token length <= ``max_tokens`` (when a tokenizer is given);
- at least ``min_rows`` rows; the most common ``best`` value covers at most ``max_label_share``
  of the rows (best-of-N data only: pairwise data has ``best=0`` by construction).

Row-wise conditions GX has no expectation for are computed in pandas first, as helper columns
whose names start with ``_``, and the expectations are set on those.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlhf_pipeline.datadocs import write_data_docs
from rlhf_pipeline.errors import DataContractError
from rlhf_pipeline.io import read_table, replace_surrogates, write_json
from rlhf_pipeline.models import load_tokenizer
from rlhf_pipeline.params import Seed, Strict, read_params_file, validate
from rlhf_pipeline.params.data import DataParams
from rlhf_pipeline.paths import BASE_MODEL
from rlhf_pipeline.preferences.formats import (
    LABEL_KEY,
    PAIRED_FORMATS,
    detect_format,
    display_names,
    sample_columns,
    to_flat_frame,
)
from rlhf_pipeline.preferences.splits import split_positions
from rlhf_pipeline.text_rules import (
    BAD_CHARACTER_CHECK,
    BAD_CHARACTERS,
    EMPTY_TEXT_CHECK,
    VISIBLE_CHARACTER,
)

INTEGER_TYPES = ["int", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "Int64", "Int32"]
EXAMPLES = 3
TABLE_SHAPE_EXPECTATIONS = ("expect_table_columns_to_match_set", "expect_table_row_count_to_be_between")


@dataclass
class ContractResult:
    success: bool
    failures: list[dict[str, Any]]  # {check, expectation, column, count, observed, examples}
    gx_json: dict
    rows: int = 0
    expectations: int = 0
    notes: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------------------------
# the suite
# --------------------------------------------------------------------------------------------
def _text_columns(frame) -> list[str]:
    return ["query", *sample_columns(frame.columns)]


def expected_samples(frame) -> list[str]:
    """sample0 .. sample{N-1} with N = 1 + the highest sample index present (at least 2)."""
    present = sample_columns(frame.columns)
    n = max([int(c[6:]) + 1 for c in present] + [2])
    return [f"sample{i}" for i in range(n)]


def add_helper_columns(frame, tokenizer=None, max_text_chars: int | None = None):
    """Helper columns for the row-wise checks; returns a copy. Texts over ``max_text_chars`` are
    not tokenized (the length check refuses them already, and a huge one would take minutes)."""
    frame = frame.copy()
    texts = [c for c in _text_columns(frame) if c in frame.columns]
    if "best" in frame.columns:
        shares = frame["best"].map(frame["best"].value_counts(normalize=True, dropna=True)).fillna(0.0)
        frame["_label_share"] = shares.astype(float)
    if tokenizer is not None and texts:
        lengths = []
        for column in texts:
            values = [
                v if isinstance(v, str) and (max_text_chars is None or len(v) <= max_text_chars) else ""
                for v in frame[column].tolist()
            ]
            ids = tokenizer(values, add_special_tokens=False)["input_ids"] if values else []
            lengths.append([len(x) for x in ids])
        frame["_max_tokens"] = [max(row) for row in zip(*lengths)] if len(frame) else []
    return frame


# checks over the whole table (not row by row): in a file validated in chunks they run once, on a
# frame of per-column hashes (8 bytes a cell) of every row
WHOLE_TABLE_EXPECTATIONS = (
    *TABLE_SHAPE_EXPECTATIONS,
    "expect_column_max_to_be_between",  # the label share
    "expect_compound_columns_to_be_unique",
)


# human labels (rlhf label import): who answered which task; one annotation per pair
HUMAN_LABEL_KEY = LABEL_KEY


def duplicate_key(frame) -> list[str]:
    """The columns two rows may not share all of: the query, samples and label, and the annotator where
    there is one (two people choosing the same response for one task are two labels, not a duplicate)."""
    columns = ["query", *expected_samples(frame), "best", "annotator"]
    return [c for c in columns if c in frame.columns]


def build_suite(frame, validation, label_check: bool = True, min_rows: int | None = None, select=None):
    """The ExpectationSuite of the row checks for ``frame`` (with helper columns) under ``data.validation``
    (``select``: keep only the expectations whose type it accepts).

    The per-text checks run on :func:`text_cells` with :func:`build_text_suite`, so the number of
    expectations does not grow with the number of samples per row (a best-of-1000 file has the
    same 20-odd expectations as a pairwise one)."""
    import great_expectations as gx
    import great_expectations.expectations as gxe

    min_rows = validation.min_rows if min_rows is None else min_rows
    samples = expected_samples(frame)
    required = ["query", *samples, "best"]
    present = [c for c in required if c in frame.columns]
    suite = gx.ExpectationSuite(name="preferences")

    def add(expectation, check):
        if select is None or select(expectation.expectation_type):
            expectation.meta = {"check": check}
            suite.add_expectation(expectation)

    add(gxe.ExpectTableColumnsToMatchSet(column_set=required, exact_match=False), "missing column")
    add(gxe.ExpectTableRowCountToBeBetween(min_value=min_rows), f"row count >= min_rows ({min_rows})")
    sample_present = [c for c in samples if c in frame.columns]
    if len(sample_present) >= 2:
        add(
            gxe.ExpectSelectColumnValuesToBeUniqueWithinRecord(column_list=sample_present),
            "distinct samples in a row (chosen != rejected)",
        )
    if "best" in frame.columns:
        add(gxe.ExpectColumnValuesToNotBeNull(column="best"), "no nulls")
        add(gxe.ExpectColumnValuesToBeInTypeList(column="best", type_list=INTEGER_TYPES), "best type (integer)")
        add(
            gxe.ExpectColumnValuesToBeBetween(column="best", min_value=0, max_value=len(samples) - 1),
            f"best within [0, {len(samples)})",
        )
        if label_check:
            add(
                gxe.ExpectColumnMaxToBeBetween(column="_label_share", max_value=validation.max_label_share),
                f"labels not degenerate (most common best share <= max_label_share {validation.max_label_share})",
            )
    if present:
        add(gxe.ExpectCompoundColumnsToBeUnique(column_list=duplicate_key(frame)), "no duplicate rows")
    if set(HUMAN_LABEL_KEY) <= set(frame.columns):
        add(
            gxe.ExpectCompoundColumnsToBeUnique(column_list=list(HUMAN_LABEL_KEY)),
            "one answer per task and annotator (task_id, annotator)",
        )
    if "_max_tokens" in frame.columns:
        add(
            gxe.ExpectColumnValuesToBeBetween(column="_max_tokens", max_value=validation.max_tokens),
            f"token length <= max_tokens ({validation.max_tokens})",
        )
    if "margin" in frame.columns:
        add(gxe.ExpectColumnValuesToNotBeNull(column="margin"), "no nulls")
        # pandas compares inf outside any bound, so this also refuses non-finite margins
        add(
            gxe.ExpectColumnValuesToBeBetween(
                column="margin", min_value=-validation.max_abs_margin, max_value=validation.max_abs_margin
            ),
            f"|margin| <= max_abs_margin ({validation.max_abs_margin:g}), finite",
        )
    return suite


def text_cells(frame):
    """One row per text cell of ``frame``: ``_row`` (its row), ``_column`` (its column), ``text``."""
    import pandas as pd

    texts = [c for c in _text_columns(frame) if c in frame.columns]
    if not texts:
        return pd.DataFrame(
            {"_row": pd.Series(dtype=int), "_column": pd.Series(dtype=object), "text": pd.Series(dtype=object)}
        )
    cells = frame[texts].astype(object).melt(ignore_index=False, var_name="_column", value_name="text")
    return cells.rename_axis("_row").reset_index()


def build_text_suite(validation):
    """The checks every text (query and each sample) must pass, on :func:`text_cells`."""
    import great_expectations as gx
    import great_expectations.expectations as gxe

    suite = gx.ExpectationSuite(name="preference-texts")
    for expectation, check in [
        (gxe.ExpectColumnValuesToNotBeNull(column="text"), "no nulls"),
        (gxe.ExpectColumnValuesToBeOfType(column="text", type_="str"), "text type (string)"),
        (
            gxe.ExpectColumnValuesToMatchRegex(column="text", regex=VISIBLE_CHARACTER),
            EMPTY_TEXT_CHECK,
        ),
        (
            gxe.ExpectColumnValuesToNotMatchRegex(column="text", regex=BAD_CHARACTERS),
            BAD_CHARACTER_CHECK,
        ),
        (
            gxe.ExpectColumnValueLengthsToBeBetween(column="text", max_value=validation.max_text_chars),
            f"text length <= max_text_chars ({validation.max_text_chars})",
        ),
    ]:
        expectation.meta = {"check": check}
        suite.add_expectation(expectation)
    return suite


def ephemeral_context():
    """An in-memory GX context with progress bars off (analytics are off via the environment).

    It must exist before a suite is built: GX 1.x binds suites to the current context."""
    import great_expectations as gx
    from great_expectations.data_context.types.base import ProgressBarsConfig

    context = gx.get_context(mode="ephemeral")
    context.variables.progress_bars = ProgressBarsConfig(globally=False, metric_calculations=False)
    return context


def run_suite(context, frame, suite, result_format: str = "SUMMARY") -> Any:
    """Validate ``frame`` (the whole dataframe as one batch) against ``suite``."""
    source = context.data_sources.add_or_update_pandas(suite.name)  # chunks validate under one name
    batch_definition = source.add_dataframe_asset("frame").add_batch_definition_whole_dataframe("all")
    batch = batch_definition.get_batch(batch_parameters={"dataframe": frame})
    return batch.validate(suite, result_format={"result_format": result_format, "partial_unexpected_count": 20})


def _json_safe(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if hasattr(value, "item"):  # numpy scalar
        return _json_safe(value.item())
    return value


def _example_columns(user_columns: list[str], columns: list[str]) -> list[str]:
    """The cells an example row shows: all of them for a narrow frame, else the query, the
    columns at fault and the label (a best-of-1000 row would print a thousand texts)."""
    if len(user_columns) <= 8:
        return user_columns
    return [c for c in user_columns if c in ("query", "best") or c in columns]


def _examples(frame, rows: list[int], user_columns: list[str], columns: list[str], label) -> list[dict[str, Any]]:
    examples = []
    for index in rows[:EXAMPLES]:
        row = {"row": int(index)}
        row.update(
            {label(c): _json_safe(frame.at[index, c]) for c in _example_columns(user_columns, columns) if label(c)}
        )
        examples.append(row)
    return examples


def _exception_message(result: dict) -> str | None:
    """The error GX caught while evaluating an expectation (e.g. a comparison of mixed types), if any."""
    return (result.get("exception_info") or {}).get("exception_message")


def summarize(names: list[str], shown: int = 8) -> str:
    """``names`` joined with commas, the first ``shown`` of a long list and how many more: a
    file with columns sample0, sample1 and sample9999 misses 9,997 columns, not a page of them."""
    if len(names) <= shown:
        return ", ".join(names)
    return f"{', '.join(names[:shown])}, ... and {len(names) - shown:,} more"


def _failure(result: dict, frame, user_columns: list[str], names: dict[str, str]) -> dict[str, Any]:
    """One reported failure from a failed expectation's result (GX's JSON form)."""
    config = result["expectation_config"]
    kwargs = config["kwargs"]
    columns = kwargs.get("column_list") or ([kwargs["column"]] if "column" in kwargs else [])
    label = lambda c: names.get(c, c)  # noqa: E731
    shown = ", ".join(label(c) for c in columns if not c.startswith("_") and label(c)) or "(table)"
    details = result.get("result") or {}
    indices = list(details.get("partial_unexpected_index_list") or [])
    exception = _exception_message(result)
    observed = _json_safe(details.get("observed_value"))
    if config["type"] == "expect_table_columns_to_match_set":
        missing = set(details.get("details", {}).get("mismatched", {}).get("missing") or [])
        shown = summarize([label(c) for c in kwargs["column_set"] if c in missing])
        observed = "not found; the columns are " + summarize([label(c) for c in user_columns if label(c)])
    return {
        "check": (config.get("meta") or {}).get("check", config["type"]),
        "expectation": config["type"],
        "column": shown,
        "count": details.get("unexpected_count"),
        "observed": observed,
        "examples": _examples(frame, indices, user_columns, columns, label),
        **({"error": exception} if exception else {}),
    }


def _text_failures(result: dict, cells, frame, user_columns: list[str], names: dict[str, str]) -> list[dict[str, Any]]:
    """One failure per text column at fault, as if the check had run on that column alone."""
    config = result["expectation_config"]
    label = lambda c: names.get(c, c)  # noqa: E731
    exception = _exception_message(result)
    if exception:
        return [
            {
                "check": config["meta"]["check"],
                "expectation": config["type"],
                "column": "(texts)",
                "count": None,
                "observed": None,
                "examples": [],
                "error": exception,
            }
        ]
    unexpected = cells.loc[list((result.get("result") or {}).get("unexpected_index_list") or []), ["_row", "_column"]]
    failures = []
    for column in [c for c in user_columns if c in set(unexpected["_column"])]:
        rows = unexpected.loc[unexpected["_column"] == column, "_row"].tolist()
        failures.append(
            {
                "check": config["meta"]["check"],
                "expectation": config["type"],
                "column": label(column),
                "count": len(rows),
                "observed": None,
                "examples": _examples(frame, rows, user_columns, [column], label),
            }
        )
    return failures


def hashable(value: Any) -> Any:
    """``value`` with its lists, arrays and mappings turned into tuples (a cell of a Parquet list
    column is a numpy array: pandas cannot count or compare it)."""
    if hasattr(value, "tolist") and not isinstance(value, str | bytes) and getattr(value, "ndim", 0) > 0:
        value = value.tolist()
    if isinstance(value, list | tuple):
        return tuple(hashable(v) for v in value)
    if isinstance(value, dict):
        return tuple((str(k), hashable(v)) for k, v in value.items())
    return value


CHUNK_ROWS = 50_000  # rows Great Expectations validates at once: its memory grows with the batch, not the file


def as_checked(frame, texts_too: bool = True):
    """``frame`` with its non-numeric columns as Python objects, as Great Expectations checks them:
    GX checks types per value and nothing is coerced to text; a list or array where a text or label
    belongs becomes a tuple, which the type checks refuse and the duplicate checks can hash.

    ``texts_too=False`` leaves pandas' own text columns (``str`` dtype: every value a text or
    missing, held compactly) as they are; a frame validated in chunks converts them chunk by chunk,
    since a million texts as Python objects take several times their compact size."""
    import pandas as pd

    converted = {}
    for column in frame.columns:
        series = frame[column]
        if pd.api.types.is_numeric_dtype(series) or (not texts_too and isinstance(series.dtype, pd.StringDtype)):
            continue
        values = [hashable(replace_surrogates(v)) for v in series.tolist()]
        converted[column] = pd.Series(values, dtype=object, index=series.index)
    return frame.assign(**converted) if converted else frame


def validate_dataframe(
    df,
    validation_params,
    tokenizer=None,
    label_check: bool = True,
    min_rows: int | None = None,
    names: dict[str, str] | None = None,
) -> ContractResult:
    """Run the contract on a flat frame.

    A frame over :data:`CHUNK_ROWS` rows is validated in chunks of that many rows (Great
    Expectations copies and melts its batch several times over, so its memory follows the batch):
    the checks over the whole table (columns, row count, label share, duplicate rows) run once on a
    frame of per-column hashes of every row, every other check chunk by chunk, and the results are
    merged, expectation by expectation, into what one batch would have given.

    Args:
        df: the flat frame (``query``, ``sample0..``, ``best``, optional ``margin``).
        validation_params: ``params.data.validation``.
        tokenizer: enables the token-length check (skipped, with a note, when None).
        label_check: the degenerate-label check; off for pairwise data (best is always 0).
        min_rows: overrides ``validation_params.min_rows`` (e.g. for a test split).
        names: flat column -> the user's column name, for messages.
    """
    names = names or {}
    frame = df.reset_index(drop=True)  # no copy: pandas copies on write, and nothing here writes in place
    user_columns = [c for c in frame.columns if not str(c).startswith("_")]
    context = ephemeral_context()
    text_suite = build_text_suite(validation_params)
    if len(frame) <= CHUNK_ROWS:
        frame = add_helper_columns(as_checked(frame), tokenizer, validation_params.max_text_chars)
        suite = build_suite(frame, validation_params, label_check=label_check, min_rows=min_rows)
        rows = run_suite(context, frame, suite).to_json_dict()
        cells = text_cells(frame)
        # COMPLETE: every failing cell's index, to report each column at fault with its own count
        texts = run_suite(context, cells, text_suite, result_format="COMPLETE").to_json_dict()
        text_failures = _text_failures_of(texts, cells, frame, user_columns, names)
    else:
        frame = as_checked(frame, texts_too=False)  # lists become tuples here; texts stay compact
        rows, texts, text_failures = _validate_in_chunks(
            context, frame, user_columns, validation_params, tokenizer, label_check, min_rows, names, text_suite
        )
    row_failures = [_failure(r, frame, user_columns, names) for r in rows["results"] if not r["success"]]
    # reported in the order a reader fixes them: the table's shape, each text, then whole rows
    shape = [f for f in row_failures if f["expectation"] in TABLE_SHAPE_EXPECTATIONS]
    failures = shape + text_failures + [f for f in row_failures if f not in shape]
    gx_json = combined_result(rows, texts)
    notes = [] if tokenizer is not None else ["token lengths not checked (no tokenizer)"]
    return ContractResult(not failures, failures, gx_json, len(frame), len(gx_json["results"]), notes)


def _text_failures_of(texts: dict, cells, frame, user_columns: list[str], names: dict[str, str]) -> list[dict]:
    return [
        f for r in texts["results"] if not r["success"] for f in _text_failures(r, cells, frame, user_columns, names)
    ]


def _validate_in_chunks(context, frame, user_columns, validation, tokenizer, label_check, min_rows, names, text_suite):
    """(row-suite result, text-suite result, text failures) of ``frame`` validated :data:`CHUNK_ROWS`
    rows at a time, as :func:`validate_dataframe` describes."""
    import pandas as pd

    helpers = add_helper_columns(frame.iloc[:0], tokenizer, validation.max_text_chars)  # the columns only
    # chunk by chunk: hashing a text column encodes all of its values at once
    whole = pd.concat(
        frame[user_columns]
        .iloc[start : start + CHUNK_ROWS]
        .apply(lambda column: pd.util.hash_pandas_object(column.astype(str), index=False))
        for start in range(0, len(frame), CHUNK_ROWS)
    )
    if "best" in frame.columns:  # the label share needs every row's label
        whole["_label_share"] = add_helper_columns(frame[["best"]])["_label_share"]
    if "_max_tokens" in helpers.columns:
        whole["_max_tokens"] = 0  # present, as in the one-batch frame; its check runs chunk by chunk
    in_whole = lambda kind: kind in WHOLE_TABLE_EXPECTATIONS  # noqa: E731
    unique = "expect_compound_columns_to_be_unique"
    table_suite = build_suite(helpers, validation, label_check, min_rows, select=lambda k: in_whole(k) and k != unique)
    table = run_suite(context, whole, table_suite).to_json_dict()
    # the duplicate-row check on the rows whose hash repeats (GX's own takes ~1.4 kB a row), its
    # counts then stated over every row: what it gives on the whole table
    repeated = pd.util.hash_pandas_object(whole[duplicate_key(helpers)], index=False).duplicated(keep=False)
    if set(HUMAN_LABEL_KEY) <= set(whole.columns):
        repeated |= pd.util.hash_pandas_object(whole[list(HUMAN_LABEL_KEY)], index=False).duplicated(keep=False)
    repeats = whole[repeated]
    duplicates = run_suite(
        context, repeats, build_suite(helpers, validation, label_check, min_rows, select=unique.__eq__)
    )
    duplicates = duplicates.to_json_dict()
    for result in duplicates["results"]:
        _restate_counts(result.get("result") or {}, len(frame))
    table["results"] += duplicates["results"]
    _show_rows_not_hashes(table, frame)
    parts, text_parts, text_failures = [], [], []
    text_checks = [e.meta["check"] for e in text_suite.expectations]
    shown = [names.get(c, c) for c in user_columns]
    row_suite = build_suite(helpers, validation, label_check, min_rows, select=lambda kind: not in_whole(kind))
    order: list[tuple] = []  # GX's own order of the results (not the suite's): from the first chunk
    for start in range(0, len(frame), CHUNK_ROWS):
        chunk = add_helper_columns(
            as_checked(frame.iloc[start : start + CHUNK_ROWS]), tokenizer, validation.max_text_chars
        )
        if not order:
            every = run_suite(context, chunk, build_suite(helpers, validation, label_check, min_rows)).to_json_dict()
            order = [_result_key(r) for r in every["results"]]
        parts.append(run_suite(context, chunk, row_suite).to_json_dict())
        cells = text_cells(chunk)  # _row: the row's index in the whole frame
        result = run_suite(context, cells, text_suite, result_format="COMPLETE").to_json_dict()
        text_failures += _text_failures_of(result, cells, frame, user_columns, names)
        size = len(chunk)
        for item in result["results"]:  # a cell's index in this chunk's cells -> in the whole frame's
            details = item.get("result") or {}
            for key in ("unexpected_index_list", "partial_unexpected_index_list"):
                if details.get(key):  # cells are column-major: (column, row) -> column * rows + row
                    details[key] = [(i // size) * len(frame) + start + i % size for i in details[key]]
        text_parts.append(result)
    # in the one-batch order: by check, then by column
    text_failures.sort(
        key=lambda f: (text_checks.index(f["check"]), shown.index(f["column"]) if f["column"] in shown else -1)
    )
    ordered = sorted(table["results"] + merge_results(parts)["results"], key=lambda r: order.index(_result_key(r)))
    return {**table, "results": ordered}, merge_results(text_parts), _merge_failures(text_failures)


def _result_key(result: dict) -> tuple[str, str]:
    """An expectation's identity in a GX result: its type and arguments (the batch aside)."""
    config = result["expectation_config"]
    arguments = {k: v for k, v in config["kwargs"].items() if k != "batch_id"}
    return config["type"], json.dumps(arguments, sort_keys=True, default=str)


def _show_rows_not_hashes(table: dict, frame) -> None:
    """The duplicate-row check ran on hashes: its examples become the rows themselves again."""
    for result in table["results"]:
        if result["expectation_config"]["type"] != "expect_compound_columns_to_be_unique":
            continue
        details = result.get("result") or {}
        columns = result["expectation_config"]["kwargs"]["column_list"]
        rows = [
            {c: _json_safe(frame.at[i, c]) for c in columns} for i in details.get("partial_unexpected_index_list") or []
        ]
        details["partial_unexpected_list"] = rows
        details.pop("partial_unexpected_counts", None)


def merge_results(parts: list[dict]) -> dict:
    """One GX validation result from the results of the same suite on consecutive chunks: per
    expectation, counts summed, percentages recomputed, example lists joined (cut as GX cuts
    them), success only if every chunk succeeded, the observed value of the first failing chunk."""
    merged = {**parts[0], "results": []}
    by_key = [{_result_key(r): r for r in part["results"]} for part in parts]
    for key in by_key[0]:
        results = [part[key] for part in by_key]
        first = next((r for r in results if not r["success"]), results[0])
        item = {**first, "success": all(r["success"] for r in results)}
        details = dict(first.get("result") or {})
        found = [r.get("result") or {} for r in results]
        for key in ("element_count", "unexpected_count", "missing_count"):
            if key in details:
                details[key] = sum(d.get(key, 0) for d in found)
        for key, cut in (("partial_unexpected_list", 20), ("partial_unexpected_index_list", 20)):
            if key in details:
                details[key] = [v for d in found for v in d.get(key) or []][:cut]
        for key in ("unexpected_list", "unexpected_index_list"):
            if key in details:
                details[key] = [v for d in found for v in d.get(key) or []]
        details.pop("partial_unexpected_counts", None)
        details.pop("unexpected_index_query", None)
        if "element_count" in details:
            _restate_counts(details, details["element_count"])
        item["result"] = details
        merged["results"].append(item)
    merged["success"] = all(r["success"] for r in merged["results"])
    return merged


def _restate_counts(details: dict, elements: int) -> None:
    """GX's counts and percentages of an expectation's result, over ``elements`` rows or cells."""
    if "element_count" not in details:
        return
    details["element_count"] = elements
    missing, unexpected = details.get("missing_count", 0), details.get("unexpected_count", 0)
    for key, value in (
        ("unexpected_percent", 100.0 * unexpected / max(1, elements - missing)),
        ("missing_percent", 100.0 * missing / max(1, elements)),
        ("unexpected_percent_total", 100.0 * unexpected / max(1, elements)),
        ("unexpected_percent_nonmissing", 100.0 * unexpected / max(1, elements - missing)),
    ):
        if key in details:
            details[key] = value


def _merge_failures(failures: list[dict]) -> list[dict]:
    """Failures of the same check and column from several chunks as one: counts summed, examples joined."""
    merged: dict[tuple, dict] = {}
    for failure in failures:
        key = (failure["check"], failure["expectation"], failure["column"])
        if key not in merged:
            merged[key] = {**failure, "examples": list(failure["examples"])}
            continue
        into = merged[key]
        if into["count"] is not None and failure["count"] is not None:
            into["count"] += failure["count"]
        into["examples"] = (into["examples"] + failure["examples"])[:EXAMPLES]
    return list(merged.values())


def combined_result(rows: dict, texts: dict) -> dict:
    """The two suites' GX results as one: every expectation listed and counted in ``statistics``,
    and without the load time GX stamps on the batch, so the same data gives the same bytes (the
    result is a cached output: a timestamp in it would make every rerun look like new data)."""
    results = rows["results"] + texts["results"]
    passed = sum(1 for result in results if result["success"])
    combined = {**rows, "results": results, "success": passed == len(results)}
    combined["statistics"] = {
        "evaluated_expectations": len(results),
        "successful_expectations": passed,
        "unsuccessful_expectations": len(results) - passed,
        "success_percent": 100.0 * passed / len(results) if results else None,
    }
    combined.get("meta", {}).get("batch_markers", {}).pop("ge_load_time", None)
    return combined


# --------------------------------------------------------------------------------------------
# reporting
# --------------------------------------------------------------------------------------------
_SHOW_RE = re.compile(BAD_CHARACTERS)


def _show(value, width: int = 60) -> str:
    """A short, printable rendering of a cell (control/invalid characters escaped)."""
    if value is None:
        return "null"
    if isinstance(value, str):
        text = value if len(value) <= width else value[: width - 3] + "..."
        return '"' + _SHOW_RE.sub(lambda m: f"\\u{ord(m.group()):04x}", text.replace('"', '\\"')) + '"'
    return repr(value)


def format_summary(result: ContractResult, title: str = "") -> str:
    """Readable summary: each failed check, its column, the count and up to 3 example rows."""
    head = f"{title}: " if title else ""
    if result.success:
        return f"{head}ok: {result.rows} rows passed {result.expectations} expectations"
    lines = [f"{head}FAILED: {len(result.failures)} of {result.expectations} expectations on {result.rows} rows"]
    for failure in result.failures:
        count = failure["count"]
        what = f"{count} row(s)" if count is not None else f"observed {failure['observed']}"
        lines.append(f"- {failure['check']} [column {failure['column']}]: {what}")
        if failure.get("error"):
            lines.append(f"    error: {failure['error']}")
        for example in failure["examples"]:
            cells = ", ".join(f"{k}={_show(v)}" for k, v in example.items() if k != "row")
            lines.append(f"    row {example['row']}: {cells}")
    lines.extend(f"note: {n}" for n in result.notes)
    return "\n".join(lines)


def summary_payload(results: dict[str, ContractResult]) -> dict:
    """``summary.json``: overall success, rows, and every failure tagged with its split."""
    return {
        "success": all(r.success for r in results.values()),
        "rows": sum(r.rows for r in results.values()),
        "splits": {
            name: {"rows": r.rows, "success": r.success, "expectations": r.expectations} for name, r in results.items()
        },
        "failures": [{"split": name, **f} for name, r in results.items() for f in r.failures],
    }


# --------------------------------------------------------------------------------------------
# rlhf validate-preferences FILE
# --------------------------------------------------------------------------------------------
def load_data_params(params_path: str | Path) -> tuple[DataParams, int]:
    """``data`` and ``seed`` from ``params_path`` (validated; the rest of the file is left to
    ``rlhf check-params``), or the schema defaults when the file is missing."""
    if not Path(params_path).is_file():
        return DataParams(), _DataSection().seed
    raw = read_params_file(params_path)
    section = {k: raw[k] for k in ("data", "seed") if k in raw} if isinstance(raw, dict) else {}
    checked = validate(_DataSection, section, str(params_path))
    return checked.data, checked.seed


class _DataSection(Strict):
    data: DataParams = DataParams()
    seed: Seed = 1  # the schema's default (params/schema.py)


def train_rows_problem(train: int, by_column: bool, data: DataParams, path: str) -> str | None:
    """Why the ``preferences`` stage would refuse a file with ``train`` train rows, or None: it
    holds out ``data.queries.test_fraction`` of the rows (unless a ``split`` column says which:
    ``by_column``), and ``data.validation.min_rows`` applies to what is left for training."""
    if by_column:
        how = "its split column marks"
    else:
        how = f"the preferences stage holds out data.queries.test_fraction ({data.queries.test_fraction:g}), leaving"
    if train >= data.validation.min_rows:
        return None
    return (
        f"{path}: {how} {train} train row(s), fewer than data.validation.min_rows ({data.validation.min_rows}): "
        "the preferences stage would refuse it. Add rows, or lower data.validation.min_rows."
    )


def optional_tokenizer(directory: str | Path = BASE_MODEL):
    """The base model's tokenizer when ``directory`` holds one, else None."""
    if not (Path(directory) / "tokenizer_config.json").is_file():
        return None
    return load_tokenizer(directory)


def validate_file_cli(
    path: str,
    params_path: str = "params.yaml",
    result_path: str | None = None,
    tokenizer_dir: str = BASE_MODEL,
    docs_dir: str | None = None,
) -> int:
    """``rlhf validate-preferences FILE``: contract check of a user preference file.

    Prints ``ok: N rows passed M expectations`` or the failure summary; writes the GX JSON to
    ``result_path`` and Great Expectations Data Docs to ``docs_dir`` if given; returns 0 (passed)
    or 3 (refused).
    """

    data, seed = load_data_params(params_path)
    validation = data.validation
    frame = read_table(path)
    if frame.empty and not len(frame.columns):
        raise DataContractError(f"{path} holds no rows.")
    # the preferences stage's split rule, so that the CLI passes only what the stage takes
    rows = split_positions(frame, path, data.queries.test_fraction, seed)
    by_column = "split" in frame.columns
    too_few = train_rows_problem(len(rows["train"]), by_column, data, path)
    if by_column:  # validated as the stage sees it: without the split column (a random split keeps the file's rows)
        frame = frame.drop(columns="split").iloc[rows["train"] + rows["test"]]
    fmt = detect_format(frame, path)
    tokenizer = optional_tokenizer(tokenizer_dir)
    flat = to_flat_frame(frame, fmt, tokenizer, path)
    result = validate_dataframe(
        flat, validation, tokenizer, label_check=fmt not in PAIRED_FORMATS, names=display_names(fmt)
    )
    if result_path:
        write_json(result_path, result.gx_json)
    if docs_dir:
        index = write_data_docs({Path(path).stem: result.gx_json}, docs_dir, f"{path}: preference-data contract")
        print(f"Data Docs: {index}")
    title = f"{path} ({fmt.replace('_', '-')})"
    if too_few and result.success:  # every expectation met, but the stage would still refuse it
        print(f"{title}: FAILED: {too_few}")
    else:
        print(format_summary(result, title=title) + (f"\n- {too_few}" if too_few else ""))
    return 0 if result.success and not too_few else DataContractError.exit_code
