"""The code and data trees a job pushes: listed with excludes, hashed once per file change."""

from __future__ import annotations

import fnmatch
import functools
import hashlib
import json
import os
import re
from typing import Any, Callable
from dataclasses import dataclass

from tether.remote.fileio import atomic_write_json, read_json, sha256_file


@dataclass(frozen=True)
class Entry:
    """One file to push: where it is here, where it goes there, and its content hash."""

    root: str  # "code" or "data"
    path: str  # posix path relative to the project root
    local: str  # absolute path on this machine
    sha256: str
    size: int
    mode: int


class HashCache:
    """SHA-256 by (path, size, mtime_ns): an unchanged file is never hashed twice."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.entries = read_json(path) or {}
        self.dirty = False

    def sha256(self, local: str, stat: os.stat_result) -> str:
        key = [stat.st_size, stat.st_mtime_ns]
        cached = self.entries.get(local)
        if cached and cached[:2] == key:
            return cached[2]
        digest, _ = sha256_file(local)
        self.entries[local] = key + [digest]
        self.dirty = True
        return digest

    def save(self) -> None:
        if self.dirty:
            atomic_write_json(self.path, self.entries)
            self.dirty = False


@functools.lru_cache(maxsize=64)
def _matcher(patterns: tuple[str, ...]) -> Callable[[str], Any]:
    """One compiled regex for all the patterns (fnmatch's own translation; case as fnmatch.fnmatch on posix)."""
    if not patterns:
        return lambda text: None
    return re.compile("|".join(f"(?:{fnmatch.translate(p)})" for p in patterns)).match


def _excluded(relpath: str, patterns: tuple[str, ...]) -> bool:
    """Whether the path, or any of its parts, matches an exclude pattern."""
    match = _matcher(patterns)
    return bool(match(relpath)) or any(match(part) for part in relpath.split("/"))


def _walk(project_root: str, path: str, patterns: tuple[str, ...]):
    start = os.path.normpath(os.path.join(project_root, path))
    if os.path.isfile(start):
        yield start
        return
    for folder, dirs, files in os.walk(start):
        rel = os.path.relpath(folder, project_root).replace(os.sep, "/")
        dirs[:] = sorted(d for d in dirs if not _excluded(d if rel == "." else f"{rel}/{d}", patterns))
        for name in sorted(files):
            yield os.path.join(folder, name)


def tree(root: str, project_root: str, paths: tuple[str, ...], exclude: tuple[str, ...],
         cache: HashCache) -> list[Entry]:
    """Every file under `paths` (relative to `project_root`) not matching `exclude`."""
    entries = {}
    for path in paths:
        for local in _walk(project_root, path, exclude):
            rel = os.path.relpath(local, project_root).replace(os.sep, "/")
            if _excluded(rel, exclude) or rel.startswith("../"):
                continue
            stat = os.stat(local)
            entries[rel] = Entry(root, rel, local, cache.sha256(local, stat), stat.st_size,
                                 stat.st_mode & 0o777)
    return [entries[k] for k in sorted(entries)]


def tree_hash(entries: list[Entry]) -> str:
    """One SHA-256 for a whole tree: paths, modes and contents."""
    listing = [[e.root, e.path, e.sha256, e.mode] for e in entries]
    return hashlib.sha256(json.dumps(listing).encode()).hexdigest()
