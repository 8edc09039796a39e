"""A user's preference file into its train and test splits (a ``split`` column, or a seeded cut),
and its label rounds."""

from __future__ import annotations

import numpy as np

from rlhf_pipeline.errors import DataContractError, PipelineError
from rlhf_pipeline.io import is_local_source, load_hub_dataset, read_table
from rlhf_pipeline.preferences.formats import FILE_ROWS, TASK_ID, detect_format
from rlhf_pipeline.queries import split_indices


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
