"""A script's own checkpoints (`trainer.checkpoint`: a file, a folder, or a glob such as outputs/checkpoint-*).

Stdlib only, Python >= 3.8 (copied to the far side with the launcher). After every exit of the
trainer the launcher keeps the newest complete ones in the run's checkpoints/ under their own
names (copied atomically: scratch copy, fsync, rename); before a launch it picks the newest one,
restoring the kept copy into the script's place when the script's folder lost it.

"Complete": the trainer has exited (we only look then, so nothing is still being written), the
candidate holds at least one regular file, no temporary name (`*.tmp*`, `*.partial`), no link,
no zip file (torch.save's format) cut short before its end record,
and, where Hugging Face's Trainer wrote it, its `trainer_state.json` (written after the weights).
A kill mid-save leaves a folder without it: that one is skipped and the previous one taken.
"""

from __future__ import annotations

import fnmatch
import os
import posixpath
import re
import shutil
import stat
import zipfile
from typing import Dict, List, Optional, Tuple

from tether.remote.fileio import fsync_dir
from tether.remote.workdir import work_path
from tether.remote.runtime import CHECKPOINT_RE

MAGIC = re.compile(r"[*?[]")  # what makes a path segment a glob
TEMPORARY = re.compile(r"\.tmp|\.partial$|\.incomplete$")  # names of writes that never finished
HF_LAST = "trainer_state.json"  # Hugging Face's Trainer writes it after weights, optimizer and RNG state
HF_SIGNS = (HF_LAST, "training_args.bin")  # files that say "a Hugging Face checkpoint folder"
ZIP_MAGIC = b"PK\x03\x04"  # torch.save's format since 1.6 (and safetensors never starts so)
MAX_FILES = 100000  # entries looked at in one checkpoint folder: far above a real one, far below a disk
SCRATCH = ".keep-"  # scratch copies: a dot name, so no glob of the script's and no roster ever lists them
DROPPED = ".drop-"  # a kept folder being replaced: restored if a kill came between the two renames


def script_path(run_dir: str, rel: str) -> str:
    """Where the trainer's own relative path `rel` lies (the one place that knows its working directory)."""
    return work_path(run_dir, rel)


def kept_dir(run_dir: str) -> str:
    """The run's checkpoints/ folder, where kept copies live."""
    return os.path.join(run_dir, "checkpoints")


def is_glob(pattern: str) -> bool:
    return bool(MAGIC.search(pattern))


def candidates(run_dir: str, pattern: str) -> List[str]:
    """The script-side paths `pattern` names now (a glob in its last part only), never through a far link."""
    where = script_path(run_dir, pattern)
    folder = os.path.dirname(where)
    if not _inside(run_dir, folder):  # outputs/ itself a link out of the run: nothing there is ours
        return []
    if not is_glob(pattern):
        return [where] if os.path.lexists(where) else []
    try:
        names = os.listdir(folder)
    except (FileNotFoundError, NotADirectoryError):
        return []
    last = posixpath.basename(pattern)
    return [os.path.join(folder, n) for n in names if fnmatch.fnmatchcase(n, last) and not n.startswith(".")]


def _inside(run_dir: str, path: str) -> bool:
    """Whether `path`, links resolved, lies in the run dir (a link may lead anywhere)."""
    real, top = os.path.realpath(path), os.path.realpath(run_dir)
    return real == top or real.startswith(top + os.sep)


def tree(top: str) -> Tuple[List[str], List[str]]:
    """(regular files, other entries: links, pipes, ...) under folder `top`, relative; links never followed."""
    files, others, stack, budget = [], [], [""], MAX_FILES
    while stack:
        rel = stack.pop()
        with os.scandir(os.path.join(top, rel)) as entries:
            for entry in entries:
                budget -= 1
                if budget < 0:
                    return files, others + ["(more than %d entries)" % MAX_FILES]
                name = posixpath.join(rel, entry.name) if rel else entry.name
                if entry.is_dir(follow_symlinks=False):
                    stack.append(name)
                elif entry.is_file(follow_symlinks=False):
                    files.append(name)
                else:
                    others.append(name)
    return sorted(files), sorted(others)


