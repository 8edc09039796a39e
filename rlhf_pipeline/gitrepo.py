"""git, run by the library: the one module that starts a ``git`` process (the lineage records, the
registry, the version commands and the lock history read git through it).

A revision or a name typed by a user reaches git only through :func:`resolve_rev`, which refuses
(exit 2) anything git could read as an option, a path or a second argument before git sees it, and
then asks git with ``--end-of-options``: a revision is never an option, as git itself promises for
arguments after that marker.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from rlhf_pipeline.errors import PipelineError, SettingsError, quoted

MAX_REVISION_CHARS = 256
# what git's revision syntax needs (names, shas, ~N, ^N, @{...}), and nothing that a shell, an option
# or a path reads: no leading '-', no ':' (``REV:PATH`` names a file), no spaces, quotes or ';'
_REVISION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/~^@{}+-]*")


def git(root: str | Path, *args: str, timeout_s: float = 60) -> str | None:
    """``git ARGS`` in ``root``: its stdout without the trailing newline, or None when git fails (or is
    missing, or runs past ``timeout_s``)."""
    try:
        proc = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.rstrip() if proc.returncode == 0 else None


def commit_staged(root: str | Path, paths: list[str], message: str) -> str:
    """Commit the staged ``paths`` (nothing else a person has staged) with ``message``; the new
    commit's short id. A refusal (no identity, a hook) is a PipelineError with git's own words."""
    try:
        proc = subprocess.run(
            ["git", "commit", "-q", "-m", message, "--", *paths], cwd=root, capture_output=True, text=True, timeout=120
        )
    except (OSError, subprocess.SubprocessError) as error:
        raise PipelineError(f"git commit in {root} could not run: {error}") from None
    if proc.returncode != 0:
        raise PipelineError(f"git commit in {root} failed:\n{proc.stderr.strip() or proc.stdout.strip()}")
    return git(root, "rev-parse", "--short", "HEAD") or "?"


def file_bytes_at(root: str | Path, commit: str, path: str) -> bytes | None:
    """The bytes of ``path`` (a path of the project, never a user's text) at ``commit`` (a commit id
    git gave, or a revision :func:`resolve_rev` accepted); None when that commit has no such file."""
    try:
        proc = subprocess.run(
            ["git", "show", "--end-of-options", f"{commit}:{path}"], cwd=root, capture_output=True, timeout=60
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout if proc.returncode == 0 else None


def file_at(root: str | Path, commit: str, path: str) -> str | None:
    """The text of ``path`` at ``commit`` (see :func:`file_bytes_at`); None when it has none."""
    data = file_bytes_at(root, commit, path)
    return None if data is None else data.decode("utf-8", "replace")


def commits_touching(root: str | Path, path: str) -> list[str]:
    """Every commit of every branch and tag that changed ``path``, newest first."""
    return (git(root, "log", "--format=%H", "--all", "--", path) or "").split()


def check_revision(rev: str, what: str) -> str:
    """``rev`` when it has the shape of a git revision; else SettingsError (exit 2) naming ``what``
    (the option it came from), without echoing more than its first characters."""
    if len(rev) > MAX_REVISION_CHARS or not _REVISION.fullmatch(rev):
        raise SettingsError(
            f"{what} {quoted(rev)}: not a git revision. A revision is a branch, a tag, a commit id or HEAD~N (letters, "
            f"digits and . _ / ~ ^ @ {{ }} + -, not starting with '-', at most {MAX_REVISION_CHARS} characters); "
            "nothing was read and git was not called."
        )
    return rev


def resolve_rev(root: str | Path, rev: str, what: str = "--rev") -> str:
    """The commit ``rev`` names (a branch, tag, sha, ``HEAD~2``); SettingsError (exit 2) when it is not a
    revision's shape or git knows none by that name."""
    check_revision(rev, what)
    commit = git(root, "rev-parse", "--verify", "--quiet", "--end-of-options", f"{rev}^{{commit}}")
    if not commit:
        raise SettingsError(f"{what} {rev}: git knows no such revision in {root} (a branch, tag or commit).")
    return commit
