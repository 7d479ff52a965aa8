"""A run directory's own files: state.json, events, the liveness lock, finality, the sealed manifest.

Stdlib only, Python >= 3.8 (copied to the far side with the launcher). Every write is atomic.
"""

from __future__ import annotations

import fcntl
import fnmatch
import json
import os
import posixpath
import re
import stat
import time
from typing import Any, Dict, List, Optional, Tuple

from tether.remote import mapped
from tether.remote.workdir import WORK, work_dir
from tether.remote.fileio import append_line, atomic_write_json, read_json, sha256_regular
from tether.remote.room import RESERVE, with_room
from tether.remote.runtime import latest_checkpoint

FINAL = ("completed", "stopped")  # always final; "failed" is final unless the restart policy retries it
# Final is "ended, sealed, never relaunched by itself". Only `completed` stays so for ever: an explicit verb
# reopens a stopped run (`doit run train`) or a failed/preempted one (`retry=1`) for a next attempt
# (tether.remote.resume.reopen), which archives the sealed manifest first.
FOR_GOOD = ("completed",)

# Tether's own files at the top of a run dir. The sealed ones are always in the manifest; the private
# ones never are (launch_env.json holds the backend's secrets, mode 0600). Config validation refuses
# an artifact pattern that names any of them, and the seal refuses any match of a private one.
SEALED_FILES = ("run.json", "tree.json", "state.json", "events.jsonl", "train.log")
PRIVATE_FILES = ("launch_env.json", "launcher.lock", "launcher.log", "heartbeat", "stop_requested", "notify.json",
                 "PULL_MANIFEST.json", "PULL_MANIFEST.attempt-*.json", "slurm.json", "job.sh", "submit.lock", "slurm-*.out",
                 "read_at", "readers.lock", "idle.json",  # these three: a rented box's meter (tether.remote.idle)
                 "gpu_request.json",  # the launch's GPU settings (tether.remote.gpuchoice)
                 RESERVE)  # room for the launcher's last records on a full disk (tether.remote.room)
TETHER_FILES = SEALED_FILES + PRIVATE_FILES
MAX_WALK = 100000  # entries the seal looks at: far above any real results folder, far below a filesystem
MAGIC = re.compile(r"[*?[]")  # what makes a path segment a glob
NOT_REGULAR = "not a regular file (a folder, pipe, socket or device)"

def is_final(state: Dict[str, Any]) -> bool:
    """Whether the run has ended: nothing relaunches it by itself, and its manifest is sealed.

    The `final` flag decides when the launcher wrote one (a reopened run is final no more); a state
    from before the flag existed is final by its status.
    """
    if "final" in state:
        return bool(state["final"])
    return state.get("status") in FINAL


def decide_final(status: str, spec: Dict[str, Any], attempt: int) -> bool:
    """`failed` stays open for a relaunch under `restart: on-failure` while restarts remain."""
    restart = spec.get("restart") or {}
    if status == "failed":
        return not (restart.get("policy") == "on-failure" and attempt <= int(restart.get("max_restarts", 0)))
    if status in ("preempted", "stalled") and "restart" in spec:  # a hand-made run.json without a policy stays open
        return not restart_allowed(status, spec, attempt)  # nobody will resume it: seal what it saved
    return status in FINAL


def run_file(run_dir: str, name: str) -> str:
    """A file of the run dir."""
    return os.path.join(run_dir, name)


def now() -> float:
    return round(time.time(), 3)


def event(run_dir: str, event: str, **fields: Any) -> None:
    record = dict(fields, event=event, t=now(), source="launcher")
    line = (json.dumps(record, sort_keys=True) + "\n").encode()
    with_room(run_dir, lambda: append_line(run_file(run_dir, "events.jsonl"), line))


def write_private(path: str, data: Any) -> None:
    """Write JSON readable by the owner only (it may hold secrets), atomically and durably."""
    tmp = path + ".tmp-%d" % os.getpid()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(fd, 0o600)  # a stale temporary file of another mode keeps it through O_TRUNC
        json.dump(data, f)
        f.flush()
        os.fsync(fd)
    os.replace(tmp, path)


