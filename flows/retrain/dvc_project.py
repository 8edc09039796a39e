"""Everything the flow asks of DVC: the stage order from DVC's graph, status, metrics, outputs and
remotes through ``dvc.repo.Repo``; ``dvc repro``/``push``/``add`` as subprocesses (each stage gets a
process of its own, and its output is streamed to the flow's log line by line)."""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlhf_pipeline.errors import (
    EXIT_CODE_MEANINGS,
    NOT_RETRIED_EXIT_CODES,
    MissingPackageError,
    ParamsError,
    PipelineError,
    StorageError,
    storage_failure,
)
from rlhf_pipeline.lineage.record import lock_problem, stage_name
from rlhf_pipeline.paths import DVC_LOCK, DVC_LOCK_COPY
from rlhf_pipeline.redaction import redact

DEFAULT_LOCAL_REMOTE = "localremote"
OUTPUT_TAIL_LINES = 40
_EXITED_WITH = re.compile(r"exited with (-?\d+)")
# A traceback ending in one of these: the environment lacks a package, the same on every attempt.
_MISSING_MODULE = re.compile(r"^(ModuleNotFoundError|ImportError): ", re.MULTILINE)


class RetrainError(Exception):
    """A retrain run failed for a reason the user can act on; ``exit_code`` is the CLI's."""

    def __init__(self, message: str, exit_code: int = PipelineError.exit_code):
        super().__init__(redact(message))  # it is logged and shown by Prefect: a child's output may quote a secret
        self.exit_code = exit_code


def open_repo(root: Path):
    from dvc.exceptions import NotDvcRepoError
    from dvc.repo import Repo

    if not (root / "dvc.yaml").is_file():
        raise RetrainError(
            f"{root / 'dvc.yaml'} not found: --repo must point at a DVC project (the folder holding dvc.yaml)",
            ParamsError.exit_code,
        )
    try:
        return Repo(str(root))
    except NotDvcRepoError as error:
        raise RetrainError(
            f"{root} is not a DVC repository ({error}): run `dvc init` there first", ParamsError.exit_code
        ) from None


def keep_lock_copy(root: Path) -> bool:
    """Copy ``root``/dvc.lock to :data:`DVC_LOCK_COPY` (atomically), if DVC can read it; False when
    there is no dvc.lock yet."""
    lock = root / DVC_LOCK
    if not lock.is_file():
        return False
    if lock_problem(str(root)) is not None:
        return True  # unreadable already: the copy from before stays the good one
    target = root / DVC_LOCK_COPY
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".dvc.lock.", dir=target.parent)
    os.close(fd)
    shutil.copyfile(lock, tmp)
    os.replace(tmp, target)
    return True


def restore_lock_copy(root: Path, logger, had_lock: bool = True) -> None:
    """Put the copy :func:`keep_lock_copy` took back over ``root``/dvc.lock if they differ (remove
    dvc.lock when there was none before: ``had_lock`` false).

    For a ``dvc repro`` that did not exit 0: DVC writes dvc.lock only once a stage has succeeded, so
    a failed run leaves it as it was, unless DVC was killed while writing it. A kill mid-write can
    leave a file that no longer parses, or (cut at a line end) one that parses but lost records; the
    copy is right in both cases, and the stage it was taken for simply runs again."""
    copy, lock = root / DVC_LOCK_COPY, root / DVC_LOCK
    if not had_lock:
        if lock.is_file():
            lock.unlink()
            logger.warning("%s appeared under a failed `dvc repro`; removed it", DVC_LOCK)
    elif copy.is_file() and (not lock.is_file() or lock.read_bytes() != copy.read_bytes()):
        shutil.copyfile(copy, lock)
        logger.warning("%s changed under a failed `dvc repro`; put back the copy taken before the stage", DVC_LOCK)


def recover_unreadable_lock(root: Path, logger) -> None:
    """If DVC cannot read ``root``/dvc.lock (a kill while DVC rewrote it), put the flow's last copy
    back (the stages recorded since then rerun, or come back from DVC's run cache); RetrainError
    (exit 2) saying how to recover when there is none."""
    problem = lock_problem(str(root))
    if problem is None:
        return
    copy = root / DVC_LOCK_COPY
    if not copy.is_file():
        raise RetrainError(
            f"{root / DVC_LOCK} cannot be read by DVC ({problem}), and the flow holds no earlier copy of it "
            f"({copy}). Restore the last committed one with `git checkout -- {DVC_LOCK}`, then run the flow (or "
            "`dvc repro`) again: stages recorded since that commit rerun or come back from DVC's run cache.",
            ParamsError.exit_code,
        )
    shutil.copyfile(copy, root / DVC_LOCK)
    logger.warning(
        "%s could not be read by DVC (%s); restored the copy taken before the last stage, %s", DVC_LOCK, problem, copy
    )


