"""Prefect flow that retrains the RLHF pipeline: ingest preferences, `dvc repro` stage by stage, push.

Run once (against ``PREFECT_API_URL`` if set, else a temporary local server)::

    python -m flows.retrain [--repo .] [--incoming PATH] [--remote NAME] [--no-push]

Serve the weekly schedule (needs a running server, see ``server`` below)::

    python -m flows.retrain server                       # = prefect server start --host 127.0.0.1
    PREFECT_API_URL=http://127.0.0.1:4200/api python -m flows.retrain serve [--cron "0 3 * * 1"]

What a run does, in order:

1. Takes the retrain lock ``.dvc/tmp/retrain.lock`` (a file lock, so it needs no server and also
   guards runs started from the command line). An overlapping run waits up to ``lock_timeout``
   seconds, then fails with a clear message; it never touches the workspace while another run
   holds the lock. The served deployment additionally has a Prefect deployment concurrency limit
   of 1 (collision strategy ENQUEUE), so scheduled runs queue on the server instead of piling up
   on the lock. DVC's own repo lock stays the last line of defence against a manual ``dvc repro``:
   a stage that hits it fails with exit 1 and is retried with backoff.
2. Ingests ``incoming`` if given (a file, or a folder whose newest ``.jsonl``/``.parquet`` is
   taken): runs the preference validator on it; on failure the flow fails with the validator's
   summary and nothing is replaced. On success the file is copied atomically to
   ``preferences_target`` and ``dvc add``-ed (unless that path is a stage output).
3. ``dvc status --json``: when nothing is stale the run ends here ("all stages up to date").
4. Each stage of ``dvc.yaml``, in file order, is one task running ``dvc repro --single-item
   STAGE``: DVC re-runs the stage only if it is stale, and never recurses into upstream stages
   (they ran, or were checked, just before). Exit codes of the stage command (DVC reports
   "exited with N"): the codes of ``rlhf_pipeline.errors.NOT_RETRIED_EXIT_CODES`` (2 params, 3 data
   contract, 4 non-finite training, 5 an output not writable) are not retried, the flow fails at
   once with the stage's message; anything else is retried with exponential backoff.
5. ``dvc push`` (to ``remote`` if given, else the default remote, else ``localremote``), then a
   markdown summary artifact (stages, metrics against HEAD and against the previous run, lineage
   of the policy) and a table artifact of the metrics.
"""

from __future__ import annotations

import rlhf_pipeline  # noqa: F401  (first: offline env vars and PREFECT_HOME before Prefect loads)

import argparse
import filecmp
import json
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

import yaml
from filelock import FileLock, Timeout
from prefect import flow, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.logging import get_run_logger
from prefect.runtime import task_run as task_run_runtime
from prefect.tasks import exponential_backoff
from pydantic import ValidationError

from rlhf_pipeline.errors import EXIT_CODE_MEANINGS, NOT_RETRIED_EXIT_CODES, ParamsError, PipelineError
from rlhf_pipeline.params import ScheduleParams, format_validation_error, load_params
from rlhf_pipeline.runner import report_error

DEPLOYMENT_NAME = "retrain-schedule"
DEFAULT_PREFERENCES_TARGET = "data/labels/preferences.jsonl"
DEFAULT_LINEAGE_TARGET = "models/policy"
DEFAULT_LOCAL_REMOTE = "localremote"
PREFERENCE_SUFFIXES = (".jsonl", ".parquet")
LOCK_RELATIVE_PATH = Path(".dvc") / "tmp" / "retrain.lock"
LAST_METRICS_RELATIVE_PATH = Path(".dvc") / "tmp" / "retrain" / "last_metrics.json"
OUTPUT_TAIL_LINES = 40


# --------------------------------------------------------------------------------------------
# Errors: the message is what the flow run shows as its failure, so it carries the stage output.
# Extra attributes live in __dict__ so the exceptions pickle with only the message in args.
# --------------------------------------------------------------------------------------------


