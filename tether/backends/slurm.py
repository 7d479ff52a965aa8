"""The slurm backend: submit from the laptop over ssh; the job, not the laptop, owns the run.

The login node is reached with the ssh transport (tether/backends/openssh.py); this policy
submits there. `job.sh` starts the launcher in the background and waits, so the scheduler's
signals reach it; a preempted or time-limited attempt checkpoints, and the job requeues itself
while the restart policy allows.
"""

from __future__ import annotations

import difflib
import posixpath
import re
import shlex
from dataclasses import dataclass
from typing import Any, Optional

from tether.backends.base import Backend as BaseBackend
from tether.backends.openssh import Connection, SSHTransport
from tether.backends.transport import Transport
from tether.errors import BackendError
from tether.paths import RunPaths
from tether.remote.protocol import ERROR, STARTED, LaunchResult, StopOutcome
from tether.remote.scheduler import RUNS_LINE

# The single source of truth for the keys that become #SBATCH lines: config key -> sbatch flag.
SBATCH = {"partition": "--partition", "gres": "--gres", "time": "--time", "nice": "--nice",
          "cpus_per_task": "--cpus-per-task", "mem": "--mem", "nodes": "--nodes"}
# sbatch's own option table (Slurm 22.05.8), as its getopt_long sees it: the long names from
#   for c in a b c d e g h i m n o p q r s t u v w; do sbatch --$c=1; done   ("is ambiguous; possibilities: ...")
# (plus --job-name, --kill-on-invalid-dep and --licenses, the only names under j, k and l), and each one's
# argument from `sbatch --NAME=1` ("doesn't allow an argument") and a bare `sbatch --NAME` ("requires an
# argument"); the short options from `sbatch -X` for every letter and digit, mapped to long ones by
# `sbatch --help`. Data, not a run-time call: the laptop that validates a config has no sbatch.
SBATCH_NO_ARG = frozenset(
    "contiguous help hold ignore-pbs no-requeue overcommit oversubscribe parsable quiet reboot requeue spread-job "
    "test-only usage use-min-nodes verbose version wait".split())
SBATCH_OPTIONAL_ARG = frozenset("exclusive get-user-env nice no-kill propagate".split())  # only as --name=value
SBATCH_REQUIRED_ARG = frozenset(
    "account acctg-freq array batch bb bbf begin chdir cluster cluster-constraint clusters comment constraint "
    "container context core-spec cores-per-socket cpu-freq cpus-per-gpu cpus-per-task deadline delay-boot "
    "dependency distribution error exclude export export-file extra-node-info gid gpu-bind gpu-freq gpus "
    "gpus-per-node gpus-per-socket gpus-per-task gres gres-flags hint input job-name kill-on-invalid-dep licenses "
    "mail-type mail-user mcs-label mem mem-bind mem-per-cpu mem-per-gpu mincpus network nodefile nodelist nodes "
    "ntasks ntasks-per-core ntasks-per-gpu ntasks-per-node ntasks-per-socket ntasks-per-tres open-mode output "
    "partition power prefer priority profile qos reservation signal sockets-per-node switches tasks-per-node "
    "thread-spec threads-per-core time time-min tmp uid wait-all-nodes wckey wrap".split())
SBATCH_LONG = sorted(SBATCH_NO_ARG | SBATCH_OPTIONAL_ARG | SBATCH_REQUIRED_ARG)
SBATCH_SHORT = {  # -k takes an optional attached value, like --no-kill; the others as their long option
    "A": "account", "B": "extra-node-info", "C": "constraint", "D": "chdir", "F": "nodefile", "G": "gpus",
    "H": "hold", "J": "job-name", "L": "licenses", "M": "clusters", "N": "nodes", "O": "overcommit", "Q": "quiet",
    "S": "core-spec", "V": "version", "W": "wait", "a": "array", "b": "begin", "c": "cpus-per-task",
    "d": "dependency", "e": "error", "h": "help", "i": "input", "k": "no-kill", "m": "distribution", "n": "ntasks",
    "o": "output", "p": "partition", "q": "qos", "s": "oversubscribe", "t": "time", "v": "verbose", "w": "nodelist",
    "x": "exclude"}
