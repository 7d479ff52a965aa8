"""Small-file requests for a mailbox: create once, append at an offset, read many at once, delete.

A mailbox (tether/mailbox.py) is a remote_dir that two sides write without seeing each other: the
laptop and an agent. These are the operations that need to be atomic on the far side, where the
files are: `create` is exclusive (two agents never both claim a run), `append` continues a copy
only where it ended, and `peek` reads every small file a poll needs in one round trip.
"""

import glob
import os
import stat
import time
from typing import Any, Dict, List, Optional, Tuple

from tether.remote.fileio import CHUNK
from tether.remote.objects import _inside, received

PEEK_LIMIT = 1 << 20  # a peeked file larger than this is reported by size only


def create(root: str, path: str, peer: Any) -> Dict[str, Any]:
    """Write the client's stream to root/path unless it exists (then nothing): {"created": bool}.

    The bytes go to a temporary name that is hard-linked to the final one, which fails if that
    exists: the file appears whole, and only one of two racing writers makes it."""
    full = _inside(root, path)
    tmp = received(full, peer)
    try:
        os.link(tmp, full)
        created = True
    except FileExistsError:
        created = False
    finally:
        os.unlink(tmp)
    return {"created": created}


def append(root: str, path: str, offset: int, peer: Any) -> Dict[str, Any]:
    """Append the client's stream to root/path if the file is `offset` bytes long now (a missing file
    is 0): {"size": its size after}. Otherwise nothing is written and "size" says where it ends,
    so the client sends again from there (a copy that grows, never one written twice)."""
    full = _inside(root, path)
    os.makedirs(os.path.dirname(full), exist_ok=True)
    size = os.path.getsize(full) if os.path.exists(full) else 0
    reader = peer.ask({"size": size} if size != offset else {})
    if size != offset:
        reader.drain()
        return {"size": size, "appended": False}
    with open(full, "ab") as out:
        for chunk in iter(lambda: reader.read(CHUNK), b""):
            out.write(chunk)
        out.flush()
        os.fsync(out.fileno())
    return {"size": os.path.getsize(full), "appended": True}


def peek(root: str, paths: Optional[List[str]] = None, patterns: Optional[List[str]] = None) -> Dict[str, Any]:
    """The text, size and age of each regular file named or matched by a glob under root, at most 1 MiB
    each (a larger one: its size only); missing files are left out, and so is a match that is not a
    regular file or leads out of root (a link, a pipe: whoever else writes the mailbox cannot make a
    poll fail or hang). A named path that leaves root is refused. {"now": the far side's clock, "files"}."""
    base = os.path.realpath(root)
    wanted = [(rel, _inside(root, rel)) for rel in paths or []]
    for pattern in patterns or []:
        found = glob.glob(_inside(root, pattern))
        wanted += [(os.path.relpath(f, base), f) for f in sorted(found) if ".tmp-" not in os.path.basename(f)
                   and os.path.realpath(f).startswith(base + os.sep)]
    files = {}  # type: Dict[str, Dict[str, Any]]
    now = time.time()
    for rel, full in dict(wanted).items():
        found = _small_file(full)
        if found is not None:
            text, size, mtime = found
            files[rel] = {"size": size, "age_s": round(now - mtime, 3), "text": text}
    return {"now": now, "files": files}


def _small_file(full: str) -> Optional[Tuple[Optional[str], int, float]]:
    """(its text, or None above PEEK_LIMIT; its size; its mtime) of a regular file, else None (without
    blocking on a pipe)."""
    try:
        fd = os.open(full, os.O_RDONLY | os.O_NONBLOCK)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError):
        return None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None
        data = f.read(PEEK_LIMIT) if st.st_size <= PEEK_LIMIT else None
    return (data.decode("utf-8", "replace") if data is not None else None), st.st_size, st.st_mtime


def delete(root: str, paths: List[str]) -> Dict[str, Any]:
    """Remove the files root/path (never a folder); those already gone count as removed."""
    for rel in paths:
        try:
            os.unlink(_inside(root, rel))
        except FileNotFoundError:
            pass
    return {"deleted": len(paths)}
