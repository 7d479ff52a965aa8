"""A rented box's meter, with real parts only: the far side's idle stop and the laptop's teardown_command.

The far side (tether/remote/idle.py) is driven on copies of a real run dir, made once by a real
`doit run train` on the local backend and sealed by its launcher. The stop command is always a
marker (`echo x >> FILE`), never a real shutdown. Waits poll a condition against a deadline: the
idle stop's own loop is watched through its `still_ours` callback, which it calls once per poll,
so "it polled N more times past after_s and did not stop" needs no fixed sleep. Reads go through
the real serve process (the local backend's FarSide). `down`'s teardown_command runs through doit
in a real project, interactively too (a pseudo-terminal answers the question).
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import DEMO, REPO, Project
from helpers import alive, poll, sha256, stop_leftover_runs
from tether import config
from tether.errors import ConfigError
from tether.remote import idle
from tether.remote.rundir import SEALED_FILES, is_private

AFTER_S = 0.5  # the idle time of these tests: long enough to see a refusal, short enough to wait for


# ---------------------------------------------------------------- a real sealed run, copied per test


def make_project(root: Path, **fields) -> Project:
    """The `project` fixture's folder (demo trainer, dodo.py), with the config `fields` say."""
    (root / "demo").mkdir(parents=True)
    shutil.copy(DEMO / "train.py", root / "demo" / "train.py")
    shutil.copy(DEMO / "points.csv", root / "demo" / "points.csv")
    shutil.copy(REPO / "dodo.py", root / "dodo.py")
    project = Project(root)
    project.write_config(**fields)
    return project


@pytest.fixture(scope="module")
def sealed(tmp_path_factory) -> Path:
    """The run dir of one real run, trained to completion and sealed by its launcher."""
    project = make_project(tmp_path_factory.mktemp("sealed") / "proj", epochs=5)
    try:
        project.doit("run", "train", check=True)
    finally:
        stop_leftover_runs(project.root / ".tether" / "remote")
    run_dir = project.remote_run()
    assert (run_dir / "PULL_MANIFEST.json").is_file() and json.loads((run_dir / "state.json").read_text())["final"]
    return run_dir


@pytest.fixture
def run_dir(sealed, tmp_path) -> Path:
    """A copy of the sealed run dir, in a `runs/` folder of this test's own."""
    copy = tmp_path / "remote" / "runs" / sealed.name
    shutil.copytree(sealed, copy, symlinks=True)
    shutil.copy(sealed.parent.parent / ".tether-remote", tmp_path / "remote")  # tether's own remote_dir
    return copy


def sealed_hashes(run_dir: Path) -> dict[str, str]:
    """SHA-256 of every file the manifest lists, and of state.json and events.jsonl (which it lists too)."""
    listed = json.loads((run_dir / "PULL_MANIFEST.json").read_text())["files"]
    return {e["path"]: sha256(run_dir / e["path"]) for e in listed}


def assert_manifest_holds(run_dir: Path) -> None:
    """Every file the far side's manifest lists still has its bytes: a pull would still verify."""
    listed = json.loads((run_dir / "PULL_MANIFEST.json").read_text())["files"]
    assert {"state.json", "events.jsonl"} <= {e["path"] for e in listed}
    for entry in listed:
        assert sha256(run_dir / entry["path"]) == entry["sha256"], entry["path"]


