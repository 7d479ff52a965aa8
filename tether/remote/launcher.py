"""The far-side launcher's commands: start a run detached, probe, stop, cancel, reopen, remove.

Copied to `<remote_dir>/tether/<version-hash>/` (stdlib only, Python >= 3.8). Its functions are
commands of the protocol's table (tether/remote/protocol.py), answered by the serve process:
`start` (the run detached, in its own session, once it holds the lock), `probe` (one snapshot per
run; SLURM runs read with one squeue), `stop` (SIGTERM the trainer's group, SIGKILL after the
grace time, re-probe), `cancel` (SLURM's scancel), `reopen` (an ended run becomes startable as
its next attempt), `checkpoint` (a run's latest checkpoint: path, bytes, SHA-256, step) and
`remove` (an ended run's folder). A run's attempts themselves are tether.remote.controller's. As a
program it runs one run in the foreground:

    python <version dir>/tether/remote/launcher.py run RUN_DIR     (the detached launcher, a SLURM job)
    python <version dir>/tether/remote/launcher.py COMMAND '{json}' (any non-streaming command, by hand)

`start`'s settings (extra environment, GPU choice) come in the request: secrets never appear on
a command line, and land in RUN_DIR/launch_env.json with mode 0600.

Liveness is an flock on RUN_DIR/launcher.lock, held by the launcher and inherited by the
trainer: the kernel releases it when both are gone, whatever killed them, so a dead run can
never look alive and a live one never looks dead (pids get reused; locks do not).
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
    # Import the copy this file belongs to: never a `tether` package in the folder we start from.
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import importlib  # noqa: E402 (after the path is set)
import json  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from typing import Any, Dict, List, Optional  # noqa: E402

from tether.remote import controller, gpuchoice, idle, notify, protocol, resume as resuming, scheduler  # noqa: E402
from tether.remote.controller import saved_checkpoint, stopped_without_launcher  # noqa: E402
from tether.remote.fileio import atomic_write_json, read_json  # noqa: E402
from tether.remote.rundir import is_alive, is_final, now, run_file, write_private  # noqa: E402
from tether.remote.supervise import group_members, killpg  # noqa: E402
from tether.remote.watchdog import output_age_s  # noqa: E402

ALREADY_RUNNING_EXIT, VERSION_DIR = controller.ALREADY_RUNNING_EXIT, controller.VERSION_DIR
LAUNCHER_EXIT_S = 5.0  # how long `stop` waits for a launcher to exit once its run has ended


def start(run_dir: str, settings: Optional[Dict[str, Any]] = None, timeout_s: float = 30.0) -> Dict[str, Any]:
    """Start `run` detached and wait until it has taken the lock and recorded its pid.

    `settings`: {"env": {...}, "gpus": "auto"|N|"0,1"|"none", "min_gpus": N, "min_free_gpu_mb": N,
    "share_gpus": B}; a launcher refused its GPUs exits early, and its reason is the answer's error.
    """
    state = read_json(run_file(run_dir, "state.json"), dict) or {}
    if is_final(state):
        return {"outcome": "finished", "state": state}
    if is_alive(run_dir):
        return {"outcome": "running", "state": state}
    settings = settings or {}
    write_private(run_file(run_dir, "launch_env.json"), dict(settings.get("env") or {}))
    gpuchoice.request(run_dir, settings)  # the launcher chooses and leases them once it holds the run's lock
    with open(run_file(run_dir, "launcher.log"), "ab") as log:
        daemon = subprocess.Popen(
            [settings.get("python") or sys.executable, os.path.abspath(__file__), "run", run_dir],
            cwd=VERSION_DIR, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,  # its own session: a closed terminal or ssh channel is no signal
        )
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        state = read_json(run_file(run_dir, "state.json"), dict) or {}
        if state.get("pid") == daemon.pid:
            return {"outcome": "started", "state": state}
        code = daemon.poll()
        if code is not None:
            state = read_json(run_file(run_dir, "state.json"), dict) or {}
            outcome = {ALREADY_RUNNING_EXIT: "running", 0: "finished"}.get(code, "error")
            return {"outcome": outcome, "state": state, "exit_code": code, "error": state.get("launcher_error", "")}
        time.sleep(0.02)
    return {"outcome": "error", "state": state, "error": "launcher did not start in time"}


# ---------------------------------------------------------------- probe and stop


def probe(run_dir: str) -> Dict[str, Any]:
    """A snapshot of one run: status (with `lost` for a dead non-final run), liveness, ages."""
    if not os.path.isdir(run_dir):
        return {"status": "absent"}
    state = read_json(run_file(run_dir, "state.json"), dict) or {}
    alive = is_alive(run_dir)
    status = state.get("status", "pending")
    if status in ("running", "pending") and not alive and state and not state.get("refused"):
        status = "lost"  # (a run refused its GPUs never started: it is pending, startable)
    snapshot = {"status": status, "final": is_final(state), "alive": alive, "state": state, "now": now(),
                "sealed": os.path.exists(run_file(run_dir, "PULL_MANIFEST.json"))}
    try:
        snapshot["heartbeat_age_s"] = round(time.time() - os.stat(run_file(run_dir, "heartbeat")).st_mtime, 3)
    except FileNotFoundError:
        snapshot["heartbeat_age_s"] = None
    snapshot.update(output_age_s=output_age_s(run_dir), notified=notify.notified(run_dir),
                    idle_stop=idle.describe(run_dir))
    return snapshot


def probe_all(run_dirs: List[str]) -> Dict[str, Dict[str, Any]]:
    """Snapshots of many runs; runs submitted to SLURM are read with ONE squeue call for all."""
    snapshots = {d: probe(d) for d in run_dirs}
    jobs = {d: scheduler.job_of(d) for d in run_dirs if snapshots[d]["status"] != "absent"}
    jobs = {d: j for d, j in jobs.items() if j}
    if jobs:
        queued, why = scheduler.queue_or_error(sorted(set(jobs.values())))
        for run_dir, job_id in jobs.items():
            _with_queue(run_dir, snapshots[run_dir], job_id, queued, why)
    return snapshots


def _with_queue(run_dir: str, snap: Dict[str, Any], job_id: str, queued: Optional[Dict[str, Any]],
                why: str = "") -> None:
    """Let the scheduler's view decide queued/running/gone (squeue failing changes nothing)."""
    snap["job_id"] = job_id
    if queued is None:
        snap["queue_error"] = "%s: the run's state is read from its files only" % why
        return
    entry = queued.get(job_id)
    if entry:
        _in_queue(snap, entry)
        return
    if not snap["final"] and not snap["alive"]:
        stopped = os.path.exists(run_file(run_dir, "stop_requested"))
        snap["scheduler"] = scheduler.describe(run_dir, job_id, stopped)
        state = snap["scheduler"]["job_state"]
        if snap["scheduler"].get("unknown"):  # squeue had no line for it and scontrol failed: decide nothing
            snap["queue_error"] = "squeue did not list job %s and scontrol failed: the run's state is read " \
                                  "from its files only" % job_id
        elif state in scheduler.QUEUED or state in scheduler.ACTIVE:  # squeue left it out: scontrol knows it
            _in_queue(snap, {"state": state, "reason": snap["scheduler"].get("reason") or "",
                             "nodes": snap["scheduler"].get("node") or ""})
            del snap["scheduler"]
        elif state == "CANCELLED" and not stopped:
            snap["status"] = "cancelled"
        elif snap["status"] == "pending":
            snap["status"] = "lost"


