"""The ssh transport: OpenSSH for the serve channel and single commands, asyncssh (sshfs) for SFTP.

One asyncssh connection (through sshfs's SSHFileSystem) per process serves the files. Host keys
are always verified (sshfs turns that off unless told), nothing can prompt, and every far-side
command is shell-quoted. The ssh and slurm backends both ride it, each with its own policy.
"""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from tether.backends.base import Shared
from tether.backends.transport import COMMAND_TIMEOUT_S, Transport
from tether.errors import BackendError, RemoteCommandError
from tether.remote import owner
from tether.remote.fileio import atomic_write_json, read_json

if TYPE_CHECKING:
    from tether.backends.farside import FarSide

SAFE_DIR = re.compile(r"^(~/)?[A-Za-z0-9._/-]+$")
# AES-GCM first: asyncssh moves 1 GiB over loopback in 4.3 s with it against 5.7 s with its
# default chacha20-poly1305 (AES-NI); the others stay for servers that lack it.
CIPHERS = ["aes128-gcm@openssh.com", "aes256-gcm@openssh.com", "chacha20-poly1305@openssh.com",
           "aes128-ctr", "aes192-ctr", "aes256-ctr"]
ALIVE_PROBES = 4  # keepalive probes in alive_timeout_s (OpenSSH's ServerAliveCountMax, asyncssh's count_max)


def alive_interval_s(cfg: "Connection") -> int:
    """Seconds between keepalive probes: ALIVE_PROBES unanswered ones end the link (whole seconds: OpenSSH's unit)."""
    return max(1, round(cfg.alive_timeout_s / ALIVE_PROBES))


@dataclass(frozen=True, kw_only=True)
class Connection(Shared):
    """The keys every backend reached over ssh takes (the ssh and slurm types), on top of the shared ones."""

    host: str
    type: str = "ssh"
    user: Optional[str] = None
    port: Optional[int] = None
    identity_file: Optional[str] = None
    python: str = "python3"
    remote_dir: str = "~/.cache/tether"
    connect_timeout_s: float = 10.0
    keep_remote: bool = False
    fetch_artifacts: bool = True
    ssh_config: Optional[str] = None
    known_hosts: Optional[str] = None
    stall_timeout_s: Optional[float] = 60.0  # a transfer that moves no byte this long is ended (null: never)
    reuse_connection_s: float = 300.0  # OpenSSH keeps the connection this long for the next command (0: never)
    alive_timeout_s: float = 60.0  # a link that answers no keepalive this long is dropped (4 probes in it)

    def problems(self) -> list[str]:
        found = super().problems()
        if self.keep_remote and self.teardown_command:
            found.append("teardown_command contradicts keep_remote: true: down would keep the run dir, then "
                         "terminate the box (and its disk) anyway; remove one of the two")
        if not self.host.strip() or self.host.startswith("-") or any(c.isspace() for c in self.host):
            found.append(f"host {self.host!r} is not a host name: give one that `ssh HOST true` reaches")
        why = owner.unsafe(self.remote_dir if self.remote_dir.startswith(("/", "~")) else "~/" + self.remote_dir)
        if why:  # a relative remote_dir is under the far side's home; normalised first: `//`, `~/.`
            found.append(f"remote_dir {self.remote_dir!r} is {why}{owner.FIX}a folder of its own, such as "
                         f"~/.cache/tether")
        elif not SAFE_DIR.fullmatch(self.remote_dir) or ".." in self.remote_dir.split("/"):
            found.append(f"remote_dir {self.remote_dir!r}: use letters, digits and ._-/ (a leading ~/ "
                         f"is the far side's home), without '..'")
        if not ALIVE_PROBES <= self.alive_timeout_s <= 3600:
            found.append(f"alive_timeout_s {self.alive_timeout_s:g} is outside {ALIVE_PROBES}-3600: give the seconds "
                         f"a silent link may last before it is dropped (OpenSSH probes it {ALIVE_PROBES} times, "
                         f"at most once a second); 60 by default")
        if not re.fullmatch(r"[A-Za-z0-9._/+-]+", self.python):
            found.append(f"python {self.python!r}: give an interpreter name or path (no spaces or quotes)")
        return found

    def fetch_policy(self, path: str, size: int) -> str:
        """'' to fetch a manifest file, else why it stays on the far side (fetch_artifacts, max_artifact_mb)."""
        from tether.pipelines.transfer import size_policy

        if path.startswith("artifacts/") and not self.fetch_artifacts:
            return "fetch_artifacts is false"
        return size_policy(path, size, self.max_artifact_mb)


