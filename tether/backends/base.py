"""The backend interface: a filesystem rooted at remote_dir, and one way to run the launcher there.

A backend type implements three things: `filesystem()`, `_execute(argv, stdin)` (the one
choke point every far-side command goes through) and `remote_dir`. Everything else (check,
launch, state, stop, teardown) is built here on the far-side launcher, so every backend
behaves the same and is tested by the same contract suite.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tether.backends.channel import ChannelLost
from tether.backends.farside import FarSide
from tether.shipping import launcher_version
from tether.errors import BackendError
from tether.paths import RunPaths
from tether.remote.protocol import LaunchResult, Preflight, Snapshot, StopOutcome

if TYPE_CHECKING:
    from tether.pipelines.transfer import Watchdog


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
    """One far side. Public methods go through its serve process; errors leave as tether's own."""

    type = ""
    min_free_mb = 500  # below this a run's checkpoints may not fit
    poll_interval_s = 2.0  # watch's slowest poll while nothing happens
    exit_grace_s = 0.0  # how long a vanished run may take to show its final state (shared storage)
    opens_early = False  # start the serve process before the first request needs it (a slow connection)
    open_timeout_s = 120.0  # the far side's first word: its Python started (and the package installed)

    def __init__(self, name: str, config: Any, state_dir: str) -> None:
        self.name, self.config, self.state_dir = name, config, state_dir
        self.version = launcher_version()
        self.far = FarSide(self)
        self._install_reported = False

    # ------------------------------------------------------------ the transport (per type)

    @property
    def remote_dir(self) -> str:
        raise NotImplementedError

    @property
    def python(self) -> str:
        raise NotImplementedError

    @property
    def base_python(self) -> str:
        """The interpreter that exists before `prepare` (which may build a venv from it): serve runs on it."""
        return self.python

    @property
    def where(self) -> str:
        """The far side in a message: user@host, or this machine."""
        return "this machine"

    def serve_argv(self, script: str, version: str) -> list[str]:
        """The command that starts the far side's serve process (`python -c SCRIPT REMOTE_DIR VERSION`)."""
        raise NotImplementedError

    def explain_lost(self, err: ChannelLost) -> BackendError:
        """Why the serve process never said hello, as one line naming the fix."""
        return BackendError(f"the far side's Python ({self.base_python}) did not start: {err}: "
                            f"set python: in the backend's config")

    def missing_program_hint(self, program: str) -> str:
        return "set python: in the backend's config"

    def filesystem(self) -> Any:
        """An fsspec filesystem whose root is remote_dir (for what the protocol does not carry)."""
        raise NotImplementedError

    def reconnect(self) -> None:
        """Drop the channel so that the next call opens a fresh one."""
        self.far.reconnect()

    def close(self) -> None:
        self.far.close()

    def is_transport_error(self, err: BaseException) -> bool:
        """Whether `err` says the far side is unreachable (worth a retry), not that something is wrong."""
        return isinstance(err, BackendError)

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
        """Make the far side ready before its preflight (the ssh backend builds its venv here)."""

    def check(self, require: tuple[str, ...] = ()) -> Report:
        """Preflight: can a run start here?"""
        report = Report(self.name)
        settings = dict(self.settings(), require=list(require))
        try:
            found = self.far.check(settings)
        except BackendError as err:
            report.add("python", False, f"{self.python}: {err}")
            return report
        report.add("python", found.python_ok, f"{self.python} is Python {found.python} ({found.executable})"
                   + ("" if found.python_ok else " (3.8 or newer needed)"))
        report.add("writable", found.writable, self.remote_dir)
        report.add("disk", found.free_mb >= self.min_free_mb,
                   f"{found.free_mb} MB free under {self.remote_dir} (want {self.min_free_mb})")
        report.add("inodes", found.free_inodes >= 1000, f"{found.free_inodes} free inodes")
        self._report(report, found, settings, require)
        return report

    def _report(self, report: Report, found: Preflight, settings: dict, require: tuple[str, ...]) -> None:
        """The type-specific lines of a preflight (here: the trainer's modules, the GPUs)."""
        missing = found.missing_modules
        report.add("modules", not missing, f"missing: {', '.join(missing)} (the trainer imports them)"
                   if missing else f"{', '.join(require) or 'none needed'}")
        _gpu_items(report, found, settings)

    def launch(self, run: RunPaths) -> LaunchResult:
        """Start the run detached; never a second copy of a live or finished run."""
        return self.far.start(run.remote_abs, self.settings())

    launches_arrays = False  # True: a sweep's runs are launched together by launch_many

    def launch_many(self, runs: list[RunPaths], name: str) -> dict[str, LaunchResult]:
        """Launch several runs (a sweep's points); a backend with job arrays submits them as one."""
        return {run.run_id: self.launch(run) for run in runs}

    def fetch_policy(self, path: str, size: int) -> str:
        """'' to fetch a manifest file, else why it stays on the far side."""
        return ""

    @property
    def stall_timeout_s(self) -> float | None:
        """How long a transfer may move no byte before it is ended (None: never; a far side here cannot stall)."""
        return None

    def watchdog(self) -> "Watchdog":
        """What ends this backend's stalled SFTP transfers (a backend over a network sets stall_timeout_s)."""
        from tether.pipelines.transfer import UNWATCHED

        return UNWATCHED

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

    @property
    def keep_remote(self) -> bool:
        """Whether `down` leaves the run dir where it is (ssh's keep_remote: true); `down` asks once."""
        return bool(getattr(self.config, "keep_remote", False))

    def teardown(self, run: RunPaths) -> str:
        """Remove the run dir on the far side (the object store stays); idempotent; never a live run."""
        outcome = self.far.remove(run.remote_abs)
        if outcome == "absent":
            return "already removed: no action needed"
        if outcome == "alive":
            raise BackendError(f"run {run.run_id} is still running: `doit stop run={run.run_id}` first")
        return f"removed {run.remote_abs}"


def _gpu_items(report: Report, found: Preflight, settings: dict) -> None:
    """The GPU lines of a preflight: what is there, which one a run would get, torch's kernels per GPU."""
    if settings.get("gpus", "none") == "none":
        return
    if found.gpu_error is not None:
        report.add("gpu", False, found.gpu_error)
        return
    if not found.gpus:
        why = found.no_gpu or "nvidia-smi absent or empty"
        report.add("gpu", True, f"no usable GPU ({why}): the trainer runs on the CPU")
        return
    listed = "; ".join(_gpu_text(g) for g in found.gpus)
    report.add("gpu", True, f"{listed}; a run gets CUDA_VISIBLE_DEVICES={found.gpu_env.get('CUDA_VISIBLE_DEVICES')}")
    torch = found.torch
    if torch and torch.get("torch") and "gpus" in torch:
        _torch_item(report, torch)


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