def _is_hf(paths: List[str]) -> bool:
    """Whether any candidate is a Hugging Face checkpoint folder: then each one needs HF_LAST."""
    return any(os.path.isfile(os.path.join(p, sign)) for p in paths for sign in HF_SIGNS)


def problem(path: str, hf: bool = False) -> str:
    """Why a candidate is not a complete checkpoint, in words ('' when it is one)."""
    mode = os.lstat(path).st_mode
    if stat.S_ISLNK(mode):
        return "a symlink to %s: links are never followed; have the script write the checkpoint itself" % \
            os.readlink(path)
    if TEMPORARY.search(os.path.basename(path)):
        return "a temporary name: still being written when the trainer ended"
    if stat.S_ISREG(mode):
        return torn(path)
    if not stat.S_ISDIR(mode):
        return "not a regular file or folder"
    files, others = tree(path)
    unfinished = [f for f in files if TEMPORARY.search(posixpath.basename(f))]
    if others:
        return "holds %s, not a regular file (links are never followed)" % others[0]
    if not files:
        return "an empty folder"
    if unfinished:
        return "holds %s: still being written when the trainer ended" % unfinished[0]
    if hf and HF_LAST not in files:
        return "incomplete: no %s (Hugging Face's Trainer writes it last)" % HF_LAST
    return ""


def torn(path: str) -> str:
    """Why a zip-format file (what torch.save writes) is cut short, or ''; a write in place that a full
    disk or a kill interrupted leaves one without its end record, and it must never be kept or resumed."""
    with open(path, "rb") as f:
        if f.read(4) != ZIP_MAGIC:
            return ""
    if zipfile.is_zipfile(path):
        return ""
    return "torn: a zip (torch.save) file without its end record, cut short while being written"


def _checked(path: str, hf: bool) -> str:
    """problem(), with a candidate that cannot be read (gone, no permission) named, never a launcher crash."""
    try:
        return problem(path, hf)
    except OSError as err:
        return "could not be read: %s" % err


def newest_last(paths: List[str]) -> List[str]:
    """Oldest first: by the numbers in the names when every name has one (checkpoint-1200), else by mtime."""
    numbers = {p: tuple(int(n) for n in re.findall(r"\d+", os.path.basename(p))) for p in paths}
    if all(numbers.values()):
        return sorted(paths, key=lambda p: (numbers[p], os.lstat(p).st_mtime_ns, p))
    return sorted(paths, key=lambda p: (os.lstat(p).st_mtime_ns, p))


def complete(run_dir: str, pattern: str) -> Tuple[List[str], Dict[str, str]]:
    """The script's complete checkpoints (oldest first) and, for the others, why they are not."""
    found = candidates(run_dir, pattern)
    hf = _is_hf(found)
    why = {p: _checked(p, hf) for p in found}
    return newest_last([p for p in found if not why[p]]), {p: w for p, w in why.items() if w}


def kept(run_dir: str, pattern: str) -> List[str]:
    """The kept copies in checkpoints/ that `pattern` names (oldest first); tether's own ckpt-N files never."""
    last = posixpath.basename(pattern)
    try:
        names = os.listdir(kept_dir(run_dir))
    except FileNotFoundError:
        return []
    mine = [n for n in names if not n.startswith(".") and not CHECKPOINT_RE.fullmatch(n)
            and (fnmatch.fnmatchcase(n, last) if is_glob(pattern) else n == last)]
    return newest_last([os.path.join(kept_dir(run_dir), n) for n in mine])


def newest_kept(run_dir: str, pattern: Optional[str]) -> Optional[str]:
    """The newest kept copy (what the seal lists and a resume may restore), or None."""
    found = kept(run_dir, pattern) if pattern else []
    return found[-1] if found else None


# ---------------------------------------------------------------- copying


def _same(src: str, dst: str) -> bool:
    """Whether a kept copy already holds `src` (names, sizes, mtimes: a copy keeps the mtimes)."""
    def shape(path: str) -> List[Tuple[str, int, int]]:
        if not os.path.isdir(path):
            st = os.lstat(path)
            return [("", st.st_size, st.st_mtime_ns)]
        return [(f, os.lstat(os.path.join(path, f)).st_size, os.lstat(os.path.join(path, f)).st_mtime_ns)
                for f in tree(path)[0]]
    if not os.path.lexists(dst) or os.path.islink(dst) or os.path.isdir(src) != os.path.isdir(dst):
        return False
    return shape(src) == shape(dst)