class RetrainError(Exception):
    """A retrain run failed for a reason the user can act on; ``exit_code`` is the CLI's."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code


class StageFailed(RetrainError):
    """A ``dvc repro`` of one stage failed; ``exit_code`` is the stage command's exit status."""

    def __init__(self, message: str, exit_code: int = 1, stage: str = ""):
        super().__init__(message, exit_code)
        self.stage = stage


class InvalidPreferences(RetrainError):
    """The incoming preference file failed validation; nothing was replaced."""


class RetrainLocked(RetrainError):
    """Another retrain run held the lock for longer than ``lock_timeout``."""


# --------------------------------------------------------------------------------------------
# Subprocess helpers
# --------------------------------------------------------------------------------------------


@dataclass
class CommandResult:
    returncode: int
    output: str  # stdout+stderr interleaved (streamed commands) or stdout only (captured)
    stderr: str = ""


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("DVC_NO_ANALYTICS", "1")
    return env


def dvc_command(*args: str) -> list[str]:
    """DVC from the interpreter running the flow, so the flow needs no PATH set-up."""
    return [sys.executable, "-m", "dvc", *args]


def rlhf_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "rlhf_pipeline.cli", *args]


def _capture(cmd: list[str], cwd: Path, timeout: float | None = 600) -> CommandResult:
    try:
        proc = subprocess.run(
            cmd, cwd=cwd, env=_env(), stdin=subprocess.DEVNULL, capture_output=True, text=True, errors="replace", timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return CommandResult(124, "", f"timed out after {timeout}s: {' '.join(cmd)}")
    except OSError as error:
        return CommandResult(127, "", f"cannot run {cmd[0]}: {error}")
    return CommandResult(proc.returncode, proc.stdout, proc.stderr)


def _stream(cmd: list[str], cwd: Path, logger) -> CommandResult:
    """Run ``cmd``, logging each output line as it comes; keep the tail for error messages."""
    tail: deque[str] = deque(maxlen=400)
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=_env(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        bufsize=1,
    )
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            line = line.rstrip("\n")
            tail.append(line)
            if line.strip():
                logger.info(line)
    finally:
        returncode = proc.wait()
    return CommandResult(returncode, "\n".join(tail))


_EXITED_WITH = re.compile(r"exited with (-?\d+)")


def stage_exit_code(result: CommandResult) -> int:
    """The stage command's exit status, parsed from DVC's "failed to reproduce ... exited with N".

    DVC itself exits 255 whatever the stage returned; when the message is missing (DVC failed
    before running the command, e.g. a lock held by another process) the failure counts as 1.
    """
    if result.returncode == 0:
        return 0
    found = _EXITED_WITH.findall(result.output + "\n" + result.stderr)
    return int(found[-1]) if found else 1


def _stage_message(stage: str, code: int, output: str, attempts: int | None = None) -> str:
    meaning = EXIT_CODE_MEANINGS.get(code, "failure")
    retry = "not retried" if code in NOT_RETRIED_EXIT_CODES else f"after {attempts or 1} attempt(s)"
    lines = [line for line in output.splitlines() if line.strip()][-OUTPUT_TAIL_LINES:]
    return f"DVC stage '{stage}' failed with exit code {code} ({meaning}; {retry}):\n" + "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Reading the DVC project
# --------------------------------------------------------------------------------------------


def _load_dvc_yaml(root: Path) -> dict[str, Any]:
    path = root / "dvc.yaml"
    if not path.is_file():
        raise RetrainError(f"{path} not found: --repo must point at a DVC project (the folder holding dvc.yaml)", 2)
    with path.open() as handle:
        data = yaml.safe_load(handle) or {}
    stages = data.get("stages") or {}
    if not isinstance(stages, dict) or not stages:
        raise RetrainError(f"{path} defines no stages", 2)
    return stages


def stage_order(repo: str | Path) -> list[str]:
    """Stage names in dvc.yaml order (foreach/matrix groups by their group name, which
    ``dvc repro -s`` expands to every generated stage)."""
    return list(_load_dvc_yaml(Path(repo)).keys())


def _declared_outputs(root: Path) -> list[Path]:
    """outs, metrics and plots of every dvc.yaml stage (templated paths are skipped)."""
    paths: list[Path] = []
    for spec in _load_dvc_yaml(root).values():
        if not isinstance(spec, dict):
            continue
        body = spec.get("do", spec)  # foreach: the template body
        wdir = root / str(body.get("wdir", "."))
        for key in ("outs", "metrics", "plots"):
            for entry in body.get(key) or []:
                name = next(iter(entry)) if isinstance(entry, dict) else entry
                if isinstance(name, str) and "${" not in name:
                    paths.append((wdir / name).resolve())
    return paths


def is_stage_output(root: Path, target: Path) -> bool:
    target = target.resolve()
    return any(target == out or out in target.parents for out in _declared_outputs(root))


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
        raise ParamsError("--cron/--timezone", [f"schedule.{line}" for line in format_validation_error(error)]) from None


def _newest_preference_file(incoming: Path) -> Path:
    if incoming.is_file():
        return incoming
    if incoming.is_dir():
        candidates = [p for p in incoming.iterdir() if p.is_file() and p.suffix in PREFERENCE_SUFFIXES]
        if candidates:
            return max(candidates, key=lambda p: (p.stat().st_mtime, p.name))
        raise RetrainError(f"no .jsonl or .parquet preference file in {incoming}", 2)
    raise RetrainError(f"incoming preference path {incoming} does not exist", 2)


def _flatten(prefix: str, value: Any, out: dict[str, Any]) -> None:
    if isinstance(value, dict):
        for key, sub in value.items():
            _flatten(f"{prefix}.{key}" if prefix else str(key), sub, out)
    else:
        out[prefix] = value


def workspace_metrics(root: Path) -> dict[str, dict[str, Any]]:
    """``{metrics file: {dotted.metric: value}}`` of the workspace, from ``dvc metrics show --json``."""
    result = _capture(dvc_command("metrics", "show", "--json"), root)
    if result.returncode != 0:
        return {}
    try:
        data = json.loads(result.output[result.output.index("{") :])
    except ValueError:
        return {}
    revision = data.get("") or data.get("workspace") or next(iter(data.values()), {})
    metrics: dict[str, dict[str, Any]] = {}
    for path, content in (revision.get("data") or {}).items():
        if isinstance(content, dict) and isinstance(content.get("data"), dict):
            flat: dict[str, Any] = {}
            _flatten("", content["data"], flat)
            metrics[path] = flat
    return metrics


def _configured_remote(root: Path, remote: str | None) -> tuple[list[str], str] | None:
    """The ``dvc push`` arguments and a label, or None when no remote is configured."""
    if remote:
        return ["-r", remote], f"remote '{remote}'"
    default = _capture(dvc_command("remote", "default"), root)
    if default.returncode == 0 and default.output.strip():
        return [], f"default remote '{default.output.strip()}'"
    listed = _capture(dvc_command("remote", "list"), root)
    names = [line.split()[0] for line in listed.output.splitlines() if line.strip()]
    if DEFAULT_LOCAL_REMOTE in names:
        return ["-r", DEFAULT_LOCAL_REMOTE], f"remote '{DEFAULT_LOCAL_REMOTE}'"
    return None


# --------------------------------------------------------------------------------------------
# Tasks
# --------------------------------------------------------------------------------------------


def refuse_retry_on_contract_errors(task, task_run, state) -> bool:
    """retry_condition_fn: no retry for the exit codes of deterministic failures (errors.NOT_RETRIED_EXIT_CODES)."""
    error = state.data if isinstance(state.data, BaseException) else None
    if error is None:
        try:
            error = state.result(raise_on_failure=False)
        except Exception:  # noqa: BLE001 - unknown failure: retry it
            return True
    return getattr(error, "exit_code", 1) not in NOT_RETRIED_EXIT_CODES


@task(name="dvc-repro", task_run_name="dvc-repro-{stage}", retries=3, retry_delay_seconds=exponential_backoff(30),
      retry_condition_fn=refuse_retry_on_contract_errors, cache_policy=NO_CACHE)
def reproduce_stage(repo: str, stage: str) -> dict[str, Any]:
    """``dvc repro --single-item STAGE``: runs the stage if stale, never its upstream stages."""
    logger = get_run_logger()
    attempt = task_run_runtime.run_count or 1
    result = _stream(dvc_command("repro", "--single-item", stage), Path(repo), logger)
    if result.returncode != 0:
        code = stage_exit_code(result)
        raise StageFailed(_stage_message(stage, code, result.output, attempt), exit_code=code, stage=stage)
    ran = f"Running stage '{stage}" in result.output
    return {"stage": stage, "result": "ran" if ran else "up to date", "attempts": attempt}


@task(name="dvc-status", cache_policy=NO_CACHE)
def dvc_status(repo: str) -> dict[str, Any]:
    """``dvc status --json``: ``{}`` when every stage and tracked file is up to date."""
    result = _capture(dvc_command("status", "--json"), Path(repo))
    if result.returncode != 0:
        raise RetrainError(f"dvc status failed (exit {result.returncode}):\n{result.stderr.strip() or result.output.strip()}")
    text = result.output.strip()
    if not text:
        return {}
    try:
        return json.loads(text[text.index("{") :])
    except ValueError as error:
        raise RetrainError(f"cannot parse `dvc status --json` output ({error}):\n{text}") from error


@task(name="ingest-preferences", cache_policy=NO_CACHE)
def ingest_preferences(repo: str, incoming: str, target: str, validate_command: list[str]) -> dict[str, Any]:
    """Validate the incoming file, then copy it atomically over ``target`` and ``dvc add`` it."""
    logger = get_run_logger()
    root = Path(repo).resolve()
    source = _newest_preference_file(Path(incoming).expanduser().resolve())
    destination = (root / target).resolve()
    if root not in destination.parents:
        raise RetrainError(f"preferences_target {target} is outside the repository {root}", 2)
    if source.suffix != destination.suffix:
        raise RetrainError(
            f"incoming preference file {source} is {source.suffix} but preferences_target {target} is "
            f"{destination.suffix}: pass a preferences_target with the same extension", 2
        )
    logger.info("validating %s", source)
    check = _capture([*validate_command, str(source)], root, timeout=3600)
    if check.returncode != 0:
        summary = "\n".join(part.strip() for part in (check.output, check.stderr) if part.strip())
        raise InvalidPreferences(
            f"incoming preference file {source} failed validation (exit {check.returncode}); "
            f"nothing was replaced.\n{summary}",
            exit_code=3 if check.returncode == 3 else 1,
        )
    unchanged = destination.is_file() and filecmp.cmp(source, destination, shallow=False)
    if not unchanged:
        destination.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{destination.name}.", suffix=".tmp", dir=destination.parent)
        try:
            with os.fdopen(fd, "wb") as out, source.open("rb") as src:
                shutil.copyfileobj(src, out)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, destination)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        logger.info("copied %s -> %s", source, destination)
    tracked = "stage output (not dvc-added)"
    if not is_stage_output(root, destination):
        dvc_file = destination.with_name(destination.name + ".dvc")
        if unchanged and dvc_file.is_file():
            tracked = f"unchanged ({dvc_file.name})"
        else:
            added = _capture(dvc_command("add", str(destination.relative_to(root))), root)
            if added.returncode != 0:
                raise RetrainError(f"dvc add {target} failed (exit {added.returncode}):\n{added.stderr.strip() or added.output.strip()}")
            tracked = f"dvc add -> {dvc_file.name}"
    return {"source": str(source), "target": target, "changed": not unchanged, "tracked": tracked}


