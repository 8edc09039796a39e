"""The common entry point of every DVC stage: validate the params it declares, restrict it to them,
seed, run, and map errors to exit codes.

DVC reruns a stage when one of its declared params changes, and only then. A stage that reads a
key it does not declare would stay "up to date" after that key changed, and its cached output
would no longer be the one its inputs produce. So the runner never gives a stage the whole params
file: it validates the sections the stage's own schema (a
:class:`~rlhf_pipeline.params.StageParams`) lists, and hands the stage a :class:`DeclaredParams`
view that lets through only the keys DVC itself reports for that stage (read with DVC's Python
API, so ``dvc.yaml`` is parsed once, by DVC) and fails at the first undeclared read, naming the
stage and the key, in tests and in real runs alike.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import random
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel

from rlhf_pipeline import allocator, numerics
from rlhf_pipeline.errors import MissingPackageError, ParamsError, PipelineError, storage_error, storage_failure
from rlhf_pipeline.io import sha256_file
from rlhf_pipeline.params import StageParams, read_params_file, validate

PARAMS_FILE = "params.yaml"  # the file dvc.yaml's `params:` entries refer to by default
# When set to a folder, each stage writes there the params keys it read (tests compare them with dvc.yaml).
RECORD_READS_ENV = "RLHF_RECORD_PARAM_READS"
UNDECLARED_SEED = 0  # a stage that does not declare `seed` must not depend on it, yet stays deterministic
CODE_ROOT = Path(__file__).resolve().parents[1]  # the checkout (or site-packages) holding this package


class UndeclaredParamError(PipelineError):
    """A stage read a params key that dvc.yaml does not declare for it (a pipeline-definition error)."""

    exit_code = 2


def project_root() -> Path:
    """The directory holding params.yaml and dvc.yaml: the working directory where DVC runs stages."""
    return Path(os.environ.get("RLHF_PROJECT_ROOT", os.getcwd()))


# --------------------------------------------------------------------------------------------
# what dvc.yaml declares
# --------------------------------------------------------------------------------------------
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


def declared_keys_by_stage(root: str | os.PathLike = ".") -> dict[str, frozenset[str] | None]:
    """Every stage of ``root``/dvc.yaml with the params.yaml keys it declares ({} without a dvc.yaml).

    The index also holds the ``.dvc`` files (``dvc add``, the flow's ingest): data, not stages, with
    no name and no params, so they are left out."""
    from dvc.repo import Repo
    from dvc.stage import PipelineStage

    root = Path(root).resolve()
    if not (root / "dvc.yaml").is_file():
        return {}
    with Repo(str(root), uninitialized=True) as repo:
        return {
            stage.name: _params_file_keys(stage, root)
            for stage in repo.index.stages
            if isinstance(stage, PipelineStage)
        }


def declared_code_hash(stage: str, root: str | os.PathLike = ".") -> str:
    """sha256 over the Python files ``dvc.yaml`` declares as ``stage``'s dependencies (its script
    and the library modules it imports; tests/test_dvc_yaml.py keeps that list exact). A resumable
    checkpoint records it, so a checkpoint written by other code is not resumed by this code.

    Each file is hashed where DVC hashes it, under the project root; a file the project does not
    hold there (a stage run in a scratch folder, as the tests do) is hashed where it runs from."""
    root = Path(root).resolve()
    declaration = _stage_declaration(stage, root)
    files = sorted({dep.def_path for dep in declaration.deps if str(dep.def_path).endswith(".py")})
    digest = hashlib.sha256()
    for name in files:
        path = root / name if (root / name).is_file() else CODE_ROOT / name
        digest.update(f"{name}\0{sha256_file(path)}\n".encode())
    return digest.hexdigest()


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


# --------------------------------------------------------------------------------------------
# the view a stage gets
# --------------------------------------------------------------------------------------------
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


def stage_params(
    name: str, path: str, root: str | os.PathLike, schema: type[StageParams]
) -> StageParams | DeclaredParams:
    """What stage ``name`` may read of the params file at ``path``: the sections of ``schema``,
    validated, restricted to the keys ``dvc.yaml`` declares for the stage, each of which the file
    must hold. The other sections of the file are not the stage's concern (``rlhf check-params``
    and the retrain flow validate the whole file)."""
    raw = read_params_file(path)
    mine = {key: value for key, value in raw.items() if key in schema.model_fields} if isinstance(raw, dict) else raw
    params = validate(schema, mine, path)
    keys = declared_param_keys(name, root)
    unknown = sorted({key.split(".")[0] for key in keys or ()} - set(schema.model_fields))
    if unknown:
        raise ParamsError(
            path,
            [
                f"{section}: dvc.yaml declares it for stage {name}, whose params schema ({schema.__name__}) has no "
                f"such section; add it to the schema or remove it from dvc.yaml"
                for section in unknown
            ],
        )
    if keys is None:
        return params
    problems = missing_key_problems(raw, {f"stage {name}": keys})
    if problems:
        raise ParamsError(path, problems)
    return DeclaredParams(params, keys, name)


# --------------------------------------------------------------------------------------------
# running a stage
# --------------------------------------------------------------------------------------------
def seed_everything(seed: int) -> None:
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def report_error(error: PipelineError, prog: str) -> int:
    if isinstance(error, ParamsError):
        print(f"{prog}: {error.path} is invalid:", file=sys.stderr)
        for line in error.problems:
            print(line, file=sys.stderr)
    else:
        print(f"{prog}: error: {error}", file=sys.stderr)
    return error.exit_code


def report_unexpected(error: Exception, prog: str) -> int:
    """A storage failure outside the atomic writers (a library writing its own files) exits 5 with
    one paragraph; anything else is a bug: its traceback is printed, exit 1."""
    reason = storage_failure(error)
    if reason is not None:
        return report_error(storage_error(reason, getattr(error, "filename", None) or "an output"), prog)
    if isinstance(error, ImportError):
        return report_error(missing_package_error(error), prog)
    traceback.print_exception(error)
    return 1


def missing_package_error(error: ImportError) -> MissingPackageError:
    return MissingPackageError(
        f"{error} (interpreter {sys.executable}). Install the project into that interpreter (`make setup`, or "
        "`pip install -e .`), or run `dvc` from the project's virtual environment (`source .venv/bin/activate`)."
    )


def record_reads(name: str, view: StageParams | DeclaredParams) -> None:
    folder = os.environ.get(RECORD_READS_ENV)
    if folder and isinstance(view, DeclaredParams):
        Path(folder).mkdir(parents=True, exist_ok=True)
        Path(folder, f"{name}.json").write_text(json.dumps(sorted(view.reads)) + "\n")


def peak_gpu_memory_mb() -> float | None:
    """The most GPU memory torch's caching allocator held at once in this process, in MB (what
    nvidia-smi shows less the CUDA context), or None where this process used no GPU. Read through
    ``sys.modules``: a stage that never imports torch (queries, validate_preferences) is not made to."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    return torch.cuda.max_memory_reserved() / 2**20


