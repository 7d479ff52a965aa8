"""Fault suite part B on SLURM: squeue/scontrol failing, hanging, garbled or empty for a stretch of polls."""

from __future__ import annotations

import os
import random

import pytest

pytest.register_assert_rewrite("slurm_fixtures")
pytest_plugins = ["slurm_fixtures"]  # the session's one real cluster

from faults_net import check_run, expected_artifacts, make_project, requests, start, wait, far_lines  # noqa: E402
from faults_scheduler import MODES, SAID, FlakyScheduler, jobs_submitted, scheduler_lines  # noqa: E402
from slurm_fixtures import new_remote_dir, remove_remote_dir  # noqa: E402

SEED = int(os.environ.get("TETHER_FAULT_SEED", "1515"))
SLURM = dict(drop=("gpus",), type="slurm", partition="debug", time="00:10:00", poll_interval_s=1, exit_grace_s=2)


@pytest.fixture
def flaky(cluster, tmp_path):
    """A login sshd whose sessions find the flaky squeue/scontrol first; a fresh shared remote_dir."""
    found = FlakyScheduler(tmp_path / "flaky", str(cluster.conf))
    found.login.start()
    remote = new_remote_dir()
    yield found, remote
    found.heal()
    found.login.stop()
    remove_remote_dir(cluster, remote)


def run_to_first_step(flaky, tmp_path, steps: int):
    scheduler, remote = flaky
    root = make_project(tmp_path / "proj", scheduler.login, remote, SEED, steps=steps, sleep=0.05,
                        policy="on-failure", **SLURM)
    bg = start(root, "run", "train")
    wait(lambda: any(line.startswith("step ") for line in far_lines(remote, "train.log")) or bg.proc.poll() is not None,
         120, "the job's first step")
    assert bg.proc.poll() is None, bg.output()
    return root, bg


def outage(bg, scheduler, name: str, mode: str, polls: int) -> None:
    """`name` in `mode` until watch has polled `polls` more times (a stretch of polls, not a fixed time)."""
    scheduler.set(name, mode)
    seen = requests(bg, "probe")
    wait(lambda: requests(bg, "probe") >= seen + polls + 1 or bg.proc.poll() is not None, 60, f"{polls} polls")


def test_a_healthy_job_outlives_squeue_failing_hanging_garbled_and_empty(flaky, tmp_path):
    scheduler, remote = flaky
    order = random.Random(SEED).sample(MODES, len(MODES))
    root, bg = run_to_first_step(flaky, tmp_path, steps=300)
    try:
        for mode in order:
            outage(bg, scheduler, "squeue", mode, polls=2)
        assert bg.proc.poll() is None, f"seed {SEED}, order {order}: watch ended in the outage:\n{bg.output()}"
        scheduler.heal()
        code = bg.finish(timeout=120)
    finally:
        scheduler.heal()
        bg.kill()
    err = bg.text()
    assert code == 0, f"seed {SEED}, order {order}:\n{bg.output()}"
    for mode, words in SAID.items():
        assert any(words in line for line in scheduler_lines(err)), f"seed {SEED}: no line for {mode}:\n{err}"
    assert jobs_submitted(remote) and len(jobs_submitted(remote)) == 1, jobs_submitted(remote)
    failures = check_run(root, remote, expected_artifacts(root, steps=300))
    assert not failures, f"seed {SEED}, order {order}: {failures}"


def test_a_job_cancelled_while_the_scheduler_is_down_is_reported_with_its_real_reason(flaky, tmp_path, cluster):
    scheduler, remote = flaky
    root, bg = run_to_first_step(flaky, tmp_path, steps=400)
    try:
        job = jobs_submitted(remote)[0]
        scheduler.set("squeue", "fail")
        scheduler.set("scontrol", "fail")
        cluster.run("scancel", job)  # the real scancel: the job really ends while nobody can ask
        wait(lambda: not cluster.run("squeue", "-h", "-j", job), 60, f"job {job} to leave the queue")
        outage(bg, scheduler, "squeue", "fail", polls=4)
        assert bg.proc.poll() is None, f"watch decided while the scheduler was down:\n{bg.output()}"
        scheduler.heal()
        code = bg.finish(timeout=60)
    finally:
        scheduler.heal()
        bg.kill()
    err = bg.text()
    assert code != 0 and f"SLURM job {job} was cancelled from outside tether" in err, bg.output()
    assert scheduler_lines(err), err
    assert jobs_submitted(remote) == [job]  # never submitted again
