"""One invocation's view: the job, its backend, and which run each task works on.

The run is resolved lazily, when a task first asks: `run=ID` if given; else the run this exact
job (code + data + run config + backend) already has; else, for `push` and later phases, a newly
minted id, and for observers (`pull`, `status`, ...), the latest run of this config and backend.
Because `push` records the run before anything is sent, every later phase of `train` finds it.
A sweep has one Session per point (`points`), sharing the backend and the far-side snapshots.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import tether
from tether import config as config_mod
from tether import sweep
from tether.backends import BACKEND_TYPES
from tether.backends.base import Backend
from tether.config import Job, asdict, changed_fields, suggest
from tether.errors import ConfigError, RunError
from tether.hashing import Entry, HashCache, tree, tree_hash
from tether.paths import RunPaths, check_run_id, mint_run_id, runs_dir
from tether.remote.fileio import atomic_write_json, read_json

VARIABLES = ("config", "backend", "run", "confirm", "json", "strict", "tolerance", "retry", "resume_from")
# What run.json holds besides the launch spec (so the spec can be read back out of a record).
RECORD_FIELDS = ("run_id", "name", "config", "backend", "backend_type", "job_hash", "code_hash", "data_hash",
                 "artifacts", "created_at", "created_on", "tether_version", "tether_package", "repro_of")


BOOLEANS = ("confirm", "json", "strict", "retry")  # the variables that say yes or no
YES, NO = ("1", "yes", "true", "on"), ("0", "no", "false", "off")


def check_variables(variables: dict[str, str]) -> None:
    """Refuse `key=value` words tether does not know (a typo would otherwise be ignored), and a
    yes-or-no variable whose word is neither."""
    unknown = [f"unknown variable {k}={variables[k]!r}{suggest(k, VARIABLES)}; tether takes: "
               f"{', '.join(VARIABLES)}" for k in variables if k not in VARIABLES]
    unclear = [_flag_problem(k, variables[k]) for k in BOOLEANS if k in variables]
    found = unknown + [p for p in unclear if p]
    if found:
        raise ConfigError(found)


def _flag_problem(name: str, word: str) -> str:
    """Why `name=word` is not a yes or a no ('' when it is one)."""
    if str(word).strip().lower() in YES + NO:
        return ""
    return f"{name}={word}: use 1/0, yes/no, true/false or on/off"


def flag(variables: dict[str, str], name: str) -> bool:
    """The yes-or-no variable `name` (absent: no); any word but the usual ones is refused, so
    `strict=on` is strict and `json=0` is not JSON."""
    word = variables.get(name)
    if word is None:
        return False
    problem = _flag_problem(name, word)
    if problem:
        raise ConfigError(problem)
    return str(word).strip().lower() in YES


def _check_id_variable(name: str, word: str) -> None:
    """A run id given as `name=word`, refused in one line (naming the variable unless it is `run`)."""
    try:
        check_run_id(word)
    except RunError as err:
        if name == "run":
            raise
        raise ConfigError(f"{name}: {err}") from None


def open_backend(job: Job, state_dir: str) -> Backend:
    module = BACKEND_TYPES[job.backend_config.type]
    cls = config_mod.load_class(module + ":Backend")
    return cls(job.backend, job.backend_config, state_dir)


@dataclass
class Session:
    """The job, the backend and the run resolution shared by every task of one invocation."""

    job: Job
    backend: Backend
    state_dir: str
    variables: dict[str, str] = field(default_factory=dict)
    point: Optional[sweep.Point] = None  # this session is one point of the job's sweep
    siblings: list["Session"] = field(default_factory=list)  # every point's session, when it is
    repro_of: Optional[str] = None  # this session re-runs that recorded run (tether.pipelines.repro)
    _run: Optional[RunPaths] = None

    @classmethod
    def open(cls, variables: dict[str, str], cwd: str = ".", files: bool = True) -> "Session":
        """The session of the config the variables name; `files=False`: its code and data may be absent."""
        check_variables(variables)
        path = variables.get("config") or config_mod.default_path(cwd)
        job = config_mod.load(path, variables.get("backend") or None, files)
        state_dir = os.path.abspath(os.path.join(cwd, ".tether"))
        for name in ("run", "resume_from"):
            if variables.get(name) is not None:
                _check_id_variable(name, variables[name])
        return cls(job, open_backend(job, state_dir), state_dir, variables)

    @functools.cached_property
    def points(self) -> list["Session"]:
        """One session per point of the job's sweep ([] without one): they share the backend, the
        hashed files and one cache of far-side snapshots, so a poll reads every point at once."""
        if not self.job.sweep:
            return []
        found = [Session(sweep.job_for(self.job, p), self.backend, self.state_dir, self.variables, point=p)
                 for p in sweep.points(self.job.sweep)]
        shared: dict[str, dict] = {}
        for one in found:
            one.__dict__.update(entries=self.entries, _snapshots=shared)
            one.siblings = found
        return found

    @property
    def params(self) -> Optional[dict]:
        return self.point.values if self.point else None

    # ------------------------------------------------------------ what this job is

    @functools.cached_property
    def entries(self) -> list[Entry]:
        cache = HashCache(os.path.join(self.state_dir, "hashcache.json"))
        found = (tree("code", self.job.root, self.job.code.paths, self.job.code.exclude, cache)
                 + tree("data", self.job.root, self.job.data.paths, self.job.data.exclude, cache))
        os.makedirs(self.state_dir, exist_ok=True)
        cache.save()
        return found

    @functools.cached_property
    def launch_spec(self) -> dict:
        """What the launcher needs (stored in run.json); everything in it is part of the run's identity."""
        spec = self.job.trainer.launch_spec()
        spec.update(checkpoint_keep=self.job.checkpoint.keep, checkpoint_every=self.job.checkpoint.every,
                    grace_seconds=self.job.grace_seconds, trainer=asdict(self.job.trainer),
                    restart=asdict(self.job.restart))
        if self.point:
            spec["params"] = self.point.values
        if self.variables.get("resume_from") and not self.repro_of:  # a repro's spec is the recorded one
            from tether.pipelines import resuming

            spec["resume_from"] = resuming.source(self, self.variables["resume_from"])  # part of the identity
        return spec

    @functools.cached_property
    def tree_hashes(self) -> dict[str, str | None]:
        """SHA-256 of the code tree and of the data tree (None when nothing is pushed)."""
        found = {}
        for root in ("code", "data"):
            entries = [e for e in self.entries if e.root == root]
            found[root] = tree_hash(entries) if entries else None
        return found

    @functools.cached_property
    def job_hash(self) -> str:
        launch = dict(self.launch_spec, trainer=changed_fields(self.job.trainer),  # defaults are no identity
                      restart=changed_fields(self.job.restart))
        parts = {"name": self.job.name, "backend": self.job.backend, **self.tree_hashes, "launch": launch}
        if self.repro_of:
            parts["repro_of"] = self.repro_of  # a reproduction is a run of its own, never the original
        return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()

    # ------------------------------------------------------------ which run

    def paths(self, run_id: str) -> RunPaths:
        return RunPaths(run_id, self.state_dir, self.backend.remote_dir)

    def known_runs(self) -> list[dict]:
        """run.json of every local run of this config and backend, oldest first."""
        found = []
        folder = runs_dir(self.state_dir)
        for run_id in os.listdir(folder) if os.path.isdir(folder) else ():
            record = read_json(os.path.join(folder, run_id, "run.json"))
            if (record and record.get("config") == self.job.source and record.get("backend") == self.job.backend
                    and record.get("params") == self.params and record.get("repro_of") == self.repro_of):
                found.append(record)
        return sorted(found, key=lambda r: (r["created_at"], r["run_id"]))

    def current(self) -> Optional[RunPaths]:
        """`run=ID`, else this exact job's existing run, else None."""
        if self._run is None:
            wanted = self.variables.get("run")
            if wanted:
                self._run = self.adopt(wanted)
            else:
                same = [r for r in self.known_runs() if r["job_hash"] == self.job_hash]
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
        run = self.paths(mint_run_id(self.job.name, self.job_hash))
        record = dict(self.launch_spec, run_id=run.run_id, name=self.job.name, config=self.job.source,
                      backend=self.job.backend, backend_type=self.backend.type, job_hash=self.job_hash,
                      code_hash=self.tree_hashes["code"], data_hash=self.tree_hashes["data"],
                      artifacts=list(self.job.artifacts), created_at=round(time.time(), 3),
                      created_on=socket.gethostname(), tether_version=self.backend.version,
                      tether_package=tether.__version__)
        if self.repro_of:
            record["repro_of"] = self.repro_of
        atomic_write_json(run.run_json, record)
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

    # ------------------------------------------------------------ far-side state, once per invocation

    @functools.cached_property
    def _snapshots(self) -> dict[str, dict]:
        return {}

    def snapshot(self, run: RunPaths, fresh: bool = False) -> dict:
        """The far side's state of `run`, fetched once per invocation unless `fresh`; in a sweep,
        one round trip (one squeue on SLURM) also refreshes every other point still in flight."""
        if fresh or run.run_id not in self._snapshots:
            others = [r for r in self.in_flight() if r.run_id != run.run_id]
            self._snapshots.update(self.backend.states([run] + others))
        return self._snapshots[run.run_id]

    def in_flight(self) -> list[RunPaths]:
        """The sweep's runs that were launched and are not yet followed to their end."""
        found = []
        for sibling in self.siblings:
            run = sibling.current()
            if run and os.path.exists(run.stamp("launch")) and not os.path.exists(run.stamp("watch")):
                found.append(run)
        return found

    def forget_snapshot(self, run: RunPaths) -> None:
        self._snapshots.pop(run.run_id, None)

    def record(self, run: RunPaths) -> dict[str, Any]:
        return read_json(run.run_json) or {}
