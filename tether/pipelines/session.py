"""One invocation's view: the job, its backend, its identity, its run and the far side's state.

`Session` composes the pieces the phases use: the job's frozen identity (tether.pipelines.identity,
built on first use), its run resolver and a snapshot cache (tether.pipelines.runs). A sweep has
one Session per point (`points`), sharing the backend, the hashed files and one snapshot cache.
"""

from __future__ import annotations

import copy
import functools
import os
from dataclasses import InitVar, dataclass, field
from typing import Any, Mapping, Optional, Sequence

from tether import config as config_mod
from tether import environment, sweep
from tether.backends import BACKEND_TYPES
from tether.backends.base import Backend
from tether.config import Job, suggest
from tether.errors import ConfigError, RunError
from tether.hashing import Entry
from tether.paths import RunPaths, check_run_id
from tether.pipelines import identity as identity_mod
from tether.pipelines.identity import JobIdentity
from tether.pipelines.runs import RunResolver, SnapshotCache

VARIABLES = ("config", "backend", "run", "confirm", "json", "strict", "tolerance", "retry", "resume_from",
             "port", "host")

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
    return cls(job.backend, job.backend_config, state_dir, environment.wanted(job.environment, job.root))


@dataclass
class Session:
    """The job, the backend, its identity and its run, shared by every task of one invocation.

    `hashed` and `spec` are given where they are known already: a sweep point gets the whole job's
    hashed files; a reproduction the recorded files and launch spec (tether.pipelines.repro).
    """

    job: Job
    backend: Backend
    state_dir: str
    variables: dict[str, str] = field(default_factory=dict)
    point: Optional[sweep.Point] = None  # this session is one point of the job's sweep
    siblings: list["Session"] = field(default_factory=list)  # every point's session, when it is
    repro_of: Optional[str] = None  # this session re-runs that recorded run (tether.pipelines.repro)
    hashed: Optional[Sequence[Entry]] = None  # the code and data files, hashed; None: scanned on first use
    spec: Optional[Mapping[str, Any]] = None  # a reproduction's launch spec, as its run.json records it
    cache: InitVar[Optional[SnapshotCache]] = None  # a sweep's shared one; None: a cache of its own
    snapshots: SnapshotCache = field(init=False, repr=False)
    resolver: RunResolver = field(init=False, repr=False)

    def __post_init__(self, cache: Optional[SnapshotCache]) -> None:
        if self.spec is not None and not self.repro_of:
            raise ValueError("a recorded launch spec belongs to a reproduction: give repro_of too")
        self.snapshots = cache if cache is not None else SnapshotCache(self.backend)
        self.resolver = RunResolver(self.job, self.backend, self.state_dir, lambda: self.identity,
                                    self.variables.get("run"), self.point, self.repro_of)

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
        files, shared = self.entries, SnapshotCache(self.backend)
        found: list[Session] = []  # each point's siblings: this very list, complete after the loop
        for p in sweep.points(self.job.sweep):
            found.append(Session(sweep.job_for(self.job, p), self.backend, self.state_dir, self.variables, point=p,
                                 siblings=found, hashed=files, cache=shared))
        for one in found:
            shared.follow(one.resolver)
        return found

    @property
    def params(self) -> Optional[dict]:
        return self.point.values if self.point else None

    # ------------------------------------------------------------ what this job is

    @functools.cached_property
    def entries(self) -> tuple[Entry, ...]:
        """The job's code and data files, hashed: the given ones, else scanned once."""
        return tuple(self.hashed) if self.hashed is not None else identity_mod.scan(self.job, self.state_dir)

    @functools.cached_property
    def identity(self) -> JobIdentity:
        """Built once, on first use: a reproduction's from its recorded spec, else from the config
        (with `resume_from=`, the source run's checkpoint, looked up on the far side, is part of it)."""
        if self.spec is not None:
            return identity_mod.reproduction(self.job, self.entries, self.spec, self.repro_of or "")
        source = None
        if self.variables.get("resume_from") and not self.repro_of:
            from tether.pipelines import resuming  # it works on a Session: a layer above this one

            source = resuming.source(self, self.variables["resume_from"])
        return identity_mod.identify(self.job, self.entries, self.point, source, self.repro_of)

    @property
    def launch_spec(self) -> dict:
        """What the launcher needs (stored in run.json): a copy of the identity's, yours to change."""
        return copy.deepcopy(dict(self.identity.launch_spec))

    def controls(self) -> dict[str, Any]:
        """What the far side enforces on its own, with nobody watching (run.json's `controls`): limits,
        notifications, the box's idle stop. Not part of the run's identity: changing them never mints a
        new run, and a relaunch after `doit stop` or `retry=1` takes the config's current ones."""
        return {"max_wall_seconds": self.job.max_wall_seconds, "stall_timeout_s": self.job.stall_timeout_s,
                "notify": config_mod.asdict(self.job.notify), "idle_stop": self.backend.idle_stop}

    @property
    def tree_hashes(self) -> dict[str, Optional[str]]:
        return dict(self.identity.tree_hashes)

    @property
    def job_hash(self) -> str:
        return self.identity.job_hash

    # ------------------------------------------------------------ which run, and its far-side state

    def paths(self, run_id: str) -> RunPaths:
        return self.resolver.paths(run_id)

    def current(self) -> Optional[RunPaths]:
        """`run=ID`, else this exact job's existing run, else None."""
        return self.resolver.current()

    def run(self) -> RunPaths:
        """The run the forward phases work on: the current one, or a new one (recorded at once)."""
        return self.resolver.run()

    def observed(self) -> RunPaths:
        """The run observers work on: the current one, else the latest of this config and backend."""
        return self.resolver.observed()

    @property
    def resolved(self) -> Optional[RunPaths]:
        """The run resolved so far, without resolving one (None before a task asked)."""
        return self.resolver.resolved

    def record(self, run: RunPaths) -> dict[str, Any]:
        return self.resolver.record(run)

    def snapshot(self, run: RunPaths, fresh: bool = False) -> dict:
        """The far side's state of `run`, fetched once per invocation unless `fresh`."""
        return self.snapshots.snapshot(run, fresh)

    def forget_snapshot(self, run: RunPaths) -> None:
        self.snapshots.forget(run)

    def in_flight(self) -> list[RunPaths]:
        return self.snapshots.in_flight()