def _copy_file(src: str, dst: str) -> None:
    shutil.copy2(src, dst, follow_symlinks=False)
    with open(dst, "rb") as f:
        os.fsync(f.fileno())


def copy(src: str, target: str) -> None:
    """Copy a checkpoint file or folder to `target` so a reader sees the old one or the whole new one."""
    folder, name = os.path.split(target)
    os.makedirs(folder, exist_ok=True)
    scratch = os.path.join(folder, "%s%d-%s" % (SCRATCH, os.getpid(), name))
    _remove(scratch)
    try:
        _copy(src, scratch, target)
    except BaseException:
        _remove(scratch)  # a copy cut short (a full disk) must not hold the space it took
        raise


def _copy(src: str, scratch: str, target: str) -> None:
    folder, name = os.path.split(target)
    if not os.path.isdir(src):
        _copy_file(src, scratch)
        os.replace(scratch, target)  # a folder in the way raises: never silently replaced by a file
        fsync_dir(folder)
        return
    for rel in tree(src)[0]:  # complete() refused anything but folders and regular files
        os.makedirs(os.path.dirname(os.path.join(scratch, rel)), exist_ok=True)
        _copy_file(os.path.join(src, rel), os.path.join(scratch, rel))
    os.makedirs(scratch, exist_ok=True)
    for path, _, _ in os.walk(scratch):
        fsync_dir(path)
    shutil.copystat(src, scratch)  # its mtime orders it when names carry no number
    dropped = os.path.join(folder, "%s%d-%s" % (DROPPED, os.getpid(), name))
    if os.path.lexists(target):
        os.rename(target, dropped)
    os.rename(scratch, target)
    fsync_dir(folder)
    _remove(dropped)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)


def clean(folder: str) -> None:
    """Remove scratch copies a killed launcher left; put back a kept folder it had moved aside."""
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return
    for name in names:
        if name.startswith(DROPPED):
            original = os.path.join(folder, name.split("-", 2)[-1])
            if not os.path.lexists(original):
                os.rename(os.path.join(folder, name), original)
                continue
        if name.startswith((SCRATCH, DROPPED)):
            _remove(os.path.join(folder, name))


# ---------------------------------------------------------------- what the launcher calls


def keep(run_dir: str, pattern: str, keep_n: int) -> Tuple[Optional[str], Dict[str, str]]:
    """After the trainer exits: copy its newest `keep_n` complete checkpoints into checkpoints/, prune older ones.

    Returns the newest kept copy (or None) and, for the events, why each other candidate was not taken.
    """
    clean(kept_dir(run_dir))
    ready, skipped = complete(run_dir, pattern)
    for src in ready[-max(1, keep_n):]:
        target = os.path.join(kept_dir(run_dir), os.path.basename(src))
        if not _same(src, target):
            copy(src, target)
    for old in kept(run_dir, pattern)[:-max(1, keep_n)]:
        _remove(old)
    fsync_dir(kept_dir(run_dir))
    return newest_kept(run_dir, pattern), skipped


def resume_point(run_dir: str, pattern: str) -> Optional[str]:
    """Before a launch: the newest complete checkpoint at the script's place, restored from the kept copy if lost."""
    ready = {os.path.basename(p): p for p in complete(run_dir, pattern)[0]}
    saved = {os.path.basename(p): p for p in kept(run_dir, pattern) if not _checked(p, False)}
    if not ready and not saved:
        return None
    best = os.path.basename(newest_last(list({**saved, **ready}.values()))[-1])
    if best in ready:
        return ready[best]
    place = os.path.join(os.path.dirname(script_path(run_dir, pattern)), best)
    if os.path.lexists(place) or not _inside(run_dir, os.path.dirname(place)):
        return saved[best]  # the script's place holds something unfinished: resume from the kept copy itself
    copy(saved[best], place)
    return place
