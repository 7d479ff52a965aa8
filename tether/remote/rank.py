"""One rank of a torchrun trainer: runs the script, keeps its output apart, and records how it ended.

Stdlib only, Python >= 3.8 (copied to the far side with the launcher). torchrun starts
`python -m tether.remote.rank --grace G -- SCRIPT_ARGV` once per rank, each in a session of its
own; this process starts the script in its process group (so a signal torchrun sends the rank with
os.killpg reaches the script and the script's own children) and waits for it:

- rank 0's output goes to the trainer's own output (train.log), so progress is read from one stream;
  every other rank's goes to ranks/rank-R.log (tether.remote.ranks copies a failing rank's last lines
  into train.log);
- ranks/rank-R.json says the rank's pid, torchrun's pid, and when and how the script ended (the exit
  code, negative for a signal): what tether.remote.ranks reads to classify the attempt's end;
- when torchrun is gone (killed outright) the script gets SIGTERM unless a signal already came, then
  SIGKILL after the grace time: no rank outlives its attempt.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any, List, Optional

from tether.remote.fileio import atomic_write_json
from tether.remote.rundir import event

HANDLED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGQUIT)
PARENT_POLL_S = 0.5  # how soon a rank notices that torchrun is gone


def folder(run_dir: str) -> str:
    return os.path.join(run_dir, "ranks")


def record_path(run_dir: str, rank: int) -> str:
    return os.path.join(folder(run_dir), "rank-%d.json" % rank)


def log_path(run_dir: str, rank: int) -> str:
    return os.path.join(folder(run_dir), "rank-%d.log" % rank)


class Rank:
    """The script of one rank, started and waited for; the signals this process saw."""

    def __init__(self, run_dir: str, rank: int, grace_s: float) -> None:
        self.run_dir, self.rank, self.grace_s, self.signalled = run_dir, rank, grace_s, ""
        self.parent = os.getppid()
        if os.getpgid(0) != os.getpid():  # torchrun starts each rank in a session of its own; anyone else:
            os.setpgid(0, 0)  # a group of our own all the same, so ending it never reaches our parent's
        for sig in HANDLED:  # the group's signal reaches the script too: only note it here
            signal.signal(sig, self._note)

    def _note(self, signum: int, frame: Any) -> None:
        self.signalled = self.signalled or signal.Signals(signum).name

    def run(self, argv: List[str]) -> int:
        """Start the script, wait for it, record its end; its return code (negative: a signal)."""
        os.makedirs(folder(self.run_dir), exist_ok=True)
        out = self._own_log()
        child = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out,
                                 stderr=subprocess.STDOUT if out else None)
        started = time.time()
        self._record(pid=child.pid, started=started)
        if self.rank == 0:  # the rendezvous this attempt uses, and how many took part
            event(self.run_dir, "torchrun", world_size=int(os.environ.get("WORLD_SIZE") or 1),
                  master_addr=os.environ.get("MASTER_ADDR"), master_port=int(os.environ.get("MASTER_PORT") or 0))
        threading.Thread(target=self._watch_parent, args=(child,), daemon=True).start()
        code = child.wait()
        self._record(pid=child.pid, started=started, exit=code, ended=time.time(), signal_seen=self.signalled or None)
        if out is not None:
            out.close()
        return code

    def _own_log(self) -> Optional[Any]:
        """Rank 0 keeps the trainer's output (None); any other rank appends to ranks/rank-R.log."""
        if self.rank == 0:
            return None
        out = open(log_path(self.run_dir, self.rank), "ab")
        out.write(("--- rank %d, torchrun pid %d, %s\n" % (self.rank, self.parent, time.strftime(
            "%Y-%m-%dT%H:%M:%SZ", time.gmtime()))).encode())
        out.flush()
        return out

    def _record(self, **fields: Any) -> None:
        atomic_write_json(record_path(self.run_dir, self.rank),
                          dict(fields, rank=self.rank, torchrun_pid=self.parent, pgid=os.getpgid(0),
                               world_size=int(os.environ.get("WORLD_SIZE") or 1)))

    def _watch_parent(self, child: "subprocess.Popen[bytes]") -> None:
        """torchrun gone before the script: ask the script to checkpoint and exit, SIGKILL after the grace."""
        while child.poll() is None and os.getppid() == self.parent:
            time.sleep(PARENT_POLL_S)
        if child.poll() is not None:
            return
        if not self.signalled:
            os.killpg(os.getpgid(0), signal.SIGTERM)  # the script and its children; this process only notes it
        deadline = time.time() + self.grace_s
        while child.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        if child.poll() is None:
            os.killpg(os.getpgid(0), signal.SIGKILL)  # this process too: the attempt is over


def main(argv: List[str]) -> int:
    grace_s = 30.0
    if argv[:1] == ["--grace"]:
        grace_s, argv = float(argv[1]), argv[2:]
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        print("usage: python -m tether.remote.rank [--grace SECONDS] -- PROGRAM [ARGS...]", file=sys.stderr)
        return 2
    code = Rank(os.environ.get("TETHER_RUN_DIR") or ".", int(os.environ.get("RANK") or 0), grace_s).run(argv)
    if code < 0:  # die of the same signal, so torchrun reads this rank as the script would have ended
        if -code != signal.SIGKILL:
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
