"""A DVC remote over SSH, for real: dvc-ssh against OpenSSH's sshd on 127.0.0.1 (a key made by the
test, the host key checked). The retrain flow pushes the tiny run there; a second clone pulls it and
finds nothing stale and every byte as recorded; a push cut mid-transfer (sshd killed with its
sessions) fails, is retried by the flow once the server is back, and leaves every object on the
remote whole; a remote that stays down ends the run with exit 5."""

from __future__ import annotations

import hashlib
import shutil
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `flows` lives at the repo root

from ssh_server import SshServer, find_or_install_sshd  # noqa: E402
from system_packages import unavailable  # noqa: E402
from test_pipeline_e2e import TINY_SOURCE, sh  # noqa: E402

from flows.retrain import retrain  # noqa: E402
from flows.retrain.dvc_project import RetrainError  # noqa: E402
from rlhf_pipeline.errors import StorageError  # noqa: E402

SSHD, WHY_NOT = find_or_install_sshd()
pytestmark = [pytest.mark.e2e]


@pytest.fixture(autouse=True)
def _service_present():
    if SSHD is None:
        unavailable(f"no OpenSSH server: {WHY_NOT}")


REMOTE = "storage"  # the DVC remote's name


@pytest.fixture(autouse=True)
def prefect_harness(prefect_server):
    """Every test here runs flows: on the process's one Prefect server (conftest.prefect_server)."""
    yield


@pytest.fixture
def sshd(tmp_path, monkeypatch):
    """The server, started; HOME is a folder whose ~/.ssh/known_hosts names it (dvc-ssh reads it)."""
    server = SshServer(SSHD, tmp_path / "sshd")
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "known_hosts").write_text(server.known_hosts_line)
    monkeypatch.setenv("HOME", str(home))
    server.start()
    yield server
    server.stop()


def remote_objects(remote: Path) -> dict[str, Path]:
    """The objects under a DVC remote's files/md5/, by hash (a .dir listing by its hash + .dir)."""
    return {p.parent.name + p.name: p for p in (remote / "files" / "md5").rglob("*") if p.is_file()}


def whole(objects: dict[str, Path]) -> list[str]:
    """The remote objects whose bytes do not hash to their name (what a cut upload would leave)."""
    return [
        name
        for name, path in objects.items()
        if not name.endswith(".tmp") and hashlib.md5(path.read_bytes()).hexdigest() != name.removesuffix(".dir")
    ]


def test_the_flow_pushes_over_ssh_retries_a_cut_push_and_a_clone_pulls_it_all(tiny_run, sshd, tmp_path, monkeypatch):
    for variable in ("GIT_AUTHOR_NAME", "GIT_AUTHOR_EMAIL", "GIT_COMMITTER_NAME", "GIT_COMMITTER_EMAIL"):
        monkeypatch.setenv(variable, "t@t" if variable.endswith("EMAIL") else "t")  # the flow commits and tags
    root = tmp_path / "project"
    shutil.copytree(tiny_run[0], root, symlinks=True)
    remote = tmp_path / "ssh-remote"
    sh(["dvc", "remote", "add", "-d", REMOTE, sshd.url(remote)], root)
    sh(["dvc", "remote", "modify", "--local", REMOTE, "keyfile", str(sshd.client_key)], root)  # not in git
    sh(["git", "commit", "-qam", "remote over ssh"], root)

    # 1. the flow pushes: nothing was stale, every output lands on the remote, whole
    report = retrain(repo=str(root), remote=REMOTE, retry_delay_seconds=0.0, lineage_target=None)
    assert report["status"] == "all stages up to date" and report["push"].startswith(f"remote '{REMOTE}': ")
    pushed = remote_objects(remote)
    assert len(pushed) > 10 and whole(pushed) == []
    assert "in sync" in sh(["dvc", "status", "-c", "-r", REMOTE], root).stdout

    # 2. a second clone pulls it: nothing stale, every byte as dvc.lock records it
    clone = tmp_path / "clone"
    sh(["git", "clone", "-q", str(root), str(clone)], tmp_path)
    shutil.copytree(root / TINY_SOURCE, clone / TINY_SOURCE)  # the base model's source, as a user has it
    sh(["dvc", "remote", "modify", "--local", REMOTE, "keyfile", str(sshd.client_key)], clone)
    sh(["dvc", "pull", "-q"], clone)
    assert "Data and pipelines are up to date" in sh(["dvc", "status"], clone).stdout
    assert "Running stage" not in sh(["dvc", "repro"], clone).stdout
    verified = sh(["rlhf", "lineage", "--verify", "."], clone).stdout
    assert verified.startswith("ok: ")

    # 3. a push cut mid-transfer: sshd and its sessions killed while an object is half uploaded, back a
    # moment later; the flow's retry sends it, and the remote holds only whole objects
    (root / "data" / "raw").mkdir(parents=True, exist_ok=True)
    (root / "data" / "raw" / "large.bin").write_bytes(hashlib.sha256(b"0").digest() * (2**27 // 32))  # 128 MiB
    sh(["dvc", "add", "-q", "data/raw/large.bin"], root)
    sh(["git", "add", "data/raw/large.bin.dvc", "data/raw/.gitignore"], root)
    sh(["git", "commit", "-qm", "a large file"], root)
    cut: list[str] = []

    def cut_mid_transfer() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            # any bytes of a temporary object: the 128 MiB upload is then under way (on a loaded
            # machine a 1 MiB threshold let the whole push finish between two looks)
            partial = [p for p in (remote / "files" / "md5").rglob("*.tmp") if p.is_file() and p.stat().st_size > 0]
            if partial:
                sshd.stop()
                cut.append(f"{partial[0].name}: {partial[0].stat().st_size} bytes")
                time.sleep(1.0)
                sshd.start()
                return
            time.sleep(0.005)

    watcher = threading.Thread(target=cut_mid_transfer)
    watcher.start()
    state = retrain(
        repo=str(root), remote=REMOTE, retries=2, retry_delay_seconds=3.0, lineage_target=None, return_state=True
    )
    watcher.join()
    assert cut, "the push ended before the watcher saw a partial upload"
    assert state.is_completed(), state.message
    assert _push_attempts(state.state_details.flow_run_id) == 2  # the cut attempt failed, the retry pushed
    after = remote_objects(remote)
    large = hashlib.md5((root / "data" / "raw" / "large.bin").read_bytes()).hexdigest()
    assert large in after and whole(after) == []
    assert "in sync" in sh(["dvc", "status", "-c", "-r", REMOTE], root).stdout

    # 4. a remote that stays down: the retries run out and the run ends with exit 5, naming the push
    sshd.stop()
    with pytest.raises(RetrainError) as failed:
        retrain(repo=str(root), remote=REMOTE, retries=1, retry_delay_seconds=0.0, lineage_target=None)
    assert failed.value.exit_code == StorageError.exit_code
    assert f"dvc push -r {REMOTE} failed" in str(failed.value) and "the next push sends the rest" in str(failed.value)


def _push_attempts(flow_run_id) -> int:
    """How many times the run's dvc-push task ran. Prefect 3 records task runs from events it sends in
    batches, so the record can trail the flow's return by a moment: ask until it is there."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, TaskRunFilter, TaskRunFilterName

    deadline = time.monotonic() + 60
    with get_client(sync_client=True) as client:
        while True:
            runs = client.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])),
                task_run_filter=TaskRunFilter(name=TaskRunFilterName(like_="dvc-push")),
            )
            attempts = max((run.run_count for run in runs if run.state and run.state.is_final()), default=0)
            if attempts or time.monotonic() > deadline:
                return attempts
            time.sleep(0.5)
