"""The far side's object store: content-addressed files, run snapshots built from them, pruning.

Stdlib only, Python >= 3.8 (copied to the far side with the launcher).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import shutil
import tarfile
import time
from stat import S_ISREG
from typing import IO, Any, Callable, Dict, List, Optional

from tether.remote import owner
from tether.remote.fileio import CHUNK, atomic_write_bytes, read_json
from tether.remote.workdir import WORK

PRUNE_MIN_AGE_S = 3600  # an object younger than this may belong to a push still in flight
TAR_BUFFER = 1 << 16  # tarfile's stream buffer: 64 KiB moves a GiB 2x faster than its 10 KiB default
STALE_UPLOAD_S = 600  # a partial upload this old belongs to a push that was killed
ROOTS = ("code", "data", WORK)  # what materialize builds from tree.json, each once (work/ last)
PR_CAPBSET_DROP, CAP_DAC_OVERRIDE = 24, 1  # <linux/prctl.h>, <linux/capability.h>
# objects/<first two>/<sha256>, or a partial upload of one: `receive` names it .tmp-<pid>, the
# sftp upload .tmp-<12 hex> (tether/pipelines/transfer.py)
OBJECT_NAME = re.compile(r"^([0-9a-f]{2})/(\1[0-9a-f]{62})(\.tmp-[0-9a-f]+)?$")


def object_path(objects_dir: str, sha256: str) -> str:
    """Where the object store keeps the file whose SHA-256 is `sha256`."""
    return os.path.join(objects_dir, sha256[:2], sha256)


def have(objects_dir: str, hashes: List[str]) -> List[str]:
    """The hashes in `hashes` the object store lacks (clearing partial uploads a killed push left)."""
    missing = [h for h in hashes if not os.path.exists(object_path(objects_dir, h))]
    for sha in missing:
        for partial in glob.glob(object_path(objects_dir, sha) + ".tmp-*"):
            try:
                if time.time() - os.stat(partial).st_mtime > STALE_UPLOAD_S:
                    os.unlink(partial)
            except FileNotFoundError:
                pass
    return missing


def push(objects_dir: str, run_dir: str, files: List[Dict[str, Any]], peer: Any) -> Dict[str, Any]:
    """One push: ask the client for the objects the store lacks, store its tar of them, build the run.

    tree.json is recorded once (it never changes after), then code/, data/ and work/ are built.
    """
    hashes = sorted({f["sha256"] for f in files})
    stored = receive(objects_dir, peer.ask({"need": have(objects_dir, hashes)}))
    lacking = have(objects_dir, hashes)
    if stored["bad"] or lacking:
        return dict(stored, missing=lacking, built=[])
    return dict(stored, missing=[], built=materialize(run_dir, {"files": files})["built"])


def materialize(run_dir: str, offered: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Build code/ (copies: a frozen snapshot), data/ and work/ from tree.json, once each.

    `offered`: the file list to record as tree.json if the run has none yet (it never changes after).
    work/ is where the trainer starts: every code and data file at its project-relative path.
    """
    os.makedirs(run_dir, exist_ok=True)
    if offered is not None and read_json(os.path.join(run_dir, "tree.json")) is None:
        atomic_write_bytes(os.path.join(run_dir, "tree.json"), json.dumps(offered).encode())
    tree = read_json(os.path.join(run_dir, "tree.json"))
    objects_dir = os.path.join(os.path.dirname(os.path.dirname(run_dir)), "objects")
    ordered = sorted(tree["files"], key=lambda e: e["root"] != "data")  # in both trees: linked as data
    built, made, locked = [], set(), set()  # type: List[str], set, set
    for root in ROOTS:
        final = os.path.join(run_dir, root)
        if os.path.isdir(final):
            continue
        tmp = final + ".tmp-%d" % os.getpid()
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        placed = set()
        for entry in ordered:
            if (root == WORK or entry["root"] == root) and entry["path"] not in placed:
                placed.add(entry["path"])
                source = object_path(objects_dir, entry["sha256"])
                if entry["root"] == "data" and source not in locked:
                    _read_only(source)
                    locked.add(source)
                _place(source, tmp + "/" + entry["path"], entry.get("mode", 0o644), entry["root"],
                       frozen=(root == WORK), made=made)
        os.replace(tmp, final)
        built.append(root)
    return {"built": built}


