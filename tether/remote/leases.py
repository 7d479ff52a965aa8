"""GPU leases: one file per GPU under remote_dir/gpu-leases/ naming the run that holds it.

Stdlib only, Python >= 3.8 (copied to the far side with the launcher). A lease is taken by a run's
detached launcher after it holds its run's lock, and released when that launcher ends. A lease
whose run is dead (its launcher.lock held by nobody: tether.remote.rundir.is_alive) or whose run
dir is gone is reclaimed by the next run that chooses GPUs. Choosing and taking happen under an
flock on gpu-leases/.lock, so two runs started at once never take the same GPU; each lease file
appears whole (written aside, then hard-linked into place, which fails if it exists).
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List

from tether.remote.fileio import read_json
from tether.remote.rundir import is_alive

FOLDER = "gpu-leases"


class LeaseTaken(RuntimeError):
    """A GPU's lease file appeared although the chooser held the lock (someone ignored it)."""


def folder(remote_dir: str) -> str:
    return os.path.join(remote_dir, FOLDER)


@contextmanager
def locked(remote_dir: str) -> Iterator[None]:
    """Hold gpu-leases/.lock: no other run chooses or takes GPUs meanwhile."""
    os.makedirs(folder(remote_dir), exist_ok=True)
    fd = os.open(os.path.join(folder(remote_dir), ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the flock


def _files(remote_dir: str) -> Dict[int, str]:
    """GPU index -> its lease file."""
    try:
        names = os.listdir(folder(remote_dir))
    except FileNotFoundError:
        return {}
    return {int(n[:-5]): os.path.join(folder(remote_dir), n) for n in names
            if n.endswith(".json") and n[:-5].isdigit()}


def _dead(lease: Dict[str, Any], own_run_dir: str) -> bool:
    """Whether a lease no longer holds its GPU: its run is gone or dead, or it is this run's own (an
    earlier launcher of it that was killed; this one holds the run's lock now)."""
    run_dir = str(lease.get("run_dir") or "")
    if not run_dir or run_dir == own_run_dir:
        return True
    return not os.path.isdir(run_dir) or not is_alive(run_dir)


def live(remote_dir: str, own_run_dir: str = "", reclaim: bool = False) -> Dict[int, Dict[str, Any]]:
    """The leases that still hold their GPU, by index; with `reclaim` (under the lock) dead ones are removed."""
    found = {}
    for index, path in sorted(_files(remote_dir).items()):
        try:
            lease = read_json(path)
        except ValueError:  # cannot happen to a linked-in lease; a hand-made file holds nothing
            lease = {}
        if lease is None:
            continue  # removed meanwhile
        if _dead(lease if isinstance(lease, dict) else {}, own_run_dir):
            if reclaim:
                _unlink(path)
            continue
        found[index] = lease
    return found


def take(remote_dir: str, run_dir: str, run_id: str, indices: List[int]) -> None:
    """Lease these GPUs to the run (call under `locked`, after `live(..., reclaim=True)`)."""
    record = {"run_dir": run_dir, "run_id": run_id, "pid": os.getpid(), "taken_at": round(time.time(), 3)}
    taken: List[int] = []
    for index in indices:
        path = os.path.join(folder(remote_dir), "%d.json" % index)
        aside = "%s.tmp-%d" % (path, os.getpid())
        with open(aside, "w") as f:
            json.dump(dict(record, index=index), f, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(aside, path)  # fails if the file exists: never two leases on one GPU
        except FileExistsError:
            release(remote_dir, run_dir, taken)
            raise LeaseTaken("GPU %d was leased meanwhile (%s)" % (index, path)) from None
        finally:
            _unlink(aside)
        taken.append(index)


def release(remote_dir: str, run_dir: str, indices: List[int]) -> None:
    """Give back this run's leases on these GPUs (a lease another run holds is left alone)."""
    files = _files(remote_dir)
    for index in indices:
        path = files.get(index)
        try:
            lease = read_json(path) if path else None
        except ValueError:
            lease = None
        if isinstance(lease, dict) and lease.get("run_dir") == run_dir:
            _unlink(path or "")


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
