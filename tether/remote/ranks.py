"""Several processes on one host: the trainer under torchrun, and the attempt's end read from its ranks.

Stdlib only, Python >= 3.8 (copied to the far side with the launcher). With `processes` in the
launch spec (an int above 1, or `auto`: one per GPU in the trainer's CUDA_VISIBLE_DEVICES, one
on the CPU when there is none), `command` turns `python SCRIPT ARGS` into

    env PET_SIGNALS_TO_HANDLE=... TORCH_ELASTIC_SHUTDOWN_TIMEOUT=G python -m torch.distributed.run
        --nnodes=1 --nproc_per_node=N --master_addr=127.0.0.1 --master_port=P --max_restarts=0
        -m tether.remote.rank --grace G -- python SCRIPT ARGS

with P a port free on this host when the attempt starts. The settings travel as torchrun's own
environment variables (PET_* are its options' defaults), which an older torchrun that lacks the
option ignores instead of refusing. torchrun forwards SIGTERM, SIGINT, SIGHUP and (asked to) SIGUSR1
to every rank and waits `grace_seconds` before it SIGKILLs them. Each rank runs under
tether.remote.rank, which records how its script ended; torchrun itself exits 1 for any failure or
signal, so `settle` reads the attempt's exit code from the ranks instead: the first rank to fail
(a crash, or 75 after a checkpoint on a signal) is the code one script would have given.
"""

from __future__ import annotations

import glob
import os
import signal
import socket
import time
from typing import Any, Dict, List, Mapping, Optional

from tether.remote.fileio import read_json
from tether.remote.rank import folder, log_path
from tether.remote.rundir import event
from tether.remote.runtime import PREEMPTED_EXIT
from tether.remote.supervise import group_members, killpg

SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"  # torchrun's own four, and SLURM's "checkpoint now" USR1
HOST = "127.0.0.1"  # one host: the rendezvous never leaves it
TAIL_LINES, TAIL_BYTES = 15, 16384  # a failing rank's last lines, under torchrun's own report in train.log


def wanted(spec: Mapping[str, Any]) -> bool:
    """Whether the launch spec asks for torchrun (`processes` set and not 1)."""
    return spec.get("processes") not in (None, 1)


def visible_gpus(env: Mapping[str, str]) -> List[str]:
    """The GPUs CUDA_VISIBLE_DEVICES names, up to its first invalid (negative) entry, as CUDA reads it."""
    found = []
    for item in env.get("CUDA_VISIBLE_DEVICES", "").split(","):
        item = item.strip()
        if not item or item.startswith("-"):
            break
        found.append(item)
    return found


def count(processes: Any, env: Mapping[str, str]) -> int:
    """How many processes: the number asked for, or with `auto` one per visible GPU (at least one)."""
    if processes == "auto":
        return max(1, len(visible_gpus(env)))
    return int(processes)


def free_port() -> int:
    """A TCP port nobody listens on now (the kernel's choice for port 0), for this attempt's rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def command(argv: List[str], spec: Mapping[str, Any], env: Mapping[str, str]) -> List[str]:
    """`argv` (python SCRIPT ARGS, or python -m MODULE ARGS) under torchrun when the spec asks for it."""
    if not wanted(spec):
        return argv
    grace = int(max(1, round(float(spec.get("grace_seconds", 30)))))
    return ["env", "PET_SIGNALS_TO_HANDLE=" + SIGNALS, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT=%d" % grace,
            argv[0], "-m", "torch.distributed.run", "--nnodes=1",
            "--nproc_per_node=%d" % count(spec["processes"], env), "--master_addr=" + HOST,
            "--master_port=%d" % free_port(), "--max_restarts=0",
            "-m", "tether.remote.rank", "--grace", str(grace), "--"] + argv


# ---------------------------------------------------------------- after torchrun exited


def records(run_dir: str, torchrun_pid: int) -> List[Dict[str, Any]]:
    """The rank records this torchrun's ranks wrote (ranks/rank-R.json), by rank."""
    found = [read_json(p) for p in glob.glob(os.path.join(folder(run_dir), "rank-*.json"))]
    mine = [r for r in found if isinstance(r, dict) and r.get("torchrun_pid") == torchrun_pid]
    return sorted(mine, key=lambda r: int(r.get("rank", 0)))