def _in_queue(snap: Dict[str, Any], entry: Dict[str, str]) -> None:
    snap["queue"] = entry
    snap["alive"] = True
    if entry["state"] in scheduler.QUEUED and not snap["final"]:
        snap["status"] = "pending"
    elif entry["state"] in scheduler.ACTIVE and snap["status"] in ("pending", "lost", "preempted"):
        snap["status"] = "running"


def _wait_until_dead(run_dir: str, pgid: int, seconds: float) -> bool:
    deadline = time.time() + seconds
    while time.time() < deadline:
        if not is_alive(run_dir) and not (pgid and group_members(pgid)):
            return True
        time.sleep(0.05)
    return False


def stop(run_dir: str, grace_s: float) -> Dict[str, Any]:
    """SIGTERM the trainer's group (and launcher), SIGKILL after grace_s, then re-probe honestly."""
    state = read_json(run_file(run_dir, "state.json"), dict) or {}
    pgid, pid = int(state.get("pgid") or 0), int(state.get("pid") or 0)
    if not is_alive(run_dir) and not (pgid and group_members(pgid)):
        return {"outcome": "was not running", "status": probe(run_dir)["status"]}
    atomic_write_json(run_file(run_dir, "stop_requested"), {"at": now()})
    if pid and _is_our_launcher(pid, run_dir):
        os.kill(pid, signal.SIGTERM)  # the launcher forwards it, once, and arms its own SIGKILL timer
    else:
        killpg(pgid, signal.SIGTERM)  # the launcher is gone: the trainer directly (never both: one TERM)
    if not _wait_until_dead(run_dir, pgid, grace_s + 5):
        killpg(pgid, signal.SIGKILL)
        if pid and _is_our_launcher(pid, run_dir):
            os.kill(pid, signal.SIGKILL)
        _wait_until_dead(run_dir, pgid, 5)
    survivors = group_members(pgid) if pgid else []
    if is_alive(run_dir) or survivors:
        return {"outcome": "error", "survivors": survivors,
                "error": "processes survived SIGKILL: %s" % survivors}
    if not is_final(read_json(run_file(run_dir, "state.json"), dict) or {}):
        stopped_without_launcher(run_dir)
    _let_exit(pid, run_dir, LAUNCHER_EXIT_S)
    return {"outcome": "stopped", "status": probe(run_dir)["status"]}


