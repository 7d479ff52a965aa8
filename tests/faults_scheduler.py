"""Part B of the fault suite: a flaky squeue/scontrol on the login node (fail, hang, garbage, empty), switched by files."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from sshd import SSHServer

MODES = ("fail", "hang", "garbage", "empty")
TIMEOUT_S = 2  # the far side's TETHER_SCHEDULER_TIMEOUT_S here: a hang is past it within one poll

WRAPPER = """\
#!/bin/sh
# {name} as the file {mode} says: fail | hang | garbage | empty; no file: the real {name}
case "$(cat {mode} 2>/dev/null)" in
  fail) echo "{name}: error: Unable to contact slurm controller (connect failure)" >&2; exit 1 ;;
  hang) exec sleep 600 ;;
  garbage) echo "slurm_load_jobs error: <html><body>502 Bad Gateway</body></html>"; exit 0 ;;
  empty) exit 0 ;;
esac
exec {real} "$@"
"""

# What watch prints for each mode of squeue (the far side's words, tether/remote/scheduler.py)
SAID = {"fail": "squeue exited 1: squeue: error: Unable to contact slurm controller",
        "hang": f"squeue did not answer within {TIMEOUT_S:g} s",
        "garbage": "squeue printed an unreadable line"}


class FlakyScheduler:
    """squeue and scontrol stand-ins first on the PATH of a login sshd of the cluster's own (its other sshd)."""

    def __init__(self, base: Path, slurm_conf: str) -> None:
        self.bin = base / "bin"
        self.bin.mkdir(parents=True, exist_ok=True)
        for name in ("squeue", "scontrol"):
            real = shutil.which(name)
            assert real, f"{name} is not installed"
            script = self.bin / name
            script.write_text(WRAPPER.format(name=name, mode=self.bin / f"{name}.mode", real=real))
            script.chmod(0o755)
        self.login = SSHServer(base / "ssh", path_prepend=str(self.bin),
                               env={"SLURM_CONF": slurm_conf, "TETHER_SCHEDULER_TIMEOUT_S": str(TIMEOUT_S)})

    def set(self, name: str, mode: str | None) -> None:
        """Switch `name` (squeue or scontrol) to `mode`, or back to the real one (None)."""
        path = self.bin / f"{name}.mode"
        if mode is None:
            path.unlink(missing_ok=True)
        else:
            path.write_text(mode)

    def heal(self) -> None:
        self.set("squeue", None)
        self.set("scontrol", None)


def jobs_submitted(far: Path) -> list[str]:
    """Every job id submitted for the far side's one run (slurm.json keeps them all)."""
    runs = sorted((far / "runs").iterdir())
    return json.loads((runs[-1] / "slurm.json").read_text()).get("jobs", [])


def scheduler_lines(text: str) -> list[str]:
    """watch's lines about the scheduler not answering."""
    return [line for line in text.splitlines() if re.search(r"job \S+: .*waiting for the scheduler", line)]


# ---------------------------------------------------------------- scenarios (the tests and the soak share them)

SLURM = dict(drop=("gpus",), type="slurm", partition="debug", time="00:10:00", poll_interval_s=1, exit_grace_s=2)


def first_step(root: Path, remote: Path):
    """`doit run train` in the background, once the job's script has printed a step."""
    from faults_net import far_lines, start, wait

    bg = start(root, "run", "train")
    wait(lambda: any(line.startswith("step ") for line in far_lines(remote, "train.log")) or bg.proc.poll() is not None,
         120, "the job's first step")
    assert bg.proc.poll() is None, bg.output()
    return bg


def outage(bg, scheduler: FlakyScheduler, name: str, mode: str, polls: int) -> None:
    """`name` in `mode` until watch has polled `polls` more times (a stretch of polls, not a fixed time)."""
    from faults_net import requests, wait

    scheduler.set(name, mode)
    seen = requests(bg, "probe")
    wait(lambda: requests(bg, "probe") >= seen + polls + 1 or bg.proc.poll() is not None, max(120, 5 * polls),
         f"{polls} polls")  # a hanging squeue makes a poll last its timeout


