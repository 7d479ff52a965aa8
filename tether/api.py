"""The public Python API: a job and its runs; the doit tasks go through it, and it calls the phase functions.

    job = tether.Job.load("tether.yaml", backend="lab")
    run = job.train()              # up, push, launch: `doit run launch`
    run.wait()                     # watch: `doit run watch`
    run.pull(); run.verify()       # `doit pull` and `doit run verify`
    run.down(confirm=True)         # `doit run down confirm=yes`, behind the same gate

Every call of a loaded Job (and of its Runs) opens its own Session, as one CLI invocation does, and
closes its backend after. `Job.over(s)` and `Run.over(s)` work on an open Session instead: the action of
each doit task of a phase (tether.pipelines.tasks) is one such call on its invocation's one Session, so
the CLI and the API are one path; `edge`, around every task's Session, is the one place where a torn
state file or a lost connection becomes tether's error.
Errors are tether's own tree (tether.errors), never a doit TaskFailed:

    TetherError               a local state file is torn (its message says what to put back)
     +-- ConfigError          a bad config file or setting (Job.load, Run.attach)
     +-- RunError             unknown run id; a run that ended without completing (wait, train(wait=True));
     |                        down not confirmed; sweep() of a job without a sweep
     +-- BackendError         the far side is unreachable (the connection lost), not ready (train's up) or
     |    |                   refused an operation
     |    +-- RemoteCommandError   a far-side command exited non-zero
     +-- ManifestError        pulled files do not match the far side's manifest (verify, down)
    TimeoutError (builtin)    wait(timeout=...) ran out; the run goes on
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Optional

from tether import manifest
from tether.backends.base import Report
from tether.errors import BackendError, RunError, TetherError
from tether.manifest import FileEntry
from tether.pipelines import observe, phases, teardown
from tether.pipelines.observe import EventReader, RunStatus
from tether.pipelines.session import Session
from tether.remote.fileio import TornFile, read_json

__all__ = ["Job", "Run", "RunStatus", "Verified"]

FORWARD = ("up", "push", "launch")  # what `doit run launch` runs, each skipped when its *_done says so


@dataclass(frozen=True)
class Verified:
    """A run's verified files (PULL_VERIFIED.json with the manifest's sizes and SHA-256)."""

    run_id: str
    manifest_sha256: str
    files: tuple[FileEntry, ...]  # each verified file: path under the run dir, bytes, sha256
    bytes: int
    remote_only: Mapping[str, str]  # files left on the far side on purpose, and why
    folder: str  # where the pulled files are


def _words(settings: Mapping[str, Any]) -> dict[str, str]:
    """Settings as the command line's key=value words: booleans as yes/no, None left out."""
    return {k: ("yes" if v else "no") if isinstance(v, bool) else str(v) for k, v in settings.items()
            if v is not None}


@contextlib.contextmanager
def edge(opener: Callable[[], Session]) -> Iterator[Session]:
    """The Session `opener` gives, with the edge's translations, for the CLI and the API alike: a torn local
    state file is a TetherError saying what to put back; a lost connection a BackendError. Any other error
    goes out as it is (one tether does not expect is a bug: its traceback is the report)."""
    s: Optional[Session] = None
    try:
        s = opener()
        yield s
    except TornFile as err:
        raise TetherError(str(err)) from None
    except (TetherError, phases.StillGoing):
        raise
    except Exception as err:
        if s is None or not s.backend.is_transport_error(err):
            raise
        raise BackendError(f"lost the connection to backend {s.job.backend} ({type(err).__name__}: {err}); "
                           f"nothing is lost: run the same command again") from err


@contextlib.contextmanager
def _opened(variables: Mapping[str, str], cwd: str) -> Iterator[Session]:
    """A Session of its own, as one CLI invocation has it, inside the edge; its backend closed after."""
    s: Optional[Session] = None
    try:
        with edge(lambda: Session.open(dict(variables), cwd)) as s:
            yield s
    finally:
        if s is not None:
            s.backend.close()


class _Sessions:
    """Where a Job's or a Run's calls get their Session: an open one given (never closed here), or one of
    their own per call, opened from the command line's words."""

    def __init__(self, variables: Mapping[str, str], cwd: str, session: Optional[Session] = None) -> None:
        self.variables, self.cwd, self._given = dict(variables), cwd, session

    def _session(self) -> contextlib.AbstractContextManager[Session]:
        given = self._given
        return edge(lambda: given) if given is not None else _opened(self.variables, self.cwd)


