"""Atomic outputs: write to a temporary sibling, then rename into place.

A crashed or refused stage therefore never leaves a half-written artifact where DVC (or the
next stage) would mistake it for a finished one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rlhf_pipeline.errors import PipelineError, storage_error, storage_failure


@contextlib.contextmanager
def atomic_dir(target: str | os.PathLike) -> Iterator[Path]:
    """Yield a fresh temporary directory that replaces ``target`` only if the block succeeds.

    The swap is two renames (target -> .old, tmp -> target); a kill between them is undone by
    :func:`recover_interrupted_write`, which runs first. A full disk or a read-only folder raises
    :class:`StorageError` naming ``target``."""
    target = Path(target)
    with storage_errors_name(target):
        target.parent.mkdir(parents=True, exist_ok=True)
        recover_interrupted_write(target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            os.chmod(tmp, 0o755)  # mkdtemp makes it private; outputs are meant to be shared
            yield tmp
            old = target.parent / f".{target.name}.old-{os.getpid()}"
            if target.exists():
                os.replace(target, old)
            os.replace(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        shutil.rmtree(old, ignore_errors=True)


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
