"""The public Python API: a job and its runs, driven by the very phase functions the doit tasks call.

    job = tether.Job.load("tether.yaml", backend="lab")
    run = job.train()              # up, push, launch: `doit run launch`
    run.wait()                     # watch: `doit run watch`
    run.pull(); run.verify()       # `doit pull`, `doit run verify`
    run.down(confirm=True)         # `doit run down confirm=yes`, behind the same gate

Every call opens its own Session, as one CLI invocation does, and closes its backend after. Errors
are tether's own tree (tether.errors), never a doit TaskFailed:

    TetherError               a local state file is torn (its message says what to put back)
     +-- ConfigError          a bad config file or setting (Job.load, Run.attach)
     +-- RunError             unknown run id; a run that ended without completing (wait, train(wait=True));
     |                        down not confirmed; sweep() of a job without a sweep
     +-- BackendError         the far side is unreachable, not ready (train's up) or refused an operation
     |    +-- RemoteCommandError   a far-side command exited non-zero
     +-- ManifestError        pulled files do not match the far side's manifest (verify, down)
    TimeoutError (builtin)    wait(timeout=...) ran out; the run goes on
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Optional

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
def _opened(variables: Mapping[str, str], cwd: str) -> Iterator[Session]:
    """A Session as one CLI invocation has it, closed after; the CLI's edge translations, as exceptions."""
    s: Optional[Session] = None
    try:
        s = Session.open(dict(variables), cwd)
        yield s
    except TornFile as err:
        raise TetherError(str(err)) from None
    except (TetherError, TimeoutError):
        raise
    except Exception as err:
        if s is None or not s.backend.is_transport_error(err):
            raise
        raise BackendError(f"lost the connection to backend {s.job.backend} ({type(err).__name__}: {err}); "
                           f"nothing is lost: call it again") from err
    finally:
        if s is not None:
            s.backend.close()


def _advance(s: Session, names: tuple[str, ...]) -> None:
    """Each phase in `names` unless its *_done check says it is done: what doit's uptodate decides."""
    for name in names:
        if not getattr(phases, f"{name}_done")(s):
            _say(getattr(phases, name)(s))


def _say(message: Optional[str]) -> None:
    """A phase's message, printed as the CLI prints it."""
    if message:
        print(message)


class Job:
    """A config on one backend, with the command line's settings: it trains and sweeps."""

    def __init__(self, variables: Mapping[str, str], cwd: str) -> None:
        self.variables, self.cwd = dict(variables), cwd

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

    def check(self) -> Report:
        """The backend's preflight (what `doit check` shows); it does not raise when not ready: see `.ready`."""
        with _opened(self.variables, self.cwd) as s:
            s.backend.install_launcher()
            s.backend.prepare()
            return s.backend.check(s.job.trainer.requires())

    def train(self, wait: bool = False) -> "Run":
        """up, push and launch (`doit run launch`; never launched twice); wait=True: then watch, pull
        and verify, as `doit run train` does."""
        with _opened(self.variables, self.cwd) as s:
            if s.job.sweep:
                raise RunError(f"{s.job.source} has a sweep: job.sweep() runs its points")
            _advance(s, FORWARD)
            run = Run(dict(self.variables, run=s.run().run_id), self.cwd)
        if wait:
            run.wait()
            run.pull()
        return run

    def sweep(self, wait: bool = False) -> list["Run"]:
        """One Run per sweep point, each up, pushed and launched; wait=True: then each watched, pulled
        and verified. RunError for a job without a sweep."""
        with _opened(self.variables, self.cwd) as s:
            if not s.points:
                raise RunError(f"{s.job.source} has no sweep: add a `sweep:` section, or use job.train()")
            _advance(s, ("up",))
            for point in s.points:
                _advance(point, ("push",) if s.backend.launches_arrays else ("push", "launch"))
            for point in s.points if s.backend.launches_arrays else ():
                _advance(point, ("launch",))  # one job array for every point, once all are pushed
            runs = [Run(dict(self.variables, run=point.run().run_id), self.cwd) for point in s.points]
        for run in runs if wait else ():
            run.wait()
            run.pull()
        return runs


class Run:
    """One run, by id: what `doit ... run=ID` looks at, from this working copy or any other."""

    def __init__(self, variables: Mapping[str, str], cwd: str) -> None:
        self.variables, self.cwd = dict(variables), cwd
        self.run_id = self.variables["run"]

    def __repr__(self) -> str:
        return f"Run({self.run_id!r})"

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

    def _session(self) -> contextlib.AbstractContextManager[Session]:
        return _opened(self.variables, self.cwd)

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

    def wait(self, timeout: Optional[float] = None, progress: bool = True) -> RunStatus:
        """Watch until the run ends (`doit run watch`; progress=False prints nothing) and return its final
        status; RunError when it ended without completing, TimeoutError after `timeout` s (it goes on)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._session() as s:
            if not phases.watch_done(s):
                with _silenced(not progress):
                    phases.watch(s, deadline=deadline)
        return self.status()

    def stop(self) -> str:
        """SIGTERM the run, SIGKILL after grace_seconds; what happened, as `doit stop` says it."""
        with self._session() as s:
            return observe.stop(s)

    def pull(self) -> manifest.Manifest:
        """Bring the run's files home (`doit pull`) and verify them; the far side's manifest they match."""
        with self._session() as s:  # one session, as `doit run train`'s pull and verify share one
            _say(phases.pull(s))
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
