"""The suite's own services: installed one process at a time, and under CI never skipped."""

from __future__ import annotations

import subprocess
import threading
import time

import pytest
import system_packages
from system_packages import CI_VARIABLE, find_or_install, unavailable


def test_a_missing_service_skips_here_and_fails_under_ci(monkeypatch):
    monkeypatch.delenv(CI_VARIABLE, raising=False)
    with pytest.raises(pytest.skip.Exception, match="no sshd"):
        unavailable("no sshd")
    monkeypatch.setenv(CI_VARIABLE, "1")
    with pytest.raises(pytest.fail.Exception, match="RLHF_CI is set .* cannot be had: no sshd"):
        unavailable("no sshd")


def test_two_processes_needing_one_package_install_it_once_one_after_the_other(monkeypatch, tmp_path):
    """Each xdist worker collects every module: two installs at once used to fight over dpkg's lock.
    Two threads (each opens the lock file itself, as two processes would) ask for the same package."""
    installed, running, calls, overlaps = [], [], [], []

    def which(name):
        if name == "apt-get":
            return "/usr/bin/apt-get"
        return "/usr/bin/fake-sshd" if installed else None

    def run(step, **_):
        if running:
            overlaps.append(step)
        running.append(step)
        calls.append(step)
        time.sleep(0.2)  # long enough for the other thread to arrive while this one holds the lock
        if "install" in step:
            installed.append(step)
        running.remove(step)
        return subprocess.CompletedProcess(step, 0, "", "")

    monkeypatch.setattr(system_packages.shutil, "which", which)
    monkeypatch.setattr(system_packages.subprocess, "run", run)
    monkeypatch.setattr(system_packages.os, "geteuid", lambda: 0)
    monkeypatch.setattr(system_packages, "INSTALL_LOCK", tmp_path / "apt.lock")
    results = []
    threads = [
        threading.Thread(target=lambda: results.append(find_or_install(("fake-sshd",), "fake-server")))
        for _ in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [("/usr/bin/fake-sshd", "")] * 2
    assert overlaps == []
    assert sum("install" in step for step in calls) == 1  # the second found it installed
    assert all("DPkg::Lock::Timeout=600" in step for step in calls)  # and apt waits for dpkg's lock