# What tether sets itself, by sbatch's long name, and what to do instead. The first four are #SBATCH
# lines of every job.sh; the next are flags of tether's own sbatch call (a command-line flag silently
# beats an #SBATCH line); the rest are config keys (a later #SBATCH line silently beats an earlier one).
OWN_OPTIONS = {
    "output": "remove it: the job writes <run dir>/slurm-%j.out, where tether reads it",
    "chdir": "remove it: the job starts in its run dir",
    "job-name": "set job_name: instead",
    "parsable": "remove it: tether submits with --parsable to read the job id",
    "signal": "set signal_grace_s: instead",
    "requeue": "remove it: the restart policy (policy:, max_restarts:) decides requeues",
    "no-requeue": "remove it: the restart policy (policy:, max_restarts:) decides requeues",
    "comment": "remove it: tether tags its jobs with --comment=tether:<run id> to find them",
    "array": "remove it: a sweep is one job array; set array_limit: to cap it",
    **{flag[2:]: f"set {key}: instead" for key, flag in SBATCH.items()},
}
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


def _long_name(given: str) -> tuple[Optional[str], str]:
    """sbatch's long option for `--NAME` the way getopt_long reads it (an exact name, or the one name
    this prefix starts); (None, why not) for an unknown or ambiguous one."""
    if given in SBATCH_LONG:
        return given, ""
    matches = [name for name in SBATCH_LONG if name.startswith(given)]
    if len(matches) == 1:
        return matches[0], ""
    if matches:
        return None, f"is ambiguous: sbatch reads it as one of --{', --'.join(matches)}; write the option in full"
    close = difflib.get_close_matches(given, SBATCH_LONG, n=3)
    hint = f"did you mean --{', --'.join(close)}?" if close else "see `sbatch --help`"
    return None, f"is not an sbatch option ({hint})"


Resolved = tuple[str, str, Optional[str]]  # (the words as given, sbatch's long name, the value or None)


def sbatch_words(options: tuple[str, ...]) -> tuple[list[Resolved], list[str]]:
    """sbatch_options as sbatch resolves them: ([(as given, long name, value)], [problems]).

    Long options by unambiguous prefix, `--name=value` or `--name value`; short ones alone, bunched
    (`-Hv`) or with a value attached (`-D/`, `-ofile`) or apart (`-o file`), as getopt_long does."""
    words = [word for option in options for word in option.split()]
    found: list[Resolved] = []
    problems: list[str] = []
    i = 0
    while i < len(words):
        if words[i].startswith("--") and words[i] != "--":
            i = _long_option(words, i, found, problems)
        elif words[i].startswith("-") and words[i] not in ("-", "--"):
            i = _short_options(words, i, found, problems)
        else:
            problems.append(f"sbatch_options: {words[i]!r} is not an option: write each one as --name=value")
            i += 1
    return found, problems


def _long_option(words: list[str], i: int, found: list[Resolved], problems: list[str]) -> int:
    """Resolve the `--name[=value]` at words[i] (its value may be the next word); the index after it."""
    word = words[i]
    given, eq, value = word[2:].partition("=")
    name, why = _long_name(given)
    if name is None:
        problems.append(f"sbatch_options: {word!r} {why}")
        return i + 1
    if not eq and name in SBATCH_REQUIRED_ARG and i + 1 < len(words):
        found.append((f"{word} {words[i + 1]}", name, words[i + 1]))
        return i + 2
    found.append((word, name, value if eq else None))
    return i + 1


def _short_options(words: list[str], i: int, found: list[Resolved], problems: list[str]) -> int:
    """Resolve the short options bunched in words[i] (the last one's value may be the next word)."""
    word = words[i]
    for j, letter in enumerate(word[1:], start=2):
        name = SBATCH_SHORT.get(letter)
        if name is None:
            problems.append(f"sbatch_options: {word!r}: -{letter} is not an sbatch option (see `sbatch --help`)")
            return i + 1
        if name in SBATCH_NO_ARG:
            found.append((word, name, None))
            continue
        value = word[j:] or None  # the rest of the word is the value: -D/ is --chdir=/
        if value is None and name in SBATCH_REQUIRED_ARG and i + 1 < len(words):
            found.append((f"{word} {words[i + 1]}", name, words[i + 1]))
            return i + 2
        found.append((word, name, value))
        return i + 1
    return i + 1


def _option_problems(options: tuple[str, ...]) -> list[str]:
    """sbatch_options that sbatch would refuse, or that would override what tether sets itself."""
    found, problems = sbatch_words(options)
    for given, name, value in found:
        if name in OWN_OPTIONS:
            seen = "" if given.startswith(f"--{name}") else f" (sbatch reads it as --{name})"
            problems.append(f"sbatch_options: {given!r} is set by tether itself{seen}: {OWN_OPTIONS[name]}")
        elif value is None and name in SBATCH_REQUIRED_ARG:
            problems.append(f"sbatch_options: {given!r} needs a value: --{name}=VALUE")
        elif value is not None and name in SBATCH_NO_ARG:
            problems.append(f"sbatch_options: {given!r} takes no value: --{name}")
    return problems


