"""What every `rlhf` command shares: its help (:func:`command`), the project it works in (:func:`project_of`), and
the rules for what it writes (never over its inputs, never over a project file, one paragraph on an OS error)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rlhf_pipeline.errors import PipelineError, SettingsError, StorageError
from rlhf_pipeline.params.data import SIMULATED
from rlhf_pipeline.params.schema import load_params
from rlhf_pipeline.project_files import refuse_project_file


def command(group, name: str, summary: str, *examples: str) -> argparse.ArgumentParser:
    """A subcommand whose ``--help`` opens with what it does (``summary``, also its line in the group's
    list) and ends with how it is called (``examples``)."""
    return group.add_parser(
        name,
        help=summary,
        description=summary[0].upper() + summary[1:] + ".",
        epilog="example" + ("s" if len(examples) > 1 else "") + ":\n" + "\n".join(f"  {e}" for e in examples),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def project_of(given: str | None, command: str, required: bool = True) -> Path | None:
    """The DVC project a command works on: the nearest folder holding ``.dvc/`` at or above ``given``
    (``--root``), else at or above the working directory, found as `dvc` finds its own (DVC's
    ``Repo.find_root``), so the command works from `data/` as from the project's root. None
    when there is none and ``required`` is false (the caller falls back to the working directory);
    else one paragraph naming where it looked, never an empty answer about the wrong folder."""
    from dvc.exceptions import NotDvcRepoError  # loads part of DVC (about 0.5 s): only for the commands with --root
    from dvc.repo import Repo

    try:
        return Path(Repo.find_root(given or os.curdir))
    except NotDvcRepoError as error:
        if given is None and not required:
            return None
        if given is not None and not Path(given).is_dir():
            problem = f"--root {given} is not a folder"
        else:
            where = f"--root {given}" if given else f"the working directory, {Path.cwd()},"
            problem = f"{where} is not in a DVC project: no .dvc folder in it or in any folder above it (DVC: {error})"
        raise SettingsError(
            f"{problem}. Run `rlhf {command}` in the project (the folder where `dvc init` ran, holding dvc.yaml) or "
            "in one of its folders, or pass --root with it; nothing was read or written."
        ) from None


def project_root(command: str) -> Path:
    """The DVC project a command that writes project files works in, else the working directory."""
    return project_of(None, command, required=False) or Path.cwd()


def never_over_inputs(output: str | os.PathLike | None, *inputs: str | os.PathLike | None) -> None:
    """Refuse an ``output`` that is one of the command's ``inputs`` or lies inside an input folder: the
    write would replace or change what the command reads (`rlhf label import export.json export.json`
    replaced Label Studio's export with its rows). SettingsError, before anything is written."""
    if output is None:
        return
    target = Path(output).resolve()
    for given in inputs:
        source = None if given is None else Path(given).resolve()
        if source is not None and (target == source or source in target.parents):
            relation = (
                f"is also this command's input ({given}): writing it would replace"
                if target == source
                else f"is inside {given}, which this command reads: writing it would change"
            )
            raise SettingsError(
                f"{output} {relation} what the command reads. Choose another path; nothing was written."
            )


@contextmanager
def writing(path: str | os.PathLike) -> Iterator[None]:
    """An OS error while writing a command's output (the path is under a file, in /proc, not
    writable) as one paragraph with the output's exit code, not a traceback."""
    try:
        yield
    except PipelineError:
        raise
    except OSError as error:
        raise StorageError(
            f"could not write {path}: {error.strerror or error}. Choose a path in a folder you can write to; "
            "nothing was written."
        ) from None


def params_if_there(path: str):
    """The params at ``path`` when the file is there (a command that also runs outside a project)."""
    return load_params(path) if Path(path).is_file() else None


def refuse_owned(output: str | None, option: str, params, appending: bool = False, root: Path | None = None) -> None:
    """A command's ``output`` is never a file the project owns (rlhf_pipeline.project_files): exit 2."""
    labels = params.data.preferences.source if params is not None else None
    refuse_project_file(
        output,
        root or project_root("label"),
        option,
        labels=None if labels == SIMULATED else labels,
        golden=params.promotion.golden_labels if params is not None else None,
        appending=appending,
    )
