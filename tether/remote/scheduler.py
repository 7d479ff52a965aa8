"""SLURM on the login node: submit once per run, one squeue for many runs, reasons in words, stop.

Stdlib only, Python >= 3.8 (copied to the far side with the launcher). No sacct: many
clusters have no accounting, so a finished job is read from `scontrol show job -o` (kept for
MinJobAge seconds) and from the job's own exit-code file.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shlex
import shutil
import subprocess
import time
from typing import Any, Dict, List, Optional, Tuple

from tether.remote.fileio import atomic_write, atomic_write_json, read_json
from tether.remote.rundir import event, write_private

RUNS_LINE = "runs=()  # filled in by submit-array"
QUEUED = ("PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "SUSPENDED", "RESIZING")
ACTIVE = ("RUNNING", "COMPLETING", "STAGE_OUT", "SIGNALING")
REASONS = {  # scontrol's JobState, in words
    "TIMEOUT": "reached its time limit", "NODE_FAIL": "its node failed", "PREEMPTED": "was preempted by the scheduler",
    "OUT_OF_MEMORY": "ran out of memory", "CANCELLED": "was cancelled from outside tether",
    "BOOT_FAIL": "its node failed to boot", "DEADLINE": "passed its deadline", "FAILED": "failed",
    "COMPLETED": "completed",
}


TIMEOUT_S = float(os.environ.get("TETHER_SCHEDULER_TIMEOUT_S") or 30)  # one squeue or scontrol, at most
JOB_ID = re.compile(r"^\d+(_\d+)?$")  # squeue -r lists array elements one by one: 12_3
STATE = re.compile(r"^[A-Z_]+$")
FORGOTTEN = "Invalid job id"  # what squeue and scontrol say of a job the scheduler no longer knows


def _run(argv: List[str], timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)


def _ask(argv: List[str]) -> Tuple[Optional[subprocess.CompletedProcess], str]:
    """One scheduler command within TIMEOUT_S: (its result, '') or (None, why it failed, in one line)."""
    try:
        done = _run(argv, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return None, "%s did not answer within %g s" % (argv[0], TIMEOUT_S)
    except OSError as err:
        return None, "%s: %s" % (argv[0], err.strerror or err)
    if done.returncode != 0 and FORGOTTEN not in done.stderr:
        said = (done.stderr.strip().splitlines() or ["no message"])[-1][:300]
        return None, "%s exited %d: %s" % (argv[0], done.returncode, said)
    return done, ""


def job_of(run_dir: str) -> Optional[str]:
    return (read_json(os.path.join(run_dir, "slurm.json")) or {}).get("job_id")


def queue(job_ids: List[str]) -> Optional[Dict[str, Dict[str, str]]]:
    """{job id: {state, reason, nodes}} for the queued or running ones, in ONE squeue call; None on failure."""
    return queue_or_error(job_ids)[0]


def queue_or_error(job_ids: List[str]) -> Tuple[Optional[Dict[str, Dict[str, str]]], str]:
    """queue()'s answer and, when it is None, why: a failing, hanging or garbled squeue must never make
    a healthy job look gone (a line that is not `ID|STATE|REASON|NODES` fails the whole answer)."""
    if not job_ids:
        return {}, ""
    done, why = _ask(["squeue", "-h", "-r", "-j", ",".join(job_ids), "-o", "%i|%T|%r|%N"])
    if done is None:
        return None, why
    found = {}
    for line in done.stdout.splitlines():
        fields = line.split("|")
        if len(fields) != 4 or not JOB_ID.match(fields[0].strip()) or not STATE.match(fields[1]):
            return None, "squeue printed an unreadable line: %r" % line[:200]
        found[fields[0].strip()] = {"state": fields[1], "reason": fields[2], "nodes": fields[3]}
    return found, ""


def job_details(job_id: str) -> Optional[Dict[str, str]]:
    """`scontrol show job -o` as a dict (empty once the scheduler has forgotten the job; None: scontrol failed)."""
    done, _ = _ask(["scontrol", "show", "job", "-o", job_id])
    if done is None:
        return None
    if done.returncode != 0:
        return {}  # FORGOTTEN
    details = {}
    for word in done.stdout.split():
        key, _, value = word.partition("=")
        details[key] = value
    if "JobId" not in details:
        return None  # garbage: scontrol's answer always starts with JobId=
    return details


def describe(run_dir: str, job_id: str, stopped_by_tether: bool) -> Dict[str, Any]:
    """Why a job left the queue: JobState, Reason and ExitCode from scontrol, the exit-code file, in words."""
    details = job_details(job_id)
    if details is None:  # scontrol failed: nothing is known, so nothing is decided
        return {"job_state": None, "reason": None, "words": "is unknown (scontrol failed)", "exit_code": None,
                "node": None, "unknown": True}
    state = details.get("JobState", "")
    words = REASONS.get(state, state.lower() or "left the queue (the scheduler no longer knows it)")
    if state == "CANCELLED" and stopped_by_tether:
        words = "was stopped by tether"
    exit_file = os.path.join(run_dir, "exit_code.%s" % job_id)
    exit_code = open(exit_file).read().strip() if os.path.exists(exit_file) else details.get("ExitCode")
    return {"job_state": state, "reason": details.get("Reason"), "words": words, "exit_code": exit_code,
            "node": details.get("BatchHost") or details.get("NodeList")}


def submit(run_dir: str, settings: Dict[str, Any]) -> Dict[str, Any]:
    """Submit job.sh once for this run (under a lock): an existing job of the run is adopted, never doubled."""
    with open(os.path.join(run_dir, "submit.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        state = read_json(os.path.join(run_dir, "state.json"), dict) or {}
        known = read_json(os.path.join(run_dir, "slurm.json")) or {}
        if state.get("final"):
            return {"outcome": "finished", "job_id": known.get("job_id"), "flags": known.get("flags"), "state": state}
        if known.get("job_id"):
            queued = queue([known["job_id"]])
            if queued is None:  # cannot tell whether the job still runs: never risk a second one
                return {"outcome": "error", "error": "squeue failed, so job %s may still run: try again" % known["job_id"]}
            still = known["job_id"] in queued or _scheduler_knows(known["job_id"])
            if still is None:  # squeue omitted it, scontrol failed: never risk a second job
                return {"outcome": "error", "error": "scontrol failed, so job %s may still run: try again" % known["job_id"]}
            if still:
                return {"outcome": "running", "job_id": known["job_id"], "flags": known.get("flags"), "state": state}
        write_private(os.path.join(run_dir, "launch_env.json"), settings.get("env") or {})  # secrets: 0600
        script = os.path.join(run_dir, "job.sh")
        atomic_write(script, lambda f: f.write(settings["script"].encode()))
        flags = settings["flags"]
        done = _run(["sbatch"] + flags + [script])
        if done.returncode != 0:
            return {"outcome": "error", "error": "sbatch exited %d: %s" % (done.returncode, done.stderr.strip()[-500:])}
        job_id = done.stdout.strip().split(";")[0]
        _record_job(run_dir, job_id, flags, known, state)
        return {"outcome": "started", "job_id": job_id, "flags": flags, "state": state}


def submit_array(remote_dir: str, settings: Dict[str, Any]) -> Dict[str, Any]:
    """One job array for the runs in settings["runs"] that need a job (under each run's lock):
    a finished run or one whose job is still queued is left alone, never submitted twice."""
    run_dirs = sorted(set(settings["runs"]))
    locks = [open(os.path.join(d, "submit.lock"), "w") for d in run_dirs]
    try:
        for lock in locks:
            fcntl.flock(lock, fcntl.LOCK_EX)
        return _submit_array(remote_dir, run_dirs, settings)
    finally:
        for lock in locks:
            lock.close()


def _submit_array(remote_dir: str, run_dirs: List[str], settings: Dict[str, Any]) -> Dict[str, Any]:
    states = {d: read_json(os.path.join(d, "state.json"), dict) or {} for d in run_dirs}
    known = {d: read_json(os.path.join(d, "slurm.json")) or {} for d in run_dirs}
    jobs = [k["job_id"] for d, k in known.items() if k.get("job_id") and not states[d].get("final")]
    queued = queue(jobs)
    if queued is None:  # cannot tell whether those jobs still run: never risk a second one
        return {"outcome": "error", "error": "squeue failed, so jobs %s may still run: try again" % ", ".join(jobs)}
    outcomes, todo = {}, []
    for d in run_dirs:
        job_id = known[d].get("job_id")
        still = False if not job_id or states[d].get("final") else (job_id in queued or _scheduler_knows(job_id))
        if still is None:  # squeue omitted it, scontrol failed: never risk a second job
            return {"outcome": "error", "error": "scontrol failed, so job %s may still run: try again" % job_id}
        if states[d].get("final"):
            outcomes[d] = {"outcome": "finished", "job_id": job_id, "state": states[d]}
        elif still:
            outcomes[d] = {"outcome": "running", "job_id": job_id, "state": states[d]}
        else:
            todo.append(d)
    result = {"outcome": "ok", "runs": outcomes, "submitted": todo, "array_job": None, "flags": []}
    if not todo:
        return result
    folder = os.path.join(remote_dir, "slurm")
    os.makedirs(folder, exist_ok=True)
    listing = "runs=(%s)" % " ".join(shlex.quote(d) for d in todo)
    script = settings["script"].replace(RUNS_LINE, listing)
    path = os.path.join(folder, "array-%s.sh" % hashlib.sha256(script.encode()).hexdigest()[:16])
    atomic_write(path, lambda f: f.write(script.encode()))
    limit = settings.get("array_limit")
    flags = settings["flags"] + ["--array=0-%d%s" % (len(todo) - 1, "%%%d" % limit if limit else "")]
    for d in todo:
        write_private(os.path.join(d, "launch_env.json"), settings.get("env") or {})  # secrets: 0600
    done = _run(["sbatch"] + flags + [path])
    if done.returncode != 0:
        return {"outcome": "error", "error": "sbatch exited %d: %s" % (done.returncode, done.stderr.strip()[-500:])}
    array_job = done.stdout.strip().split(";")[0]
    for index, d in enumerate(todo):
        job_id = "%s_%d" % (array_job, index)
        _record_job(d, job_id, flags, known[d], states[d], array_job=array_job)
        outcomes[d] = {"outcome": "started", "job_id": job_id, "state": states[d]}
    return dict(result, array_job=array_job, flags=flags)


def _scheduler_knows(job_id: str) -> Optional[bool]:
    """Whether scontrol still has the job queued or running (squeue may have left it out); None: scontrol failed."""
    details = job_details(job_id)
    if details is None:
        return None
    return details.get("JobState") in QUEUED + ACTIVE


def _record_job(run_dir: str, job_id: str, flags: List[str], known: Dict[str, Any], state: Dict[str, Any],
                **extra: Any) -> None:
    """slurm.json (which job runs this run), a `submit` event, and the state `pending` with the job."""
    record = dict(extra, job_id=job_id, flags=flags, submitted_at=round(time.time(), 3),
                  jobs=known.get("jobs", []) + [job_id])
    atomic_write_json(os.path.join(run_dir, "slurm.json"), record)
    event(run_dir, "submit", job_id=job_id, flags=flags)  # the run's log says which job and how
    if state.get("status") in (None, "pending"):
        atomic_write_json(os.path.join(run_dir, "state.json"), dict(state, status="pending", job_id=job_id))


def cancel(run_dir: str, grace_s: float) -> Dict[str, Any]:
    """SIGTERM to the job's script (passed on once to the trainer), plain scancel after grace_s; what happened."""
    job_id = job_of(run_dir)
    queued, why = queue_or_error([job_id]) if job_id else ({}, "")
    if queued is None:  # never report "was not running" for a job squeue could not be asked about
        return {"outcome": "error", "job_id": job_id, "error": "%s, so job %s may still run: try again" % (why, job_id)}
    if not queued.get(job_id):
        return {"outcome": "was not running", "job_id": job_id}
    atomic_write_json(os.path.join(run_dir, "stop_requested"), {"at": time.time()})
    if (queue([job_id]) or {}).get(job_id, {}).get("state") in QUEUED:
        _run(["scancel", job_id])  # nothing runs yet: no one to warn (and TERM is refused for it)
    else:  # not --full: srun, in the batch step, would turn its TERM into a SIGKILL of every task
        _run(["scancel", "--batch", "--signal=TERM", job_id])  # job.sh -> launcher -> trainer (nodes.py: a
        # srun step's tasks, once; signalling the steps here as well would TERM every task twice)
    deadline = time.time() + grace_s
    while time.time() < deadline and (queue([job_id]) or {}).get(job_id):
        time.sleep(0.5)
    forced = bool((queue([job_id]) or {}).get(job_id))
    if forced:
        _run(["scancel", job_id])
        deadline = time.time() + 60
        while time.time() < deadline and (queue([job_id]) or {}).get(job_id):
            time.sleep(0.5)
    if (queue([job_id]) or {}).get(job_id):
        return {"outcome": "error", "job_id": job_id, "error": "job %s is still in the queue after scancel" % job_id}
    return {"outcome": "stopped", "job_id": job_id, "forced": forced}


def check(settings: Dict[str, Any]) -> Dict[str, Any]:
    """The login node's side of a SLURM preflight: the commands, the partitions."""
    commands = {c: bool(shutil.which(c)) for c in ("sbatch", "squeue", "scancel", "scontrol", "sinfo")}
    partitions: List[str] = []
    if commands["sinfo"]:
        done = _run(["sinfo", "-h", "-o", "%P"], timeout=30)
        partitions = [p.rstrip("*") for p in done.stdout.split()] if done.returncode == 0 else []
    return {"commands": commands, "partitions": partitions, "partition": settings.get("partition")}
