"""Small-file requests for a mailbox: create once, append at an offset, read many at once, delete.

A mailbox (tether/mailbox.py) is a remote_dir that two sides write without seeing each other: the
laptop and an agent. These are the operations that need to be atomic on the far side, where the
files are: `create` is exclusive (two agents never both claim a run), `append` continues a copy
only where it ended, and `peek` reads every small file a poll needs in one round trip.
"""

import glob
import os
import time
from typing import Any, Dict, List, Optional

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
    """The text, size and age of each file named or matched by a glob under root, at most 1 MiB each
    (a larger one: its size only); missing files are left out. {"now": the far side's clock, "files"}."""
    base = os.path.realpath(root)
    named = list(paths or [])
    for pattern in patterns or []:
        found = glob.glob(_inside(root, pattern))
        named += sorted(os.path.relpath(f, base) for f in found if ".tmp-" not in os.path.basename(f))
    files = {}  # type: Dict[str, Dict[str, Any]]
    now = time.time()
    for rel in dict.fromkeys(named):
        full = _inside(root, rel)
        try:
            with open(full, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                data = f.read(PEEK_LIMIT) if size <= PEEK_LIMIT else None
                mtime = os.fstat(f.fileno()).st_mtime
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            continue
        files[rel] = {"size": size, "age_s": round(now - mtime, 3),
                      "text": data.decode("utf-8", "replace") if data is not None else None}
    return {"now": now, "files": files}


def delete(root: str, paths: List[str]) -> Dict[str, Any]:
    """Remove the files root/path (never a folder); those already gone count as removed."""
    for rel in paths:
        try:
            os.unlink(_inside(root, rel))
        except FileNotFoundError:
            pass
    return {"deleted": len(paths)}