def update_state(run_dir: str, **changes: Any) -> Dict[str, Any]:
    state = read_json(run_file(run_dir, "state.json"), dict) or {}
    state.update(changes, updated_at=now())
    with_room(run_dir, lambda: atomic_write_json(run_file(run_dir, "state.json"), state))
    return state


def try_lock(run_dir: str) -> Optional[int]:
    """The locked fd of RUN_DIR/launcher.lock, or None when a live launcher or trainer holds it."""
    fd = os.open(run_file(run_dir, "launcher.lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def is_alive(run_dir: str) -> bool:
    """Whether a launcher or trainer of this run still lives (it holds the lock)."""
    if not os.path.exists(run_file(run_dir, "launcher.lock")):
        return False
    fd = try_lock(run_dir)
    if fd is None:
        return True
    os.close(fd)  # closing releases the probe's own lock at once
    return False


# ---------------------------------------------------------------- run


def restart_allowed(status: str, spec: Dict[str, Any], attempt: int) -> bool:
    """Whether the restart policy wants this attempt's end relaunched (a SLURM job requeues itself).

    A stall is restarted like a preemption: a hang is rarely the script's own doing (a stuck file
    system, a deadlocked collective), and the checkpoint before it is good."""
    restart = spec.get("restart") or {}
    policy, most = restart.get("policy", "on-preempt"), int(restart.get("max_restarts", 0))
    wanted = (status in ("preempted", "stalled") and policy in ("on-preempt", "on-failure")) or \
             (status == "failed" and policy == "on-failure")
    return wanted and attempt - 1 < most


# ---------------------------------------------------------------- the roster: what the seal lists


def is_private(relpath: str) -> bool:
    """Whether a run-dir path is one of tether's private files (or its temporary twin): never sealed."""
    if "/" in relpath:
        return False
    name = re.sub(r"\.tmp-\d+$", "", relpath.lstrip("."))  # atomic writes' temporary names
    return any(fnmatch.fnmatchcase(name, private) for private in PRIVATE_FILES)


def artifact_paths(pattern: str, workdir: str = WORK) -> List[str]:
    """Where an artifact pattern is looked for, as run-dir paths: in artifacts/ (TETHER_ARTIFACTS_DIR),
    then in the trainer's working directory `workdir`; [] when it leaves the run dir."""
    pattern = pattern.replace("\\", "/")
    if posixpath.isabs(pattern):
        return []
    found: List[str] = []
    for base in ("artifacts", workdir):
        relpath = posixpath.normpath(posixpath.join(base, pattern))
        if relpath == ".." or relpath.startswith("../"):
            return []
        found += [] if relpath in found else [relpath]
    return found


def artifact_problem(pattern: str) -> str:
    """Why an artifact pattern cannot be sealed, as a sentence naming the fix ('' when it can)."""
    fix = ("list paths relative to where the trainer writes them: the run's artifacts/ folder "
           "(TETHER_ARTIFACTS_DIR) or its working directory (the project root: out/model.pt)")
    relpaths = artifact_paths(pattern)
    if not pattern.strip():
        return "artifact %r is empty: %s" % (pattern, fix)
    if not relpaths:
        where = "an absolute path" if posixpath.isabs(pattern.replace("\\", "/")) else "outside the run folder"
        return "artifact %r is %s: %s" % (pattern, where, fix)
    owned = [name for name in TETHER_FILES for relpath in relpaths
             if _matches(name.replace("*", "0").split("/"), relpath.split("/"))]
    if owned:
        return "artifact %r names tether's own run file %s (never an artifact): %s" % (pattern, owned[0], fix)
    return ""


def is_literal(pattern: str) -> bool:
    """Whether an artifact pattern names one file (no `*?[`): the run must produce it (manifest.check)."""
    return not MAGIC.search(pattern)


def inputs(run_dir: str) -> set:
    """Run-dir paths of the pushed code and data (tree.json): inputs, never sealed as results."""
    tree = read_json(run_file(run_dir, "tree.json")) or {"files": []}
    return {posixpath.join(root, entry["path"]) for entry in tree["files"] for root in ("code", "data", WORK)}


def _matches(parts: List[str], segments: List[str]) -> bool:
    """glob.glob's rules on split paths: `*` stays in one folder, `**` spans folders, wildcards skip dotfiles."""
    if not segments:
        return not parts
    head = segments[0]
    if head == "**":
        return _matches(parts, segments[1:]) or (
            bool(parts) and not parts[0].startswith(".") and _matches(parts[1:], segments))
    if not parts:
        return False
    if MAGIC.search(head):
        fits = fnmatch.fnmatchcase(parts[0], head) and (head.startswith(".") or not parts[0].startswith("."))
    else:
        fits = parts[0] == head
    return fits and _matches(parts[1:], segments[1:])


def _link(run_dir: str, relpath: str) -> Dict[str, str]:
    """The refusal of a symlink: its target is named, never followed."""
    target = os.readlink(run_file(run_dir, relpath))
    return {"path": relpath, "reason": "a symlink to %s: links are never followed or pulled; "
                                       "have the trainer write the file itself" % target}


def _kind(run_dir: str, relpath: str) -> Tuple[str, str]:
    """(missing|link|dir|file|other, the path it names) walking each component without following links."""
    parts = relpath.split("/")
    for depth in range(1, len(parts) + 1):
        prefix = "/".join(parts[:depth])
        try:
            mode = os.lstat(run_file(run_dir, prefix)).st_mode
        except (FileNotFoundError, NotADirectoryError):
            return "missing", prefix
        if stat.S_ISLNK(mode):
            return "link", prefix
        if depth < len(parts) and not stat.S_ISDIR(mode):
            return "missing", prefix
    kind = "dir" if stat.S_ISDIR(mode) else "file" if stat.S_ISREG(mode) else "other"
    return kind, relpath


def _find(run_dir: str, relpath: str, budget: List[int]) -> Tuple[List[str], List[Dict[str, str]]]:
    """Regular files matching the run-dir pattern, and what was refused; never follows a link, stops at budget."""
    segments = relpath.split("/")
    base = []
    for segment in segments:
        if MAGIC.search(segment):
            break
        base.append(segment)
    kind, named = _kind(run_dir, "/".join(base))
    if kind == "link":
        return [], [_link(run_dir, named)]
    if kind == "dir":
        return _walk(run_dir, named, segments, budget)
    if kind == "missing" or not _matches(base, segments):
        return [], []
    return ([named], []) if kind == "file" else ([], [{"path": named, "reason": NOT_REGULAR}])


def _walk(run_dir: str, base: str, segments: List[str], budget: List[int]) -> Tuple[List[str], List[Dict[str, str]]]:
    """The bounded walk under one pattern's literal folder: links are refused where they match or lead on."""
    depth = None if "**" in segments else len(segments) - len(base.split("/") if base else [])  # deepest match
    found, refused, stack = [], [], [(base, 0)]
    while stack:
        folder, level = stack.pop()
        try:
            entries = os.scandir(run_file(run_dir, folder))
        except OSError as err:  # unreadable: say so, and seal the rest
            refused.append({"path": folder, "reason": "could not be listed: %s" % err})
            continue
        with entries:
            for entry in entries:
                budget[0] -= 1
                if budget[0] < 0:
                    refused.append({"path": base, "reason": "more than %d entries: the seal stopped looking "
                                                            "there; declare narrower artifacts" % MAX_WALK})
                    return found, refused
                relpath, deeper = posixpath.join(folder, entry.name), depth is None or level + 1 < depth
                fits = _matches(relpath.split("/"), segments)
                if entry.is_symlink():
                    refused += [_link(run_dir, relpath)] if fits or deeper else []
                elif entry.is_dir(follow_symlinks=False):
                    stack += [(relpath, level + 1)] if deeper else []
                elif fits and entry.is_file(follow_symlinks=False):
                    found.append(relpath)
                elif fits:
                    refused.append({"path": relpath, "reason": NOT_REGULAR})
    return found, refused


def _fixed(run_dir: str, relpath: str) -> Tuple[List[str], List[Dict[str, str]]]:
    """A file the roster always wants (logs, the latest checkpoint): listed if it is a regular file."""
    kind, named = _kind(run_dir, relpath)
    if kind == "link":
        return [], [_link(run_dir, named)]
    if kind in ("dir", "other"):
        return [], [{"path": relpath, "reason": NOT_REGULAR}]
    return ([relpath] if kind == "file" else []), []


def _own_checkpoint(run_dir: str, pattern: Optional[str]) -> Tuple[List[str], List[Dict[str, str]]]:
    """The newest kept copy of the script's own checkpoint: the file, or every file of the folder."""
    newest = mapped.newest_kept(run_dir, pattern)
    if not newest:
        return [], []
    relpath = os.path.relpath(newest, run_dir).replace(os.sep, "/")
    if _kind(run_dir, relpath)[0] != "dir":  # a file, or a link somewhere on the way (refused by name)
        return _fixed(run_dir, relpath)
    files, others = mapped.tree(newest)
    return ([posixpath.join(relpath, f) for f in files],
            [{"path": posixpath.join(relpath, o), "reason": NOT_REGULAR} for o in others])


def _roster(run_dir: str, spec: Dict[str, Any]) -> Dict[str, Any]:
    """The files the manifest lists, the declared artifacts that matched nothing, and what was refused."""
    wanted = list(SEALED_FILES)
    latest = latest_checkpoint(run_file(run_dir, "checkpoints"))
    wanted += [os.path.relpath(latest, run_dir)] if latest else []
    files, refused = _own_checkpoint(run_dir, spec.get("checkpoint_path"))
    missing: List[str] = []
    for relpath in wanted:
        listed, why = _fixed(run_dir, relpath)
        files, refused = files + listed, refused + why
    budget, pushed = [MAX_WALK], inputs(run_dir)
    workdir = os.path.relpath(work_dir(run_dir), run_dir)
    for pattern in spec.get("artifacts", []):
        problem = artifact_problem(pattern)
        if problem:  # a run.json from before patterns were checked, or one made by hand
            refused.append({"path": pattern, "reason": problem})
            continue
        found, why = _artifact(run_dir, pattern, workdir, budget, pushed)
        files += found
        refused += why
        missing += [] if found or why else [pattern]
    return {"files": sorted(set(files)), "missing": missing, "refused": refused}


def _artifact(run_dir: str, pattern: str, workdir: str, budget: List[int],
              pushed: set) -> Tuple[List[str], List[Dict[str, str]]]:
    """One pattern's files in artifacts/ and in the working directory, without pushed inputs or private files.

    A glob silently skips the code and data it matches (`work/**/*` must not pull the dataset home
    again); a literal name that is an input is refused, saying so.
    """
    files, refused = [], []
    for relpath in artifact_paths(pattern, workdir):
        if budget[0] < 0 and refused:  # the walk's cap was reached in artifacts/: said once is enough
            break
        found, why = _find(run_dir, relpath, budget)
        refused += why + [{"path": p, "reason": "tether's own private file: never sealed"}
                          for p in found if is_private(p)]
        if is_literal(pattern):
            refused += [{"path": p, "reason": "a pushed input (tree.json lists it), not a result: never sealed"}
                        for p in found if p in pushed]
        files += [p for p in found if not is_private(p) and p not in pushed]
    return files, refused


def seal(run_dir: str) -> Dict[str, Any]:
    """Write PULL_MANIFEST.json (bytes and SHA-256 of every roster file) unless it exists."""
    target = run_file(run_dir, "PULL_MANIFEST.json")
    existing = read_json(target)
    if existing is not None:
        return existing
    spec = read_json(run_file(run_dir, "run.json")) or {}
    roster = _roster(run_dir, spec)
    entries, refused = [], roster["refused"]
    for name in roster["files"]:
        try:
            digest, size = sha256_regular(run_file(run_dir, name))
        except OSError as err:  # replaced by a link or a pipe since the walk, or unreadable
            refused.append({"path": name, "reason": "could not be read: %s" % err})
            continue
        entries.append({"path": name, "bytes": size, "sha256": digest})
    state = read_json(run_file(run_dir, "state.json"), dict) or {}
    manifest = {"format": 1, "run_id": spec.get("run_id"), "status": state.get("status"),
                "sealed_at": now(), "files": entries, "missing": roster["missing"], "refused": refused,
                "artifacts": spec.get("artifacts", [])}
    with_room(run_dir, lambda: atomic_write_json(target, manifest))  # no event after hashing: events.jsonl is in the manifest
    return manifest
