"""A rented box's meter: when its runs were last read, and the one idle stop once nobody has for long.

Stdlib only, Python >= 3.8 (copied to the far side with the launcher). Three private files of a
run dir carry it (rundir.PRIVATE_FILES): `readers.lock`, on which every serve request that reads
the run holds a shared flock; `read_at`, touched at the end of each such request (its mtime is
the last read); and `idle.json`, the idle stop's record. The box is one meter: the stop waits
for the last read (or seal) of any run in the same runs/ folder, never fires while another run
there is alive, and decides under exclusive, non-blocking flocks on every run's `readers.lock`,
so it never cuts off a pull. Nothing here writes state.json or events.jsonl: they are sealed
into the manifest, and a write would break its verification.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import time
from typing import Any, Callable, Dict, Iterator, List, Optional

from tether.remote import shell
from tether.remote.fileio import read_json
from tether.remote.rundir import is_alive, is_final, now, run_file, write_private

READERS, READ_AT, RECORD = "readers.lock", "read_at", "idle.json"
POLL_MAX_S = 5.0  # the stop comes at most this late: seconds, against an idle time of minutes
READER_WAIT_S = 5.0  # a reader waits this long for a stop's decision (held for milliseconds), then reads anyway
STOP_TIMEOUT_S = 300.0  # a provider's CLI that has not returned in five minutes is hung: kill it and say so


@contextlib.contextmanager
def reading(run_dir: str) -> Iterator[None]:
    """Mark one request that reads the run: a shared flock on RUN_DIR/readers.lock while it runs, and
    RUN_DIR/read_at touched at its end (so a `probe` inside sees the previous read's time).

    Never fails the request: a run dir that does not exist (yet, or any more) is left alone.
    """
    fd = _open_lock(run_dir)
    if fd is not None:
        _lock_shared(fd)
    try:
        yield
    finally:
        try:
            _touch(run_file(run_dir, READ_AT))  # still under the shared lock: a stop deciding now waits for it
        finally:
            if fd is not None:
                os.close(fd)


def wait_then_stop(run_dir: str, settings: Dict[str, Any], still_ours: Callable[[], bool]) -> None:
    """Wait until the run is final and sealed, no other run in its runs/ folder is alive, and nothing
    has read any of them for settings["after_s"] seconds; then run settings["command"] (the box's
    stop, which keeps its disk) once, through /bin/sh.

    Returns when the command has run (its outcome in RUN_DIR/idle.json), when another run's wait
    has stopped the box since the last read, when `still_ours()` turns false (the run reopened, a
    newer launcher took over) or when the run dir is gone. A stop recorded for this seal is never
    run again, whoever calls this later. settings may carry "timeout_s" (default STOP_TIMEOUT_S).
    """
    after_s, command = float(settings["after_s"]), str(settings["command"])
    timeout_s = float(settings.get("timeout_s") or STOP_TIMEOUT_S)
    poll_s = min(POLL_MAX_S, max(0.05, after_s / 4))
    if not command.strip() or after_s <= 0 or _ran_for_this_seal(run_dir):
        return
    waiting = False
    while os.path.isdir(run_dir) and still_ours():
        if not waiting:
            waiting = _record(run_dir, {"after_s": after_s, "waiting_since": now()})
        idle = _idle_s(run_dir)
        if idle is not None and idle >= after_s and _stop_once(run_dir, after_s, command, timeout_s, still_ours):
            return
        time.sleep(poll_s)


def describe(run_dir: str) -> Dict[str, Any]:
    """The idle stop as `status` shows it: {after_s, last_read_age_s (the box's: any of its runs, read
    or sealed), ran_at, exit_code[, error, stopped_by]}, or {} when none is configured for this run."""
    record = _read_record(run_dir)
    if not record:
        return {}
    last = _box_last_read(run_dir)
    found = {"after_s": record.get("after_s"), "ran_at": record.get("ran_at"), "exit_code": record.get("exit_code"),
             "last_read_age_s": None if last is None else round(max(0.0, time.time() - last), 1)}
    found.update({k: record[k] for k in ("error", "stopped_by") if record.get(k)})
    return found


# ---------------------------------------------------------------- the clock: seals, reads, idle time


def _mtime(path: str) -> Optional[float]:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return None


def _seal_time(run_dir: str) -> Optional[float]:
    """When PULL_MANIFEST.json was written (it is written once; a reopen moves it away)."""
    return _mtime(run_file(run_dir, "PULL_MANIFEST.json"))


def _last_read(run_dir: str) -> Optional[float]:
    """The later of the run's last read and its seal (a run never read since its seal counts from the seal)."""
    times = [t for t in (_mtime(run_file(run_dir, READ_AT)), _seal_time(run_dir)) if t is not None]
    return max(times) if times else None


def _runs(run_dir: str) -> List[str]:
    """Every run dir of the box: the folders of run_dir's runs/ folder, run_dir first."""
    own = os.path.abspath(run_dir)
    parent = os.path.dirname(own)
    try:
        names = sorted(os.listdir(parent))
    except OSError:
        return [own]
    others = [os.path.join(parent, n) for n in names if os.path.join(parent, n) != own]
    return [own] + [d for d in others if os.path.isdir(d) and not os.path.islink(d)]


def _box_last_read(run_dir: str) -> Optional[float]:
    """The box's last read: the latest read or seal of any of its runs."""
    times = [t for t in (_last_read(d) for d in _runs(run_dir)) if t is not None]
    return max(times) if times else None


def _idle_s(run_dir: str) -> Optional[float]:
    """Seconds since the box's last read, once this run is final and sealed and no other run is alive;
    None until then."""
    sealed = _seal_time(run_dir)
    try:
        state = read_json(run_file(run_dir, "state.json"), dict) or {}
    except (OSError, ValueError):
        return None  # mid-rewrite or unreadable: look again at the next poll
    if sealed is None or not is_final(state) or any(is_alive(d) for d in _runs(run_dir)[1:]):
        return None
    return time.time() - (_box_last_read(run_dir) or sealed)


# ---------------------------------------------------------------- the stop


def _stop_once(run_dir: str, after_s: float, command: str, timeout_s: float, still_ours: Callable[[], bool]) -> bool:
    """Run the stop unless a request is reading one of the box's runs right now; True when the wait is over
    (the stop ran, or another run's wait stopped the box since the last read)."""
    with contextlib.ExitStack() as locks:
        if not all(_lock_exclusive(locks, d, create=i == 0) for i, d in enumerate(_runs(run_dir))):
            return False  # mid-read: that request touches read_at as it ends, and the wait starts again
        idle = _idle_s(run_dir)  # a read may have ended between the first look and the locks
        if idle is None or idle < after_s or not still_ours() or _ran_for_this_seal(run_dir):
            return False
        other = _stopped_since(run_dir, _box_last_read(run_dir))
        if other:  # two runs' waits reached the same moment: the box stops once
            _record(run_dir, dict(_read_record(run_dir), stopped_by=other))
            return True
        record = {"after_s": after_s, "command": command, "sealed_at": _seal_time(run_dir), "ran_at": now(),
                  "exit_code": None, "error": None}
        if not _record(run_dir, record):  # recorded before it runs: a box that stops mid-command has still stopped
            return False
    record.update(_run(run_dir, command, timeout_s))
    _record(run_dir, record)
    return True


def _lock_exclusive(locks: contextlib.ExitStack, run_dir: str, create: bool) -> bool:
    """An exclusive, non-blocking flock on RUN_DIR/readers.lock, held until `locks` closes; False if a
    reader holds it. Another run's lock file is never created (a run never read has no reader)."""
    try:
        fd = os.open(run_file(run_dir, READERS), os.O_RDWR | (os.O_CREAT if create else 0), 0o600)
    except OSError:
        return not create
    locks.callback(os.close, fd)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:
        pass  # a filesystem without flock: read_at still times the reads
    return True


def _stopped_since(run_dir: str, last: Optional[float]) -> str:
    """The name of another run of the box whose idle stop ran after the box's last read ('' if none)."""
    for other in _runs(run_dir)[1:]:
        ran = _read_record(other).get("ran_at")
        if ran is not None and last is not None and ran >= last:
            return os.path.basename(other)
    return ""


def _run(run_dir: str, command: str, timeout_s: float) -> Dict[str, Any]:
    """The command through /bin/sh in its own session, its output appended to launcher.log; its outcome."""
    env = dict(os.environ, TETHER_RUN_DIR=run_dir)
    try:
        with open(run_file(run_dir, "launcher.log"), "ab") as log:
            log.write(("%s idle stop: %s\n" % (time.strftime("%Y-%m-%dT%H:%M:%S"), command)).encode())
            log.flush()
            code, _ = shell.run(command, run_dir, env, timeout_s, stdout=log, stderr=subprocess.STDOUT)
    except OSError as err:
        return {"error": "the stop command could not start: %s" % err}
    if code is None:
        return {"error": "the stop command did not finish within %g s and was killed: the box may still be "
                         "running; stop it by hand" % timeout_s}
    if code != 0:
        return {"exit_code": code, "error": "the stop command exited %d (its output is in launcher.log): the box "
                                            "may still be running; stop it by hand" % code}
    return {"exit_code": 0}


# ---------------------------------------------------------------- files


def _open_lock(run_dir: str) -> Optional[int]:
    """An fd of RUN_DIR/readers.lock (created, mode 0600), or None when the run dir is not there."""
    try:
        return os.open(run_file(run_dir, READERS), os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        return None


def _lock_shared(fd: int) -> None:
    """A shared flock, waiting at most READER_WAIT_S for a stop that is deciding (the read goes on regardless)."""
    deadline = time.monotonic() + READER_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return
            time.sleep(0.01)
        except OSError:
            return  # a filesystem without flock: reads are still timed by read_at


def _touch(path: str) -> None:
    """Create `path` (mode 0600) if needed and set its mtime to now; quietly nothing if its folder is gone."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600))
        os.utime(path, None)
    except OSError:
        pass


def _read_record(run_dir: str) -> Dict[str, Any]:
    try:
        record = read_json(run_file(run_dir, RECORD))
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _record(run_dir: str, record: Dict[str, Any]) -> bool:
    """Write idle.json (private, atomic); False when the run dir is gone."""
    try:
        write_private(run_file(run_dir, RECORD), record)
    except OSError:
        return False
    return True


def _ran_for_this_seal(run_dir: str) -> bool:
    """Whether idle.json records a stop that ran after the run's current seal."""
    record, sealed = _read_record(run_dir), _seal_time(run_dir)
    return record.get("ran_at") is not None and sealed is not None and record.get("sealed_at") == sealed
