"""The ssh backend: a machine reached with an ssh key, the launcher a detached process there.

The ssh transport (tether/backends/openssh.py) carries every far-side command and file; this
policy adds what a plain ssh machine needs: the GPU choice (the job's venv is built as on every
backend: tether/backends/venv.py; `packages:` here is its deprecated alias).
"""

from __future__ import annotations

from dataclasses import dataclass

from tether.backends.base import Backend as BaseBackend
from tether.backends.gpus import GpuKeys
from tether.backends.openssh import Connection, SSHTransport
from tether.backends.transport import Transport


@dataclass(frozen=True, kw_only=True)
class Config(GpuKeys, Connection):
    """backends: {NAME: {type: ssh, host: HOST, ...}}: a machine your ssh key reaches."""

    packages: tuple[str, ...] = ()  # deprecated: the job's environment: {packages: [...]}

    def problems(self) -> list[str]:
        return super().problems() + self.gpu_problems()

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
        return {"remote_dir": self.remote_dir, "python": self.python, "env": self.config.trainer_env(),
                **self.config.gpu_settings()}

    def fetch_policy(self, path: str, size: int) -> str:
        return self.config.fetch_policy(path, size)