@task(name="dvc-push", retries=3, retry_delay_seconds=exponential_backoff(30), cache_policy=NO_CACHE)
def dvc_push(repo: str, remote_args: list[str]) -> str:
    logger = get_run_logger()
    result = _stream(dvc_command("push", *remote_args), Path(repo), logger)
    if result.returncode != 0:
        lines = "\n".join(result.output.splitlines()[-OUTPUT_TAIL_LINES:])
        raise RetrainError(f"dvc push {' '.join(remote_args)} failed (exit {result.returncode}):\n{lines}")
    return result.output.splitlines()[-1] if result.output.strip() else "pushed"


# --------------------------------------------------------------------------------------------
# Summary artifacts
# --------------------------------------------------------------------------------------------


def _metrics_table(metrics: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"file": path, "metric": name, "value": value} for path, values in metrics.items() for name, value in values.items()]


def _previous_run_diff(root: Path, metrics: dict[str, dict[str, Any]]) -> str:
    path = root / LAST_METRICS_RELATIVE_PATH
    try:
        previous = json.loads(path.read_text())
    except (OSError, ValueError):
        return "_No previous run recorded._"
    rows = ["| File | Metric | Previous run | This run | Change |", "|---|---|---|---|---|"]
    for file in sorted(set(previous) | set(metrics)):
        old, new = previous.get(file, {}), metrics.get(file, {})
        for name in sorted(set(old) | set(new)):
            a, b = old.get(name, "-"), new.get(name, "-")
            change = f"{b - a:+.6g}" if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (a, b)) else ""
            rows.append(f"| {file} | {name} | {a} | {b} | {change} |")
    return "\n".join(rows)


