"""The trainer's side of the contract: events, checkpoints and the stop signal (stdlib only).

A training program, built in or the user's own, reads its places from the environment:

    TETHER_RUN_DIR         the run directory on the far side
    TETHER_CHECKPOINT_DIR  where `save_checkpoint` writes
    TETHER_EVENTS          the events.jsonl that `log` appends to
    TETHER_ARTIFACTS_DIR   where results go; the manifest lists what the config declares
    TETHER_DATA_DIR        the pushed data, laid out as in the project
    TETHER_RESUME_FROM     the latest checkpoint, or empty on a fresh start

Scripts import it as `tether.trainers.runtime` (a re-export of this module, shipped with it).

SIGTERM and SIGUSR1 mean "checkpoint now and exit": call `stop_signal()` once, check
`.requested` in the loop, save, and `sys.exit(PREEMPTED_EXIT)`.

Under torchrun (`trainer.processes`) every rank may call these: only rank 0's events and
checkpoints count, so `log` and `save_checkpoint` do nothing on the others (RANK above 0).
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from typing import Any, BinaryIO, Callable, List, Optional

from tether.remote.fileio import atomic_write, fsync_dir

__all__ = ["CHECKPOINT_RE", "PREEMPTED_EXIT", "StopSignal", "checkpoints", "latest_checkpoint", "log", "resume_from",
           "save_checkpoint", "stop_signal"]  # also what tether.trainers.runtime re-exports for users' scripts
PREEMPTED_EXIT = 75  # EX_TEMPFAIL: "checkpointed on request, run me again"
CHECKPOINT_RE = re.compile(r"^ckpt-(\d{12})\.ckpt$")


def _env(name: str) -> str:
    value = os.environ.get(name, "")
    if not value:
        raise RuntimeError("%s is not set: run this program through tether's launcher" % name)
    return value


def _other_rank() -> bool:
    """Whether this process is a rank of several other than rank 0 (torchrun sets RANK)."""
    return (os.environ.get("RANK") or "0").strip() not in ("", "0")


def log(event: str = "step", **fields: Any) -> None:
    """Append one event (a JSON object on one line, with a timestamp) to events.jsonl (rank 0 only)."""
    if _other_rank():
        return
    record = {"event": event, "t": round(time.time(), 3)}
    record.update(fields)
    line = (json.dumps(record, sort_keys=True) + "\n").encode()
    fd = os.open(_env("TETHER_EVENTS"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)  # one write of one line: appends from several processes never mix
    finally:
        os.close(fd)


def checkpoints(directory: Optional[str] = None) -> List[str]:
    """Complete checkpoints in `directory` (default: this run's), oldest first."""
    folder = directory or _env("TETHER_CHECKPOINT_DIR")
    try:
        names = sorted(n for n in os.listdir(folder) if CHECKPOINT_RE.fullmatch(n))
    except FileNotFoundError:
        return []
    return [os.path.join(folder, n) for n in names]


def latest_checkpoint(directory: Optional[str] = None) -> Optional[str]:
    """The newest complete checkpoint, or None."""
    found = checkpoints(directory)
    return found[-1] if found else None


def resume_from() -> Optional[str]:
    """The checkpoint this process should resume from (TETHER_RESUME_FROM), or None."""
    return os.environ.get("TETHER_RESUME_FROM") or None


def save_checkpoint(write: Callable[[BinaryIO], None], step: int, keep: Optional[int] = None) -> str:
    """Save a checkpoint through `write(file)` atomically, keep the newest `keep`, log it; on a rank
    other than 0, only the path rank 0 writes (nothing is written)."""
    folder = _env("TETHER_CHECKPOINT_DIR")
    path = os.path.join(folder, "ckpt-%012d.ckpt" % step)
    if _other_rank():
        return path
    atomic_write(path, write)
    keep = keep or int(os.environ.get("TETHER_CHECKPOINT_KEEP", "3"))
    others = [p for p in checkpoints(folder) if p != path]  # never the one just written
    for old in others[:max(0, len(others) - (keep - 1))]:
        os.unlink(old)
    for name in os.listdir(folder):  # temporary files of writes that were killed half-way
        if ".tmp-" in name and not name.endswith(".tmp-%d" % os.getpid()):
            os.unlink(os.path.join(folder, name))
    fsync_dir(folder)
    log("checkpoint", step=step, path=os.path.basename(path), bytes=os.path.getsize(path))
    return path


class StopSignal:
    """Turns SIGTERM and SIGUSR1 into a flag the training loop checks between steps."""

    def __init__(self) -> None:
        self.requested = False
        self.signal_name = ""
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.requested = True
        self.signal_name = signal.Signals(signum).name


def stop_signal() -> StopSignal:
    """Install the SIGTERM/SIGUSR1 handlers and return the flag they set."""
    return StopSignal()
