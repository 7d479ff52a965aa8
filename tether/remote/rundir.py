"""A run directory's own files: state.json, events, the liveness lock, finality, the sealed manifest.

Stdlib only, Python >= 3.8 (copied to the far side with the launcher). Every write is atomic.
"""

from __future__ import annotations

import fcntl
import glob
import json
import os
import time
from typing import Any, Dict, List, Optional

from tether.remote.fileio import atomic_write_json, read_json, sha256_file
from tether.trainers.runtime import latest_checkpoint

FINAL = ("completed", "stopped")  # always final; "failed" is final unless the restart policy retries it

def is_final(state: Dict[str, Any]) -> bool:
    """Whether the run has ended for good: it is never launched again, and its manifest is sealed."""
    return bool(state.get("final")) or state.get("status") in FINAL


def decide_final(status: str, spec: Dict[str, Any], attempt: int) -> bool:
    """`failed` stays open for a relaunch under `restart: on-failure` while restarts remain."""
    restart = spec.get("restart") or {}
    if status == "failed":
        return not (restart.get("policy") == "on-failure" and attempt <= int(restart.get("max_restarts", 0)))
    return status in FINAL


def run_file(run_dir: str, name: str) -> str:
    """A file of the run dir."""
    return os.path.join(run_dir, name)


def now() -> float:
    return round(time.time(), 3)


def event(run_dir: str, event: str, **fields: Any) -> None:
    record = dict(fields, event=event, t=now(), source="launcher")
    line = (json.dumps(record, sort_keys=True) + "\n").encode()
    fd = os.open(run_file(run_dir, "events.jsonl"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def write_private(path: str, data: Dict[str, Any]) -> None:
    """Write JSON readable by the owner only (it may hold secrets), atomically."""
    tmp = path + ".tmp-%d" % os.getpid()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def update_state(run_dir: str, **changes: Any) -> Dict[str, Any]:
    state = read_json(run_file(run_dir, "state.json")) or {}
    state.update(changes, updated_at=now())
    atomic_write_json(run_file(run_dir, "state.json"), state)
    return state


def try_lock(run_dir: str) -> Optional[int]:
    """The locked fd of RUN_DIR/launcher.lock, or None when a live launcher or trainer holds it."""
    fd = os.open(run_file(run_dir, "launcher.lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def is_alive(run_dir: str) -> bool:
    """Whether a launcher or trainer of this run still lives (it holds the lock)."""
    if not os.path.exists(run_file(run_dir, "launcher.lock")):
        return False
    fd = try_lock(run_dir)
    if fd is None:
        return True
    os.close(fd)  # closing releases the probe's own lock at once
    return False


# ---------------------------------------------------------------- run


def restart_allowed(status: str, spec: Dict[str, Any], attempt: int) -> bool:
    """Whether the restart policy wants this attempt's end relaunched (a SLURM job requeues itself)."""
    restart = spec.get("restart") or {}
    policy, most = restart.get("policy", "on-preempt"), int(restart.get("max_restarts", 0))
    wanted = (status == "preempted" and policy in ("on-preempt", "on-failure")) or \
             (status == "failed" and policy == "on-failure")
    return wanted and attempt - 1 < most


def _roster(run_dir: str, spec: Dict[str, Any]) -> Dict[str, List[str]]:
    """The files the manifest lists, and the declared artifacts that matched nothing."""
    files = [n for n in ("run.json", "tree.json", "state.json", "events.jsonl", "train.log")
             if os.path.isfile(run_file(run_dir, n))]
    latest = latest_checkpoint(run_file(run_dir, "checkpoints"))
    if latest:
        files.append(os.path.relpath(latest, run_dir))
    mapped = spec.get("checkpoint_path")
    if mapped and os.path.isfile(run_file(run_dir, os.path.join("checkpoints", os.path.basename(mapped)))):
        files.append(os.path.join("checkpoints", os.path.basename(mapped)))
    artifacts, missing = run_file(run_dir, "artifacts"), []
    for pattern in spec.get("artifacts", []):
        found = sorted(p for p in glob.glob(os.path.join(artifacts, pattern), recursive=True)
                       if os.path.isfile(p))
        missing += [] if found else [pattern]
        files += [os.path.relpath(p, run_dir) for p in found]
    return {"files": sorted(set(files)), "missing": missing}


def seal(run_dir: str) -> Dict[str, Any]:
    """Write PULL_MANIFEST.json (bytes and SHA-256 of every roster file) unless it exists."""
    target = run_file(run_dir, "PULL_MANIFEST.json")
    existing = read_json(target)
    if existing is not None:
        return existing
    spec = read_json(run_file(run_dir, "run.json")) or {}
    roster = _roster(run_dir, spec)
    entries = []
    for name in roster["files"]:
        digest, size = sha256_file(run_file(run_dir, name))
        entries.append({"path": name, "bytes": size, "sha256": digest})
    state = read_json(run_file(run_dir, "state.json")) or {}
    manifest = {"format": 1, "run_id": spec.get("run_id"), "status": state.get("status"),
                "sealed_at": now(), "files": entries, "missing": roster["missing"],
                "artifacts": spec.get("artifacts", [])}
    atomic_write_json(target, manifest)
    return manifest
