"""The far-side launcher: runs one trainer, records its life in files, seals the results.

Copied to `<remote_dir>/tether/<version-hash>/` (stdlib only, Python >= 3.8). Its functions are
commands of the protocol's table (tether/remote/protocol.py), answered by the serve process:
`start` (the run detached, in its own session, once it holds the lock), `probe` (one snapshot per
run; SLURM runs read with one squeue), `stop` (SIGTERM the trainer's group, SIGKILL after the
grace time, re-probe), `cancel` (SLURM's scancel), `reopen` (an ended run becomes startable as
its next attempt), `checkpoint` (a run's latest checkpoint: path, bytes, SHA-256, step) and
`remove` (an ended run's folder). As a program it runs one run in the foreground:

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

import glob  # noqa: E402 (after the path is set)
import importlib  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from typing import Any, Dict, List, Optional  # noqa: E402

from tether.remote import endings, machine, objects, progress, protocol, resume as resuming, scheduler  # noqa: E402
from tether.remote import mapped as own_checkpoints  # noqa: E402
from tether.remote.fileio import atomic_write_json, read_json  # noqa: E402
from tether.remote.rundir import (  # noqa: E402
    decide_final, event, is_alive, is_final, now, restart_allowed, run_file, seal, try_lock, update_state,
    write_private,
)
from tether.remote.workdir import work_dir  # noqa: E402
from tether.remote.runtime import latest_checkpoint  # noqa: E402

HEARTBEAT_S = 2.0  # a few seconds: fresh enough for a 60 s timeout, cheap on shared storage
ALREADY_RUNNING_EXIT = 3
LAUNCHER_ERROR_EXIT = 4  # `run`: the launcher itself failed; state.json's launcher_error says how
REQUEUE_EXIT = 99  # `run` under SLURM: "requeue this job, the restart policy wants another attempt"
VERSION_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _trainer_command(spec: Dict[str, Any], resume: Optional[str]) -> List[str]:
    argv = [sys.executable if a == "{python}" else a for a in spec["argv"]]
    if resume:
        argv += [a.replace("{checkpoint}", resume) for a in spec.get("resume_args", [])]
    srun = os.environ.get("TETHER_SRUN")  # job.sh of a multi-node SLURM job: one trainer per node
    return srun.split() + argv if srun else argv


def _trainer_env(run_dir: str, spec: Dict[str, Any], resume: Optional[str]) -> Dict[str, str]:
    env = dict(os.environ)
    env.update({str(k): str(v) for k, v in spec.get("env", {}).items()})
    env.update({str(k): str(v) for k, v in (read_json(run_file(run_dir, "launch_env.json")) or {}).items()})
    env.update(
        TETHER_RUN_ID=spec["run_id"],
        TETHER_RUN_DIR=run_dir,
        TETHER_CHECKPOINT_DIR=run_file(run_dir, "checkpoints"),
        TETHER_CHECKPOINT_KEEP=str(spec.get("checkpoint_keep", 3)),
        TETHER_CHECKPOINT_EVERY=str(spec.get("checkpoint_every", 0)),
        TETHER_EVENTS=run_file(run_dir, "events.jsonl"),
        TETHER_ARTIFACTS_DIR=run_file(run_dir, "artifacts"),
        TETHER_DATA_DIR=run_file(run_dir, "data"),
        TETHER_RESUME_FROM=resume or "",
        PYTHONUNBUFFERED="1",
    )
    env["PYTHONPATH"] = os.pathsep.join(p for p in (VERSION_DIR, env.get("PYTHONPATH", "")) if p)
    return env


def _resume_point(run_dir: str, spec: Dict[str, Any]) -> Optional[str]:
    """The checkpoint to resume from: the script's own (file, folder or glob's newest), else the runtime's latest."""
    mapped = spec.get("checkpoint_path")
    if mapped:
        return own_checkpoints.resume_point(run_dir, mapped)
    return latest_checkpoint(run_file(run_dir, "checkpoints"))


def _keep_mapped_checkpoint(run_dir: str, spec: Dict[str, Any]) -> None:
    """Keep the script's newest complete checkpoints in checkpoints/, so the manifest and resumes see them.

    Runs after every exit of the trainer, preemption included, and when `stop` or `cancel` ends a
    run whose launcher was gone. A launcher SIGKILLed with nobody stopping the run after it skips
    it (a relaunch still resumes from the script's own folder, which holds them).
    """
    mapped = spec.get("checkpoint_path")
    if not mapped:
        return
    kept, skipped = own_checkpoints.keep(run_dir, mapped, int(spec.get("checkpoint_keep", 3)))
    for path, reason in sorted(skipped.items()):
        event(run_dir, "checkpoint_not_kept", path=os.path.relpath(path, own_checkpoints.script_path(run_dir, "")),
              reason=reason)
    if kept:
        event(run_dir, "checkpoint_kept", path=os.path.relpath(kept, run_dir))


