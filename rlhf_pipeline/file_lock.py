"""One writer at a time of a project file: a command that reads, merges and rewrites a file (label
import --append, verdicts into a round, a round sampled) holds :func:`held` across all three, so two
at once never lose each other's rows.

The lock is an advisory ``flock`` on a file beside the repository's git data (``.git/rlhf-locks/``),
or in the temporary folder outside a repository, never in the project's tracked folders (DVC would
see it). It guards processes of one machine, as DVC's own lock does.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rlhf_pipeline.errors import BusyError

POLL_S = 0.05


def lock_file(path: str | Path) -> Path:
    """Where the lock of ``path`` lives: ``.git/rlhf-locks/`` of the repository holding it, else a
    folder of this user's in the temporary folder; named by the digest of the resolved path."""
    target = Path(path).resolve()
    name = hashlib.sha256(str(target).encode()).hexdigest()[:32] + ".lock"
    for folder in target.parents:
        if (folder / ".git").is_dir():
            return folder / ".git" / "rlhf-locks" / name
    return Path(tempfile.gettempdir(), f"rlhf-locks-{os.getuid()}", name)


@contextmanager
def held(path: str | Path, timeout_s: float = 600.0) -> Iterator[None]:
    """Hold ``path``'s lock (waiting up to ``timeout_s`` for another writer); BusyError (exit 75) past it."""
    where = lock_file(path)
    where.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    deadline = time.monotonic() + timeout_s
    with open(where, "a") as handle:
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise BusyError(
                        f"{path} is being written by another command (its lock {where} was held for {timeout_s:g} s); "
                        "nothing was changed. Try again when it has finished."
                    ) from None
                time.sleep(POLL_S)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
