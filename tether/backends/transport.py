"""How this side reaches a far side: its serve process, its files, one command; here, the local one.

A backend is a Transport composed with a policy (its type's Backend class): the transport says
how to start the serve process, where remote_dir is and how to read its files; the policy says
how a run is launched and stopped and what settings the far side gets. Local and ssh are the
transports; local, ssh and slurm the policies (slurm rides the ssh transport).
"""

from __future__ import annotations

import os
import subprocess
from typing import TYPE_CHECKING, Any, Optional

from tether.backends.channel import ChannelLost
from tether.errors import BackendError, RemoteCommandError

if TYPE_CHECKING:
    from tether.backends.farside import FarSide

COMMAND_TIMEOUT_S = 3600  # a materialize of a large tree or a venv install can take minutes


class Transport:
    """The interface every transport implements; the defaults suit a far side on this machine."""

    where = "this machine"  # the far side in a message: user@host, or this machine
    opens_early = False  # start the serve process before the first request needs it (a slow connection)
    open_timeout_s = 120.0  # the far side's first word: its Python started (and the package installed)
    stall_timeout_s: Optional[float] = None  # a transfer that moves no byte this long is ended (None: never)

    @property
    def python(self) -> str:
        """The interpreter that exists before `prepare` (which may build a venv from it): serve runs on it."""
        raise NotImplementedError

    def root(self, far: "FarSide") -> str:
        """remote_dir, absolute on the far side (the serve process may be asked where it is)."""
        raise NotImplementedError

    def serve_argv(self, script: str, version: str) -> list[str]:
        """The command that starts the far side's serve process (`python -c SCRIPT REMOTE_DIR VERSION`)."""
        raise NotImplementedError

    def filesystem(self, remote_dir: str) -> Any:
        """An fsspec filesystem whose root is remote_dir (for what the protocol does not carry)."""
        raise NotImplementedError

    def execute(self, argv: list[str], stdin: bytes = b"") -> bytes:
        """Run one command on the far side outside the serve process (building a venv); its stdout."""
        raise NotImplementedError

    def explain_lost(self, err: ChannelLost) -> BackendError:
        """Why the serve process never said hello, as one line naming the fix."""
        return BackendError(f"the far side's Python ({self.python}) did not start: {err}: "
                            f"set python: in the backend's config")

    def missing_program_hint(self, program: str) -> str:
        return "set python: in the backend's config"

    def reconnect(self) -> None:
        """Forget any connection of this transport's own (the serve channel is the FarSide's)."""

    def is_transport_error(self, err: BaseException) -> bool:
        """Whether `err` says the far side is unreachable (worth a retry), not that something is wrong."""
        return isinstance(err, BackendError)


class LocalTransport(Transport):
    """A far side that is a folder on this machine."""

    def __init__(self, remote_dir: str, python: str) -> None:
        self.wanted, self._python = remote_dir, python

    @property
    def python(self) -> str:
        return self._python

    @property
    def remote_dir(self) -> str:
        """The folder made absolute as the command runs (a leading ~ is your home folder)."""
        return os.path.abspath(os.path.expanduser(self.wanted))

    def root(self, far: "FarSide") -> str:
        return self.remote_dir

    def serve_argv(self, script: str, version: str) -> list[str]:
        return [self.python, "-c", script, self.remote_dir, version]

    def filesystem(self, remote_dir: str) -> Any:
        from fsspec.implementations.dirfs import DirFileSystem
        from fsspec.implementations.local import LocalFileSystem

        os.makedirs(remote_dir, mode=0o700, exist_ok=True)
        return DirFileSystem(path=remote_dir, fs=LocalFileSystem())

    def execute(self, argv: list[str], stdin: bytes = b"") -> bytes:
        try:
            done = subprocess.run(argv, input=stdin, capture_output=True, timeout=COMMAND_TIMEOUT_S)
        except FileNotFoundError:
            raise BackendError(f"{argv[0]}: not found: " + self.missing_program_hint(argv[0])) from None
        if done.returncode != 0:
            raise RemoteCommandError(argv, done.returncode, done.stderr.decode(errors="replace"))
        return done.stdout
