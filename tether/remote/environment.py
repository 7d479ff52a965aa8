"""The job's Python environment on the far side: one venv per (interpreter, requirements), built once; setup lines.

Stdlib only, Python >= 3.8 (copied to the far side with the launcher). `ensure` answers the
protocol's `environment` command on every backend alike (local, ssh, and a SLURM login node):

- the venv's key is the SHA-256 of the base interpreter's real path and version, the requirements
  text and the sorted packages; it lives in `remote_dir/venv/<key[:16]>` (short: it is in every
  script's shebang), with `--system-site-packages` (a cluster's own torch stays usable);
- it is built under an exclusive flock on `venv/<key[:16]>.lock`, so runs that start together
  build it once; a READY marker, written last and atomically, is the only proof that it is whole:
  a folder without one (a killed or failed build) is never used and is removed by the next build;
- the installer is `uv` when the far side has it, else `python -m venv` + `python -m pip`; the
  backend's `env:` (mirrors, proxies: PIP_INDEX_URL, ...) is the installer's environment.

`with_setup` wraps a trainer's argv in the job's `setup:` shell lines (local and ssh: SLURM's
job.sh runs them itself and says so with TETHER_SETUP_DONE).
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

from tether.remote.fileio import atomic_write_json, read_json

INSTALL_TIMEOUT_S = 3600  # a torch wheel over a slow mirror takes minutes; a hung index must still end
TAIL_LINES = 15  # of the installer's output, kept in the answer
SETUP_DONE = "TETHER_SETUP_DONE"  # set by a SLURM job.sh that ran the setup lines before the launcher
UV_NAMES = {"PIP_INDEX_URL": "UV_INDEX_URL", "PIP_EXTRA_INDEX_URL": "UV_EXTRA_INDEX_URL",
            "PIP_FIND_LINKS": "UV_FIND_LINKS", "PIP_NO_INDEX": "UV_NO_INDEX"}  # uv does not read pip's names
VERSION_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROBE = ("import json, sys; sys.path.insert(0, %r); from tether.remote.environment import describe; "
         "print(json.dumps(describe()))" % VERSION_DIR)


class BuildFailed(Exception):
    """The installer exited non-zero: `line` for the user, `tail` its last lines."""

    def __init__(self, line: str, tail: List[str]) -> None:
        super().__init__(line)
        self.line, self.tail = line, tail


def ensure(remote_dir: str, python: str, requirements: str = "", requirements_name: str = "",
           packages: Sequence[str] = (), env: Optional[Dict[str, str]] = None, build: bool = True,
           describe: bool = False) -> Dict[str, Any]:
    """The venv for (python, requirements, packages) under remote_dir: reused, built now, or (build=False)
    absent; with nothing asked, outcome "none" (the run uses `python` itself). `describe`: also what the
    run's interpreter says about itself (version, path, torch and its CUDA build)."""
    try:
        base = probe(python)
    except ValueError as err:
        return {"outcome": "failed", "error": str(err)}
    answer = {"outcome": "none", "python": base["executable"], "base": base}  # type: Dict[str, Any]
    if requirements.strip() or packages:
        key = venv_key(base, requirements, packages)
        answer.update(_venv(remote_dir, key, base, requirements, requirements_name, packages, env or {}, build))
    if describe:
        answer["interpreter"] = base if answer["outcome"] == "none" else _probe_or_none(answer)
    return answer


