"""The local backend: the far side is a folder on this machine, the launcher a detached process."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from tether.backends.base import Backend as BaseBackend
from tether.backends.base import Shared
from tether.backends.gpus import GpuKeys
from tether.backends.transport import LocalTransport, Transport
from tether.remote import owner


@dataclass(frozen=True, kw_only=True)
class Config(GpuKeys, Shared):
    """backends: {NAME: {type: local, remote_dir: PATH, python: PATH, max_artifact_mb: N, gpus: auto, ...}}

    remote_dir defaults to .tether/remote in the working folder (a leading ~ is your home
    folder); python to the interpreter running tether; artifacts and checkpoints above
    max_artifact_mb stay in remote_dir (as on ssh). The GPU keys, env and num_threads are as on ssh.
    """

    type: str = "local"

    def problems(self) -> list[str]:
        found = super().problems() + self.gpu_problems()
        if self.remote_dir is None:
            return found
        why = owner.unsafe(os.path.abspath(os.path.expanduser(self.remote_dir)), os.path.expanduser("~"))
        return found + ([f"remote_dir {self.remote_dir!r} is {why}{owner.FIX}a folder of its own, such as "
                         f"~/.cache/tether"] if why else [])


class Backend(BaseBackend):
    """The local policy: a detached process on this machine, over the local transport."""

    type = "local"
    config: Config

    def make_transport(self) -> Transport:
        return LocalTransport(self.config.remote_dir or os.path.join(self.state_dir, "remote"),
                              self.config.python or sys.executable)

    def settings(self) -> dict:
        return dict(super().settings(), env=self.config.trainer_env(), **self.config.gpu_settings())
