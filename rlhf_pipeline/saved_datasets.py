"""A dataset a stage saved (``data/queries``, ``data/preferences``), read by the commands that take its
folder as an argument: ``rlhf export-preferences --input``, ``rlhf label export --queries`` and
``rlhf label compare --queries``.

``datasets.load_from_disk`` answers a missing folder, a folder of something else, or a file cut short
with a traceback (``FileNotFoundError``, ``JSONDecodeError``, ``ArrowInvalid``). Here each is one
paragraph that names the folder and what writes it again, before anything is sampled or written.
"""

from __future__ import annotations

import os
from pathlib import Path

from datasets import Dataset, DatasetDict, load_from_disk

from rlhf_pipeline.errors import PipelineError, plain


def read_split(folder: str | os.PathLike, split: str, rebuild: str, columns: tuple[str, ...] = ()) -> Dataset:
    """Split ``split`` of the dataset saved in ``folder``, which must hold ``columns`` (another stage's
    dataset, such as ``data/queries`` given for ``data/preferences``, does not); ``rebuild`` is the
    command that writes the folder again (``dvc repro queries``), for the error."""
    where = Path(folder)
    name = plain(str(where), 200)  # a user's argument: escaped if it holds anything unprintable
    if not where.is_dir():
        raise PipelineError(f"{name} is missing (or is not a folder); `{rebuild}` writes it. Nothing was written.")
    try:
        saved = load_from_disk(str(where))
    except (OSError, ValueError) as error:  # a file gone or cut short; JSON or Arrow that does not parse
        raise PipelineError(
            f"{name} is not a dataset a stage saved, or its files are damaged ({type(error).__name__}: "
            f"{plain(str(error), 300)}). If DVC tracks it, `dvc checkout {name}` restores the recorded copy; "
            f"`{rebuild}` writes it again. Nothing was written."
        ) from None
    if not isinstance(saved, DatasetDict):
        raise PipelineError(
            f"{name} holds one split, not the splits a stage saves ({split!r} among them): give the folder above "
            "it. Nothing was written."
        )
    if split not in saved:
        raise PipelineError(f"{name} has no split {split!r}; its splits are {sorted(saved)}. Nothing was written.")
    missing = [column for column in columns if column not in saved[split].column_names]
    if missing:
        raise PipelineError(
            f"{name} is not the dataset asked for: its {split!r} split has no {' or '.join(map(repr, missing))} "
            f"column (it has {', '.join(map(repr, saved[split].column_names))}); the folder `{rebuild}` writes has "
            f"{' and '.join(map(repr, columns))}. Nothing was written."
        )
    return saved[split]
