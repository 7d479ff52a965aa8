"""Backends by composition: a transport per way of reaching a far side, a policy per type, the shared keys once."""

from __future__ import annotations

import dataclasses
import importlib
import re
from pathlib import Path

import pytest

from tether.backends import BACKEND_TYPES
from tether.backends.base import Shared
from tether.backends.openssh import Connection, SSHTransport
from tether.backends.transport import LocalTransport
from tether.errors import RemoteCommandError

BACKENDS = Path(__file__).resolve().parent.parent / "tether" / "backends"


def test_slurm_rides_the_ssh_transport_without_the_ssh_policy(tmp_path):
    from tether.backends import slurm, ssh

    assert not issubclass(slurm.Backend, ssh.Backend)
    backend = slurm.Backend("hpc", slurm.Config(host="login", remote_dir="/shared/t"), str(tmp_path))
    assert isinstance(backend.transport, SSHTransport)
    assert backend.where == "login" and backend.remote_dir == "/shared/t" and backend.opens_early
    assert backend.python == "python3"  # no venv: packages: is an ssh key, not a slurm one


@pytest.mark.parametrize("kind", sorted(BACKEND_TYPES))
def test_every_config_extends_the_shared_keys(kind):
    config = importlib.import_module(BACKEND_TYPES[kind]).Config
    assert issubclass(config, Shared)
    shared = {f.name for f in dataclasses.fields(Shared)}
    assert shared <= {f.name for f in dataclasses.fields(config)}


def test_keys_over_ssh_are_declared_once():
    declared = {kind: set(importlib.import_module(BACKEND_TYPES[kind]).Config.__annotations__)
                for kind in ("ssh", "slurm")}
    for kind, names in declared.items():
        again = names & {"env", "keep_remote", "fetch_artifacts", "max_artifact_mb", "num_threads"}
        assert not again, f"{kind}.Config declares {again} again: they belong to openssh.Connection"
    assert issubclass(importlib.import_module(BACKEND_TYPES["slurm"]).Config, Connection)


def test_no_backend_reads_its_config_through_getattr_fallbacks():
    for path in BACKENDS.glob("*.py"):
        assert not re.search(r"getattr\((self\.)?config", path.read_text()), path.name


def test_keep_remote_and_fetch_artifacts_are_the_policies_over_ssh(tmp_path):
    from tether.backends import local, slurm, ssh

    assert local.Backend("l", local.Config(), str(tmp_path)).keep_remote is False
    for module, extra in ((ssh, {}), (slurm, {"remote_dir": "/shared/t"})):
        backend = module.Backend("b", module.Config(host="h", keep_remote=True, fetch_artifacts=False, **extra),
                                 str(tmp_path))
        assert backend.keep_remote is True
        assert backend.fetch_policy("artifacts/model.pt", 1) == "fetch_artifacts is false"
        assert backend.fetch_policy("metrics.jsonl", 1) == ""


def test_the_local_transport_runs_one_command_and_reports_its_failure(tmp_path):
    import sys

    transport = LocalTransport(str(tmp_path / "far"), sys.executable)
    assert transport.execute([sys.executable, "-c", "import sys; print(sys.stdin.read())"], b"hi") == b"hi\n"
    with pytest.raises(RemoteCommandError):
        transport.execute([sys.executable, "-c", "raise SystemExit(3)"])
    assert transport.serve_argv("S", "v") == [sys.executable, "-c", "S", str(tmp_path / "far"), "v"]
