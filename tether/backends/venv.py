"""A backend's side of the job's environment: the far side's venv asked for once, a line while it builds, check's line."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from tether.environment import Wanted
from tether.errors import BackendError
from tether.remote.protocol import EnvironmentInfo

if TYPE_CHECKING:
    from tether.backends.base import Backend, Report


def merged(wanted: Optional[Wanted], legacy_packages: tuple[str, ...]) -> Wanted:
    """The job's environment plus an ssh backend's deprecated `packages:` (in order, once each)."""
    wanted = wanted if wanted is not None else Wanted()
    packages = tuple(dict.fromkeys(wanted.packages + tuple(legacy_packages)))
    return Wanted(wanted.requirements, wanted.requirements_name, packages, wanted.setup)


def _ask(backend: "Backend", build: bool, describe: bool = False, venv: bool = True) -> EnvironmentInfo:
    wanted = backend.environment if venv else Wanted()
    return backend.far.environment(dict(wanted.request(), remote_dir=backend.remote_dir, python=backend.venv_base,
                                        env=backend.install_env, build=build, describe=describe))


def ensure(backend: "Backend") -> Optional[EnvironmentInfo]:
    """The job's venv on the far side, built there now if it is not yet (None: the job asks for none).
    A failed build is one line naming the fix; nothing half-built is left to be trusted."""
    if not backend.environment.venv:
        return None
    found = _ask(backend, build=False)
    if found.outcome == "absent":
        print(f"environment: building {found.venv} from {_what(backend.environment)} with {found.base.get('executable')} "
              f"on {backend.where} (once; this can take minutes)", flush=True)
        found = _ask(backend, build=True)
    if found.outcome == "failed":
        if found.tail:  # the installer's own words, above the one line that names the fix
            print("environment: the installer's last lines:\n" + "\n".join("    " + line for line in found.tail))
        raise BackendError(found.error)
    if found.outcome == "built":
        print(f"environment: built {found.venv} in {found.seconds:g} s ({found.installer})", flush=True)
    return found


def _what(wanted: Wanted) -> str:
    parts = [wanted.requirements_name] if wanted.requirements.strip() else []
    if wanted.packages:
        parts.append(", ".join(wanted.packages))
    return " + ".join(parts)


def report(backend: "Backend", report: "Report") -> None:
    """check's environment line: the run's interpreter (version, path), its torch and CUDA build, the venv."""
    found = _ask(backend, build=False, describe=True, venv=backend.environment.venv)
    if found.outcome == "failed":  # without a venv to build, only SLURM's job_python can be missing here:
        report.add("environment", not backend.environment.venv,  # the compute nodes may have it
                   found.error if backend.environment.venv else f"{found.error} (here; the compute nodes may have it)")
        return
    me = found.interpreter or found.base
    torch = f"torch {me['torch']} (CUDA {me.get('cuda') or 'none: a CPU build'})" if me.get("torch") else "no torch"
    venv = {"none": "no venv (no environment: section)", "reused": f"venv {found.venv} (built, reused by every run)",
            "absent": f"venv {found.venv} (to be built by the next up)"}.get(found.outcome, found.venv)
    report.add("environment", True, f"Python {me['version']} ({me['executable']}); {torch}; {venv}")
