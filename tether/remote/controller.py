"""The far-side controller: one run's attempts under its lock, its policy enforced with nobody watching.

Stdlib only, Python >= 3.8 (copied to the far side with the launcher). `run(RUN_DIR)` is the
detached launcher (or a SLURM job's): it starts the trainer, records its life in state.json and
events.jsonl, and decides what happens when an attempt ends, from run.json's spec and `controls`:

- the restart policy: a preempted or stalled (or, under `on-failure`, failed) attempt is followed by
  the next one from the latest checkpoint after a backoff, up to `max_restarts`; under SLURM the
  job requeues itself instead. The lock is held throughout, so no one else starts a duplicate;
- `max_wall_seconds` (counted from the run's first start, restarts included) and
  `stall_timeout_s` (tether.remote.watchdog) end an attempt: checkpoint signal, grace, SIGKILL;
- `processes` (tether.remote.ranks): the trainer under torchrun, the attempt's end read from its ranks;
- notifications (tether.remote.notify) on the run's ends and restarts, after the seal;
- the box's idle stop (tether.remote.idle), once the run is sealed and its lock released.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
import traceback
from typing import Any, Dict, List, Optional, Tuple

from tether.remote import endings, environment, gpuchoice, idle, notify, objects, progress, ranks, resume as resuming, room
from tether.remote import mapped as own_checkpoints
from tether.remote.fileio import read_json
from tether.remote import nodes  # a multi-node SLURM job's srun step
from tether.remote.rundir import decide_final, event, is_final, now, restart_allowed, run_file, seal, try_lock, update_state
from tether.remote.runtime import latest_checkpoint
from tether.remote.supervise import Heartbeat, Supervisor, end_group, killpg
from tether.remote.protocol import FAILED, LOST, PREEMPTED, RUNNING, STALLED
from tether.remote.watchdog import WALL, Watchdog
from tether.remote.workdir import work_dir

ALREADY_RUNNING_EXIT = 3
LAUNCHER_ERROR_EXIT = 4  # `run`: the launcher itself failed; state.json's launcher_error says how
REQUEUE_EXIT = 99  # `run` under SLURM: "requeue this job, the restart policy wants another attempt"
VERSION_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
POLL_S = 0.5  # how often an attempt's limits are checked
BACKOFF_MAX_S = 600.0  # the longest wait before a restart
NOTIFY_DRAIN_S = 30.0  # how long the launcher waits for its last notifications before it exits
ENDINGS = (PREEMPTED, STALLED, FAILED, LOST)  # a previous attempt's end that a next attempt restarts from


def run(run_dir: str) -> int:
    """Run the trainer's attempts for this run dir; the exit code says whether it was started."""
    supervisor = Supervisor(30.0)  # first: a signal that comes while we start up is kept, not fatal
    lock = try_lock(run_dir)
    if lock is None:
        print("run %s is already running" % run_dir, file=sys.stderr)
        return ALREADY_RUNNING_EXIT
    state = read_json(run_file(run_dir, "state.json"), dict) or {}
    if is_final(state):
        print("run %s already ended: %s" % (run_dir, state["status"]), file=sys.stderr)
        return 0
    gpus, refusal = gpuchoice.claim_safely(run_dir)  # under the run's lock: a dead run's leases are reclaimable
    if refusal:
        gpuchoice.refused(run_dir, refusal)  # left startable: `start` answers with the reason
        os.close(lock)
        return LAUNCHER_ERROR_EXIT
    heartbeat = Heartbeat(run_dir)
    control = None  # type: Optional[Controller]
    try:
        control = Controller(run_dir, supervisor, lock)
        code, state = control.attempts(state)
    except Exception as err:  # our own bug must not look like a lost run (a relaunch trains again)
        code, state = _launcher_failed(run_dir, err, supervisor, control)
    heartbeat.stop()
    room.release(run_dir)  # the reserve is for a live launcher's records: an ended run keeps no 1 MiB
    gpuchoice.give_back(run_dir, gpus)  # held through every attempt and backoff of this launcher
    os.close(lock)  # the run reads as ended from here on; what follows is housekeeping
    if control is not None:
        control.after(state)
    return code


