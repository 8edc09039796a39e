"""Files in and out.

Outputs are atomic: written to a temporary sibling, then renamed into place, so a crashed or
refused stage never leaves a half-written artifact where DVC (or the next stage) would mistake
it for a finished one. User files (JSONL, Parquet, text) are read with one clear error for
anything unreadable, naming the file and line.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import shutil
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rlhf_pipeline import paths
from rlhf_pipeline.errors import (
    DamagedArtifactError,
    DataContractError,
    ParamsError,
    PipelineError,
    StorageError,
    quoted,
    storage_error,
    storage_failure,
)

CHECKSUMS = "SHA256SUMS"  # `sha256sum -c SHA256SUMS` format: "<hex>  <relative path>" per file, sorted
# a user's own files: dvc.yaml declares each folder a dependency of the stages that read it
LOCAL_MODELS, RAW_DATA, LABELS = Path(paths.LOCAL_MODELS), Path(paths.RAW_DATA), Path(paths.LABELS)


@contextlib.contextmanager
def atomic_dir(target: str | os.PathLike, checksums: bool = False) -> Iterator[Path]:
    """Yield a fresh temporary directory that replaces ``target`` only if the block succeeds.

    The swap is two renames (target -> .old, tmp -> target); a kill between them is undone by
    :func:`recover_interrupted_write`, which runs first. A full disk or a read-only folder raises
    :class:`StorageError` naming ``target``. ``checksums``: record every file's sha256 in
    ``SHA256SUMS`` before the swap (:func:`verify_checksums` checks them when the folder is read)."""
    target = Path(target)
    if target.exists() and not target.is_dir():  # os.replace would swap a file for the folder and hide it as .old
        raise StorageError(
            f"{target} is a file, not a folder: choose a folder's path for this output. Nothing was written."
        )
    with storage_errors_name(target):
        target.parent.mkdir(parents=True, exist_ok=True)
        recover_interrupted_write(target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            os.chmod(tmp, 0o755)  # mkdtemp makes it private; outputs are meant to be shared
            yield tmp
            share_modes(tmp)
            if checksums:
                write_checksums(tmp)
            old = target.parent / f".{target.name}.old-{os.getpid()}"
            if target.exists():
                os.replace(target, old)
            os.replace(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        shutil.rmtree(old, ignore_errors=True)


def share_modes(directory: Path) -> None:
    """Make everything under ``directory`` readable by all: files 0644, folders 0755. Some writers
    (safetensors among them) create their files 0600, and an output is read by others: a colleague
    on a shared cache, a server, a container running as another user."""
    for path in directory.rglob("*"):
        if not path.is_symlink():
            os.chmod(path, 0o755 if path.is_dir() else 0o644)


@contextlib.contextmanager
def storage_errors_name(target: Path) -> Iterator[None]:
    """Turn a full-disk / read-only / permission failure inside the block into a
    :class:`StorageError` that names ``target`` (the OS error often names no file)."""
    try:
        yield
    except PipelineError:
        raise
    except Exception as error:
        reason = storage_failure(error)
        if reason is None:
            raise
        raise storage_error(reason, target) from error


def recover_interrupted_write(target: str | os.PathLike) -> None:
    """Clean up after an :func:`atomic_dir` write that was killed: if ``target`` is missing but
    its previous version is still parked as ``.NAME.old-PID``, put it back; then delete leftover
    ``.NAME.tmp-*`` and ``.NAME.old-*`` siblings. Writers of one target never overlap (one
    stage writes it, under DVC's lock), so anything left there is debris."""
    target = Path(target)
    if not target.parent.is_dir():
        return
    parked = sorted(target.parent.glob(f".{target.name}.old-*"), key=lambda p: p.stat().st_mtime)
    if not target.exists() and parked:
        os.replace(parked.pop(), target)
    for leftover in [*parked, *target.parent.glob(f".{target.name}.tmp-*")]:
        shutil.rmtree(leftover, ignore_errors=True)


@contextlib.contextmanager
def atomic_file(target: str | os.PathLike, mode: str = "w") -> Iterator[Any]:
    """Open a temporary sibling of ``target`` for writing; rename it over ``target`` on success."""
    target = Path(target)
    with storage_errors_name(target):
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.tmp-", dir=target.parent)
        try:
            os.chmod(tmp_name, 0o644)
            with os.fdopen(fd, mode) as handle:
                yield handle
            os.replace(tmp_name, target)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp_name)
            raise


