"""The retrain flow, its stage, commit, gate and push tasks, and its scheduled deployment (the label tasks:
:mod:`.labels`; what a run does, step by step: the package docstring)."""

from __future__ import annotations

import json
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

from flows.retrain.defaults import CRASH_RESTARTS, LOCK_TIMEOUT_SECONDS, RETRIES, RETRY_DELAY_SECONDS
from flows.retrain.dvc_project import (
    OUTPUT_TAIL_LINES,
    RetrainError,
    capture,
    clear_unreadable_rwlock,
    configured_remote,
    dvc_command,
    keep_lock_copy,
    put_back_recorded_outputs,
    recover_unreadable_lock,
    refuse_retry_on_contract_errors,
    restore_lock_copy,
    rlhf_command,
    run_rlhf,
    stage_exit_code,
    stage_failure_message,
    stage_order,
    stale_stages,
    stream,
    unsaved_outputs,
)
from flows.retrain.labels import bring_in_labels
from flows.retrain.report import publish_summary
from flows.retrain.rounds import pull_before_gate, send_after_gate
from rlhf_pipeline.errors import (
    EXIT_CODE_MEANINGS,
    BusyError,
    DamagedArtifactError,
    ParamsError,
    PipelineError,
    StorageError,
)
from rlhf_pipeline.gitrepo import commit_staged, git
from rlhf_pipeline.lineage.verify import RESTORE_ADVICE, stage_input_problems, stage_output_problems, verify_paths
from rlhf_pipeline.params import format_validation_error
from rlhf_pipeline.params.schedule import ScheduleParams
from rlhf_pipeline.params.schema import load_params
from rlhf_pipeline.paths import POLICY as POLICY_DIR
from rlhf_pipeline.paths import RUN_RECORD
from rlhf_pipeline.registry import POLICY, declared_artifacts

DEPLOYMENT_NAME = "retrain-schedule"
DEFAULT_LINEAGE_TARGET = POLICY_DIR
LOCK_RELATIVE_PATH = Path(".dvc") / "tmp" / "retrain.lock"


class StageFailed(RetrainError):
    """A ``dvc repro`` of one stage failed; ``exit_code`` is the stage command's exit status."""

    def __init__(self, message: str, exit_code: int = PipelineError.exit_code, stage: str = ""):
        super().__init__(message, exit_code)
        self.stage = stage


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


