"""The backend interface: a filesystem rooted at remote_dir, and one way to run the launcher there.

A backend type implements three things: `filesystem()`, `_execute(argv, stdin)` (the one
choke point every far-side command goes through) and `remote_dir`. Everything else (check,
launch, state, stop, teardown) is built here on the far-side launcher, so every backend
behaves the same and is tested by the same contract suite.
"""

from __future__ import annotations

import json
import os
import posixpath
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tether.errors import BackendError, RemoteCommandError
from tether.paths import RunPaths
from tether.remote import owner
from tether.remote.fileio import tar_bytes
from tether.shipping import PACKAGE_ROOT, launcher_version, shipped_files

if TYPE_CHECKING:
    from tether.pipelines.transfer import Watchdog


OWNER = "tether/remote/owner.py"  # its source heads the install script: see UNPACK
UNPACK = """
remote_dir, version = sys.argv[1], sys.argv[2]
claim(remote_dir, version)  # before anything is written there: tether's own folder, or none
import shutil, tarfile, tempfile
parent = os.path.join(remote_dir, "tether")
os.makedirs(parent, mode=0o700, exist_ok=True)
tmp = tempfile.mkdtemp(prefix="." + version + ".", dir=parent)
tarfile.open(fileobj=sys.stdin.buffer, mode="r|").extractall(tmp)
open(os.path.join(tmp, "COMPLETE"), "w").write(version)
try:
    os.rename(tmp, os.path.join(parent, version))
except OSError:
    shutil.rmtree(tmp)  # another invocation installed the same version first
"""


def unpack_script() -> str:
    """The install script: owner.py's source (the ownership check, before the launcher is there), then UNPACK."""
    with open(os.path.join(PACKAGE_ROOT, OWNER)) as f:
        return f.read() + "\nimport sys\n" + UNPACK