def write_figure(figure: Any, target: str | os.PathLike, dpi: int) -> None:
    """Save a matplotlib ``figure`` as a PNG at ``target``, atomically (the one way a plot is written)."""
    with atomic_file(target, "wb") as handle:
        figure.savefig(handle, format="png", dpi=dpi)


def write_json(target: str | os.PathLike, payload: Any) -> None:
    with atomic_file(target) as handle:
        json.dump(payload, handle, indent=2, sort_keys=True, default=float)
        handle.write("\n")


def read_json(path: str | os.PathLike) -> Any:
    with open(path) as handle:
        return json.load(handle)


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def content_hash(path: str | os.PathLike) -> str:
    """sha256 of a file, or over the sorted (relative path, file sha256) pairs of a directory."""
    path = Path(path)
    if path.is_file():
        return sha256_file(path)
    digest = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        digest.update(f"{file.relative_to(path).as_posix()}\0{sha256_file(file)}\n".encode())
    return digest.hexdigest()


def write_checksums(directory: str | os.PathLike) -> None:
    """``SHA256SUMS`` in ``directory``: the sha256 of every other file in it, by relative path."""
    directory = Path(directory)
    files = (p for p in directory.rglob("*") if p.is_file() and p.name != CHECKSUMS)
    recorded = {p.relative_to(directory).as_posix(): sha256_file(p) for p in files}
    (directory / CHECKSUMS).write_text(checksum_text(recorded))


def checksum_text(recorded: dict[str, str]) -> str:
    """The text of a ``SHA256SUMS`` file listing ``recorded`` (``{relative path: sha256}``): one
    ``<hex>  <path>`` line per file, sorted by path (what :func:`read_checksums` reads back)."""
    return "".join(f"{digest}  {name}\n" for name, digest in sorted(recorded.items()))


def read_checksums(path: str | os.PathLike) -> dict[str, str]:
    """``{relative path: sha256}`` of a ``SHA256SUMS`` file (an unreadable line is a damaged file)."""
    recorded = {}
    for number, line in enumerate(Path(path).read_text(errors="replace").splitlines(), 1):
        digest, sep, name = line.partition("  ")
        if not sep or len(digest) != 64:
            raise DamagedArtifactError(
                f"{path}: line {number} is not '<sha256>  <file>'; the checksum file is damaged."
            )
        recorded[name] = digest
    return recorded


def checksum_problems(directory: str | os.PathLike, recorded: dict[str, str]) -> list[str]:
    """How the files of ``directory`` differ from ``recorded`` (``{relative path: sha256}``):
    each file hashed from its bytes (no cached stat), one line per difference."""
    directory = Path(directory)
    problems = []
    for name, digest in sorted(recorded.items()):
        path = directory / name
        if not path.is_file():
            problems.append(f"{name} is missing")
        elif sha256_file(path) != digest:
            problems.append(f"{name} does not match its recorded sha256")
    return problems


def unlisted_files(directory: str | os.PathLike, recorded: dict[str, str]) -> list[str]:
    """The files of ``directory`` (besides ``SHA256SUMS``) that ``recorded`` does not list, one line each.

    A model folder is read by transformers and peft, which load what they find: an
    ``adapter_config.json`` beside the weights is applied on top of them, so a file added after the
    stage wrote the folder changes the model as surely as an edited one."""
    directory = Path(directory)
    present = sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*") if not p.is_dir())
    return [
        f"{name} is not listed (a file added after the folder was written; it would be loaded with it)"
        for name in present
        if name != CHECKSUMS and name not in recorded
    ]


def verify_checksums(directory: str | os.PathLike, rebuild: str) -> None:
    """Refuse ``directory`` (:class:`DamagedArtifactError`) unless every file its ``SHA256SUMS``
    lists has those bytes and it holds no other file; ``rebuild`` says how to get a good copy back."""
    directory = Path(directory)
    sums = directory / CHECKSUMS
    if not sums.is_file():
        raise DamagedArtifactError(
            f"{directory} has no {CHECKSUMS}, so its files cannot be checked before use; {rebuild}."
        )
    recorded = read_checksums(sums)
    problems = unlisted_files(directory, recorded) + checksum_problems(directory, recorded)
    if problems:
        listed = "; ".join(problems[:5]) + (f"; ... and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise DamagedArtifactError(
            f"{directory} is damaged: {listed} (checked against {sums}). Nothing was trained on it. `rlhf lineage "
            f"--verify {directory}` shows which copy (workspace or DVC cache) is bad; {rebuild}."
        )