def seconds_since_process_start() -> float:
    """Wall time since this process was created: the stage's whole cost, Python and torch imports
    included, so the stage times in `dvc repro`'s log add up to its wall time."""
    import psutil

    return time.time() - psutil.Process().create_time()


def run_stage(name: str, body: Callable[[Any], None], schema: type[StageParams], argv: list[str] | None = None) -> None:
    """Parse ``--params``, validate the sections of ``schema``, restrict to the declared keys, seed,
    and call ``body(params)``; exit non-zero on user errors.

    Unexpected exceptions still print their traceback: those are bugs, and hiding them would
    make them harder to report.
    """
    if not gc.isenabled():
        # stages/_interpreter.py turned the collector off for a fresh stage process's imports: what they
        # made lives until the process ends, so it leaves the collector's reach before it goes back on
        gc.freeze()
        gc.enable()
    parser = argparse.ArgumentParser(prog=f"stage {name}")
    parser.add_argument("--params", default=os.environ.get("RLHF_PARAMS", PARAMS_FILE))
    args = parser.parse_args(argv)
    try:
        params = stage_params(name, args.params, project_root(), schema)
        allocator.keep_freed_memory()  # a few % off a training step: see allocator.py
        if "compute" in schema.model_fields:  # before the stage's first torch operation: see numerics.py
            numerics.pin(params.compute.cpu_numerics, params.compute.cpu_threads)
        declares_seed = not isinstance(params, DeclaredParams) or params.declares("seed")
        seed_everything(params.seed if declares_seed else UNDECLARED_SEED)
        body(params)
        record_reads(name, params)
        given_back = allocator.times_given_back()
        gpu = peak_gpu_memory_mb()
        print(
            f"stage {name}: done in {seconds_since_process_start():.0f} s, peak RSS {allocator.peak_rss_mb():.0f} MB"
            + ("" if gpu is None else f", peak GPU memory {gpu:.0f} MB")
            + ("" if given_back is None else f", freed memory past the bound given back {given_back} times"),
            flush=True,
        )
    except PipelineError as error:
        sys.exit(report_error(error, f"stage {name}"))
    except KeyboardInterrupt:
        print(f"stage {name}: interrupted", file=sys.stderr)
        sys.exit(130)
    except Exception as error:
        sys.exit(report_unexpected(error, f"stage {name}"))
