"""Every local and far-side path of a run, derived in one place; run ids validated first."""

from __future__ import annotations

import os
import posixpath
import re
import time
from dataclasses import dataclass

from tether.errors import RunError

RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
PHASES = ("up", "push", "launch", "watch", "pull", "verify", "down")


def check_run_id(run_id: str) -> str:
    """`run_id` if it is safe in a path and a shell, else a RunError naming the rule."""
    if not isinstance(run_id, str) or not RUN_ID_RE.fullmatch(run_id) or ".." in run_id:
        raise RunError("invalid run id %r: use letters, digits and '._-', start with a letter or "
                       "digit, at most 64 characters (`ls .tether/runs` lists the runs known here)" % (run_id,))
    return run_id


def mint_run_id(name: str, job_hash: str, now: float | None = None) -> str:
    """`<name>-<UTC time>-<short hash>` for a new run."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now if now is not None else time.time()))
    return check_run_id(f"{name}-{stamp}-{job_hash[:8]}")


@dataclass(frozen=True)
class RunPaths:
    """Where one run's files live: `local_*` on this machine, `remote_*` relative to remote_dir."""

    run_id: str
    state_dir: str  # this machine's .tether folder (absolute)
    remote_dir: str  # the backend's remote_dir, absolute on the far side
    folder: str = ""  # a run folder kept elsewhere (a recorded run that `repro` reads); default under state_dir

    def __post_init__(self) -> None:
        check_run_id(self.run_id)

    @property
    def local(self) -> str:
        return self.folder or os.path.join(self.state_dir, "runs", self.run_id)

    @property
    def files(self) -> str:
        """Where pulled files land: a folder of their own, so the roster check is exact."""
        return os.path.join(self.local, "files")

    def pulled(self, relpath: str) -> str:
        """A pulled file's place here; `relpath` must stay inside the run folder."""
        if not relpath or relpath.startswith("/") or ".." in relpath.split("/") or "\\" in relpath:
            raise RunError("refusing path %r from the manifest: it leaves the run folder" % relpath)
        return os.path.join(self.files, *relpath.split("/"))

    def stamp(self, phase: str) -> str:
        return os.path.join(self.local, f"{phase}.json")

    @property
    def run_json(self) -> str:
        return os.path.join(self.local, "run.json")

    @property
    def manifest(self) -> str:
        return os.path.join(self.local, "PULL_MANIFEST.json")

    @property
    def verified(self) -> str:
        return os.path.join(self.local, "PULL_VERIFIED.json")

    @property
    def remote(self) -> str:
        """The run dir relative to remote_dir (for the filesystem, which is rooted there)."""
        return f"runs/{self.run_id}"

    def remote_file(self, relpath: str) -> str:
        return posixpath.join(self.remote, relpath)

    @property
    def remote_abs(self) -> str:
        """The run dir as an absolute far-side path (for the launcher's command line)."""
        return posixpath.join(self.remote_dir, self.remote)


def runs_dir(state_dir: str) -> str:
    return os.path.join(state_dir, "runs")