def healthy_through(root: Path, scheduler: FlakyScheduler, remote: Path, seed: int, steps: int,
                    stretches: list[tuple[str, int]]):
    """A healthy job watched through squeue outages (mode, polls) in turn: watch waits and says why for each,
    the job completes with one submit, one launch, no restart, artifacts as an uninterrupted run's."""
    from faults_net import Outcome, check_run, expected_artifacts, finish

    results = [Outcome(seed, mode, moment=f"squeue {mode} for {polls} polls") for mode, polls in stretches]
    bg = first_step(root, remote)
    try:
        for mode, polls in stretches:
            outage(bg, scheduler, "squeue", mode, polls)
        ended = bg.proc.poll()
        scheduler.heal()
        code = finish(bg, results[-1], 180)
    finally:
        scheduler.heal()
        bg.kill()
    err = bg.text()
    common = [f"watch ended during the outage (exit {ended})"] if ended is not None else []
    common += [f"doit exit {code}: {err[-1500:]}"] if code != 0 else []
    common += [f"{len(jobs_submitted(remote))} jobs submitted, want 1"] if len(jobs_submitted(remote)) != 1 else []
    common += check_run(root, remote, expected_artifacts(root, steps))
    for result, (mode, _) in zip(results, stretches):
        result.failures += common
        if mode in SAID and not any(SAID[mode] in line for line in scheduler_lines(err)):
            result.failures.append(f"watch never said why it waited ({SAID[mode]!r})")
    return results


def ended_in_outage(root: Path, scheduler: FlakyScheduler, remote: Path, seed: int, cluster, mode: str, polls: int):
    """squeue and scontrol in `mode` while the job is really cancelled (the real scancel): watch decides nothing
    while they are down; once they answer it reports the real reason; the job is never submitted again."""
    from faults_net import Outcome, finish, wait

    result = Outcome(seed, "ended", moment=f"scancel during squeue+scontrol {mode} for {polls} polls")
    bg = first_step(root, remote)
    try:
        job = jobs_submitted(remote)[0]
        scheduler.set("scontrol", mode)
        scheduler.set("squeue", mode)
        cluster.run("scancel", job)  # the job really ends while nobody can ask
        wait(lambda: not cluster.run("squeue", "-h", "-j", job), 60, f"job {job} to leave the queue")
        outage(bg, scheduler, "squeue", mode, polls)
        if bg.proc.poll() is not None:
            result.failures.append(f"watch decided while the scheduler was down: {bg.text()[-1500:]}")
        scheduler.heal()
        code = finish(bg, result, 60)
    finally:
        scheduler.heal()
        bg.kill()
    err = bg.text()
    if code == 0 or f"SLURM job {job} was cancelled from outside tether" not in err:
        result.failures.append(f"the real reason (cancelled) was not reported: {err[-1500:]}")
    if mode in SAID and not scheduler_lines(err):
        result.failures.append("watch never said why it waited")
    if jobs_submitted(remote) != [job]:
        result.failures.append(f"submitted again: {jobs_submitted(remote)}")
    return result


def queued_through(root: Path, scheduler: FlakyScheduler, remote: Path, seed: int, most_polls: int = 5):
    """A job held PENDING while squeue prints garbage, nothing, or fails (seeded order, 2-most_polls polls each):
    watch keeps waiting, and the job is never submitted again (the status-fetch snowball)."""
    import random

    from faults_net import Outcome, start, wait

    rng = random.Random(seed)
    stretches = [(mode, rng.randint(2, most_polls)) for mode in rng.sample(("garbage", "empty", "fail"), 3)]
    results = [Outcome(seed, mode, moment=f"queued; squeue {mode} for {polls} polls") for mode, polls in stretches]
    bg = start(root, "run", "train")
    try:
        wait(lambda: "PENDING" in bg.text() or bg.proc.poll() is not None, 60, "the job to be queued")
        for result, (mode, polls) in zip(results, stretches):
            outage(bg, scheduler, "squeue", mode, polls)
            if bg.proc.poll() is not None:
                result.failures.append(f"watch ended while the job was queued: {bg.text()[-1500:]}")
            if len(jobs_submitted(remote)) != 1:
                result.failures.append(f"submitted again: {jobs_submitted(remote)}")
    finally:
        scheduler.heal()
        bg.kill()
    return results
