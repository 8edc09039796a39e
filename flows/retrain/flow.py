"""The retrain flow, its tasks and its scheduled deployment (what a run does: see the package docstring)."""

from __future__ import annotations

import filecmp
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout
from prefect import flow, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.logging import get_run_logger
from prefect.runtime import flow_run as flow_run_runtime
from prefect.runtime import task_run as task_run_runtime
from prefect.tasks import exponential_backoff
from pydantic import ValidationError

from flows.retrain.dvc_project import (
    OUTPUT_TAIL_LINES,
    RetrainError,
    capture,
    clear_unreadable_rwlock,
    configured_remote,
    dvc_command,
    is_stage_output,
    keep_lock_copy,
    put_back_recorded_outputs,
    recover_unreadable_lock,
    restore_lock_copy,
    rlhf_command,
    stage_exit_code,
    stage_failure_message,
    stage_order,
    stale_stages,
    stream,
    unsaved_outputs,
)
from flows.retrain.report import publish_summary
from rlhf_pipeline.errors import (
    EXIT_CODE_MEANINGS,
    NOT_RETRIED_EXIT_CODES,
    BusyError,
    DamagedArtifactError,
    DataContractError,
    ParamsError,
    PipelineError,
    StorageError,
)
from rlhf_pipeline.gitrepo import git
from rlhf_pipeline.lineage.verify import RESTORE_ADVICE, stage_input_problems, stage_output_problems, verify_paths
from rlhf_pipeline.params import format_validation_error
from rlhf_pipeline.params.labelling import FILE_LABELS, SIMULATED_LABELS
from rlhf_pipeline.params.schedule import ScheduleParams
from rlhf_pipeline.params.schema import load_params
from rlhf_pipeline.registry import declared_artifacts
from rlhf_pipeline.versions import POLICY, RUN_RECORD

DEPLOYMENT_NAME = "retrain-schedule"
DEFAULT_PREFERENCES_TARGET = "data/labels/preferences.jsonl"
DEFAULT_LINEAGE_TARGET = "models/policy"
PREFERENCE_SUFFIXES = (".jsonl", ".parquet")
LOCK_RELATIVE_PATH = Path(".dvc") / "tmp" / "retrain.lock"


class StageFailed(RetrainError):
    """A ``dvc repro`` of one stage failed; ``exit_code`` is the stage command's exit status."""

    def __init__(self, message: str, exit_code: int = PipelineError.exit_code, stage: str = ""):
        super().__init__(message, exit_code)
        self.stage = stage


class InvalidPreferences(RetrainError):
    """The incoming preference file failed validation; nothing was replaced."""


class RetrainLocked(RetrainError):
    """Another retrain run held the lock for longer than ``lock_timeout``."""


# --------------------------------------------------------------------------------------------
# Subprocess helpers
# --------------------------------------------------------------------------------------------
CODE_ROOT = Path(__file__).resolve().parents[2]  # the checkout holding flows/: what a worker loads the flow from


def resolve_schedule(repo: str | Path = ".", cron: str | None = None, timezone: str | None = None) -> ScheduleParams:
    """The retrain schedule: ``cron``/``timezone`` when given, else params.yaml's ``schedule``
    section (validated by the params schema, so a bad value stops with its key path), else the
    schema's defaults when there is no params.yaml."""
    path = Path(repo) / "params.yaml"
    schedule = load_params(path).schedule if path.is_file() else ScheduleParams()
    overrides = {key: value for key, value in (("cron", cron), ("timezone", timezone)) if value}
    try:
        return ScheduleParams.model_validate({**schedule.model_dump(), **overrides})
    except ValidationError as error:
        raise ParamsError(
            "--cron/--timezone", [f"schedule.{line}" for line in format_validation_error(error)]
        ) from None