# --------------------------------------------------------------------------------------------
# user files
# --------------------------------------------------------------------------------------------
_SURROGATES = re.compile(r"[\ud800-\udfff]")


def replace_surrogates(value):
    """Lone surrogates (from JSON escapes like "\\ud800") -> U+FFFD, the mark of invalid UTF-8.

    pandas' string dtype (and arrow) cannot hold surrogates at all; U+FFFD can, and the data
    contract flags it."""
    return _SURROGATES.sub("\ufffd", value) if isinstance(value, str) else value


class _KeyGivenTwice(Exception):
    """A JSON object naming one key twice (json.loads would keep the last value without a word)."""


def _object_naming_each_key_once(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json.loads' object hook: the object as a dict, or :class:`_KeyGivenTwice` with the first key given
    twice (the same rule as params.yaml's: a labelling tool that writes ``chosen`` twice says two things)."""
    made = dict(pairs)
    if len(made) < len(pairs):
        seen = set()
        raise _KeyGivenTwice(next(key for key, _ in pairs if key in seen or seen.add(key)))
    return made


def nesting_depth(value: Any, limit: int) -> int:
    """How deep dicts and lists nest in ``value``, counted up to ``limit + 1`` (iteratively: a
    value nested 100,000 deep must not recurse)."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        deepest = max(deepest, depth)
        if depth <= limit and isinstance(item, dict | list):
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


class NotUTF8Error(ValueError):
    """A file that should be UTF-8 text holds a byte that is not; the message names the file, byte and line."""


def decode_utf8(path: str | os.PathLike, data: bytes) -> str:
    """``data``, the bytes of the file ``path``, as UTF-8 text; a :class:`NotUTF8Error` naming the first
    bad byte and its line otherwise. The one wording of that problem: each caller adds its own fix."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data[: error.start].count(b"\n") + 1
        raise NotUTF8Error(f"{path} is not UTF-8 text (byte {data[error.start]:#04x} on line {line})") from None


# UTF-8 that skips one byte-order mark at the start of the file: a user's text file saved by Notepad or Excel
# opens with one, which json.loads refuses ("Unexpected UTF-8 BOM") and a passage would keep as text
UTF8_OPTIONAL_BOM = "utf-8-sig"
# a preference row nests at most a list of messages of role/content mappings: 3 levels
MAX_ROW_DEPTH = 8


def read_jsonl(path: Path) -> dict[str, list]:
    """The columns of a JSON-lines file, ``{name: values}`` in the order names first appear, a row
    without a name holding NaN there (as pandas builds a frame from records); blank lines are
    skipped. Built column by column, not as a list of row dicts: a million rows then take their
    values' memory, not a dict each besides. Invalid UTF-8 bytes and lone surrogate escapes become
    U+FFFD (visible to the data contract) instead of crashing. A byte-order mark opening the file (Notepad
    and Excel write one) is skipped, as pandas and PyYAML skip it. A line that is not a JSON object, names
    a key twice in one object, or nests deeper than any row format, is refused (exit 3)."""
    columns: dict[str, list] = {}
    rows = 0
    with open(path, encoding=UTF8_OPTIONAL_BOM, errors="replace") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            too_deep = f"{path}: line {number} nests values more than {MAX_ROW_DEPTH} levels deep; no row format does."
            try:
                row = json.loads(line, object_pairs_hook=_object_naming_each_key_once)
            except json.JSONDecodeError as error:
                raise DataContractError(
                    f"{path}: line {number} is not valid JSON ({error.msg}); each line must be one JSON object."
                ) from None
            except _KeyGivenTwice as twice:
                raise DataContractError(
                    f"{path}: line {number} gives the key {quoted(str(twice))} twice in one object, so which value "
                    "it means is unknown (JSON readers keep the last silently); give each key once."
                ) from None
            except RecursionError:  # the JSON decoder recurses once per level
                raise DataContractError(too_deep) from None
            if not isinstance(row, dict):
                raise DataContractError(
                    f"{path}: line {number} is a JSON {type(row).__name__}, not an object with named columns."
                )
            if nesting_depth(row, MAX_ROW_DEPTH) > MAX_ROW_DEPTH:
                raise DataContractError(too_deep)
            for key, value in row.items():
                values = columns.get(key)
                if values is None:  # a new name: NaN in every row before (setdefault would build it each call)
                    values = columns[key] = [math.nan] * rows
                values.append(replace_surrogates(value))
            rows += 1
            if len(row) < len(columns):
                for values in columns.values():
                    if len(values) < rows:
                        values.append(math.nan)
    return columns


def read_table(path: str | Path):
    """A .jsonl or .parquet file as a pandas DataFrame: PipelineError if missing, DataContractError (exit 3)
    if unreadable or naming a column twice."""
    import pandas as pd

    path = Path(path)
    if path.is_dir():
        raise PipelineError(f"{path} is a folder; give a .jsonl or .parquet file.")
    if not path.is_file():
        raise PipelineError(f"{path} not found (paths are relative to the project root, e.g. data/raw/corpus.jsonl).")
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        columns = read_jsonl(path)
        return pd.DataFrame(columns) if columns else pd.DataFrame()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            names = pq.read_schema(path).names
            twice = next((name for name, count in Counter(names).items() if count > 1), None)
            if twice is None:
                return pd.read_parquet(path)
        except Exception as error:  # pyarrow raises several unrelated types, some with the schema over lines
            first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise DataContractError(f"{path} is not a readable Parquet file: {first_line}") from None
        # Arrow keeps both columns of one name, and pandas would then fail on the name
        raise DataContractError(
            f"{path} has two columns named {quoted(twice)}, so which one holds the data is unknown; give each "
            "column one name."
        )
    raise PipelineError(f"{path}: unsupported file type {suffix!r}; use .jsonl or .parquet.")


def is_local_source(source: str) -> bool:
    """A path (existing, or named like a supported file) rather than a hub dataset id."""
    return (
        Path(source).exists()
        or source.lower().endswith((".txt", ".jsonl", ".parquet", ".json"))
        or source.startswith(("/", "./", "../"))
    )


def load_hub_dataset(source: str, split: str | None, key: str):
    """``datasets.load_dataset(source, split=split)`` with offline failures turned into one clear error."""
    import datasets

    try:
        return datasets.load_dataset(source, split=split)
    except Exception as error:  # offline/connection/not-found errors come in many types
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise PipelineError(
            f"{key}: could not load hub dataset {source!r} (split {split!r}): {first}. It is not a local file "
            f"either. Hub downloads are off (HF_DATASETS_OFFLINE=1): pre-download it with network access, export "
            f"HF_DATASETS_OFFLINE=0 HF_HUB_OFFLINE=0, or point {key} at a local file."
        ) from None


def local_model_dir(source: str, key: str) -> Path | None:
    """``source`` as a local model folder (None when it names none: a hub id), refused unless it
    lies inside ``data/models/``, where dvc.yaml tracks every file of it for the stages that read it."""
    path = Path(source)
    if not path.exists():
        return None
    if not path.is_dir():
        raise PipelineError(
            f"{key} '{source}' is a file; give a model directory or a hub id (base_model.source also takes a "
            ".gguf file)."
        )
    return require_tracked_location(path, key, LOCAL_MODELS, "local model folder")


def require_tracked_location(path: str | os.PathLike, key: str, folder: Path, what: str = "file") -> Path:
    """``path``, if it lies inside ``folder`` (links resolved), the folder ``dvc.yaml`` declares as a
    dependency of the stage reading ``key``; ParamsError otherwise. A file elsewhere is read but
    not tracked: editing it would leave `dvc status` up to date and the stale results served."""
    path = Path(path)
    if Path(os.path.realpath(path)).is_relative_to(os.path.realpath(folder)):
        return path
    raise ParamsError(
        "params.yaml",
        [
            f"{key}: the {what} {path} is outside {folder}/, the folder dvc.yaml declares as a dependency of the "
            "stage that reads it, so DVC cannot see it change and would keep serving results built from an older "
            f"copy. Copy it into {folder}/ (e.g. {folder}/{path.name}; `dvc add` it to version it) and set {key} "
            "to that path"
        ],
    )


def read_txt_passages(path: Path) -> list[str]:
    """Paragraphs separated by blank lines; one passage per line if the file has no blank line (a
    byte-order mark opening the file is skipped, not read as the first passage's first character)."""
    text = path.read_text(encoding=UTF8_OPTIONAL_BOM, errors="replace").strip()
    paragraphs = re.split(r"\n\s*\n", text)
    if len(paragraphs) == 1:
        return text.splitlines()
    return [" ".join(line.strip() for line in p.splitlines() if line.strip()) for p in paragraphs]