@task(
    name="dvc-repro",
    task_run_name="dvc-repro-{stage}",
    retries=RETRIES,
    retry_delay_seconds=exponential_backoff(RETRY_DELAY_SECONDS),
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


@task(name="record-run", cache_policy=NO_CACHE)
def record_run(repo: str, status: str) -> str:
    """Commit what git keeps of the run (dvc.lock, metrics/, evaluation/ and the .dvc files DVC
    staged): a registry version is a commit, so the gate registers this one."""
    root = Path(repo)
    git(root, "add", "--", *[p for p in RUN_RECORD if (root / p).exists()])
    staged = (git(root, "diff", "--cached", "--name-only") or "").split()
    # the run's own files only: whatever else a person has staged stays theirs to commit
    staged = [f for f in staged if f.split("/")[0] in RUN_RECORD or f.endswith((".dvc", ".gitignore"))]
    if not staged:
        return "nothing new to commit"
    try:
        head = commit_staged(root, sorted(set(staged)), f"retrain: {status}")
    except PipelineError as error:
        raise RetrainError(f"the commit of the run's record failed: {error}") from None
    return f"committed {len(staged)} file(s) as {head}"


@task(name="promotion-gate", cache_policy=NO_CACHE)
def promotion_gate(repo: str) -> dict[str, Any]:
    """``rlhf models gate``: register the new policy and assign it prod only if the rule in
    ``promotion.*`` holds; the decision is a markdown artifact. A rejected challenger is a
    result, not a failure."""
    decision = json.loads(run_rlhf(Path(repo), ["models", "gate", "--json"], "the promotion gate", timeout=3600))
    get_run_logger().info("promotion gate: %s\n%s", decision["outcome"], decision.get("markdown", ""))
    if decision.get("markdown"):
        create_markdown_artifact(
            markdown=decision["markdown"], key="promotion-decision", description=decision["outcome"]
        )
    return decision


@task(
    name="dvc-push",
    retries=RETRIES,
    retry_delay_seconds=exponential_backoff(RETRY_DELAY_SECONDS),
    cache_policy=NO_CACHE,
)
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


def take_retrain_lock(root: Path, lock_timeout: float) -> FileLock:
    """The retrain lock ``.dvc/tmp/retrain.lock``, held; RetrainLocked (exit 8) past ``lock_timeout``."""
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
    return lock


def reproduce_stale(root: Path, stages: list[str], retries: int, retry_delay_seconds: float) -> tuple[str, list]:
    """Each stage in DVC's order, a task each (see reproduce_stage); (status, the stages' reports)."""
    stale = dvc_status(str(root))
    if not stale:
        get_run_logger().info("all stages up to date; nothing to reproduce")
        return "all stages up to date", []
    get_run_logger().info("stale: %s", ", ".join(sorted(stale)))
    repro = reproduce_stage.with_options(retries=retries, retry_delay_seconds=exponential_backoff(retry_delay_seconds))
    reports = [repro(str(root), stage) for stage in stages]
    ran = [s["stage"] for s in reports if s["result"] == "ran"]
    return (f"reproduced {', '.join(ran)}" if ran else "all stages up to date"), reports


def push_outputs(root: Path, remote: str | None, push: bool, retries: int, retry_delay_seconds: float) -> dict:
    """The outputs re-read against dvc.lock, then ``dvc push`` (retried); what the report says of it."""
    if not push:
        return {"push": "disabled (push=False)"}
    target = configured_remote(root, remote)
    if target is None:
        return {"push": "skipped: no DVC remote configured"}
    verified = verify_outputs(str(root))
    pusher = dvc_push.with_options(retries=retries, retry_delay_seconds=exponential_backoff(retry_delay_seconds))
    return {"verified": verified, "push": f"{target[1]}: {pusher(str(root), target[0])}"}


@flow(name="retrain", description="Ingest labels, reproduce the stale DVC stages, commit, gate, push, report.")
def retrain(
    repo: str = ".",
    incoming: str | None = None,
    remote: str | None = None,
    push: bool = True,
    validate_command: list[str] | None = None,
    retries: int = RETRIES,
    retry_delay_seconds: float = RETRY_DELAY_SECONDS,
    lock_timeout: float = LOCK_TIMEOUT_SECONDS,
    lineage_target: str | None = DEFAULT_LINEAGE_TARGET,
    crash_restarts: int = CRASH_RESTARTS,
    code_commit: str | None = None,
) -> dict[str, Any]:
    """One retrain run; see the package docstring for its steps.

    Args:
        repo: the DVC project (folder holding dvc.yaml).
        incoming: a preference file, or a folder whose newest .jsonl/.parquet is taken; only where
            ``labelling.source`` is ``file`` (it replaces ``data.preferences.source``).
        remote: DVC remote to push to; default: the repo's default remote, else ``localremote``.
        push: push the DVC cache at the end.
        validate_command: validator argv, the file path is appended; exit 0 = valid. Default:
            ``python -m rlhf_pipeline.cli validate-preferences``.
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
    lock = take_retrain_lock(root, lock_timeout)
    report: dict[str, Any] = {"status": "running", "repo": str(root), "stages": [], "ingested": None}
    try:
        try:
            recover_unreadable_lock(root, logger)  # a dvc.lock truncated by a killed run: the last readable copy
            clear_unreadable_rwlock(root, logger)  # DVC's rwlock emptied by a full disk: DVC makes a new one
            stages = stage_order(root)
            report["params"] = check_params(str(root))
            report |= bring_in_labels(root, incoming, validate_command, retries, retry_delay_seconds)
            report["status"], report["stages"] = reproduce_stale(root, stages, retries, retry_delay_seconds)
            if POLICY in declared_artifacts(root):
                report["recorded"] = record_run(str(root), report["status"])
                report |= pull_before_gate(root)
                report["promotion"] = send_after_gate(root, promotion_gate(str(root)))
            report |= push_outputs(root, remote, push, retries, retry_delay_seconds)
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