class SSHTransport(Transport):
    """A far side reached over ssh: the serve channel through OpenSSH (SFTP only for filesystem())."""

    opens_early = True  # the handshake takes a while: start it while this side still decides

    def __init__(self, config: Connection, state_dir: str) -> None:
        self.config, self.state_dir = config, state_dir
        self._fs: Any = None
        self._pid = os.getpid()  # a connection belongs to the process that opened it
        self._remote_dir: Optional[str] = None

    # ------------------------------------------------------------ the serve channel (OpenSSH)

    @property
    def where(self) -> str:  # type: ignore[override]
        return f"{self.config.user + '@' if self.config.user else ''}{self.config.host}"

    @property
    def open_timeout_s(self) -> float:  # type: ignore[override]
        return self.config.connect_timeout_s + 120

    @property
    def stall_timeout_s(self) -> Optional[float]:  # type: ignore[override]
        return self.config.stall_timeout_s

    @property
    def python(self) -> str:
        return self.config.python

    def serve_argv(self, script: str, version: str) -> list[str]:
        """`ssh HOST python -c SCRIPT REMOTE_DIR VERSION`: one connection, one Python, every request."""
        words = [self.python, "-c", script, self.config.remote_dir, version]
        return ssh_argv(self.config) + [" ".join(shlex.quote(w) for w in words)]

    def explain_lost(self, err: Any) -> BackendError:
        return ssh_refusal(self.config, err.stderr, err.code, self.python)

    def missing_program_hint(self, program: str) -> str:
        return "install OpenSSH's client (the ssh command), which tether runs to reach the far side"

    def execute(self, argv: list[str], stdin: bytes = b"") -> bytes:
        """Run one command over its own ssh connection (building a venv); its stdout."""
        command = " ".join(shlex.quote(a) for a in argv)
        if os.environ.get("TETHER_TRACE"):
            print(f"[ssh {self.config.host}] {command}", file=sys.stderr)
        try:
            done = subprocess.run(ssh_argv(self.config) + [command], input=stdin, capture_output=True,
                                  timeout=COMMAND_TIMEOUT_S)
        except FileNotFoundError:
            raise BackendError("ssh: not found: " + self.missing_program_hint("ssh")) from None
        if done.returncode == 255:
            raise ssh_refusal(self.config, done.stderr.decode(errors="replace"), 255, argv[0])
        if done.returncode != 0:
            raise RemoteCommandError(argv, done.returncode, done.stderr.decode(errors="replace"))
        return done.stdout

    def root(self, far: "FarSide") -> str:
        """remote_dir made absolute on the far side (the serve process says where), once per machine."""
        if self._remote_dir is None:
            wanted = self.config.remote_dir
            cache = os.path.join(self.state_dir, "remote-dirs.json")
            key = f"{self.config.user}@{self.config.host}:{self.config.port}:{wanted}"
            known = read_json(cache) or {}
            if wanted.startswith("/"):
                self._remote_dir = wanted
            elif key in known:
                self._remote_dir = known[key]
            else:
                self._remote_dir = far.root()  # the bootstrap made it (mode 0700) and resolved it
                atomic_write_json(cache, dict(known, **{key: self._remote_dir}))
        return self._remote_dir

    # ------------------------------------------------------------ the SFTP filesystem (asyncssh)

    def _connect_args(self) -> dict:
        cfg = self.config
        args: dict = {"known_hosts": os.path.expanduser(cfg.known_hosts) if cfg.known_hosts else (),
                      "connect_timeout": cfg.connect_timeout_s, "login_timeout": cfg.connect_timeout_s,
                      "skip_instance_cache": True, "timeout": cfg.connect_timeout_s + 5,
                      "keepalive_interval": alive_interval_s(cfg), "keepalive_count_max": ALIVE_PROBES, "encryption_algs": CIPHERS}
        if cfg.ssh_config:
            args["config"] = [os.path.expanduser(cfg.ssh_config)]
        if cfg.user:
            args["username"] = cfg.user
        if cfg.port:
            args["port"] = cfg.port
        if cfg.identity_file:
            args["client_keys"] = [os.path.expanduser(cfg.identity_file)]
        return args

    def connect(self) -> Any:
        """The SSHFileSystem, connected once per process (again after `reconnect`): a worker of
        `doit -n N -P process` opens its own, as a forked child cannot use its parent's."""
        if self._pid != os.getpid():
            self._fs, self._pid = None, os.getpid()
        if self._fs is None:
            from sshfs import SSHFileSystem

            started = time.monotonic()
            try:
                self._fs = SSHFileSystem(self.config.host, **self._connect_args())
            except Exception as err:  # asyncssh and OS errors alike: translated here, once
                raise explain(err, self.config, time.monotonic() - started) from err
        return self._fs

    def reconnect(self) -> None:
        self._fs = None

    def filesystem(self, remote_dir: str) -> Any:
        from fsspec.implementations.dirfs import DirFileSystem

        return DirFileSystem(path=remote_dir, fs=self.connect())

    def is_transport_error(self, err: BaseException) -> bool:
        kinds: tuple = (BackendError, ConnectionError, TimeoutError, EOFError)
        if "asyncssh" in sys.modules:  # only an SFTP call can raise its errors
            kinds += (sys.modules["asyncssh"].Error,)
        return isinstance(err, kinds)