def _say(message: Optional[str]) -> None:
    """A phase's message, printed as the CLI prints it."""
    if message:
        print(message)


class Job(_Sessions):
    """A config on one backend, with the command line's settings: it trains and sweeps."""

    @classmethod
    def load(cls, config: str = "tether.yaml", backend: Optional[str] = None, cwd: Optional[str] = None,
             **settings: Any) -> "Job":
        """The job of `config` (relative to `cwd`) on `backend` (None: the config's own); `settings`
        are the command line's key=value variables (retry=True, resume_from=ID, ...). ConfigError
        lists every problem."""
        cwd = os.path.abspath(cwd or ".")
        variables = _words(dict(settings, config=os.path.join(cwd, config), backend=backend))
        with _opened(variables, cwd):
            pass  # the config and the settings are checked now, as the CLI checks them
        return cls(variables, cwd)

    @classmethod
    def over(cls, s: Session) -> "Job":
        """The job of an open Session (a sweep point's is that point's): every call works on `s` and none
        closes its backend. A doit task's action is such a call on its invocation's one Session."""
        return cls(s.variables, os.path.dirname(s.state_dir), s)

    def check(self) -> Report:
        """The backend's preflight (what `doit check` shows); it does not raise when not ready: see `.ready`."""
        with self._session() as s:
            return observe.preflight(s)

    def up(self) -> str:
        """Preflight the backend and copy the launcher there, now (`doit run up`); what it did."""
        with self._session() as s:
            return phases.up(s)

    def push(self) -> str:
        """Upload the code and data the far side lacks, now (`doit run push`); what it sent."""
        with self._session() as s:
            return phases.push(s)

    def launch(self) -> str:
        """Start the run detached (`doit run launch`; a launched run is never launched twice); what it did."""
        with self._session() as s:
            return phases.launch(s)

    def train(self, wait: bool = False) -> "Run":
        """up, push and launch, each unless done (`doit run launch`; never launched twice); wait=True:
        then watch, pull and verify, each unless done, as `doit run train` does."""
        with self._session() as s:
            if s.job.sweep and not s.point:
                raise RunError(f"{s.job.source} has a sweep: job.sweep() runs its points")
            _advance(Job.over(s), s, FORWARD)
            run = self._run(s)
        if wait:
            _finish(run)
        return run

    def sweep(self, wait: bool = False) -> list["Run"]:
        """One Run per sweep point, each up, pushed and launched unless done; wait=True: then each watched,
        pulled and verified unless done. RunError for a job without a sweep."""
        with self._session() as s:
            if not s.points:
                raise RunError(f"{s.job.source} has no sweep: add a `sweep:` section, or use job.train()")
            _advance(Job.over(s), s, ("up",))
            arrays = s.backend.launches_arrays  # one job array for every point, once all are pushed
            for point in s.points:
                _advance(Job.over(point), point, ("push",) if arrays else ("push", "launch"))
            for point in s.points if arrays else ():
                _advance(Job.over(point), point, ("launch",))
            runs = [self._run(point) for point in s.points]
        for run in runs if wait else ():
            _finish(run)
        return runs

    def _run(self, s: Session) -> "Run":
        """The run `s` works on: on `s` itself for a Job over a Session, else by id, with sessions of its own."""
        if self._given is not None:
            return Run.over(s)
        return Run(dict(self.variables, run=s.run().run_id), self.cwd)


def _advance(job: Job, s: Session, names: tuple[str, ...]) -> None:
    """Each phase in `names` unless its *_done check says it is done: what doit's uptodate decides."""
    for name in names:
        if not getattr(phases, f"{name}_done")(s):
            _say(getattr(job, name)())


def _finish(run: "Run") -> None:
    """Watch the run to its end, then pull and verify it unless that is done (as `doit run train`'s
    uptodate decides), in one session."""
    with run._session() as s:
        here = Run.over(s)
        here.wait()
        if not phases.pulled_done(s):
            here.pull()


