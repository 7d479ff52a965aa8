"""The backend contract on the ssh backend, against a real OpenSSH server on loopback (no mocks).

`TestSSHBackend` runs the very same `BackendContract` suite as the local backend, with a far side
reached through the session's sshd. The checks after it use only the public interface
(`Config`, `Backend`, `remote_dir`, `filesystem`, `far`, `launch`, `state`, `stop`,
`reconnect`) and what the far side wrote to disk.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import uuid
from pathlib import Path

import pytest

from backend_contract import BackendContract, wait_for
from helpers import stop_leftover_runs
from sshd import SSHServer
from tether.backends.ssh import Backend, Config
from tether.errors import BackendError


def ssh_backend(server: SSHServer, remote_dir, state_dir: Path, **extra) -> Backend:
    """tether.backends.ssh.Backend for `server`, built from its backend_config (as a tether.yaml would)."""
    return Backend("lab", Config(**server.backend_config(remote_dir, **extra)), str(state_dir))


def accepted_logins(server: SSHServer) -> int:
    """How many connections the server has authenticated so far (sshd's own log)."""
    return server.log.read_text(errors="replace").count("Accepted publickey")


class TestSSHBackend(BackendContract):
    """The shared contract, far side reached over ssh."""

    @pytest.fixture
    def backend(self, sshd, tmp_path: Path) -> Backend:
        remote = tmp_path / "far"
        yield ssh_backend(sshd, remote, tmp_path / ".tether")
        stop_leftover_runs(remote)

    # ------------------------------------------------------------ ssh only, public interface

    def test_remote_dir_is_absolute_on_the_far_side_and_private(self, backend, tmp_path):
        assert backend.remote_dir == str(tmp_path / "far")
        assert backend.install_launcher() is True  # the first contact claims remote_dir (creates it)
        assert stat.S_IMODE(os.stat(backend.remote_dir).st_mode) == 0o700
        copied = tmp_path / "far" / "tether" / backend.version / "tether" / "remote" / "launcher.py"
        assert copied.read_bytes() == (Path(__file__).parent.parent / "tether" / "remote" / "launcher.py").read_bytes()

    def test_every_far_side_command_of_an_invocation_shares_one_connection(self, sshd, tmp_path):
        before = accepted_logins(sshd)
        backend = ssh_backend(sshd, tmp_path / "far", tmp_path / ".tether")
        backend.install_launcher()
        backend.far.put("note.txt", b"x")  # files travel on the serve channel too (SFTP is only filesystem())
        for _ in range(3):
            assert backend.check().ready
            assert backend.far.cat("note.txt") == b"x"
        assert backend.commands >= 3  # the three checks, at least
        assert backend.far.starts == 1, "the far side's serve process was started more than once"
        wait_for(lambda: accepted_logins(sshd) > before, "sshd to log the login")
        assert accepted_logins(sshd) - before == 1, "each command opened a connection of its own"

    def test_remote_dir_under_home_is_made_absolute_there(self, sshd, tmp_path):
        name = f"tether-test-{uuid.uuid4().hex[:10]}"
        home = Path(os.path.expanduser("~root"))
        backend = Backend("lab", Config(**dict(sshd.backend_config(tmp_path), remote_dir=f"~/{name}")),
                          str(tmp_path / ".tether"))
        try:
            assert backend.remote_dir == str((home / name).resolve())
            assert (home / name).is_dir()
            assert stat.S_IMODE((home / name).stat().st_mode) == 0o700
            assert backend.install_launcher() is True
            assert backend.check().ready
        finally:
            shutil.rmtree(home / name, ignore_errors=True)

    def test_secrets_travel_on_stdin_into_a_private_file(self, sshd, backend, make_run, tmp_path):
        secret = f"s3cr3t-{uuid.uuid4().hex}"
        run = make_run("--wait")  # pushed through the contract's backend, onto the same far side
        with_env = ssh_backend(sshd, tmp_path / "far", tmp_path / ".tether", env={"API_TOKEN": secret})
        started = with_env.launch(run)
        assert started.outcome == "started", started
        env_file = tmp_path / "far" / "runs" / run.run_id / "launch_env.json"
        assert stat.S_IMODE(env_file.stat().st_mode) == 0o600
        assert json.loads(env_file.read_text())["API_TOKEN"] == secret
        self.wait_event(backend, run, "ready")
        self.go(backend, run)
        self.wait_status(backend, run, "completed")

    def test_an_unreachable_far_side_is_a_backend_error_then_reconnect_recovers(self, tmp_path):
        server = SSHServer(tmp_path / "own-sshd").start()
        try:
            backend = ssh_backend(server, tmp_path / "far", tmp_path / ".tether", connect_timeout_s=3)
            backend.install_launcher()
            assert backend.check().ready
            server.stop()
            with pytest.raises(BackendError) as lost:  # tether's own error, never asyncssh's
                backend.far.probe([f"{backend.remote_dir}/runs/none"])
            assert "\n" not in str(lost.value)
            with pytest.raises(BackendError) as refused:
                backend.far.probe([f"{backend.remote_dir}/runs/none"])
            assert "cannot connect" in str(refused.value), refused.value
            server.start()
            backend.reconnect()
            answer = backend.far.probe([f"{backend.remote_dir}/runs/none"])
            assert answer[f"{backend.remote_dir}/runs/none"].status == "absent"
        finally:
            server.stop()


# ---------------------------------------------------------------- the config refuses what a shell could misread

HOSTILE = ["x;touch M", "$(touch M)", "`touch M`", "a b", "../../x", "x/../../y", "x\ny", "-oProxyCommand=x"]


@pytest.mark.parametrize("value", HOSTILE + ["far\n"], ids=repr)
def test_config_refuses_a_hostile_remote_dir(value):
    problems = Config(host="h", remote_dir=value).problems()
    assert problems and "remote_dir" in problems[0], problems


@pytest.mark.parametrize("value", ["-oProxyCommand=touch M", "a b", "h\nx", "", "h\n"], ids=repr)
def test_config_refuses_a_hostile_host(value):
    problems = Config(host=value).problems()
    assert problems and "host" in problems[0], problems


@pytest.mark.parametrize("value", ["python3; touch M", "$(touch M)", "py thon", "python3\n"], ids=repr)
def test_config_refuses_a_hostile_python(value):
    problems = Config(host="h", python=value).problems()
    assert problems and "python" in problems[0], problems


def test_config_refuses_a_hostile_env_key():
    problems = Config(host="h", env={"A;touch M": "1", "OK_NAME": "fine"}).problems()
    assert len(problems) == 1 and "A;touch M" in problems[0], problems


def test_config_accepts_ordinary_values():
    assert Config(host="gpu-box.example.org", remote_dir="~/.cache/tether", python="/opt/py/bin/python3.11",
                  env={"API_TOKEN": "x"}).problems() == []
