"""The ssh backend: a machine reached with an ssh key, the launcher a detached process there.

The ssh transport (tether/backends/openssh.py) carries every far-side command and file; this
policy adds what a plain ssh machine needs: the GPU choice (the job's venv is built as on every
backend: tether/backends/venv.py; `packages:` here is its deprecated alias).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from tether.backends.base import Backend as BaseBackend
from tether.backends.openssh import Connection, SSHTransport
from tether.backends.transport import Transport


@dataclass(frozen=True, kw_only=True)
class Config(Connection):
    """backends: {NAME: {type: ssh, host: HOST, ...}}: a machine your ssh key reaches."""

    gpus: str = "auto"
    min_free_gpu_mb: int = 2000
    packages: tuple[str, ...] = ()  # deprecated: the job's environment: {packages: [...]}

    def problems(self) -> list[str]:
        found = super().problems()
        if self.gpus not in ("auto", "none") and not re.fullmatch(r"\d+(,\d+)*", self.gpus):
            found.append(f"gpus {self.gpus!r}: use auto, none, or indices such as \"0,1\"")
        return found

    def warnings(self) -> list[str]:
        return super().warnings() + (["packages: is deprecated: move the list to the job's environment: "
                                      "{packages: [...]} (it still works, into the same venv)"] if self.packages else [])

    def legacy_packages(self) -> tuple[str, ...]:
        return self.packages


class Backend(BaseBackend):
    """The ssh policy: a detached process on the far machine, over the ssh transport."""

    type = "ssh"
    config: Config
    transport: SSHTransport

    def make_transport(self) -> Transport:
        return SSHTransport(self.config, self.state_dir)

    @property
    def keep_remote(self) -> bool:
        return self.config.keep_remote

    def settings(self) -> dict:
        return {"remote_dir": self.remote_dir, "gpus": self.config.gpus, "python": self.python,
                "min_free_gpu_mb": self.config.min_free_gpu_mb, "env": self.config.trainer_env()}

    def fetch_policy(self, path: str, size: int) -> str:
        return self.config.fetch_policy(path, size)