def _newest_preference_file(incoming: Path) -> Path:
    if incoming.is_file():
        return incoming
    if incoming.is_dir():
        candidates = [p for p in incoming.iterdir() if p.is_file() and p.suffix in PREFERENCE_SUFFIXES]
        if candidates:
            return max(candidates, key=lambda p: (p.stat().st_mtime, p.name))
        raise RetrainError(f"no .jsonl or .parquet preference file in {incoming}", ParamsError.exit_code)
    raise RetrainError(f"incoming preference path {incoming} does not exist", ParamsError.exit_code)


def refuse_retry_on_contract_errors(task, task_run, state) -> bool:
    """retry_condition_fn: no retry for the exit codes of deterministic failures (errors.NOT_RETRIED_EXIT_CODES)."""
    error = state.data if isinstance(state.data, BaseException) else None
    if error is None:
        try:
            error = state.result(raise_on_failure=False)
        except Exception:  # noqa: BLE001 - unknown failure: retry it
            return True
    return getattr(error, "exit_code", PipelineError.exit_code) not in NOT_RETRIED_EXIT_CODES


@task(
    name="dvc-repro",
    task_run_name="dvc-repro-{stage}",
    retries=3,
    retry_delay_seconds=exponential_backoff(30),
    retry_condition_fn=refuse_retry_on_contract_errors,
    cache_policy=NO_CACHE,
)
def reproduce_stage(repo: str, stage: str) -> dict[str, Any]:
    """``dvc repro --single-item STAGE``: runs the stage if stale, never its upstream stages."""
    logger = get_run_logger()
    attempt = task_run_runtime.run_count or 1
    # what the stage would read, and what a checkout or a run-cache restore of its outputs would lay
    # down, re-read first: DVC trusts its cache objects' names, so a swapped object would be
    # trained on and recorded in dvc.lock under the hash of what it holds
    refuse_damage(stage, "was not run", *stage_input_problems(repo, stage))
    had_lock = keep_lock_copy(Path(repo))
    result = stream(dvc_command("repro", "--single-item", stage), Path(repo), logger)
    if result.returncode != 0:
        # DVC rewrites dvc.lock in place, after the stage succeeded: killed during that write, it
        # leaves a truncated file (unreadable, or readable with records lost)
        restore_lock_copy(Path(repo), logger, had_lock)
        code = stage_exit_code(result)
        message = stage_failure_message(stage, code, result.output, attempt)
        if code == StorageError.exit_code:
            # DVC deletes a stage's outputs before running it and stops at the first file it cannot
            # delete: put the recorded outputs back rather than leave part of one in place
            put_back = put_back_recorded_outputs(Path(repo), stage)
            if put_back:
                message += "\nThe stage's outputs after the failure:\n" + "\n".join(put_back)
        raise StageFailed(message, exit_code=code, stage=stage)
    # DVC can exit 0 after failing to save outputs to its cache ("No space left on device"):
    # dvc.lock then records outputs the cache does not hold, and a later checkout loses them
    unsaved = unsaved_outputs(Path(repo), stage)
    if unsaved:
        listed = "\n".join(f"- {item}" for item in unsaved[:OUTPUT_TAIL_LINES])
        errors = [line for line in result.output.splitlines() if line.startswith("ERROR")][-OUTPUT_TAIL_LINES:]
        raise StageFailed(
            f"DVC stage '{stage}' ran, but DVC did not save its outputs as dvc.lock records them "
            f"({StorageError.exit_code}: {EXIT_CODE_MEANINGS[StorageError.exit_code]}; not retried). Free space "
            f"in the DVC cache (or make it writable), then run the stage again.\n{listed}"
            + ("\nDVC said:\n" + "\n".join(errors) if errors else ""),
            exit_code=StorageError.exit_code,
            stage=stage,
        )
    ran = f"Running stage '{stage}" in result.output
    checked, problems = stage_output_problems(repo, stage)
    if problems:  # e.g. restored from a damaged cache object: dvc.lock goes back to before the stage
        restore_lock_copy(Path(repo), logger, had_lock)
        refuse_damage(stage, "ran, but its outputs are not what dvc.lock recorded for them", checked, problems)
    return {"stage": stage, "result": "ran" if ran else "up to date", "attempts": attempt}


