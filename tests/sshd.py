"""A real OpenSSH server on 127.0.0.1 for the tests: own host key, own client key, no systemd."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def keygen(path: Path, comment: str) -> None:
    if not path.exists():
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
                       check=True)


class SSHServer:
    """sshd -D on a free loopback port; `stop()` and `start()` again keep port and keys."""

    def __init__(self, base: Path, path_prepend: str = "", env: dict | None = None) -> None:
        self.base = base
        base.mkdir(parents=True, exist_ok=True)
        os.chmod(base, 0o755)
        self.port = free_port()
        self.host_key = base / "host_ed25519"
        self.client_key = base / "client_ed25519"
        keygen(self.host_key, "test-host")
        keygen(self.client_key, "test-client")
        shutil.copy(f"{self.client_key}.pub", base / "authorized_keys")
        os.chmod(base / "authorized_keys", 0o600)
        self.known_hosts = base / "known_hosts"
        self.write_known_hosts(self.host_key)
        self.config = base / "sshd_config"
        lines = [f"Port {self.port}", "ListenAddress 127.0.0.1", f"HostKey {self.host_key}",
                 f"PidFile {base / 'sshd.pid'}", f"AuthorizedKeysFile {base / 'authorized_keys'}",
                 "PubkeyAuthentication yes", "PasswordAuthentication no", "KbdInteractiveAuthentication no",
                 "PermitRootLogin prohibit-password", "UsePAM no", "StrictModes no", "X11Forwarding no",
                 "PrintMotd no", "AllowTcpForwarding yes", "Subsystem sftp internal-sftp",
                 "MaxSessions 20", "LogLevel VERBOSE"]
        settings = dict(env or {})
        if path_prepend:
            settings["PATH"] = f"{path_prepend}:/usr/local/bin:/usr/bin:/bin"
        if settings:
            lines.append("SetEnv " + " ".join(f"{k}={v}" for k, v in settings.items()))
        self.config.write_text("\n".join(lines) + "\n")
        self.log = base / "sshd.log"
        self.process: subprocess.Popen | None = None

    def write_known_hosts(self, key: Path) -> None:
        public = " ".join(Path(f"{key}.pub").read_text().split()[:2])
        self.known_hosts.write_text(f"[127.0.0.1]:{self.port} {public}\n")

    def start(self) -> "SSHServer":
        Path("/run/sshd").mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen([SSHD, "-D", "-f", str(self.config), "-E", str(self.log)],
                                        start_new_session=True)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return self
            except OSError:
                if self.process.poll() is not None:
                    raise RuntimeError(f"sshd exited: {self.log.read_text()[-2000:]}")
                time.sleep(0.02)
        raise RuntimeError("sshd did not listen within 10 s")

    def sessions(self) -> list[int]:
        """The per-connection sshd processes (the listener's children; each calls setsid())."""
        found = []
        for entry in os.listdir("/proc") if self.process else ():
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as f:
                        fields = f.read().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                if int(fields[1]) == self.process.pid:
                    found.append(int(entry))
        return found

    def stop(self) -> None:
        """Stop the listener and end every connection it serves, as a crashed server would."""
        if self.process and self.process.poll() is None:
            sessions = self.sessions()
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=10)
            for pid in sessions:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.process = None

    def kill(self) -> None:
        """SIGKILL the listener and every live session at once, as a crash or an OOM kill would."""
        if self.process and self.process.poll() is None:
            for pid in [self.process.pid, *self.sessions()]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self.process.wait(timeout=10)
        self.process = None

    def freeze(self, listener: bool = True) -> list[int]:
        """SIGSTOP the live sessions (and the listener): the link goes silent, nothing closes; the pids."""
        pids = self.sessions() + ([self.process.pid] if listener and self.process else [])
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        return pids

    def thaw(self, pids: list[int]) -> None:
        """SIGCONT what `freeze` stopped (gone ones skipped)."""
        for pid in pids:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass

    def backend_config(self, remote_dir: Path, **extra) -> dict:
        """The keys of a `type: ssh` backend that reaches this server."""
        import sys

        config = {"type": "ssh", "host": "127.0.0.1", "port": self.port, "user": "root",
                  "identity_file": str(self.client_key), "known_hosts": str(self.known_hosts),
                  "python": sys.executable, "remote_dir": str(remote_dir), "gpus": "none",
                  "connect_timeout_s": 5, "reuse_connection_s": 0}  # a test counts its own connections
        config.update(extra)
        return config
