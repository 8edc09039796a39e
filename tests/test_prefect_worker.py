"""The retrain flow as production runs it: a Prefect server on PostgreSQL (Debian's ``postgresql``, a
cluster and database made here), the ``retrain-schedule`` deployment on a process work pool
(``python -m flows.retrain deploy``), and ``prefect worker start`` processes started apart from it.

The project is a copy of the tiny pipeline's finished run with ``train_policy`` and ``evaluate``
taken out of ``dvc.lock`` (and DVC's run cache emptied), so a retrain reruns both for real and, the
outputs being the same bytes for the same inputs, must end on the finished run's ``dvc.lock``.
Checked: a worker picks up a scheduled run and ends there; with two workers and two runs the
deployment's concurrency limit makes one wait; a worker killed with its run mid-stage (kill -9, as a
machine that goes down) leaves a run that the deployment's automations mark Crashed and schedule
again, another worker reruns it, and it ends on the same ``dvc.lock``."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from uuid import UUID

import psutil
import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `flows` lives at the repo root

from postgres_server import PostgresServer, find_or_install_postgres  # noqa: E402
from ssh_server import _free_port  # noqa: E402
from system_packages import unavailable  # noqa: E402

POSTGRES, WHY_NOT = find_or_install_postgres()
pytestmark = [pytest.mark.e2e]


@pytest.fixture(autouse=True)
def _service_present():
    if POSTGRES is None:
        unavailable(f"no PostgreSQL: {WHY_NOT}")


POOL = "rlhf-pool"
RERUN = ("train_policy", "evaluate")  # the stages each retrain here reruns
HEARTBEAT_SECONDS = 30  # Prefect's minimum
MISSED_HEARTBEATS = 2  # the fewest deploy takes (3 unless told)
SILENT_SECONDS = MISSED_HEARTBEATS * HEARTBEAT_SECONDS  # a run silent this long is taken for dead


class Prefect:
    """A Prefect server on a PostgreSQL database, and what the tests start against it."""

    def __init__(self, folder: Path, database_url: str):
        self.folder, self.port = folder, _free_port()
        self.api = f"http://127.0.0.1:{self.port}/api"
        self.env = {
            **os.environ,
            "PREFECT_HOME": str(folder / "home"),
            "PREFECT_API_URL": self.api,
            "PREFECT_API_DATABASE_CONNECTION_URL": database_url,
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_UI_ENABLED": "false",
            "PREFECT_WORKER_QUERY_SECONDS": "2",  # a worker looks for runs every 2 s (default 10)
        }
        self.processes: list[subprocess.Popen] = []

    def start(self, *args: str, log: str) -> subprocess.Popen:
        process = subprocess.Popen(
            [sys.executable, "-m", *args],
            env=self.env,
            stdout=(self.folder / log).open("w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.processes.append(process)
        return process

    def worker(self, name: str) -> subprocess.Popen:
        return self.start("prefect", "worker", "start", "--pool", POOL, "--name", name, log=f"worker-{name}.log")

    def run(self, *args: str) -> str:
        result = subprocess.run(
            [sys.executable, "-m", *args], env=self.env, capture_output=True, text=True, timeout=300
        )
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
        return result.stdout

    @contextmanager
    def client(self):
        """A synchronous Prefect client of this server (the test process's own settings aside)."""
        from prefect.client.orchestration import get_client
        from prefect.settings import PREFECT_API_URL, temporary_settings

        with temporary_settings(updates={PREFECT_API_URL: self.api}), get_client(sync_client=True) as client:
            yield client

    def trigger(self, deployment_id: str) -> UUID:
        """A flow run of the deployment, in state Scheduled (for now): what the cron would make."""
        with self.client() as client:
            return client.create_flow_run_from_deployment(UUID(deployment_id)).id

    def states(self, run: UUID) -> list:
        with self.client() as client:
            return client.read_flow_run_states(run)

    def wait_final(self, run: UUID, timeout: float) -> object:
        deadline = time.time() + timeout
        with self.client() as client:
            while time.time() < deadline:
                flow_run = client.read_flow_run(run)
                if flow_run.state.is_final() and flow_run.state.name != "Crashed":  # Crashed: about to be retried
                    return flow_run
                time.sleep(1)
        raise AssertionError(f"flow run {run} did not end within {timeout} s: {[s.name for s in self.states(run)]}")

    def stop(self) -> None:
        for process in reversed(self.processes):
            with_children = (
                [process.pid, *(c.pid for c in psutil.Process(process.pid).children(recursive=True))]
                if process.poll() is None
                else []
            )
            for pid in with_children:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


@pytest.fixture(scope="module")
def prefect(tmp_path_factory):
    postgres = PostgresServer(POSTGRES)
    postgres.start()
    try:
        postgres.create_database("prefect")
        server = Prefect(tmp_path_factory.mktemp("prefect"), postgres.url("prefect"))
        server.start("prefect", "server", "start", "--host", "127.0.0.1", "--port", str(server.port), log="server.log")
        deadline = time.time() + 180
        while subprocess.run(["curl", "-sf", f"{server.api}/health"], capture_output=True).returncode != 0:
            assert time.time() < deadline, (server.folder / "server.log").read_text()[-3000:]
            time.sleep(0.5)
        try:
            yield server
        finally:
            server.stop()
    finally:
        postgres.stop()


def stale_copy(tiny_run, folder: Path) -> Path:
    """The finished tiny run, copied, with RERUN taken out of dvc.lock and DVC's run cache emptied."""
    root = folder / "project"
    shutil.copytree(tiny_run[0], root, symlinks=True)
    shutil.rmtree(root / ".dvc" / "cache" / "runs", ignore_errors=True)
    lock = yaml.safe_load((root / "dvc.lock").read_text())
    for stage in RERUN:
        del lock["stages"][stage]
    (root / "dvc.lock").write_text(yaml.safe_dump(lock, sort_keys=False))
    return root


def deploy(prefect: Prefect, project: Path) -> str:
    crash_window = ["--heartbeat-seconds", str(HEARTBEAT_SECONDS), "--missed-heartbeats", str(MISSED_HEARTBEATS)]
    out = prefect.run("flows.retrain", "deploy", "--repo", str(project), "--pool", POOL, *crash_window)
    return out.split("(")[1].split(")")[0]  # "deployment retrain/retrain-schedule (<id>) on work pool ..."


def assert_same_lock(project: Path, tiny_run) -> None:
    finished = yaml.safe_load((tiny_run[0] / "dvc.lock").read_text())
    assert yaml.safe_load((project / "dvc.lock").read_text()) == finished


def test_a_worker_runs_the_scheduled_deployment_and_the_limit_queues_a_second_run(prefect, tiny_run, tmp_path):
    project = stale_copy(tiny_run, tmp_path)
    deployment = deploy(prefect, project)
    with prefect.client() as client:  # the cron of params.yaml is on the server: its next runs are scheduled
        upcoming = client.read_deployment(UUID(deployment))
        assert upcoming.schedules and upcoming.schedules[0].schedule.cron == "0 3 * * 1"
    first, second = prefect.trigger(deployment), prefect.trigger(deployment)
    workers = [prefect.worker("a"), prefect.worker("b")]
    try:
        runs = [prefect.wait_final(run, 600) for run in (first, second)]
    finally:
        for worker in workers:  # the next test's runs must go to its own workers
            worker.kill()
            worker.wait()
    assert [run.state.name for run in runs] == ["Completed", "Completed"], [run.state.message for run in runs]
    # one ran at a time: the later to start waited for the slot the other held until it ended
    spans = sorted((run.start_time, run.end_time) for run in runs)
    assert spans[0][1] <= spans[1][0], spans
    waited = [s.name for run in (first, second) for s in prefect.states(run)]
    assert "AwaitingConcurrencySlot" in waited
    assert_same_lock(project, tiny_run)


def run_processes(run: UUID) -> list[psutil.Process]:
    """The processes of flow run ``run``: Prefect's engine and what it started (they carry its id)."""
    tag = f"PREFECT__FLOW_RUN_ID={run}".encode()
    found = []
    for process in psutil.process_iter():
        try:
            if tag in Path(f"/proc/{process.pid}/environ").read_bytes():
                found.append(process)
        except OSError:
            continue
    return found


def test_a_run_killed_with_its_worker_mid_stage_is_retried_and_ends_on_the_same_lock(prefect, tiny_run, tmp_path):
    project = stale_copy(tiny_run, tmp_path)
    deployment = deploy(prefect, project)
    doomed = prefect.worker("doomed")
    run = prefect.trigger(deployment)
    deadline = time.time() + 300
    while not any("stages/train_policy.py" in " ".join(p.cmdline()) for p in run_processes(run)):
        assert time.time() < deadline and doomed.poll() is None, "train_policy never started"
        time.sleep(0.2)
    # the machine goes down: the worker and the run's processes (the engine runs in a session of its
    # own and would outlive a worker killed alone), all with SIGKILL
    for process in [psutil.Process(doomed.pid), *run_processes(run)]:
        process.kill()
    killed = time.time()
    assert not (project / "dvc.lock").read_text().count("train_policy:")  # it died before DVC recorded it
    prefect.worker("survivor")
    flow_run = prefect.wait_final(run, 600)
    states = [(s.name, s.message or "") for s in prefect.states(run)]
    assert flow_run.state.name == "Completed", states
    crashed = [message for name, message in states if name == "Crashed"]
    assert crashed == [f"no heartbeat for {SILENT_SECONDS} s: its process or machine died"], states
    assert "AwaitingRetry" in [name for name, _ in states] and flow_run.run_count == 2
    assert time.time() - killed >= SILENT_SECONDS
    assert_same_lock(project, tiny_run)


def test_deploying_twice_makes_one_deployment_and_one_of_each_automation(prefect, tiny_run, tmp_path):
    """A redeploy replaces, never adds; a project whose params.yaml is invalid is refused (exit 2)
    before anything reaches the server."""
    project = stale_copy(tiny_run, tmp_path)
    first, second = deploy(prefect, project), deploy(prefect, project)
    assert first == second
    with prefect.client() as client:
        deployments = [d for d in client.read_deployments() if d.name == "retrain-schedule"]
        automations = [a.name for a in client.read_automations()]
        recorded = client.read_deployment(UUID(first)).parameters["code_commit"]
    assert len(deployments) == 1
    assert sorted(automations) == ["retrain-schedule: crashed when silent", "retrain-schedule: retry when crashed"]
    assert (
        recorded
        and recorded.split("+")[0]
        == subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=Path(__file__).parents[1], capture_output=True, text=True
        ).stdout.strip()
    )

    params = yaml.safe_load((project / "params.yaml").read_text())
    params["ppo"]["lora"] = {"rank": 4, "target_modules": []}
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    result = subprocess.run(
        [sys.executable, "-m", "flows.retrain", "deploy", "--repo", str(project), "--pool", "a-new-pool"],
        env=prefect.env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2 and "ppo.lora.target_modules" in result.stderr, result.stderr[-2000:]
    with prefect.client() as client:
        assert "a-new-pool" not in [pool.name for pool in client.read_work_pools()]  # refused before the pool
        assert client.read_deployment(UUID(first)).updated == deployments[0].updated


def test_a_run_whose_code_is_at_another_commit_than_deployed_is_refused(prefect, tiny_run, tmp_path):
    """A worker loads the flow from the deployed checkout's folder: if that checkout moved on (or is
    another machine's, at another commit), the run fails at once naming both commits (no retry)."""
    project = stale_copy(tiny_run, tmp_path)
    deployment = deploy(prefect, project)
    elsewhere = "0123456789abcdef0123456789abcdef01234567"
    lock_before = (project / "dvc.lock").read_text()
    with prefect.client() as client:
        run = client.create_flow_run_from_deployment(UUID(deployment), parameters={"code_commit": elsewhere}).id
    worker = prefect.worker("checkout-b")
    try:
        flow_run = prefect.wait_final(run, 300)
    finally:
        worker.kill()
        worker.wait()
    message = " ".join(s.message or "" for s in prefect.states(run))
    assert flow_run.state.name == "Failed" and flow_run.run_count == 1, message
    assert f"the deployment was made from commit {elsewhere}" in message and "this run's code is at commit" in message
    assert (project / "dvc.lock").read_text() == lock_before  # refused before any stage
