"""The Python API (tether.api) drives a whole run on the local backend and over ssh (a real sshd), and
agrees with `doit status json=1` at every state it is compared in. Every wait polls a condition."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import tether
from conftest import config_text, ssh_config_text
from helpers import sha256

AGES = ("heartbeat_age_s", "output_age_s")  # they grow between two looks


def cli_status(project, run_id: str) -> dict:
    done = project.doit("status", "json=1", f"run={run_id}", check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def same(project, run: tether.Run) -> tether.RunStatus:
    """The API's status and the CLI's, compared (ages apart); the API's."""
    mine = run.status()
    theirs = cli_status(project, run.run_id)
    assert {k: v for k, v in mine.as_dict().items() if k not in AGES} == \
           {k: v for k, v in theirs.items() if k not in AGES}
    return mine


def launches(project, run_id: str) -> int:
    """How many times the far side launched the run: its launcher's `launch` events."""
    return sum(e.get("event") == "launch" for e in project.events(run_id))


def finished_here(project, run: tether.Run) -> None:
    """`run` completed, and pulled and verified here by the call that returned it (its PULL_VERIFIED.json is
    there before verify() is called); each verified file's SHA-256 hashed again here, from the pulled file."""
    assert run.status().status == "completed"
    recorded = json.loads((project.local_run(run.run_id) / "PULL_VERIFIED.json").read_text())  # before verify()
    verified = run.verify()
    assert verified.manifest_sha256 == recorded["manifest_sha256"]
    assert {e.path for e in verified.files} >= {"artifacts/model.json", "artifacts/metrics.json", "events.jsonl"}
    for entry in verified.files:
        assert sha256(Path(verified.folder) / entry.path) == entry.sha256, entry.path


def drive(project, config: str, epochs: int) -> tether.Run:
    """train, follow, time out, stop, resume, wait, down refused, pull, verify, attach, down."""
    job = tether.Job.load(config, cwd=str(project.root))
    run = job.train(wait=False)
    for event in run.events(follow=True, poll_s=0.05):
        if event.get("event") == "step" and event["step"] >= 60:
            break
    mine, theirs = run.status().as_dict(), cli_status(project, run.run_id)
    # step, loss, metric, elapsed_s and the ages move between the two looks: compared are the fields that stay
    steady = ("status", "attempt", "where", "host", "backend", "run_id", "total")
    assert {k: mine[k] for k in steady} == {k: theirs[k] for k in steady}
    assert (mine["status"], mine["attempt"], mine["total"]) == ("running", 1, epochs * 25)
    with pytest.raises(TimeoutError):
        run.wait(timeout=0.2, progress=False)
    assert run.status().status == "running"  # the run goes on
    assert run.stop() == f"{run.run_id}: stopped"
    stopped = same(project, run)
    assert (stopped.status, stopped.attempt) == ("stopped", 1)
    assert job.train().run_id == run.run_id  # the same run, resumed
    final = run.wait(progress=False)
    assert (final.status, final.attempt, final.step, final.total) == ("completed", 2, final.total, epochs * 25)
    assert same(project, run).metrics["accuracy"] > 0.5
    with pytest.raises(tether.TetherError):
        run.down(confirm=True)  # nothing pulled and verified here yet: refused
    assert "artifacts/model.json" in {e.path for e in run.pull().files}
    verified = run.verify()
    assert {e.path for e in verified.files} >= {"artifacts/model.json", "events.jsonl"}, verified.files
    assert all(len(e.sha256) == 64 and e.bytes >= 0 for e in verified.files)
    assert len(run.log()) > len(run.log(lines=1)) > 0
    return run


def test_a_whole_run_through_the_api_on_the_local_backend(project, capfd):
    project.write_config(epochs=400)  # long enough to be stopped mid-way
    run = drive(project, "tether.yaml", 400)
    capfd.readouterr()
    assert run.wait(progress=False).status == "completed" and capfd.readouterr() == ("", "")
    with pytest.raises(tether.RunError, match="confirm=yes"):
        run.down(confirm=False)
    assert "removed" in run.down(confirm=True)
    assert not project.remote_run(run.run_id).exists()


def test_a_whole_run_over_ssh_and_attached_from_a_second_working_copy(project, sshd, tmp_path):
    far = tmp_path / "far"
    project.write_config(ssh_config_text(sshd, far, epochs=600))  # long enough to be stopped mid-way over ssh
    run = drive(project, "tether.yaml", 600)
    other = tmp_path / "other"
    shutil.copytree(project.root, other, ignore=shutil.ignore_patterns(".tether"))
    attached = tether.Run.attach("lab", run.run_id, cwd=str(other))
    assert attached.status().as_dict() | {k: None for k in AGES} == run.status().as_dict() | {k: None for k in AGES}
    with pytest.raises(tether.TetherError):
        attached.down(confirm=True)  # nothing verified in that copy: the gate holds
    assert "removed" in run.down(confirm=True)
    assert not (far / "runs" / run.run_id).exists()


def test_a_bad_setting_is_the_clis_config_error_and_check_is_the_preflight(project):
    report = tether.Job.load("tether.yaml", cwd=str(project.root)).check()
    assert report.ready and report.backend == "local", report.text()
    with pytest.raises(tether.ConfigError, match="unknown variable retyr"):
        tether.Job.load("tether.yaml", cwd=str(project.root), retyr=True)
    with pytest.raises(tether.RunError, match="no sweep"):
        tether.Job.load("tether.yaml", cwd=str(project.root)).sweep()


def test_train_with_wait_returns_the_run_completed_pulled_and_verified(project, capsys):
    job = tether.Job.load("tether.yaml", cwd=str(project.root))
    run = job.train(wait=True)
    finished_here(project, run)
    assert launches(project, run.run_id) == 1
    capsys.readouterr()
    assert job.train(wait=True).run_id == run.run_id  # all done already: nothing runs again, nothing is said
    assert capsys.readouterr().out == "" and launches(project, run.run_id) == 1


def test_sweep_with_wait_returns_each_point_completed_pulled_and_verified_and_again_the_same(project, capsys):
    project.write_config(config_text(command="{python} demo/train.py --epochs 2 --lr {lr} --seed {seed}")
                         + "sweep:\n  lr: [0.1, 0.03]\n  seed: [0]\n")
    job = tether.Job.load("tether.yaml", cwd=str(project.root))
    with pytest.raises(tether.RunError, match="has a sweep"):
        job.train()
    runs = job.sweep(wait=True)
    assert len({run.run_id for run in runs}) == 2 and sorted(project.run_ids()) == sorted(r.run_id for r in runs)
    stamps = {}
    for run in runs:
        finished_here(project, run)
        assert launches(project, run.run_id) == 1
        stamps[run.run_id] = (project.local_run(run.run_id) / "launch.json").read_text()
    capsys.readouterr()
    again = job.sweep()
    assert [r.run_id for r in again] == [r.run_id for r in runs]
    assert capsys.readouterr().out == ""  # no phase ran: every point was up, pushed and launched already
    for run in again:
        assert launches(project, run.run_id) == 1
        assert (project.local_run(run.run_id) / "launch.json").read_text() == stamps[run.run_id]