def _ssh_words(cfg: Connection) -> list[str]:
    """OpenSSH's options as tether connects: host keys verified, never a prompt, this config's files."""
    words = ["ssh", "-o", "BatchMode=yes"]  # BatchMode: fail where a prompt would hang tether
    if cfg.ssh_config:
        words += ["-F", cfg.ssh_config]
    if cfg.known_hosts:
        words += ["-o", f"UserKnownHostsFile={cfg.known_hosts}"]
    if cfg.port:
        words += ["-p", str(cfg.port)]
    if cfg.identity_file:
        words += ["-i", cfg.identity_file]
    return words


def ssh_argv(cfg: Connection) -> list[str]:
    """The ssh command line of the serve channel (the command to run follows it)."""
    words = _ssh_words(cfg) + ["-T", "-o", f"ConnectTimeout={max(1, round(cfg.connect_timeout_s))}",
                               "-o", f"ServerAliveInterval={alive_interval_s(cfg)}",
                               "-o", f"ServerAliveCountMax={ALIVE_PROBES}"]
    if cfg.reuse_connection_s > 0:  # the next invocation skips the handshake (as SkyPilot and Ansible do)
        words += ["-o", "ControlMaster=auto", "-o", f"ControlPath={control_dir()}/{_settings_key(cfg)}-%C",
                  "-o", f"ControlPersist={max(1, round(cfg.reuse_connection_s))}"]
    words = [os.path.expanduser(w) if w.startswith("~/") else w for w in words]
    return words + [f"{cfg.user}@{cfg.host}" if cfg.user else cfg.host]


def _settings_key(cfg: Connection) -> str:
    """What else picks the connection (%C covers host, port and user): another key, known_hosts file
    or ssh config gets a connection of its own, never one made and checked with other settings."""
    words = [cfg.identity_file or "", cfg.known_hosts or "", cfg.ssh_config or "", str(alive_interval_s(cfg))]
    return hashlib.sha256("\0".join(words).encode()).hexdigest()[:12]


def control_dir() -> str:
    """Where OpenSSH keeps tether's shared connections: a private folder, short enough for a socket path."""
    folder = os.path.join(tempfile.gettempdir(), f"tether-ssh-{os.getuid()}")
    os.makedirs(folder, mode=0o700, exist_ok=True)
    return folder


def ssh_command(cfg: Connection) -> str:
    """The OpenSSH command that connects as tether does (the same host, port, user, key and files)."""
    words = _ssh_words(cfg) + [f"{cfg.user}@{cfg.host}" if cfg.user else cfg.host, "true"]
    return " ".join(_shell_word(w) for w in words)


