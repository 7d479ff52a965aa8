"""`down`: the gate, the confirmation, the far-side run dir's removal, and the box's terminate verb."""

from __future__ import annotations

import os
import subprocess
import sys

from tether import manifest
from tether.errors import RunError
from tether.paths import RunPaths
from tether.pipelines.phases import far_manifest, write_stamp
from tether.pipelines.session import Session
from tether.remote.protocol import ABSENT

TEARDOWN_TIMEOUT_S = 600.0  # down's teardown_command: a provider's CLI silent for ten minutes is hung


def down(s: Session, confirm: bool) -> str:
    """Remove the far-side run dir, only once the results here are verified against its manifest."""
    run = s.observed()
    far = far_manifest(s, run)
    snap = s.snapshot(run, fresh=True)
    if far is None and snap.status == ABSENT:
        return _already_removed(s, run, confirm)
    keep = s.backend.keep_remote  # decided here once: the gate and what happens after it
    verified = manifest.gate_teardown(run, far, snap.alive, keep, s.job.artifacts)
    terminate = s.backend.teardown_command  # never with keep_remote (the config refuses both)
    print(f"down will delete {run.remote_abs} on backend {s.job.backend} "
          f"({len(verified['files'])} verified files are kept in {run.files})"
          + (f" and then run, if no other run is left there: {terminate}" if terminate else ""))
    if not (confirm or _ask("delete it and run teardown_command?" if terminate else "delete it?")):
        raise RunError(f"not confirmed: nothing deleted. Add confirm=yes to tear down {run.run_id}")
    if keep:
        outcome, others = f"kept {run.remote_abs} (keep_remote is true): nothing deleted", []
    else:
        outcome, others = s.backend.teardown(run)
    if terminate and others:  # the box still holds other runs: terminating it would lose them
        write_stamp(run, "down", outcome=outcome, teardown_waits_for=others)
        return (f"{run.run_id}: {outcome}; teardown_command not run: the far side still holds "
                f"{len(others)} other run(s) ({', '.join(others[:3])}{', ...' if len(others) > 3 else ''}); "
                f"it runs with the `down` of the last one")
    if terminate:
        return _terminate(s, run, outcome, terminate)
    write_stamp(run, "down", outcome=outcome)
    return f"{run.run_id}: {outcome}"


def _already_removed(s: Session, run: RunPaths, confirm: bool) -> str:
    """The far run dir is gone. A `down` killed after removing it left no down.json and perhaps never ran
    teardown_command: finish those now (only for a run verified here; the box is ended only if confirmed)."""
    done = "already removed: no action needed"
    if os.path.exists(run.stamp("down")) or not os.path.exists(run.verified):
        return f"{run.run_id}: {done}"
    terminate = s.backend.teardown_command
    others = s.backend.teardown(run)[1] if terminate else []
    if terminate and not others:
        if not (confirm or _ask("run teardown_command?")):
            raise RunError(f"not confirmed: teardown_command not run. Add confirm=yes to tear down {run.run_id}")
        return _terminate(s, run, done, terminate)
    write_stamp(run, "down", outcome=done, **({"teardown_waits_for": others} if others else {}))
    return f"{run.run_id}: {done}"


def _terminate(s: Session, run: RunPaths, outcome: str, command: str) -> str:
    """down's last step: the provider's terminate verb, here, once the run dir is gone; a failure says so in one line."""
    s.backend.close()  # the box may go away now: no channel is left open to it
    code = _run_here(command)
    write_stamp(run, "down", outcome=outcome, teardown_command=command, teardown_exit=code)
    if code != 0:
        failed = f"did not finish within {TEARDOWN_TIMEOUT_S:g} s" if code is None else f"exited {code}"
        raise RunError(f"{run.run_id}: {outcome}, but teardown_command {failed}: the box may still be billing: "
                       f"run it by hand: {command}")
    return f"{run.run_id}: {outcome}; then ran teardown_command: {command}"


def _run_here(command: str) -> int | None:
    """`command` through /bin/sh on this machine, its output shown as it comes; its exit code (None: timed out)."""
    sys.stdout.flush()
    sys.stderr.flush()
    try:  # in this terminal's process group: a Ctrl-C reaches the provider's CLI too
        return subprocess.run(["/bin/sh", "-c", command], stdin=subprocess.DEVNULL,
                              timeout=TEARDOWN_TIMEOUT_S).returncode
    except subprocess.TimeoutExpired:
        return None


def _ask(question: str) -> bool:
    if not sys.stdin.isatty():
        return False
    return input(f"{question} [y/N] ").strip().lower() in ("y", "yes")
