"""The phases as doit task dicts, shared by dodo.py and the `tether` command.

Every task's `uptodate` asks the phase itself (stamps and far-side state), so doit's database
is only a cache: losing it to a SIGKILL makes a phase look again, never redo its work.
"""

from __future__ import annotations

import functools
import signal
import sys
from typing import Any, Callable

from doit.exceptions import TaskFailed
from doit.reporter import ConsoleReporter

from tether import config as config_mod
from tether.errors import ConfigError, TetherError
from tether.pipelines import observe, phases, report
from tether.pipelines.session import Session, check_variables

DOIT_CONFIG = {
    "default_tasks": ["train"],  # never `down`: a bare `doit` must not tear anything down
    "dep_file": ".tether/doit.db",
    "backend": "tether-sqlite",  # doit's sqlite3, committed after every task (tether.pipelines.doit_db)
    "verbosity": 2,
}

FORWARD = ("up", "push", "launch", "watch")  # each depends on the one before


class Reporter(ConsoleReporter):
    """doit's console output, with a failure shown as tether's one message instead of a dump."""

    def add_failure(self, task: Any, fail: Any) -> None:
        self.failures.append({"task": task, "exception": fail})
        message = getattr(fail, "message", "") or fail.get_msg()
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
    run = session._run if session else None
    where = f" Run {run.run_id} goes on if it was launched: `doit status run={run.run_id}` shows it." if run else ""
    return f"interrupted: nothing is lost.{where} Run the same command again to resume."


def task_creators(variables: Callable[[], dict[str, str]]) -> dict[str, Callable[[], dict]]:
    """`task_*` functions for doit; `variables()` gives the command line's key=value words."""

    @functools.lru_cache(maxsize=1)
    def session() -> Session:
        return Session.open(variables())

    def action(phase: Callable, *args: Any) -> Callable[[], Any]:
        def run() -> Any:
            opened = None
            try:
                opened = session()
                message = phase(opened, *args)
                if message:
                    print(message)
            except TetherError as err:
                return TaskFailed(str(err))
            except KeyboardInterrupt:
                return TaskFailed(resume_hint(opened))
            except Exception as err:
                if opened is None or not opened.backend.is_transport_error(err):
                    raise  # a bug: doit shows the traceback
                return TaskFailed(f"lost the connection to backend {opened.job.backend} ({type(err).__name__}: "
                                  f"{err}); nothing is lost: run the same command again")
            return None
        return run

    def done(check: Callable[[Session], bool]) -> Callable[[], bool]:
        def uptodate() -> bool:
            try:
                return check(session())
            except TetherError:
                return False  # let the action run and report the error in full
        return uptodate

    def forward(name: str, doc: str, **extra: Any) -> Callable[[], dict]:
        index = FORWARD.index(name)
        deps = [FORWARD[index - 1]] if index else []
        check = getattr(phases, f"{name}_done")
        return lambda: dict(doc=doc, actions=[action(getattr(phases, name))], uptodate=[done(check)],
                            task_dep=deps, **extra)

    def simple(doc: str, phase: Callable, *args: Any, **extra: Any) -> Callable[[], dict]:
        return lambda: dict(doc=doc, actions=[action(phase, *args)], **extra)

    def down() -> dict:
        confirm = lambda s: phases.down(s, s.variables.get("confirm") == "yes")  # noqa: E731
        return dict(doc="remove the far-side run dir; refused until PULL_VERIFIED.json matches "
                        "the far side's manifest (confirm=yes)", actions=[action(confirm)])

    return {
        "task_up": forward("up", "preflight the backend and copy the launcher there"),
        "task_push": forward("push", "upload the code and data the far side lacks; freeze the code snapshot"),
        "task_launch": forward("launch", "start the run detached (never twice)"),
        "task_watch": forward("watch", "follow the run until it ends; Ctrl-C leaves it running",
                              io={"capture": False}),
        "task_pull": simple("bring the run's files home, as its manifest lists them", phases.pull,
                            uptodate=[done(phases.pulled_done)]),
        "task_verify": simple("check every pulled file against the manifest; write PULL_VERIFIED.json",
                              phases.verify, uptodate=[done(phases.pulled_done)]),
        "task_train": lambda: dict(doc="up, push, launch, watch, then pull and verify (the default)",
                                   actions=[action(phases.pull), action(phases.verify)],
                                   uptodate=[done(phases.pulled_done)], task_dep=["watch"]),
        "task_down": down,
        "task_status": simple("state, step, loss, heartbeat and place of a run (json=1)", observe.status),
        "task_tail": simple("print the run's log, following it until the run ends", observe.tail,
                            io={"capture": False}),
        "task_stop": simple("SIGTERM the run, SIGKILL after grace_seconds, and say what happened", observe.stop),
        "task_prune": simple("remove far-side objects that no run references (after `down`s)", observe.prune),
        "task_report": simple("curves (PNG) and a Markdown summary from the verified files", report.report),
        "task_check": simple("preflight the backend: could a run start there? (json=1)", observe.check),
        "task_validate": lambda: dict(doc="report every config problem at once (strict=1: warnings fail too)",
                                      actions=[functools.partial(validate, variables)]),
    }


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
    if job.warnings and found.get("strict") in ("1", "yes", "true"):
        return TaskFailed(f"{len(job.warnings)} warning(s) and strict=1: fix them or acknowledge them "
                          f"under validation: acknowledge:")
    print(f"{job.source}: ok ({len(job.warnings)} warning(s)); backend {job.backend}")
    return None