def refuse_damage(stage: str, what: str, checked: int, problems: list[str]) -> None:
    """StageFailed (exit 7, not retried) listing ``problems`` of the ``checked`` files, if any."""
    if not problems:
        return
    listed = "\n".join(f"- {p}" for p in problems[:OUTPUT_TAIL_LINES])
    code = DamagedArtifactError.exit_code
    raise StageFailed(
        f"DVC stage '{stage}' {what}: {len(problems)} of {checked} file(s) re-read differ from dvc.lock or the DVC "
        f"cache ({code}: {EXIT_CODE_MEANINGS[code]}; not retried). dvc.lock holds no record of this run, and "
        f"nothing was pushed.\n{listed}\n{RESTORE_ADVICE}",
        exit_code=code,
        stage=stage,
    )


@task(name="check-params", cache_policy=NO_CACHE)
def check_params(repo: str) -> str:
    """``rlhf check-params`` on the whole params.yaml (each stage validates only the sections it
    reads, so a bad key is found here before any stage runs); skipped without a params.yaml."""
    if not (Path(repo) / "params.yaml").is_file():
        return "no params.yaml"
    result = capture(rlhf_command("check-params", "params.yaml"), Path(repo))
    if result.returncode != 0:
        details = "\n".join(part.strip() for part in (result.output, result.stderr) if part.strip())
        raise RetrainError(f"params.yaml is invalid; no stage was run.\n{details}", ParamsError.exit_code)
    return "ok"


@task(name="verify-outputs", cache_policy=NO_CACHE)
def verify_outputs(repo: str) -> str:
    """Every output's bytes, re-read, against dvc.lock and the DVC cache, before anything is pushed:
    DVC would upload a damaged cache object under its old hash."""
    checked, problems = verify_paths(repo)
    if problems:
        listed = "\n".join(f"- {p}" for p in problems[:OUTPUT_TAIL_LINES])
        raise RetrainError(
            f"{len(problems)} output file(s) differ from dvc.lock or the DVC cache; nothing was pushed. "
            f"`rlhf lineage --verify PATH` re-checks one artifact.\n{listed}",
            DamagedArtifactError.exit_code,
        )
    return f"{checked} file(s) verified"


@task(name="dvc-status", cache_policy=NO_CACHE)
def dvc_status(repo: str) -> dict[str, Any]:
    """DVC's status of the project: ``{}`` when every stage and tracked file is up to date."""
    return stale_stages(Path(repo))