def raise_refusal(err: RemoteCommandError) -> None:
    """Raise the far side's one-line refusal of a remote_dir tether does not own, if that is why `err` happened."""
    lines = [line for line in err.stderr_tail.splitlines() if owner.FIX in line and line.startswith("remote_dir ")]
    if lines:
        raise BackendError(lines[-1]) from None


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
    """One far side. Public methods wrap the transport; errors leave as tether's own."""

    type = ""
    min_free_mb = 500  # below this a run's checkpoints may not fit
    poll_interval_s = 2.0  # watch's slowest poll while nothing happens
    exit_grace_s = 0.0  # how long a vanished run may take to show its final state (shared storage)

    def __init__(self, name: str, config: Any, state_dir: str) -> None:
        self.name, self.config, self.state_dir = name, config, state_dir
        self.version = launcher_version()
        self._installed = False

    # ------------------------------------------------------------ the transport (per type)

    @property
    def remote_dir(self) -> str:
        raise NotImplementedError

    @property
    def python(self) -> str:
        raise NotImplementedError

    @property
    def base_python(self) -> str:
        """The interpreter that exists before `prepare` (which may build a venv from it)."""
        return self.python

    def filesystem(self) -> Any:
        """An fsspec filesystem whose root is remote_dir."""
        raise NotImplementedError

    def _execute(self, argv: list[str], stdin: bytes = b"") -> bytes:
        """Run `argv` on the far side; its stdout, or RemoteCommandError on a non-zero exit."""
        raise NotImplementedError

    def reconnect(self) -> None:
        """Drop the connection so that the next call opens a fresh one (a no-op where there is none)."""

    def is_transport_error(self, err: BaseException) -> bool:
        """Whether `err` says the far side is unreachable (worth a retry), not that something is wrong."""
        return isinstance(err, BackendError)

    # ------------------------------------------------------------ built on the launcher

    @property
    def version_dir(self) -> str:
        return posixpath.join(self.remote_dir, "tether", self.version)

    def launcher_bytes(self, command: str, *args: str, stdin: bytes = b"") -> bytes:
        """Run one launcher command on the far side; its raw stdout.

        The launcher is stdlib only, so it starts with -S (no site-packages scan: a third off
        every far-side command here); `check` alone looks for the trainer's packages.
        """
        flags = [] if command == "check" else ["-S"]
        launcher = f"{self.version_dir}/tether/remote/launcher.py"
        return self._execute([self.python, *flags, launcher, command, *args], stdin)

    def launcher(self, command: str, *args: str, stdin: bytes = b"") -> Any:
        """Run one launcher command on the far side and decode its JSON answer.

        The first call of an invocation makes sure this version of the launcher is there (one
        stat), so `status` or `stop` work from a newer tether than the one that launched the run.
        """
        if not self._installed:
            self.install_launcher()
        out = self.launcher_bytes(command, *args, stdin=stdin).decode(errors="replace")
        try:
            return json.loads(out.strip().splitlines()[-1])
        except (json.JSONDecodeError, IndexError):
            raise BackendError(f"the launcher's {command!r} answered {out[-300:]!r}, not JSON: "
                               f"run `doit check` to see what the far side lacks")

    def install_launcher(self) -> bool:
        """Copy the launcher to remote_dir/tether/<version>/ unless it is there; True if copied.

        One command: a tar on stdin, unpacked by the far side's Python into a temporary folder
        that is renamed into place, so a half-copied launcher never has the final name. It first
        claims remote_dir (tether/remote/owner.py): a folder tether did not create is refused.
        """
        try:
            self.filesystem().info(f"tether/{self.version}/COMPLETE")
            self._installed = True
            return False
        except FileNotFoundError:
            pass
        archive = tar_bytes([(rel, os.path.join(PACKAGE_ROOT, rel)) for rel in shipped_files()])
        try:
            self._execute([self.base_python, "-c", unpack_script(), self.remote_dir, self.version], archive)
        except RemoteCommandError as err:
            raise_refusal(err)
            raise
        self._installed = True
        return True

    def settings(self) -> dict:
        """What the far side needs to know for a check or a launch (env, GPU choice); no secrets in argv."""
        return {"remote_dir": self.remote_dir, "gpus": "none", "env": {}}

    def prepare(self) -> None:
        """Make the far side ready before its preflight (the ssh backend builds its venv here)."""

    def check(self, require: tuple[str, ...] = ()) -> Report:
        """Preflight: can a run start here? (The launcher must be installed first.)"""
        report = Report(self.name)
        settings = dict(self.settings(), require=list(require))
        try:
            found = self.launcher("check", stdin=json.dumps(settings).encode())
        except BackendError as err:
            report.add("python", False, f"{self.python}: {err}")
            return report
        report.add("python", found["python_ok"], f"{self.python} is Python {found['python']} ({found['executable']})"
                   + ("" if found["python_ok"] else " (3.8 or newer needed)"))
        report.add("writable", found["writable"], self.remote_dir)
        report.add("disk", found["free_mb"] >= self.min_free_mb,
                   f"{found['free_mb']} MB free under {self.remote_dir} (want {self.min_free_mb})")
        report.add("inodes", found["free_inodes"] >= 1000, f"{found['free_inodes']} free inodes")
        self._report(report, found, settings, require)
        return report

    def _report(self, report: Report, found: dict, settings: dict, require: tuple[str, ...]) -> None:
        """The type-specific lines of a preflight (here: the trainer's modules, the GPUs)."""
        missing = found["missing_modules"]
        report.add("modules", not missing, f"missing: {', '.join(missing)} (the trainer imports them)"
                   if missing else f"{', '.join(require) or 'none needed'}")
        _gpu_items(report, found, settings)

    def launch(self, run: RunPaths) -> dict:
        """Start the run detached; never a second copy of a live or finished run."""
        return self.launcher("start", run.remote_abs, stdin=json.dumps(self.settings()).encode())

    launches_arrays = False  # True: a sweep's runs are launched together by launch_many

    def launch_many(self, runs: list[RunPaths], name: str) -> dict[str, dict]:
        """Launch several runs (a sweep's points); a backend with job arrays submits them as one."""
        return {run.run_id: self.launch(run) for run in runs}

    def fetch_policy(self, path: str, size: int) -> str:
        """'' to fetch a manifest file, else why it stays on the far side."""
        return ""

    def watchdog(self) -> "Watchdog":
        """What ends this backend's stalled transfers (a backend over a network sets stall_timeout_s)."""
        from tether.pipelines.transfer import UNWATCHED

        return UNWATCHED

    def prune(self) -> dict:
        """Remove far-side objects that no run references (only ever in a remote_dir tether owns)."""
        try:
            return self.launcher("prune", self.remote_dir)
        except RemoteCommandError as err:
            raise_refusal(err)
            raise

    def states(self, runs: list[RunPaths]) -> dict[str, dict]:
        """One snapshot per run, in one far-side round trip."""
        found = self.launcher("probe", *[r.remote_abs for r in runs])
        return {r.run_id: found[r.remote_abs] for r in runs}

    def state(self, run: RunPaths) -> dict:
        return self.states([run])[run.run_id]

    def stop(self, run: RunPaths, grace_s: float) -> dict:
        """SIGTERM, then SIGKILL after grace_s; the outcome says honestly what happened."""
        return self.launcher("stop", run.remote_abs, str(grace_s))

    def teardown(self, run: RunPaths) -> str:
        """Remove the run dir on the far side (the object store stays); idempotent; never a live run."""
        fs = self.filesystem()
        try:
            fs.info(run.remote)
        except FileNotFoundError:
            return "already removed: no action needed"
        if self.state(run)["alive"]:
            raise BackendError(f"run {run.run_id} is still running: `doit stop run={run.run_id}` first")
        fs.rm(run.remote, recursive=True)
        return f"removed {run.remote_abs}"


def _gpu_items(report: Report, found: dict, settings: dict) -> None:
    """The GPU lines of a preflight: what is there, which one a run would get, torch's kernels per GPU."""
    if settings.get("gpus", "none") == "none":
        return
    if "gpu_error" in found:
        report.add("gpu", False, found["gpu_error"])
        return
    if not found.get("gpus"):
        why = found.get("no_gpu") or "nvidia-smi absent or empty"
        report.add("gpu", True, f"no usable GPU ({why}): the trainer runs on the CPU")
        return
    listed = "; ".join(_gpu_text(g) for g in found["gpus"])
    report.add("gpu", True, f"{listed}; a run gets CUDA_VISIBLE_DEVICES={found['gpu_env'].get('CUDA_VISIBLE_DEVICES')}")
    torch = found.get("torch")
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
