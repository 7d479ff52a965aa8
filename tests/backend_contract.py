"""The contract every backend keeps, written once against the public Backend interface.

A backend's test module subclasses `BackendContract` and supplies a `backend` fixture (a
fresh far side per test); the test methods here use nothing else: `install_launcher`,
`check`, `filesystem`, `far`, `launch`, `state`, `states`, `stop`, `teardown`. Runs are
pushed by hand through `filesystem()` (objects, tree.json, run.json) and built on the far side
with the far side's `materialize`, as the push phase does.

Every wait polls a condition against a deadline; nothing sleeps a fixed time.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from typing import Any, Callable

import pytest

from tether.paths import RunPaths
from tether.remote.protocol import Snapshot

# A small trainer that uses tether's runtime; options choose how it behaves.
TRAINER = r'''
import argparse, json, multiprocessing, os, signal, subprocess, sys, time
from tether.trainers import runtime

parser = argparse.ArgumentParser()
parser.add_argument("--exit", type=int, default=0, help="exit code at the end")
parser.add_argument("--wait", action="store_true", help="wait for RUN_DIR/go before finishing")
parser.add_argument("--steps", type=int, default=3, help="checkpoints to save before `ready`")
parser.add_argument("--on-term", choices=("checkpoint", "ignore", "default"), default="default")
parser.add_argument("--children", action="store_true", help="spawn child processes and a worker")
args = parser.parse_args()

run_dir = os.environ["TETHER_RUN_DIR"]
flag = runtime.stop_signal() if args.on_term == "checkpoint" else None
if args.on_term == "ignore":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)

resume = runtime.resume_from()
start = 0
if resume:
    with open(resume, "rb") as f:
        start = int(f.read().decode())
runtime.log("trainer-start", resume=os.environ.get("TETHER_RESUME_FROM", ""), start=start,
            pid=os.getpid(), pgid=os.getpgid(0))


def save(step):
    runtime.save_checkpoint(lambda f: f.write(str(step).encode()), step)


step = start
for step in range(start + 1, start + args.steps + 1):
    save(step)
    print("step", step, flush=True)

children = []
if args.children:
    marker = os.path.join(run_dir, "child-ignores-term")
    stubborn = ("import signal, sys\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                "open(sys.argv[1], 'w').close()\nwhile True:\n    signal.pause()\n")
    children.append(subprocess.Popen([sys.executable, "-c", stubborn, marker]).pid)
    children += [subprocess.Popen(["sleep", "1000"]).pid for _ in range(2)]
    worker = multiprocessing.get_context("fork").Process(target=signal.pause, daemon=True)
    worker.start()
    children.append(worker.pid)
    while not os.path.exists(marker):
        time.sleep(0.01)

runtime.log("ready", children=children, step=step)
while args.wait and not os.path.exists(os.path.join(run_dir, "go")):
    if flag is not None and flag.requested:
        save(step + 1)
        runtime.log("preempting", signal=flag.signal_name, step=step + 1)
        sys.exit(runtime.PREEMPTED_EXIT)
    time.sleep(0.01)

artifacts = os.environ["TETHER_ARTIFACTS_DIR"]
os.makedirs(os.path.join(artifacts, "eval"), exist_ok=True)
with open(os.path.join(artifacts, "model.json"), "w") as f:
    json.dump({"step": step}, f)
with open(os.path.join(artifacts, "eval", "metrics.json"), "w") as f:
    json.dump({"loss": 0.25}, f)
runtime.log("done", step=step)
sys.exit(args.exit)
'''

# Declared results: two patterns that match, one that matches nothing.
ARTIFACTS = ("model.json", "eval/*.json", "never-*.bin")
DATA = b"x,y\n1,2\n3,4\n"

TIMEOUT = 60.0  # generous for slow far sides; a passing wait returns as soon as its condition holds


def wait_for(predicate: Callable[[], Any], what: str, timeout: float = TIMEOUT) -> Any:
    """Poll `predicate` until it returns something truthy; that value, or AssertionError at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class BackendContract:
    """Mix into `class TestXxxBackend(BackendContract)` and provide a `backend` fixture."""

    # ------------------------------------------------------------ helpers

    @pytest.fixture
    def make_run(self, backend) -> Callable[..., RunPaths]:
        """make_run(*trainer_args, grace=1.0) -> RunPaths of a run pushed and materialized by hand."""
        assert backend.install_launcher() in (True, False)
        made: list[RunPaths] = []

        def make(*trainer_args: str, grace: float = 1.0, artifacts=ARTIFACTS) -> RunPaths:
            run = RunPaths(f"contract-{uuid.uuid4().hex[:10]}", backend.state_dir, backend.remote_dir)
            fs = backend.filesystem()
            code = TRAINER.encode()
            files = {sha256(code): code, sha256(DATA): DATA}
            lacking = backend.far.have(f"{backend.remote_dir}/objects", list(files))
            for digest in lacking:
                fs.makedirs(f"objects/{digest[:2]}", exist_ok=True)
                fs.pipe_file(f"objects/{digest[:2]}/{digest}", files[digest])
            tree = {"files": [
                {"root": "code", "path": "train.py", "sha256": sha256(code), "mode": 0o644},
                {"root": "data", "path": "sets/points.csv", "sha256": sha256(DATA), "mode": 0o644},
            ]}
            spec = {"run_id": run.run_id, "argv": ["{python}", "train.py", *trainer_args],
                    "artifacts": list(artifacts), "grace_seconds": grace, "checkpoint_keep": 2}
            fs.makedirs(run.remote, exist_ok=True)
            fs.pipe_file(run.remote_file("tree.json"), json.dumps(tree).encode())
            fs.pipe_file(run.remote_file("run.json"), json.dumps(spec).encode())
            built = backend.far.materialize(run.remote_abs)
            assert sorted(built) == ["code", "data", "work"], built
            made.append(run)
            return run

        yield make
        for run in made:  # leave nothing running, whatever the test did
            try:
                if backend.state(run).alive:
                    backend.stop(run, 1.0)
            except Exception:
                pass

    def events(self, backend, run: RunPaths) -> list[dict]:
        """events.jsonl of `run` (complete lines only: a line being appended is not read half)."""
        try:
            text = backend.filesystem().cat_file(run.remote_file("events.jsonl")).decode()
        except FileNotFoundError:
            return []
        return [json.loads(line) for line in text.split("\n")[:-1] if line.strip()]

    def wait_event(self, backend, run: RunPaths, name: str, count: int = 1) -> list[dict]:
        def found():
            hits = [e for e in self.events(backend, run) if e["event"] == name]
            return hits if len(hits) >= count else None
        return wait_for(found, f"{count} {name!r} event(s) of {run.run_id}")

    def wait_status(self, backend, run: RunPaths, *statuses: str) -> Snapshot:
        """The first snapshot whose status is one of `statuses` with no process left alive."""
        return wait_for(lambda: (lambda s: s if s.status in statuses and not s.alive else None)(
            backend.state(run)), f"{run.run_id} to be {statuses}")

    def go(self, backend, run: RunPaths) -> None:
        backend.filesystem().pipe_file(run.remote_file("go"), b"")

    def complete_and_check_manifest(self, backend, run: RunPaths) -> None:
        """Let a `--wait` run go: it completes, and its sealed manifest lists exactly what it wrote, each
        entry true to the bytes on the far side."""
        self.go(backend, run)
        done = self.wait_status(backend, run, "completed")
        assert done.state["exit_code"] == 0
        assert done.sealed is True and done.final is True

        fs = backend.filesystem()
        manifest = json.loads(fs.cat_file(run.remote_file("PULL_MANIFEST.json")))
        assert manifest["run_id"] == run.run_id and manifest["status"] == "completed"
        listed = {f["path"] for f in manifest["files"]}
        assert listed == {"run.json", "tree.json", "state.json", "events.jsonl", "train.log",
                          "checkpoints/ckpt-000000000003.ckpt",
                          "artifacts/model.json", "artifacts/eval/metrics.json"}
        for entry in manifest["files"]:
            data = fs.cat_file(run.remote_file(entry["path"]))
            assert (len(data), sha256(data)) == (entry["bytes"], entry["sha256"]), entry["path"]
        assert manifest["missing"] == ["never-*.bin"]

    # ------------------------------------------------------------ install, check, filesystem

    def test_install_launcher_copies_once_under_its_version(self, backend):
        assert backend.install_launcher() is True
        assert backend.install_launcher() is False
        fs = backend.filesystem()
        base = f"tether/{backend.version}"
        assert fs.cat_file(f"{base}/COMPLETE") == backend.version.encode()
        for rel in ("tether/__init__.py", "tether/remote/launcher.py", "tether/remote/fileio.py",
                    "tether/trainers/runtime.py"):
            assert fs.info(f"{base}/{rel}")["size"] > 0, rel
        leftovers = [p for p in fs.ls("tether", detail=False) if ".tmp-" in p]
        assert leftovers == []

    def test_check_reports_ready_with_items(self, backend):
        backend.install_launcher()
        report = backend.check()
        assert report.ready, report.text()
        names = {item["check"] for item in report.items}
        assert {"python", "writable", "disk", "inodes"} <= names
        assert all(item["ok"] is True and item["detail"] for item in report.items)
        assert report.as_dict()["ready"] is True

    def test_filesystem_is_rooted_at_remote_dir(self, backend):
        backend.install_launcher()
        fs = backend.filesystem()
        fs.makedirs("scratch", exist_ok=True)
        fs.pipe_file("scratch/a.txt", b"hello")
        assert fs.info("scratch/a.txt")["size"] == 5
        assert fs.cat_file("scratch/a.txt") == b"hello"
        fs.mv("scratch/a.txt", "scratch/b.txt")
        with pytest.raises(FileNotFoundError):
            fs.info("scratch/a.txt")
        assert fs.cat_file("scratch/b.txt") == b"hello"
        fs.rm("scratch/b.txt")
        with pytest.raises(FileNotFoundError):
            fs.info("scratch/b.txt")
        # the far side sees what the filesystem wrote, at remote_dir/objects
        data = b"object " + uuid.uuid4().hex.encode()
        present, absent = sha256(data), sha256(data + b"!")
        fs.makedirs(f"objects/{present[:2]}", exist_ok=True)
        fs.pipe_file(f"objects/{present[:2]}/{present}", data)
        lacking = backend.far.have(f"{backend.remote_dir}/objects", [present, absent])
        assert lacking == [absent]

    # ------------------------------------------------------------ launch and state

    def test_launch_runs_to_completion_and_seals_a_true_manifest(self, backend, make_run):
        run = make_run("--wait")
        started = backend.launch(run)
        assert started.outcome == "started", started
        assert started.state["attempt"] == 1
        self.wait_event(backend, run, "ready")
        live = backend.state(run)
        assert live.status == "running" and live.alive is True and live.sealed is False
        assert live.state["launcher_version"] == backend.version  # the shipped copy runs, not another
        self.complete_and_check_manifest(backend, run)

    def test_launch_never_starts_a_running_or_finished_run_again(self, backend, make_run):
        run = make_run("--wait")
        assert backend.launch(run).outcome == "started"
        self.wait_event(backend, run, "ready")
        assert backend.launch(run).outcome == "running"
        self.go(backend, run)
        self.wait_status(backend, run, "completed")
        again = backend.launch(run)
        assert again.outcome == "finished", again
        assert again.state["status"] == "completed"
        events = self.events(backend, run)
        assert [e["event"] for e in events].count("launch") == 1
        assert [e["event"] for e in events].count("trainer-start") == 1

    def test_failed_trainer_keeps_its_exit_code(self, backend, make_run):
        run = make_run("--exit", "3")
        assert backend.launch(run).outcome == "started"
        done = self.wait_status(backend, run, "failed")
        assert done.state["exit_code"] == 3
        assert done.sealed is True
        assert backend.launch(run).outcome == "finished"

    def test_states_answers_for_many_runs_at_once(self, backend, make_run):
        finished, running = make_run(), make_run("--wait")
        never = RunPaths("contract-never-pushed", backend.state_dir, backend.remote_dir)
        assert backend.launch(finished).outcome == "started"
        self.wait_status(backend, finished, "completed")
        assert backend.launch(running).outcome == "started"
        self.wait_event(backend, running, "ready")
        snaps = backend.states([finished, running, never])
        assert set(snaps) == {finished.run_id, running.run_id, never.run_id}
        assert snaps[finished.run_id].status == "completed"
        assert snaps[running.run_id].status == "running" and snaps[running.run_id].alive is True
        assert snaps[never.run_id].status == "absent"
        assert backend.state(finished).status == "completed"

    # ------------------------------------------------------------ stop

    def test_stop_ends_a_running_run_as_stopped(self, backend, make_run):
        run = make_run("--wait", "--on-term", "checkpoint")
        assert backend.launch(run).outcome == "started"
        self.wait_event(backend, run, "ready")
        outcome = backend.stop(run, 10.0)
        assert outcome.outcome == "stopped", outcome
        snap = backend.state(run)
        assert snap.status == "stopped" and snap.alive is False and snap.sealed is True
        assert [e["event"] for e in self.events(backend, run)].count("preempting") == 1  # it checkpointed
        assert backend.launch(run).outcome == "finished"  # a stopped run is never restarted

    def test_stop_kills_a_trainer_that_ignores_sigterm(self, backend, make_run):
        run = make_run("--wait", "--on-term", "ignore", grace=1.0)
        assert backend.launch(run).outcome == "started"
        self.wait_event(backend, run, "ready")
        outcome = backend.stop(run, 1.0)
        assert outcome.outcome == "stopped", outcome
        snap = backend.state(run)
        assert snap.status == "stopped" and snap.alive is False

    def test_stop_of_a_finished_run_changes_nothing(self, backend, make_run):
        run = make_run()
        assert backend.launch(run).outcome == "started"
        self.wait_status(backend, run, "completed")
        before = backend.filesystem().cat_file(run.remote_file("PULL_MANIFEST.json"))
        outcome = backend.stop(run, 1.0)
        assert outcome.outcome == "was not running", outcome
        assert backend.state(run).status == "completed"
        assert backend.filesystem().cat_file(run.remote_file("PULL_MANIFEST.json")) == before

    # ------------------------------------------------------------ teardown

    def test_teardown_removes_the_run_dir_once(self, backend, make_run):
        run = make_run()
        assert backend.launch(run).outcome == "started"
        self.wait_status(backend, run, "completed")
        first, others = backend.teardown(run)
        assert first.startswith("removed") and run.run_id not in others, (first, others)
        with pytest.raises(FileNotFoundError):
            backend.filesystem().info(run.remote)
        assert backend.state(run).status == "absent"
        again, left = backend.teardown(run)
        assert again.startswith("already removed") and left == others
        code = TRAINER.encode()  # the object store outlives the run
        assert backend.far.have(f"{backend.remote_dir}/objects", [sha256(code)]) == []
