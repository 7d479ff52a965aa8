"""The backend contract on the slurm backend: a real single-node SLURM behind a real sshd (no mocks).

`TestSlurmBackend` runs the same `BackendContract` suite as the local and ssh backends. Its far side
is the login node of the session's cluster (tests/slurm_fixtures.py); `launch` there is an sbatch of
the run's job.sh, `state` merges squeue into the launcher's snapshot and `stop` is scancel.

One contract test is adapted rather than inherited, for a reason that belongs to SLURM: see
`test_launch_runs_to_completion_and_seals_a_true_manifest` below.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.register_assert_rewrite("slurm_fixtures")
pytest_plugins = ["slurm_fixtures"]  # the session's one cluster, shared with test_slurm.py

from backend_contract import BackendContract, wait_for  # noqa: E402
from slurm_fixtures import new_remote_dir, remove_remote_dir, slurm_backend_config  # noqa: E402
from tether.backends.slurm import Backend, Config  # noqa: E402


class TestSlurmBackend(BackendContract):
    """The shared contract, far side reached over ssh, runs submitted to SLURM."""

    @pytest.fixture
    def backend(self, cluster, tmp_path: Path) -> Backend:
        remote = new_remote_dir()
        yield Backend("hpc", Config(**slurm_backend_config(cluster, remote)), str(tmp_path / ".tether"))
        remove_remote_dir(cluster, remote)  # after make_run's own stop: cancels whatever is left

    # ------------------------------------------------------------ adapted for SLURM

    def test_launch_runs_to_completion_and_seals_a_true_manifest(self, backend, make_run, cluster):
        """The contract's version asserts `launch(run).state["attempt"] == 1`: the local and ssh
        backends return once the launcher holds the run. sbatch returns when the job is queued (on a
        real cluster it may wait there for hours), so here `launch` answers with the job id and the
        attempt is asserted once the job runs. Everything else is the contract's test."""
        run = make_run("--wait")
        started = backend.launch(run)
        assert started.outcome == "started", started
        job_id = started.job_id
        assert job_id.isdigit(), started
        record = json.loads(backend.filesystem().cat_file(run.remote_file("slurm.json")))
        assert record["job_id"] == job_id and record["jobs"] == [job_id]
        assert f"--comment=tether:{run.run_id}" in record["flags"]
        self.wait_event(backend, run, "ready")
        live = backend.state(run)
        assert live.status == "running" and live.alive is True and live.sealed is False
        assert live.job_id == job_id and live.queue["state"] == "RUNNING"
        assert live.state["attempt"] == 1
        assert live.state["launcher_version"] == backend.version  # the shipped copy runs, not another
        self.complete_and_check_manifest(backend, run)
        scheduler = wait_for(lambda: "JobState=COMPLETED" in cluster.run("scontrol", "show", "job", "-o", job_id),
                             f"job {job_id} to be COMPLETED")
        assert scheduler
