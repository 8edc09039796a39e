"""A real OpenSSH server on 127.0.0.1 for the DVC-over-SSH tests: its own host key, a client key
made here and the only one it accepts, a free port, and a known_hosts line naming it (so the client
checks the host key, as a user's would). Debian's ``openssh-server``: found or installed by
:func:`system_packages.find_or_install`."""

from __future__ import annotations

import getpass
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import psutil
from system_packages import find_or_install

SSHD_NAMES = ("/usr/sbin/sshd", "sshd")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class SshServer:
    """``sshd -D`` with a configuration in ``folder``; ``url(path)`` is a DVC remote URL on it."""

    def __init__(self, executable: str, folder: Path):
        self.executable, self.folder = executable, folder
        folder.mkdir(parents=True, exist_ok=True)
        self.port = _free_port()
        for key in ("host_key", "client_key"):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(folder / key)], check=True)
        shutil.copy(folder / "client_key.pub", folder / "authorized_keys")
        self.client_key = folder / "client_key"
        settings = {
            "Port": self.port,
            "ListenAddress": "127.0.0.1",
            "HostKey": folder / "host_key",
            "AuthorizedKeysFile": folder / "authorized_keys",
            "PubkeyAuthentication": "yes",
            "PasswordAuthentication": "no",
            "KbdInteractiveAuthentication": "no",
            "PermitRootLogin": "prohibit-password",
            "StrictModes": "no",  # the test's temporary folders are not owned the way sshd wants a home
            "UsePAM": "no",
            "PidFile": folder / "sshd.pid",
            "Subsystem": "sftp internal-sftp",
        }
        (folder / "sshd_config").write_text("".join(f"{k} {v}\n" for k, v in settings.items()))
        algorithm, key = (folder / "host_key.pub").read_text().split()[:2]
        self.known_hosts_line = f"[127.0.0.1]:{self.port} {algorithm} {key}\n"
        self.process: subprocess.Popen | None = None

    def url(self, path: Path) -> str:
        return f"ssh://{getpass.getuser()}@127.0.0.1:{self.port}{path}"

    def start(self) -> None:
        if os.geteuid() == 0:
            Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation folder (the service makes it)
        log = open(self.folder / "sshd.log", "a")  # noqa: SIM115 - sshd writes to it until stopped
        self.process = subprocess.Popen(
            [self.executable, "-D", "-e", "-f", str(self.folder / "sshd_config")], stderr=log
        )
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                break
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"sshd did not start: {(self.folder / 'sshd.log').read_text()[-500:]}")

    def stop(self) -> None:
        """The listener and every session it forked, killed at once: a transfer in flight is cut."""
        if self.process is None:
            return
        listener = psutil.Process(self.process.pid)
        for process in [listener, *listener.children(recursive=True)]:
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass
        self.process.wait()
        self.process = None


def find_or_install_sshd() -> tuple[str | None, str]:
    return find_or_install(SSHD_NAMES, "openssh-server")
