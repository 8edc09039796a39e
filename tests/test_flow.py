"""The Prefect retrain flow on a tiny throwaway git+DVC project (no model, no network)."""

from __future__ import annotations

import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `flows` lives at the repo root

from filelock import FileLock  # noqa: E402
from prefect.client.orchestration import get_client  # noqa: E402
from ssh_server import _free_port  # noqa: E402

from flows.retrain import (  # noqa: E402
    DEPLOYMENT_NAME,
    CommandResult,
    build_deployment,
    resolve_schedule,
    retrain,
    stage_exit_code,
    stage_order,
)
from flows.retrain.__main__ import _parser  # noqa: E402
from flows.retrain.pool import deploy_to_pool  # noqa: E402
from rlhf_pipeline.errors import (  # noqa: E402
    EXIT_CODE_MEANINGS,
    NOT_RETRIED_EXIT_CODES,
    MissingPackageError,
    ParamsError,
    PipelineError,
)

pytestmark = [pytest.mark.prefect, pytest.mark.e2e]  # every test runs the flow, which starts a temporary Prefect server

PY = sys.executable
STAGES = ["prepare", "train_reward", "train_policy", "evaluate"]

# One script for every stage: counts its attempts in counters/NAME (not tracked by DVC), fails as
# control.json says (not a dependency, so tests can change behaviour without making stages stale),
# then writes its output from a digest of its inputs so that a change flows downstream.
STEP = textwrap.dedent(
    """
    import hashlib, json, sys, time
    from pathlib import Path

    name, out, *deps = sys.argv[1:]
    counter = Path("counters") / name
    counter.parent.mkdir(exist_ok=True)
    attempt = int(counter.read_text()) + 1 if counter.exists() else 1
    counter.write_text(str(attempt))
    control = json.loads(Path("control.json").read_text()).get(name, {}) if Path("control.json").exists() else {}
    time.sleep(control.get("sleep", 0))
    if attempt <= control.get("fail_first", 0):
        print(f"{name}: transient failure on attempt {attempt}", file=sys.stderr)
        sys.exit(1)
    if "exit" in control:
        print(control["message"], file=sys.stderr)
        sys.exit(control["exit"])
    files = [f for d in map(Path, deps) for f in (sorted(d.rglob("*")) if d.is_dir() else [d]) if f.is_file()]
    digest = hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    if out.endswith(".json"):
        Path(out).write_text(json.dumps({"reward": int(digest[:4], 16) / 65536, "eval": {"n": 4}}))
    else:
        Path(out).write_text(f"{name} {digest}\\n")
    """
)


def _run(cmd: list[str], cwd: Path) -> None:
    subprocess.run(cmd, cwd=cwd, check=True, capture_output=True, text=True)


def _git(repo: Path, *args: str) -> None:
    _run(["git", "-c", "user.name=test", "-c", "user.email=test@example.com", *args], repo)


def _stage(name: str, out: str, deps: list[str], metrics: bool = False) -> dict:
    spec: dict = {"cmd": f"{PY} step.py {name} {out} {' '.join(deps)}", "deps": ["step.py", *deps]}
    if metrics:
        spec["metrics"] = [{out: {"cache": False}}]
    else:
        spec["outs"] = [out]
    return spec


@pytest.fixture(autouse=True)
def prefect_harness(prefect_server):
    """Every test here runs flows: on the process's one Prefect server (conftest.prefect_server)."""
    yield


@pytest.fixture(scope="module")
def project_template(tmp_path_factory) -> Path:
    return make_project(tmp_path_factory.mktemp("flow-project"))


@pytest.fixture
def project(project_template: Path, tmp_path: Path) -> Path:
    """git+DVC repo: 4 stages, a dvc-added data/labels/preferences.jsonl, a local remote `localremote`
    (tmp_path/remote). A copy of one made per module: git init, dvc init and dvc add cost seconds."""
    repo = tmp_path / "repo"
    shutil.copytree(project_template, repo, symlinks=True)
    return repo


def make_project(tmp_path: Path) -> Path:
    """The ``project`` fixture's repo, made in ``tmp_path`` (its remote beside it, named by a path
    relative to the repo: a copy of the two folders keeps them paired)."""
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "step.py").write_text(STEP)
    (repo / "data" / "labels").mkdir(parents=True)
    (repo / "data" / "labels" / "README.md").write_text("Drop user preference files here.\n")
    (repo / "data" / "labels" / "preferences.jsonl").write_text('{"chosen": "a", "rejected": "b"}\n')
    stages = {  # like the real pipeline: the first stage depends on the whole data/labels folder
        "prepare": _stage("prepare", "data/prepared.txt", ["data/labels"]),
        "train_reward": _stage("train_reward", "models/reward/model.txt", ["data/prepared.txt"]),
        "train_policy": _stage("train_policy", "models/policy/model.txt", ["models/reward/model.txt"]),
        "evaluate": _stage("evaluate", "metrics.json", ["models/policy/model.txt"], metrics=True),
    }
    import yaml

    (repo / "dvc.yaml").write_text(yaml.safe_dump({"stages": stages}, sort_keys=False))
    (repo / ".gitignore").write_text("counters/\ncontrol.json\n")
    _git(repo, "init", "-q")
    dvc = [PY, "-m", "dvc"]
    _run([*dvc, "init", "-q"], repo)
    _run([*dvc, "remote", "add", "localremote", os.path.join("..", "remote")], repo)
    _run([*dvc, "add", "-q", "data/labels/preferences.jsonl"], repo)
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "tiny project")
    return repo


LABELS_BY_FILE = "labelling:\n  source: file\ndata:\n  preferences:\n    source: data/labels/preferences.jsonl\n"


def _labels_by_file(repo: Path, extra: str = "") -> None:
    """params.yaml saying that each run's --incoming file replaces data/labels/preferences.jsonl."""
    (repo / "params.yaml").write_text(extra + LABELS_BY_FILE)
    _git(repo, "add", "params.yaml")
    _git(repo, "commit", "-qm", "labels come in files")