def _save_metrics(root: Path, metrics: dict[str, dict[str, Any]]) -> None:
    path = root / LAST_METRICS_RELATIVE_PATH
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(metrics, indent=2, sort_keys=True, default=str))


def publish_summary(root: Path, report: dict[str, Any], lineage_target: str | None, error: BaseException | None = None) -> str:
    """Create the ``retrain-summary`` markdown and ``retrain-metrics`` table artifacts."""
    metrics = workspace_metrics(root)
    lines = [f"# Retrain: {report['status']}", "", f"- Repository: `{root}`"]
    ingested = report.get("ingested")
    if ingested:
        lines.append(f"- Ingested `{ingested['source']}` -> `{ingested['target']}` ({'new data' if ingested['changed'] else 'same as before'}; {ingested['tracked']})")
    lines.append(f"- Push: {report.get('push', 'not attempted')}")
    if report["stages"]:
        lines += ["", "## Stages", "", "| Stage | Result | Attempts |", "|---|---|---|"]
        lines += [f"| {s['stage']} | {s['result']} | {s['attempts']} |" for s in report["stages"]]
    if error is not None:
        lines += ["", "## Failure", "", "```text", str(error), "```"]
    diff = _capture(dvc_command("metrics", "diff", "HEAD", "--md"), root)
    lines += ["", "## Metrics against HEAD", ""]
    lines.append(diff.output.strip() if diff.returncode == 0 and diff.output.strip() else f"_Not available: {(diff.stderr.strip() or 'no output').splitlines()[-1]}_")
    lines += ["", "## Metrics against the previous run", "", _previous_run_diff(root, metrics)]
    if lineage_target:
        lineage = _capture(rlhf_command("lineage", lineage_target), root, timeout=300)
        lines += ["", f"## Lineage of `{lineage_target}`", ""]
        if lineage.returncode == 0 and lineage.output.strip():
            lines += ["```text", lineage.output.strip(), "```"]
        else:
            reason = (lineage.stderr.strip() or lineage.output.strip() or f"exit {lineage.returncode}").splitlines()[-1]
            lines.append(f"_Not available: {reason}_")
    markdown = "\n".join(lines) + "\n"
    create_markdown_artifact(markdown=markdown, key="retrain-summary", description=f"Retrain run: {report['status']}")
    table = _metrics_table(metrics)
    if table:
        create_table_artifact(table=table, key="retrain-metrics", description="Workspace metrics (dvc metrics show)")
    if error is None:
        _save_metrics(root, metrics)
    return markdown