DVC_TMP = Path(".dvc/tmp")
DVC_REPO_LOCK, DVC_RWLOCK = DVC_TMP / "lock", DVC_TMP / "rwlock"  # dvc.lock.Lock's and dvc.rwlock's files


def clear_unreadable_rwlock(root: Path, logger) -> bool:
    """Remove DVC's ``.dvc/tmp/rwlock`` when DVC could not read it and no DVC command is running.

    DVC rewrites that file (which paths running DVC processes hold) in place at every stage it
    runs: a disk that fills at that moment leaves it empty or cut, and every later ``dvc repro``
    fails with "RWLock-file ... corrupted" (exit 255) long after the space is freed. The file is
    only meaningful while DVC holds its repo lock, and DVC makes a new one when it is missing, so it
    goes only when that lock is free (zc.lockfile, DVC's own backend). True when it was removed."""
    import json

    import zc.lockfile
    from dvc.rwlock import SCHEMA
    from voluptuous import Invalid

    rwlock = root / DVC_RWLOCK
    try:
        SCHEMA(json.loads(rwlock.read_text(encoding="utf-8")))
        return False
    except FileNotFoundError:
        return False
    except (ValueError, Invalid) as error:  # json's decode error is a ValueError
        problem = f"{type(error).__name__}: {error}"
    try:
        repo_lock = zc.lockfile.LockFile(str(root / DVC_REPO_LOCK))
    except (zc.lockfile.LockError, OSError):
        return False  # a DVC command holds the repo (it will fail on the file itself), or no space yet
    try:
        rwlock.unlink()
    finally:
        repo_lock.close()
    logger.warning(
        "%s could not be read by DVC (%s: what a full disk leaves when DVC rewrites it); removed it, no DVC command "
        "was running. DVC makes a new one.",
        DVC_RWLOCK,
        problem,
    )
    return True


def stage_order(repo: str | Path) -> list[str]:
    """Pipeline stages, dependencies first (DVC's stage graph); ``dvc.yaml`` order among independent ones."""
    import networkx as nx

    with open_repo(Path(repo).resolve()) as dvc_repo:
        stages = [s for s in dvc_repo.index.stages if not s.is_data_source]
        if not stages:
            raise RetrainError(f"{Path(repo) / 'dvc.yaml'} defines no stages", ParamsError.exit_code)
        position = {stage: index for index, stage in enumerate(stages)}
        # edges point from a stage to the stages it depends on: reversed, a dependency comes first
        graph = dvc_repo.index.graph.reverse().subgraph(stages)
        return [stage_name(s) for s in nx.lexicographical_topological_sort(graph, key=lambda s: position[s])]


def stale_stages(root: Path) -> dict[str, Any]:
    """DVC's status of every stage and tracked file: ``{}`` when all are up to date."""
    with open_repo(root) as dvc_repo:
        return dvc_repo.status()


def changed_outputs(root: Path, stage: str) -> dict[str, str]:
    """``{path: state}`` of ``stage``'s outputs that the workspace or DVC's cache does not hold as
    dvc.lock records them (state: ``modified``, ``deleted``, ``not in cache``), from DVC's status."""
    with open_repo(root) as dvc_repo:
        status = dvc_repo.status(targets=[f"{Path(root) / 'dvc.yaml'}:{stage}"])  # not relative to the cwd
    return {
        path: state
        for entries in status.values()
        for entry in entries
        if isinstance(entry, dict)
        for path, state in (entry.get("changed outs") or {}).items()
    }


def unsaved_outputs(root: Path, stage: str) -> list[str]:
    """``PATH: state`` for each output of ``stage`` not held as recorded: what a `dvc repro` that hit a
    full or read-only cache leaves behind while it exits 0."""
    return [f"{path}: {state}" for path, state in changed_outputs(root, stage).items()]