@task(name="ingest-preferences", cache_policy=NO_CACHE)
def ingest_preferences(
    repo: str, incoming: str, target: str, validate_command: list[str], shown_as: str | None = None
) -> dict[str, Any]:
    """Copy the incoming file privately, validate that copy, then rename it over ``target`` and
    ``dvc add`` it: the bytes checked are the bytes ingested, even while an exporter still writes.
    ``shown_as``: what messages call the incoming file (labels pulled into a scratch file)."""
    logger = get_run_logger()
    root = Path(repo).resolve()
    source = _newest_preference_file(Path(incoming).expanduser().resolve())
    destination = (root / target).resolve()
    if root not in destination.parents:
        raise RetrainError(f"preferences_target {target} is outside the repository {root}", ParamsError.exit_code)
    if source.suffix != destination.suffix:
        raise RetrainError(
            f"incoming preference file {source} is {source.suffix} but preferences_target {target} is "
            f"{destination.suffix}: pass a preferences_target with the same extension",
            ParamsError.exit_code,
        )
    destination.parent.mkdir(parents=True, exist_ok=True)
    # the private copy keeps the suffix (the validator reads the format from it) and sits beside the
    # target, so that putting it in place is one rename on one file system
    fd, name = tempfile.mkstemp(prefix=f".{destination.name}.", suffix=destination.suffix, dir=destination.parent)
    private = Path(name)
    try:
        with os.fdopen(fd, "wb") as out, source.open("rb") as src:
            shutil.copyfileobj(src, out)
            out.flush()
            os.fsync(out.fileno())
        logger.info("validating %s (a private copy of %s)", private.name, source)
        check = capture([*validate_command, str(private)], root, timeout=3600)
        if check.returncode != 0:
            summary = "\n".join(part.strip() for part in (check.output, check.stderr) if part.strip())
            shown = shown_as or str(source)
            raise InvalidPreferences(
                f"incoming preference file {shown} failed validation (exit {check.returncode}); "
                f"nothing was replaced.\n{summary.replace(str(private), shown)}",
                exit_code=DataContractError.exit_code
                if check.returncode == DataContractError.exit_code
                else PipelineError.exit_code,
            )
        unchanged = destination.is_file() and filecmp.cmp(private, destination, shallow=False)
        if not unchanged:
            os.replace(private, destination)
            logger.info("copied %s -> %s (the validated bytes)", source, destination)
    finally:
        private.unlink(missing_ok=True)
    tracked = "stage output (not dvc-added)"
    if not is_stage_output(root, destination):
        dvc_file = destination.with_name(destination.name + ".dvc")
        if unchanged and dvc_file.is_file():
            tracked = f"unchanged ({dvc_file.name})"
        else:
            added = capture(dvc_command("add", str(destination.relative_to(root))), root)
            if added.returncode != 0:
                raise RetrainError(
                    f"dvc add {target} failed (exit {added.returncode}):\n"
                    f"{added.stderr.strip() or added.output.strip()}"
                )
            tracked = f"dvc add -> {dvc_file.name}"
    return {"source": str(source), "target": target, "changed": not unchanged, "tracked": tracked}


@task(
    name="pull-labels",
    retries=3,
    retry_delay_seconds=exponential_backoff(30),
    retry_condition_fn=refuse_retry_on_contract_errors,
    cache_policy=NO_CACHE,
)
def pull_labels(repo: str, project: int, labels_file: str, private: str) -> dict[str, Any]:
    """Label Studio ``project``'s annotations (``rlhf label import --from-server``: address and token
    from this process's environment) added to a private copy of ``labels_file``, every earlier
    round kept; the copy is then validated and ingested like any incoming file."""
    root = Path(repo)
    current = root / labels_file
    if current.is_file():
        shutil.copyfile(current, private)
    else:
        Path(private).unlink(missing_ok=True)
    result = capture(rlhf_command("label", "import", "--from-server", str(project), private, "--append"), root)
    if result.returncode != 0:
        details = "\n".join(part.strip() for part in (result.output, result.stderr) if part.strip())
        raise RetrainError(
            f"pulling labels from Label Studio project {project} failed (exit {result.returncode}); {labels_file} "
            f"is unchanged.\n{details}",
            result.returncode,
        )
    return json.loads(result.output)


