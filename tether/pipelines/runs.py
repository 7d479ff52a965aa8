"""Which run a job works on (`RunResolver`), and the far side's state of runs (`SnapshotCache`).

A run is resolved lazily, when a task first asks: `run=ID` if given; else the run this exact job
(its identity's job hash) already has; else, for `push` and later phases, a newly minted id, and
for observers (`pull`, `status`, ...), the latest run of this config and backend. Because `push`
records the run before anything is sent, every later phase of `train` finds it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import time
from types import MappingProxyType
from typing import Any, Callable, Mapping, Optional

import tether
from tether.backends.base import Backend
from tether.config import Job
from tether.errors import RunError
from tether.paths import RunPaths, check_run_id, mint_run_id, runs_dir
from tether.pipelines.identity import JobIdentity
from tether.remote.fileio import atomic_write_json, fsync_dir, read_json
from tether.remote.protocol import Snapshot
from tether.sweep import Point

UNRECORDED = re.compile(r"^\..+\.tmp-(\d+)$")  # a run folder being created (record_new), by that pid
# What run.json holds besides the launch spec (so the spec can be read back out of a record).
RECORD_FIELDS = ("run_id", "name", "config", "backend", "backend_type", "job_hash", "code_hash", "data_hash",
                 "artifacts", "created_at", "created_on", "tether_version", "tether_package", "repro_of", "controls")


def recorded_spec(record: Mapping[str, Any]) -> dict[str, Any]:
    """The launch spec a run.json holds: everything in it but the RECORD_FIELDS."""
    return {k: v for k, v in record.items() if k not in RECORD_FIELDS}


class RunResolver:
    """The run of one job in one invocation: resolved once, then the same for every task."""

    def __init__(self, job: Job, backend: Backend, state_dir: str, identity: Callable[[], JobIdentity],
                 wanted: Optional[str] = None, point: Optional[Point] = None,
                 repro_of: Optional[str] = None) -> None:
        self.job, self.backend, self.state_dir = job, backend, state_dir
        self.identity = identity  # called only when a run must be matched or minted (it hashes files)
        self.wanted = wanted  # `run=ID`
        self.point = point
        self.repro_of = repro_of
        self._run: Optional[RunPaths] = None

    @property
    def resolved(self) -> Optional[RunPaths]:
        """The run resolved so far (None before a task asked), without resolving one."""
        return self._run

    def paths(self, run_id: str) -> RunPaths:
        return RunPaths(run_id, self.state_dir, self.backend.remote_dir)

    def known_runs(self) -> list[dict]:
        """run.json of every local run of this config and backend (and sweep point), oldest first."""
        params = self.point.values if self.point else None
        found = []
        folder = runs_dir(self.state_dir)
        for run_id in os.listdir(folder) if os.path.isdir(folder) else ():
            if run_id.startswith("."):  # a run folder still being created (record_new)
                continue
            record = read_json(os.path.join(folder, run_id, "run.json"))
            if (record and record.get("config") == self.job.source and record.get("backend") == self.job.backend
                    and record.get("params") == params and record.get("repro_of") == self.repro_of):
                found.append(record)
        return sorted(found, key=lambda r: (r["created_at"], r["run_id"]))

    def current(self) -> Optional[RunPaths]:
        """`run=ID`, else this exact job's existing run, else None."""
        if self._run is None:
            if self.wanted:
                self._run = self.adopt(self.wanted)
            else:
                job_hash = self.identity().job_hash
                same = [r for r in self.known_runs() if r["job_hash"] == job_hash]
                self._run = self.paths(same[-1]["run_id"]) if same else None
        return self._run

    def run(self) -> RunPaths:
        """The run the forward phases work on: the current one, or a new one (recorded at once)."""
        if self.current() is None:
            self._run = self.create()
        return self._run

    def observed(self) -> RunPaths:
        """The run observers work on: the current one, else the latest of this config and backend."""
        current = self.current()
        if current is not None:
            return current
        runs = self.known_runs()
        if not runs:
            point = f" (sweep point {self.point.label})" if self.point else ""
            raise RunError(f"no run of {self.job.source}{point} on backend {self.job.backend} yet: "
                           f"start one with `doit run train`")
        return self.paths(runs[-1]["run_id"])

    def create(self) -> RunPaths:
        """Mint a run id for this job and record it locally (run.json), before anything else."""
        identity = self.identity()
        forget_unrecorded(runs_dir(self.state_dir))
        run = self.paths(mint_run_id(self.job.name, identity.job_hash))
        record = dict(identity.launch_spec, run_id=run.run_id, name=self.job.name, config=self.job.source,
                      backend=self.job.backend, backend_type=self.backend.type, job_hash=identity.job_hash,
                      code_hash=identity.tree_hashes["code"], data_hash=identity.tree_hashes["data"],
                      artifacts=list(self.job.artifacts), created_at=round(time.time(), 3),
                      created_on=socket.gethostname(), tether_version=self.backend.version,
                      tether_package=tether.__version__)
        if self.repro_of:
            record["repro_of"] = self.repro_of
        record_new(run, record)
        return run

    def adopt(self, run_id: str) -> RunPaths:
        """A run named on the command line; known here, or fetched from the far side's run.json."""
        run = self.paths(check_run_id(run_id))
        if os.path.exists(run.run_json):
            return run
        try:
            data = self.backend.far.cat(run.remote_file("run.json"))
        except FileNotFoundError:
            raise RunError(f"run {run_id} is unknown here and on backend {self.job.backend} "
                           f"({run.remote_abs}): check the id, or pass backend=NAME")
        atomic_write_json(run.run_json, json.loads(data))
        return run

    def record(self, run: RunPaths) -> dict[str, Any]:
        return read_json(run.run_json) or {}


