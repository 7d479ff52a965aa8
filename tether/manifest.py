"""The manifest and the gate: PULL_MANIFEST parsed, saved, checked against pulled files; down's one gate."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import time
import zipfile
from dataclasses import dataclass
from typing import Any

from tether.errors import ManifestError, RunError
from tether.paths import RunPaths
from tether.remote.fileio import TornFile, atomic_write_bytes, json_lines, atomic_write_json, read_json, sha256_file
from tether.remote.rundir import is_literal

PART = ".part"  # a file being downloaded (tether.pipelines.transfer)
SHA256 = re.compile(r"[0-9a-f]{64}")  # how the seal writes a digest (hexdigest: lowercase)


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class FileEntry:
    """One sealed file: its path under the run dir, its size and its SHA-256."""

    path: str
    bytes: int
    sha256: str


@dataclass(frozen=True)
class Refused:
    """A file the seal would not list (a link, one of tether's own files), and why."""

    path: str
    reason: str


@dataclass(frozen=True)
class Manifest:
    """A PULL_MANIFEST.json as the far side sealed it; `sha256` is that of its exact bytes."""

    files: tuple[FileEntry, ...]
    refused: tuple[Refused, ...]
    missing: tuple[str, ...]  # declared artifacts that matched nothing
    artifacts: tuple[str, ...]  # the roster the run was launched (and sealed) with
    status: str | None  # the run's status when it was sealed
    run_id: str | None
    sha256: str

    @classmethod
    def parse(cls, data: bytes, where: str, fix: str) -> Manifest:
        """The manifest in `data`; ManifestError naming `where`, what is wrong and `fix` when it is malformed."""
        try:
            return cls._parse(data)
        except ValueError as err:  # UnicodeDecodeError and JSONDecodeError are ValueErrors too
            raise ManifestError(f"{where} is not a valid manifest ({err}): {fix}") from None

    @classmethod
    def _parse(cls, data: bytes) -> Manifest:
        raw = json.loads(data.decode())
        if not isinstance(raw, dict) or not isinstance(raw.get("files"), list):
            raise ValueError("no list of files")
        files = tuple(_file_entry(e) for e in raw["files"])
        paths = [e.path for e in files]
        if len(set(paths)) != len(paths):
            raise ValueError(f"{sorted(p for p in set(paths) if paths.count(p) > 1)[0]} is listed twice")
        refused = tuple(Refused(_text(e, "path"), _text(e, "reason")) for e in _list(raw, "refused", dict))
        status, run_id = raw.get("status"), raw.get("run_id")
        if not isinstance(status, (str, type(None))) or not isinstance(run_id, (str, type(None))):
            raise ValueError("status and run_id must be strings")
        return cls(files, refused, tuple(_list(raw, "missing", str)), tuple(_list(raw, "artifacts", str)),
                   status, run_id, digest(data))

    def by_path(self) -> dict[str, FileEntry]:
        return {e.path: e for e in self.files}


def _file_entry(entry: Any) -> FileEntry:
    """One `files` item, checked: a non-empty path, a size of zero or more, a SHA-256 in hex."""
    if not isinstance(entry, dict):
        raise ValueError(f"a files item is {type(entry).__name__}, not an object")
    path, size, sha = _text(entry, "path"), entry.get("bytes"), entry.get("sha256")
    if not path or isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ValueError(f"files item {path!r} has no path or no size (bytes: {size!r})")
    if not isinstance(sha, str) or not SHA256.fullmatch(sha):
        raise ValueError(f"{path}: sha256 {sha!r} is not 64 hex digits")
    return FileEntry(path, size, sha)


def _text(entry: dict, key: str) -> str:
    if not isinstance(entry, dict) or not isinstance(entry.get(key), str):
        raise ValueError(f"an item lacks {key!r} as a string: {str(entry)[:80]}")
    return entry[key]


def _list(raw: dict, key: str, kind: type) -> list:
    """`raw[key]` (absent: empty), a list of `kind`."""
    found = raw.get(key, [])
    if not isinstance(found, list) or not all(isinstance(x, kind) for x in found):
        raise ValueError(f"{key} is not a list of {'objects' if kind is dict else 'strings'}")
    return found


def parse_far(run: RunPaths, data: bytes) -> Manifest:
    """The far side's PULL_MANIFEST.json as fetched; ManifestError when it is malformed."""
    return Manifest.parse(data, f"the far side's {run.remote_abs}/PULL_MANIFEST.json",
                          f"only the far side's seal writes it, so something else changed it; remove it there, "
                          f"then `doit pull run={run.run_id}` seals the ended run again")


def read(run: RunPaths) -> Manifest:
    """The local copy of the manifest; ManifestError when there is none or it is malformed."""
    return _parse_local(run, _local_bytes(run))


def load(run: RunPaths) -> tuple[dict, str]:
    """The local copy of the manifest as a dict (checked like `read`) and its SHA-256, for dict-reading callers."""
    data = _local_bytes(run)
    return json.loads(data), _parse_local(run, data).sha256


def _local_bytes(run: RunPaths) -> bytes:
    try:
        with open(run.manifest, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise ManifestError(f"run {run.run_id} has no pulled manifest: run `doit pull run={run.run_id}`")


def _parse_local(run: RunPaths, data: bytes) -> Manifest:
    return Manifest.parse(data, run.manifest, f"remove it, then `doit pull run={run.run_id}` fetches the far "
                                              f"side's again")


def save_pulled(run: RunPaths, data: bytes) -> str:
    """Store the far side's manifest here atomically (tmp, fsync, rename, fsync of the folder).

    One that differs from the copy here ends that copy's verification first; the answer is the
    warning to show then ('' when the manifest is new or unchanged).
    """
    try:
        with open(run.manifest, "rb") as f:
            before = f.read()
    except FileNotFoundError:
        before = data
    warning = ""
    if before != data:
        warning = (f"warning: the far side's PULL_MANIFEST.json changed since it was pulled here "
                   f"(sha256 {digest(before)[:12]}, now {digest(data)[:12]}): pulling what it lists now")
        forget(run)  # verified against the old manifest is not verified against this one
    atomic_write_bytes(run.manifest, data)
    return warning


def left_remote(run: RunPaths) -> dict[str, str]:
    """Manifest files the pull left on the far side on purpose, with the reason (from the pull stamp)."""
    return (read_json(run.stamp("pull")) or {}).get("left", {})


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
        elif name == EVENTS_LOG:
            notes["torn_event_lines"] = notes.get("torn_event_lines", 0) + _torn_lines(path)
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


EVENTS_LOG = "events.jsonl"  # append-only: a writer killed mid-line leaves a torn line, which readers skip


def _torn_lines(path: str) -> int:
    """How many lines of an events log are not a JSON object (counted, never trusted, not a failure:
    the launcher ends a torn line before its next event, and pulling again cannot change a sealed file)."""
    with open(path, "rb") as f:
        return json_lines(f.read())[1]


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
    sealed = read(run)
    _check_produced(run, sealed, declared)
    left = left or {}
    listed = {path: entry for path, entry in sealed.by_path().items() if path not in left}
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
    verified = {"run_id": run.run_id, "manifest_sha256": sealed.sha256, "files": record,
                "bytes": sum(e.bytes for e in listed.values()), "verified_at": round(time.time(), 3),
                "missing_declared": list(sealed.missing), "remote_only": left,
                "torch_files": notes.get("torch_files", 0), "torch_loaded": notes.get("torch_loaded", 0),
                "torn_event_lines": notes.get("torn_event_lines", 0)}
    return verified


def unproduced(sealed: Manifest, declared: tuple[str, ...] | None = None) -> list[str]:
    """The literal artifact names a completed run was declared to produce and did not: the contract.

    A glob that matched nothing is only a warning (pull prints it), and so is anything missing from a
    run that did not complete: a failed or stopped run's logs must still come home and verify.
    `declared` (the config's artifacts now) lets a user who drops a name from `artifacts:` accept
    the run without it; None holds the run to the list its manifest was sealed with.
    """
    if sealed.status != "completed":
        return []
    wanted = sealed.artifacts if declared is None else declared
    return [p for p in sealed.missing if is_literal(p) and p in wanted]


def _check_produced(run: RunPaths, sealed: Manifest, declared: tuple[str, ...] | None) -> None:
    """ManifestError naming each literal artifact the completed run did not produce."""
    absent = unproduced(sealed, declared)
    if absent:
        said = "; ".join(f"artifact {name} was declared but the run did not produce it" for name in absent)
        raise ManifestError(
            f"run {run.run_id} failed verification: {said} (looked in artifacts/ and in the trainer's working "
            f"directory): have the script write it there and run again, or remove it from `artifacts:` in the "
            f"config to accept this run without it")


def _problem(run: RunPaths, path: str, entry: FileEntry, present: bool, notes: dict) -> str:
    """What is wrong with one pulled file ('' when nothing): missing, other bytes, or unloadable."""
    if not present:
        return "missing"
    local = run.pulled(path)
    sha, size = hashed(local)
    if size != entry.bytes or sha != entry.sha256:
        return (f"{size} bytes, sha256 {sha[:12]}; the manifest says {entry.bytes} bytes, "
                f"sha256 {entry.sha256[:12]}")
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
    try:
        verified = read_json(run.verified, dict)
    except TornFile:
        return False  # a torn PULL_VERIFIED.json proves nothing: verify again
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


def gate_teardown(run: RunPaths, far: bytes | None, alive: bool, keep_remote: bool,
                  declared: tuple[str, ...] | None) -> dict:
    """The one gate before anything on the far side is deleted: PULL_VERIFIED.json's record, or an error.

    `far`: the far side's PULL_MANIFEST.json bytes (None: it has none), `alive`: whether the run
    is running there, `keep_remote`: nothing will be deleted, so files left there are no loss.
    Refused, in this order: not verified here, a file here no longer matching (every file is
    hashed again: a timestamp proves nothing), files left on the far side, the far manifest
    changed since it was verified, the run still running.
    """
    try:
        missing = "missing" if read_json(run.verified, dict) is None else ""
    except TornFile:
        missing = "torn: it proves nothing"
    if missing:
        raise RunError(f"refusing to tear down {run.run_id}: its results are not verified here "
                       f"({run.verified} is {missing}). Run `doit run train` (or `doit pull verify`) first")
    verified = verify(run, left_remote(run), declared)
    if verified["remote_only"] and not keep_remote:
        raise RunError(f"refusing to tear down {run.run_id}: {len(verified['remote_only'])} file(s) were left "
                       f"on the far side ({', '.join(sorted(verified['remote_only']))}): fetch them first "
                       f"(fetch_artifacts / max_artifact_mb, then `doit pull`), or set keep_remote: true")
    if far is None or digest(far) != verified["manifest_sha256"]:  # sealed again after this side verified it
        raise ManifestError(f"refusing to tear down {run.run_id}: the far side's manifest changed after it was "
                            f"verified here: `doit pull verify run={run.run_id}` fetches and checks what it lists now")
    if alive:
        raise RunError(f"refusing to tear down {run.run_id}: it is still running: `doit stop` first")
    return verified
