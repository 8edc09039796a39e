"""``rlhf label import`` as one library call: Label Studio's export (a file, or a project pulled from a
running server) into a labels file of best-of-N rows, optionally added to the rounds it already holds.

The rows are read first, in bounded memory (:func:`~rlhf_pipeline.label_studio.export.rows_from_export`);
then the labels file is read, merged and written under its lock (:func:`rlhf_pipeline.file_lock.held`), so
two imports at once each keep the other's rows, and written whole or not at all.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rlhf_pipeline.errors import DataContractError
from rlhf_pipeline.file_lock import held
from rlhf_pipeline.io import atomic_file
from rlhf_pipeline.label_studio.client import fetch_export
from rlhf_pipeline.label_studio.export import merge_rounds, open_export_file, read_export, read_rows, rows_from_export
from rlhf_pipeline.params.labelling import LabellingParams


def open_export(path: str | Path | None, project: int | None, limits: LabellingParams) -> tuple[Any, str]:
    """(Label Studio's JSON export as an open text file, where it came from): project ``project`` pulled
    from the server (spooled), else the file ``path``, each within ``limits``' bounds."""
    if project is not None:
        return fetch_export(project, limits)
    return open_export_file(path, limits), str(path)


def import_labels(
    source: str | Path | None,
    output: str | Path,
    *,
    key: bytes,
    limits: LabellingParams,
    project: int | None = None,
    min_agreement: float | None = None,
    append: bool = False,
) -> dict[str, Any]:
    """Label Studio's export (the file ``source``, or ``project`` from the server) into the labels file
    ``output`` (``append``: added to the rows it holds, every earlier round kept); ``key``: the project key
    the annotators' pseudonyms are made with. Returns the import's summary (rows, annotations, cancelled,
    agreement; with ``append``, how many rows were kept, added, already there). Nothing is written when no
    annotation is usable (:class:`DataContractError`, exit 3)."""
    handle, where = open_export(source, project, limits)
    with handle:
        tasks = (task for _, task in read_export(handle, where, limits))
        report = rows_from_export(tasks, where, key, min_agreement, limits.max_annotations_per_task)
    if not report.rows:
        raise DataContractError(f"{where}: no usable annotation ({report.summary()}); nothing written.")
    rows, merged = report.rows, {}
    with held(output):
        if append and Path(output).exists():
            existing = read_rows(output)
            rows, added, repeated = merge_rounds(existing, report.rows, str(output))
            merged = {"kept": len(existing), "added": added, "already_there": repeated}
        with atomic_file(output) as out:
            out.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    return {"output": str(output), **report.summary(), **merged}
