"""The local backend: the far side is a folder on this machine, the launcher a detached process."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any, Optional

from tether.backends.base import Backend as BaseBackend
from tether.remote import owner


@dataclass(frozen=True)
class Config:
    """backends: {NAME: {type: local, remote_dir: PATH, python: PATH, max_artifact_mb: N}}

    remote_dir defaults to .tether/remote in the working folder (a leading ~ is your home
    folder); python to the interpreter running tether; artifacts and checkpoints above
    max_artifact_mb stay in remote_dir (as on ssh).
    """

    type: str = "local"
    remote_dir: Optional[str] = None
    python: Optional[str] = None
    max_artifact_mb: Optional[float] = None

    def problems(self) -> list[str]:
        if self.remote_dir is None:
            return []
        why = owner.unsafe(os.path.abspath(os.path.expanduser(self.remote_dir)), os.path.expanduser("~"))
        return [f"remote_dir {self.remote_dir!r} is {why}{owner.FIX}a folder of its own, such as "
                f"~/.cache/tether"] if why else []


class Backend(BaseBackend):
    """A far side that is this machine."""

    type = "local"

    @property
    def remote_dir(self) -> str:
        return os.path.abspath(os.path.expanduser(self.config.remote_dir or os.path.join(self.state_dir, "remote")))

    @property
    def python(self) -> str:
        return self.config.python or sys.executable

    def filesystem(self) -> Any:
        from fsspec.implementations.dirfs import DirFileSystem
        from fsspec.implementations.local import LocalFileSystem

        os.makedirs(self.remote_dir, mode=0o700, exist_ok=True)
        return DirFileSystem(path=self.remote_dir, fs=LocalFileSystem())

    def fetch_policy(self, path: str, size: int) -> str:
        from tether.pipelines.transfer import size_policy

        return size_policy(path, size, self.config.max_artifact_mb)

    def serve_argv(self, script: str, version: str) -> list[str]:
        return [self.python, "-c", script, self.remote_dir, version]