class Controller:
    """One launcher's view of its run: the spec, its controls, the supervisor and the notifier."""

    def __init__(self, run_dir: str, supervisor: Supervisor, lock: int) -> None:
        self.run_dir, self.supervisor, self.lock = run_dir, supervisor, lock
        spec = read_json(run_file(run_dir, "run.json"))
        if not isinstance(spec, dict):
            raise ValueError("run.json is missing or not a JSON object")
        self.spec, self.controls = spec, spec.get("controls") or {}
        self.notifier = notify.Notifier(run_dir, self.controls.get("notify"))
        supervisor.grace_s = float(spec.get("grace_seconds", 30))

    def attempts(self, state: Dict[str, Any]) -> Tuple[int, Dict[str, Any]]:
        """Attempt after attempt until one is final or the next is not this launcher's to start."""
        while True:
            state = self.attempt(state)
            if state.get("final") or not self._wait_to_restart(state):
                break
        state = read_json(run_file(self.run_dir, "state.json"), dict) or state  # a stop during the backoff ended it
        return self._exit_code(state), state

    def attempt(self, state: Dict[str, Any]) -> Dict[str, Any]:
        """One attempt: start the trainer, watch its limits, record its end, seal and notify if final."""
        run_dir, spec = self.run_dir, self.spec
        for name in ("checkpoints", "artifacts"):
            os.makedirs(run_file(run_dir, name), exist_ok=True)
        room.reserve(run_dir)  # taken again after a full disk released it (a retry once space was freed)
        _forget_stop_request(run_dir)
        state = _record_lost_attempt(run_dir, state)
        attempt = int(state.get("attempt", 0)) + 1
        base = int(state.get("restart_base") or 0)  # a reopened run's restart budget counts from its reopening
        try:
            resuming.adopt_source(run_dir, spec, state)  # resume_from=: the source's checkpoint, checked
        except resuming.SourceError as err:
            return self._ended_before_start(attempt, resume_error=str(err))
        resume = _resume_point(run_dir, spec)
        env = _trainer_env(run_dir, spec, resume)
        argv = _trainer_command(spec, resume, env)
        with open(run_file(run_dir, "train.log"), "ab") as log:
            offset = os.fstat(log.fileno()).st_size  # where this attempt's output starts
            try:
                child = subprocess.Popen(
                    argv, cwd=work_dir(run_dir), env=env,
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    start_new_session=True, pass_fds=(self.lock,),  # the trainer keeps the run "alive"
                    preexec_fn=objects.no_write_override(),  # a root trainer obeys the objects' 0444 too
                )
            except OSError as err:  # no such program, or not executable: the command's fault, not ours
                return self._not_started(log, err, attempt)
        self.supervisor.attach(child.pid)
        # The trainer writes train.log itself and a thread reads it behind: no pipe between them, so
        # a launcher killed outright never takes the trainer's output (or the trainer) with it.
        tail = progress.follow(run_file(run_dir, "train.log"), run_file(run_dir, "events.jsonl"), spec, offset)
        if state.get("status") in ENDINGS and not state.get("final"):
            self.notifier.send("restarted", dict(state, status="running", attempt=attempt))
        wall_since = state.get("wall_since") if state.get("wall_base", 0) == base else None
        state = update_state(
            run_dir, status="running", pid=os.getpid(), pgid=child.pid, attempt=attempt,
            restarts=attempt - 1 - base, started_at=now(), resumed_from=resume, host=os.uname()[1],
            exit_code=None, ended_at=None, final=False, launcher_version=os.path.basename(VERSION_DIR),
            plan=None, wall_since=wall_since or now(), wall_base=base, previous=_previous(state),
        )
        event(run_dir, "launch", attempt=attempt, restarts=attempt - 1 - base, resumed_from=resume, argv=argv)
        oom_before = endings.oom_kills()  # an OOM kill during the attempt raises the cgroup's count
        returncode, verdict = self._wait(child, Watchdog(run_dir, self.controls, state["wall_since"]))
        killpg(child.pid, signal.SIGKILL)  # leftover children (dataloader workers) go with it
        returncode = ranks.settle(run_dir, spec, child.pid, returncode)  # torchrun: no rank left; read as one script
        self.supervisor.detach()
        if tail:
            tail.finish()  # its last events land before "exit" and before the seal reads events.jsonl
        full = room.full_reason(run_dir) if returncode else ""  # before the reserve goes: it is part of "full"
        if full:
            room.release(run_dir)  # the records below need the room; keeping a copy may fail, and is reported
        _keep_mapped_checkpoint(run_dir, spec)
        stopped = os.path.exists(run_file(run_dir, "stop_requested"))
        ended = endings.outcome(returncode, stopped, self.supervisor.signalled, oom_before)
        if verdict and not stopped:  # the launcher ended it: its reason, whatever the trainer died of
            ended.update(verdict)
        elif full and ended["status"] == "failed":
            ended["reason"] = full
        final = decide_final(ended["status"], spec, attempt - base)
        fields = dict({"signal_to": None, "oom": None, "reason": None}, **ended)  # nothing left from an earlier attempt
        state = update_state(run_dir, final=final, exit_code=returncode, ended_at=now(),
                             checkpoint=saved_checkpoint(run_dir, spec), **fields)
        event(run_dir, "exit", exit_code=returncode, attempt=attempt, final=final, **ended)
        if final:
            seal(run_dir)
        self._notify_end(state)
        return state

    def _wait(self, child: "subprocess.Popen[bytes]", dog: Watchdog) -> Tuple[int, Optional[Dict[str, Any]]]:
        """The trainer's exit code, checking the limits every poll; the limit that ended it, if one did."""
        while True:
            try:
                return child.wait(timeout=POLL_S), dog.verdict
            except subprocess.TimeoutExpired:
                pass
            verdict = dog.check()
            if verdict:
                event(self.run_dir, "limit", **verdict)
                self.supervisor.end()  # checkpoint and exit now; SIGKILL after the grace time

    def _wait_to_restart(self, state: Dict[str, Any]) -> bool:
        """Plan the next attempt in state.json and wait out its backoff; False when it is not ours to
        start (SLURM requeues the job; the policy says no; a signal came, meaning "stop")."""
        attempt, base = int(state["attempt"]), int(state.get("restart_base") or 0)
        if os.environ.get("SLURM_JOB_ID") or self.supervisor.signalled \
                or not restart_allowed(state["status"], self.spec, attempt - base):
            return False
        restart = self.spec.get("restart") or {}
        delay = min(BACKOFF_MAX_S, float(restart.get("backoff_s", 10)) * 2 ** (attempt - base - 1))
        plan = {"action": "restart", "at": round(time.time() + delay, 3), "attempt": attempt + 1,
                "of": base + int(restart.get("max_restarts", 0)) + 1, "after": state["status"],
                "from_step": resuming.checkpoint_step(self.run_dir, state.get("checkpoint"))}
        update_state(self.run_dir, plan=plan)
        event(self.run_dir, "restart_planned", **plan)
        if not self.supervisor.wait(delay):
            return True
        self._stopped_while_waiting()
        return False

    def _stopped_while_waiting(self) -> None:
        """A signal during the backoff: `doit stop` (stop_requested) ends the run here; any other
        leaves it as it was (preempted, not final) for whoever starts it next."""
        state = update_state(self.run_dir, plan=None)
        if os.path.exists(run_file(self.run_dir, "stop_requested")):
            event(self.run_dir, "exit", status="stopped", exit_code=None, attempt=state.get("attempt"), final=True)
            self._notify_end(stopped_without_launcher(self.run_dir))  # the event lands before the seal

    def _exit_code(self, state: Dict[str, Any]) -> int:
        # A SLURM job requeues itself after the time-limit warning (USR1), a trainer's own exit 75 or a
        # stall; never after a TERM: that is scancel (the user's will) or a scheduler that requeues by itself.
        signalled = self.supervisor.signalled in ("SIGTERM", "SIGINT", "SIGHUP")
        base = int(state.get("restart_base") or 0)
        wanted = not state.get("final") and restart_allowed(state["status"], self.spec, int(state["attempt"]) - base)
        return REQUEUE_EXIT if os.environ.get("SLURM_JOB_ID") and not signalled and wanted else 0

    def _notify_end(self, state: Dict[str, Any]) -> None:
        if state.get("status") == STALLED:
            self.notifier.send(STALLED, state)
        elif state.get("final"):
            self.notifier.send(WALL if state.get("reason") == WALL else state["status"], state)

    def after(self, state: Dict[str, Any]) -> None:
        """After the lock is released: the last notifications go out, then the box's idle stop waits."""
        self.notifier.drain(NOTIFY_DRAIN_S)
        settings = self.controls.get("idle_stop")
        if settings and state.get("final") and not os.environ.get("SLURM_JOB_ID"):
            idle.wait_then_stop(self.run_dir, settings, self._still_ours)

    def _still_ours(self) -> bool:
        """The run is still the final one this launcher left (not reopened, not removed)."""
        state = read_json(run_file(self.run_dir, "state.json"), dict) or {}
        return is_final(state) and state.get("pid") == os.getpid()

    def _ended_before_start(self, attempt: int, **why: str) -> Dict[str, Any]:
        """Record an attempt whose trainer never started (final: a restart would fail the same way), sealed."""
        event(self.run_dir, "exit", status="failed", exit_code=None, attempt=attempt, final=True, **why)
        state = update_state(self.run_dir, status="failed", final=True, exit_code=None, attempt=attempt,
                             started_at=now(), ended_at=now(), pid=os.getpid(), plan=None, **why)
        seal(self.run_dir)
        self._notify_end(state)
        return state

    def _not_started(self, log: Any, err: OSError, attempt: int) -> Dict[str, Any]:
        """A trainer whose program could not be started: the reason goes into train.log too."""
        error = "%s: %s" % (type(err).__name__, err)
        log.write(("tether: the trainer could not start: %s\n" % error).encode())
        log.flush()
        return self._ended_before_start(attempt, start_error=error)


