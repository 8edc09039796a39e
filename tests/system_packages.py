"""Debian packages the tests drive for real (Chromium, OpenSSH's server, PostgreSQL): found, or
installed with apt-get where the suite may (root, apt-get present), as CI does; otherwise the reason
they are not. Under CI (``.ci/run`` sets ``RLHF_CI``) a test whose service cannot be had fails,
naming it; elsewhere it is skipped with the reason (:func:`unavailable`)."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

CI_VARIABLE = "RLHF_CI"
# one install at a time across the suite's processes: every xdist worker collects every module, and
# two apt-gets at once fight over dpkg's lock (the loser used to skip its tests)
INSTALL_LOCK = Path(tempfile.gettempdir()) / "rlhf-tests-apt.lock"
APT_LOCK_WAIT_S = 600  # and wait for an apt of someone else's (unattended-upgrades) instead of failing


def unavailable(why: str) -> None:
    """Skip the calling test with ``why``; under CI fail it instead: CI must run every test."""
    if os.environ.get(CI_VARIABLE):
        pytest.fail(f"{CI_VARIABLE} is set (CI runs every test) and this test's service cannot be had: {why}")
    pytest.skip(why)


def find_or_install(names: tuple[str, ...], package: str) -> tuple[str | None, str]:
    """(the path of the first of ``names`` found, '') or (None, why it could not be had); a name may be
    an absolute path (``/usr/sbin/sshd`` is not on every PATH). Installs ``package`` when none is found."""

    def found() -> str | None:
        for name in names:
            if Path(name).is_absolute():
                if os.access(name, os.X_OK):
                    return name
            elif shutil.which(name):
                return shutil.which(name)
        return None

    if found():
        return found(), ""
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        return None, f"{package} is not installed and cannot be installed here (needs root and apt-get)"
    wait = ["-o", f"DPkg::Lock::Timeout={APT_LOCK_WAIT_S}"]
    with open(INSTALL_LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if found():  # another process installed it while this one waited
            return found(), ""
        for step in (["apt-get", *wait, "update", "-qq"], ["apt-get", *wait, "install", "-y", "-qq", package]):
            proc = subprocess.run(
                step, capture_output=True, text=True, env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
            )
            if proc.returncode != 0:
                return None, f"`{' '.join(step)}` failed: {(proc.stderr or proc.stdout).strip()[-300:]}"
    return (found(), "") if found() else (None, f"apt-get installed {package} but {names[0]} is not there")