def _control(repo: Path, **behaviour: dict) -> None:
    (repo / "control.json").write_text(json.dumps(behaviour))


def _counters(repo: Path) -> dict[str, int]:
    folder = repo / "counters"
    return {p.name: int(p.read_text()) for p in folder.iterdir()} if folder.exists() else {}


def _validator(tmp_path: Path, exit_code: int, message: str) -> list[str]:
    script = tmp_path / f"validator_{exit_code}.py"
    script.write_text(f"import sys\nprint({message!r})\nsys.exit({exit_code})\n")
    return [PY, str(script)]


def _artifacts(flow_run_id) -> dict[str, object]:
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        )
    return {a.key: a for a in found}


FAST = {"retry_delay_seconds": 0.0, "lineage_target": None}


def test_stage_order_and_exit_code_parsing(project: Path):
    assert stage_order(project) == STAGES
    # the order comes from DVC's graph, not from the file: dependents listed first still run last
    import yaml

    spec = yaml.safe_load((project / "dvc.yaml").read_text())
    (project / "dvc.yaml").write_text(
        yaml.safe_dump({"stages": dict(reversed(spec["stages"].items()))}, sort_keys=False)
    )
    assert list(yaml.safe_load((project / "dvc.yaml").read_text())["stages"]) == STAGES[::-1]
    assert stage_order(project) == STAGES
    dvc_error = "boom\nERROR: failed to reproduce 'x': failed to run: python s.py, exited with 3"
    assert stage_exit_code(CommandResult(255, dvc_error)) == 3
    assert stage_exit_code(CommandResult(255, "ERROR: Unable to acquire lock")) == 1
    # DVC's own writes failing for storage (the stage itself ran): exit 5, never retried
    for reason in ("[Errno 28] No space left on device", "[Errno 1] Operation not permitted: 'models/x'"):
        assert stage_exit_code(CommandResult(255, f"ERROR: unexpected error - {reason}")) == 5
    assert stage_exit_code(CommandResult(255, f"{dvc_error}\nNo space left on device")) == 3  # the stage's own code
    assert stage_exit_code(CommandResult(0, "")) == 0
    missing = (
        "Traceback (most recent call last):\nModuleNotFoundError: No module named 'torch'\nERROR: failed to "
        "reproduce 'x': exited with 1"
    )
    assert stage_exit_code(CommandResult(255, missing)) == MissingPackageError.exit_code


def test_transient_failure_is_retried_and_valid_data_ingested(project: Path, tmp_path: Path):
    _control(project, train_policy={"fail_first": 2})
    _labels_by_file(project)
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    (inbox / "old.jsonl").write_text('{"chosen": "old", "rejected": "x"}\n')
    (inbox / "new.jsonl").write_text('{"chosen": "new", "rejected": "y"}\n')
    os.utime(inbox / "old.jsonl", (1_000_000, 1_000_000))

    state = retrain(
        repo=str(project),
        incoming=str(inbox),
        validate_command=_validator(tmp_path, 0, "ok"),
        retries=3,
        retry_delay_seconds=0.0,
        return_state=True,  # lineage: the real CLI, failure tolerated
    )

    assert state.is_completed(), state.message
    result = state.result()
    assert _counters(project) == {"prepare": 1, "train_reward": 1, "train_policy": 3, "evaluate": 1}
    assert [s["attempts"] for s in result["stages"]] == [1, 1, 3, 1]
    assert all(s["result"] == "ran" for s in result["stages"])
    assert (project / "data/labels/preferences.jsonl").read_text() == (inbox / "new.jsonl").read_text()
    assert result["ingested"]["changed"] and "dvc add" in result["ingested"]["tracked"]
    assert (project / "metrics.json").exists() and (project / "models/policy/model.txt").exists()
    assert any((tmp_path / "remote").rglob("*")), "dvc push to localremote left the remote empty"
    assert "localremote" in result["push"]
    artifacts = _artifacts(state.state_details.flow_run_id)
    assert {"retrain-summary", "retrain-metrics"} <= set(artifacts)
    summary = artifacts["retrain-summary"].data
    assert "train_policy | ran | 3" in summary and "Lineage of `models/policy`" in summary
    table = artifacts["retrain-metrics"].data
    table = json.loads(table) if isinstance(table, str) else table
    assert {row["metric"] for row in table} == {"reward", "eval.n"}


def test_the_schedule_runs_on_after_its_own_ingest(project: Path, tmp_path: Path):
    """With a params.yaml (the flow then runs `rlhf check-params` first) and the .dvc files an ingest
    makes: a run ingesting a file, a second ingesting another, a third with none all end well, each
    rerunning only what changed."""
    _labels_by_file(project, "seed: 1\n")
    ran = []
    for round_, rows in enumerate(
        ('{"chosen": "first", "rejected": "x"}\n', '{"chosen": "second", "rejected": "y"}\n', None)
    ):
        incoming = None
        if rows is not None:
            incoming = tmp_path / f"batch{round_}.jsonl"
            incoming.write_text(rows)
        state = retrain(
            repo=str(project),
            incoming=None if incoming is None else str(incoming),
            validate_command=_validator(tmp_path, 0, "ok"),
            push=False,
            return_state=True,
            **FAST,
        )
        assert state.is_completed(), f"round {round_}: {state.message}"
        result = state.result()
        assert result["params"] != "no params.yaml"
        ran.append([s["stage"] for s in result["stages"] if s["result"] == "ran"])
    assert ran == [STAGES, STAGES, []]
    assert (project / "data/labels/preferences.jsonl").read_text() == '{"chosen": "second", "rejected": "y"}\n'


