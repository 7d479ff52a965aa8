"""Shared fixtures: a throwaway project with the demo trainer, and ways to run doit/tether in it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest

from helpers import stop_leftover_runs

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "configs" / "demo"

CONFIG = """\
name: {name}
backend: {backend_name}
code:
  paths: [{code}]
data:
  paths: [{data}]
trainer:
  type: command
  command: "{command}"
artifacts: [{artifacts}]
checkpoint: {{keep: 3, every: 50}}
heartbeat_timeout_s: 60
grace_seconds: {grace}
backends:
  {backend_name}: {backend}
"""


def config_text(name: str = "demo", epochs: int = 30, grace: float = 5, command: str | None = None,
                code: str = "demo/train.py", data: str = "demo/points.csv",
                artifacts: str = "model.json, metrics.json", backend_name: str = "local",
                backend: str = "{type: local}") -> str:
    """A tether.yaml for the project: the demo trainer for `epochs` unless `command` is given, on the
    backend `backend_name` whose keys are `backend` (YAML flow text; JSON is YAML)."""
    if command is None:
        command = f"{{python}} demo/train.py --epochs {epochs}"
    return CONFIG.format(name=name, grace=grace, command=command, code=code, data=data, artifacts=artifacts,
                         backend_name=backend_name, backend=backend)


class Project:
    """A folder with tether.yaml, dodo.py and the demo trainer; commands run inside it."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def write_config(self, text: str | None = None, **fields) -> Path:
        path = self.root / "tether.yaml"
        path.write_text(text if text is not None else config_text(**fields))
        return path

    def doit(self, *args: str, timeout: float = 120, check: bool = False) -> subprocess.CompletedProcess:
        """`python -m doit ARGS` here; stdout and stderr captured as text."""
        done = subprocess.run([sys.executable, "-m", "doit", *args], cwd=self.root, text=True,
                              capture_output=True, timeout=timeout, stdin=subprocess.DEVNULL)
        if check and done.returncode != 0:
            raise AssertionError(f"doit {args} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
        return done

    def tether(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        """The `tether` console script's code path (python -m tether.cli ARGS) here."""
        return subprocess.run([sys.executable, "-m", "tether.cli", *args], cwd=self.root, text=True,
                              capture_output=True, timeout=timeout, stdin=subprocess.DEVNULL)

    def start(self, *args: str) -> subprocess.Popen:
        """`python -m doit ARGS` in the background, in its own process group."""
        return subprocess.Popen([sys.executable, "-m", "doit", *args], cwd=self.root, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                start_new_session=True)

    def run_ids(self) -> list[str]:
        folder = self.root / ".tether" / "runs"
        # a dot name is a run still being created (tether.pipelines.runs.record_new): not a run yet
        return sorted(p.name for p in folder.iterdir() if not p.name.startswith(".")) if folder.is_dir() else []

    def local_run(self, run_id: str | None = None) -> Path:
        ids = self.run_ids()
        assert ids, "no run was created"
        return self.root / ".tether" / "runs" / (run_id or ids[-1])

    def remote_run(self, run_id: str | None = None) -> Path:
        return self.root / ".tether" / "remote" / "runs" / (run_id or self.run_ids()[-1])

    def events(self, run_id: str | None = None) -> list[dict]:
        if not (run_id or self.run_ids()):
            return []
        path = self.remote_run(run_id) / "events.jsonl"
        if not path.exists():
            return []
        lines = path.read_text().split("\n")[:-1]  # a line still being written is not yet an event
        return [json.loads(line) for line in lines if line.strip()]

    def wait_for(self, predicate: Callable[[], bool], timeout: float = 60, what: str = "") -> None:
        """Poll `predicate` until it holds (no fixed sleeps: the condition decides)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return
            time.sleep(0.02)
        raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")


@pytest.fixture(scope="session")
def sshd(tmp_path_factory):
    """A real OpenSSH server on 127.0.0.1 (own host key and client key), for the whole session."""
    from sshd import SSHServer

    server = SSHServer(tmp_path_factory.mktemp("sshd")).start()
    yield server
    server.stop()


def ssh_config_text(server, remote_dir: Path, name: str = "demo", epochs: int = 30, **extra) -> str:
    """A tether.yaml whose backend `lab` is the given sshd (the demo trainer)."""
    return config_text(name=name, epochs=epochs, backend_name="lab",
                       backend=json.dumps(server.backend_config(remote_dir, **extra)))


@pytest.fixture
def project(tmp_path: Path) -> Project:
    root = tmp_path / "proj"
    (root / "demo").mkdir(parents=True)
    shutil.copy(DEMO / "train.py", root / "demo" / "train.py")
    shutil.copy(DEMO / "points.csv", root / "demo" / "points.csv")
    shutil.copy(REPO / "dodo.py", root / "dodo.py")
    proj = Project(root)
    proj.write_config()
    yield proj
    _kill_leftovers(root)


def _kill_leftovers(root: Path) -> None:
    """Stop any launcher or trainer a test left running (found by the run dirs they hold)."""
    stop_leftover_runs(root / ".tether" / "remote")
