"""The far-side launcher and the trainer runtime, on real processes in a run dir built by hand.

Layout as on any far side: <tmp>/runs/<id>/{run.json, code/train.py}. The trainer is the small
script of backend_contract.TRAINER (options pick its behaviour); it imports
`tether.trainers.runtime` through the PYTHONPATH the launcher gives it. Waits poll a condition
against a deadline; nothing sleeps a fixed time.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from backend_contract import ARTIFACTS, TRAINER, wait_for
from helpers import alive, group
from tether.remote import launcher, machine, objects, rundir, supervise
from tether.trainers import runtime

REPO = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------- helpers


def events(run_dir: str, name: str | None = None) -> list[dict]:
    path = os.path.join(run_dir, "events.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        lines = f.read().split("\n")[:-1]  # complete lines only
    found = [json.loads(line) for line in lines if line.strip()]
    return [e for e in found if name is None or e["event"] == name]


def wait_event(run_dir: str, name: str, count: int = 1) -> list[dict]:
    return wait_for(lambda: (lambda hits: hits if len(hits) >= count else None)(events(run_dir, name)),
                    f"{count} {name!r} event(s) in {run_dir}")


def wait_status(run_dir: str, *statuses: str) -> dict:
    """The first probe whose status is one of `statuses` and that finds nothing alive."""
    def check():
        snap = launcher.probe(run_dir)
        return snap if snap["status"] in statuses and not snap["alive"] else None
    return wait_for(check, f"{run_dir} to be {statuses}")


def state(run_dir: str) -> dict:
    return json.loads(Path(run_dir, "state.json").read_text())


def touch(run_dir: str, name: str) -> None:
    Path(run_dir, name).write_bytes(b"")


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def make_run(tmp_path: Path):
    """make_run(*trainer_args, grace=1.0, run_id="r1") -> run dir (str) under tmp/runs/."""
    made: list[str] = []

    def make(*trainer_args: str, grace: float = 1.0, run_id: str = "r1", artifacts=ARTIFACTS) -> str:
        run_dir = tmp_path / "runs" / run_id
        (run_dir / "code").mkdir(parents=True)
        (run_dir / "code" / "train.py").write_text(TRAINER)
        spec = {"run_id": run_id, "argv": ["{python}", "train.py", *trainer_args],
                "artifacts": list(artifacts), "grace_seconds": grace, "checkpoint_keep": 2}
        (run_dir / "run.json").write_text(json.dumps(spec))
        made.append(str(run_dir))
        return str(run_dir)

    yield make
    for run_dir in made:  # leave nothing behind, whatever the test did
        found = launcher.read_json(os.path.join(run_dir, "state.json")) or {}
        if launcher.is_alive(run_dir):
            launcher.stop(run_dir, 0.5)
        for pid in [p for e in events(run_dir, "ready") for p in e.get("children", [])]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        if found.get("pgid"):
            for pid in group(found["pgid"]):
                os.kill(pid, signal.SIGKILL)


# ---------------------------------------------------------------- start, run, seal


def test_start_runs_to_completion_and_seals_a_true_manifest(make_run):
    run_dir = make_run("--wait")
    result = launcher.start(run_dir)
    assert result["outcome"] == "started", result
    assert result["state"]["status"] == "running" and result["state"]["attempt"] == 1
    wait_event(run_dir, "ready")
    live = launcher.probe(run_dir)
    assert live["status"] == "running" and live["alive"] is True and live["sealed"] is False
    assert live["heartbeat_age_s"] is not None and live["heartbeat_age_s"] < 30
    beat = os.stat(Path(run_dir, "heartbeat")).st_mtime_ns
    wait_for(lambda: os.stat(Path(run_dir, "heartbeat")).st_mtime_ns > beat, "the heartbeat to be touched again",
             timeout=supervise.HEARTBEAT_S * 5)
    assert not Path(run_dir, "PULL_MANIFEST.json").exists()
    assert alive(live["state"]["pgid"])

    touch(run_dir, "go")
    done = wait_status(run_dir, "completed")
    final = done["state"]
    assert final["exit_code"] == 0 and final["ended_at"] >= final["started_at"]
    assert done["sealed"] is True
    assert [e["status"] for e in events(run_dir, "exit")] == ["completed"]
    # keep=2: only the two newest checkpoints stay
    assert sorted(os.listdir(Path(run_dir, "checkpoints"))) == ["ckpt-000000000002.ckpt", "ckpt-000000000003.ckpt"]
    assert "step 3" in Path(run_dir, "train.log").read_text()

    manifest = json.loads(Path(run_dir, "PULL_MANIFEST.json").read_text())
    assert manifest["run_id"] == "r1" and manifest["status"] == "completed"
    assert {f["path"] for f in manifest["files"]} == {
        "run.json", "state.json", "events.jsonl", "train.log", "checkpoints/ckpt-000000000003.ckpt",
        "artifacts/model.json", "artifacts/eval/metrics.json"}
    for entry in manifest["files"]:
        data = Path(run_dir, entry["path"]).read_bytes()
        assert entry["bytes"] == len(data), entry["path"]
        assert entry["sha256"] == sha256_bytes(data), entry["path"]
    assert manifest["missing"] == ["never-*.bin"]
    assert manifest["artifacts"] == list(ARTIFACTS)


def test_seal_is_immutable(make_run):
    run_dir = make_run()
    assert launcher.start(run_dir)["outcome"] == "started"
    wait_status(run_dir, "completed")
    before = Path(run_dir, "PULL_MANIFEST.json").read_bytes()
    with open(Path(run_dir, "train.log"), "ab") as f:
        f.write(b"written after sealing\n")
    assert rundir.seal(run_dir) == json.loads(before)
    assert Path(run_dir, "PULL_MANIFEST.json").read_bytes() == before


def test_start_of_a_finished_run_runs_nothing(make_run):
    run_dir = make_run()
    assert launcher.start(run_dir)["outcome"] == "started"
    wait_status(run_dir, "completed")
    state_before = Path(run_dir, "state.json").read_bytes()
    manifest_before = Path(run_dir, "PULL_MANIFEST.json").read_bytes()

    again = launcher.start(run_dir)
    assert again["outcome"] == "finished", again
    assert again["state"]["status"] == "completed"
    # start decided from state.json alone: no launcher process was spawned to find out
    assert "already ended" not in Path(run_dir, "launcher.log").read_text()
    # the foreground `run` (what a SLURM requeue calls) refuses as well
    direct = subprocess.run([sys.executable, "-m", "tether.remote.launcher", "run", run_dir],
                            cwd=REPO, capture_output=True, text=True, timeout=60)
    assert direct.returncode == 0 and "already ended" in direct.stderr
    assert len(events(run_dir, "launch")) == 1
    assert len(events(run_dir, "trainer-start")) == 1
    assert Path(run_dir, "state.json").read_bytes() == state_before
    assert Path(run_dir, "PULL_MANIFEST.json").read_bytes() == manifest_before


def test_start_while_running_says_running_and_starts_no_second_trainer(make_run):
    run_dir = make_run("--wait")
    assert launcher.start(run_dir)["outcome"] == "started"
    wait_event(run_dir, "ready")
    again = launcher.start(run_dir)
    assert again["outcome"] == "running", again
    direct = subprocess.run([sys.executable, "-m", "tether.remote.launcher", "run", run_dir],
                            cwd=REPO, capture_output=True, text=True, timeout=60)
    assert direct.returncode == launcher.ALREADY_RUNNING_EXIT
    touch(run_dir, "go")
    done = wait_status(run_dir, "completed")
    assert done["state"]["attempt"] == 1
    assert len(events(run_dir, "launch")) == 1
    assert len(events(run_dir, "trainer-start")) == 1


def test_failing_trainer_is_failed_with_its_exit_code(make_run):
    run_dir = make_run("--exit", "3")
    assert launcher.start(run_dir)["outcome"] == "started"
    done = wait_status(run_dir, "failed")
    assert done["state"]["exit_code"] == 3
    assert done["sealed"] is True
    assert json.loads(Path(run_dir, "PULL_MANIFEST.json").read_text())["status"] == "failed"
    assert launcher.start(run_dir)["outcome"] == "finished"


# ---------------------------------------------------------------- preemption


def test_trainer_that_checkpoints_and_exits_75_is_preempted_and_resumes(make_run):
    run_dir = make_run("--wait", "--on-term", "checkpoint")
    first = launcher.start(run_dir)
    assert first["outcome"] == "started"
    wait_event(run_dir, "ready")
    os.kill(first["state"]["pid"], signal.SIGTERM)  # what a scheduler does to the job
    done = wait_status(run_dir, "preempted")
    assert done["state"]["exit_code"] == runtime.PREEMPTED_EXIT
    assert done["state"]["signal"] == "SIGTERM"
    assert done["sealed"] is False and not Path(run_dir, "PULL_MANIFEST.json").exists()
    assert events(run_dir, "preempting")[0]["signal"] == "SIGTERM"
    saved = os.path.join(run_dir, "checkpoints", "ckpt-000000000004.ckpt")
    assert runtime.latest_checkpoint(os.path.join(run_dir, "checkpoints")) == saved

    touch(run_dir, "go")
    second = launcher.start(run_dir)  # preempted is not final: it may run again, from its checkpoint
    assert second["outcome"] == "started", second
    done = wait_status(run_dir, "completed")
    assert done["state"]["attempt"] == 2 and done["state"]["resumed_from"] == saved
    restart = events(run_dir, "trainer-start")[-1]
    assert restart["resume"] == saved and restart["start"] == 4
    assert json.loads(Path(run_dir, "artifacts", "model.json").read_text()) == {"step": 7}


def test_preemption_signal_the_trainer_does_not_handle_is_preempted_not_failed(make_run):
    """A scheduler's SIGTERM reaches the launcher, which forwards it; a trainer without a handler
    dies of it. Nobody asked tether to stop and the trainer did not fail: the run was preempted and
    must stay resumable (not `failed`, not sealed)."""
    run_dir = make_run("--wait")
    first = launcher.start(run_dir)
    assert first["outcome"] == "started"
    wait_event(run_dir, "ready")
    os.kill(first["state"]["pid"], signal.SIGTERM)
    done = wait_for(lambda: (lambda s: s if not s["alive"] and s["status"] != "running" else None)(
        launcher.probe(run_dir)), "the run to end")
    assert done["state"]["exit_code"] == -signal.SIGTERM
    assert done["status"] == "preempted", done["state"]
    assert done["sealed"] is False


# ---------------------------------------------------------------- stop


def test_stop_leaves_no_process_of_the_group_alive(make_run):
    run_dir = make_run("--wait", "--children", grace=2.0)
    started = launcher.start(run_dir)
    assert started["outcome"] == "started"
    ready = wait_event(run_dir, "ready")[0]
    pgid, launcher_pid = started["state"]["pgid"], started["state"]["pid"]
    children = ready["children"]
    assert len(children) == 4 and all(alive(p) for p in children)
    assert set(children) | {pgid} <= set(group(pgid))

    t0 = time.monotonic()
    outcome = launcher.stop(run_dir, 2.0)
    elapsed = time.monotonic() - t0
    assert outcome["outcome"] == "stopped", outcome
    assert outcome["status"] == "stopped"
    # the launcher cleared the group as soon as the trainer died (stop's own SIGKILL comes after grace + 5 s)
    assert elapsed < 5.0, elapsed
    assert group(pgid) == []
    assert [p for p in children if alive(p)] == []  # incl. one that ignores SIGTERM
    assert not alive(launcher_pid)
    assert state(run_dir)["status"] == "stopped"
    snap = launcher.probe(run_dir)
    assert snap["alive"] is False and snap["sealed"] is True


def test_children_left_behind_by_a_finished_trainer_are_killed(make_run):
    run_dir = make_run("--children")  # exits 0 without reaping its children
    started = launcher.start(run_dir)
    assert started["outcome"] == "started"
    done = wait_status(run_dir, "completed")
    children = events(run_dir, "ready")[0]["children"]
    assert len(children) == 4
    assert group(done["state"]["pgid"]) == []
    assert [p for p in children if alive(p)] == []


def test_stop_sigkills_a_trainer_that_ignores_sigterm_after_the_grace(make_run):
    run_dir = make_run("--wait", "--on-term", "ignore", grace=1.0)
    started = launcher.start(run_dir)
    assert started["outcome"] == "started"
    wait_event(run_dir, "ready")
    pgid = started["state"]["pgid"]
    t0 = time.monotonic()
    outcome = launcher.stop(run_dir, 1.0)
    elapsed = time.monotonic() - t0
    assert outcome["outcome"] == "stopped", outcome
    assert 1.0 <= elapsed < 5.0, elapsed  # it got its grace, then SIGKILL (not stop's late fallback)
    final = state(run_dir)
    assert final["status"] == "stopped" and final["exit_code"] == -signal.SIGKILL
    assert group(pgid) == []
    assert launcher.probe(run_dir)["alive"] is False


COUNTS_TERMS = """\
import os, select, signal, sys, time
r, w = os.pipe()
os.set_blocking(r, False)
os.set_blocking(w, False)
signal.set_wakeup_fd(w)  # one byte per SIGTERM delivered: Python's handler calls would coalesce
signal.signal(signal.SIGTERM, lambda *_: None)
open("ready", "w").close()
select.select([r], [], [], 60)
deadline = time.time() + 1.5  # a second TERM (forwarded twice, or sent twice) comes within this
while time.time() < deadline:
    select.select([], [], [], 0.05)
