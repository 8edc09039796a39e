"""The parameters a stage may read: exactly the params.yaml keys ``dvc.yaml`` declares for it.

DVC reruns a stage when one of its declared params changes, and only then. A stage that reads a
key it does not declare would stay "up to date" after that key changed, and its cached output
would no longer be the one its inputs produce. So the stage runner never gives a stage the whole
validated :class:`~rlhf_pipeline.params.Params`: it gives a :class:`DeclaredParams` view that
lets through only the keys DVC itself reports for that stage (read with DVC's Python API, so
``dvc.yaml`` is parsed once, by DVC) and fails at the first undeclared read, naming the stage
and the key, in tests and in real runs alike.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from rlhf_pipeline.errors import PipelineError

PARAMS_FILE = "params.yaml"  # the file dvc.yaml's `params:` entries refer to by default


class UndeclaredParamError(PipelineError):
    """A stage read a params key that dvc.yaml does not declare for it (a pipeline-definition error)."""

    exit_code = 2


def declared_param_keys(stage: str, root: str | os.PathLike = ".") -> frozenset[str] | None:
    """The params.yaml keys ``dvc.yaml`` at ``root`` declares for ``stage``; None when it
    declares the whole file (a ``- params.yaml:`` entry with no keys)."""
    root = Path(root).resolve()
    return _params_file_keys(_stage_declaration(stage, root), root)


def _stage_declaration(stage: str, root: Path):
    """``stage`` as DVC reads it from ``root``/dvc.yaml, or a PipelineError saying why not."""
    from dvc.exceptions import DvcException
    from dvc.repo import Repo
    from dvc.stage.exceptions import StageNotFound

    dvcfile = root / "dvc.yaml"
    if not dvcfile.is_file():
        raise PipelineError(
            f"stage {stage}: no dvc.yaml in {root}. Stages read only the params dvc.yaml declares for them, "
            "so they run from the project root (where `dvc repro` runs them)."
        )
    try:
        # uninitialized: the declaration is all we need, also in a folder without .dvc/ (tests, exports)
        with Repo(str(root), uninitialized=True) as repo:
            return repo.stage.load_one(path=str(dvcfile), name=stage)
    except StageNotFound:
        raise PipelineError(f"stage {stage}: {dvcfile} has no stage named {stage!r}.") from None
    except DvcException as error:
        raise PipelineError(f"stage {stage}: DVC cannot read {dvcfile}: {error}") from None


def _params_file_keys(declaration, root: Path) -> frozenset[str] | None:
    """The params.yaml keys a DVC stage declares; None for the whole file."""
    keys: set[str] = set()
    for dependency in declaration.params:
        if Path(dependency.fs_path).resolve() != root / PARAMS_FILE:
            continue  # another params file: not the schema this project validates
        if not dependency.params:
            return None
        keys.update(dependency.params)
    return frozenset(keys)


def declared_code_hash(stage: str, root: str | os.PathLike = ".") -> str:
    """sha256 over the Python files ``dvc.yaml`` declares as ``stage``'s dependencies (its script
    and the library modules it imports; tests/test_dvc_yaml.py keeps that list exact). A resumable
    checkpoint records it, so a checkpoint written by other code is not resumed by this code."""
    import hashlib

    from rlhf_pipeline.io import sha256_file

    declaration = _stage_declaration(stage, Path(root).resolve())
    files = sorted({dep.def_path for dep in declaration.deps if str(dep.def_path).endswith(".py")})
    # hash the files that actually run: this package's checkout (the same as root in a project,
    # the repository when tests run a stage in a scratch directory)
    code_root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for name in files:
        digest.update(f"{name}\0{sha256_file(code_root / name)}\n".encode())
    return digest.hexdigest()


def declared_keys_by_stage(root: str | os.PathLike = ".") -> dict[str, frozenset[str] | None]:
    """Every stage of ``root``/dvc.yaml with the params.yaml keys it declares ({} without a dvc.yaml)."""
    from dvc.repo import Repo

    root = Path(root).resolve()
    if not (root / "dvc.yaml").is_file():
        return {}
    with Repo(str(root), uninitialized=True) as repo:
        return {stage.name: _params_file_keys(stage, root) for stage in repo.index.stages}


def missing_declared_keys(raw: Any, keys: Iterable[str]) -> list[str]:
    """The ``keys`` that ``raw`` (params.yaml as parsed YAML) does not hold.

    DVC reads a stage's declared params from the file itself, not from the schema's defaults: a
    key missing there makes `dvc repro` fail after the stage ran (its old outputs already
    removed), so the runner and `rlhf check-params` refuse it first."""
    missing = []
    for key in sorted(keys):
        node = raw
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                missing.append(key)
                break
            node = node[part]
    return missing


def missing_key_problems(raw: Any, declared: dict[str, frozenset[str] | None]) -> list[str]:
    """One ``key: missing; ...`` line per declared key that ``raw`` lacks, naming who declares it
    (``declared`` maps a label, such as a stage name, to its declared keys; None: the whole file)."""
    declarers: dict[str, list[str]] = {}
    for who, keys in declared.items():
        for key in missing_declared_keys(raw, keys or ()):
            declarers.setdefault(key, []).append(who)
    return [
        f"{key}: missing; dvc.yaml tracks it for {', '.join(names)} (DVC reads it from this file, not from the "
        "schema's default)"
        for key, names in sorted(declarers.items())
    ]


def check_params_file(path: str | os.PathLike, root: str | os.PathLike) -> None:
    """Validate the params file at ``path`` against the schema, and check that it spells out every
    key ``root``/dvc.yaml tracks (DVC does not know the schema's defaults); ParamsError otherwise."""
    from rlhf_pipeline.errors import ParamsError
    from rlhf_pipeline.params import parse_params, read_params_file

    raw = read_params_file(path)
    parse_params(raw, str(path))
    problems = missing_key_problems(raw, declared_keys_by_stage(root))
    if problems:
        raise ParamsError(str(path), problems)


def _covers(declared: Iterable[str], path: str) -> bool:
    """True if a declared key is ``path`` or one of its parent sections."""
    return any(path == key or path.startswith(key + ".") for key in declared)


class DeclaredParams:
    """Read-only view of validated params that lets through only the declared keys.

    ``view.task`` returns the validated value itself when ``task`` (or a parent) is declared, a
    narrower view of a section that is not declared as a whole (``view.data.queries``), and raises
    :class:`UndeclaredParamError` at the first undeclared value read, naming its full key.
    ``model_dump()`` of a section not declared as a whole is refused for the same reason: it would
    read the undeclared keys too. Every granted read is
    added to ``reads`` (shared by nested views) for the check that dvc.yaml declares nothing unused.
    """

    __slots__ = ("_model", "_prefix", "_declared", "_stage", "_reads")

    def __init__(
        self, model: BaseModel, declared: Iterable[str], stage: str, prefix: str = "", reads: set[str] | None = None
    ):
        object.__setattr__(self, "_model", model)
        object.__setattr__(self, "_prefix", prefix)
        object.__setattr__(self, "_declared", frozenset(declared))
        object.__setattr__(self, "_stage", stage)
        object.__setattr__(self, "_reads", set() if reads is None else reads)

    @property
    def reads(self) -> set[str]:
        return self._reads

    def declares(self, path: str) -> bool:
        """True if ``path`` (a dotted key) may be read."""
        return _covers(self._declared, path)

    def _path(self, name: str) -> str:
        return f"{self._prefix}.{name}" if self._prefix else name

    def _refuse(self, path: str, what: str) -> UndeclaredParamError:
        declared = ", ".join(sorted(self._declared)) or "none"
        return UndeclaredParamError(
            f"stage {self._stage} {what} params.yaml key '{path}', which dvc.yaml does not declare for this stage "
            f"(it declares: {declared}). DVC would not rerun the stage when that key changes: add '{path}' to "
            f"stages.{self._stage}.params in dvc.yaml, or stop reading it."
        )

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name not in type(self._model).model_fields:
            raise AttributeError(f"{type(self._model).__name__} has no parameter {name!r}")
        path = self._path(name)
        value = getattr(self._model, name)
        if _covers(self._declared, path):
            self._reads.add(path)
            return value
        if isinstance(value, BaseModel):  # a section: the refusal, if any, names the key read inside it
            return DeclaredParams(value, self._declared, self._stage, path, self._reads)
        raise self._refuse(path, "read")

    def model_dump(self, **kwargs) -> dict[str, Any]:
        raise self._refuse(self._prefix or "<all of params.yaml>", "dumped the whole section")

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("stage params are read-only")

    def __repr__(self) -> str:
        return (
            f"DeclaredParams(stage={self._stage!r}, section={self._prefix or '<root>'!r}, "
            f"declared={sorted(self._declared)})"
        )