def test_the_next_run_recovers_after_the_disk_filled(tmp_path: Path):
    """A disk that fills while DVC rewrites its .dvc/tmp/rwlock leaves it empty, and every later
    `dvc repro` fails (exit 255) after the space is freed. On a real full tmpfs where root can mount
    one (else the file the full disk leaves, written by hand): the run on the full disk fails, and the
    next run after freeing the space completes with every output whole."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(disk)], capture_output=True)
    try:
        repo = make_project(disk)
        if mounted.returncode == 0:
            rwlock = repo / ".dvc" / "tmp" / "rwlock"
            rwlock.unlink(missing_ok=True)
            filler = disk / "filler"
            with open(filler, "wb") as handle:  # every block taken
                try:
                    while True:
                        handle.write(b"\0" * 65536)
                except OSError:
                    pass
            full = retrain(repo=str(repo), push=False, return_state=True, **FAST)
            assert full.is_failed()
            filler.unlink()
            assert rwlock.is_file() and rwlock.read_bytes() == b"", "DVC's rwlock is not what a full disk leaves"
        else:  # emulation: what the full disk left in the real case
            (repo / ".dvc" / "tmp").mkdir(parents=True, exist_ok=True)
            (repo / ".dvc" / "tmp" / "rwlock").write_bytes(b"")
        broken = subprocess.run([PY, "-m", "dvc", "repro"], cwd=repo, capture_output=True, text=True)
        assert broken.returncode == 255 and "RWLock-file" in broken.stderr  # what a person met before
        state = retrain(repo=str(repo), push=False, return_state=True, **FAST)
        assert state.is_completed(), state.message
        assert [s["result"] for s in state.result()["stages"]] == ["ran"] * 4
        status = subprocess.run([PY, "-m", "dvc", "status", "--json"], cwd=repo, capture_output=True, text=True)
        assert json.loads(status.stdout) == {}
    finally:
        if mounted.returncode == 0:
            subprocess.run(["umount", "-l", str(disk)], check=False)


def test_the_bytes_validated_are_the_bytes_ingested(project: Path, tmp_path: Path):
    """An exporter still writing: a row is appended to the incoming file while the validator runs.
    The flow validated a private copy and renames that copy into place: the appended (unchecked)
    row never reaches data/labels, and nothing is left beside the target."""
    _labels_by_file(project)
    incoming = tmp_path / "incoming.jsonl"
    checked = '{"chosen": "checked", "rejected": "x"}\n'
    incoming.write_text(checked)
    writer = tmp_path / "validator_appends.py"
    writer.write_text(
        "import sys\n"
        f'open({str(incoming)!r}, \'a\').write(\'{{"chosen": "unchecked", "rejected": "x"}}\\n\')\n'
        "text = open(sys.argv[1]).read()\n"
        "assert 'unchecked' not in text, 'the validator saw the appended row'\n"
        "print('ok')\n"
    )
    state = retrain(
        repo=str(project), incoming=str(incoming), validate_command=[PY, str(writer)], return_state=True, **FAST
    )
    assert state.is_completed(), state.message
    assert "unchecked" in incoming.read_text()  # the writer did append
    assert (project / "data/labels/preferences.jsonl").read_text() == checked
    assert sorted(p.name for p in (project / "data/labels").iterdir()) == [
        ".gitignore",
        "README.md",
        "preferences.jsonl",
        "preferences.jsonl.dvc",
    ]


def test_outputs_dvc_failed_to_cache_fail_the_stage_with_exit_5(project: Path, monkeypatch):
    """`dvc repro` with a full cache can exit 0 after printing "No space left on device", leaving
    dvc.lock recording outputs its cache does not hold: the flow checks DVC's status after each stage
    and stops (exit 5, storage, not retried) instead of going on to push a lock without its data."""
    import flows.retrain.flow as flow_module

    real_stream = flow_module.stream

    def cache_fills_up(cmd, cwd, logger):
        result = real_stream(cmd, cwd, logger)
        if "train_reward" in cmd:  # DVC ran the stage, then could not write its output to the cache
            shutil.rmtree(project / ".dvc" / "cache")
            return CommandResult(0, result.output + "\nERROR: [Errno 28] No space left on device\n")
        return result

    monkeypatch.setattr(flow_module, "stream", cache_fills_up)
    state = retrain(repo=str(project), return_state=True, **FAST)
    assert state.is_failed()
    error = state.result(raise_on_failure=False)
    assert error.exit_code == 5
    assert "DVC stage 'train_reward' ran, but DVC did not save its outputs as dvc.lock records them" in str(error)
    assert "models/reward/model.txt: not in cache" in str(error) and "No space left on device" in str(error)
    assert _counters(project).get("train_policy") is None and _counters(project)["train_reward"] == 1  # no retry


# Loaded by every Python the flow starts (PYTHONPATH): unlinking a file of the given name fails as it
# does for an immutable file (chattr +i), which this test cannot set without privileges.
IMMUTABLE_FILE = textwrap.dedent(
    """
    import errno
    import os

    _name = os.environ.get("RLHF_TEST_IMMUTABLE_NAME")
    if _name:
        _unlink = os.unlink

        def refuse(path, *args, **kwargs):
            if os.fspath(path).endswith(_name):
                raise PermissionError(errno.EPERM, "Operation not permitted", os.fspath(path))
            return _unlink(path, *args, **kwargs)

        os.unlink = os.remove = refuse
    """
)
SEVEN_PARTS = "import pathlib, sys\nout = pathlib.Path(sys.argv[1])\nout.mkdir(parents=True, exist_ok=True)\n" + (
    "for i in range(7):\n    (out / f'part{i}.bin').write_text(pathlib.Path(sys.argv[2]).read_text() + str(i))\n"
)


def test_an_output_dvc_could_only_half_delete_is_put_back_whole(project: Path, tmp_path: Path, monkeypatch):
    """DVC deletes a stale stage's outputs before running it and stops at the first file it cannot
    delete (an immutable file: exit 255, "Operation not permitted"), leaving part of the output in
    place. The flow reads that as storage (exit 5, not retried), moves the partial output aside whole
    and checks the recorded version out of DVC's cache: nothing half-deleted stays where it was."""
    import yaml

    (project / "parts.py").write_text(SEVEN_PARTS)
    pipeline = yaml.safe_load((project / "dvc.yaml").read_text())
    pipeline["stages"]["train_policy"] = {
        "cmd": f"{PY} parts.py models/policy models/reward/model.txt",
        "deps": ["parts.py", "models/reward/model.txt"],
        "outs": ["models/policy"],
    }
    pipeline["stages"]["evaluate"] = _stage("evaluate", "metrics.json", ["models/policy"], metrics=True)
    (project / "dvc.yaml").write_text(yaml.safe_dump(pipeline, sort_keys=False))
    _git(project, "add", "-A")
    _git(project, "commit", "-qm", "a folder output")
    assert retrain(repo=str(project), push=False, return_state=True, **FAST).is_completed()
    recorded = {p.name: p.read_bytes() for p in (project / "models/policy").iterdir()}
    assert len(recorded) == 7

    (project / "parts.py").write_text(SEVEN_PARTS + "# a change: train_policy is stale\n")
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(IMMUTABLE_FILE)
    monkeypatch.setenv("PYTHONPATH", str(hooks))
    # the last file rmtree reaches (the file system's listing order): DVC deletes the other six first
    immutable = [entry.name for entry in os.scandir(project / "models/policy")][-1]
    monkeypatch.setenv("RLHF_TEST_IMMUTABLE_NAME", immutable)

    state = retrain(repo=str(project), retries=3, return_state=True, **FAST)

    assert state.is_failed()
    error = state.result(raise_on_failure=False)
    assert error.exit_code == 5 and "not retried" in str(error), str(error)
    aside = project / ".dvc/tmp/incomplete/models/policy-1"
    assert "models/policy: not as dvc.lock records it; moved whole to .dvc/tmp/incomplete/models/policy-1" in str(error)
    assert [p.name for p in aside.iterdir()] == [immutable]  # what DVC could not delete
    assert {p.name: p.read_bytes() for p in (project / "models/policy").iterdir()} == recorded
    # stale because its code changed, nothing else: its output is whole again
    status = json.loads(_dvc(project, "status", "--json", "train_policy").stdout)
    assert status == {"train_policy": [{"changed deps": {"parts.py": "modified"}}]}, status


