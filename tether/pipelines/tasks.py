"""The phases as doit task dicts, shared by dodo.py and the `tether` command.

Every task's action is a call of tether.api on the invocation's one Session, inside the API's edge
(tether.api.edge), so the CLI and the API are one path. Every task's `uptodate` asks the phase itself
(stamps and far-side state), so doit's database is only a cache: losing it to a SIGKILL makes a phase
look again, never redo its work.
"""

from __future__ import annotations

import functools
import importlib
import signal
import sys
from typing import Any, Callable, Optional

from doit.exceptions import TaskError, TaskFailed, UnmetDependency
from doit.reporter import ConsoleReporter

from tether import config as config_mod
from tether import sweep
from tether.errors import ConfigError, TetherError
from tether.pipelines import phases
from tether.pipelines.session import Session, check_variables, flag
from tether.remote.fileio import TornFile

DOIT_CONFIG = {
    "default_tasks": ["train"],  # never `down`: a bare `doit` must not tear anything down
    "dep_file": ".tether/doit.db",
    "backend": "tether-sqlite",  # doit's sqlite3, committed after every task (tether.pipelines.doit_db)
    "verbosity": 2,
}

FORWARD = ("up", "push", "launch", "watch")  # each depends on the one before


class SkippedAfterFailure(TaskFailed):
    """A task doit did not run because a task it depends on failed (reported already)."""


class Reporter(ConsoleReporter):
    """doit's console output, with a failure shown as tether's one message instead of a dump."""

    def add_failure(self, task: Any, fail: Any) -> None:
        self.failures.append({"task": task, "exception": fail})
        message = getattr(fail, "message", "") or fail.get_msg()
        if isinstance(fail, TaskError):  # an exception tether did not expect: the traceback is the bug report
            message = fail.get_msg()
        if isinstance(fail, UnmetDependency):  # with --continue: a task after one that failed
            sys.stderr.write(f"skipped: {task.name}, because {message.strip()} failed\n")
            fail.__class__ = SkippedAfterFailure  # doit would exit 2 ("a bug"); it is that failure: exit 1
            return
        sys.stderr.write(f"error: {task.name}: {message.strip()}\n")

    def complete_run(self) -> None:
        if self.runtime_errors:
            sys.stderr.write("error: " + "\n".join(self.runtime_errors) + "\n")


DOIT_CONFIG["reporter"] = Reporter


