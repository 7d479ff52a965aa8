"""The ssh backend: a machine reached with an ssh key, the launcher a detached process there.

The ssh transport (tether/backends/openssh.py) carries every far-side command and file; this
policy adds what a plain ssh machine needs: the GPU choice, and a venv built from `packages:`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from tether.backends.base import Backend as BaseBackend
from tether.backends.gpus import GpuKeys
from tether.backends.openssh import Connection, SSHTransport
from tether.backends.transport import Transport


@dataclass(frozen=True, kw_only=True)
class Config(GpuKeys, Connection):
    """backends: {NAME: {type: ssh, host: HOST, ...}}: a machine your ssh key reaches."""

    packages: tuple[str, ...] = ()

    def problems(self) -> list[str]:
        return super().problems() + self.gpu_problems()


class Backend(BaseBackend):
    """The ssh policy: a detached process on the far machine, over the ssh transport."""

    type = "ssh"
    config: Config
    transport: SSHTransport

    def make_transport(self) -> Transport:
        return SSHTransport(self.config, self.state_dir)

    @property
    def python(self) -> str:
        if self.config.packages:
            return f"{self.remote_dir}/venv/{self._venv_hash()}/bin/python"
        return self.base_python

    @property
    def keep_remote(self) -> bool:
        return self.config.keep_remote

    def settings(self) -> dict:
        return {"remote_dir": self.remote_dir, "python": self.python, "env": self.config.trainer_env(),
                **self.config.gpu_settings()}

    def fetch_policy(self, path: str, size: int) -> str:
        return self.config.fetch_policy(path, size)

    def _venv_hash(self) -> str:
        spec = "\n".join([self.config.python] + sorted(self.config.packages))
        return hashlib.sha256(spec.encode()).hexdigest()[:12]

    def prepare(self) -> None:
        """With `packages:`, a venv under remote_dir (system site packages visible), built once."""
        if not self.config.packages:
            return
        venv = f"{self.remote_dir}/venv/{self._venv_hash()}"
        try:
            self.far.cat(f"venv/{self._venv_hash()}/READY")
            return
        except FileNotFoundError:
            pass
        self.transport.execute([self.config.python, "-m", "venv", "--system-site-packages", venv])
        self.transport.execute([f"{venv}/bin/python", "-m", "pip", "install", "--quiet", *self.config.packages])
        self.far.put(f"venv/{self._venv_hash()}/READY", b"\n".join(p.encode() for p in self.config.packages))
