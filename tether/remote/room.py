"""Room for the launcher's last records on a full disk: a reserve file, released when a write finds no space.

Stdlib only, Python >= 3.8 (copied to the far side with the launcher). A trainer that fills the run's
filesystem (a checkpoint that does not fit) would otherwise leave the launcher unable to write the
attempt's end: state.json would still say `running` and the run would read as lost. The launcher
holds RESERVE_BYTES in a private file of the run dir from its start; a write that fails with ENOSPC
releases it and is tried once more, so the end, its reason and the seal land.
"""

from __future__ import annotations

import errno
import os
from typing import Callable, TypeVar

RESERVE = "space_reserve"  # a private run-dir file (rundir.PRIVATE_FILES): never sealed, never pulled
RESERVE_BYTES = 1 << 20  # state.json, a few events, the seal and a traceback fit many times over
FULL_BYTES = 1 << 20  # free space below this when a trainer fails: the disk filled, say so
T = TypeVar("T")


def reserve(run_dir: str) -> None:
    """Hold RESERVE_BYTES in the run dir (blocks really allocated); a disk already full holds what it can."""
    path = os.path.join(run_dir, RESERVE)
    try:
        if os.path.getsize(path) >= RESERVE_BYTES:
            return
    except OSError:
        pass
    try:
        with open(path, "wb") as f:
            f.write(b"\0" * RESERVE_BYTES)  # written, not fallocated: some filesystems have no fallocate
            f.flush()
            os.fsync(f.fileno())
    except OSError:
        return


def release(run_dir: str) -> bool:
    """Give the reserve back to the filesystem; whether there was one to give."""
    try:
        os.unlink(os.path.join(run_dir, RESERVE))
    except OSError:
        return False
    return True


def with_room(run_dir: str, write: Callable[[], T]) -> T:
    """`write()`, tried once more after releasing the reserve when it finds no space left."""
    try:
        return write()
    except OSError as err:
        if err.errno != errno.ENOSPC or not release(run_dir):
            raise
    return write()


def free_bytes(path: str) -> int:
    """Bytes an unprivileged writer may still use on `path`'s filesystem (-1 when it cannot be asked)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return -1
    return st.f_bavail * st.f_frsize


def full_reason(run_dir: str) -> str:
    """`no space left on device ...` in words when the run's filesystem is full now, else ''."""
    free = free_bytes(run_dir)
    if free < 0 or free >= FULL_BYTES:
        return ""
    return "no space left on device: %d bytes free on the filesystem of %s; free space there" % (free, run_dir)
