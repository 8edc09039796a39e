"""Label Studio's JSON export read into best-of-N preference rows (:func:`rows_from_export`), one per
annotation, with ``annotator`` (a pseudonym), ``task_id``, ``round`` and ``model``. An annotation that cannot
be a label is refused (:class:`DataContractError`, exit 3, nothing written); cancelled and skipped ones are
counted, and so is the agreement between annotators where a task has several. The export is read one task at
a time (:func:`read_export`), so any size is read in bounded memory; :func:`merge_rounds` adds a round to a
labels file, keeping every earlier one."""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from itertools import combinations
from pathlib import Path

from rlhf_pipeline.errors import DataContractError, plain, quoted
from rlhf_pipeline.io import UTF8_OPTIONAL_BOM, read_jsonl
from rlhf_pipeline.json_stream import iter_json_array
from rlhf_pipeline.label_studio.interface import CHOICE, TASK_FIELDS
from rlhf_pipeline.params.labelling import LabellingParams
from rlhf_pipeline.project_key import pseudonym
from rlhf_pipeline.text_rules import INVISIBLE_CHARACTERS, text_problem


def read_export(handle, where: str, limits: LabellingParams) -> Iterator[tuple[int, dict]]:
    """``(position, task)`` of a Label Studio JSON export (a text file), parsed one task at a time
    (:func:`rlhf_pipeline.json_stream.iter_json_array`): any size is read in bounded memory."""
    return iter_json_array(handle.read, where, max_element_chars=limits.max_export_bytes)


def open_export_file(path: str | Path, limits: LabellingParams):
    """A hand-made or downloaded export file, open as text; refused (exit 3) over the size bound."""
    try:
        size = Path(path).stat().st_size
        if size > limits.max_export_bytes:
            raise DataContractError(
                f"{path}: {size / (1 << 20):,.0f} MiB, over labelling.max_export_mb = {limits.max_export_mb:g} MiB. "
                "Import it round by round, or raise the bound; nothing written."
            )
        return open(path, encoding=UTF8_OPTIONAL_BOM, errors="replace")
    except OSError as error:
        raise DataContractError(f"{path}: not a readable Label Studio JSON export ({error.strerror}).") from None


@dataclass
class ImportReport:
    rows: list[dict]
    annotations: int = 0
    cancelled: int = 0
    skipped: int = 0  # submitted without a choice
    tasks: int = 0
    tasks_with_several: int = 0
    agreement: float | None = None  # share of annotator pairs on one task that chose the same response
    annotators: Counter = field(default_factory=Counter)

    def summary(self) -> dict:
        return {
            "rows": len(self.rows),
            "tasks": self.tasks,
            "annotations": self.annotations,
            "cancelled": self.cancelled,
            "skipped": self.skipped,
            "annotators": dict(sorted(self.annotators.items())),
            "tasks_with_several_annotations": self.tasks_with_several,
            "agreement": self.agreement,
        }


def annotation_author(annotation: dict, where: str) -> str:
    """The identity of the person who made ``annotation`` (an id or an e-mail address): read to be
    pseudonymised at once (:func:`answered_choice`), never written."""
    who = annotation.get("completed_by")
    if isinstance(who, dict):  # some exports expand the user: its id first, as a plain export gives it
        who = who.get("id") if who.get("id") is not None else who.get("email")
    if not isinstance(who, (str, int)) or isinstance(who, bool) or not str(who).isprintable() or len(str(who)) > 256:
        raise DataContractError(
            f"{where}: completed_by is {quoted(str(who))}, not an annotator's id or email; Label Studio writes one "
            "for every annotation. Nothing was written."
        )
    return str(who)


def annotation_choice(annotation: dict, where: str) -> list[str] | None:
    """The values chosen in ``annotation``'s result for :data:`CHOICE` (None: no choice made)."""
    result = annotation.get("result") or []
    if not isinstance(result, list):
        raise DataContractError(f"{where}: its result is not a list of regions. Nothing was written.")
    for item in result:
        if isinstance(item, dict) and item.get("from_name") == CHOICE and item.get("type") == "choices":
            value = item.get("value") or {}
            chosen = value.get("choices") if isinstance(value, dict) else None
            if chosen is not None and not (isinstance(chosen, list) and all(isinstance(c, str) for c in chosen)):
                raise DataContractError(f"{where}: its choices are not a list of texts. Nothing was written.")
            return list(chosen or [])
    return None


# the whole-number fields `rlhf label export` writes, each with its exclusive upper bound
INTEGER_FIELDS = {"query_index": 2**31, "seed": 2**32, "round": 10**6}
_HEX = frozenset("0123456789abcdef")
INVISIBLE = re.compile(f"[{INVISIBLE_CHARACTERS}]")
MAX_SAMPLES = 64


