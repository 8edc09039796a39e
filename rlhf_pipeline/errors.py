"""User-facing errors: one clear paragraph, a non-zero exit, no traceback."""

from __future__ import annotations

import errno
import re


def quoted(text: str, limit: int = 60) -> str:
    """``text`` as a message may show a user's input: its first ``limit`` characters, with anything
    unprintable (a NUL, a control or bidirectional character) escaped, and ``...`` when cut."""
    return ascii(text[:limit]) + ("..." if len(text) > limit else "")


def plain(text: str, limit: int = 60) -> str:
    """``text`` as it is when it is printable ASCII of at most ``limit`` characters (an id, a name),
    else :func:`quoted`: nothing a user typed can reorder, hide or flood a message."""
    return text if len(text) <= limit and text.isascii() and text.isprintable() else quoted(text, limit)


class PipelineError(Exception):
    """A problem with the user's input (file, dataset, parameter) rather than a bug.

    The message is printed as-is by the stage runner and the CLI, so it must name the file,
    key or column at fault and say what to do about it.
    """

    exit_code = 1


class ParamsError(PipelineError):
    """params.yaml failed validation; ``problems`` holds one ``dotted.key: message`` per line."""

    exit_code = 2

    def __init__(self, path: str, problems: list[str]):
        self.path = path
        self.problems = problems
        super().__init__("\n".join(problems))


class LaunchConfigError(PipelineError):
    """The multi-process configuration `accelerate launch` passed cannot be honoured: refused before
    training, with params.yaml's exit code (a configuration no retry can fix)."""

    exit_code = ParamsError.exit_code


class SettingsError(PipelineError):
    """A command cannot run as called: wrong arguments, or a setting it reads from the environment
    missing or refused (a server's address, an API token). Exit 2, like params.yaml: no retry fixes it."""

    exit_code = ParamsError.exit_code


class DataContractError(PipelineError):
    """Preference data failed the Great Expectations contract."""

    exit_code = 3


class NonFiniteError(PipelineError):
    """Training produced NaN/inf; nothing is written and the last good checkpoint is kept."""

    exit_code = 4


class StorageError(PipelineError):
    """An output could not be written: the disk or quota is full, the file system is read-only, or
    permission is denied. Retrying does not help until the user frees space or fixes the folder."""

    exit_code = 5


class MissingPackageError(PipelineError):
    """The interpreter running a stage lacks a package the stage imports: an installation problem."""

    exit_code = 6


class LostProcessError(PipelineError):
    """One of the processes `accelerate launch` started is gone (killed, crashed, or silent past the
    collective timeout), so the others cannot go on. Another launch can succeed: retried."""


class DamagedArtifactError(PipelineError):
    """An artifact's bytes differ from the checksums recorded when it was written (a model's
    SHA256SUMS, a checkpoint's meta, dvc.lock or the DVC cache): nothing is trained on or pushed
    from it. Retrying reads the same bytes; restoring or rebuilding the artifact fixes it."""

    exit_code = 7


class BusyError(PipelineError):
    """Another run holds the project (the retrain flow's lock): nothing was changed; try again later.
    The code is sysexits' EX_TEMPFAIL, which schedulers read as "retry later"."""

    exit_code = 75


COMMAND_NOT_FOUND_EXIT_CODE = 127  # the shell's: a stage's command (e.g. `python`) is not on PATH

# Exit codes of failures that are the same on every attempt: the retrain flow fails at once on these.
NOT_RETRIED_EXIT_CODES = frozenset(
    {
        ParamsError.exit_code,
        DataContractError.exit_code,
        NonFiniteError.exit_code,
        StorageError.exit_code,
        MissingPackageError.exit_code,
        DamagedArtifactError.exit_code,
        COMMAND_NOT_FOUND_EXIT_CODE,
    }
)
EXIT_CODE_MEANINGS = {
    ParamsError.exit_code: "params.yaml or launch configuration invalid",
    DataContractError.exit_code: "data-contract failure",
    NonFiniteError.exit_code: "non-finite training (NaN/inf)",
    StorageError.exit_code: "an output could not be written (disk full, read-only or no permission)",
    MissingPackageError.exit_code: "a package is missing from the stage's interpreter",
    DamagedArtifactError.exit_code: "an artifact's bytes differ from their recorded checksums",
    COMMAND_NOT_FOUND_EXIT_CODE: "the stage's command is not on PATH",
}

_STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM})
# Writers that wrap the OS error in their own text: safetensors ("I/O error: No space left on device (os error 28)")
_STORAGE_TEXT = re.compile(
    r"No space left on device|Disk quota exceeded|Read-only file system|Permission denied|Operation not permitted"
)


def storage_failure(error: BaseException) -> str | None:
    """The operating system's reason when ``error``, or an exception it was raised from or while
    handling (torch.save raises a RuntimeError while handling the OSError), is a storage failure."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in _STORAGE_ERRNOS:
            return current.strerror or _STORAGE_TEXT.search(str(current)).group(0)
        match = _STORAGE_TEXT.search(str(current))
        if match:
            return match.group(0)
        current = current.__cause__ or current.__context__
    return None


def storage_error(reason: str, target: object) -> StorageError:
    return StorageError(
        f"could not write {target}: {reason}. Nothing half-written is left in its place (outputs are written to a "
        "temporary sibling, renamed into place only when complete, and the temporary is removed on failure). "
        "Free disk space, or make the folder writable, then run the stage again; the retrain flow does not retry this."
    )