class Waiter:
    """wait_then_stop in a thread; `polls` counts its calls of still_ours (one per poll), `ours` ends it."""

    def __init__(self, run_dir: Path, command: str, after_s: float = AFTER_S, **extra) -> None:
        self.polls, self.ours, self.error = 0, True, None
        settings = dict(extra, after_s=after_s, command=command)
        self.thread = threading.Thread(target=self._run, args=(str(run_dir), settings), daemon=True)
        self.thread.start()

    def still_ours(self) -> bool:
        self.polls += 1
        return self.ours

    def _run(self, run_dir: str, settings: dict) -> None:
        try:
            idle.wait_then_stop(run_dir, settings, self.still_ours)
        except BaseException as err:  # shown by join()
            self.error = err

    def polled(self, more: int) -> None:
        """Wait until it has polled `more` times from now."""
        target = self.polls + more
        poll(lambda: self.polls >= target or not self.thread.is_alive(), timeout=30, what=f"{more} more polls",
             interval=0.005)
        assert self.thread.is_alive(), f"wait_then_stop returned early ({self.error!r})"

    def join(self, timeout: float = 30) -> None:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "wait_then_stop is still waiting"
        assert self.error is None, repr(self.error)


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def record(run_dir: Path) -> dict:
    return json.loads((run_dir / "idle.json").read_text())


class HeldRead:
    """One request reading `run_dir` (idle.reading, as serve wraps it), held open in a thread until `end()`."""

    def __init__(self, run_dir: Path) -> None:
        self.holding, self.release = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._read, args=(str(run_dir),), daemon=True)
        self.thread.start()
        assert self.holding.wait(30), "the read never started"

    def _read(self, run_dir: str) -> None:
        with idle.reading(run_dir):
            self.holding.set()
            self.release.wait(60)

    def end(self) -> None:
        self.release.set()
        self.thread.join(30)


def mark_read(run_dir: Path) -> float:
    """One read through idle.reading (as serve does it); the time it ended."""
    with idle.reading(str(run_dir)):
        pass
    return (run_dir / "read_at").stat().st_mtime


# ---------------------------------------------------------------- the far side: wait_then_stop


def test_an_idle_sealed_run_stops_the_box_once(run_dir, tmp_path):
    marker = tmp_path / "marker"
    before = sealed_hashes(run_dir)
    last_read = mark_read(run_dir)
    waiter = Waiter(run_dir, f"echo x >> {marker}")
    waiter.join()
    assert lines(marker) == ["x"]
    done = record(run_dir)
    assert done["ran_at"] - last_read >= AFTER_S - 0.001, (done, last_read)  # not before after_s (ran_at: ms)
    assert done["exit_code"] == 0 and done["error"] is None, done
    assert done["after_s"] == AFTER_S and done["command"] == f"echo x >> {marker}"
    assert done["sealed_at"] == (run_dir / "PULL_MANIFEST.json").stat().st_mtime

    # once for this seal, whoever waits again (a later launcher, a box started again to pull)
    again = Waiter(run_dir, f"echo x >> {marker}")
    again.join()
    assert again.polls == 0 and lines(marker) == ["x"]

    shown = idle.describe(str(run_dir))
    assert shown["after_s"] == AFTER_S and shown["ran_at"] == done["ran_at"] and shown["exit_code"] == 0, shown
    assert shown["last_read_age_s"] >= AFTER_S, shown
    assert sealed_hashes(run_dir) == before  # state.json and events.jsonl included: never written
    assert_manifest_holds(run_dir)
    assert oct((run_dir / "idle.json").stat().st_mode & 0o777) == "0o600"
    for name in ("idle.json", "read_at", "readers.lock"):  # private: never sealed, never an artifact
        assert is_private(name) and name not in SEALED_FILES


def test_a_request_reading_the_run_holds_the_stop_off(run_dir, tmp_path):
    marker = tmp_path / "marker"
    mark_read(run_dir)
    read = HeldRead(run_dir)
    waiter = Waiter(run_dir, f"echo x >> {marker}")
    # past after_s since the last finished read, while this request still reads: polled, refused
    poll(lambda: time.time() - (run_dir / "read_at").stat().st_mtime > 3 * AFTER_S, timeout=30, what="3 x after_s")
    waiter.polled(5)
    assert lines(marker) == [] and "ran_at" not in record(run_dir), record(run_dir)
    assert record(run_dir)["waiting_since"] > 0

    released = time.time()
    read.end()
    ended = (run_dir / "read_at").stat().st_mtime
    assert ended >= released - 0.01, (ended, released)  # touched as the read ended, not as it began
    waiter.join()
    assert lines(marker) == ["x"]
    assert record(run_dir)["ran_at"] - ended >= AFTER_S - 0.001  # the clock started again at the read's end


