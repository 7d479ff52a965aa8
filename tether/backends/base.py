"""The backend interface: a Transport composed with a policy (each type's Backend), and the shared keys.

A backend type is one module with a `Config` (extending `Shared`, the keys every type takes) and a
`Backend` (extending this one) that names its transport (tether/backends/transport.py) and says
how a run is launched and stopped there. Everything else (check, state, teardown, prune) is built
here on the far-side launcher, so every backend behaves the same and is tested by the same
contract suite.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass, field
from typing import Any, Optional

from tether.backends import venv
from tether.backends.channel import ChannelLost
from tether.backends.farside import FarSide
from tether.backends.transport import Transport
from tether.shipping import launcher_version
from tether.errors import BackendError
from tether.paths import RunPaths
from tether.environment import Wanted
from tether.remote.protocol import EnvironmentInfo, LaunchResult, Preflight, Snapshot, StopOutcome


DELETING_WORDS = ("terminate", "destroy", "delete", "remove")  # the providers' verbs that take the disk too


@dataclass(frozen=True)
class IdleStop:
    """idle_stop: {after_s: S, command: CMD}: once a run is final and sealed, no other run of the box
    is alive, and nothing has read any of them (no pull, status or watch) for after_s seconds, the
    box runs CMD, once: its own stop, which keeps the disk so the results stay pullable
    (tether.remote.idle.wait_then_stop, called by the far side's launcher)."""

    after_s: float = 1800.0
    command: str = ""

    def problems(self) -> list[str]:
        found = []
        if self.after_s <= 0:
            found.append(f"idle_stop: after_s {self.after_s:g} must be positive: the seconds without a read "
                         f"before the box stops itself (e.g. 1800)")
        if not self.command.strip():
            found.append("idle_stop: command is empty: give the box's own stop command, one that keeps its disk "
                         "(e.g. runpodctl stop pod $RUNPOD_POD_ID; the README lists the providers' verbs)")
        return found

    def warnings(self) -> list[str]:
        found = []
        if 0 < self.after_s < 60:
            found.append(f"idle_stop: after_s {self.after_s:g} is below 60 s: the box may stop itself before you "
                         f"get to `doit pull` (a pull in progress is never cut off)")
        said = [w for w in DELETING_WORDS if w in self.command.lower()]
        if said:
            found.append(f"idle_stop: command {self.command!r} says {said[0]!r}: an idle stop must keep the disk, "
                         f"or the results go with it; use the provider's stop verb here, and its delete verb in "
                         f"teardown_command (run by `down` once the results are verified here)")
        return found


@dataclass(frozen=True, kw_only=True)
class Shared:
    """The keys every backend type takes; each type's Config extends it (and may change a default)."""

    type: str = ""
    remote_dir: Optional[str] = None
    python: Optional[str] = None
    max_artifact_mb: Optional[float] = None  # artifacts and checkpoints above this stay on the far side
    teardown_command: Optional[str] = None  # run here by `down` after the gate and the run dir's removal
    idle_stop: Optional[IdleStop] = None  # the box stops itself once its sealed runs go unread
    num_threads: Optional[int] = None  # OMP/MKL/OPENBLAS_NUM_THREADS for the trainer
    env: dict = field(default_factory=dict)  # extra environment for the trainer

    def problems(self) -> list[str]:
        found = self.idle_stop.problems() if self.idle_stop is not None else []
        if self.teardown_command is not None and not self.teardown_command.strip():
            found.append("teardown_command is empty: give the provider's terminate command "
                         "(e.g. vastai destroy instance 4242), or remove the key")
        for key in self.env:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
                found.append(f"env key {key!r} is not a valid environment variable name")
        return found

    def trainer_env(self) -> dict:
        """`env:` plus the thread counts from `num_threads:`: what a run's trainer gets."""
        env = {str(k): str(v) for k, v in self.env.items()}
        if self.num_threads:
            for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
                env[name] = str(self.num_threads)
        return env

    def warnings(self) -> list[str]:
        return self.idle_stop.warnings() if self.idle_stop is not None else []

    def legacy_packages(self) -> tuple[str, ...]:
        """Packages this backend's own (deprecated) key adds to the job's venv (ssh: packages:)."""
        return ()

    def installer_env(self) -> dict:
        """The environment the venv's installer gets from this backend: env: (mirrors, proxies)."""
        return {str(k): str(v) for k, v in self.env.items()}


@dataclass
class Report:
    """A preflight: what was checked, whether it passed, and what was found."""

    backend: str
    items: list[dict] = field(default_factory=list)

    def add(self, what: str, ok: bool, detail: str) -> None:
        self.items.append({"check": what, "ok": ok, "detail": detail})

    @property
    def ready(self) -> bool:
        return all(item["ok"] for item in self.items)

    def text(self) -> str:
        lines = [f"{'ok ' if i['ok'] else 'NO '} {i['check']}: {i['detail']}" for i in self.items]
        verdict = "ready" if self.ready else "not ready"
        return "\n".join([f"backend {self.backend}: {verdict}"] + lines)

    def as_dict(self) -> dict:
        return {"backend": self.backend, "ready": self.ready, "checks": self.items}


class Backend:
    """One far side: a transport and this type's policy. Public methods go through its serve process."""

    type = ""
    min_free_mb = 500  # below this a run's checkpoints may not fit
    poll_interval_s = 2.0  # watch's slowest poll while nothing happens
    exit_grace_s = 0.0  # how long a vanished run may take to show its final state (shared storage)
    launches_arrays = False  # True: a sweep's runs are launched together by launch_many

    def __init__(self, name: str, config: Any, state_dir: str, environment: Optional[Wanted] = None) -> None:
        self.name, self.config, self.state_dir = name, config, state_dir
        # the job's environment: (ssh's deprecated packages: folded in); its venv is found or built once
        self.environment = venv.merged(environment, config.legacy_packages())
        self._venv: Optional[EnvironmentInfo] = None
        self.version = launcher_version()
        self.transport = self.make_transport()
        self.far = FarSide(self)
        self._install_reported = False

    def make_transport(self) -> Transport:
        """This type's transport, built from its config (the one thing each type must give)."""
        raise NotImplementedError

    # ------------------------------------------------------------ the transport

    @property
    def remote_dir(self) -> str:
        """remote_dir, absolute on the far side (the transport may ask the serve process, once)."""
        return self.transport.root(self.far)

    @property
    def base_python(self) -> str:
        """The interpreter that exists before `prepare` (which may build a venv from it): serve runs on it."""
        return self.transport.python

    @property
    def python(self) -> str:
        """The interpreter a run gets: the job's venv's (built by `prepare`, or found now), else base_python."""
        found = self.venv()
        return found.python if found else self.base_python

    @property
    def venv_base(self) -> str:
        """The interpreter the job's venv is built from (SLURM: the compute nodes')."""
        return self.base_python

    @property
    def install_env(self) -> dict:
        """The backend's `env:` (mirrors, proxies), for the venv's installer too."""
        return self.config.installer_env()

    def venv(self) -> Optional[EnvironmentInfo]:
        """The job's venv on the far side (None: it asks for none), built there if it is missing."""
        if self._venv is None and self.environment.venv:
            self._venv = venv.ensure(self)
        return self._venv

    @property
    def where(self) -> str:
        return self.transport.where

    @property
    def opens_early(self) -> bool:
        return self.transport.opens_early

    @property
    def open_timeout_s(self) -> float:
        return self.transport.open_timeout_s

    @property
    def stall_timeout_s(self) -> float | None:
        """How long a transfer may move no byte before it is ended (None: never)."""
        return self.transport.stall_timeout_s

    @property
    def commands(self) -> int:
        """Far-side requests this invocation (a poll of a whole sweep is one)."""
        return self.far.requests

    def serve_argv(self, script: str, version: str) -> list[str]:
        return self.transport.serve_argv(script, version)

    def explain_lost(self, err: ChannelLost) -> BackendError:
        return self.transport.explain_lost(err)

    def missing_program_hint(self, program: str) -> str:
        return self.transport.missing_program_hint(program)

    def filesystem(self) -> Any:
        """An fsspec filesystem whose root is remote_dir (for what the protocol does not carry).

        The far side is contacted first, so remote_dir is claimed (or refused) before anything is
        written there through the filesystem."""
        self.far.channel()
        return self.transport.filesystem(self.remote_dir)

    def reconnect(self) -> None:
        """Drop the channel (and the transport's connection) so that the next call opens a fresh one."""
        self.far.reconnect()
        self.transport.reconnect()

    def close(self) -> None:
        self.far.close()

    def is_transport_error(self, err: BaseException) -> bool:
        """Whether `err` says the far side is unreachable (worth a retry), not that something is wrong."""
        return self.transport.is_transport_error(err)

    # ------------------------------------------------------------ built on the protocol

    @property
    def version_dir(self) -> str:
        return posixpath.join(self.remote_dir, "tether", self.version)

    def install_launcher(self) -> bool:
        """Make sure this tether's far-side package is in remote_dir/tether/<version>/; True if copied now.

        The serve process's bootstrap does it on the channel's first open: it claims remote_dir
        (tether/remote/owner.py) and unpacks the package into a temporary folder that is renamed
        into place, so a half-copied package never has the final name.
        """
        self.far.channel()
        copied = self.far.installed_now and not self._install_reported
        self._install_reported = True
        return copied

    def settings(self) -> dict:
        """What the far side needs to know for a check or a launch (env, GPU choice); no secrets in argv."""
        return {"remote_dir": self.remote_dir, "gpus": "none", "env": {}, "python": self.python}

    def prepare(self) -> None:
        """Make the far side ready before its preflight: the job's venv, built once (tether.backends.venv)."""
        self._venv = venv.ensure(self)

    def check(self, require: tuple[str, ...] = ()) -> Report:
        """Preflight: can a run start here?"""
        report = Report(self.name)
        settings = dict(self.settings(), require=list(require))
        found = self._preflight(report, settings)
        if found is None:
            return report
        venv.report(self, report)
        self._report(report, found, settings, require)
        return report

    def _preflight(self, report: Report, settings: dict) -> Optional[Preflight]:
        """The far side's own lines (its Python, remote_dir writable, disk, inodes); None, after a NO
        line, when it did not answer."""
        try:
            found = self.far.check(settings)
        except BackendError as err:
            report.add("python", False, f"{self.python}: {err}")
            return None
        report.add("python", found.python_ok, f"{self.python} is Python {found.python} ({found.executable})"
                   + ("" if found.python_ok else " (3.8 or newer needed)"))
        report.add("writable", found.writable, self.remote_dir)
        report.add("disk", found.free_mb >= self.min_free_mb,
                   f"{found.free_mb} MB free under {self.remote_dir} (want {self.min_free_mb})")
        report.add("inodes", found.free_inodes >= 1000, f"{found.free_inodes} free inodes")
        return found

    def _report(self, report: Report, found: Preflight, settings: dict, require: tuple[str, ...]) -> None:
        """The type-specific lines of a preflight (here: the trainer's modules, the GPUs)."""
        missing = found.missing_modules
        report.add("modules", not missing, f"missing: {', '.join(missing)} (the trainer imports them)"
                   if missing else f"{', '.join(require) or 'none needed'}")
        _gpu_items(report, found, settings)

    def launch(self, run: RunPaths) -> LaunchResult:
        """Start the run detached; never a second copy of a live or finished run."""
        return self.far.start(run.remote_abs, self.settings())

    def launch_many(self, runs: list[RunPaths], name: str) -> dict[str, LaunchResult]:
        """Launch several runs (a sweep's points); a backend with job arrays submits them as one."""
        return {run.run_id: self.launch(run) for run in runs}

    def fetch_policy(self, path: str, size: int) -> str:
        """'' to fetch a manifest file, else why it stays on the far side (max_artifact_mb)."""
        from tether.pipelines.transfer import size_policy

        return size_policy(path, size, self.config.max_artifact_mb)

    def prune(self) -> dict:
        """Remove far-side objects that no run references (only ever in a remote_dir tether owns)."""
        return self.far.prune(self.remote_dir)

    def states(self, runs: list[RunPaths]) -> dict[str, Snapshot]:
        """One snapshot per run, in one far-side round trip."""
        found = self.far.probe([r.remote_abs for r in runs])
        return {r.run_id: found[r.remote_abs] for r in runs}

    def state(self, run: RunPaths) -> Snapshot:
        return self.states([run])[run.run_id]

    def stop(self, run: RunPaths, grace_s: float) -> StopOutcome:
        """SIGTERM, then SIGKILL after grace_s; the outcome says honestly what happened."""
        return self.far.stop(run.remote_abs, grace_s)

    def reopen(self, run: RunPaths) -> dict:
        """Make an ended run (not completed) startable as its next attempt: the far side's outcome, with
        the checkpoint it resumes from (tether.remote.resume.reopen)."""
        return self.far.reopen(run.remote_abs)

    def vouch(self, run: RunPaths, manifest: bytes) -> None:
        """Refuse the far side's PULL_MANIFEST.json (these bytes) unless whoever must vouch for it did
        (an agent's signature); here nothing more is asked of it."""

    @property
    def keep_remote(self) -> bool:
        """Whether `down` leaves the run dir where it is (keep_remote: true over ssh); `down` asks once."""
        return False

    @property
    def teardown_command(self) -> str:
        """The provider's terminate verb that `down` runs on this machine once the run dir is removed ('': none)."""
        return self.config.teardown_command or ""

    @property
    def idle_stop(self) -> Optional[dict]:
        """idle_stop as the far side's launcher takes it ({"after_s", "command"}), or None when it is off."""
        from tether.config import asdict

        return asdict(self.config.idle_stop) if self.config.idle_stop is not None else None

    def teardown(self, run: RunPaths) -> tuple[str, list[str]]:
        """Remove the run dir on the far side (the object store stays); idempotent; never a live run.
        What was done, and the other runs the far side still holds."""
        removal = self.far.remove(run.remote_abs)
        if removal.outcome == "alive":
            raise BackendError(f"run {run.run_id} is still running: `doit stop run={run.run_id}` first")
        done = "already removed: no action needed" if removal.outcome == "absent" else f"removed {run.remote_abs}"
        return done, removal.others


def _gpu_items(report: Report, found: Preflight, settings: dict) -> None:
    """The GPU lines of a preflight: what is there, which one a run would get, torch's kernels per GPU."""
    if settings.get("gpus", "none") == "none":
        return
    if found.gpu_error is not None:
        report.add("gpu", False, found.gpu_error)
    else:
        _gpu_line(report, found)
    torch = found.torch
    if torch and torch.get("torch") and "gpus" in torch:
        _torch_item(report, torch)


def _gpu_line(report: Report, found: Preflight) -> None:
    """The GPUs there are, and which ones a run would get now (each other one with its reason)."""
    visible = found.gpu_env.get("CUDA_VISIBLE_DEVICES")
    if not found.gpus:
        why = found.no_gpu or "nvidia-smi absent or empty"
        gets = f"; a run gets CUDA_VISIBLE_DEVICES={visible} (unchecked)" if visible else \
            ": the trainer runs on the CPU"
        report.add("gpu", True, f"no usable GPU ({why}){gets}")
        return
    listed = "; ".join(_gpu_text(g) for g in found.gpus)
    skipped = "; ".join(f"{i}: {why}" for i, why in sorted(found.gpu_skipped.items(), key=lambda kv: int(kv[0])))
    gets = f"a run gets CUDA_VISIBLE_DEVICES={visible}" if visible else "a run gets no GPU: the trainer runs on the CPU"
    report.add("gpu", True, f"{listed}; {gets}" + (f" (passed over: {skipped})" if skipped else ""))


def _gpu_text(g: dict) -> str:
    """One GPU as the preflight shows it; nvidia-smi's [N/A] reads as unknown."""
    free, total, util = g["memory_free_mb"], g["memory_total_mb"], g["utilization_pct"]
    memory = f"{free}/{total} MB free" if free is not None and total is not None else "free memory unknown ([N/A])"
    busy = f"{util}% busy" if util is not None else "utilization unknown"
    return f"{g['index']}: {g['name']}, {memory}, {busy}"


def _torch_item(report: Report, torch: dict) -> None:
    """torch's kernels: GPUs without them are skipped and named; the host is refused only if no GPU has them."""
    lacking = [v for v in torch["gpus"] if not v["ok"]]
    skipped = "; ".join(f"{v['index']} ({v['capability']}): {v['reason']}" for v in lacking)
    head = f"torch {torch['torch']} (CUDA {torch['cuda']})"
    if len(lacking) == len(torch["gpus"]):
        report.add("torch kernels", False, f"{head} has kernels for no GPU here: {skipped}; install a torch "
                   f"build for these GPUs (pytorch.org/get-started), or set gpus: none to train on the CPU")
    elif lacking:
        usable = ", ".join(str(i) for i in torch["usable"])
        report.add("torch kernels", True, f"{head} has kernels for GPU(s) {usable}; skipped: {skipped}")
    else:
        report.add("torch kernels", True, f"{head} has kernels for these GPUs")
