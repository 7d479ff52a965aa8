"""The slurm backend: submit from the laptop over ssh; the job, not the laptop, owns the run.

The login node is reached with the ssh backend's transport. `job.sh` starts the launcher in
the background and waits, so the scheduler's signals reach it; a preempted or time-limited
attempt checkpoints, and the job requeues itself while the restart policy allows.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass
from typing import Any, Optional

from tether.backends import ssh
from tether.errors import BackendError
from tether.paths import RunPaths

# The single source of truth for the keys that become #SBATCH lines: config key -> sbatch flag.
SBATCH = {"partition": "--partition", "gres": "--gres", "time": "--time", "nice": "--nice",
          "cpus_per_task": "--cpus-per-task", "mem": "--mem", "nodes": "--nodes"}
OWN_FLAGS = ("--output", "--chdir", "--job-name", "--parsable", "-o", "-D", "-J")  # tether sets these
TIME_RE = re.compile(r"^(?:(\d+)-)?(\d{1,2}):(\d{2}):(\d{2})$|^(\d+)$")
LONG_JOB_S = 6 * 3600


def time_seconds(value: str) -> Optional[int]:
    """SLURM's [D-]HH:MM:SS (or plain minutes) in seconds; None if it is not that."""
    match = TIME_RE.fullmatch(value)
    if not match:
        return None
    days, hours, minutes, seconds, plain = match.groups()
    if plain:
        return int(plain) * 60
    return ((int(days or 0) * 24 + int(hours)) * 60 + int(minutes)) * 60 + int(seconds)


@dataclass(frozen=True)
class Config(ssh.Connection):
    """backends: {NAME: {type: slurm, host: LOGIN_NODE, remote_dir: SHARED_PATH, partition: ..., ...}}"""

    type: str = "slurm"
    remote_dir: str = ""
    job_python: Optional[str] = None
    partition: Optional[str] = None
    gres: Optional[str] = None
    time: str = "04:00:00"
    nice: Optional[int] = None
    cpus_per_task: Optional[int] = None
    mem: Optional[str] = None
    nodes: int = 1
    sbatch_options: tuple[str, ...] = ()
    prelude: tuple[str, ...] = ()
    poll_interval_s: float = 30.0
    exit_grace_s: float = 60.0
    job_name: str = "tether"  # the job is named <job_name>-<the run id's last 8 characters: its hash>
    signal_grace_s: int = 120

    def problems(self) -> list[str]:
        found = [p for p in super().problems() if not (p.startswith("remote_dir") and not self.remote_dir)]
        if not self.remote_dir:
            found.append("remote_dir is required for slurm: a folder on storage the compute nodes share")
        elif re.match(r"^/(var/)?tmp(/|$)", self.remote_dir):
            found.append(f"remote_dir {self.remote_dir!r} is under /tmp or /var/tmp, which compute nodes do "
                         f"not share: use a folder on shared storage (e.g. ~/tether or /scratch/$USER/tether)")
        if time_seconds(self.time) is None:
            found.append(f"time {self.time!r}: use SLURM's [D-]HH:MM:SS, e.g. 04:00:00")
        if self.nice is not None and not 0 <= self.nice <= 2000:
            found.append(f"nice {self.nice} is outside 0-2000")
        for option in self.sbatch_options:
            if (option.split("=")[0].split() or [""])[0] in OWN_FLAGS:
                found.append(f"sbatch_options: {option!r} is set by tether itself ({', '.join(OWN_FLAGS[:4])} "
                             f"are tether's own); remove it")
        if self.poll_interval_s < 1:
            found.append(f"poll_interval_s {self.poll_interval_s} is too small (at least 10 is kind to the scheduler)")
        if not re.fullmatch(r"[A-Za-z0-9._-]+", self.job_name):
            found.append(f"job_name {self.job_name!r}: use letters, digits and ._-")
        if self.job_python and not re.fullmatch(r"[A-Za-z0-9._/+-]+", self.job_python):
            found.append(f"job_python {self.job_python!r}: give an interpreter name or path")
        return found

    def warnings(self) -> list[str]:
        found = []
        seconds = time_seconds(self.time)
        if seconds and seconds > LONG_JOB_S:
            found.append(f"time {self.time} is above 6 hours: long jobs wait longer in most queues "
                         f"(checkpointing and requeue make shorter ones safe)")
        if self.poll_interval_s < 10:
            found.append(f"poll_interval_s {self.poll_interval_s:g} is below 10 s: every poll is an squeue "
                         f"on a shared login node")
        return found