def _normalized(path: str) -> str:
    """A POSIX path without ., .. and repeated slashes (normpath keeps a leading // : POSIX allows it)."""
    norm = posixpath.normpath(path)
    return "/" + norm.lstrip("/") if norm.startswith("//") else norm


@dataclass(frozen=True, kw_only=True)
class Config(Connection):
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
    prelude: tuple[str, ...] = ()  # deprecated: the job's environment: {setup: [...]} (these run first)
    poll_interval_s: float = 30.0
    exit_grace_s: float = 60.0
    job_name: str = "tether"  # the job is named <job_name>-<the run id's last 8 characters: its hash>
    array_limit: Optional[int] = None  # a sweep's job array runs at most this many points at once
    signal_grace_s: int = 120

    def problems(self) -> list[str]:
        found = [p for p in super().problems() if not (p.startswith("remote_dir") and not self.remote_dir)]
        if not self.remote_dir:
            found.append("remote_dir is required for slurm: a folder on storage the compute nodes share")
        elif re.match(r"^/(var/)?tmp(/|$)", _normalized(self.remote_dir)):
            found.append(f"remote_dir {self.remote_dir!r} is under /tmp or /var/tmp, which compute nodes do "
                         f"not share: use a folder on shared storage (e.g. ~/tether or /scratch/$USER/tether)")
        if time_seconds(self.time) is None:
            found.append(f"time {self.time!r}: use SLURM's [D-]HH:MM:SS, e.g. 04:00:00")
        if self.nice is not None and not 0 <= self.nice <= 2000:
            found.append(f"nice {self.nice} is outside 0-2000")
        found += _option_problems(self.sbatch_options)
        seconds = time_seconds(self.time)
        if seconds is not None and self.signal_grace_s >= seconds:
            # --signal=B:USR1@grace then fires as the job starts: every attempt is told to checkpoint
            # during its prelude, before the trainer runs ("SLURM job N failed (exit code 0:10)")
            found.append(f"signal_grace_s {self.signal_grace_s} is not below time {self.time} ({seconds} s): the "
                         f"time-limit warning would come as the job starts; lower signal_grace_s well below "
                         f"{seconds}, or raise time")
        if self.poll_interval_s < 1:
            found.append(f"poll_interval_s {self.poll_interval_s} is too small (at least 10 is kind to the scheduler)")
        if not re.fullmatch(r"[A-Za-z0-9._-]+", self.job_name):
            found.append(f"job_name {self.job_name!r}: use letters, digits and ._-")
        if self.array_limit is not None and self.array_limit < 1:
            found.append(f"array_limit {self.array_limit} must be at least 1 (or null: no limit)")
        if self.job_python and not re.fullmatch(r"[A-Za-z0-9._/+-]+", self.job_python):
            found.append(f"job_python {self.job_python!r}: give an interpreter name or path")
        return _no_rented_box_keys(self, found)

    def warnings(self) -> list[str]:
        found = [w for w in super().warnings() if not w.startswith("idle_stop")]  # refused above
        seconds = time_seconds(self.time)
        if seconds and seconds > LONG_JOB_S:
            found.append(f"time {self.time} is above 6 hours: long jobs wait longer in most queues "
                         f"(checkpointing and requeue make shorter ones safe)")
        if self.poll_interval_s < 10:
            found.append(f"poll_interval_s {self.poll_interval_s:g} is below 10 s: every poll is an squeue "
                         f"on a shared login node")
        if self.prelude:
            found.append("prelude: is deprecated: move the lines to the job's environment: {setup: [...]} "
                         "(they still run first in job.sh)")
        return found


def _no_rented_box_keys(cfg: Config, found: list[str]) -> list[str]:
    """A cluster is no rented box: its job frees the node when it ends, and `down` never tears it down."""
    found = [p for p in found if not p.startswith(("idle_stop", "teardown_command"))]  # one line each, below
    if cfg.idle_stop is not None:
        found.append("idle_stop is for a box rented by the hour: under SLURM the job ends and frees its node by "
                     "itself; remove idle_stop from this backend")
    if cfg.teardown_command is not None:
        found.append("teardown_command is for a rented box: `down` never tears down a cluster (it removes the "
                     "run dir only); remove teardown_command from this backend")
    return found


def sbatch_lines(cfg: Config, run: RunPaths) -> list[str]:
    """The #SBATCH lines of a run's job.sh (tether's own flags, then the config's, then sbatch_options)."""
    return _sbatch_lines(cfg, f"{cfg.job_name}-{run.run_id[-8:]}", f"{run.remote_abs}/slurm-%j.out", run.remote_abs)