def doit_variables() -> dict[str, str]:
    """The command line's key=value words, as doit parsed them (all of them, so typos can be refused)."""
    from doit import doit_cmd

    return dict(doit_cmd._CMDLINE_VARS or {})


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def catch_signals() -> None:
    """SIGTERM and SIGHUP end tether like Ctrl-C: cleanly, with the command to resume."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)


def resume_hint(session: Session | None) -> str:
    run = session.resolved if session else None
    where = f" Run {run.run_id} goes on if it was launched: `doit status run={run.run_id}` shows it." if run else ""
    return f"interrupted: nothing is lost.{where} Run the same command again to resume."


def _api() -> Any:
    """tether.api, imported at the first action: a no-op `train` (every task up to date) imports no API,
    observer, report, repro or web page code."""
    return importlib.import_module("tether.api")


def _pull(s: Session) -> None:
    _api().Run.over(s).pull(verify=False)


def _verify(s: Session) -> None:
    _api().Run.over(s).verify()


def _status(s: Session) -> None:
    lazy("observe", "show_status")(s, _api().Run.over(s).status())


def _check(s: Session) -> None:
    lazy("observe", "show_check")(s, _api().Job.over(s).check())


CALLS: dict[str, Callable[[Session], Optional[str]]] = {  # what each task's action asks of the API
    "up": lambda s: _api().Job.over(s).up(),
    "push": lambda s: _api().Job.over(s).push(),
    "launch": lambda s: _api().Job.over(s).launch(),
    "watch": lambda s: _api().Run.over(s).watch(),
    "pull": _pull,
    "verify": _verify,
    "down": lambda s: _api().Run.over(s).down(flag(s.variables, "confirm")),
    "status": _status,
    "stop": lambda s: _api().Run.over(s).stop(),
    "check": _check,
}


Opener = Callable[[], Session]


def lazy(module: str, name: str, package: str = "tether.pipelines") -> Callable[..., Any]:
    """`<package>.<module>.<name>`, imported at its first call (see `_api`)."""
    def call(*args: Any) -> Any:
        return getattr(importlib.import_module(f"{package}.{module}"), name)(*args)
    call.__name__ = call.__qualname__ = name
    return call


def task_creators(variables: Callable[[], dict[str, str]]) -> dict[str, Callable[[], Any]]:
    """`task_*` functions for doit; `variables()` gives the command line's key=value words.

    With a `sweep:` in the config, every per-run task has one sub-task per point
    (`train:lr:0.001,seed:2`), and the plain name (`train`) runs them all.
    """

    @functools.lru_cache(maxsize=1)
    def session() -> Session:
        return Session.open(variables())

    def recorded() -> Session:
        """For `repro`: the config gives the backends; the code and data come from the record."""
        return Session.open(variables(), files=False)

    def points() -> list[Session]:
        """The sweep's point sessions; [] without a sweep, with run=ID, or when the config does not
        load (the task's action then reports the error in full)."""
        try:
            whole = session()
        except TetherError:
            return []
        return [] if whole.variables.get("run") else whole.points

    def action(opener: Opener, call: Callable[..., Optional[str]], *args: Any) -> Callable[[], Any]:
        """A doit action: `call(session, *args)` inside the API's edge, the message it returns printed;
        tether's error as doit's TaskFailed, Ctrl-C as the command to resume. (Any other error is a bug:
        doit shows its traceback.)"""
        def run() -> Any:
            opened: Optional[Session] = None
            try:
                with _api().edge(opener) as opened:
                    message = call(opened, *args)
                if message:
                    print(message)
            except TetherError as err:
                return TaskFailed(str(err))
            except KeyboardInterrupt:
                return TaskFailed(resume_hint(opened))
            return None
        return run

    def done(opener: Opener, check: Callable[[Session], bool]) -> Callable[[], bool]:
        def uptodate() -> bool:
            try:
                opened = opener()
                if opened.backend.opens_early:
                    opened.backend.far.open_soon()  # its connection is made while this side decides
                return check(opened)
            except (TetherError, TornFile):
                return False  # let the action run and report the error in full
        return uptodate

    def per_run(basename: str, doc: str, build: Callable[[Opener, str], dict]) -> Callable[[], Any]:
        """A task of one run, or, for a sweep, one sub-task per point plus the group."""
        def creator() -> Any:
            found = points()
            if not found:
                return dict(build(session, ""), doc=doc)
            return _subtasks(basename, doc, build, found)
        return creator

    def forward(name: str, **extra: Any) -> Callable[[Opener, str], dict]:
        """push, launch or watch of one run: each depends on the one before, and push on `up`."""
        before = FORWARD[FORWARD.index(name) - 1]

        def build(opener: Opener, label: str) -> dict:
            dep = f"{before}:{label}" if label and before != "up" else before
            if name == "launch" and label and opener().backend.launches_arrays:
                dep = "push"  # one job array for every point: all of them are pushed first
            return dict(actions=[action(opener, CALLS[name])],
                        uptodate=[done(opener, getattr(phases, f"{name}_done"))], task_dep=[dep], **extra)
        return build

    def up() -> dict:
        """`up` belongs to the backend: one task for a whole sweep."""
        return dict(doc="preflight the backend and copy the launcher there", actions=[action(session, CALLS["up"])],
                    uptodate=[done(session, phases.up_done)])

    def explicit(phase: Callable) -> Callable[[Opener, str], dict]:
        """pull and verify asked for by name always run: pull compares the far side's manifest with the
        one here, verify hashes every file again (the stat-only check is `train`'s)."""
        return lambda opener, label: dict(actions=[action(opener, phase)])

    def simple(phase: Callable, *args: Any, **extra: Any) -> Callable[[Opener, str], dict]:
        return lambda opener, label: dict(actions=[action(opener, phase, *args)], **extra)

    def train(opener: Opener, label: str) -> dict:
        return dict(actions=[action(opener, CALLS["pull"]), action(opener, CALLS["verify"])],
                    uptodate=[done(opener, phases.pulled_done)], task_dep=[f"watch:{label}" if label else "watch"])

    def down(opener: Opener, label: str) -> dict:
        return dict(actions=[action(opener, CALLS["down"])])

    def whole(doc: str, phase: Callable, sweep_phase: Callable, **extra: Any) -> Callable[[], dict]:
        """A task that looks at one run, or at every point of a sweep at once."""
        return lambda: dict(doc=doc, actions=[action(session, sweep_phase if points() else phase)], **extra)

    def fixed(doc: str, *actions: Any, **extra: Any) -> Callable[[], dict]:
        """A task of the whole config, the same with or without a sweep. (A creator defined in one
        short line: doit tokenizes every creator's source to order them, and a lambda's runs to the
        end of its statement, here the whole dict below.)"""
        return lambda: dict(doc=doc, actions=list(actions), **extra)

    return {
        "task_up": up,
        "task_push": per_run("push", "upload the code and data the far side lacks; freeze the code snapshot",
                             forward("push")),
        "task_launch": per_run("launch", "start the run detached (never twice)", forward("launch")),
        "task_watch": per_run("watch", "follow the run until it ends; Ctrl-C leaves it running",
                              forward("watch", io={"capture": False})),
        "task_pull": per_run("pull", "bring the run's files home, as its manifest lists them", explicit(CALLS["pull"])),
        "task_verify": per_run("verify", "check every pulled file against the manifest; write PULL_VERIFIED.json",
                               explicit(CALLS["verify"])),
        "task_train": per_run("train", "up, push, launch, watch, then pull and verify (the default)", train),
        "task_down": per_run("down", "remove the far-side run dir; refused until PULL_VERIFIED.json matches "
                                     "the far side's manifest (confirm=yes)", down),
        "task_status": whole("state, step, loss, heartbeat and place of a run, or of every sweep point (json=1)",
                             CALLS["status"], lazy("observe", "sweep_status")),
        "task_tail": per_run("tail", "print the run's log, following it until the run ends",
                             simple(lazy("observe", "tail"), io={"capture": False})),
        "task_stop": per_run("stop", "SIGTERM the run, SIGKILL after grace_seconds, and say what happened",
                             simple(CALLS["stop"])),
        "task_prune": fixed("remove far-side objects that no run references (after `down`s)",
                            action(session, lazy("observe", "prune"))),
        "task_report": whole("curves and a Markdown summary from the verified files; for a sweep, results.json, "
                             "a table and a figure with error bars", lazy("report", "report"),
                             lazy("results", "report")),
        "task_check": fixed("preflight the backend: could a run start there? (json=1)",
                            action(session, CALLS["check"])),
        "task_repro": fixed("re-run recorded runs (a run folder, results.json or its provenance file) and "
                            "compare: tether repro PATH [backend=NAME]",
                            lambda paths: action(recorded, lazy("repro", "repro"), paths)(), pos_arg="paths",
                            io={"capture": False}),
        "task_ui": fixed("serve a read-only web page of every run of this project, with a Check button per "
                         "backend: tether ui [port=N] [host=ADDR]", action(session, lazy("server", "ui", "tether.ui")),
                         io={"capture": False}),
        "task_validate": fixed("report every config problem at once (strict=1: warnings fail too)",
                               functools.partial(validate, variables)),
    }


def _subtasks(basename: str, doc: str, build: Callable[[Opener, str], dict], found: list[Session]) -> Any:
    yield {"basename": basename, "name": None, "doc": doc}
    for point in found:
        yield dict(build(lambda point=point: point, point.point.label), basename=basename, name=point.point.label)


def validate(variables: Callable[[], dict[str, str]]) -> Any:
    """Print every error and warning in the config; fail on errors (and on warnings with strict=1)."""
    found = variables()
    try:
        check_variables(found)
        path = found.get("config") or config_mod.default_path()
        job = config_mod.load(path, found.get("backend") or None)
    except ConfigError as err:
        for problem in err.problems:
            print(problem)
        return TaskFailed(f"{len(err.problems)} error(s) in the config or the command line")
    for warning in job.warnings:
        print(warning)
    if job.warnings and flag(found, "strict"):
        return TaskFailed(f"{len(job.warnings)} warning(s) and strict=1: fix them or acknowledge them "
                          f"under validation: acknowledge:")
    points = f"; a sweep of {len(sweep.points(job.sweep))} points" if job.sweep else ""
    print(f"{job.source}: ok ({len(job.warnings)} warning(s)); backend {job.backend}{points}")
    return None
