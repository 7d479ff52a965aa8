"""Continuing what did not complete, on this side: resume a stopped run, `retry=1` a failed one, and
`resume_from=RUN_ID` (a new run seeded with another run's latest checkpoint).

Nothing here relaunches a run by itself: each path is an explicit verb, and each refusal is one
line naming the command that does what the user probably wants.
"""

from __future__ import annotations

import json
import os
import sys
from typing import TYPE_CHECKING, Any

from tether import manifest
from tether.errors import ConfigError
from tether.paths import RunPaths, check_run_id
from tether.remote.endings import words as signal_words
from tether.remote.fileio import read_json
from tether.remote.protocol import COMPLETED, Snapshot

if TYPE_CHECKING:
    from tether.pipelines.session import Session


# ------------------------------------------------------------------ resume_from=RUN_ID


def source(s: "Session", run_id: str) -> dict[str, Any]:
    """What a `resume_from=` run records of its source: run id, checkpoint path, SHA-256 (and step).

    Refused in one line, before anything is pushed or launched: an unknown run, one of another
    backend, one without a checkpoint.
    """
    check_run_id(run_id)
    src = s.paths(run_id)
    record = read_json(src.run_json)
    if record is None:
        try:
            record = read_json_text(s.backend.far.cat(src.remote_file("run.json")))
        except FileNotFoundError:
            record = None
    if record is None:
        raise ConfigError(f"resume_from={run_id}: no such run here or on backend {s.job.backend} "
                          f"({src.remote_abs}): `ls .tether/runs` lists the runs known here")
    if record.get("backend") not in (None, s.job.backend):
        raise ConfigError(f"resume_from={run_id}: that run is on backend {record['backend']}, this job on "
                          f"{s.job.backend}: pass backend={record['backend']} (its checkpoint stays where it ran)")
    info = s.backend.far.checkpoint(src.remote_abs)
    if info.outcome == "absent":
        raise ConfigError(f"resume_from={run_id}: its run dir is gone from backend {s.job.backend} "
                          f"(`doit down` removed it?), so its checkpoint cannot seed a new run")
    if not info.checkpoint:
        raise ConfigError(f"resume_from={run_id}: run {run_id} ({info.status}) saved no checkpoint to "
                          f"resume from: run without resume_from to start from step 0")
    return {"run_id": run_id, "checkpoint": info.checkpoint, "sha256": info.sha256, "step": info.step}


def read_json_text(data: bytes) -> dict | None:
    """A far-side run.json's bytes as a dict (None when it is not one)."""
    try:
        found = json.loads(data)
    except ValueError:
        return None
    return found if isinstance(found, dict) else None


def lineage(record: dict) -> str:
    """`resumed from ID (checkpoint PATH, step N, sha256 ...)`, or '' for a run started from scratch."""
    source = record.get("resume_from")
    if not source:
        return ""
    step = f", step {source['step']}" if source.get("step") is not None else ""
    return f"resumed from {source['run_id']} (checkpoint {source['checkpoint']}{step}, sha256 {source['sha256']})"


# ------------------------------------------------------------------ a run that ended without completing


def checkpoint_words(state: dict) -> str:
    """What a run left to resume from, as the launcher recorded it (older launchers did not)."""
    if "checkpoint" not in state:
        return "its checkpoints/ folder holds what it saved"
    saved = state["checkpoint"]
    return f"its latest checkpoint is {saved}" if saved else "it saved no checkpoint"


def retry_hint(state: dict) -> str:
    """The command that relaunches an ended run, and from where."""
    where = "from there" if state.get("checkpoint") else "from the start"
    return f"`doit run train retry=1` relaunches it {where}"


def how_it_ended(snap: Snapshot) -> str:
    """`failed: killed by SIGKILL (out of memory?)`, `stalled: no output ... (stall_timeout_s)`, or
    `failed (exit code 1)`."""
    said = "; ".join(filter(None, (snap.state.get("reason"), signal_words(snap.state))))
    return f"{snap.status}: {said}" if said else f"{snap.status} (exit code {snap.state.get('exit_code')})"


def relaunch(s: "Session", run: RunPaths, snap: Snapshot, retry: bool) -> str:
    """An ended run asked to run again (a stopped one, or any with retry=1): reopened on the far side and
    archived here; a completed one never runs again. The far side's outcome ("" when left alone)."""
    if snap.status == COMPLETED:
        if retry:
            raise ConfigError(f"retry=1: run {run.run_id} completed, and a completed run is final: change the "
                              f"code or config for a new run, or pass resume_from={run.run_id} to start one "
                              f"from its checkpoint")
        return ""
    opened = s.backend.reopen(run)
    if opened["outcome"] == "refused":
        raise ConfigError(f"run {run.run_id}: {opened['error']}")
    if opened["outcome"] == "reopened":
        archive_here(run, int(opened["state"].get("reopened", {}).get("attempt") or 0))
        print(resuming_words(run, opened), file=sys.stderr)
    return opened["outcome"]


def resuming_words(run: RunPaths, opened: dict) -> str:
    """`resuming ID from checkpoint step N, attempt k` (the path when the step is unknown)."""
    checkpoint, step, attempt = opened.get("checkpoint"), opened.get("step"), opened.get("next_attempt")
    if not checkpoint:
        return f"resuming {run.run_id} from the start (it saved no checkpoint), attempt {attempt}"
    where = f"step {step}" if step is not None else checkpoint
    return f"resuming {run.run_id} from checkpoint {where}, attempt {attempt}"


def archive_here(run: RunPaths, attempt: int) -> None:
    """The previous attempt's manifest and pulled files move aside here too: what was verified for it
    proves nothing about the next attempt, and must not make `train` skip it as "already verified"."""
    manifest.forget(run)
    suffix = f".attempt-{attempt}"
    for path in (run.manifest, run.files):
        if os.path.lexists(path):
            os.replace(path, _free(path.replace("PULL_MANIFEST.json", f"PULL_MANIFEST{suffix}.json")
                                   if path == run.manifest else path + suffix))
    for phase in ("watch", "pull"):
        try:
            os.unlink(run.stamp(phase))
        except FileNotFoundError:
            pass


def _free(path: str) -> str:
    """`path`, or `path.2`, `path.3` ... when an earlier archive of the same attempt is there."""
    found, n = path, 1
    while os.path.lexists(found):
        n += 1
        found = f"{path}.{n}"
    return found


def verified_complete(run: RunPaths) -> bool:
    """Verified here and what was verified is a completed run's manifest (an older one, without a status,
    counts as complete): only then may the forward phases skip the run."""
    if not manifest.still_verified(run):
        return False
    return (read_json(run.manifest) or {}).get("status", COMPLETED) == COMPLETED