INCOMPLETE_DIR = Path(".dvc/tmp/incomplete")  # DVC ignores .dvc/tmp; git does too (.dvc/.gitignore)


def put_back_recorded_outputs(root: Path, stage: str) -> list[str]:
    """After ``dvc repro`` of ``stage`` failed for storage: each output of the stage that dvc.lock
    records but the workspace no longer holds as recorded (DVC deleted part of it before it hit an
    immutable or unwritable file, or could not finish a checkout) is moved whole to
    ``.dvc/tmp/incomplete/PATH-N``, and the recorded version is checked out of DVC's cache in its place.
    Nothing partial is left where an output was: the output is as dvc.lock says, or absent when the
    cache cannot give it back. Returns one line per output it touched, for the failure message."""
    from dvc.exceptions import DvcException

    root = Path(root)
    changed = {path: state for path, state in changed_outputs(root, stage).items() if state in ("modified", "deleted")}
    if not changed:
        return []
    lines = []
    for path, state in changed.items():
        where = root / path
        if state == "modified" and where.exists():
            number = 1 + sum(1 for _ in (root / INCOMPLETE_DIR / path).parent.glob(f"{where.name}-*"))
            aside = root / INCOMPLETE_DIR / f"{path}-{number}"
            try:
                aside.parent.mkdir(parents=True, exist_ok=True)
                os.replace(where, aside)  # a rename of the whole output: works beside an immutable file inside it
            except OSError as error:  # e.g. the output on another file system than .dvc/tmp
                lines.append(f"- {path}: not as dvc.lock records it, and could not be moved aside ({error})")
                continue
            lines.append(f"- {path}: not as dvc.lock records it; moved whole to {aside.relative_to(root)}")
    try:
        with open_repo(root) as dvc_repo:
            dvc_repo.checkout(targets=[f"{root / 'dvc.yaml'}:{stage}"], force=True)
        lines.append(f"- {', '.join(changed)}: the version dvc.lock records is back in place, from DVC's cache")
    except (DvcException, OSError) as error:
        lines.append(
            f"- {', '.join(changed)}: could not be checked out of DVC's cache ({error}); absent until "
            f"`dvc checkout {stage}` succeeds"
        )
    return lines


def workspace_metrics(root: Path) -> dict[str, dict[str, Any]]:
    """``{metrics file: {dotted.metric: value}}`` of the workspace, as DVC reads them."""
    from dvc.utils.flatten import flatten

    with open_repo(root) as dvc_repo:
        shown = dvc_repo.metrics.show().get("", {}).get("data", {})
    return {path: flatten(content["data"]) for path, content in shown.items() if isinstance(content.get("data"), dict)}


def is_stage_output(root: Path, target: Path) -> bool:
    """Whether ``target`` is (inside) an output of a ``dvc.yaml`` stage, which must not be ``dvc add``-ed."""
    target = target.resolve()
    with open_repo(root) as dvc_repo:
        outs = [Path(o.fs_path) for s in dvc_repo.index.stages if not s.is_data_source for o in s.outs]
    return any(target == out or out in target.parents for out in outs)


def configured_remote(root: Path, remote: str | None) -> tuple[list[str], str] | None:
    """The ``dvc push`` arguments and a label, or None when no remote is configured."""
    if remote:
        return ["-r", remote], f"remote '{remote}'"
    with open_repo(root) as dvc_repo:
        default, names = dvc_repo.config["core"].get("remote"), set(dvc_repo.config["remote"])
    if default:
        return [], f"default remote '{default}'"
    if DEFAULT_LOCAL_REMOTE in names:
        return ["-r", DEFAULT_LOCAL_REMOTE], f"remote '{DEFAULT_LOCAL_REMOTE}'"
    return None


# --------------------------------------------------------------------------------------------
# subprocesses
# --------------------------------------------------------------------------------------------


@dataclass
class CommandResult:
    returncode: int
    output: str  # stdout+stderr interleaved (streamed commands) or stdout only (captured)
    stderr: str = ""


def command_env() -> dict[str, str]:
    """The flow's environment with its own interpreter's bin directory first on PATH, so a stage's
    ``python`` is the flow's even when no virtual environment is activated."""
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.setdefault("DVC_NO_ANALYTICS", "1")
    return env