def _let_exit(pid: int, run_dir: str, seconds: float) -> None:
    """Give a launcher that has released the run's lock a moment to exit (its last notifications, or an
    idle stop's wait, may keep it longer: it is no process of the run any more)."""
    deadline = time.time() + seconds
    while pid and _is_our_launcher(pid, run_dir) and time.time() < deadline:
        time.sleep(0.02)


def cancel(run_dir: str, grace_s: float) -> Dict[str, Any]:
    """Stop a SLURM run (scancel, TERM then KILL); mark it stopped and sealed if its launcher could not."""
    outcome = scheduler.cancel(run_dir, grace_s)
    state = read_json(run_file(run_dir, "state.json"), dict) or {}
    if outcome["outcome"] == "stopped" and not is_final(state) and not is_alive(run_dir):
        stopped_without_launcher(run_dir)
    return outcome


def _is_our_launcher(pid: int, run_dir: str) -> bool:
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            return run_dir.encode() in f.read()
    except OSError:
        return False


def reopen(run_dir: str) -> Dict[str, Any]:
    """An ended run (not completed) becomes startable as its next attempt (tether.remote.resume)."""
    return resuming.reopen(run_dir, saved_checkpoint(run_dir, read_json(run_file(run_dir, "run.json")) or {}))


def checkpoint(run_dir: str, named: Optional[str] = None) -> Dict[str, Any]:
    """The run's latest checkpoint (or `named`): path, bytes, SHA-256, step."""
    named = named or saved_checkpoint(run_dir, read_json(run_file(run_dir, "run.json")) or {})
    return resuming.checkpoint_info(run_dir, named)


def remove(run_dir: str) -> Dict[str, Any]:
    """Delete an ended run's folder (the object store stays); never a live run's. Says which other
    runs the box still holds (a teardown_command waits for the last one)."""
    if not os.path.isdir(run_dir):
        outcome = "absent"
    elif is_alive(run_dir):
        outcome = "alive"
    else:
        shutil.rmtree(run_dir)
        outcome = "removed"
    runs, name = os.path.dirname(run_dir), os.path.basename(run_dir)
    others = sorted(d for d in os.listdir(runs) if d != name and os.path.isdir(os.path.join(runs, d))) \
        if os.path.isdir(runs) else []
    return {"outcome": outcome, "others": others}


# ---------------------------------------------------------------- command line


def main(argv: List[str]) -> int:
    """`run RUN_DIR` (the detached launcher, a SLURM job), or any command of the table with its input
    as JSON (`probe '{"run_dirs": [...]}'`): what the serve process answers, for a shell on the far side."""
    if argv[:1] == ["run"] and len(argv) == 2:
        return controller.run(os.path.normpath(argv[1]))
    if len(argv) not in (1, 2) or argv[0] not in protocol.COMMANDS:
        print("usage: launcher.py run RUN_DIR | launcher.py COMMAND [JSON]; commands: %s"
              % ", ".join(sorted(protocol.COMMANDS)), file=sys.stderr)
        return 2
    command = protocol.COMMANDS[argv[0]]
    if command.takes_stream or command.gives_stream:
        print("%s streams bytes: it is answered by serve only" % argv[0], file=sys.stderr)
        return 2
    function = getattr(importlib.import_module("tether.remote." + command.module), command.function)
    print(json.dumps(function(**json.loads(argv[1] if len(argv) > 1 else "{}")), sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