def bring_in_labels(
    root: Path,
    incoming: str | None,
    preferences_target: str,
    validate_command: list[str],
    retries: int = 3,
    retry_delay_seconds: float = 30.0,
) -> dict:
    """What ``labelling.source`` in params.yaml says this run adds to the labels (see LabellingParams):
    {"ingested": ..., "pulled": ...}; nothing for the simulated labeller without ``incoming``. A pull
    that fails for a reason a retry can fix (the server restarting) is retried like a stage."""
    labelling = load_params(root / "params.yaml").labelling if (root / "params.yaml").is_file() else None
    if labelling is None or labelling.source == SIMULATED_LABELS:
        return (
            {"ingested": ingest_preferences(str(root), incoming, preferences_target, validate_command)}
            if incoming
            else {}
        )
    if labelling.source == FILE_LABELS:
        if not incoming:
            return {"ingested": None, "note": "labelling.source is file and no --incoming file was given"}
        return {"ingested": ingest_preferences(str(root), incoming, labelling.labels_file, validate_command)}
    if incoming:
        raise RetrainError(
            f"labelling.source is label_studio in params.yaml: the run pulls its labels from Label Studio project "
            f"{labelling.label_studio_project}, so the incoming file {incoming} would be left out; pass no incoming "
            "file, or set labelling.source: file. Nothing was changed.",
            ParamsError.exit_code,
        )
    target = root / labelling.labels_file
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, private = tempfile.mkstemp(prefix=f".{target.name}.pull-", suffix=target.suffix, dir=target.parent)
    os.close(fd)
    try:
        project = labelling.label_studio_project
        pull = pull_labels.with_options(retries=retries, retry_delay_seconds=exponential_backoff(retry_delay_seconds))
        pulled = pull(str(root), project, labelling.labels_file, private)
        shown = f"{labelling.labels_file} with Label Studio project {project}'s new labels"
        return {
            "pulled": pulled,
            "ingested": ingest_preferences(str(root), private, labelling.labels_file, validate_command, shown),
        }
    finally:
        Path(private).unlink(missing_ok=True)


@task(name="record-run", cache_policy=NO_CACHE)
def record_run(repo: str, status: str) -> str:
    """Commit what git keeps of the run (dvc.lock, metrics/, evaluation/ and the .dvc files DVC
    staged): a registry version is a commit, so the gate registers this one."""
    root = Path(repo)
    paths = [p for p in RUN_RECORD if (root / p).exists()]
    capture(["git", "add", "--", *paths], root)
    staged = capture(["git", "diff", "--cached", "--name-only"], root).output.split()
    # the run's own files only: whatever else a person has staged stays theirs to commit
    staged = [f for f in staged if f.split("/")[0] in RUN_RECORD or f.endswith((".dvc", ".gitignore"))]
    if not staged:
        return "nothing new to commit"
    result = capture(["git", "commit", "-q", "-m", f"retrain: {status}", "--", *sorted(set(staged))], root)
    if result.returncode != 0:
        raise RetrainError(f"git commit of the run's record failed:\n{result.stderr.strip() or result.output.strip()}")
    head = capture(["git", "rev-parse", "--short", "HEAD"], root).output.strip()
    return f"committed {len(staged)} file(s) as {head}"


@task(name="promotion-gate", cache_policy=NO_CACHE)
def promotion_gate(repo: str) -> dict[str, Any]:
    """``rlhf models gate``: register the new policy and assign it prod only if the rule in
    ``promotion.*`` holds; the decision is a markdown artifact. A rejected challenger is a
    result, not a failure."""
    result = capture(rlhf_command("models", "gate", "--json"), Path(repo), timeout=3600)
    if result.returncode != 0:
        details = "\n".join(part.strip() for part in (result.output, result.stderr) if part.strip())
        raise RetrainError(f"the promotion gate failed (exit {result.returncode}):\n{details}", result.returncode)
    decision = json.loads(result.output)
    get_run_logger().info("promotion gate: %s\n%s", decision["outcome"], decision.get("markdown", ""))
    if decision.get("markdown"):
        create_markdown_artifact(
            markdown=decision["markdown"], key="promotion-decision", description=decision["outcome"]
        )
    return decision


@task(name="dvc-push", retries=3, retry_delay_seconds=exponential_backoff(30), cache_policy=NO_CACHE)
def dvc_push(repo: str, remote_args: list[str]) -> str:
    logger = get_run_logger()
    result = stream(dvc_command("push", *remote_args), Path(repo), logger)
    if result.returncode != 0:
        # exit 5: the remote storage could not be written (unreachable, full, refused). The task's retries
        # cover a remote that comes back; a push is safe to repeat, since DVC uploads only what the
        # remote lacks and each object lands whole under its hash or not at all
        lines = "\n".join(result.output.splitlines()[-OUTPUT_TAIL_LINES:])
        raise RetrainError(
            f"dvc push {' '.join(remote_args)} failed (exit {result.returncode}); the remote holds what was uploaded "
            f"before the failure, and the next push sends the rest:\n{lines}",
            exit_code=StorageError.exit_code,
        )
    return result.output.splitlines()[-1] if result.output.strip() else "pushed"