def dvc_command(*args: str) -> list[str]:
    """DVC from the interpreter running the flow, so the flow needs no PATH set-up."""
    return [sys.executable, "-m", "dvc", *args]


def rlhf_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "rlhf_pipeline.cli", *args]


def capture(cmd: list[str], cwd: Path, timeout: float | None = 600) -> CommandResult:
    try:
        proc = subprocess.run(
            cmd,
            cwd=cwd,
            env=command_env(),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            errors="replace",
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return CommandResult(124, "", f"timed out after {timeout}s: {' '.join(cmd)}")
    except OSError as error:
        return CommandResult(127, "", f"cannot run {cmd[0]}: {error}")
    return CommandResult(proc.returncode, redact(proc.stdout), redact(proc.stderr))


def run_rlhf(repo: Path, args: list[str], doing: str, timeout: float | None = 600, unchanged: str = "") -> str:
    """``rlhf ARGS`` in ``repo``; its output, or a :class:`RetrainError` with its exit status and what it
    printed (redacted): "``doing`` failed (exit N)", then ``unchanged`` (what the failure left as it was)."""
    result = capture(rlhf_command(*args), repo, timeout=timeout)
    if result.returncode != 0:
        details = "\n".join(part.strip() for part in (result.output, result.stderr) if part.strip())
        left = f"; {unchanged}" if unchanged else ""
        raise RetrainError(f"{doing} failed (exit {result.returncode}){left}:\n{details}", result.returncode)
    return result.output


def stream(cmd: list[str], cwd: Path, logger) -> CommandResult:
    """Run ``cmd``, logging each output line as it comes (a traceback, from its first line on, and
    DVC's ``ERROR:`` lines at ERROR, the rest at INFO); keep the tail for error messages."""
    tail: deque[str] = deque(maxlen=400)
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=command_env(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        bufsize=1,
    )
    assert proc.stdout is not None
    in_traceback = False
    try:
        for line in proc.stdout:
            line = redact(line.rstrip("\n"))
            tail.append(line)
            in_traceback = in_traceback or line.startswith("Traceback (most recent call last):")
            if line.strip():
                logger.log(logging.ERROR if in_traceback or line.startswith("ERROR:") else logging.INFO, line)
    finally:
        returncode = proc.wait()
    return CommandResult(returncode, "\n".join(tail))


def stage_exit_code(result: CommandResult) -> int:
    """The stage command's exit status, from DVC's "failed to reproduce ... exited with N".

    DVC itself exits 255 whatever the stage returned; when the message is missing (DVC failed
    before or after running the command, e.g. a lock held by another process) the failure counts
    as 1, or as 5 when DVC's own writes failed for storage (a full disk or cache, a read-only or
    immutable file): freeing space, not retrying, fixes that. A stage that died of a missing
    module counts as exit 6: reinstalling, not retrying, fixes it.
    """
    if result.returncode == 0:
        return 0
    text = result.output + "\n" + result.stderr
    found = _EXITED_WITH.findall(text)
    if not found and storage_failure(RuntimeError(text)):
        return StorageError.exit_code  # DVC's own writes (cache, checkout, dvc.lock) failed for storage
    code = int(found[-1]) if found else 1
    return MissingPackageError.exit_code if code == PipelineError.exit_code and _MISSING_MODULE.search(text) else code


def stage_failure_message(stage: str, code: int, output: str, attempts: int | None = None) -> str:
    meaning = EXIT_CODE_MEANINGS.get(code, "failure")
    retry = "not retried" if code in NOT_RETRIED_EXIT_CODES else f"after {attempts or 1} attempt(s)"
    lines = [line for line in output.splitlines() if line.strip()][-OUTPUT_TAIL_LINES:]
    return f"DVC stage '{stage}' failed with exit code {code} ({meaning}; {retry}):\n" + "\n".join(lines)


def refuse_retry_on_contract_errors(task, task_run, state) -> bool:
    """retry_condition_fn: no retry for the exit codes of deterministic failures (errors.NOT_RETRIED_EXIT_CODES)."""
    error = state.data if isinstance(state.data, BaseException) else None
    if error is None:
        try:
            error = state.result(raise_on_failure=False)
        except Exception:  # noqa: BLE001 - unknown failure: retry it
            return True
    return getattr(error, "exit_code", PipelineError.exit_code) not in NOT_RETRIED_EXIT_CODES
