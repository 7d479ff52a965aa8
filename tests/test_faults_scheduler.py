"""Fault suite part B on SLURM: squeue/scontrol failing, hanging, garbled or empty for a stretch of polls."""

from __future__ import annotations

import os
import random

import pytest

pytest.register_assert_rewrite("slurm_fixtures", "faults_scheduler", "faults_net")
pytest_plugins = ["slurm_fixtures"]  # the session's one real cluster

from faults_net import make_project  # noqa: E402
from faults_scheduler import MODES, SLURM, FlakyScheduler, ended_in_outage, healthy_through, queued_through  # noqa: E402
from slurm_fixtures import new_remote_dir, remove_remote_dir  # noqa: E402

SEED = int(os.environ.get("TETHER_FAULT_SEED", "1515"))


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


def test_a_healthy_job_outlives_squeue_failing_hanging_garbled_and_empty(flaky, tmp_path):
    scheduler, remote = flaky
    root = make_project(tmp_path / "proj", scheduler.login, remote, SEED, steps=300, policy="on-failure", **SLURM)
    stretches = [(mode, 2) for mode in random.Random(SEED).sample(MODES, len(MODES))]
    results = healthy_through(root, scheduler, remote, SEED, 300, stretches)
    failed = [(r.moment, r.failures) for r in results if r.failures]
    assert not failed, f"seed {SEED} (TETHER_FAULT_SEED={SEED} replays it): {failed}"


def test_a_job_cancelled_while_the_scheduler_is_down_is_reported_with_its_real_reason(flaky, tmp_path, cluster):
    scheduler, remote = flaky
    root = make_project(tmp_path / "proj", scheduler.login, remote, SEED, steps=400, policy="on-failure", **SLURM)
    result = ended_in_outage(root, scheduler, remote, SEED, cluster, "fail", polls=3)
    assert not result.failures, f"seed {SEED}: {result.failures} {result.notes}"


def test_a_queued_job_is_never_submitted_again_while_squeue_lies_or_fails(flaky, tmp_path):
    """The snowball (a status-fetch error read as "the job is gone", so it is launched again): a job held
    PENDING (--begin an hour away) while squeue prints garbage, nothing, or fails: watch keeps waiting,
    no second sbatch."""
    scheduler, remote = flaky
    root = make_project(tmp_path / "proj", scheduler.login, remote, SEED, steps=20, policy="on-failure",
                        sbatch_options=["--begin=now+3600"], **SLURM)
    results = queued_through(root, scheduler, remote, SEED, most_polls=2)
    failed = [(r.moment, r.failures) for r in results if r.failures]
    assert not failed, f"seed {SEED} (TETHER_FAULT_SEED={SEED} replays it): {failed}"