def test_invalid_preferences_fail_the_run_before_any_stage(project: Path, tmp_path: Path):
    _labels_by_file(project)
    before = (project / "data/labels/preferences.jsonl").read_text()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"chosen": "same", "rejected": "same"}\n')
    summary = "Data contract failed for bad.jsonl: 1 row where chosen == rejected"

    state = retrain(
        repo=str(project),
        incoming=str(bad),
        validate_command=_validator(tmp_path, 3, summary),
        return_state=True,
        **FAST,
    )

    assert state.is_failed()
    assert "chosen == rejected" in state.message and "nothing was replaced" in state.message
    assert _counters(project) == {}, "a stage ran after the contract failure"
    assert not (project / "models").exists() and not (project / "metrics.json").exists()
    assert (project / "data/labels/preferences.jsonl").read_text() == before


DETERMINISTIC_FAILURES = {  # exit code -> a stage's message for it
    2: "params.yaml is invalid: ppo.lr: must be > 0",
    4: "The weights after update 3 are not finite",
    5: "could not write models/reward: No space left on device",
    6: "ModuleNotFoundError: No module named 'torch'",  # a stage that died importing: exit 1, read as 6
    127: "/bin/sh: 1: python: not found",
}
EXITS = {6: 1}  # the code the stage process itself returns, where it is not the code the flow reports


@pytest.mark.parametrize("code", sorted(DETERMINISTIC_FAILURES))
def test_deterministic_failures_are_not_retried(project: Path, code: int):
    assert code in NOT_RETRIED_EXIT_CODES
    message = DETERMINISTIC_FAILURES[code]
    _control(project, train_reward={"exit": EXITS.get(code, code), "message": message})

    state = retrain(repo=str(project), retries=3, return_state=True, **FAST)

    assert state.is_failed()
    assert message in state.message and f"exit code {code} ({EXIT_CODE_MEANINGS[code]}; not retried)" in state.message
    assert _counters(project) == {"prepare": 1, "train_reward": 1}, f"exit {code} was retried or later stages ran"
    assert not (project / "models/policy").exists()
    summary = _artifacts(state.state_details.flow_run_id)["retrain-summary"].data
    assert "# Retrain: failed" in summary and message in summary
    assert any(message in line for line in _error_logs(state.state_details.flow_run_id)), "not logged at ERROR"


def test_a_stage_traceback_is_logged_at_error(project: Path):
    """A bug's traceback, streamed from the stage line by line, reaches Prefect's log at ERROR."""
    trace = 'Traceback (most recent call last):\n  File "step.py", line 1\nZeroDivisionError: division by zero'
    _control(project, train_reward={"exit": 1, "message": trace})
    state = retrain(repo=str(project), retries=0, return_state=True, **FAST)
    assert state.is_failed()
    errors = _error_logs(state.state_details.flow_run_id)
    assert "Traceback (most recent call last):" in errors and "ZeroDivisionError: division by zero" in errors


def _error_logs(flow_run_id) -> list[str]:
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId, LogFilterLevel
    from prefect.logging.handlers import APILogHandler

    APILogHandler().flush()  # logs reach the server in batches: send the pending ones first
    log_filter = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id]), level=LogFilterLevel(ge_=40))
    with get_client(sync_client=True) as client:
        return [log.message for log in client.read_logs(log_filter=log_filter)]


def test_unchanged_project_runs_nothing(project: Path):
    first = retrain(repo=str(project), return_state=True, **FAST)
    assert first.is_completed(), first.message
    after_first = _counters(project)
    assert after_first == dict.fromkeys(STAGES, 1)

    second = retrain(repo=str(project), return_state=True, **FAST)

    assert second.is_completed(), second.message
    assert _counters(project) == after_first
    result = second.result()
    assert result["status"] == "all stages up to date" and result["stages"] == []
    assert "all stages up to date" in result["summary"]
    assert "retrain-summary" in _artifacts(second.state_details.flow_run_id)