def _probe_or_none(answer: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """What the venv's interpreter says about itself, once it exists."""
    return probe(answer["python"]) if answer["outcome"] in ("built", "reused") else None


def describe() -> Dict[str, Any]:
    """This interpreter: version, path, real path, pip, and torch's version and CUDA build, read from the
    torch/version.py that every torch wheel ships (`__version__`, `cuda`): importing torch takes seconds."""
    found = {"version": "%d.%d.%d" % sys.version_info[:3], "executable": sys.executable,
             "real": os.path.realpath(sys.executable), "full_version": sys.version,
             "has_pip": importlib.util.find_spec("pip") is not None, "torch": None, "cuda": None}
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.origin:
        return found
    try:
        with open(os.path.join(os.path.dirname(spec.origin), "version.py")) as f:
            text = f.read()
    except OSError:
        return dict(found, torch="unknown version")
    for key, name in (("torch", "__version__"), ("cuda", "cuda")):
        match = re.search(r"^%s\s*(?::[^=\n]*)?=\s*['\"]([^'\"]*)['\"]" % name, text, re.M)
        found[key] = match.group(1) if match else None
    return dict(found, torch=found["torch"] or "unknown version")


def probe(python: str) -> Dict[str, Any]:
    """`python` (a name on PATH or a path) describing itself; ValueError naming the fix when it cannot start."""
    if shutil.which(python) and os.path.abspath(shutil.which(python) or "") == os.path.abspath(sys.executable):
        return describe()  # serve's own interpreter: no second Python start
    try:
        done = subprocess.run([python, "-c", PROBE], capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        raise ValueError("environment: interpreter %s is not on the far side: set python: (or job_python:) "
                         "in the backend's config" % python) from None
    if done.returncode != 0:
        said = " ".join(done.stderr.split())[-300:]
        raise ValueError("environment: %s exited %d: %s" % (python, done.returncode, said))
    return json.loads(done.stdout.strip().splitlines()[-1])


def venv_key(base: Dict[str, Any], requirements: str, packages: Sequence[str]) -> str:
    """SHA-256 of what the venv is: the interpreter (real path, version), the requirements, the packages."""
    parts = [base["real"], base["full_version"], requirements, sorted(packages)]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()


def folder_of(remote_dir: str, key: str) -> str:
    return os.path.join(remote_dir, "venv", key[:16])


def _ready(folder: str, key: str) -> Optional[Dict[str, Any]]:
    """The READY marker of a whole venv of this key (None: absent, half-built, or another key's)."""
    marker = read_json(os.path.join(folder, "READY"))
    if isinstance(marker, dict) and marker.get("key") == key and os.path.exists(os.path.join(folder, "bin", "python")):
        return marker
    return None


def _venv(remote_dir: str, key: str, base: Dict[str, Any], requirements: str, requirements_name: str,
          packages: Sequence[str], env: Dict[str, str], build: bool) -> Dict[str, Any]:
    folder = folder_of(remote_dir, key)
    found = {"venv": folder, "key": key, "python": os.path.join(folder, "bin", "python")}
    marker = _ready(folder, key)
    if marker is not None or not build:
        return dict(found, outcome="reused" if marker else "absent", installer=(marker or {}).get("installer", ""))
    os.makedirs(os.path.dirname(folder), mode=0o700, exist_ok=True)
    with open(folder + ".lock", "a") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)  # another run building it: wait, then reuse its venv
        marker = _ready(folder, key)
        if marker is not None:
            return dict(found, outcome="reused", installer=marker.get("installer", ""))
        started = time.time()
        try:
            installer = _build(folder, base, requirements, packages, env)
        except BuildFailed as err:
            shutil.rmtree(folder, ignore_errors=True)  # never trusted; nothing half-built left behind
            return dict(found, outcome="failed", error=_fix(err.line, requirements_name, packages), tail=err.tail)
        seconds = round(time.time() - started, 1)
        atomic_write_json(os.path.join(folder, "READY"), {  # last: the one proof the venv is whole
            "key": key, "python": base["real"], "version": base["version"], "installer": installer,
            "requirements_sha256": hashlib.sha256(requirements.encode()).hexdigest(),
            "packages": sorted(packages), "built_at": round(time.time(), 3), "seconds": seconds})
    return dict(found, outcome="built", installer=installer, seconds=seconds)


def _build(folder: str, base: Dict[str, Any], requirements: str, packages: Sequence[str],
           env: Dict[str, str]) -> str:
    """Build the venv in `folder` (any earlier remains removed first); the installer's name."""
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder, mode=0o700)
    wanted = os.path.join(folder, "requirements.txt")
    with open(wanted, "w") as f:
        f.write(requirements)
    uv = find_uv()
    steps = build_argv(folder, base, wanted if requirements.strip() else None, packages, uv)
    environ = installer_env(env, uv is not None)
    for argv in steps:
        _install_step(argv, environ, "uv" if uv else "pip")
    return "uv" if uv else "pip"


