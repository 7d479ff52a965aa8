"""Resuming what did not complete: reopening an ended run for a next attempt, and seeding a new run
from another run's checkpoint (`resume_from=`).

Stdlib only, Python >= 3.8 (copied to the far side with the launcher). Only explicit verbs reopen a
run (`doit run train` of a stopped run, `retry=1` of a failed or preempted one): the sealed manifest
of the attempt that ended is archived as PULL_MANIFEST.attempt-N.json (never sealed, never changed),
so the next attempt seals a manifest of its own and nothing verified against the old one counts.
"""

from __future__ import annotations

import os
import re
import shutil
from typing import Any, Dict, Optional

from tether.remote.fileio import json_lines, read_json, sha256_regular
from tether.remote.rundir import FOR_GOOD, event, is_alive, is_final, now, run_file, update_state
from tether.remote.runtime import CHECKPOINT_RE

def checkpoint_step(run_dir: str, relpath: Optional[str]) -> Optional[int]:
    """The training step a checkpoint holds: from the runtime's name, its `checkpoint` event, or the
    last step logged before the file was written (a script's own checkpoint); None when unknown."""
    if not relpath:
        return None
    named = CHECKPOINT_RE.match(os.path.basename(relpath))
    if named:
        return int(named.group(1))
    try:
        written = os.stat(run_file(run_dir, relpath)).st_mtime
    except OSError:
        return None
    step = None
    for record in _events(run_dir):
        if record.get("event") in ("step", "checkpoint") and isinstance(record.get("step"), int) \
                and float(record.get("t") or 0) <= written:
            step = record["step"]
    return step


def _events(run_dir: str) -> list:
    try:
        with open(run_file(run_dir, "events.jsonl"), "rb") as f:
            return json_lines(f.read())[0]
    except OSError:
        return []


def checkpoint_info(run_dir: str, relpath: Optional[str]) -> Dict[str, Any]:
    """What `resume_from=` records of a run's checkpoint (its latest, or `relpath`): path, bytes,
    SHA-256, step, status; `outcome` absent (no run dir) or missing (no such file)."""
    if not os.path.isdir(run_dir):
        return {"outcome": "absent"}
    state = read_json(run_file(run_dir, "state.json"), dict) or {}
    info = {"outcome": "found", "status": state.get("status", "pending"), "checkpoint": relpath}
    if relpath:
        if relpath.startswith("/") or ".." in relpath.split("/"):
            return {"outcome": "missing", "checkpoint": relpath}
        try:
            digest, size = sha256_regular(run_file(run_dir, relpath))
        except OSError:
            return dict(info, outcome="missing")
        info.update(sha256=digest, bytes=size, step=checkpoint_step(run_dir, relpath))
    return info


def _archive_manifest(run_dir: str, attempt: int) -> Optional[str]:
    """Move the sealed manifest of attempt N aside (a rename: atomic); its new name, or None if unsealed."""
    name = "PULL_MANIFEST.attempt-%d.json" % attempt
    try:
        os.replace(run_file(run_dir, "PULL_MANIFEST.json"), run_file(run_dir, name))
    except FileNotFoundError:
        return None
    return name


def reopen(run_dir: str, checkpoint: Optional[str]) -> Dict[str, Any]:
    """Make an ended (not completed) run startable again as its next attempt; `start` then launches it."""
    state = read_json(run_file(run_dir, "state.json"), dict) or {}
    status = state.get("status", "pending")
    if is_alive(run_dir):
        return {"outcome": "running", "state": state}
    if status in FOR_GOOD:
        return {"outcome": "refused", "state": state,
                "error": "it completed, and a completed run is final for ever"}
    if not is_final(state):
        return {"outcome": "open", "state": state}  # nothing sealed: `start` continues it as it is
    attempt = int(state.get("attempt") or 0)
    archived = _archive_manifest(run_dir, attempt)
    # "pending": if the launch that follows never happens, the run reads as lost, and `doit run
    # train` launches it; the restart budget counts again from this attempt on.
    state = update_state(run_dir, status="pending", final=False, restart_base=attempt,
                         reopened={"from": status, "attempt": attempt, "manifest": archived, "at": now()})
    event(run_dir, "reopen", previous=status, attempt=attempt, archived=archived, checkpoint=checkpoint)
    return {"outcome": "reopened", "state": state, "archived": archived, "checkpoint": checkpoint,
            "step": checkpoint_step(run_dir, checkpoint), "next_attempt": attempt + 1}


class SourceError(Exception):
    """The checkpoint `resume_from=` names cannot be used (gone, changed, or outside the runs)."""


def adopt_source(run_dir: str, spec: Dict[str, Any], state: Dict[str, Any]) -> Optional[str]:
    """Before a `resume_from=` run's first attempt: copy the source run's checkpoint into this run's
    checkpoints/ (where resumes look), checked by SHA-256; the copy's path, or None when not wanted."""
    source = spec.get("resume_from")
    if not source or state.get("attempt"):
        return None
    if not re.match(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$", str(source.get("run_id"))) \
            or ".." in source["checkpoint"].split("/") or source["checkpoint"].startswith("/"):
        raise SourceError("resume_from %r: not a run id and a path inside its run dir" % (source,))
    origin = os.path.join(os.path.dirname(run_dir), source["run_id"], source["checkpoint"])
    mapped = spec.get("checkpoint_path")
    name = os.path.basename(mapped) if mapped else os.path.basename(source["checkpoint"])
    target = run_file(run_dir, os.path.join("checkpoints", name))
    if os.path.isfile(target) and sha256_regular(target)[0] == source["sha256"]:
        return target  # put there already (`tether repro` uploads a pulled copy when the source is gone)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    tmp = target + ".tmp-%d" % os.getpid()
    try:
        shutil.copyfile(origin, tmp)
    except OSError as err:
        raise SourceError("run %s's checkpoint %s is not on this machine any more (%s): start without "
                          "resume_from, or from a run that still has one" % (source["run_id"], source["checkpoint"],
                                                                            type(err).__name__))
    digest, _ = sha256_regular(tmp)
    if digest != source["sha256"]:
        os.unlink(tmp)
        raise SourceError("run %s's checkpoint %s changed since it was chosen (sha256 %s, recorded %s): "
                          "run `doit run train resume_from=%s` again to take its latest"
                          % (source["run_id"], source["checkpoint"], digest[:12], source["sha256"][:12], source["run_id"]))
    os.replace(tmp, target)
    event(run_dir, "resume_source", run_id=source["run_id"], checkpoint=source["checkpoint"], sha256=digest)
    return target
