"""PULL_MANIFEST (built on the far side) against pulled files: verify, record, re-check cheaply."""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import time
import zipfile

from tether.errors import ManifestError
from tether.paths import RunPaths
from tether.remote.fileio import atomic_write_json, read_json, sha256_file
from tether.remote.rundir import is_literal

PART = ".part"  # a file being downloaded (tether.pipelines.transfer)


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
    """Why a pulled file's content is unusable ('' when fine): JSON parses, torch and safetensors files open.

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
        elif name.endswith(".safetensors"):
            _safetensors_header(path)
        elif zipfile.is_zipfile(path):
            torch = _torch()
            notes["torch_files"] = notes.get("torch_files", 0) + 1
            if torch is not None:
                torch.load(path, map_location="cpu", weights_only=True)
                notes["torch_loaded"] = notes.get("torch_loaded", 0) + 1
    except Exception as err:  # any failure to parse or load is the finding
        return f"{type(err).__name__}: {str(err)[:200]}"
    return ""


def _safetensors_header(path: str) -> None:
    """A .safetensors file's header (8-byte little-endian length, then a JSON object) reads; ValueError if not."""
    with open(path, "rb") as f:
        head = f.read(8)
        size = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < size <= os.fstat(f.fileno()).st_size - 8:
            raise ValueError("not a safetensors file: its header length is missing or past the end")
        if not isinstance(json.loads(f.read(size)), dict):
            raise ValueError("not a safetensors file: its header is not a JSON object")


def _torch():
    try:
        import torch  # only when a torch checkpoint is there: the import costs a second
    except ImportError:
        return None
    return torch


def verify(run: RunPaths, left: dict[str, str] | None = None, declared: tuple[str, ...] | None = None) -> dict:
    """Check every pulled file against the manifest; write PULL_VERIFIED.json, or raise naming them.

    `left`: files the pull left on the far side on purpose (size limits); they are recorded as
    remote-only instead of being required here. `declared`: the config's artifacts (see `unproduced`).
    """
    try:
        verified = check(run, left, declared)
    except ManifestError:
        forget(run)
        raise
    atomic_write_json(run.verified, verified)
    return verified


def check(run: RunPaths, left: dict[str, str] | None = None, declared: tuple[str, ...] | None = None) -> dict:
    """What `verify` records, without writing anything; ManifestError naming every bad file."""
    manifest, manifest_sha = load(run)
    _check_produced(run, manifest, declared)
    left = left or {}
    listed = {entry["path"]: entry for entry in manifest["files"] if entry["path"] not in left}
    present = local_files(run)
    partial = {path + PART for path in listed}  # an interrupted pull's file: the pull continues it
    extras = sorted(present - set(listed) - partial)
    problems = [f"{extra}: not in the manifest" for extra in extras]
    refetch, record, notes = 0, {}, {}
    for path, entry in sorted(listed.items()):
        found = _problem(run, path, entry, path in present, notes)
        if found:
            problems.append(f"{path}: {found}")
            refetch += 1
            continue
        record[path] = stamp(os.stat(run.pulled(path)))
    if problems:
        raise ManifestError(f"run {run.run_id} failed verification ({len(problems)} of "
                            f"{len(listed)} files): " + "; ".join(problems) + ". " + _advice(run, refetch, extras))
    verified = {"run_id": run.run_id, "manifest_sha256": manifest_sha, "files": record,
                "bytes": sum(e["bytes"] for e in listed.values()), "verified_at": round(time.time(), 3),
                "missing_declared": manifest.get("missing", []), "remote_only": left,
                "torch_files": notes.get("torch_files", 0), "torch_loaded": notes.get("torch_loaded", 0)}
    return verified


def unproduced(manifest: dict, declared: tuple[str, ...] | None = None) -> list[str]:
    """The literal artifact names a completed run was declared to produce and did not: the contract.

    A glob that matched nothing is only a warning (pull prints it), and so is anything missing from a
    run that did not complete: a failed or stopped run's logs must still come home and verify.
    `declared` (the config's artifacts now) lets a user who drops a name from `artifacts:` accept
    the run without it; None holds the run to the list its manifest was sealed with.
    """
    if manifest.get("status") != "completed":
        return []
    wanted = manifest.get("artifacts", []) if declared is None else declared
    return [p for p in manifest.get("missing", []) if is_literal(p) and p in wanted]