def _saved_checkpoint(run_dir: str, spec: Dict[str, Any]) -> Optional[str]:
    """The checkpoint this run leaves (relative to the run dir), or None: what a message may promise."""
    found = own_checkpoints.newest_kept(run_dir, spec.get("checkpoint_path")) or \
        latest_checkpoint(run_file(run_dir, "checkpoints"))
    return os.path.relpath(found, run_dir) if found else None


class _Supervisor:
    """Forwards stop signals to the trainer's process group and SIGKILLs after the grace time.

    Installed before the trainer starts, so a signal in between is remembered, not lost.
    """

    def __init__(self, grace_s: float) -> None:
        self.pgid, self.grace_s, self.signalled, self.pending = 0, grace_s, "", 0  # grace_s: set from run.json
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._forward)

    def attach(self, pgid: int) -> None:
        self.pgid = pgid
        if self.pending:
            self._forward(self.pending, None)

    def _forward(self, signum: int, frame: Any) -> None:
        self.signalled = self.signalled or signal.Signals(signum).name
        if not self.pgid:
            self.pending = signum
            return
        sent = signal.SIGUSR1 if signum == signal.SIGUSR1 else signal.SIGTERM
        _killpg(self.pgid, sent)
        timer = threading.Timer(self.grace_s, _killpg, (self.pgid, signal.SIGKILL))
        timer.daemon = True
        timer.start()


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _heartbeat(run_dir: str, done: threading.Event) -> None:
    beat = run_file(run_dir, "heartbeat")
    while not done.is_set():
        with open(beat, "a"):
            os.utime(beat)
        done.wait(HEARTBEAT_S)


def _outcome(run_dir: str, returncode: int, signalled: str, oom_before: Optional[int]) -> Dict[str, Any]:
    """How the attempt ended (tether.remote.endings): stopped by tether, completed, preempted, failed."""
    stopped = os.path.exists(run_file(run_dir, "stop_requested"))
    return endings.outcome(returncode, stopped, signalled, oom_before)


def run(run_dir: str) -> int:
    """Run the trainer once for this run dir; the exit code says whether it was started."""
    supervisor = _Supervisor(30.0)  # first: a signal that comes while we start up is kept, not fatal
    lock = try_lock(run_dir)
    if lock is None:
        print("run %s is already running" % run_dir, file=sys.stderr)
        return ALREADY_RUNNING_EXIT
    state = read_json(run_file(run_dir, "state.json")) or {}
    if is_final(state):
        print("run %s already ended: %s" % (run_dir, state["status"]), file=sys.stderr)
        return 0
    try:
        return _attempt(run_dir, state, lock, supervisor)
    except Exception as err:  # our own bug must not look like a lost run (a relaunch trains again)
        return _launcher_failed(run_dir, err, supervisor)