def ssh_refusal(cfg: Connection, stderr: str, code: Optional[int], python: str) -> BackendError:
    """One tether error, naming the fix, for why an ssh command (the serve channel) never answered."""
    where = f"{cfg.user + '@' if cfg.user else ''}{cfg.host}" + (f":{cfg.port}" if cfg.port else "")
    lines = [line.strip() for line in stderr.splitlines() if line.strip() and not line.startswith("@")]
    said = lines[-1] if lines else f"ssh exited {code}"
    if code == 127 or "command not found" in stderr or (python in stderr and "not found" in stderr):
        return BackendError(f"{where}: {python}: not found on the far side: set python: in the backend's config")
    if code != 255:
        return BackendError(f"{where}: the far side's Python ({python}) ended at once (exit status {code}): {said}")
    if "Permission denied" in stderr:
        return BackendError(auth_hint(cfg, where))
    if "host key" in stderr.lower() or "HOST IDENTIFICATION HAS CHANGED" in stderr:
        return BackendError(f"{where}: host key not verified ({said}). A new server: check its "
                            f"fingerprint, then `ssh {cfg.host} true` once to record it (or set known_hosts:). "
                            f"A changed key: find out why before you remove the old entry")
    if "not responding" in stderr:  # ServerAlive: the link or the host went silent mid-command
        return BackendError(f"{where}: no answer to {ALIVE_PROBES} keepalives in alive_timeout_s "
                            f"({cfg.alive_timeout_s:g}s): the link or the host is down (a run there goes on); "
                            f"run the command again once `ssh {cfg.host} true` answers")
    if "timed out" in stderr.lower():
        return BackendError(f"{where}: no answer within connect_timeout_s ({cfg.connect_timeout_s:g}s): "
                            f"is the host up and the port right?")
    if any(words in stderr for words in ("Connection refused", "No route to host", "Could not resolve",
                                         "Network is unreachable", "Connection reset")):
        return BackendError(f"{where}: cannot connect: {said}: is sshd running and the port right?")
    if "Load key" in stderr or "passphrase" in stderr:
        return BackendError(f"{where}: cannot use the key ({said}): an encrypted key needs ssh-agent (ssh-add it)")
    return BackendError(f"{where}: the connection was lost ({said}): run the command again")


def _shell_word(word: str) -> str:
    """`word` quoted for a shell, a leading ~/ left bare so the shell still expands it."""
    if word.startswith("~/") and len(word) > 2:
        return "~/" + shlex.quote(word[2:])
    return shlex.quote(word)


def auth_hint(cfg: Connection, where: str) -> str:
    """Authentication failed: the exact command that must work, and what to change."""
    if cfg.identity_file:
        fix = (f"put {cfg.identity_file}.pub into the far side's ~/.ssh/authorized_keys "
               f"(ssh-copy-id), or set identity_file: to a key it accepts")
    else:
        fix = "set identity_file:, or load the key with ssh-add"
    return f"{where}: authentication failed: `{ssh_command(cfg)}` must work without a prompt: {fix}"


def explain(err: BaseException, cfg: Connection, waited: float) -> BackendError:
    """One tether error, naming the fix, for whatever the connection raised."""
    import asyncio

    import asyncssh

    where = f"{cfg.user + '@' if cfg.user else ''}{cfg.host}" + (f":{cfg.port}" if cfg.port else "")
    if isinstance(err, asyncssh.HostKeyNotVerifiable):
        return BackendError(f"{where}: host key not verified ({err.reason}). A new server: check its "
                            f"fingerprint, then `ssh {cfg.host} true` once to record it (or set known_hosts:). "
                            f"A changed key: find out why before you remove the old entry")
    if isinstance(err, asyncssh.PermissionDenied) or isinstance(err, PermissionError) or \
            isinstance(err.__cause__, asyncssh.PermissionDenied):  # sshfs turns it into PermissionError
        return BackendError(auth_hint(cfg, where))
    if isinstance(err, asyncssh.KeyImportError):
        return BackendError(f"{where}: cannot use the key ({err}): an encrypted key needs ssh-agent (ssh-add it)")
    if isinstance(err, (asyncio.TimeoutError, TimeoutError)) or "timed out" in str(err).lower():
        return BackendError(f"{where}: no answer within connect_timeout_s ({cfg.connect_timeout_s:g}s): "
                            f"is the host up and the port right?")
    if isinstance(err, (ConnectionError, OSError)):
        return BackendError(f"{where}: cannot connect: {err.strerror or err}: is sshd running and the port right?")
    if isinstance(err, (asyncssh.DisconnectError, asyncssh.ChannelOpenError)):
        return BackendError(f"{where}: the connection was lost ({err}): run the command again")
    return BackendError(f"{where}: {type(err).__name__}: {err}")