def _forget_stop_request(run_dir: str) -> None:
    try:
        os.unlink(run_file(run_dir, "stop_requested"))
    except FileNotFoundError:
        pass


def _record_lost_attempt(run_dir: str, state: Dict[str, Any]) -> Dict[str, Any]:
    """An attempt still `running` when its run's lock is ours ended with its launcher killed outright
    (SIGKILL, a node lost, a scheduler's kill after its grace): give it the exit it never got, so
    every launch in events.jsonl has one and `status` says what happened."""
    if state.get("status") != RUNNING or not state.get("attempt"):
        return state
    why = {"status": LOST, "reason": "its launcher ended before it could record the attempt's end"}
    event(run_dir, "exit", exit_code=None, attempt=state["attempt"], final=False, **why)
    return update_state(run_dir, ended_at=now(), exit_code=None, **why)


def _previous(state: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """How the attempt before this one ended, kept while this one runs (`status`: "stalled 4 min ago")."""
    if state.get("status") not in ENDINGS:
        return state.get("previous")
    return {"status": state["status"], "reason": state.get("reason"), "at": state.get("ended_at"),
            "attempt": state.get("attempt")}


def _launcher_failed(run_dir: str, err: Exception, supervisor: Supervisor,
                     control: Optional[Controller]) -> Tuple[int, Dict[str, Any]]:
    """Record the launcher's own failure (state, event), end the trainer, seal what exists; its exit code."""
    traceback.print_exc()  # into launcher.log (a SLURM job's output): the bug report needs it
    error = "%s: %s" % (type(err).__name__, err)
    if supervisor.pgid:
        end_group(supervisor.pgid, supervisor.grace_s)
    progress.finish_all()  # no progress event may land after the seal
    state = {}  # type: Dict[str, Any]
    try:
        event(run_dir, "launcher_error", error=error)
        state = update_state(run_dir, status="failed", final=True, launcher_error=error, ended_at=now(), plan=None)
        seal(run_dir)
        if control is not None:
            control.notifier.send("failed", state)
    except Exception:  # the run dir itself is broken: the traceback is all we can leave
        traceback.print_exc()
    return LAUNCHER_ERROR_EXIT, state


# ---------------------------------------------------------------- the trainer's command and checkpoints


def _trainer_command(spec: Dict[str, Any], resume: Optional[str], env: Optional[Dict[str, str]] = None) -> List[str]:
    argv = [sys.executable if a == "{python}" else a for a in spec["argv"]]
    if resume:
        argv += [a.replace("{checkpoint}", resume) for a in spec.get("resume_args", [])]
    argv = ranks.command(argv, spec, env or {})  # `processes`: under torchrun, on this host
    argv = environment.with_setup(argv, spec)  # the job's setup: lines first (a SLURM job.sh ran them itself)
    srun = os.environ.get("TETHER_SRUN")  # job.sh of a multi-node SLURM job: one trainer per node
    return nodes.step_command(srun, argv) if srun else argv  # (a torchrun per node: wrap argv above this)


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
    try:
        kept, skipped = own_checkpoints.keep(run_dir, mapped, int(spec.get("checkpoint_keep", 3)))
    except OSError as err:  # a full disk: the script's own file stays the resume point, the run's end is recorded
        if err.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise  # anything else is our own failure, reported as one (launcher_error)
        event(run_dir, "checkpoint_not_kept", path=mapped, reason="could not keep a copy: %s" % err)
        return
    for path, reason in sorted(skipped.items()):
        event(run_dir, "checkpoint_not_kept", path=os.path.relpath(path, own_checkpoints.script_path(run_dir, "")),
              reason=reason)
    if kept:
        event(run_dir, "checkpoint_kept", path=os.path.relpath(kept, run_dir))


def saved_checkpoint(run_dir: str, spec: Dict[str, Any]) -> Optional[str]:
    """The checkpoint this run leaves (relative to the run dir), or None: what a message may promise."""
    mapped = spec.get("checkpoint_path")
    own = own_checkpoints.complete(run_dir, mapped)[0] if mapped else []  # no copy kept (a full disk): the script's own
    found = own_checkpoints.newest_kept(run_dir, mapped) or (own[-1] if own else None) or \
        latest_checkpoint(run_file(run_dir, "checkpoints"))
    return os.path.relpath(found, run_dir) if found else None



def stopped_without_launcher(run_dir: str) -> Dict[str, Any]:
    """Record a run whose trainer is gone as stopped: keep the script's checkpoints as an attempt's end would, seal."""
    spec = read_json(run_file(run_dir, "run.json")) or {}
    _keep_mapped_checkpoint(run_dir, spec)
    state = update_state(run_dir, status="stopped", final=True, ended_at=now(), plan=None,
                         checkpoint=saved_checkpoint(run_dir, spec))
    seal(run_dir)
    return state