def test_a_run_that_is_not_final_and_sealed_never_stops_the_box(run_dir, tmp_path):
    marker, state_file = tmp_path / "marker", run_dir / "state.json"
    final = json.loads(state_file.read_text())
    (run_dir / "PULL_MANIFEST.json").rename(tmp_path / "manifest")  # as while it runs: no seal yet
    state_file.write_text(json.dumps(dict(final, status="running", final=False)))
    waiter = Waiter(run_dir, f"echo x >> {marker}", after_s=0.2)
    waiter.polled(8)  # no read ever: a sealed run would have stopped after 0.2 s
    assert lines(marker) == []

    os.rename(tmp_path / "manifest", run_dir / "PULL_MANIFEST.json")  # sealed, but not final: still not
    waiter.polled(8)
    assert lines(marker) == []

    state_file.write_text(json.dumps(final))  # final and sealed: now it stops
    waiter.join()
    assert lines(marker) == ["x"]


def test_the_wait_ends_when_the_run_is_no_longer_ours_or_gone(run_dir, tmp_path):
    marker = tmp_path / "marker"
    mark_read(run_dir)  # the idle clock starts now: 8 s, far beyond each wait below (a poll is 2 s)
    waiter = Waiter(run_dir, f"echo x >> {marker}", after_s=8)
    waiter.polled(1)
    assert record(run_dir) == {"after_s": 8, "waiting_since": record(run_dir)["waiting_since"]}
    waiter.ours = False  # reopened, or a newer launcher took over
    waiter.join()
    assert lines(marker) == [] and "ran_at" not in record(run_dir)

    mark_read(run_dir)
    waiter = Waiter(run_dir, f"echo x >> {marker}", after_s=8)
    waiter.polled(1)
    while run_dir.exists():  # `down` removed it; the waiter may be renaming its idle.json.tmp-N in there meanwhile
        shutil.rmtree(run_dir, ignore_errors=True)
    waiter.join()
    assert lines(marker) == [] and not run_dir.exists()  # and the wait wrote nothing back


def sibling(run_dir: Path, name: str) -> Path:
    """Another run of the same box: a copy of the sealed run in the same runs/ folder."""
    other = run_dir.parent / name
    shutil.copytree(run_dir, other, symlinks=True)
    return other