def test_overlapping_run_does_not_touch_the_workspace(project: Path):
    lock_path = project / ".dvc" / "tmp" / "retrain.lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(lock_path)):
        state = retrain(repo=str(project), lock_timeout=0.5, return_state=True, **FAST)
    assert state.is_failed()
    assert "another retrain run holds" in state.message
    assert _counters(project) == {}


def test_schedule_is_registered(project: Path):
    (project / "params.yaml").write_text("schedule:\n  cron: '15 4 * * 2'\n  timezone: Europe/Paris\n")
    assert resolve_schedule(project, "0 5 * * *").model_dump() == {"cron": "0 5 * * *", "timezone": "Europe/Paris"}
    assert resolve_schedule(project, timezone="Asia/Tokyo").timezone == "Asia/Tokyo"
    with pytest.raises(ParamsError, match="schedule.timezone: Value error, not an IANA time zone"):
        resolve_schedule(project, timezone="Mars/Olympus")

    deployment_id = build_deployment(str(project)).apply()  # the deployment `serve` serves

    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name(f"retrain/{DEPLOYMENT_NAME}")
        assert deployment.id == deployment_id
        assert [(s.schedule.cron, s.schedule.timezone) for s in deployment.schedules] == [
            ("15 4 * * 2", "Europe/Paris")
        ]
        assert deployment.schedules[0].active
        assert deployment.parameters["repo"] == str(project.resolve())
        assert deployment.global_concurrency_limit is not None and deployment.global_concurrency_limit.limit == 1


def test_stages_run_with_the_flows_interpreter_without_an_activated_venv(project: Path, monkeypatch):
    """A stage command saying plain `python` gets the flow's interpreter even when PATH has no venv."""
    import yaml

    spec = yaml.safe_load((project / "dvc.yaml").read_text())
    prepare = spec["stages"]["prepare"]
    prepare["cmd"] = (
        'python -c \'import sys; open("counters-interpreter.txt", "w").write(sys.executable)\' && '
        + prepare["cmd"].replace(PY, "python")
    )
    (project / "dvc.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # no venv, no pyenv shims: `python` alone is not found here
    state = retrain(repo=str(project), return_state=True, **FAST)
    assert state.is_completed(), state.message
    assert (project / "counters-interpreter.txt").read_text() == PY


def test_an_invalid_params_file_stops_the_run_before_any_stage(project: Path):
    """Each stage validates only the sections it reads; the flow checks the whole file first."""
    (project / "params.yaml").write_text("ppo:\n  lr: -1.0\n")
    state = retrain(repo=str(project), return_state=True, **FAST)
    assert state.is_failed()
    assert "params.yaml is invalid" in state.message and "ppo.lr" in state.message
    assert _counters(project) == {}


# Loaded by every Python the flow starts (PYTHONPATH): the first DVC process that writes dvc.lock
# with train_policy in it writes half the file, then kills itself with SIGKILL, as a kill -9 at that
# moment would leave it.
KILL_AT_LOCK_WRITE = textwrap.dedent(
    """
    import os
    import signal
    from pathlib import Path

    marker = os.environ.get("RLHF_TEST_KILL_AT_LOCK_WRITE")
    if marker and not Path(marker).exists():
        import io

        import dvc.utils.serialize._yaml as dvc_yaml

        write = dvc_yaml._dump

        def die_halfway(data, stream):
            if str(getattr(stream, "name", "")).endswith("dvc.lock") and "train_policy" in data.get("stages", {}):
                text = io.StringIO()
                write(data, text)
                stream.write(text.getvalue()[: len(text.getvalue()) // 2])
                stream.flush()
                Path(marker).write_text("killed")
                os.kill(os.getpid(), signal.SIGKILL)
            return write(data, stream)

        dvc_yaml._dump = die_halfway
    """
)


def _dvc(project: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "dvc", *args], cwd=project, capture_output=True, text=True)


def test_a_kill_while_dvc_writes_dvc_lock_does_not_wedge_the_pipeline(project: Path, tmp_path: Path, monkeypatch):
    """DVC rewrites dvc.lock in place. Killed during that write it leaves a truncated file that no dvc
    command reads: the flow puts back its copy from before the stage and retries the stage; with no
    copy, it stops at once and says how to recover."""
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(KILL_AT_LOCK_WRITE)
    monkeypatch.setenv("PYTHONPATH", str(hooks))
    monkeypatch.setenv("RLHF_TEST_KILL_AT_LOCK_WRITE", str(tmp_path / "killed"))

    state = retrain(repo=str(project), retries=2, return_state=True, **FAST)

    assert (tmp_path / "killed").is_file(), "no dvc process was killed at its dvc.lock write"
    assert state.is_completed(), state.message
    # its record was lost with the file: the retry reproduced it (from DVC's run cache: no second run)
    assert next(s for s in state.result()["stages"] if s["stage"] == "train_policy")["attempts"] == 2
    assert _dvc(project, "status", "--json").stdout.strip() == "{}"

    _git(project, "add", "-A")
    _git(project, "commit", "-qm", "a good run")

    # a manual `dvc repro` killed the same way, with no copy of the flow's to fall back on
    (tmp_path / "killed").unlink()
    (project / ".dvc/tmp/dvc.lock.last-good").unlink()
    _control(project, train_policy={"fail_first": 0})  # a change to nothing: force the stage to run again
    killed = _dvc(project, "repro", "--force", "--single-item", "train_policy")
    assert killed.returncode != 0 and (tmp_path / "killed").is_file()
    assert _dvc(project, "status").returncode != 0  # wedged: DVC cannot read its own lock
    lineage = subprocess.run(
        [PY, "-m", "rlhf_pipeline.cli", "lineage", "models/policy"], cwd=project, text=True, capture_output=True
    )
    assert (
        lineage.returncode == 1 and "git checkout -- dvc.lock" in lineage.stderr and "Traceback" not in lineage.stderr
    )
    stopped = retrain(repo=str(project), return_state=True, **FAST)
    assert stopped.is_failed() and "git checkout -- dvc.lock" in stopped.message
    _git(project, "checkout", "--", "dvc.lock")  # the recovery the message gives (the last committed lock)
    assert retrain(repo=str(project), return_state=True, **FAST).is_completed()
    assert _dvc(project, "status", "--json").stdout.strip() == "{}"