try:
    got = os.read(r, 64)
except BlockingIOError:  # no signal came
    got = b""
with open("terms.txt", "w") as f:
    f.write(str(got.count(bytes([signal.SIGTERM]))))
sys.exit(75)
"""


def test_a_repeated_stop_reaches_the_trainer_as_one_sigterm(make_run):
    """Two stops (a repeated `doit stop`, or job.sh's and SLURM's TERM): the trainer gets SIGTERM once.
    A second one can land while the script, checkpoint written, is exiting with Python's default
    handlers back, and it would die of the signal (-15) instead of exiting 75."""
    run_dir = Path(make_run(grace=10.0, artifacts=["terms.txt"]))  # stopped and cleared afterwards, whatever happens
    (run_dir / "code" / "train.py").write_text(COUNTS_TERMS)
    started = launcher.start(str(run_dir))
    assert started["outcome"] == "started", started
    wait_for((run_dir / "code" / "ready").exists, "the trainer's handler")
    os.kill(started["state"]["pid"], signal.SIGTERM)  # the first stop, straight to the launcher
    outcome = launcher.stop(str(run_dir), 10.0)  # and `doit stop`'s own
    assert outcome["outcome"] == "stopped", outcome
    final = state(str(run_dir))
    assert (final["status"], final["exit_code"]) == ("stopped", 75), final
    assert (run_dir / "code" / "terms.txt").read_text() == "1"


def test_stop_of_a_finished_run_says_it_was_not_running(make_run):
    run_dir = make_run()
    assert launcher.start(run_dir)["outcome"] == "started"
    wait_status(run_dir, "completed")
    before = Path(run_dir, "state.json").read_bytes()
    outcome = launcher.stop(run_dir, 1.0)
    assert outcome == {"outcome": "was not running", "status": "completed"}
    assert Path(run_dir, "state.json").read_bytes() == before
    assert not Path(run_dir, "stop_requested").exists()


# ---------------------------------------------------------------- lost and resumed


def test_killed_run_is_lost_and_a_relaunch_resumes_from_its_checkpoint(make_run):
    run_dir = make_run("--wait", "--steps", "2")
    started = launcher.start(run_dir)
    assert started["outcome"] == "started"
    wait_event(run_dir, "ready")
    os.kill(started["state"]["pid"], signal.SIGKILL)  # the machine's OOM killer, a node crash...
    os.killpg(started["state"]["pgid"], signal.SIGKILL)
    lost = wait_status(run_dir, "lost")
    assert lost["alive"] is False and lost["sealed"] is False
    assert launcher.stop(run_dir, 1.0)["outcome"] == "was not running"

    touch(run_dir, "go")
    again = launcher.start(run_dir)
    assert again["outcome"] == "started", again
    saved = os.path.join(run_dir, "checkpoints", "ckpt-000000000002.ckpt")
    assert again["state"]["attempt"] == 2 and again["state"]["restarts"] == 1
    assert again["state"]["resumed_from"] == saved
    done = wait_status(run_dir, "completed")
    assert done["state"]["attempt"] == 2
    starts = events(run_dir, "trainer-start")
    assert [s["resume"] for s in starts] == ["", saved]  # TETHER_RESUME_FROM as the trainer saw it
    assert starts[1]["start"] == 2
    assert [(e["attempt"], e["resumed_from"]) for e in events(run_dir, "launch")] == [(1, None), (2, saved)]
    # the killed attempt got the exit it never recorded, from the launcher after it: one per launch
    assert [(e["attempt"], e["status"]) for e in events(run_dir, "exit")] == [(1, "lost"), (2, "completed")]
    assert done["state"]["previous"]["status"] == "lost", done["state"]
    assert not Path(run_dir, "space_reserve").exists()  # a live launcher's room on a full disk, given back at its end
    assert json.loads(Path(run_dir, "artifacts", "model.json").read_text()) == {"step": 4}


# ---------------------------------------------------------------- probe, check, command line


def test_probe_command_answers_for_several_runs_and_absent_ones(make_run, tmp_path):
    run_dir = make_run()
    absent = str(tmp_path / "runs" / "nope")
    out = subprocess.run([sys.executable, "-m", "tether.remote.launcher", "probe",
                          json.dumps({"run_dirs": [run_dir, absent]})],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    found = json.loads(out.stdout)
    assert found[absent] == {"status": "absent"}
    assert found[run_dir]["status"] == "pending" and found[run_dir]["alive"] is False
    bad = subprocess.run([sys.executable, "-m", "tether.remote.launcher", "frobnicate"],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2


def test_check_reports_this_machine(tmp_path):
    found = machine.check({"remote_dir": str(tmp_path / "remote"), "require": ["json", "no_such_module_x"]})
    assert found["python_ok"] is True and found["writable"] is True
    assert found["free_mb"] > 1 and found["free_inodes"] > 0
    assert os.listdir(tmp_path / "remote") == [".tether-remote"]  # its claim; its write test leaves nothing
    assert found["missing_modules"] == ["no_such_module_x"]


# ---------------------------------------------------------------- objects


def test_materialize_builds_code_and_data_from_the_object_store(tmp_path):
    remote = tmp_path / "remote"
    contents = {"train": b"print('hi')\n", "tool": b"#!/bin/sh\necho tool\n", "csv": b"a,b\n1,2\n"}
    hashes = {k: sha256_bytes(v) for k, v in contents.items()}
    for key, data in contents.items():
        obj = Path(objects.object_path(str(remote / "objects"), hashes[key]))
        obj.parent.mkdir(parents=True, exist_ok=True)
        obj.write_bytes(data)
    run_dir = remote / "runs" / "m1"
    run_dir.mkdir(parents=True)
    tree = {"files": [
        {"root": "code", "path": "train.py", "sha256": hashes["train"], "mode": 0o644},
        {"root": "code", "path": "bin/tool.sh", "sha256": hashes["tool"], "mode": 0o755},
        {"root": "code", "path": "copy-of-points.csv", "sha256": hashes["csv"], "mode": 0o600},
        {"root": "data", "path": "sets/points.csv", "sha256": hashes["csv"], "mode": 0o644},
    ]}
    (run_dir / "tree.json").write_text(json.dumps(tree))

    assert sorted(objects.materialize(str(run_dir))["built"]) == ["code", "data", "work"]
    assert (run_dir / "code" / "train.py").read_bytes() == contents["train"]
    assert (run_dir / "code" / "bin" / "tool.sh").read_bytes() == contents["tool"]
    assert (run_dir / "code" / "bin" / "tool.sh").stat().st_mode & 0o777 == 0o755
    assert (run_dir / "code" / "copy-of-points.csv").stat().st_mode & 0o777 == 0o600
    assert (run_dir / "data" / "sets" / "points.csv").read_bytes() == contents["csv"]
    csv_object = Path(objects.object_path(str(remote / "objects"), hashes["csv"]))
    # code is a frozen copy; data may share the object's bytes
    assert (run_dir / "code" / "copy-of-points.csv").stat().st_ino != csv_object.stat().st_ino
    # work/: both trees at their project paths; code copied without write bits, data linked read-only
    assert (run_dir / "work" / "bin" / "tool.sh").stat().st_mode & 0o777 == 0o555
    assert (run_dir / "work" / "sets" / "points.csv").stat().st_ino == csv_object.stat().st_ino
    assert csv_object.stat().st_mode & 0o777 == 0o444
    assert sorted(p.name for p in run_dir.iterdir()) == ["code", "data", "tree.json", "work"]  # no tmp left
    assert objects.materialize(str(run_dir))["built"] == []  # once


def test_have_lists_the_hashes_the_store_lacks(tmp_path):
    store = tmp_path / "objects"
    present = sha256_bytes(b"here")
    Path(objects.object_path(str(store), present)).parent.mkdir(parents=True)
    Path(objects.object_path(str(store), present)).write_bytes(b"here")
    lacking = [sha256_bytes(b"one"), sha256_bytes(b"two")]
    assert objects.have(str(store), [lacking[0], present, lacking[1]]) == lacking
    out = subprocess.run([sys.executable, "-m", "tether.remote.launcher", "have",
                          json.dumps({"objects_dir": str(store), "hashes": [present, *lacking]})], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == lacking


# ---------------------------------------------------------------- runtime


@pytest.fixture
def runtime_env(tmp_path: Path, monkeypatch) -> Path:
    folder = tmp_path / "checkpoints"
    monkeypatch.setenv("TETHER_CHECKPOINT_DIR", str(folder))
    monkeypatch.setenv("TETHER_EVENTS", str(tmp_path / "events.jsonl"))
    monkeypatch.delenv("TETHER_CHECKPOINT_KEEP", raising=False)
    return folder


def test_save_checkpoint_keeps_only_the_newest(runtime_env, tmp_path, monkeypatch):
    for step in range(1, 6):
        path = runtime.save_checkpoint(lambda f, s=step: f.write(b"w%d" % s), step, keep=2)
        assert Path(path).read_bytes() == b"w%d" % step
    assert sorted(os.listdir(runtime_env)) == ["ckpt-000000000004.ckpt", "ckpt-000000000005.ckpt"]
    assert runtime.latest_checkpoint() == str(runtime_env / "ckpt-000000000005.ckpt")
    logged = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [(e["event"], e["step"], e["bytes"]) for e in logged] == [("checkpoint", s, 2) for s in range(1, 6)]

    monkeypatch.setenv("TETHER_CHECKPOINT_KEEP", "4")  # the launcher's setting when keep is not given
    for step in range(6, 12):
        runtime.save_checkpoint(lambda f: f.write(b"x"), step)
    assert [os.path.basename(p) for p in runtime.checkpoints()] == [
        "ckpt-000000000008.ckpt", "ckpt-000000000009.ckpt", "ckpt-000000000010.ckpt", "ckpt-000000000011.ckpt"]


def test_latest_checkpoint_of_a_missing_folder_is_none(tmp_path):
    assert runtime.latest_checkpoint(str(tmp_path / "nothing")) is None


def test_save_checkpoint_returns_the_checkpoint_it_wrote_even_below_older_steps(runtime_env):
    """A trainer that restarts its step count (it ignored TETHER_RESUME_FROM) saves step 1 next to
    a step 100 from the previous attempt: save_checkpoint must not delete what it just wrote and
    then crash reading its size."""
    runtime.save_checkpoint(lambda f: f.write(b"old"), 100, keep=1)
    path = runtime.save_checkpoint(lambda f: f.write(b"new"), 1, keep=1)
    assert Path(path).read_bytes() == b"new"


KILLED_MID_WRITE = r'''
import os, signal, sys
from tether.trainers import runtime

runtime.save_checkpoint(lambda f: f.write(b"step one, complete"), 1)

def half(f):
    f.write(b"step two, half of it")
    f.flush()
    open(sys.argv[1], "w").close()  # tell the test we are in the middle of the write
    while True:
        signal.pause()

runtime.save_checkpoint(half, 2)
'''


def test_sigkill_in_the_middle_of_a_checkpoint_keeps_the_previous_one(runtime_env, tmp_path):
    marker = tmp_path / "mid-write"
    script = tmp_path / "writer.py"
    script.write_text(KILLED_MID_WRITE)
    env = dict(os.environ, PYTHONPATH=str(REPO))  # the tether under test, whatever is installed
    proc = subprocess.Popen([sys.executable, str(script), str(marker)], env=env)
    try:
        wait_for(lambda: marker.exists() or proc.poll() is not None, "the writer to reach the middle")
        assert proc.poll() is None, "the writer exited before the test could kill it"
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    first = str(runtime_env / "ckpt-000000000001.ckpt")
    assert runtime.latest_checkpoint(str(runtime_env)) == first
    assert runtime.checkpoints(str(runtime_env)) == [first]
    assert Path(first).read_bytes() == b"step one, complete"
    names = os.listdir(runtime_env)
    assert "ckpt-000000000002.ckpt" not in names
    partial = [n for n in names if n != "ckpt-000000000001.ckpt"]
    # the half-written bytes exist, but only under a temporary name no reader takes for a checkpoint
    assert len(partial) == 1 and not runtime.CHECKPOINT_RE.match(partial[0])
    assert (runtime_env / partial[0]).read_bytes() == b"step two, half of it"