def task_data(item, position: int, where: str) -> tuple[dict, int, str]:
    """``(data, n, label)`` of one exported task, checked field by field: every field `rlhf label
    export` writes, of its type and range, texts that pass the contract's text rule
    (:func:`rlhf_pipeline.text_rules.text_problem`); else :class:`DataContractError` naming the field."""
    if not isinstance(item, dict):
        raise DataContractError(f"{where}: task {position} is a {type(item).__name__}, not a task object.")
    label = f"{where}: task {plain(str(item.get('id', position)), 40)}"
    data = item.get("data")
    if not isinstance(data, dict):
        raise DataContractError(f"{label} has no data object: it was not made by `rlhf label export`.")
    missing = [k for k in (*TASK_FIELDS, "sample0", "sample1") if k not in data]
    if missing:
        raise DataContractError(
            f"{label} lacks {', '.join(missing)} in its data: it was not made by `rlhf label export` (or its "
            "fields were edited). Export tasks with `rlhf label export` and import them into the project."
        )
    n = sum(1 for k in data if k.startswith("sample") and k[6:].isdigit())
    samples = [f"sample{k}" for k in range(n)]
    problems = []
    if n > MAX_SAMPLES or any(k not in data for k in samples):
        problems.append(f"its responses are not sample0 to sample{n - 1} (at most {MAX_SAMPLES})")
    for name, bound in INTEGER_FIELDS.items():
        value = data[name]
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < bound:
            problems.append(f"{name} is {quoted(str(value), 40)}, not a whole number from 0 to {bound - 1:,}")
    if data["split"] not in ("train", "test"):
        problems.append(f"split is {quoted(str(data['split']), 40)}, not train or test")
    sha = data["model_sha256"]
    if not (isinstance(sha, str) and len(sha) == 64 and set(sha) <= _HEX):
        problems.append("model_sha256 is not 64 hexadecimal digits")
    for name in ("task_id", "model"):
        value = data[name]
        if not (isinstance(value, str) and value.isprintable() and 0 < len(value) <= 1024):
            problems.append(f"{name} is not a printable text of 1 to 1024 characters")
    for name in ("query", *samples):
        value = data.get(name)
        problem = text_problem(value) if isinstance(value, str) else "not a text"
        if problem is not None:
            problems.append(f"{name} fails the contract's text rule ({problem})")
    shown = [INVISIBLE.sub("", data[k]) for k in samples if isinstance(data.get(k), str)]
    if not problems and len(set(shown)) < len(shown) and len(set(data[k] for k in samples)) == len(shown):
        # zero-width and directional marks are kept (emoji sequences and Persian need them), but two
        # responses that differ only by them look the same to the annotator, whose choice is then a coin
        problems.append("two responses differ only by invisible characters (zero-width or directional marks)")
    if problems:
        raise DataContractError(
            f"{label}: {'; '.join(problems[:4])}. Tasks come from `rlhf label export`; one edited by hand or by "
            "another tool is refused. Nothing was written."
        )
    return data, n, label


def rows_from_export(
    tasks: Iterable, where: str, key: bytes, min_agreement: float | None = None, max_annotations: int = 100
) -> ImportReport:
    """Best-of-N rows from Label Studio's JSON export ``tasks`` (task objects, e.g. from
    :func:`read_export`; see the module docstring). Every task is checked (:func:`task_data`); each
    annotator is named by a pseudonym keyed with the project's ``key``
    (:func:`rlhf_pipeline.project_key.pseudonym`), never by the e-mail address or id the export holds."""
    report = ImportReport(rows=[])
    choices_by_task: dict[str, list[int]] = {}
    positions: dict[str, int] = {}
    for position, item in enumerate(tasks):
        data, n, label = task_data(item, position, where)
        if (first := positions.setdefault(data["task_id"], position)) != position:
            raise DataContractError(  # its answers would count twice
                f"{label}: task_id {plain(data['task_id'], 40)} is also task {first} of this export; an export holds "
                "each task once (one was copied by hand or by another tool). Nothing was written."
            )
        seen: set[str] = set()
        report.tasks += 1
        responses = {str(k) for k in range(n)}
        for annotation in task_annotations(item, label, max_annotations):
            report.annotations += 1
            answered = answered_choice(
                annotation, f"{label} (task_id {data['task_id']})", responses,
                f"one of the {n} responses (0 to {n - 1})", "rlhf label config", seen, report, key,
            )  # fmt: skip
            if answered is None:
                continue
            who, best = answered[0], int(answered[1])
            report.annotators[who] += 1
            choices_by_task.setdefault(data["task_id"], []).append(best)
            report.rows.append(_row(data, n, best, who))
    report.agreement, report.tasks_with_several = pairwise_agreement(choices_by_task)
    if min_agreement is not None and report.agreement is not None and report.agreement < min_agreement:
        worst = [t for t, c in choices_by_task.items() if len(set(c)) > 1][:5]
        raise DataContractError(
            f"{where}: annotators agree on {report.agreement:.2f} of the pairs that labelled one task "
            f"({report.tasks_with_several} tasks with several annotations), below min_agreement {min_agreement:g}. "
            f"Tasks they split on: {', '.join(worst)}. Review the instructions or the annotators; nothing was written."
        )
    return report


