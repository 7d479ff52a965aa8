"""How one attempt ended: completed, stopped, preempted or failed, and which signal did it, in words.

Stdlib only, Python >= 3.8 (copied to the far side with the launcher). A signal that tether did
not send is classified by what it usually means: SIGTERM, SIGINT and SIGHUP are an orderly "stop
now" (a scheduler's preemption, an administrator, a watchdog): `preempted`, so the restart policy
applies. SIGKILL and crashes (SIGSEGV, SIGABRT, SIGBUS, ...) are `failed`, with the signal named;
a SIGKILL is marked "out of memory?" when the kernel's cgroup counters say an OOM kill happened
during the attempt (read without privileges; when they cannot be read, nothing is claimed).
"""

from __future__ import annotations

import os
import signal
from typing import Any, Dict, Optional

from tether.remote.runtime import PREEMPTED_EXIT

PREEMPTING = ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1")  # "checkpoint and exit": resumable by policy


def signal_name(number: int) -> str:
    """SIGKILL for 9; `signal 42` for a number without a name (real-time signals)."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return "signal %d" % number


def _cgroup_paths() -> list:
    """This process's memory-cgroup counter files, v2 (memory.events) and v1 (memory.oom_control)."""
    found = []
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return found
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            found.append(os.path.join("/sys/fs/cgroup", path.lstrip("/"), "memory.events"))
        elif "memory" in controllers.split(","):
            found.append(os.path.join("/sys/fs/cgroup/memory", path.lstrip("/"), "memory.oom_control"))
    return found


def oom_kills() -> Optional[int]:
    """The OOM-kill count of this process's memory cgroup, or None where it cannot be read unprivileged."""
    for path in _cgroup_paths():
        try:
            with open(path) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except (OSError, ValueError):
            continue
    return None


def outcome(returncode: Optional[int], stop_requested: bool, received: str,
            oom_before: Optional[int]) -> Dict[str, Any]:
    """{status, signal, signal_to, oom}: how an attempt ended; `received` is a signal the launcher got."""
    died_of = signal_name(-returncode) if returncode is not None and returncode < 0 else ""
    if stop_requested:  # tether's stop: the signal is recorded (TERM, or the KILL after the grace), not judged
        return {"status": "stopped", "signal": received or died_of or None}
    if returncode == 0:
        return {"status": "completed", "signal": None}
    if received in PREEMPTING:  # the launcher was told to stop (and told the trainer): whatever it died of
        return {"status": "preempted", "signal": received, "signal_to": "launcher"}
    if returncode == PREEMPTED_EXIT:
        return {"status": "preempted", "signal": None}
    if died_of in PREEMPTING:
        return {"status": "preempted", "signal": died_of, "signal_to": "trainer"}
    if died_of:
        after = oom_kills() if died_of == "SIGKILL" else None
        oom = after is not None and oom_before is not None and after > oom_before
        return {"status": "failed", "signal": died_of, "signal_to": "trainer", "oom": oom}
    return {"status": "failed", "signal": None}


def words(state: Dict[str, Any]) -> str:
    """`killed by SIGKILL (out of memory?)`, `ended by SIGTERM`, or '' when no signal ended it."""
    name = state.get("signal")
    if not name:
        return ""
    verb = "ended by" if name in PREEMPTING else "killed by"
    return "%s %s%s" % (verb, name, " (out of memory?)" if state.get("oom") else "")