def _sbatch_lines(cfg: Config, name: str, output: str, chdir: str) -> list[str]:
    lines = [f"--job-name={name}", f"--output={output}", f"--chdir={chdir}"]
    for key, flag in SBATCH.items():
        value = getattr(cfg, key)
        if value is not None and not (key == "nodes" and value == 1):
            lines.append(f"{flag}={value}")
    lines += list(cfg.sbatch_options)
    return [f"#SBATCH {shlex.quote(line)}" for line in lines]


def job_script(cfg: Config, run: RunPaths, launcher: str, python: str, setup: tuple[str, ...] = ()) -> str:
    """job.sh: the setup lines, then the launcher in the background with `wait`, so signals reach it."""
    return _script(cfg, sbatch_lines(cfg, run), [f"run_dir={shlex.quote(run.remote_abs)}", "job_key=$SLURM_JOB_ID"],
                   launcher, python, setup)


def array_script(cfg: Config, name: str, remote_dir: str, launcher: str, python: str,
                 setup: tuple[str, ...] = ()) -> str:
    """One job array for a sweep: element i runs the i-th run dir of the list that `submit-array`
    writes in place of RUNS_LINE on the far side (only the runs that still need a job)."""
    header = _sbatch_lines(cfg, f"{cfg.job_name}-{name}", f"{remote_dir}/slurm/%A_%a.out", remote_dir)
    select = [RUNS_LINE, 'run_dir="${runs[$SLURM_ARRAY_TASK_ID]}"', 'cd "$run_dir" || exit 1',
              'job_key="${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}"  # what squeue -r calls this element']
    return _script(cfg, header, select, launcher, python, setup)


def setup_lines(cfg: Config, setup: tuple[str, ...]) -> list[str]:
    """The job's setup lines in job.sh: the backend's prelude first (its deprecated alias), then the job's
    environment.setup; TETHER_SETUP_DONE tells the launcher not to run them again around the trainer."""
    lines = list(cfg.prelude) + list(setup)
    return ["# setup (prelude, then environment.setup)", *lines, "export TETHER_SETUP_DONE=1"] if lines else []


def rendezvous_lines(python: str) -> list[str]:
    """job.sh's lines for a job on several nodes: the rendezvous every node's trainer reads, and
    TETHER_SRUN, which makes the launcher start the trainer as one srun task per node
    (tether/remote/nodes.py sets RANK, LOCAL_RANK, WORLD_SIZE, NODE_RANK per task).

    job.sh runs on the allocation's first node (sbatch's rule), where srun puts task 0: rank 0,
    which listens for the others. MASTER_ADDR is that node's NodeAddr, the address slurmctld itself
    reaches it by (its name where NodeAddr is unset). MASTER_PORT is a port the kernel says is free
    on that node, picked anew by every attempt: never a fixed 29500, which two jobs sharing a node
    would both try to bind, and not one derived from the job id, which anything else on the node
    may hold. srun gets --cpus-per-task again: since Slurm 22.05 a step no longer inherits sbatch's.
    """
    free_port = 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'
    return [
        'first="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"',
        'addr="$(scontrol show node -o "$first" 2>/dev/null | tr " " "\\n" | sed -n "s/^NodeAddr=//p")"',
        f'export MASTER_ADDR="${{addr:-$first}}" MASTER_PORT="$({shlex.quote(python)} -c {shlex.quote(free_port)})"',
        "export WORLD_SIZE=$SLURM_NNODES NNODES=$SLURM_NNODES",
        'export TETHER_SRUN="srun --nodes=$SLURM_NNODES --ntasks-per-node=1'
        '${SLURM_CPUS_PER_TASK:+ --cpus-per-task=$SLURM_CPUS_PER_TASK}"',
    ]


def _script(cfg: Config, header: list[str], select: list[str], launcher: str, python: str,
            setup: tuple[str, ...] = ()) -> str:
    q = shlex.quote
    multi_node = rendezvous_lines(python) if cfg.nodes > 1 else []
    return "\n".join(["#!/bin/bash", *header, "", *setup_lines(cfg, setup), "", *multi_node, *select,
                      "child=; early=",
                      "trap 'early=USR1; kill -USR1 $child 2>/dev/null' USR1  # the time-limit warning",
                      "trap 'early=TERM; kill -TERM $child 2>/dev/null' TERM  # scancel, preemption, requeue",
                      f'{q(python)} {q(launcher)} run "$run_dir" &',
                      "child=$!",
                      '[ -n "$early" ] && kill -$early $child  # a signal that came before the launcher',
                      "while :; do wait $child; code=$?; kill -0 $child 2>/dev/null || break; done",
                      'echo "$code" > "$run_dir/exit_code.$job_key"',
                      '[ "$code" = 99 ] && scontrol requeue "$SLURM_JOB_ID"  # the restart policy wants another attempt',
                      "exit $code", ""])