def attempt_code(torchrun_code: Optional[int], ranks: List[Dict[str, Any]]) -> Optional[int]:
    """The exit code one script would have given: the first rank to fail, else torchrun's own.

    A rank whose record has no exit was killed with its rank process (SIGKILL); when one rank
    crashes torchrun ends the others, so the earliest failure is the cause, not the rest. When
    every rank finished (exit 0), so did the attempt, whatever torchrun's own exit.
    """
    failed = sorted((r for r in ranks if r.get("exit") not in (0, None)), key=lambda r: float(r.get("ended") or 0))
    if failed:
        return int(failed[0]["exit"])
    if ranks and all(r.get("exit") == 0 for r in ranks) and len(ranks) == int(ranks[0].get("world_size") or 0):
        return 0  # every rank finished its work: a signal that reached torchrun afterwards changes nothing
    if torchrun_code and any(r.get("exit") is None for r in ranks):
        return -signal.SIGKILL
    return torchrun_code


def _end_ranks(ranks: List[Dict[str, Any]], wait_s: float) -> None:
    """Wait up to `wait_s` for ranks still running (torchrun gone first), then SIGKILL every rank's group."""
    groups = [int(r["pgid"]) for r in ranks if r.get("pgid")]
    running = [int(r["pgid"]) for r in ranks if r.get("pgid") and r.get("exit") is None]
    deadline = time.time() + wait_s
    while time.time() < deadline and any(group_members(g) for g in running):
        time.sleep(0.05)
    for pgid in groups:  # leftovers (a script's own children) go as torchrun's group's do
        killpg(pgid, signal.SIGKILL)


def settle(run_dir: str, spec: Mapping[str, Any], torchrun_pid: int, torchrun_code: Optional[int]) -> Optional[int]:
    """After torchrun exited: no rank left running, each rank's end recorded (a `ranks` event); the
    attempt's exit code as one script's would read. A torchrun killed outright (SIGKILL: the grace
    is over, or the kernel's OOM killer) takes its ranks at once; otherwise they get the grace time."""
    if not wanted(spec):
        return torchrun_code
    killed = torchrun_code == -signal.SIGKILL
    _end_ranks(records(run_dir, torchrun_pid), 0 if killed else float(spec.get("grace_seconds", 30)))
    ranks = records(run_dir, torchrun_pid)
    code = attempt_code(torchrun_code, ranks)
    event(run_dir, "ranks", processes=len(ranks), torchrun_exit=torchrun_code, exit_code=code,
          exits={str(r.get("rank")): r.get("exit") for r in ranks})
    _tell_failure(run_dir, ranks)
    return code


def _tell_failure(run_dir: str, ranks: List[Dict[str, Any]]) -> None:
    """The first rank that failed by itself (no signal asked it to end, not 75 after a checkpoint): its
    last lines at the end of train.log, below torchrun's own report, where the run's failure message reads."""
    failed = sorted((r for r in ranks if r.get("exit") not in (0, None, PREEMPTED_EXIT) and not r.get("signal_seen")),
                    key=lambda r: float(r.get("ended") or 0))
    if not failed:
        return
    first, code = int(failed[0]["rank"]), int(failed[0]["exit"])
    how = "signal %d" % -code if code < 0 else "exit code %d" % code
    if first == 0:
        text = "tether: rank 0 failed first (%s); its output is above\n" % how
    else:
        text = "tether: rank %d failed first (%s); the end of its output (ranks/rank-%d.log):\n%s\n" % (
            first, how, first, "\n".join("  " + line for line in _last_lines(log_path(run_dir, first))))
    with open(os.path.join(run_dir, "train.log"), "ab") as f:
        f.write(text.encode())


def _last_lines(path: str) -> List[str]:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - TAIL_BYTES))
            return f.read().decode(errors="replace").splitlines()[-TAIL_LINES:]
    except OSError as err:
        return ["(unreadable: %s)" % err]
