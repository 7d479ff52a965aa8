"""One trainer per node of a multi-node SLURM job: the srun step, stop signals passed on intact, torch's rank per task.

Stdlib only, Python >= 3.8 (copied to the far side with the launcher). job.sh exports the srun
flags as TETHER_SRUN and the rendezvous (MASTER_ADDR, MASTER_PORT); the launcher then starts
`step_command(srun, argv)` as the trainer, which runs in two roles:

- `step`, on the batch node as the launcher's child: starts srun (in its own session, so the
  launcher's signals to its trainer's process group never reach srun) and waits for it. srun
  turns a SIGTERM or SIGHUP it receives into a SIGKILL of every task ("srun: forcing job
  termination", checked on Slurm 22.05), which would cut the trainer's checkpoint short; so a
  TERM, INT or HUP sent here becomes `scancel --signal=TERM JOB.STEP`, which every task gets
  itself. USR1 (the time-limit warning), which srun forwards to every task, goes to srun.
- `task`, on every node, what srun starts: RANK, LOCAL_RANK, WORLD_SIZE and NODE_RANK from srun's
  SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS and SLURM_NODEID, then exec of the trainer's argv, so a
  script's `init_process_group("gloo")` (env://) works unchanged.

A launcher that wraps the argv in torchrun for several processes per node passes torchrun's argv
here: each node's task then runs one torchrun, which reads NODE_RANK, WORLD_SIZE (nodes) and the
rendezvous, and sets RANK and LOCAL_RANK for its own workers.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
from typing import Any, Callable, List, Mapping, Optional

RANKS = {"RANK": "SLURM_PROCID", "LOCAL_RANK": "SLURM_LOCALID", "WORLD_SIZE": "SLURM_NTASKS",
         "NODE_RANK": "SLURM_NODEID"}
STEP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # what srun must never receive itself
SCANCEL_S = 20.0  # a hung scancel must not hold the step; the scheduler's KillWait ends it anyway


def step_command(srun: str, argv: List[str]) -> List[str]:
    """The launcher's trainer command for a multi-node job: this module's `step` around `argv`."""
    return [sys.executable, os.path.abspath(__file__), "step", *shlex.split(srun), "--", *argv]


def task_env(environ: Mapping[str, str]) -> dict:
    """`environ` with torch's rank variables set from the ones srun gives this task."""
    env = dict(environ)
    env.update({name: environ[slurm] for name, slurm in RANKS.items() if slurm in environ})
    return env


def task(argv: List[str]) -> int:
    """One node's task: its ranks in the environment, then the trainer in this very process."""
    os.execvpe(argv[0], argv, task_env(os.environ))
    return 127  # not reached: exec replaces this process or raises


def step(srun: List[str], argv: List[str]) -> int:
    """srun `task argv` on every node; its exit code (128 + N for a signal), signals passed on."""
    started: List["subprocess.Popen[bytes]"] = []
    early: List[int] = []  # a signal before srun started: passed on once it has
    for sig in (*STEP_SIGNALS, signal.SIGUSR1):
        signal.signal(sig, lambda signum, frame: _pass_on(started[0], signum) if started else early.append(signum))
    started.append(subprocess.Popen([*srun, sys.executable, os.path.abspath(__file__), "task", *argv],
                                    start_new_session=True, preexec_fn=_die_with_parent()))
    for signum in early:
        _pass_on(started[0], signum)
    code = started[0].wait()
    return 128 - code if code < 0 else code


def _pass_on(child: "subprocess.Popen[bytes]", signum: int) -> None:
    if signum == signal.SIGUSR1:
        _send(child, signal.SIGUSR1)  # srun forwards it to every task
    else:
        _term_tasks(child)


def _term_tasks(child: "subprocess.Popen[bytes]") -> None:
    """SIGTERM to every task of this job's running steps; to srun only while no step exists yet."""
    steps = _running_steps(os.environ.get("SLURM_JOB_ID", ""))
    if steps:
        try:
            subprocess.run(["scancel", "--signal=TERM", *steps], timeout=SCANCEL_S,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            return
        except (OSError, subprocess.SubprocessError):
            pass
    _send(child, signal.SIGTERM)  # nothing started, or no scancel: srun ends what it launched


def _running_steps(job_id: str) -> List[str]:
    """`JOB.N` for the job's numbered steps in the queue (not its batch or extern step)."""
    if not job_id:
        return []
    try:
        out = subprocess.run(["squeue", "-h", "-s", "-j", job_id, "-o", "%i"], timeout=SCANCEL_S,
                             capture_output=True, text=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [s for s in out.split() if s.partition(".")[2].isdigit()]


def _send(child: "subprocess.Popen[bytes]", sig: int) -> None:
    try:
        child.send_signal(sig)
    except OSError:
        pass


def _die_with_parent() -> Optional[Callable[[], None]]:
    """A preexec_fn that has srun SIGKILLed when this process dies (the launcher's SIGKILL after its
    grace time): srun's own shepherd then kills the step's tasks on every node. None without prctl."""
    try:
        import ctypes

        prctl = ctypes.CDLL(None).prctl
    except (ImportError, OSError, AttributeError):
        return None
    return lambda: prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def main(args: Optional[List[str]] = None) -> Any:
    args = sys.argv[1:] if args is None else args
    if args[:1] == ["task"]:
        return task(args[1:])
    if args[:1] == ["step"] and "--" in args:
        cut = args.index("--")
        return step(args[1:cut], args[cut + 1:])
    print("usage: nodes.py step SRUN... -- ARGV... | nodes.py task ARGV...", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
