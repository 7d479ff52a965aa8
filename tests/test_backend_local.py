"""The backend contract on the local backend, plus what only a local far side lets us see (/proc)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from backend_contract import BackendContract
from helpers import alive, group
from tether.backends.local import Backend, Config
from tether.errors import BackendError


@pytest.fixture
def neutral_cwd(tmp_path: Path, monkeypatch) -> Path:
    """Work from an empty folder: the repository root holds a `tether/` package of its own (see
    test_launcher_commands_ignore_a_tether_package_in_the_working_folder)."""
    folder = tmp_path / "cwd"
    folder.mkdir()
    monkeypatch.chdir(folder)
    return folder


class TestLocalBackend(BackendContract):
    @pytest.fixture
    def backend(self, tmp_path: Path, neutral_cwd: Path) -> Backend:
        return Backend("local", Config(), str(tmp_path / ".tether"))

    # ------------------------------------------------------------ local only

    def test_remote_dir_defaults_under_the_state_dir_and_files_land_there(self, backend, tmp_path):
        assert backend.remote_dir == str(tmp_path / ".tether" / "remote")
        assert backend.install_launcher() is True  # first: it claims remote_dir (an empty folder)
        assert (Path(backend.remote_dir) / "tether" / backend.version / "tether" / "remote" / "launcher.py").is_file()
        fs = backend.filesystem()
        fs.makedirs("a", exist_ok=True)
        fs.pipe_file("a/b.txt", b"on disk")
        assert (tmp_path / ".tether" / "remote" / "a" / "b.txt").read_bytes() == b"on disk"

    def test_config_remote_dir_is_used(self, tmp_path, neutral_cwd):
        elsewhere = tmp_path / "far"
        backend = Backend("local", Config(remote_dir=str(elsewhere)), str(tmp_path / ".tether"))
        assert backend.remote_dir == str(elsewhere)
        assert backend.install_launcher() is True
        assert (elsewhere / "tether" / backend.version / "COMPLETE").read_text() == backend.version
        assert backend.check().ready

    def test_check_is_not_ready_with_a_missing_python(self, tmp_path, neutral_cwd):
        backend = Backend("local", Config(python=str(tmp_path / "no-such-python")), str(tmp_path / ".tether"))
        with pytest.raises(BackendError, match="no-such-python.*set python:"):
            backend.install_launcher()  # the far side's Python unpacks the launcher: it must exist
        report = backend.check()
        assert not report.ready
        python = [i for i in report.items if i["check"] == "python"]
        assert python and python[0]["ok"] is False and "no-such-python" in python[0]["detail"]

    def test_stop_leaves_no_process_of_the_trainers_group(self, backend, make_run):
        run = make_run("--wait", "--children")
        assert backend.launch(run).outcome == "started"
        ready = self.wait_event(backend, run, "ready")[0]
        state = backend.state(run).state
        pgid, launcher_pid = state["pgid"], state["pid"]
        assert len(ready["children"]) == 4 and all(alive(p) for p in ready["children"])
        assert set(ready["children"]) <= set(group(pgid))
        t0 = time.monotonic()
        outcome = backend.stop(run, 2.0)
        assert outcome.outcome == "stopped", outcome
        assert time.monotonic() - t0 < 5.0  # the launcher cleared the group, not stop's late SIGKILL
        assert group(pgid) == []
        assert [p for p in ready["children"] if alive(p)] == []
        assert not alive(launcher_pid)
        snap = backend.state(run)
        assert snap.status == "stopped" and snap.alive is False

    def test_launcher_commands_ignore_a_tether_package_in_the_working_folder(self, backend, tmp_path, monkeypatch):
        """The far side must run the launcher copied to remote_dir/tether/<version>/, whatever folder
        the command starts in. A project (or a home directory) holding its own `tether/` must not
        replace it: here a decoy whose launcher answers {"decoy": true}."""
        backend.install_launcher()
        decoy = tmp_path / "project"
        (decoy / "tether" / "remote").mkdir(parents=True)
        (decoy / "tether" / "__init__.py").write_text("")
        (decoy / "tether" / "remote" / "__init__.py").write_text("")
        (decoy / "tether" / "remote" / "launcher.py").write_text('print(\'{"decoy": true}\')\n')
        monkeypatch.chdir(decoy)
        found = backend.far.check(backend.settings())
        assert found.python_ok is True, "the launcher came from the working folder, not the copied version"