def _place(source: str, target: str, mode: int, root: str, frozen: bool, made: set) -> None:
    """Put one file of the tree at `target`: code as a copy, data as a hard link to its read-only object.

    Code is copied (small, and it keeps its own mode: a link to a 0444 object would lose `x`); in
    work/ without write bits (`frozen`), so every attempt of the run starts the snapshot's bytes.
    Data is never copied per run: a hard link to the object, which is made read-only first, so a
    script writing into its data gets an error instead of corrupting a store other runs share.
    """
    folder = os.path.dirname(target)
    if folder not in made:
        os.makedirs(folder, exist_ok=True)
        made.add(folder)
    if root == "data":  # the caller made the object read-only
        try:
            os.link(source, target)
            return
        except OSError:
            mode = 0o444  # another filesystem, or links not allowed: a copy, read-only like the object
    shutil.copyfile(source, target)
    os.chmod(target, mode & ~0o222 if frozen else mode)


def _read_only(path: str) -> None:
    """Take the write bits off an object (a push may have stored it writable)."""
    mode = os.stat(path).st_mode & 0o777
    if mode & 0o222:
        try:
            os.chmod(path, mode & ~0o222)
        except PermissionError:  # another user's object: its mode is theirs to set
            pass


def no_write_override() -> Optional[Callable[[], None]]:
    """For the trainer's Popen(preexec_fn=): a root trainer loses CAP_DAC_OVERRIDE (Linux, best effort).

    Root ignores a file's write bits, so without this a trainer running as root (common on rented
    GPU boxes and in containers) could write straight into a read-only object through work/ or data/.
    Dropping the capability from the bounding set makes the exec'd program's root obey file modes;
    where that is not allowed (no CAP_SETPCAP) the call fails quietly and the trainer runs as before.
    None when there is nothing to drop. libc is loaded here, before the fork: the child only calls it.
    """
    if os.geteuid() != 0:
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (ImportError, OSError, AttributeError):  # no ctypes or no libc prctl (not Linux)
        return None
    return lambda: prctl(PR_CAPBSET_DROP, CAP_DAC_OVERRIDE, 0, 0, 0)


def prune(remote_dir: str) -> Dict[str, Any]:
    """Remove the objects tether wrote that no run's tree.json references (and that are not brand new).

    Only names tether gives an object are candidates: objects/<sha[:2]>/<sha> (64 lowercase hex,
    a plain file whose content hashes to the name) and the partial uploads of one. Anything
    else under objects/ is someone else's: left alone and counted as `foreign`.
    """
    owner.claim(remote_dir)  # never prune a folder tether does not own
    wanted = _referenced(os.path.join(remote_dir, "runs"))
    removed, freed, kept, foreign = 0, 0, 0, 0
    objects_dir = os.path.join(remote_dir, "objects")
    if os.path.islink(objects_dir):
        return {"removed": 0, "bytes": 0, "kept": 0, "foreign": 1}  # tether never links it elsewhere
    for folder, _, names in os.walk(objects_dir):
        for name in names:
            path = os.path.join(folder, name)
            verdict = _verdict(path, os.path.relpath(path, objects_dir), wanted)
            if verdict == "foreign":
                foreign += 1
            elif verdict == "keep":
                kept += 1
            else:
                size = os.lstat(path).st_size
                os.unlink(path)
                removed, freed = removed + 1, freed + size
    return {"removed": removed, "bytes": freed, "kept": kept, "foreign": foreign}


def _referenced(runs: str) -> set:
    """Every object hash some run's tree.json lists; a tree.json that cannot be read stops the prune.

    A run without tree.json references nothing yet (its push is under way: the age rule keeps its
    objects); one whose tree.json is unreadable might reference anything, so nothing is removed.
    """
    wanted = set()
    for run_id in os.listdir(runs) if os.path.isdir(runs) else ():
        path = os.path.join(runs, run_id, "tree.json")
        if not os.path.lexists(path):
            continue
        try:
            tree = read_json(path)
            wanted.update(entry["sha256"] for entry in tree["files"])
        except (ValueError, TypeError, KeyError, OSError) as err:
            raise SystemExit("%s cannot be read (%s): prune removed nothing; restore the file or "
                             "remove that run (doit run down)" % (path, type(err).__name__))
    return wanted