def _check_produced(run: RunPaths, manifest: dict, declared: tuple[str, ...] | None) -> None:
    """ManifestError naming each literal artifact the completed run did not produce."""
    absent = unproduced(manifest, declared)
    if absent:
        said = "; ".join(f"artifact {name} was declared but the run did not produce it" for name in absent)
        raise ManifestError(
            f"run {run.run_id} failed verification: {said} (looked in artifacts/ and in the trainer's working "
            f"directory): have the script write it there and run again, or remove it from `artifacts:` in the "
            f"config to accept this run without it")


def _problem(run: RunPaths, path: str, entry: dict, present: bool, notes: dict) -> str:
    """What is wrong with one pulled file ('' when nothing): missing, other bytes, or unloadable."""
    if not present:
        return "missing"
    local = run.pulled(path)
    sha, size = hashed(local)
    if size != entry["bytes"] or sha != entry["sha256"]:
        return (f"{size} bytes, sha256 {sha[:12]}; the manifest says {entry['bytes']} bytes, "
                f"sha256 {entry['sha256'][:12]}")
    bad = content_problem(local, notes)
    return f"does not load: {bad}" if bad else ""


def _advice(run: RunPaths, refetch: int, extras: list[str]) -> str:
    """What fixes each kind of problem: pull fetches listed files; it never deletes files it did not write."""
    steps = []
    if refetch:
        steps.append(f"`doit pull verify run={run.run_id}` fetches the damaged or missing files again and checks them")
    if extras:
        paths = " ".join(shlex.quote(run.pulled(p)) for p in extras)
        steps.append(f"`rm {paths}` removes what the manifest does not list (pull never deletes a file it "
                     f"did not write), then `doit run verify run={run.run_id}`")
    return "; ".join(steps)


_HASHED: dict[str, tuple[list[int], str]] = {}  # this process's own hashes of the files it just wrote


def remember(path: str, sha256: str) -> None:
    """The pull hashed these bytes as it wrote them: verify in the same process need not read them again."""
    _HASHED[os.path.abspath(path)] = (stamp(os.stat(path)), sha256)


def hashed(path: str) -> tuple[str, int]:
    """(SHA-256, size) of a file: read again unless this process wrote and hashed it and nothing
    changed it since (size, mtime, inode and ctime all as they were then)."""
    known = _HASHED.get(os.path.abspath(path))
    stat = os.stat(path)
    if known and known[0] == stamp(stat):
        return known[1], stat.st_size
    return sha256_file(path)


def stamp(stat: os.stat_result) -> list[int]:
    """What a cheap re-check compares: ctime and inode change on any write or replacement, even one that
    puts size and mtime back (os.utime cannot set ctime)."""
    return [stat.st_size, stat.st_mtime_ns, stat.st_ino, stat.st_ctime_ns]


def forget(run: RunPaths) -> None:
    """A verification that no longer holds must not stay on disk looking valid."""
    try:
        os.unlink(run.verified)
    except FileNotFoundError:
        pass


def still_verified(run: RunPaths) -> bool:
    """Cheap re-check (stat only): PULL_VERIFIED.json exists and nothing pulled has changed since.

    Size, mtime, inode and ctime: a write that restores size and mtime still moves ctime. An
    explicit `verify` (and `down`) hashes everything again instead.
    """
    verified = read_json(run.verified)
    if not verified:
        return False
    try:
        with open(run.manifest, "rb") as f:
            if digest(f.read()) != verified["manifest_sha256"]:
                return False
        for path, recorded in verified["files"].items():
            if stamp(os.stat(run.pulled(path))) != list(recorded):  # a 2-field record of an older tether: verify again
                return False
    except FileNotFoundError:
        return False
    return local_files(run) == set(verified["files"])
