"""Which folders tether owns: a marker file in remote_dir, written when tether creates or adopts it.

Stdlib only, Python >= 3.8, and self-contained (no tether imports): the install step runs this
very source before the launcher exists on the far side (see UNPACK in tether/backends/base.py),
and the launcher imports it, so every backend and every entry decides ownership the same way.
"""

from __future__ import annotations

import json
import os
import posixpath
import re
import socket
import time
from typing import List

MARKER = ".tether-remote"  # JSON: what created or adopted the folder, when, where
# What tether itself writes directly in remote_dir. A remote_dir made by a tether older than the
# marker holds only these (and always `tether/`, the first thing it wrote): it is adopted.
LAYOUT = ("objects", "runs", "slurm", "tether", "venv")
TRANSIENT = (MARKER, ".write-test-")  # a claim in flight, a preflight's write test (a killed one stays)
VERSION = re.compile(r"^\.?[0-9a-f]{16}($|\.)")  # tether/<version>/ and its install temporaries
FIX = ": point remote_dir at "  # in every refusal: how this side tells one from another failure
# Folders that must never be a remote_dir: tether writes objects/ and runs/ in it, and prune and
# down delete under it. A home folder, and any folder that holds one, are refused too. (/tmp is
# not listed: the slurm backend refuses it with its own reason, and claim() a non-empty one.)
SYSTEM = ("/", "/bin", "/boot", "/dev", "/etc", "/home", "/lib", "/lib64", "/mnt", "/media", "/opt",
          "/proc", "/root", "/run", "/sbin", "/srv", "/sys", "/usr", "/var",
          "/Users", "/Volumes", "/private", "/System", "/Library", "/Applications")


class NotOurs(SystemExit):
    """remote_dir holds files tether did not write: exits with the one-line message (status 1)."""


def normal(path: str) -> str:
    """`path` with repeated slashes and `.`/`..` parts folded (`//` and `/./` are `/`, `~/.` is `~`)."""
    home = path == "~" or path.startswith("~/")
    rest = re.sub("/+", "/", "/" + (path[1:] if home else path))
    folded = posixpath.normpath(rest)
    if home:
        return "~" if folded == "/" else "~" + folded
    return folded if path.startswith("/") else folded[1:] or "."


def unsafe(path: str, home: str = "~") -> str:
    """Why `path` (normalised, absolute or ~-based) must not be a remote_dir, or '' if it may."""
    path, home = normal(path), normal(home)
    if path in ("~", home):
        return "the home folder itself"
    if path in SYSTEM:
        return "the filesystem root" if path == "/" else "a system folder"
    if home.startswith(path.rstrip("/") + "/"):
        return "a folder that holds the home folder"
    if posixpath.dirname(path) in ("/home", "/Users"):
        return "someone's home folder"
    return ""


def claim(remote_dir: str, version: str = "") -> None:
    """Make sure tether owns remote_dir: create or adopt it (writing the marker), or refuse it.

    An absent or empty folder is created or adopted; one with only tether's own layout (a
    remote_dir of a tether older than the marker) is adopted; anything else exits with NotOurs.
    """
    marker = os.path.join(remote_dir, MARKER)
    if os.path.isfile(marker):
        return
    why = unsafe(os.path.abspath(remote_dir), os.path.expanduser("~"))
    if why:
        raise NotOurs("remote_dir %s is %s%sa folder of its own, such as ~/.cache/tether"
                      % (remote_dir, why, FIX))
    os.makedirs(remote_dir, mode=0o700, exist_ok=True)
    foreign = _foreign(remote_dir)
    if foreign:
        raise NotOurs("remote_dir %s is not empty and was not created by tether (it holds %s; no %s)%s"
                      "a new or empty folder, or, if tether may own and prune everything in it, create "
                      "an empty file %s" % (remote_dir, ", ".join(foreign[:3]), MARKER, FIX, marker))
    how = "adopted (made by an older tether)" if "tether" in os.listdir(remote_dir) else "created"
    _write_marker(marker, {"by": "tether", "version": version, "how": how, "at": round(time.time(), 3),
                           "host": socket.gethostname(), "pid": os.getpid()})


def _foreign(remote_dir: str) -> List[str]:
    """The entries of remote_dir that tether's own layout does not explain (sorted)."""
    names = sorted(n for n in os.listdir(remote_dir) if not n.startswith(TRANSIENT))
    if not names:
        return []
    tether_dir = os.path.join(remote_dir, "tether")
    versions = os.listdir(tether_dir) if os.path.isdir(tether_dir) and not os.path.islink(tether_dir) else []
    if not versions or not all(VERSION.match(v) for v in versions):
        return names  # without a tether/<version>/ nothing here says tether wrote it
    return [n for n in names if n not in LAYOUT or os.path.islink(os.path.join(remote_dir, n))]


def _write_marker(marker: str, record: dict) -> None:
    """Write the marker atomically (tmp, fsync, rename): a half-written one never has the name."""
    tmp = "%s.tmp-%d" % (marker, os.getpid())
    with open(tmp, "w") as f:
        json.dump(record, f, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, marker)