def sbatch_lines(cfg: Config, run: RunPaths) -> list[str]:
    """The #SBATCH lines of a run's job.sh (tether's own flags, then the config's, then sbatch_options)."""
    lines = [f"--job-name={cfg.job_name}-{run.run_id[-8:]}", f"--output={run.remote_abs}/slurm-%j.out",
             f"--chdir={run.remote_abs}"]
    for key, flag in SBATCH.items():
        value = getattr(cfg, key)
        if value is not None and not (key == "nodes" and value == 1):
            lines.append(f"{flag}={value}")
    lines += list(cfg.sbatch_options)
    return [f"#SBATCH {shlex.quote(line)}" for line in lines]


def job_script(cfg: Config, run: RunPaths, launcher: str, python: str) -> str:
    """job.sh: the prelude, then the launcher in the background with `wait`, so signals reach it."""
    q = shlex.quote
    multi_node = [
        'export MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"',
        "export MASTER_PORT=29500 WORLD_SIZE=$SLURM_NNODES NNODES=$SLURM_NNODES",
        'export TETHER_SRUN="srun --nodes=$SLURM_NNODES --ntasks-per-node=1"',
    ] if cfg.nodes > 1 else []
    return "\n".join(["#!/bin/bash", *sbatch_lines(cfg, run), "", "# prelude (from the config)",
                      *cfg.prelude, "", *multi_node,
                      "child=; early=",
                      "trap 'early=USR1; kill -USR1 $child 2>/dev/null' USR1  # the time-limit warning",
                      "trap 'early=TERM; kill -TERM $child 2>/dev/null' TERM  # scancel, preemption, requeue",
                      f"{q(python)} {q(launcher)} run {q(run.remote_abs)} &",
                      "child=$!",
                      '[ -n "$early" ] && kill -$early $child  # a signal that came before the launcher',
                      "while :; do wait $child; code=$?; kill -0 $child 2>/dev/null || break; done",
                      f'echo "$code" > {q(run.remote_abs)}/exit_code.$SLURM_JOB_ID',
                      '[ "$code" = 99 ] && scontrol requeue "$SLURM_JOB_ID"  # the restart policy wants another attempt',
                      "exit $code", ""])


class Backend(ssh.Backend):
    """A SLURM cluster behind a login node."""

    type = "slurm"

    @property
    def job_python(self) -> str:
        return self.config.job_python or self.config.python

    @property
    def poll_interval_s(self) -> float:
        return self.config.poll_interval_s

    @property
    def exit_grace_s(self) -> float:
        return self.config.exit_grace_s

    def settings(self) -> dict:
        return {"remote_dir": self.remote_dir, "gpus": "none", "env": self.trainer_env(), "scheduler": "slurm",
                "partition": self.config.partition}

    def _report(self, report: Any, found: dict, settings: dict, require: tuple[str, ...]) -> None:
        slurm = found.get("slurm", {})
        missing = [c for c in ("sbatch", "squeue", "scancel") if not slurm.get("commands", {}).get(c)]
        report.add("slurm commands", not missing, f"missing on the login node: {', '.join(missing)}" if missing
                   else "sbatch, squeue, scancel found")
        partitions, wanted = slurm.get("partitions", []), self.config.partition
        report.add("partition", not wanted or wanted in partitions,
                   f"{wanted or '(the default)'}; sinfo lists: {', '.join(partitions) or 'none'}")
        report.add("compute nodes", True, "their packages cannot be checked from the login node"
                   + (f" (the trainer needs {', '.join(require)})" if require else ""))

    def launch(self, run: RunPaths) -> dict:
        script = job_script(self.config, run, f"{self.version_dir}/tether/remote/launcher.py", self.job_python)
        flags = ["--parsable", f"--signal=B:USR1@{self.config.signal_grace_s}", "--requeue",
                 f"--comment=tether:{run.run_id}"]
        settings = dict(self.settings(), script=script, flags=flags)
        result = self.launcher("submit", run.remote_abs, stdin=json.dumps(settings).encode())
        if result["outcome"] == "error":
            raise BackendError(f"{run.run_id}: {result['error']}")
        if result["outcome"] == "started":
            print(f"{run.run_id}: SLURM job {result['job_id']} (sbatch {' '.join(result['flags'] or [])})")
        return dict(result, state=result.get("state") or {})

    def stop(self, run: RunPaths, grace_s: float) -> dict:
        return self.launcher("cancel", run.remote_abs, str(grace_s))