class Backend(BaseBackend):
    """The slurm policy: sbatch on a login node reached over the ssh transport; the job owns the run."""

    type = "slurm"
    launches_arrays = True  # a sweep is one job array, not one sbatch per point
    config: Config
    transport: SSHTransport

    def make_transport(self) -> Transport:
        return SSHTransport(self.config, self.state_dir)

    @property
    def keep_remote(self) -> bool:
        return self.config.keep_remote

    def fetch_policy(self, path: str, size: int) -> str:
        return self.config.fetch_policy(path, size)

    @property
    def job_python(self) -> str:
        """The compute nodes' interpreter: the job's venv's (built from it on the login node), else job_python."""
        found = self.venv()
        return found.python if found else self.venv_base

    @property
    def venv_base(self) -> str:
        return self.config.job_python or self.config.python

    @property
    def python(self) -> str:
        """The login node's interpreter: serve and the preflight run there (the job runs job_python)."""
        return self.base_python

    @property
    def poll_interval_s(self) -> float:  # type: ignore[override]
        return self.config.poll_interval_s

    @property
    def exit_grace_s(self) -> float:  # type: ignore[override]
        return self.config.exit_grace_s

    def settings(self) -> dict:
        return {"remote_dir": self.remote_dir, "gpus": "none", "env": self.config.trainer_env(), "scheduler": "slurm",
                "partition": self.config.partition}

    def _report(self, report: Any, found: dict, settings: dict, require: tuple[str, ...]) -> None:
        slurm = found.slurm or {}
        missing = [c for c in ("sbatch", "squeue", "scancel") if not slurm.get("commands", {}).get(c)]
        report.add("slurm commands", not missing, f"missing on the login node: {', '.join(missing)}" if missing
                   else "sbatch, squeue, scancel found")
        partitions, wanted = slurm.get("partitions", []), self.config.partition
        report.add("partition", not wanted or wanted in partitions,
                   f"{wanted or '(the default)'}; sinfo lists: {', '.join(partitions) or 'none'}")
        report.add("compute nodes", True, "their packages cannot be checked from the login node"
                   + (f" (the trainer needs {', '.join(require)})" if require else ""))

    def launch(self, run: RunPaths) -> dict:
        script = job_script(self.config, run, f"{self.version_dir}/tether/remote/launcher.py", self.job_python,
                            self.environment.setup)
        flags = ["--parsable", f"--signal=B:USR1@{self.config.signal_grace_s}", "--requeue",
                 f"--comment=tether:{run.run_id}"]
        settings = dict(self.settings(), script=script, flags=flags)
        result = self.far.submit(run.remote_abs, settings)
        if result.outcome == ERROR:
            raise BackendError(f"{run.run_id}: {result.error}")
        if result.outcome == STARTED:
            print(f"{run.run_id}: SLURM job {result.job_id} (sbatch {' '.join(result.flags or [])})")
        return result

    def launch_many(self, runs: list[RunPaths], name: str) -> dict[str, LaunchResult]:
        """One job array (`--array=0-K%array_limit`) for the runs that need a job; the others are adopted."""
        script = array_script(self.config, name, self.remote_dir, f"{self.version_dir}/tether/remote/launcher.py",
                              self.job_python, self.environment.setup)
        flags = ["--parsable", f"--signal=B:USR1@{self.config.signal_grace_s}", "--requeue", f"--comment=tether:{name}"]
        settings = dict(self.settings(), script=script, flags=flags, runs=[r.remote_abs for r in runs],
                        array_limit=self.config.array_limit)
        result = self.far.submit_array(self.remote_dir, settings)
        if result.get("outcome") == "error":
            raise BackendError(f"{name}: {result['error']}")
        if result.get("array_job"):
            print(f"{name}: SLURM job array {result['array_job']} for {len(result['submitted'])} run(s) "
                  f"(sbatch {' '.join(result['flags'])})")
        return {r.run_id: LaunchResult.of(result["runs"][r.remote_abs]) for r in runs}

    def stop(self, run: RunPaths, grace_s: float) -> StopOutcome:
        return self.far.cancel(run.remote_abs, grace_s)
