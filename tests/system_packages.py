"""Debian packages the tests drive for real (Chromium, OpenSSH's server): found, or installed with
apt-get where the suite may (root, apt-get present), as CI does; otherwise the reason they are not."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path


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
    for step in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", package]):
        proc = subprocess.run(
            step, capture_output=True, text=True, env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        )
        if proc.returncode != 0:
            return None, f"`{' '.join(step)}` failed: {(proc.stderr or proc.stdout).strip()[-300:]}"
    return (found(), "") if found() else (None, f"apt-get installed {package} but {names[0]} is not there")