def test_damaged_bytes_are_never_pushed(project: Path, tmp_path: Path):
    """`dvc push` would upload a damaged cache object under its old hash: the flow re-reads every
    output's bytes first and fails (not retried) naming the file."""
    assert retrain(repo=str(project), push=False, return_state=True, **FAST).is_completed()
    import yaml

    lock = yaml.safe_load((project / "dvc.lock").read_text())
    md5 = lock["stages"]["train_policy"]["outs"][0]["md5"]  # models/policy/model.txt: "train_policy <digest>"
    cached = project / ".dvc/cache/files/md5" / md5[:2] / md5[2:]
    stat = cached.stat()  # size and mtime kept: DVC's state db takes it for the object it wrote
    cached.chmod(0o644)
    cached.write_bytes(cached.read_bytes().replace(b"train_policy", b"train_pollcy"))
    os.utime(cached, ns=(stat.st_atime_ns, stat.st_mtime_ns))

    state = retrain(repo=str(project), retries=3, return_state=True, **FAST)

    assert state.is_failed()
    assert "nothing was pushed" in state.message and str(cached) in state.message
    assert not (tmp_path / "remote").exists() or not any((tmp_path / "remote").rglob("*"))


# --------------------------------------------------------------------------------------------
# the promotion gate inside the flow, on the tiny pipeline
# --------------------------------------------------------------------------------------------
@pytest.mark.e2e
def test_the_flow_registers_each_new_policy_and_promotes_only_by_the_rule(versioned, tmp_path, monkeypatch):
    import yaml
    from test_pipeline_e2e import sh

    root = tmp_path / "project"
    shutil.copytree(versioned, root, symlinks=True)
    for variable in ("GIT_AUTHOR_NAME", "GIT_AUTHOR_EMAIL", "GIT_COMMITTER_NAME", "GIT_COMMITTER_EMAIL"):
        monkeypatch.setenv(variable, "t@t" if variable.endswith("EMAIL") else "t")  # the flow commits and tags

    def set_params(**sections) -> None:
        params = yaml.safe_load((root / "params.yaml").read_text())
        for section, values in sections.items():
            params[section].update(values)
        (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
        sh(["git", "commit", "-qam", "params"], root)

    def run() -> tuple[dict, dict]:
        state = retrain(repo=str(root), push=False, return_state=True, **FAST)
        assert state.is_completed(), state.message
        return state.result(), _artifacts(state.state_details.flow_run_id)

    def prod() -> str:
        return sh(["gto", "show", "policy#prod", "--ref"], root, check=False).stdout.strip()

    # the first version meets the base model; a loose rule promotes it
    set_params(promotion={"max_kl": None, "tolerance_se": 100.0, "min_queries": 2})
    report, artifacts = run()
    assert report["promotion"] == "policy@v1.0.0 assigned prod (with reward-model@v1.0.0)"
    decision = artifacts["promotion-decision"].data
    assert "policy@v1.0.0 promoted to prod" in decision and "Compared with: base model" in decision
    assert "Promotion gate: policy@v1.0.0 assigned prod" in artifacts["retrain-summary"].data
    assert prod() == "policy@v1.0.0"
    # nothing new: no version, prod kept
    report, _ = run()
    assert "no new version" in report["promotion"] and prod() == "policy@v1.0.0"
    # a retrain the rule cannot accept (it asks for more paired queries than the tiny run holds;
    # the tiny policy's KL estimate can be <= 0, so a KL budget would not do): registered, not
    # promoted, and the run still completes
    set_params(ppo={"lr": 3.0e-4}, promotion={"min_queries": 10_000})
    (root / "notes.txt").write_text("a person's work in progress\n")
    sh(["git", "add", "notes.txt"], root)
    report, artifacts = run()
    assert sh(["git", "status", "--porcelain", "--", "notes.txt"], root).stdout == "A  notes.txt\n"  # not ours
    assert report["status"] == "reproduced train_policy, evaluate"
    assert report["recorded"].startswith("committed ")
    assert "prod stays policy@v1.0.0; policy@v2.0.0 is registered, not promoted" == report["promotion"]
    assert "not promoted: prod is unchanged" in artifacts["promotion-decision"].data
    assert "held-out queries pair up (promotion.min_queries: 10000)" in artifacts["promotion-decision"].data
    assert prod() == "policy@v1.0.0"
    assert sh(["git", "status", "--porcelain", "--", "dvc.lock", "metrics", "evaluation"], root).stdout == ""


@pytest.mark.e2e
@pytest.mark.parametrize("swap", ["dir object", "file object"])
def test_a_swapped_cache_object_is_refused_before_it_is_trained_on_recorded_or_pushed(swap, versioned, tmp_path):
    """models/reward's DVC cache object replaced by a self-consistent other one (reward_unnormalized's
    file list, or one of its files), then `dvc checkout`: DVC would restore normalize_reward from its
    run cache onto it, record the other folder's hash and train on it. The flow refuses it before the
    stage runs: exit 7, dvc.lock untouched, nothing pushed, and the message says how to restore."""
    import yaml
    from test_pipeline_e2e import sh

    root = tmp_path / "project"
    shutil.copytree(versioned, root, symlinks=True)
    remote = tmp_path / "remote"
    sh(["dvc", "remote", "add", "-f", "-d", "local", str(remote)], root)
    lock = yaml.safe_load((root / "dvc.lock").read_text())

    def object_of(md5: str) -> Path:
        return root / ".dvc/cache/files/md5" / md5[:2] / md5[2:]

    def out(stage: str, path: str) -> dict:
        return next(entry for entry in lock["stages"][stage]["outs"] if entry["path"] == path)

    reward, unnormalized = out("normalize_reward", "models/reward"), out("train_reward", "models/reward_unnormalized")
    if swap == "dir object":
        victim, planted = object_of(reward["md5"]), object_of(unnormalized["md5"]).read_bytes()
    else:
        files = {entry["relpath"]: entry["md5"] for entry in json.loads(object_of(reward["md5"]).read_text())}
        others = {entry["relpath"]: entry["md5"] for entry in json.loads(object_of(unnormalized["md5"]).read_text())}
        name = next(n for n in sorted(files) if n in others and files[n] != others[n] and n.endswith(".safetensors"))
        victim, planted = object_of(files[name]), object_of(others[name]).read_bytes()
    victim.chmod(0o644)
    victim.write_bytes(planted)
    sh(["dvc", "checkout", "--force", "models/reward"], root, check=False)
    lock_before = (root / "dvc.lock").read_bytes()

    state = retrain(repo=str(root), return_state=True, **FAST)

    assert state.is_failed()
    message = state.message
    assert "DVC stage 'normalize_reward' was not run" in message and "(7: " in message, message
    assert str(victim) in message and "dvc repro --force STAGE" in message
    assert (root / "dvc.lock").read_bytes() == lock_before
    assert not remote.exists() or not any(remote.rglob("*")), "something was pushed"


def test_the_flow_names_its_exit_codes_by_their_error_classes():
    """Every exit code the flow gives is an `errors` class's code (one home for what each means), never
    an integer written in the flow: no int literal as a RetrainError's code, an `exit_code=` value or
    a `getattr(..., "exit_code", ...)` default."""
    import ast

    literals = []
    for path in sorted((Path(__file__).resolve().parents[1] / "flows/retrain").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = getattr(node.func, "id", getattr(node.func, "attr", ""))
            values = [k.value for k in node.keywords if k.arg == "exit_code"]
            if name.endswith(("Error", "Failed", "Locked", "Preferences")):
                values += node.args[1:2]
            if name == "getattr" and len(node.args) == 3:
                values.append(node.args[2])
            literals += [
                f"{path.name}:{v.lineno}" for v in values if isinstance(v, ast.Constant) and isinstance(v.value, int)
            ]
    assert literals == []


def test_a_run_that_keeps_crashing_is_refused_after_its_crash_restarts(monkeypatch):
    """The work pool's automation schedules a Crashed run again (flows/retrain/pool.py); the flow's
    first act is to count the starts Prefect recorded and fail, for good, past crash_restarts."""
    from types import SimpleNamespace

    import flows.retrain.flow as flow_module
    from flows.retrain.dvc_project import RetrainError

    monkeypatch.setattr(flow_module, "flow_run_runtime", SimpleNamespace(run_count=4))
    with pytest.raises(RetrainError, match="started 4 times: it crashed 3 times .* crash_restarts is 2"):
        flow_module.refuse_endless_restarts(2)
    monkeypatch.setattr(flow_module, "flow_run_runtime", SimpleNamespace(run_count=1))
    flow_module.refuse_endless_restarts(0)  # a first start always runs


def test_labelling_source_file_ingests_into_the_labels_file(project: Path, tmp_path: Path):
    """labelling.source: file: the run's incoming file replaces data.preferences.source (the one file
    the preferences stage reads), wherever that is."""
    labels = "data/labels/human.jsonl"
    (project / "params.yaml").write_text(f"data:\n  preferences:\n    source: {labels}\nlabelling:\n  source: file\n")
    incoming = tmp_path / "round.jsonl"
    incoming.write_text('{"chosen": "people", "rejected": "x"}\n')
    state = retrain(
        repo=str(project),
        incoming=str(incoming),
        validate_command=_validator(tmp_path, 0, "ok"),
        push=False,
        return_state=True,
        **FAST,
    )
    assert state.is_completed(), state.message
    assert state.result()["ingested"]["target"] == labels
    assert (project / labels).read_text() == incoming.read_text()
    assert (project / "data/labels/preferences.jsonl").read_text() == '{"chosen": "a", "rejected": "b"}\n'


@pytest.mark.parametrize("params", [None, "labelling:\n  source: simulated\n"])
def test_a_project_whose_labels_are_simulated_refuses_an_incoming_file(project: Path, tmp_path: Path, params):
    """labelling.source: simulated (also the default, without a params.yaml) brings in no labels: an
    --incoming file is refused (exit 2) before anything is written, saying what to set instead."""
    if params is not None:
        (project / "params.yaml").write_text(params)
    incoming = tmp_path / "round.jsonl"
    incoming.write_text('{"chosen": "people", "rejected": "x"}\n')

    def files():  # the project's own files and what git says of them (DVC's and the flow's locks aside)
        kept = [p for p in project.rglob("*") if p.is_file() and not {".git", ".dvc"} & set(p.parts)]
        status = subprocess.run(["git", "status", "-s"], cwd=project, capture_output=True, text=True).stdout
        return {p.relative_to(project).as_posix(): p.read_bytes() for p in kept}, status

    before = files()
    state = retrain(repo=str(project), incoming=str(incoming), push=False, return_state=True, **FAST)
    assert state.is_failed()
    error = state.result(raise_on_failure=False)
    assert error.exit_code == 2, error
    assert "labelling.source is simulated" in state.message and "set labelling.source: file" in state.message
    assert _counters(project) == {}
    assert files() == before
    assert (project / "data/labels/preferences.jsonl").read_text() == '{"chosen": "a", "rejected": "b"}\n'


def test_labelling_from_an_unreachable_label_studio_is_retried_then_fails_with_nothing_changed(
    project: Path, tmp_path: Path, monkeypatch
):
    labels = "data/labels/human.jsonl"
    (project / "params.yaml").write_text(
        f"data:\n  preferences:\n    source: {labels}\nlabelling:\n  source: label_studio\n  label_studio_project: 3\n"
    )
    (project / labels).write_text('{"chosen": "kept", "rejected": "x"}\n')
    closed = _free_port()  # a port nobody listens on
    monkeypatch.setenv("LABEL_STUDIO_URL", f"http://127.0.0.1:{closed}")
    monkeypatch.setenv("LABEL_STUDIO_API_KEY", "0" * 40)
    state = retrain(repo=str(project), push=False, return_state=True, retries=1, **FAST)
    assert state.is_failed()
    message = state.message
    assert "pulling labels from Label Studio project 3 failed (exit 1)" in message, message
    assert f"Label Studio project 3 at http://127.0.0.1:{closed}: the server did not answer" in message
    assert (project / labels).read_text() == '{"chosen": "kept", "rejected": "x"}\n'
    assert not list((project / "data/labels").glob(".human.jsonl.pull-*")), "the scratch copy was left behind"
    assert _counters(project) == {}, "a stage ran without the labels"

    incoming = tmp_path / "round.jsonl"
    incoming.write_text('{"chosen": "people", "rejected": "x"}\n')
    both = retrain(repo=str(project), incoming=str(incoming), push=False, return_state=True, **FAST)
    assert both.is_failed() and "the incoming file" in both.message and "would be left out" in both.message
    assert (project / labels).read_text() == '{"chosen": "kept", "rejected": "x"}\n'


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["run", "--retries", "-1"], "argument --retries: -1 is not a whole number of at least 0"),
        (["run", "--retry-delay", "nan"], "argument --retry-delay: 'nan' is not a finite number of seconds"),
        (["run", "--lock-timeout", "-3"], "argument --lock-timeout: '-3' is not a finite number of seconds"),
        (["deploy", "--pool", "p", "--heartbeat-seconds", "10"], "10 is not a whole number of at least 30"),
        (["deploy", "--pool", "p", "--missed-heartbeats", "1"], "1 is not a whole number of at least 2"),
    ],
)
def test_the_flow_s_number_options_are_checked_by_its_parser(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        _parser(argv[0]).parse_args(argv[1:])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_the_command_line_s_defaults_are_those_of_the_flow_and_the_deployment():
    """``python -m flows.retrain run`` and ``deploy`` with no options pass what ``retrain`` and
    ``deploy_to_pool`` take when called as a library, and a deployed run restarts as often as a run
    of the flow called with its own default."""
    run = _parser("run").parse_args([])
    deploy = _parser("deploy").parse_args(["--pool", "p"])
    flow = {name: p.default for name, p in inspect.signature(retrain.fn).parameters.items()}
    pool = {name: p.default for name, p in inspect.signature(deploy_to_pool).parameters.items()}
    assert (run.retries, run.retry_delay, run.lock_timeout) == (
        flow["retries"],
        flow["retry_delay_seconds"],
        flow["lock_timeout"],
    )
    assert (deploy.heartbeat_seconds, deploy.missed_heartbeats, deploy.crash_restarts) == (
        pool["heartbeat_seconds"],
        pool["missed_heartbeats"],
        pool["crash_restarts"],
    )
    assert pool["crash_restarts"] == flow["crash_restarts"] == 2
    assert (flow["retries"], flow["retry_delay_seconds"], pool["heartbeat_seconds"]) == (3, 30.0, 60)


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"heartbeat_seconds": 29}, "heartbeat_seconds must be at least 30 (Prefect's"),
        ({"crash_restarts": -1}, "crash_restarts at least 0 (got -1)"),
        ({"missed_heartbeats": 1}, "missed_heartbeats at least 2 (got 1)"),
    ],
)
def test_deploying_refuses_a_crash_window_prefect_cannot_keep_before_it_reads_the_project(tmp_path, options, named):
    """Called as a library, ``deploy_to_pool`` checks what argparse checks for the CLI, first: the
    folder given is no project, and the error is about the option, not the folder."""
    with pytest.raises(PipelineError, match=re.escape(named)):
        deploy_to_pool("p", tmp_path / "no-project", **options)