@flow(name="retrain", description="Ingest preferences, reproduce the stale DVC stages, push, report.")
def retrain(
    repo: str = ".",
    incoming: str | None = None,
    remote: str | None = None,
    push: bool = True,
    validate_command: list[str] | None = None,
    preferences_target: str = DEFAULT_PREFERENCES_TARGET,
    retries: int = 3,
    retry_delay_seconds: float = 30.0,
    lock_timeout: float = 3600.0,
    lineage_target: str | None = DEFAULT_LINEAGE_TARGET,
    crash_restarts: int = 2,
    code_commit: str | None = None,
) -> dict[str, Any]:
    """One retrain run; see the module docstring.

    Args:
        repo: the DVC project (folder holding dvc.yaml).
        incoming: a preference file, or a folder whose newest .jsonl/.parquet is taken.
        remote: DVC remote to push to; default: the repo's default remote, else ``localremote``.
        push: push the DVC cache at the end.
        validate_command: validator argv, the file path is appended; exit 0 = valid. Default:
            ``python -m rlhf_pipeline.cli validate-preferences``.
        preferences_target: where valid incoming data is copied (relative to ``repo``).
        retries: retries of a stage failing with an exit code not in errors.NOT_RETRIED_EXIT_CODES.
        retry_delay_seconds: first retry delay; doubles each retry (exponential backoff).
        lock_timeout: seconds to wait for an overlapping run to finish before failing.
        lineage_target: artifact whose ``rlhf lineage`` goes into the summary (None: skip).
        crash_restarts: a run that crashed (its process or machine died) and was scheduled again
            by the work pool's automation (flows/retrain/pool.py) runs at most this many more times.
        code_commit: the commit of the code the deployment was made from (flows/retrain/pool.py
            records it): a run whose code is at another commit refuses to start.
    """
    logger = get_run_logger()
    refuse_endless_restarts(crash_restarts)
    refuse_other_code(code_commit)
    root = Path(repo).expanduser().resolve()
    validate_command = list(validate_command or rlhf_command("validate-preferences"))
    lock_path = root / LOCK_RELATIVE_PATH
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(lock_path), timeout=lock_timeout)
    try:
        lock.acquire()
    except Timeout:
        raise RetrainLocked(
            f"another retrain run holds {lock_path} (waited {lock_timeout:g}s); nothing was changed. "
            "If no run is active the lock is stale only if its process died: the OS releases it then.",
            exit_code=BusyError.exit_code,
        ) from None
    report: dict[str, Any] = {"status": "running", "repo": str(root), "stages": [], "ingested": None}
    try:
        try:
            recover_unreadable_lock(root, logger)  # a dvc.lock truncated by a killed run: the last readable copy
            clear_unreadable_rwlock(root, logger)  # DVC's rwlock emptied by a full disk: DVC makes a new one
            stages = stage_order(root)
            report["params"] = check_params(str(root))
            report |= bring_in_labels(
                root, incoming, preferences_target, validate_command, retries, retry_delay_seconds
            )
            stale = dvc_status(str(root))
            if not stale:
                report["status"] = "all stages up to date"
                logger.info("all stages up to date; nothing to reproduce")
            else:
                logger.info("stale: %s", ", ".join(sorted(stale)))
                repro = reproduce_stage.with_options(
                    retries=retries, retry_delay_seconds=exponential_backoff(retry_delay_seconds)
                )
                for stage in stages:
                    report["stages"].append(repro(str(root), stage))
                ran = [s["stage"] for s in report["stages"] if s["result"] == "ran"]
                report["status"] = f"reproduced {', '.join(ran)}" if ran else "all stages up to date"
            if POLICY in declared_artifacts(root):
                report["recorded"] = record_run(str(root), report["status"])
                gate = promotion_gate(str(root))
                report["promotion"] = gate["outcome"]
            if push:
                target = configured_remote(root, remote)
                if target is None:
                    report["push"] = "skipped: no DVC remote configured"
                else:
                    report["verified"] = verify_outputs(str(root))
                    pusher = dvc_push.with_options(
                        retries=retries, retry_delay_seconds=exponential_backoff(retry_delay_seconds)
                    )
                    report["push"] = f"{target[1]}: {pusher(str(root), target[0])}"
            else:
                report["push"] = "disabled (push=False)"
        except BaseException as error:
            report["status"] = "failed"
            try:
                publish_summary(root, report, lineage_target, error=error)
            except Exception as summary_error:  # noqa: BLE001 - never hide the real failure
                logger.warning("could not publish the failure summary: %s", summary_error)
            raise
        report["summary"] = publish_summary(root, report, lineage_target)
        return report
    finally:
        lock.release()