def find_uv() -> Optional[str]:
    """uv on the far side's PATH (or where its installer puts it), else None."""
    for candidate in (shutil.which("uv"), os.path.expanduser("~/.local/bin/uv"), os.path.expanduser("~/.cargo/bin/uv")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def build_argv(folder: str, base: Dict[str, Any], requirements: Optional[str], packages: Sequence[str],
               uv: Optional[str]) -> List[List[str]]:
    """The commands that build the venv: uv's two, or venv + pip. A base that has pip lends it to the
    venv (--without-pip: seconds saved; its site packages are visible), else ensurepip seeds one."""
    wanted = (["-r", requirements] if requirements else []) + list(packages)
    python = os.path.join(folder, "bin", "python")
    if uv:
        return [[uv, "venv", "--python", base["executable"], "--system-site-packages", folder],
                [uv, "pip", "install", "--python", python, *wanted]]
    venv = [base["executable"], "-m", "venv", "--system-site-packages", folder]
    if base.get("has_pip"):
        venv.insert(-1, "--without-pip")
    return [venv, [python, "-m", "pip", "install", "--disable-pip-version-check", "--no-input", *wanted]]


def installer_env(env: Dict[str, str], uv: bool) -> Dict[str, str]:
    """The installer's environment: ours plus the backend's env: (for uv, pip's index names as uv's too)."""
    environ = dict(os.environ, **{str(k): str(v) for k, v in env.items()})
    environ.pop("PYTHONPATH", None)  # tether's own copy must not shadow what pip sees installed
    if uv:
        for pip_name, uv_name in UV_NAMES.items():
            if pip_name in environ and uv_name not in environ:
                environ[uv_name] = "true" if uv_name == "UV_NO_INDEX" else environ[pip_name]
    return environ


def _install_step(argv: List[str], environ: Dict[str, str], installer: str) -> None:
    """Run one build command; BuildFailed with its last lines when it fails."""
    try:
        done = subprocess.run(argv, env=environ, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, timeout=INSTALL_TIMEOUT_S)
    except OSError as err:
        raise BuildFailed("%s could not start: %s" % (installer, err), []) from None
    except subprocess.TimeoutExpired:
        raise BuildFailed("%s ran past %d s" % (installer, INSTALL_TIMEOUT_S), []) from None
    if done.returncode == 0:
        return
    lines = [line for line in done.stdout.decode(errors="replace").splitlines() if line.strip()]
    raise BuildFailed(failure_line(installer, argv, lines), lines[-TAIL_LINES:])


def failure_line(installer: str, argv: List[str], lines: List[str]) -> str:
    """One line: what could not be installed and the installer's own reason (its last error line)."""
    text = "\n".join(lines)
    named = re.search(r"(?:No matching distribution found for|satisfies the requirement|"
                      r"Because (?:there is no version of )?)\s*([^\s(,]+)", text)
    errors = [line.strip() for line in lines if re.match(r"\s*(ERROR\b|error\b|×)", line)]
    reason = (errors or lines or ["exited without a word"])[-1].strip()
    if "venv" in argv[1:3] and not named:
        return "%s could not create the venv (%s)" % (installer, reason)
    return "%s could not install %s (%s)" % (installer, named.group(1) if named else "the requirements", reason)


def _fix(line: str, requirements_name: str, packages: Sequence[str]) -> str:
    """The user's line: `environment: <what failed>: fix <the file or key that asked for it>`."""
    names = ([requirements_name] if requirements_name else []) + (["environment.packages"] if packages else [])
    return "environment: %s: fix %s" % (line, " or ".join(names) or "the environment")


# ---------------------------------------------------------------- setup lines around the trainer


def setup_script(lines: Sequence[str]) -> str:
    """The setup lines as one /bin/sh script that ends in `exec "$@"`; a failing line ends it, named."""
    guarded = ["{ %s\n} || { echo \"tether: setup line failed (exit $?): \"%s >&2; exit 1; }" % (line, shlex.quote(line))
               for line in lines]
    return "\n".join(guarded + ['exec "$@"'])


def with_setup(argv: List[str], spec: Dict[str, Any]) -> List[str]:
    """`argv` run after the job's setup lines (none, or already run by a SLURM job.sh: `argv` itself)."""
    lines = (spec.get("environment") or {}).get("setup") or []
    if not lines or os.environ.get(SETUP_DONE) == "1":
        return argv
    return ["/bin/sh", "-c", setup_script(lines), "tether-setup"] + list(argv)


def _main() -> None:  # pragma: no cover - by hand on a far side: python -m tether.remote.environment PYTHON
    print(json.dumps(probe(sys.argv[1] if len(sys.argv) > 1 else sys.executable), indent=2))


if __name__ == "__main__":
    _main()