def test_the_flow_sends_a_waiting_round_once_and_pulls_only_one_it_sent(monkeypatch, tmp_path):
    """Around the gate (flows/retrain/rounds.py): a gate that waits for a round not yet sampled, with a
    Label Studio project, has the round sent; a sampled round, a round through files and a decision send
    nothing. Before the gate, answers are pulled only for a sampled round of a project."""
    import flows.retrain.rounds as rounds
    from rlhf_pipeline.gate import WantedRound

    sent, pulled = [], []
    monkeypatch.setattr(
        rounds,
        "send_round",
        lambda repo, c, i, p: sent.append((c, i, p)) or f"6 tasks sent to Label Studio project {p}",
    )
    monkeypatch.setattr(rounds, "pull_verdicts", lambda repo, p: pulled.append(p) or "pulled")
    wanted = {"challenger": "policy@v2.0.0", "incumbent": "policy@v1.0.0", "sampled": False, "project": 3}
    waiting = {"outcome": "policy@v2.0.0 is registered and waits", "waiting": True, "round": wanted}
    assert rounds.send_after_gate(tmp_path, waiting).endswith("6 tasks sent to Label Studio project 3")
    assert sent == [("policy@v2.0.0", "policy@v1.0.0", 3)]
    for decision in (
        dict(waiting, round=dict(wanted, sampled=True)),
        dict(waiting, round=dict(wanted, project=None)),
        {"outcome": "policy@v2.0.0 assigned prod", "decision": {"promote": True}},
    ):
        assert rounds.send_after_gate(tmp_path, decision) == decision["outcome"]
    assert len(sent) == 1

    shutil.copy(Path(__file__).resolve().parents[1] / "params.yaml", tmp_path / "params.yaml")
    path = tmp_path / "side_by_side" / "policy@v2.0.0_vs_policy@v1.0.0.json"
    for project, there, pulls in ((3, False, []), (None, True, []), (3, True, [3])):
        path.parent.mkdir(exist_ok=True)
        path.write_text("{}") if there else path.unlink(missing_ok=True)
        round_ = WantedRound("policy@v2.0.0", "policy@v1.0.0", path, project)
        monkeypatch.setattr(rounds, "waiting_round", lambda root, params, r=round_: r)
        assert rounds.pull_before_gate(tmp_path) == ({"verdicts": "pulled"} if pulls else {})
        assert pulled == pulls
    monkeypatch.setattr(rounds, "waiting_round", lambda root, params: None)
    assert rounds.pull_before_gate(tmp_path) == {}