def task_annotations(item: dict, label: str, max_annotations: int) -> list[dict]:
    """The annotations of one exported task (``label`` names it): refused (exit 3) when they are not a
    list of objects, or more than ``labelling.max_annotations_per_task``."""
    annotations = item.get("annotations") or []
    if not isinstance(annotations, list):
        raise DataContractError(f"{label}: its annotations are not a list. Nothing was written.")
    if len(annotations) > max_annotations:
        raise DataContractError(
            f"{label}: {len(annotations):,} annotations; at most labelling.max_annotations_per_task = "
            f"{max_annotations} are read. Nothing was written."
        )
    if not all(isinstance(annotation, dict) for annotation in annotations):
        raise DataContractError(f"{label}: an annotation is not an object. Nothing was written.")
    return annotations


def answered_choice(
    annotation: dict, task_label: str, allowed: set[str], what: str, config: str, seen: set[str], report, key: bytes
) -> tuple[str, str] | None:
    """(annotator's pseudonym, the value chosen) of one annotation of a task; None for a cancelled or
    empty one (counted in ``report.cancelled``, ``report.skipped``). Refuses a choice not in ``allowed``
    (``what`` says which, ``config`` names the command that writes the interface) and a second answer by
    one annotator (``seen``, the task's annotators so far). The pseudonym is keyed with ``key``: the same
    person is the same pseudonym in every round, and the identity itself goes nowhere."""
    who = pseudonym(annotation_author(annotation, task_label), key)
    where = f"{task_label}, annotation {plain(str(annotation.get('id')), 40)} by annotator {plain(who, 80)}"
    if annotation.get("was_cancelled"):
        report.cancelled += 1
        return None
    chosen = annotation_choice(annotation, where)
    if not chosen:
        report.skipped += 1
        return None
    if len(chosen) != 1 or chosen[0] not in allowed:
        raise DataContractError(
            f"{where}: the choice {plain(str(chosen), 80)} is not {what}; the project's labelling interface must be "
            f"the one `{config}` writes. Nothing was written."
        )
    if who in seen:
        raise DataContractError(
            f"{where}: this annotator answered the task twice; keep one of the two annotations in Label Studio "
            "(delete the other) and export again. Nothing was written."
        )
    seen.add(who)
    return who, chosen[0]


def _row(data: dict, n: int, best: int, annotator: str) -> dict:
    """One best-of-N preference row, with where it came from."""
    return {
        "query": data["query"],
        **{f"sample{k}": data[f"sample{k}"] for k in range(n)},
        "best": best,
        # not `split`: the preferences stage holds out its own seeded share of the labels
        "query_split": data["split"],
        "annotator": annotator,
        "task_id": data["task_id"],
        "round": int(data["round"]),
        "model": data["model"],
        "model_sha256": data["model_sha256"],
        "seed": int(data["seed"]),
        "query_index": int(data["query_index"]),
    }


def pairwise_agreement(choices_by_task: dict[str, list[int]]) -> tuple[float | None, int]:
    """(share of the pairs of annotations of one task that chose the same response, tasks with >= 2);
    None when no task has two annotations."""
    pairs = agreeing = tasks = 0
    for choices in choices_by_task.values():
        if len(choices) < 2:
            continue
        tasks += 1
        for a, b in combinations(choices, 2):
            pairs += 1
            agreeing += a == b
    return (agreeing / pairs if pairs else None), tasks


def read_rows(path: str | Path) -> list[dict]:
    """The rows of a JSON-lines label file, read (and refused, exit 3) as every preference file is
    (:func:`rlhf_pipeline.io.read_jsonl`); a key a row lacks stays absent, not NaN."""
    columns = read_jsonl(Path(path))
    names = list(columns)
    return [
        {k: v for k, v in zip(names, values) if not (isinstance(v, float) and math.isnan(v))}
        for values in zip(*columns.values())
    ]


def merge_rounds(existing: list[dict], new: list[dict], where: str) -> tuple[list[dict], int, int]:
    """Every round's labels in one file: ``existing`` rows, then the ``new`` rows whose (task_id,
    annotator) is not there yet. Importing the same export again adds nothing; an annotation that
    disagrees with the one already kept for its task and annotator is refused (exit 3), since one of
    the two exports was edited. Returns (rows, added, already there)."""
    kept = {(row.get("task_id"), row.get("annotator")): row for row in existing}
    added, repeated = [], 0
    for row in new:
        key = (row["task_id"], row["annotator"])
        if key in kept:
            if kept[key]["best"] != row["best"]:
                raise DataContractError(
                    f"{where}: task_id {key[0]} by annotator {key[1]} is already labelled {kept[key]['best']} "
                    f"(round {kept[key].get('round')}), and this export says {row['best']}. One of the two exports was "
                    "changed after the labels were taken; nothing was written."
                )
            repeated += 1
            continue
        kept[key] = row
        added.append(row)
    return [*existing, *added], len(added), repeated
