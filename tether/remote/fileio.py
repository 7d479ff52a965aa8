"""Atomic writes and SHA-256 hashing, shared by both sides (stdlib only, Python >= 3.8)."""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import stat
from typing import Any, BinaryIO, Callable, List, Optional, Tuple

CHUNK = 1 << 20  # 1 MiB reads: past this, hashing speed no longer improves


def fsync_dir(path: str) -> None:
    """Make a rename inside `path` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: str, write: Callable[[BinaryIO], None]) -> None:
    """Write `path` through `write(file)` so that readers see the old file or the whole new one."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, ".%s.tmp-%d" % (os.path.basename(path), os.getpid()))
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(folder)


def atomic_write_bytes(path: str, data: bytes) -> None:
    """Atomically replace `path` with `data`."""
    atomic_write(path, lambda f: f.write(data))


def dump_json(obj: Any) -> bytes:
    """The one JSON encoding tether writes: sorted keys, indented, newline-terminated."""
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()


def atomic_write_json(path: str, obj: Any) -> None:
    """Atomically replace `path` with `obj` as JSON."""
    atomic_write_bytes(path, dump_json(obj))


class TornFile(ValueError):
    """A JSON file tether writes whole that is cut short, not JSON or of the wrong shape: never trusted."""

    def __init__(self, path: str, why: str) -> None:
        super().__init__("%s is torn or damaged (%s): tether writes it whole (tmp, fsync, rename), so something "
                         "else cut or changed it and nothing in it is trusted: put a good copy back (a pulled run "
                         "keeps one under .tether/runs/<run id>/files/), then run the command again" % (path, why))
        self.path = path


def read_json(path: str, want: Optional[type] = None) -> Optional[Any]:
    """The JSON in `path`, or None when the file does not exist; TornFile when it is not JSON (or, with
    `want`, not of that type); other errors propagate."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    try:
        value = json.loads(data.decode())
    except ValueError as err:  # JSONDecodeError and UnicodeDecodeError both are
        raise TornFile(path, "%s bytes, %s" % (len(data), err)) from None
    if want is not None and not isinstance(value, want):
        raise TornFile(path, "a JSON %s, not an object" % type(value).__name__)
    return value


def json_lines(data: bytes) -> Tuple[List[dict], int]:
    """The JSON objects of a .jsonl text, and how many non-empty lines are not one (a line a killed or
    cut-short writer left torn, or a trainer's junk: `5` is JSON, but no event)."""
    found, torn = [], 0
    for line in data.splitlines():
        try:
            value = json.loads(line)
        except ValueError:
            value = None
        if isinstance(value, dict):
            found.append(value)
        elif line.strip():
            torn += 1
    return found, torn


def append_line(path: str, line: bytes) -> None:
    """Append one newline-ended line in one write; a torn last line (a write a full disk cut short) is
    ended first, so it stays one unreadable line instead of gluing itself to this one."""
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            line = b"\n" + line
        if os.write(fd, line) < len(line):
            raise OSError(errno.ENOSPC, "no space left on device: a line of %s was cut short" % path)
    finally:
        os.close(fd)


def sha256_file(path: str) -> Tuple[str, int]:
    """(hex SHA-256, size in bytes) of the file at `path`."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(CHUNK), b""):
            digest.update(chunk)
            size += len(chunk)
    return digest.hexdigest(), size


def sha256_regular(path: str) -> Tuple[str, int]:
    """sha256_file of a regular file only: a link is not followed, a pipe never blocks (OSError instead)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", path)
        digest, size = hashlib.sha256(), 0
        for chunk in iter(lambda: f.read(CHUNK), b""):
            digest.update(chunk)
            size += len(chunk)
    return digest.hexdigest(), size


def tar_bytes(files: List[Tuple[str, str]]) -> bytes:
    """A tar, in memory, of local files: [(name in the archive, local path)] (one batch of small files)."""
    import tarfile  # only a push needs it

    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, local in files:
            tar.add(local, arcname=name, recursive=False)
    return buffer.getvalue()