class Run(_Sessions):
    """One run, by id: what `doit ... run=ID` looks at, from this working copy or any other."""

    def __repr__(self) -> str:
        return f"Run({self.run_id!r})"

    @property
    def run_id(self) -> str:
        """The run's id: `run=ID`, else (a Run over a Session) the run that Session works on."""
        if self.variables.get("run"):
            return self.variables["run"]
        with self._session() as s:
            return (s.resolved or s.observed()).run_id

    @classmethod
    def attach(cls, config_or_backend: str, run_id: str, cwd: Optional[str] = None) -> "Run":
        """The run `run_id` of a config path, or of a backend of the default config; RunError when
        neither this machine nor the far side knows it."""
        cwd = os.path.abspath(cwd or ".")
        path = os.path.join(cwd, config_or_backend)
        given = {"config": path} if os.path.isfile(path) else {"backend": config_or_backend}
        run = cls(dict(given, run=run_id), cwd)
        with run._session() as s:
            s.observed()  # known here, or its run.json fetched from the far side
        return run

    @classmethod
    def over(cls, s: Session) -> "Run":
        """The run an open Session works on (its `run=ID`, its job's current or latest run): every call
        works on `s` and none closes its backend. A doit task's action is such a call."""
        return cls(s.variables, os.path.dirname(s.state_dir), s)

    def status(self) -> RunStatus:
        """The run's state now, as `doit status` reports it (`as_dict()`: its json=1 object)."""
        with self._session() as s:
            run = s.observed()
            return observe.summary(s, run, s.snapshot(run, fresh=True))

    def events(self, follow: bool = False, poll_s: float = 0.5) -> Iterator[dict]:
        """The run's events (events.jsonl), one dict each; follow=True: keep going until the run is final."""
        with self._session() as s:
            run = s.observed()
            reader = EventReader(s.backend, run)
            while True:
                final = follow and s.snapshot(run, fresh=True).final
                yield from reader.read()
                if not follow or final:
                    return
                time.sleep(poll_s)

    def log(self, lines: Optional[int] = None) -> str:
        """train.log as text (its last `lines` lines when given); '' before the trainer wrote any."""
        with self._session() as s:
            run = s.observed()
            if lines is not None:
                return observe.tail_text(s.backend.far, run, lines=lines)
            try:
                return s.backend.far.cat(run.remote_file("train.log")).decode(errors="replace")
            except FileNotFoundError:
                return ""

    def watch(self, timeout: Optional[float] = None, progress: bool = True) -> str:
        """Follow the run until it ends, now (`doit run watch`; progress=False prints nothing) and say how it
        ended; RunError when it ended without completing, TimeoutError after `timeout` s (it goes on)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._session() as s, _silenced(not progress):
            return phases.watch(s, deadline=deadline)

    def wait(self, timeout: Optional[float] = None, progress: bool = True) -> RunStatus:
        """Watch until the run ends, unless it is watched already, and return its final status: as watch()
        raises, it raises."""
        with self._session() as s:
            if not phases.watch_done(s):
                Run.over(s).watch(timeout, progress)
        return self.status()

    def stop(self) -> str:
        """SIGTERM the run, SIGKILL after grace_seconds; what happened, as `doit stop` says it."""
        with self._session() as s:
            return observe.stop(s)

    def pull(self, verify: bool = True) -> manifest.Manifest:
        """Bring the run's files home (`doit pull`) and verify them (verify=False: not yet); the far side's
        manifest they match."""
        with self._session() as s:  # one session, as `doit run train`'s pull and verify share one
            _say(phases.pull(s))
            if verify:
                _say(phases.verify(s))
            return manifest.read(s.observed())

    def verify(self) -> Verified:
        """Hash every pulled file against the manifest (`doit run verify`); ManifestError naming each bad one."""
        with self._session() as s:
            _say(phases.verify(s))
            run = s.observed()
            found, listed = read_json(run.verified, dict), manifest.read(run).by_path()
        return Verified(run.run_id, found["manifest_sha256"], tuple(listed[p] for p in sorted(found["files"])),
                        found["bytes"], dict(found["remote_only"]), run.files)

    def down(self, confirm: bool = True) -> str:
        """Remove the far-side run dir behind `doit run down`'s gate (verified here, nothing left there);
        confirm=False is the CLI without confirm=yes: it asks at a terminal, and is refused elsewhere."""
        with self._session() as s:
            return teardown.down(s, confirm)


@contextlib.contextmanager
def _silenced(quiet: bool) -> Iterator[None]:
    """stdout and stderr to /dev/null while `quiet` (the watch's bar and lines)."""
    if not quiet:
        yield
        return
    with open(os.devnull, "w") as null, contextlib.redirect_stdout(null), contextlib.redirect_stderr(null):
        yield
