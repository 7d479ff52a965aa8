"""What is copied to the far side: every module of tether/remote/, plus the few files outside it named here."""

from __future__ import annotations

import functools
import hashlib
import os

import tether
from tether.remote.fileio import tar_bytes

PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(tether.__file__)))
FAR_PACKAGE = "tether/remote"
ALSO_SHIPPED = (  # outside tether/remote/, and each on purpose; keep these files tiny
    "tether/__init__.py",  # the package root (imports nothing)
    "tether/trainers/__init__.py",
    "tether/trainers/runtime.py",  # the name users' scripts import the runtime by: a re-export
)


def shipped_files() -> list[str]:
    """Every file the far side gets, sorted, relative to PACKAGE_ROOT: the walk of tether/remote/ and ALSO_SHIPPED.

    The walk takes modules only (`name.py`): no caches, no editor backups or merge leftovers,
    which would ship and change the version for nothing.
    """
    found = list(ALSO_SHIPPED)
    for folder, dirs, files in os.walk(os.path.join(PACKAGE_ROOT, FAR_PACKAGE)):
        dirs[:] = [d for d in dirs if d.isidentifier() and d != "__pycache__"]  # subpackages only
        rel = os.path.relpath(folder, PACKAGE_ROOT).replace(os.sep, "/")
        found += [f"{rel}/{name}" for name in files if name.endswith(".py") and name[:-3].isidentifier()]
    return sorted(found)


@functools.lru_cache(maxsize=1)
def launcher_version() -> str:
    """A short hash of the shipped files: a changed far side gets a new folder there."""
    digest = hashlib.sha256()
    for rel in shipped_files():
        with open(os.path.join(PACKAGE_ROOT, rel), "rb") as f:
            digest.update(rel.encode() + b"\0" + f.read() + b"\0")
    return digest.hexdigest()[:16]


OWNER, BOOTSTRAP = "tether/remote/owner.py", "tether/remote/bootstrap.py"


@functools.lru_cache(maxsize=1)
def bootstrap_script() -> str:
    """`python -c` text of the far side's entry: owner.py's source (the claim), then bootstrap.py's."""
    parts = []
    for rel in (OWNER, BOOTSTRAP):
        with open(os.path.join(PACKAGE_ROOT, rel)) as f:
            parts.append(f.read())
    return parts[0] + "\n" + parts[1].replace("from __future__ import annotations\n", "")


def package_tar() -> bytes:
    """The shipped files as one tar (a few hundred KB), for the bootstrap's install."""
    return tar_bytes([(rel, os.path.join(PACKAGE_ROOT, rel)) for rel in shipped_files()])
