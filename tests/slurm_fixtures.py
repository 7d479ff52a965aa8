"""The SLURM cluster the slurm tests share, and what they need to use it (a pytest plugin module).

`test_backend_slurm.py` and `test_slurm.py` load this with `pytest_plugins`, so one session-scoped
cluster (real munged + slurmctld + slurmd, and sshd as the login node: tests/slurm.py) serves both.
`test_slurm_multinode.py` starts its own 2-node cluster with `started_cluster(nodes=2)`, only for itself.

Far-side folders live under ~/.cache/tether-slurm-tests/<unique>: the slurm backend refuses
remote_dir under /tmp or /var/tmp, as compute nodes do not share those. Each is removed after its
test, once every job that works in it has been cancelled.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import Iterator

import pytest

from slurm import SlurmCluster

REMOTE_ROOT = Path.home() / ".cache" / "tether-slurm-tests"
POLL_ACK = "is below 10 s: every poll"  # the warning poll_interval_s: 1 earns, acknowledged in test configs


@contextlib.contextmanager
def started_cluster(nodes: int = 1, **settings: int) -> Iterator[SlurmCluster]:
    """A real SLURM of `nodes` slurmd with its login node (`settings`: SlurmCluster's cred_expire, kill_wait);
    every job cancelled and every daemon stopped after."""
    base = Path(tempfile.mkdtemp(prefix="tether-slurm-"))  # not pytest's 0700 tree: munged wants x on parents
    found = SlurmCluster(base, nodes, **settings)
    try:
        found.start()
        yield found
    finally:
        try:
            cancel_jobs(found, lambda: found.run("squeue", "-h", "-o", "%i").split())
        finally:
            found.stop()
            shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="session")
def cluster():
    """A real single-node SLURM with its login node, for the whole session; stop() cancels every job.

    KillWait (SIGTERM to SIGKILL of a cancelled or requeued job) is 15 s, above the test jobs' 5-s
    grace: a launcher SIGKILLed before it records its attempt's end (as on a loaded machine with
    KillWait 5) makes that attempt `lost`, which the requeue tests would rightly call a failure."""
    with started_cluster(kill_wait=15) as found:  # the launcher's grace (5 s in slurm_yaml) and its records fit
        yield found


def jobs_under(cluster: SlurmCluster, folder: Path) -> list[str]:
    """Ids of the jobs in the queue whose working folder is inside `folder`."""
    out = cluster.run("squeue", "-h", "-o", "%i|%Z")
    return [job for job, _, workdir in (line.partition("|") for line in out.splitlines())
            if workdir == str(folder) or workdir.startswith(f"{folder}/")]


def cancel_jobs(cluster: SlurmCluster, listed, timeout: float = 60) -> None:
    """scancel the jobs `listed()` names until the queue holds none of them.

    Once is not always enough: a tether job whose trainer takes SIGTERM for a preemption asks to be
    requeued (job.sh runs `scontrol requeue`), so it may come back PENDING; scancel it again.
    """
    deadline = time.monotonic() + timeout
    jobs = listed()
    while jobs:
        if time.monotonic() > deadline:
            raise AssertionError(f"jobs {jobs} still in the queue {timeout}s after scancel")
        cluster.run("scancel", *jobs)
        wait_until = time.monotonic() + 1.0
        while (jobs := listed()) and time.monotonic() < wait_until:
            time.sleep(0.1)


def cancel_jobs_under(cluster: SlurmCluster, folder: Path) -> None:
    """scancel every job working inside `folder`; return once the queue no longer holds them."""
    cancel_jobs(cluster, lambda: jobs_under(cluster, folder))


def new_remote_dir() -> Path:
    return REMOTE_ROOT / f"t-{uuid.uuid4().hex[:12]}"


def remove_remote_dir(cluster: SlurmCluster, folder: Path) -> None:
    cancel_jobs_under(cluster, folder)
    shutil.rmtree(folder, ignore_errors=True)
    try:
        REMOTE_ROOT.rmdir()  # the last one out removes the parent
    except OSError:
        pass


@pytest.fixture
def remote(cluster):
    """A fresh far-side folder for one test (a path; the backend creates it), removed afterwards."""
    folder = new_remote_dir()
    yield folder
    remove_remote_dir(cluster, folder)


def slurm_backend_config(cluster: SlurmCluster, remote_dir: Path, **extra) -> dict:
    """The keys of a `type: slurm` backend whose login node is the cluster's sshd."""
    config = cluster.login.backend_config(remote_dir, type="slurm", partition="debug", time="00:10:00",
                                          poll_interval_s=1, exit_grace_s=2)
    config.pop("gpus")  # an ssh key, not a slurm one
    config.update(extra)
    return config


SLURM_CONFIG = """\
name: {name}
backend: hpc
code:
  paths: [{code}]
data:
  paths: [demo/points.csv]
trainer:
  type: command
  command: "{command}"
artifacts: [{artifacts}]
checkpoint: {{keep: 3, every: 50}}
restart: {{policy: {policy}, max_restarts: {max_restarts}}}
heartbeat_timeout_s: 60
grace_seconds: {grace}
validation:
  acknowledge: ["{ack}"]
backends:
  hpc: {backend}
"""


def slurm_yaml(cluster: SlurmCluster, remote_dir: Path, command: str, code: str = "demo/train.py",
               artifacts: str = "model.json, metrics.json", name: str = "demo", grace: float = 5,
               policy: str = "on-preempt", max_restarts: int = 3, **backend) -> str:
    """A tether.yaml whose backend `hpc` is the cluster (a command trainer)."""
    return SLURM_CONFIG.format(name=name, code=code, command=command, artifacts=artifacts, grace=grace,
                               policy=policy, max_restarts=max_restarts, ack=POLL_ACK,
                               backend=json.dumps(slurm_backend_config(cluster, remote_dir, **backend)))
