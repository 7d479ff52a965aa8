"""The far side's entry: claim remote_dir, install this tether there if it is missing, then serve.

Stdlib only, Python >= 3.8, and self-contained: the laptop sends owner.py's source followed by
this one as `python -c SCRIPT REMOTE_DIR VERSION` (tether/backends/farside.py), so one Python
start claims the folder, installs the far-side package from a tar the client streams when asked,
and becomes the serve process. Its first message says where remote_dir is and which Python runs.
"""

import json
import os
import shutil
import struct
import sys
import tarfile
import tempfile

try:  # in the -c script owner.py's source comes first; imported as a module, from the package
    claim  # noqa: B018
except NameError:
    from tether.remote.owner import NotOurs, claim


def _say(out, message):
    out.write(json.dumps(message, sort_keys=True).encode() + b"\n")
    out.flush()


class _Chunks:
    """The client's chunked stream (protocol.py's framing) as a file, for tarfile's `r|`."""

    def __init__(self, source):
        self.source, self.left, self.done = source, 0, False

    def read(self, size=-1):
        parts = []
        while not self.done and size != 0:
            if not self.left:
                (self.left,) = struct.unpack(">I", self.source.read(4))
                self.done = not self.left
                continue
            want = self.left if size < 0 else min(self.left, size)
            data = self.source.read(want)
            if not data:
                raise EOFError("the channel closed during the install")
            parts.append(data)
            self.left -= len(data)
            size = size - len(data) if size > 0 else size
        return b"".join(parts)


def _install(remote_dir, version, source, out):
    """Unpack the package the client streams into tether/<version>/ (a temporary folder renamed into place)."""
    parent = os.path.join(remote_dir, "tether")
    os.makedirs(parent, mode=0o700, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="." + version + ".", dir=parent)
    _say(out, {"install": version})
    stream = _Chunks(source)
    tarfile.open(fileobj=stream, mode="r|").extractall(tmp)
    while stream.read(1 << 16):  # up to the stream's end marker (tarfile stops before it)
        pass
    with open(os.path.join(tmp, "COMPLETE"), "w") as f:
        f.write(version)
    try:
        os.rename(tmp, os.path.join(parent, version))
    except OSError:
        shutil.rmtree(tmp)  # another invocation installed the same version first


def _widen(fd):
    """A 1 MiB pipe instead of Linux's 64 KiB, where the channel is a pipe (best effort)."""
    try:
        import fcntl

        fcntl.fcntl(fd, getattr(fcntl, "F_SETPIPE_SZ", 1031), 1 << 20)
    except (ImportError, OSError):
        pass


def boot(given_dir, version):
    """Claim remote_dir, install if needed, then serve; the protocol's pipes are moved off fds 0 and 1."""
    for fd in (0, 1):
        _widen(fd)
    source, out = os.fdopen(os.dup(0), "rb"), os.fdopen(os.dup(1), "wb")
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # a child that reads stdin gets nothing of ours
    os.dup2(2, 1)  # and a stray print goes to stderr, never into the framing
    remote_dir = os.path.realpath(os.path.expanduser(given_dir))
    try:
        claim(remote_dir, version)  # before anything is written there: tether's own folder, or none
    except NotOurs as err:
        _say(out, {"refused": str(err)})
        return 1
    installed = os.path.exists(os.path.join(remote_dir, "tether", version, "COMPLETE"))
    if not installed:
        _install(remote_dir, version, source, out)
    sys.path.insert(0, os.path.join(remote_dir, "tether", version))
    from tether.remote import serve

    _say(out, {"hello": version, "remote_dir": remote_dir, "installed": not installed,
               "python": "%d.%d.%d" % sys.version_info[:3], "executable": sys.executable})
    return serve.main(source, out)


if __name__ == "__main__":
    sys.exit(boot(sys.argv[1], sys.argv[2]))