def test_another_run_of_the_box_alive_or_being_read_holds_the_stop_off(run_dir, tmp_path):
    """A sweep on one box: the first run to idle must not stop the box under the others."""
    marker = tmp_path / "marker"
    other = sibling(run_dir, "demo-other")
    mark_read(run_dir)
    fd = os.open(other / "launcher.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # what a live launcher (and its trainer) holds
    waiter = Waiter(run_dir, f"echo x >> {marker}")
    poll(lambda: time.time() - (run_dir / "read_at").stat().st_mtime > 3 * AFTER_S, timeout=30, what="3 x after_s")
    waiter.polled(5)
    assert lines(marker) == []
    os.close(fd)  # it ended

    read = HeldRead(other)
    waiter.polled(5)  # the other run is being pulled: still no stop
    assert lines(marker) == []
    read.end()
    ended = (other / "read_at").stat().st_mtime
    waiter.join()
    assert lines(marker) == ["x"]
    assert record(run_dir)["ran_at"] - ended >= AFTER_S - 0.001  # the other run's read reset the box's clock


def test_two_runs_idling_together_stop_the_box_once(run_dir, tmp_path):
    marker = tmp_path / "marker"
    other = sibling(run_dir, "demo-other")
    mark_read(other)
    waiters = [Waiter(run_dir, f"echo x >> {marker}"), Waiter(other, f"echo x >> {marker}")]
    for waiter in waiters:
        waiter.join()
    assert lines(marker) == ["x"]
    records = sorted([record(run_dir), record(other)], key=lambda r: "stopped_by" in r)
    assert records[0]["exit_code"] == 0 and "stopped_by" in records[1], records
    assert records[1]["stopped_by"] in (run_dir.name, other.name)


def test_a_failing_or_hanging_stop_command_is_recorded(run_dir, tmp_path):
    Waiter(run_dir, "echo said-so; exit 3", after_s=0.05).join()
    failed = record(run_dir)
    assert failed["exit_code"] == 3 and "exited 3" in failed["error"] and "by hand" in failed["error"], failed
    assert "said-so" in (run_dir / "launcher.log").read_text()
    assert idle.describe(str(run_dir))["error"] == failed["error"]

    other = tmp_path / "other" / "runs" / run_dir.name
    shutil.copytree(run_dir, other, symlinks=True)
    (other / "idle.json").unlink()
    pid_file = tmp_path / "pid"
    Waiter(other, f"echo $$ > {pid_file}; exec sleep 60", after_s=0.05, timeout_s=0.5).join()
    hung = record(other)
    assert hung["exit_code"] is None and "did not finish within 0.5 s" in hung["error"], hung
    pid = int(pid_file.read_text())
    poll(lambda: not alive(pid), timeout=10, what="the hung stop command to be killed")


def test_describe_is_empty_without_an_idle_stop(run_dir):
    assert idle.describe(str(run_dir)) == {}
    assert idle.describe(str(run_dir.parent / "no-such-run")) == {}


def test_reading_never_fails_a_request_for_a_missing_run(tmp_path):
    missing = tmp_path / "runs" / "gone"
    with idle.reading(str(missing)):
        pass
    assert not missing.exists()  # and it made nothing


# ---------------------------------------------------------------- reads through the real serve process


def test_reads_through_serve_reset_the_idle_clock_and_hold_the_lock(run_dir, tmp_path):
    from tether.backends import local

    remote = run_dir.parent.parent
    backend = local.Backend("local", local.Config(remote_dir=str(remote)), str(tmp_path / "state"))
    read_at, old = run_dir / "read_at", time.time() - 3600

    def reset() -> None:
        read_at.touch()
        os.utime(read_at, (old, old))

    try:
        for name, request in [  # status and watch, pull (manifest, small files), and any other request about it
            ("probe", lambda: backend.far.probe([str(run_dir)])),
            ("read", lambda: backend.far.cat(f"runs/{run_dir.name}/PULL_MANIFEST.json")),
            ("send", lambda: backend.far.send(str(run_dir), ["run.json"], lambda chunk: None, None)),
            ("start", lambda: backend.far.start(str(run_dir), backend.settings())),
        ]:
            reset()
            request()
            assert read_at.stat().st_mtime > old + 3000, f"{name} did not count as a read"

        reset()
        backend.far.have(str(remote / "objects"), ["0" * 64])
        backend.far.read("tether/" + backend.version + "/tether/__init__.py", lambda chunk: None)
        assert read_at.stat().st_mtime == old  # requests about no run are no read of it

        # while a read streams, its request holds readers.lock shared: the idle stop's exclusive try fails
        big = run_dir / "artifacts" / "big.bin"
        big.write_bytes(os.urandom(32 << 20))
        tried: list[str] = []

        def receive(chunk: bytes) -> None:
            if tried:
                return
            fd = os.open(run_dir / "readers.lock", os.O_RDWR)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                tried.append("taken")
            except BlockingIOError:
                tried.append("held")
            finally:
                os.close(fd)

        reset()
        backend.far.read(f"runs/{run_dir.name}/artifacts/big.bin", receive)
        assert tried == ["held"]
        assert read_at.stat().st_mtime > old + 3000
        fd = os.open(run_dir / "readers.lock", os.O_RDWR)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # and released when the request ends
        os.close(fd)
    finally:
        backend.close()


# ---------------------------------------------------------------- the laptop: down's teardown_command


def teardown_project(root: Path, command: str) -> Project:
    return make_project(root, epochs=5, backend=json.dumps({"type": "local", "teardown_command": command}))


def marker_command(marker: Path, remote_runs: Path) -> str:
    """A teardown_command that says, into `marker`, whether the run dirs were already gone when it ran."""
    return (f'if [ -z "$(ls -A {remote_runs})" ]; then echo gone >> {marker}; else echo present >> {marker}; fi; '
            f'echo teardown-said-hi')


def interactive_down(project: Project, answer: str) -> tuple[int, str]:
    """`doit run down` with a terminal on stdin that answers the question with `answer`."""
    leader, follower = pty.openpty()
    try:
        proc = subprocess.Popen([sys.executable, "-m", "doit", "run", "down"], cwd=project.root, stdin=follower,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        os.close(follower)
        follower = -1
        os.write(leader, answer.encode() + b"\n")
        out, _ = proc.communicate(timeout=120)
        return proc.returncode, out
    finally:
        os.close(leader)
        if follower != -1:
            os.close(follower)


def test_down_runs_teardown_command_once_after_the_gate_and_the_confirmation(tmp_path):
    marker = tmp_path / "marker"
    root = tmp_path / "proj"
    command = marker_command(marker, root / ".tether" / "remote" / "runs")
    project = teardown_project(root, command)
    project.doit("run", "train", check=True)
    run_id = project.run_ids()[-1]

    refused = project.doit("run", "down")  # no terminal, no confirm=yes
    assert refused.returncode != 0 and "confirm=yes" in refused.stderr, refused.stdout + refused.stderr
    assert f"and then run, if no other run is left there: {command}" in refused.stdout, refused.stdout  # in full, before anything happens
    assert not marker.exists() and project.remote_run(run_id).is_dir()

    code, said = interactive_down(project, "n")
    assert code != 0, said
    shown, asked = said.index(f"and then run, if no other run is left there: {command}"), said.index("delete it and run teardown_command? [y/N]")
    assert shown < asked, said
    assert not marker.exists() and project.remote_run(run_id).is_dir()

    code, said = interactive_down(project, "y")
    assert code == 0, said
    assert lines(marker) == ["gone"]  # ran once, after the run dir's removal
    assert "teardown-said-hi" in said and "then ran teardown_command" in said, said
    assert not project.remote_run(run_id).exists()
    stamp = json.loads((project.local_run(run_id) / "down.json").read_text())
    assert stamp["teardown_command"] == command and stamp["teardown_exit"] == 0

    again = project.doit("run", "down", "confirm=yes")
    assert again.returncode == 0 and "already removed" in again.stdout, again.stdout + again.stderr
    assert lines(marker) == ["gone"]


def test_down_with_confirm_yes_runs_it_and_a_failure_is_one_line(tmp_path):
    marker = tmp_path / "marker"
    command = f"echo ran >> {marker}; echo oops >&2; exit 7"
    project = teardown_project(tmp_path / "proj", command)
    project.doit("run", "train", check=True)
    run_id = project.run_ids()[-1]

    failed = project.doit("run", "down", "confirm=yes")
    assert failed.returncode != 0, failed.stdout + failed.stderr
    assert lines(marker) == ["ran"] and "oops" in failed.stderr
    errors = [line for line in failed.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, failed.stderr
    assert "exited 7" in errors[0] and "may still be billing" in errors[0], errors
    assert errors[0].endswith(f"run it by hand: {command}"), errors
    assert not project.remote_run(run_id).exists()  # the run dir went first, as it should


def test_teardown_command_waits_for_the_down_of_the_last_run_on_the_box(tmp_path):
    marker = tmp_path / "marker"
    root = tmp_path / "proj"
    command = marker_command(marker, root / ".tether" / "remote" / "runs")
    project = teardown_project(root, command)
    project.doit("run", "train", check=True)
    project.write_config(epochs=6, backend=json.dumps({"type": "local", "teardown_command": command}))
    project.doit("run", "train", check=True)  # a second run on the same box
    first, second = project.run_ids()[-2:]

    done = project.doit("run", "down", f"run={first}", "confirm=yes")
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"teardown_command not run: the far side still holds 1 other run(s) ({second})" in done.stdout, done.stdout
    assert not marker.exists() and not project.remote_run(first).exists() and project.remote_run(second).is_dir()

    done = project.doit("run", "down", f"run={second}", "confirm=yes")  # the last one: the box goes
    assert done.returncode == 0 and "then ran teardown_command" in done.stdout, done.stdout + done.stderr
    assert lines(marker) == ["gone"]


def test_a_down_the_gate_refuses_never_runs_teardown_command(tmp_path):
    marker = tmp_path / "marker"
    project = teardown_project(tmp_path / "proj", f"echo ran >> {marker}")
    project.doit("run", "train", check=True)
    run_id = project.run_ids()[-1]
    pulled = project.local_run(run_id) / "files" / "artifacts" / "model.json"
    pulled.write_bytes(pulled.read_bytes() + b" ")

    refused = project.doit("run", "down", "confirm=yes")
    assert refused.returncode != 0 and "artifacts/model.json" in refused.stderr, refused.stdout + refused.stderr
    assert not marker.exists() and project.remote_run(run_id).is_dir()
    assert "and then run" not in refused.stdout  # nothing was announced: the gate came first


# ---------------------------------------------------------------- the config keys


def load(tmp_path: Path, backend: dict) -> config.Job:
    project = make_project(tmp_path / "proj", backend_name="box", backend=json.dumps(backend))
    return config.load(str(project.root / "tether.yaml"))


def problems(tmp_path: Path, backend: dict) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        load(tmp_path, backend)
    return [p.split(": error: ", 1)[1] for p in caught.value.problems]


SSH = {"type": "ssh", "host": "gpu-box"}
SLURM = {"type": "slurm", "host": "login", "remote_dir": "~/tether"}


@pytest.mark.parametrize("backend, says", [
    (dict(SSH, keep_remote=True, teardown_command="vastai destroy instance 4242"),
     "teardown_command contradicts keep_remote: true"),
    (dict(SLURM, idle_stop={"after_s": 600, "command": "true"}), "idle_stop is for a box rented by the hour"),
    (dict(SLURM, teardown_command="true"), "teardown_command is for a rented box"),
    ({"type": "local", "idle_stop": {"after_s": 0, "command": "true"}}, "idle_stop: after_s 0 must be positive"),
    ({"type": "local", "idle_stop": {"after_s": 600}}, "idle_stop: command is empty"),
    ({"type": "local", "idle_stop": {"aftr_s": 600, "command": "true"}}, "unknown key 'aftr_s' in idle_stop "
                                                                         "(did you mean 'after_s'?)"),
    ({"type": "local", "teardown_command": " "}, "teardown_command is empty"),
], ids=["keep_remote", "slurm-idle_stop", "slurm-teardown", "after_s-0", "no-command", "typo", "empty-teardown"])
def test_contradictions_and_slurm_are_refused(tmp_path, backend, says):
    found = problems(tmp_path, backend)
    assert len(found) == 1 and says in found[0], found


def test_idle_stop_reaches_the_launcher_as_a_dict_with_warnings_for_risky_values(tmp_path):
    job = load(tmp_path, dict(SSH, idle_stop={"after_s": 30, "command": "vastai destroy instance 4242"},
                              teardown_command="vastai destroy instance 4242"))
    from tether.backends import ssh

    backend = ssh.Backend("box", job.backend_config, str(tmp_path / "state"))
    assert backend.idle_stop == {"after_s": 30.0, "command": "vastai destroy instance 4242"}
    assert backend.teardown_command == "vastai destroy instance 4242"
    warned = "\n".join(job.warnings)
    assert "after_s 30 is below 60 s" in warned and "says 'destroy'" in warned, job.warnings
    plain = load(tmp_path / "2", {"type": "local"})
    assert plain.backend_config.idle_stop is None and plain.backend_config.teardown_command is None
