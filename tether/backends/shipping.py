"""What ships to the far side: its package's files, their version hash, and the bootstrap that installs them."""

from __future__ import annotations

import functools
import hashlib
import os
import tether
from tether.remote.fileio import tar_bytes

PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(tether.__file__)))
SHIPPED = (  # what the far side needs: the launcher, the runtime and what they import
    "tether/__init__.py", "tether/remote/__init__.py", "tether/remote/fileio.py",
    "tether/remote/launcher.py", "tether/remote/machine.py", "tether/remote/objects.py",
    "tether/remote/mapped.py", "tether/remote/protocol.py", "tether/remote/serve.py", "tether/remote/bootstrap.py",
    "tether/remote/scheduler.py", "tether/remote/rundir.py", "tether/trainers/__init__.py", "tether/trainers/runtime.py",
    "tether/trainers/torch_classifier.py", "tether/trainers/torch_loop.py",
    "tether/remote/owner.py", "tether/remote/progress.py", "tether/remote/workdir.py",
    "tether/remote/endings.py", "tether/remote/resume.py",
)
OWNER, BOOTSTRAP = "tether/remote/owner.py", "tether/remote/bootstrap.py"


@functools.lru_cache(maxsize=1)
def launcher_version() -> str:
    """A short hash of the shipped files: a changed far side gets a new folder there."""
    digest = hashlib.sha256()
    for rel in SHIPPED:
        with open(os.path.join(PACKAGE_ROOT, rel), "rb") as f:
            digest.update(rel.encode() + b"\0" + f.read() + b"\0")
    return digest.hexdigest()[:16]


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
    return tar_bytes([(rel, os.path.join(PACKAGE_ROOT, rel)) for rel in SHIPPED])
