"""What a command may write and read in a project: the files the project owns are never a command's
output, and the model folders a command is given stay inside the project.

- :func:`refuse_project_file`: ``rlhf label compare A B params.yaml`` would replace the parameters
  with tasks. A command's output may not be the project's own record (``params.yaml``, ``dvc.yaml``,
  ``dvc.lock``, ``requirements.lock``, anything under ``.git``/``.dvc``), a file git tracks, a ``.dvc``
  file or what one tracks, a stage's output, a side-by-side round, the golden labels, or the labels
  file (``data.preferences.source``) except where the command appends to it. SettingsError (exit 2),
  before anything is written.
- :func:`project_relative`: a model folder given to a command resolves inside the project (after
  ``..`` and symbolic links), and tasks, rounds and cards name it relative to the project, never by an
  absolute host path. SettingsError (exit 2) otherwise.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath

import yaml

from rlhf_pipeline.errors import SettingsError, quoted
from rlhf_pipeline.gitrepo import git

RECORDS = ("params.yaml", "dvc.yaml", "dvc.lock", "requirements.lock", "pyproject.toml")
FOLDERS = (".git", ".dvc", "side_by_side")  # git's and DVC's data; the rounds people answered


def _stage_outputs(root: Path) -> list[str]:
    """Every output, metric and plot file the stages of ``root``/dvc.yaml declare."""
    path = root / "dvc.yaml"
    try:
        stages = (yaml.safe_load(path.read_text()) or {}).get("stages") or {}
    except (OSError, yaml.YAMLError):
        return []
    found = []
    for stage in stages.values():
        for kind in ("outs", "metrics", "plots"):
            for entry in (stage or {}).get(kind) or []:
                found.append(next(iter(entry)) if isinstance(entry, dict) else str(entry))
    return found


def _dvc_tracked(root: Path) -> list[str]:
    """What the ``.dvc`` files of ``root`` track (their ``outs``' paths, relative to the project)."""
    found = []
    for dvc_file in root.rglob("*.dvc"):
        if ".git" in dvc_file.parts or ".dvc" in dvc_file.relative_to(root).parts[:-1]:
            continue
        try:
            outs = (yaml.safe_load(dvc_file.read_text()) or {}).get("outs") or []
        except (OSError, yaml.YAMLError, AttributeError):
            continue
        found += [str((dvc_file.parent / out["path"]).relative_to(root)) for out in outs if isinstance(out, dict)]
    return found


def owner_of(output: str | Path, root: Path, labels: str | None = None, golden: str | None = None) -> str | None:
    """What in the project ``output`` belongs to (see the module docstring), or None when it is free."""
    root = root.resolve()
    target = Path(output).resolve()
    if root != target and root not in target.parents:
        return None
    relative = target.relative_to(root)
    text = relative.as_posix()
    if text in RECORDS:
        return "one of the project's records"
    if relative.parts and relative.parts[0] in FOLDERS:
        return f"in {relative.parts[0]}/, which the project keeps"
    if text.endswith(".dvc"):
        return "a .dvc file (DVC's record of a tracked file)"
    if golden and target == (root / golden).resolve():
        return "promotion.golden_labels (the golden set a frozen judge is trained on)"
    if labels and target == (root / labels).resolve():
        return "data.preferences.source (the labels file: add to it with `rlhf label import --append`)"
    # a stage owns all of its output folder; a .dvc file, the path it names (a new file beside the labels in
    # a folder that is dvc-added whole stays free: the retrain flow writes its private copy there)
    owned = [(path, "a stage's output (dvc.yaml)", True) for path in _stage_outputs(root)]
    owned += [(path, "tracked by DVC (a .dvc file)", False) for path in _dvc_tracked(root)]
    for path, what, whole_folder in owned:
        declared = PurePosixPath(path.rstrip("/"))
        if PurePosixPath(text) == declared or (whole_folder and declared in PurePosixPath(text).parents):
            return f"{what}: {declared}"
    if git(root, "ls-files", "--error-unmatch", "--", text) is not None:
        return "a file git tracks"
    return None


def refuse_project_file(
    output: str | Path | None,
    root: Path | None,
    option: str,
    labels: str | None = None,
    golden: str | None = None,
    appending: bool = False,
) -> None:
    """SettingsError (exit 2) when the ``output`` of a command (``option`` names it) is a file the project
    owns. ``labels``: the labels file (``data.preferences.source``), which only an append may write."""
    if output is None or root is None:
        return
    if appending and labels and Path(output).resolve() == (root / labels).resolve():
        return
    owner = owner_of(output, root, labels, golden)
    if owner is not None:
        raise SettingsError(
            f"{option} {output} is {owner}: this command writes only new files of its own, never over one the "
            "project owns. Choose another path; nothing was written."
        )


def project_relative(path: str | Path, root: Path, what: str) -> str:
    """``path`` (a folder the user gave) as a path relative to ``root``, after ``..`` and symbolic links;
    SettingsError (exit 2) when it lies outside the project."""
    root = root.resolve()
    resolved = Path(root, path).resolve()
    if resolved != root and root not in resolved.parents:
        raise SettingsError(
            f"{what} {quoted(str(path), 200)} resolves outside the project ({root}): a model folder must be inside "
            "it (copy it in and `dvc add` it, or give a registered version such as policy@v2), so that what it "
            "writes names it by a path any clone shares. Nothing was read or written."
        )
    return resolved.relative_to(root).as_posix() or "."