# --------------------------------------------------------------------------------------------
# The flow
# --------------------------------------------------------------------------------------------


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
    """
    logger = get_run_logger()
    root = Path(repo).expanduser().resolve()
    stages = stage_order(root)
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
            exit_code=75,
        ) from None
    report: dict[str, Any] = {"status": "running", "repo": str(root), "stages": [], "ingested": None}
    try:
        try:
            if incoming:
                report["ingested"] = ingest_preferences(str(root), incoming, preferences_target, validate_command)
            stale = dvc_status(str(root))
            if not stale:
                report["status"] = "all stages up to date"
                logger.info("all stages up to date; nothing to reproduce")
            else:
                logger.info("stale: %s", ", ".join(sorted(stale)))
                repro = reproduce_stage.with_options(retries=retries, retry_delay_seconds=exponential_backoff(retry_delay_seconds))
                for stage in stages:
                    report["stages"].append(repro(str(root), stage))
                ran = [s["stage"] for s in report["stages"] if s["result"] == "ran"]
                report["status"] = f"reproduced {', '.join(ran)}" if ran else "all stages up to date"
            if push:
                target = _configured_remote(root, remote)
                if target is None:
                    report["push"] = "skipped: no DVC remote configured"
                else:
                    pusher = dvc_push.with_options(retries=retries, retry_delay_seconds=exponential_backoff(retry_delay_seconds))
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
    parameters: dict[str, Any] = {"repo": str(root), "push": push}
    if incoming:
        parameters["incoming"] = str(Path(incoming).expanduser().resolve())
    if remote:
        parameters["remote"] = remote
    return retrain.to_deployment(
        name=DEPLOYMENT_NAME,
        schedules=[Cron(schedule.cron, timezone=schedule.timezone)],
        parameters=parameters,
        concurrency_limit=1,  # collision strategy ENQUEUE: an overlapping scheduled run waits
        tags=["rlhf", "retrain"],
        description="Weekly RLHF retrain: ingest, dvc repro (stale stages only), push, report.",
    )


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def _api_url() -> str | None:
    from prefect.settings import get_current_settings

    return get_current_settings().api.url


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv.pop(0) if argv and argv[0] in {"run", "serve", "server"} else "run"
    parser = argparse.ArgumentParser(prog=f"python -m flows.retrain {command}")
    if command == "server":
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", default="4200")
        args = parser.parse_args(argv)
        cmd = [sys.executable, "-m", "prefect", "server", "start", "--host", args.host, "--port", str(args.port)]
        print(f"PREFECT_HOME={os.environ['PREFECT_HOME']}; then export PREFECT_API_URL=http://{args.host}:{args.port}/api", flush=True)
        os.execv(sys.executable, cmd)
    parser.add_argument("--repo", default=".")
    parser.add_argument("--incoming", default=None, help="preference file, or folder (newest .jsonl/.parquet)")
    parser.add_argument("--remote", default=None, help="DVC remote to push to (default: default remote, else localremote)")
    parser.add_argument("--no-push", dest="push", action="store_false")
    if command == "serve":
        parser.add_argument("--cron", default=None, help="default: params.yaml schedule.cron")
        parser.add_argument("--timezone", default=None, help="IANA time zone of the cron (default: params.yaml schedule.timezone)")
        args = parser.parse_args(argv)
        if not _api_url():
            print("serve needs a Prefect server: start one with `python -m flows.retrain server` and "
                  "export PREFECT_API_URL=http://127.0.0.1:4200/api", file=sys.stderr)
            return 2
        from prefect import serve

        try:
            deployment = build_deployment(args.repo, args.cron, args.timezone, args.incoming, args.remote, args.push)
        except PipelineError as error:
            return report_error(error, "python -m flows.retrain serve")
        serve(deployment)
        return 0
    parser.add_argument("--preferences-target", default=DEFAULT_PREFERENCES_TARGET)
    parser.add_argument("--retries", type=int, default=3)
    parser.add_argument("--retry-delay", type=float, default=30.0, help="first retry delay in seconds, doubling")
    parser.add_argument("--lock-timeout", type=float, default=3600.0)
    args = parser.parse_args(argv)
    state = retrain(
        repo=args.repo,
        incoming=args.incoming,
        remote=args.remote,
        push=args.push,
        preferences_target=args.preferences_target,
        retries=args.retries,
        retry_delay_seconds=args.retry_delay,
        lock_timeout=args.lock_timeout,
        return_state=True,
    )
    if state.is_completed():
        print(state.result()["status"])
        return 0
    error = state.result(raise_on_failure=False)
    print(f"retrain failed: {error if isinstance(error, BaseException) else state.message}", file=sys.stderr)
    return getattr(error, "exit_code", 1)


if __name__ == "__main__":
    sys.exit(main())