def deployment_parameters(root: Path, incoming: str | None, remote: str | None, push: bool) -> dict[str, Any]:
    """The flow's parameters for a deployment of the project at ``root`` (paths made absolute)."""
    parameters: dict[str, Any] = {"repo": str(root), "push": push}
    if incoming:
        parameters["incoming"] = str(Path(incoming).expanduser().resolve())
    if remote:
        parameters["remote"] = remote
    return parameters


def running_code_commit() -> str | None:
    """The commit of the checkout this flow's code was loaded from (None outside git); ``+dirty`` when
    a tracked file of it differs from that commit."""
    commit = git(CODE_ROOT, "rev-parse", "HEAD")
    if commit and git(CODE_ROOT, "status", "--porcelain", "--untracked-files=no"):
        commit += "+dirty"
    return commit


def refuse_other_code(code_commit: str | None) -> None:
    """Fail (final: no automation retries it) a run whose code is not the deployment's: a worker that
    loaded this flow from a checkout at another commit would run other stages' code than was deployed."""
    running = running_code_commit()
    if code_commit and running != code_commit:
        raise RetrainError(
            f"this run's code is at commit {running or '(not a git checkout)'} ({CODE_ROOT}), but the deployment "
            f"was made from commit {code_commit}. Check out {code_commit} there, or deploy again from the code "
            "the workers run (`python -m flows.retrain deploy`); nothing was changed."
        )


def refuse_endless_restarts(crash_restarts: int) -> None:
    """Fail (a final state no automation retries) a run that has crashed more than ``crash_restarts``
    times: Prefect counts every start of a flow run in its ``run_count``."""
    starts = flow_run_runtime.run_count or 1
    if starts > 1 + crash_restarts:
        raise RetrainError(
            f"this flow run has started {starts} times: it crashed {starts - 1} times (its process or machine "
            f"died mid-run) and crash_restarts is {crash_restarts}. Nothing was changed by this start; look at "
            "the earlier attempts' logs for what killed them, then start a new run."
        )
    if starts > 1:
        get_run_logger().warning("start %d of this flow run: the previous one crashed; resuming the pipeline", starts)


def build_deployment(
    repo: str = ".",
    cron: str | None = None,
    timezone: str | None = None,
    incoming: str | None = None,
    remote: str | None = None,
    push: bool = True,
):
    """The ``retrain-schedule`` deployment (used by ``serve`` and by the tests)."""
    from prefect.schedules import Cron

    root = Path(repo).expanduser().resolve()
    schedule = resolve_schedule(root, cron, timezone)
    return retrain.to_deployment(
        name=DEPLOYMENT_NAME,
        schedules=[Cron(schedule.cron, timezone=schedule.timezone)],
        parameters=deployment_parameters(root, incoming, remote, push),
        concurrency_limit=1,  # collision strategy ENQUEUE: an overlapping scheduled run waits
        tags=["rlhf", "retrain"],
        description="Weekly RLHF retrain: ingest, dvc repro (stale stages only), push, report.",
    )
