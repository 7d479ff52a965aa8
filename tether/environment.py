"""The job's `environment:` section: requirements file, packages and setup lines; what a backend asks of it.

`Environment` is the section as written; `Wanted` is what the far side is asked to build (the
requirements file's text travels in the request: the venv is built by `up`, before any run's push,
and is keyed by that text, not by a run). The far side builds it (tether/remote/environment.py).
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from typing import Optional

INCLUDES = re.compile(r"^\s*(-r|-c|--requirement|--constraint)(\s|=|$)")  # a file the far side would not have


@dataclass(frozen=True)
class Environment:
    """environment: {requirements: FILE, packages: [...], setup: [...]}: the far side's venv, and the shell
    lines run before the trainer (`module load cuda/12.4`)."""

    requirements: Optional[str] = None  # a project file, relative to the config's folder
    packages: tuple[str, ...] = ()
    setup: tuple[str, ...] = ()

    def problems(self, root: str) -> list[str]:
        """Errors, each one line naming the fix."""
        found = [f"environment.packages: {p!r} is not a package: give one requirement per entry, e.g. torch>=2.1"
                 for p in self.packages if not p.strip() or "\n" in p or p.strip().startswith("-")]
        found += ["environment.setup: an empty line: give a shell line (e.g. module load cuda/12.4) or remove it"
                  for line in self.setup if not line.strip()]
        if self.requirements is not None:
            found += _file_problems(self.requirements, root)
        return found


def _file_problems(path: str, root: str) -> list[str]:
    """A requirements file inside the project, readable as text, including no other file."""
    if os.path.isabs(path) or ".." in path.replace("\\", "/").split("/"):
        return [f"environment.requirements {path!r} leaves the project folder {root}: name a file in it"]
    full = os.path.join(root, path)
    if not os.path.isfile(full):
        return [f"environment.requirements {path!r} does not exist (paths are relative to {root}): "
                f"create it, or remove the key"]
    try:
        with open(full, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as err:
        return [f"environment.requirements {path!r} cannot be read as UTF-8 text ({err}): save it as UTF-8"]
    included = [line.strip() for line in text.splitlines() if INCLUDES.match(line)]
    return [f"environment.requirements {path!r} includes another file ({line}): the far side gets this file "
            f"alone; copy those lines into it" for line in included[:1]]


@dataclass(frozen=True)
class Wanted:
    """What the far side builds and runs: the requirements' text and name, the packages, the setup lines."""

    requirements: str = ""
    requirements_name: str = ""
    packages: tuple[str, ...] = ()
    setup: tuple[str, ...] = ()

    @property
    def venv(self) -> bool:
        """Whether a venv is asked for (setup lines alone need none)."""
        return bool(self.requirements.strip() or self.packages)

    def request(self) -> dict:
        return {"requirements": self.requirements, "requirements_name": self.requirements_name,
                "packages": list(self.packages)}


def wanted(env: Environment, root: str, legacy_packages: tuple[str, ...] = ()) -> Wanted:
    """The section as a request: the requirements file read now (checked by config.load), plus the
    packages an ssh backend still lists under its deprecated `packages:`."""
    text = ""
    if env.requirements:
        with open(os.path.join(root, env.requirements), encoding="utf-8") as f:
            text = f.read()
    packages = tuple(dict.fromkeys(env.packages + tuple(legacy_packages)))  # in order, once each
    return Wanted(text, env.requirements or "", packages, env.setup)


def identity(env: Environment, root: str) -> Optional[dict]:
    """What of the section makes a run's identity (run.json's `environment`): the requirements file's
    SHA-256, the packages and the setup lines; None without the section, so older run ids stay."""
    if env == Environment():
        return None
    found: dict = {"packages": list(env.packages), "setup": list(env.setup)}
    if env.requirements:
        with open(os.path.join(root, env.requirements), "rb") as f:
            found.update(requirements=env.requirements, requirements_sha256=hashlib.sha256(f.read()).hexdigest())
    return found


def differs(recorded: Optional[dict], env: Environment, root: str) -> str:
    """Why this job's environment is not the one a recorded run had ('' when it is): a reproduction
    must install what the run installed."""
    here = identity(env, root)
    if (recorded or None) == here:
        return ""
    if here is None or recorded is None:
        return "the job here has %s environment: section" % ("no" if here is None else "an")
    changed = [k for k in sorted(set(here) | set(recorded)) if here.get(k) != recorded.get(k)]
    return "its environment differs here (%s)" % ", ".join(changed)