def _attempt(run_dir: str, state: Dict[str, Any], lock: int, supervisor: _Supervisor) -> int:
    """One attempt under the lock: start the trainer, wait for it, record its end, seal if final."""
    spec = read_json(run_file(run_dir, "run.json"))
    for name in ("checkpoints", "artifacts"):
        os.makedirs(run_file(run_dir, name), exist_ok=True)
    try:
        os.unlink(run_file(run_dir, "stop_requested"))
    except FileNotFoundError:
        pass
    attempt = int(state.get("attempt", 0)) + 1
    base = int(state.get("restart_base") or 0)  # a reopened run's restart budget counts from its reopening
    try:
        resuming.adopt_source(run_dir, spec, state)  # resume_from=: the source's checkpoint, checked
    except resuming.SourceError as err:
        return _ended_before_start(run_dir, attempt, resume_error=str(err))
    resume = _resume_point(run_dir, spec)
    argv = _trainer_command(spec, resume)
    supervisor.grace_s = float(spec.get("grace_seconds", 30))
    with open(run_file(run_dir, "train.log"), "ab") as log:
        offset = os.fstat(log.fileno()).st_size  # where this attempt's output starts
        try:
            child = subprocess.Popen(
                argv, cwd=work_dir(run_dir), env=_trainer_env(run_dir, spec, resume),
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, pass_fds=(lock,),  # the trainer keeps the run "alive"
                preexec_fn=objects.no_write_override(),  # a root trainer obeys the objects' 0444 too
            )
        except OSError as err:  # no such program, or not executable: the command's fault, not ours
            return _not_started(run_dir, log, err, attempt)
    supervisor.attach(child.pid)
    # The trainer writes train.log itself and a thread reads it behind: no pipe between them, so
    # a launcher killed outright never takes the trainer's output (or the trainer) with it.
    tail = progress.follow(run_file(run_dir, "train.log"), run_file(run_dir, "events.jsonl"), spec, offset)
    update_state(
        run_dir, status="running", pid=os.getpid(), pgid=child.pid, attempt=attempt,
        restarts=attempt - 1 - base, started_at=now(), resumed_from=resume, host=os.uname()[1],
        exit_code=None, ended_at=None, final=False, launcher_version=os.path.basename(VERSION_DIR),
    )
    event(run_dir, "launch", attempt=attempt, restarts=attempt - 1 - base, resumed_from=resume, argv=argv)
    oom_before = endings.oom_kills()  # an OOM kill during the attempt raises the cgroup's count
    done = threading.Event()
    threading.Thread(target=_heartbeat, args=(run_dir, done), daemon=True).start()
    returncode = child.wait()
    _killpg(child.pid, signal.SIGKILL)  # leftover children (dataloader workers) go with it
    done.set()
    if tail:
        tail.finish()  # its last events land before "exit" and before the seal reads events.jsonl
    _keep_mapped_checkpoint(run_dir, spec)
    ended = _outcome(run_dir, returncode, supervisor.signalled, oom_before)
    status = ended["status"]
    final = decide_final(status, spec, attempt - base)
    fields = dict({"signal_to": None, "oom": None}, **ended)  # no field left over from an earlier attempt
    update_state(run_dir, final=final, exit_code=returncode, ended_at=now(),
                 checkpoint=_saved_checkpoint(run_dir, spec), **fields)
    event(run_dir, "exit", exit_code=returncode, attempt=attempt, final=final, **ended)
    if final:
        seal(run_dir)
    # A SLURM job requeues itself after the time-limit warning (USR1) or a trainer's own exit 75;
    # never after a TERM: that is scancel (the user's will) or a scheduler that requeues by itself.
    requeue = os.environ.get("SLURM_JOB_ID") and supervisor.signalled not in ("SIGTERM", "SIGINT", "SIGHUP")
    return REQUEUE_EXIT if requeue and restart_allowed(status, spec, attempt - base) else 0


def _ended_before_start(run_dir: str, attempt: int, **why: str) -> int:
    """Record an attempt whose trainer never started (final: a restart would fail the same way), sealed."""
    event(run_dir, "exit", status="failed", exit_code=None, attempt=attempt, final=True, **why)
    update_state(run_dir, status="failed", final=True, exit_code=None, attempt=attempt, started_at=now(),
                 ended_at=now(), pid=os.getpid(), **why)
    seal(run_dir)
    return 0


def _not_started(run_dir: str, log: Any, err: OSError, attempt: int) -> int:
    """A trainer whose program could not be started: the reason goes into train.log too."""
    error = "%s: %s" % (type(err).__name__, err)
    log.write(("tether: the trainer could not start: %s\n" % error).encode())
    log.flush()
    return _ended_before_start(run_dir, attempt, start_error=error)


def _launcher_failed(run_dir: str, err: Exception, supervisor: _Supervisor) -> int:
    """Record the launcher's own failure (state, event), end the trainer, seal what exists; its exit code."""
    traceback.print_exc()  # into launcher.log (a SLURM job's output): the bug report needs it
    error = "%s: %s" % (type(err).__name__, err)
    if supervisor.pgid:
        _end_group(supervisor.pgid, supervisor.grace_s)
    progress.finish_all()  # no progress event may land after the seal
    try:
        event(run_dir, "launcher_error", error=error)
        update_state(run_dir, status="failed", final=True, launcher_error=error, ended_at=now())
        seal(run_dir)
    except Exception:  # the run dir itself is broken: the traceback is all we can leave
        traceback.print_exc()
    return LAUNCHER_ERROR_EXIT


def _end_group(pgid: int, grace_s: float) -> None:
    """SIGTERM a trainer that outlived its launcher's failure, SIGKILL after the grace time."""
    _killpg(pgid, signal.SIGTERM)
    deadline = time.time() + grace_s
    while _group_members(pgid) and time.time() < deadline:
        time.sleep(0.05)
    _killpg(pgid, signal.SIGKILL)