def forget_unrecorded(folder: str) -> None:
    """Remove what a run's creation left when killed: its folder under a temporary name (see
    `record_new`), whose writer is dead. Such a run was never recorded, so nothing was sent for it."""
    for name in os.listdir(folder) if os.path.isdir(folder) else ():
        writer = UNRECORDED.match(name)
        if writer and not _alive(int(writer.group(1))):
            shutil.rmtree(os.path.join(folder, name), ignore_errors=True)


def record_new(run: RunPaths, record: dict) -> None:
    """Make the run's folder with its run.json in one rename: a kill leaves no run or a recorded one,
    never a run folder without run.json (which a rerun, minting a new id, would leave behind)."""
    parent = os.path.dirname(run.local)
    tmp = os.path.join(parent, ".%s.tmp-%d" % (run.run_id, os.getpid()))
    os.makedirs(tmp, exist_ok=True)
    atomic_write_json(os.path.join(tmp, "run.json"), record)
    os.rename(tmp, run.local)
    fsync_dir(parent)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class SnapshotCache:
    """The far side's state of runs, fetched once per invocation; one cache is shared by the points
    of a sweep, so a poll of one point's run also refreshes every other point still in flight."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self._states: dict[str, Snapshot] = {}
        self._followed: list[RunResolver] = []

    def follow(self, resolver: RunResolver) -> None:
        """Refresh `resolver`'s run with every poll, from its launch until it is followed to its end."""
        self._followed.append(resolver)

    @property
    def states(self) -> Mapping[str, dict]:
        """What is cached, by run id (a read-only view)."""
        return MappingProxyType(self._states)

    def snapshot(self, run: RunPaths, fresh: bool = False) -> Snapshot:
        """The far side's state of `run`, fetched once unless `fresh`; in a sweep, one round trip
        (one squeue on SLURM) also refreshes every other run in flight."""
        if fresh or run.run_id not in self._states:
            others = [r for r in self.in_flight() if r.run_id != run.run_id]
            self._states.update(self.backend.states([run] + others))
        return self._states[run.run_id]

    def in_flight(self) -> list[RunPaths]:
        """The followed runs that were launched and are not yet followed to their end."""
        found = []
        for resolver in self._followed:
            run = resolver.current()
            if run and os.path.exists(run.stamp("launch")) and not os.path.exists(run.stamp("watch")):
                found.append(run)
        return found

    def forget(self, run: RunPaths) -> None:
        self._states.pop(run.run_id, None)
