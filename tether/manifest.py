"""PULL_MANIFEST (built on the far side) against pulled files: verify, record, re-check cheaply."""

from __future__ import annotations

import hashlib
import json
import os
import time
import zipfile

from tether.errors import ManifestError
from tether.paths import RunPaths
from tether.remote.fileio import atomic_write_json, read_json, sha256_file


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def load(run: RunPaths) -> tuple[dict, str]:
    """The local copy of the manifest and its SHA-256; ManifestError when there is none."""
    try:
        with open(run.manifest, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise ManifestError(f"run {run.run_id} has no pulled manifest: run `doit pull run={run.run_id}`")
    return json.loads(data), digest(data)


def local_files(run: RunPaths) -> set[str]:
    """Every file under the run's pulled folder, as manifest-style relative paths."""
    found = set()
    for folder, _, names in os.walk(run.files):
        for name in names:
            found.add(os.path.relpath(os.path.join(folder, name), run.files).replace(os.sep, "/"))
    return found


def content_problem(path: str, notes: dict) -> str:
    """Why a pulled file's content is unusable ('' when fine): JSON parses, torch checkpoints load.

    A torch checkpoint (a zip archive) is loaded with weights_only=True when torch is installed;
    `notes` counts what was loaded and what could only be checked by hash.
    """
    name = os.path.basename(path)
    try:
        if name.endswith(".json"):
            with open(path, "rb") as f:
                json.loads(f.read())
        elif name.endswith(".jsonl"):
            with open(path, "rb") as f:
                for line in f:
                    if line.strip():
                        json.loads(line)
        elif zipfile.is_zipfile(path):
            torch = _torch()
            notes["torch_files"] = notes.get("torch_files", 0) + 1
            if torch is not None:
                torch.load(path, map_location="cpu", weights_only=True)
                notes["torch_loaded"] = notes.get("torch_loaded", 0) + 1
    except Exception as err:  # any failure to parse or load is the finding
        return f"{type(err).__name__}: {str(err)[:200]}"
    return ""


def _torch():
    try:
        import torch  # only when a torch checkpoint is there: the import costs a second
    except ImportError:
        return None
    return torch


def verify(run: RunPaths, left: dict[str, str] | None = None) -> dict:
    """Check every pulled file against the manifest; write PULL_VERIFIED.json, or raise naming them.

    `left`: files the pull left on the far side on purpose (size limits); they are recorded as
    remote-only instead of being required here.
    """
    try:
        verified = check(run, left)
    except ManifestError:
        _forget(run)
        raise
    atomic_write_json(run.verified, verified)
    return verified


def check(run: RunPaths, left: dict[str, str] | None = None) -> dict:
    """What `verify` records, without writing anything; ManifestError naming every bad file."""
    manifest, manifest_sha = load(run)
    left = left or {}
    listed = {entry["path"]: entry for entry in manifest["files"] if entry["path"] not in left}
    problems = []
    present = local_files(run)
    for extra in sorted(present - set(listed)):
        problems.append(f"{extra}: not in the manifest")
    record, notes = {}, {}
    for path, entry in sorted(listed.items()):
        local = run.pulled(path)
        if path not in present:
            problems.append(f"{path}: missing")
            continue
        sha, size = sha256_file(local)
        if size != entry["bytes"] or sha != entry["sha256"]:
            problems.append(f"{path}: {size} bytes, sha256 {sha[:12]}; the manifest says "
                            f"{entry['bytes']} bytes, sha256 {entry['sha256'][:12]}")
            continue
        bad = content_problem(local, notes)
        if bad:
            problems.append(f"{path}: does not load: {bad}")
            continue
        stat = os.stat(local)
        record[path] = [stat.st_size, stat.st_mtime_ns]
    if problems:
        raise ManifestError(f"run {run.run_id} failed verification ({len(problems)} of "
                            f"{len(listed)} files): " + "; ".join(problems)
                            + f". `doit pull run={run.run_id}` fetches them again")
    verified = {"run_id": run.run_id, "manifest_sha256": manifest_sha, "files": record,
                "bytes": sum(e["bytes"] for e in listed.values()), "verified_at": round(time.time(), 3),
                "missing_declared": manifest.get("missing", []), "remote_only": left,
                "torch_files": notes.get("torch_files", 0), "torch_loaded": notes.get("torch_loaded", 0)}
    return verified


def _forget(run: RunPaths) -> None:
    """A verification that no longer holds must not stay on disk looking valid."""
    try:
        os.unlink(run.verified)
    except FileNotFoundError:
        pass


def still_verified(run: RunPaths) -> bool:
    """Cheap re-check (stat only): PULL_VERIFIED.json exists and nothing pulled has changed since."""
    verified = read_json(run.verified)
    if not verified:
        return False
    try:
        with open(run.manifest, "rb") as f:
            if digest(f.read()) != verified["manifest_sha256"]:
                return False
        for path, (size, mtime_ns) in verified["files"].items():
            stat = os.stat(run.pulled(path))
            if (stat.st_size, stat.st_mtime_ns) != (size, mtime_ns):
                return False
    except FileNotFoundError:
        return False
    return local_files(run) == set(verified["files"])