def start(run_dir: str, settings: Optional[Dict[str, Any]] = None, timeout_s: float = 30.0) -> Dict[str, Any]:
    """Start `run` detached and wait until it has taken the lock and recorded its pid.

    `settings`: {"env": {...}, "gpus": "auto"|"0,1"|"none", "min_free_gpu_mb": N}.
    """
    state = read_json(run_file(run_dir, "state.json")) or {}
    if is_final(state):
        return {"outcome": "finished", "state": state}
    if is_alive(run_dir):
        return {"outcome": "running", "state": state}
    settings = settings or {}
    try:
        env = dict(settings.get("env") or {}, **machine.gpu_env(settings))
    except ValueError as err:
        return {"outcome": "error", "state": state, "error": str(err)}
    write_private(run_file(run_dir, "launch_env.json"), env)
    with open(run_file(run_dir, "launcher.log"), "ab") as log:
        daemon = subprocess.Popen(
            [settings.get("python") or sys.executable, os.path.abspath(__file__), "run", run_dir],
            cwd=VERSION_DIR, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,  # its own session: a closed terminal or ssh channel is no signal
        )
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        state = read_json(run_file(run_dir, "state.json")) or {}
        if state.get("pid") == daemon.pid:
            return {"outcome": "started", "state": state}
        code = daemon.poll()
        if code is not None:
            state = read_json(run_file(run_dir, "state.json")) or {}
            outcome = {ALREADY_RUNNING_EXIT: "running", 0: "finished"}.get(code, "error")
            return {"outcome": outcome, "state": state, "exit_code": code, "error": state.get("launcher_error", "")}
        time.sleep(0.02)
    return {"outcome": "error", "state": state, "error": "launcher did not start in time"}


# ---------------------------------------------------------------- probe and stop


def probe(run_dir: str) -> Dict[str, Any]:
    """A snapshot of one run: status (with `lost` for a dead non-final run), liveness, ages."""
    if not os.path.isdir(run_dir):
        return {"status": "absent"}
    state = read_json(run_file(run_dir, "state.json")) or {}
    alive = is_alive(run_dir)
    status = state.get("status", "pending")
    if status in ("running", "pending") and not alive and state:
        status = "lost"
    snapshot = {"status": status, "final": is_final(state), "alive": alive, "state": state, "now": now(),
                "sealed": os.path.exists(run_file(run_dir, "PULL_MANIFEST.json"))}
    try:
        snapshot["heartbeat_age_s"] = round(time.time() - os.stat(run_file(run_dir, "heartbeat")).st_mtime, 3)
    except FileNotFoundError:
        snapshot["heartbeat_age_s"] = None
    return snapshot


def probe_all(run_dirs: List[str]) -> Dict[str, Dict[str, Any]]:
    """Snapshots of many runs; runs submitted to SLURM are read with ONE squeue call for all."""
    snapshots = {d: probe(d) for d in run_dirs}
    jobs = {d: scheduler.job_of(d) for d in run_dirs if snapshots[d]["status"] != "absent"}
    jobs = {d: j for d, j in jobs.items() if j}
    if jobs:
        queued = scheduler.queue(sorted(set(jobs.values())))
        for run_dir, job_id in jobs.items():
            _with_queue(run_dir, snapshots[run_dir], job_id, queued)
    return snapshots


def _with_queue(run_dir: str, snap: Dict[str, Any], job_id: str, queued: Optional[Dict[str, Any]]) -> None:
    """Let the scheduler's view decide queued/running/gone (squeue failing changes nothing)."""
    snap["job_id"] = job_id
    if queued is None:
        snap["queue_error"] = "squeue failed: the run's state is read from its files only"
        return
    entry = queued.get(job_id)
    if entry:
        snap["queue"] = entry
        snap["alive"] = True
        if entry["state"] in scheduler.QUEUED and not snap["final"]:
            snap["status"] = "pending"
        elif entry["state"] in scheduler.ACTIVE and snap["status"] in ("pending", "lost", "preempted"):
            snap["status"] = "running"
        return
    if not snap["final"] and not snap["alive"]:
        stopped = os.path.exists(run_file(run_dir, "stop_requested"))
        snap["scheduler"] = scheduler.describe(run_dir, job_id, stopped)
        if snap["scheduler"]["job_state"] == "CANCELLED" and not stopped:
            snap["status"] = "cancelled"
        elif snap["status"] == "pending":
            snap["status"] = "lost"