def _verdict(path: str, rel: str, wanted: set) -> str:
    """'remove', 'keep' or 'foreign' for the file at objects/<rel>."""
    match = OBJECT_NAME.match(rel.replace(os.sep, "/"))
    stat = os.lstat(path)
    if match is None or not S_ISREG(stat.st_mode):
        return "foreign"
    sha, partial = match.group(2), match.group(3)
    if time.time() - stat.st_mtime < PRUNE_MIN_AGE_S or (sha in wanted and not partial):
        return "keep"
    if not partial and _sha256_of(path) != sha:
        return "foreign"  # under an object's name, but not tether's bytes: not ours to judge
    return "remove"


def _sha256_of(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def receive(objects_dir: str, stream: IO[bytes]) -> Dict[str, Any]:
    """Store the files of a tar stream (each named by its SHA-256) as objects, checking every hash."""
    stored, bad = 0, []
    with tarfile.open(fileobj=stream, mode="r|", bufsize=TAR_BUFFER) as tar:
        for member in tar:
            name = os.path.basename(member.name)
            if not member.isfile() or len(name) != 64 or name.strip("0123456789abcdef"):
                bad.append(member.name)
                continue
            target = object_path(objects_dir, name)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            tmp = "%s.tmp-%d" % (target, os.getpid())
            digest = hashlib.sha256()
            with tar.extractfile(member) as source, open(tmp, "wb") as out:
                for chunk in iter(lambda: source.read(CHUNK), b""):
                    digest.update(chunk)
                    out.write(chunk)
            if digest.hexdigest() != name:
                os.unlink(tmp)
                bad.append(name)
                continue
            os.chmod(tmp, 0o444)  # read-only from the start: data/ links it, no run may write it
            os.replace(tmp, target)  # under its final name only once whole and checked
            stored += 1
    return {"stored": stored, "bad": bad}


def send(run_dir: str, paths: List[str], stream: IO[bytes]) -> Dict[str, Any]:
    """Write the run's files named in `paths` (relative, inside the run dir) to `stream` as a tar."""
    root = os.path.realpath(run_dir)
    with tarfile.open(fileobj=stream, mode="w|", bufsize=TAR_BUFFER) as tar:
        for rel in paths:
            full = os.path.realpath(os.path.join(root, rel))
            if not full.startswith(root + os.sep):
                raise ValueError("refusing %r: it leaves the run dir" % rel)
            tar.add(full, arcname=rel, recursive=False)
    return {"sent": len(paths)}


def _inside(root: str, rel: str) -> str:
    """`rel` under `root`, refused if it leaves it."""
    base = os.path.realpath(root)
    full = os.path.realpath(os.path.join(base, rel))
    if not full.startswith(base + os.sep):
        raise ValueError("refusing %r: it leaves %s" % (rel, root))
    return full


def read_file(root: str, path: str, stream: IO[bytes], offset: int = 0, length: int = -1) -> Dict[str, Any]:
    """Stream bytes [offset, offset + length) of root/path (length -1: to the end; a negative offset
    counts from the end); its size now and where the bytes start."""
    full = _inside(root, path)
    with open(full, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        offset = max(0, size + offset) if offset < 0 else min(offset, size)
        f.seek(offset)
        left = size - offset if length < 0 else min(length, size - offset)
        while left > 0:
            chunk = f.read(min(CHUNK, left))
            if not chunk:
                break
            stream.write(chunk)
            left -= len(chunk)
    return {"size": size, "start": offset}


def put_file(root: str, path: str, peer: Any) -> Dict[str, Any]:
    """Write the client's stream to root/path atomically (a temporary name, then rename)."""
    full = _inside(root, path)
    os.replace(received(full, peer), full)
    return {"bytes": os.path.getsize(full)}


def received(full: str, peer: Any) -> str:
    """The client's stream written to a temporary name beside `full` (its folder made): that name."""
    os.makedirs(os.path.dirname(full), exist_ok=True)
    tmp = "%s.tmp-%d" % (full, os.getpid())
    reader = peer.ask({})
    with open(tmp, "wb") as out:
        for chunk in iter(lambda: reader.read(CHUNK), b""):
            out.write(chunk)
    return tmp
