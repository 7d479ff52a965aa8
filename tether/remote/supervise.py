"""The trainer's process group under the launcher: signals forwarded, ends asked for, the heartbeat.

Stdlib only, Python >= 3.8 (copied to the far side with the launcher).
"""

from __future__ import annotations

import glob
import os
import signal
import threading
import time
from typing import Any, List, Set

from tether.remote.rundir import run_file

HEARTBEAT_S = 2.0  # a few seconds: fresh enough for a 60 s timeout, cheap on shared storage


def killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class Supervisor:
    """Forwards stop signals to the trainer's process group and SIGKILLs after the grace time.

    Installed before the trainer starts, so a signal in between is remembered, not lost; a signal
    while no trainer runs (a restart's backoff) wakes `wait`. Each kind of signal reaches a trainer
    once: a second SIGTERM (a repeated stop, or SLURM's own TERM to every process of the job) could
    land while the script, its checkpoint written, is exiting; Python has put back the default
    action by then, and the script would die of the signal instead of exiting 75.
    """

    def __init__(self, grace_s: float) -> None:
        self.pgid, self.grace_s, self.signalled, self.pending = 0, grace_s, "", 0  # grace_s: set from run.json
        self.sent: Set[int] = set()  # the signals this trainer's group already got
        self.woken = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._forward)

    def attach(self, pgid: int) -> None:
        self.pgid, self.sent = pgid, set()
        if self.pending:
            self._forward(self.pending, None)

    def detach(self) -> None:
        """The trainer's group is gone: a signal from now on is kept for the next one."""
        self.pgid = 0

    def end(self) -> None:
        """Ask the trainer to checkpoint and exit (SIGTERM), SIGKILL after the grace time: the
        launcher's own decision (wall time, a stall), not a signal it received."""
        if self.pgid:
            self._end_group(signal.SIGTERM)

    def wait(self, seconds: float) -> bool:
        """Sleep `seconds` unless a signal comes first; whether one came."""
        return self.woken.wait(seconds) or bool(self.signalled)

    def _forward(self, signum: int, frame: Any) -> None:
        self.signalled = self.signalled or signal.Signals(signum).name
        self.woken.set()
        if not self.pgid:
            self.pending = signum
            return
        self._end_group(signal.SIGUSR1 if signum == signal.SIGUSR1 else signal.SIGTERM)

    def _end_group(self, sent: int) -> None:
        if sent in self.sent:
            return  # asked already; the SIGKILL timer of the first runs
        self.sent.add(sent)
        killpg(self.pgid, sent)
        timer = threading.Timer(self.grace_s, killpg, (self.pgid, signal.SIGKILL))
        timer.daemon = True
        timer.start()


class Heartbeat:
    """Touches RUN_DIR/heartbeat every few seconds while the launcher lives: "the launcher is alive"."""

    def __init__(self, run_dir: str) -> None:
        self.path, self.done = run_file(run_dir, "heartbeat"), threading.Event()
        threading.Thread(target=self._beat, daemon=True).start()

    def _beat(self) -> None:
        while not self.done.is_set():
            with open(self.path, "a"):
                os.utime(self.path)
            self.done.wait(HEARTBEAT_S)

    def stop(self) -> None:
        self.done.set()


def group_members(pgid: int) -> List[int]:
    """Pids whose process group is `pgid` (Linux /proc), zombies excluded."""
    members = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(stat.split("/")[2]))
    return members


def end_group(pgid: int, grace_s: float) -> None:
    """SIGTERM a trainer that outlived its launcher's failure, SIGKILL after the grace time."""
    killpg(pgid, signal.SIGTERM)
    deadline = time.time() + grace_s
    while group_members(pgid) and time.time() < deadline:
        time.sleep(0.05)
    killpg(pgid, signal.SIGKILL)
