"""The preference data as TRL's pairwise dataset (``rlhf export-preferences``)."""

from __future__ import annotations

from pathlib import Path

from rlhf_pipeline.errors import PipelineError
from rlhf_pipeline.io import atomic_file
from rlhf_pipeline.saved_datasets import read_split


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
    suffix = Path(target).suffix.lower()
    if suffix not in (".jsonl", ".parquet"):
        raise PipelineError(f"{target}: write .jsonl or .parquet (TRL's load_dataset reads both).")
    pairs = to_pairwise(read_split(source, split, "dvc repro preferences", columns=("query", "samples", "best")))
    with atomic_file(target, "wb") as handle:
        if suffix == ".jsonl":
            handle.write(pairs.to_json(orient="records", lines=True, force_ascii=False).encode())
        else:
            pairs.to_parquet(handle, index=False)
    return len(pairs)