def _group_members(pgid: int) -> List[int]:
    """Pids whose process group is `pgid` (Linux /proc), zombies excluded."""
    members = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(stat.split("/")[2]))
    return members


def _wait_until_dead(run_dir: str, pgid: int, seconds: float) -> bool:
    deadline = time.time() + seconds
    while time.time() < deadline:
        if not is_alive(run_dir) and not (pgid and _group_members(pgid)):
            return True
        time.sleep(0.05)
    return False


def stop(run_dir: str, grace_s: float) -> Dict[str, Any]:
    """SIGTERM the trainer's group (and launcher), SIGKILL after grace_s, then re-probe honestly."""
    state = read_json(run_file(run_dir, "state.json")) or {}
    pgid, pid = int(state.get("pgid") or 0), int(state.get("pid") or 0)
    if not is_alive(run_dir) and not (pgid and _group_members(pgid)):
        return {"outcome": "was not running", "status": probe(run_dir)["status"]}
    atomic_write_json(run_file(run_dir, "stop_requested"), {"at": now()})
    if pid and _is_our_launcher(pid, run_dir):
        os.kill(pid, signal.SIGTERM)  # the launcher forwards it and arms its own SIGKILL timer
    _killpg(pgid, signal.SIGTERM)  # and directly, in case the launcher is already gone
    if not _wait_until_dead(run_dir, pgid, grace_s + 5):
        _killpg(pgid, signal.SIGKILL)
        if pid and _is_our_launcher(pid, run_dir):
            os.kill(pid, signal.SIGKILL)
        _wait_until_dead(run_dir, pgid, 5)
    survivors = _group_members(pgid) if pgid else []
    if is_alive(run_dir) or survivors:
        return {"outcome": "error", "survivors": survivors,
                "error": "processes survived SIGKILL: %s" % survivors}
    if not is_final(read_json(run_file(run_dir, "state.json")) or {}):
        _stopped_without_launcher(run_dir)
    return {"outcome": "stopped", "status": probe(run_dir)["status"]}


def cancel(run_dir: str, grace_s: float) -> Dict[str, Any]:
    """Stop a SLURM run (scancel, TERM then KILL); mark it stopped and sealed if its launcher could not."""
    outcome = scheduler.cancel(run_dir, grace_s)
    state = read_json(run_file(run_dir, "state.json")) or {}
    if outcome["outcome"] == "stopped" and not is_final(state) and not is_alive(run_dir):
        _stopped_without_launcher(run_dir)
    return outcome


def _stopped_without_launcher(run_dir: str) -> None:
    """Record a run whose launcher died first as stopped: keep the script's checkpoints as it would have, seal."""
    spec = read_json(run_file(run_dir, "run.json")) or {}
    _keep_mapped_checkpoint(run_dir, spec)
    update_state(run_dir, status="stopped", final=True, ended_at=now(), checkpoint=_saved_checkpoint(run_dir, spec))
    seal(run_dir)


def _is_our_launcher(pid: int, run_dir: str) -> bool:
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            return run_dir.encode() in f.read()
    except OSError:
        return False


def reopen(run_dir: str) -> Dict[str, Any]:
    """An ended run (not completed) becomes startable as its next attempt (tether.remote.resume)."""
    return resuming.reopen(run_dir, _saved_checkpoint(run_dir, read_json(run_file(run_dir, "run.json")) or {}))


def checkpoint(run_dir: str, named: Optional[str] = None) -> Dict[str, Any]:
    """The run's latest checkpoint (or `named`): path, bytes, SHA-256, step."""
    named = named or _saved_checkpoint(run_dir, read_json(run_file(run_dir, "run.json")) or {})
    return resuming.checkpoint_info(run_dir, named)


def remove(run_dir: str) -> Dict[str, Any]:
    """Delete an ended run's folder (the object store stays); never a live run's."""
    if not os.path.isdir(run_dir):
        return {"outcome": "absent"}
    if is_alive(run_dir):
        return {"outcome": "alive"}
    shutil.rmtree(run_dir)
    return {"outcome": "removed"}


# ---------------------------------------------------------------- command line


def main(argv: List[str]) -> int:
    """`run RUN_DIR` (the detached launcher, a SLURM job), or any command of the table with its input
    as JSON (`probe '{"run_dirs": [...]}'`): what the serve process answers, for a shell on the far side."""
    if argv[:1] == ["run"] and len(argv) == 2:
        return run(os.path.normpath(argv[1]))
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
