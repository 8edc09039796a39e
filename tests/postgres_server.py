"""A real PostgreSQL server on 127.0.0.1 for the Prefect tests: Debian's ``postgresql`` binaries
(found, or installed by :func:`system_packages.find_or_install`), a cluster made by ``initdb`` in a
folder of the test's, trust authentication on 127.0.0.1 only, a free port. PostgreSQL refuses to
run as root, so under root the cluster belongs to the ``postgres`` account the package creates."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from ssh_server import _free_port
from system_packages import find_or_install


def _bin_dir() -> str | None:
    """Debian keeps the server's programs in /usr/lib/postgresql/<major>/bin (newest first)."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[4]), reverse=True)
    if found:
        return str(Path(found[0]).parent)
    return str(Path(shutil.which("initdb")).parent) if shutil.which("initdb") else None


def find_or_install_postgres() -> tuple[str | None, str]:
    """(the folder of initdb, pg_ctl and postgres, '') or (None, why not)."""
    if _bin_dir() is None:
        _, why = find_or_install(("initdb",), "postgresql")
        if _bin_dir() is None:
            return None, why or "postgresql installed, but no initdb under /usr/lib/postgresql/*/bin"
    if os.geteuid() == 0 and shutil.which("runuser") is None:
        return None, "running as root, and no `runuser` to start PostgreSQL as the postgres account"
    return _bin_dir(), ""


class PostgresServer:
    """A throwaway cluster; :meth:`url` is an SQLAlchemy asyncpg URL of one of its databases."""

    def __init__(self, bin_dir: str):
        self.bin_dir = Path(bin_dir)
        # not under pytest's tmp_path: the postgres account must be able to reach the folder
        self.folder = Path(tempfile.mkdtemp(prefix="rlhf-postgres-"))
        self.data = self.folder / "data"
        self.port = _free_port()
        self.as_owner: list[str] = []
        if os.geteuid() == 0:
            shutil.chown(self.folder, "postgres", "postgres")
            self.as_owner = ["runuser", "-u", "postgres", "--"]

    def _run(self, *command: str) -> subprocess.CompletedProcess:
        result = subprocess.run([*self.as_owner, *command], capture_output=True, text=True, timeout=120)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed: {(result.stderr or result.stdout)[-1500:]}")
        return result

    def start(self) -> None:
        self._run(str(self.bin_dir / "initdb"), "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8")
        options = f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.folder}"
        self._run(
            str(self.bin_dir / "pg_ctl"),
            "-D",
            str(self.data),
            "-o",
            options,
            "-l",
            str(self.folder / "log"),
            "-w",
            "start",
        )

    def create_database(self, name: str) -> None:
        psql = shutil.which("psql") or str(self.bin_dir / "psql")
        self._run(psql, "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", "-c", f"CREATE DATABASE {name}")

    def url(self, database: str) -> str:
        return f"postgresql+asyncpg://postgres@127.0.0.1:{self.port}/{database}"

    def stop(self) -> None:
        if self.data.exists():
            subprocess.run(
                [*self.as_owner, str(self.bin_dir / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "stop"],
                capture_output=True,
            )
        shutil.rmtree(self.folder, ignore_errors=True)
