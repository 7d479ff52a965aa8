"""Moving bytes for a pull and a push: tar streams, resumable downloads checked as they land, one tqdm bar."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import os
import sys
from typing import Any, Callable, Iterable, Iterator, Optional, TypeVar

from tether import manifest
from tether.errors import ManifestError, RunError
from tether.manifest import PART
from tether.remote.fileio import CHUNK, sha256_file

SMALL = 4 << 20  # files up to this size travel in tar batches: one round trip per batch, not three per file
BATCH = 64 << 20  # bytes per batch: memory stays bounded whatever the total
TAR_BUFFER = 1 << 16  # tarfile's stream buffer: 64 KiB moves a GiB 2x faster than its 10 KiB default
LARGE = 1 << 30  # a file above this is announced before it is pulled: it may fill the disk or take hours
T = TypeVar("T")


def size_policy(path: str, size: int, max_artifact_mb: Optional[float]) -> str:
    """Why an artifact or checkpoint above max_artifact_mb stays on the far side ('' to fetch it)."""
    if max_artifact_mb is None or not path.startswith(("artifacts/", "checkpoints/")):
        return ""
    if size > max_artifact_mb * (1 << 20):
        return f"{size / (1 << 20):.1f} MB is above max_artifact_mb ({max_artifact_mb:g})"
    return ""


def large_warning(path: str, size: int) -> str:
    """The line that announces a file above LARGE ('' below): it may fill the disk or take hours."""
    if size <= LARGE:
        return ""
    limit = "; set max_artifact_mb to leave such files on the far side" \
        if path.startswith(("artifacts/", "checkpoints/")) else ""
    return f"pulling {path} ({size / (1 << 30):.1f} GiB){limit}"


def far_side_changed(run_id: str, path: str, far_path: str, want: tuple[int, str],
                     got: Optional[tuple[int, str]]) -> ManifestError:
    """The far side's own copy differs from what it sealed (got None: is gone): pulling again fetches the same."""
    found = "is gone (removed after sealing)" if got is None else \
        f"no longer matches its sealed manifest (changed after sealing): it has {got[0]} bytes, sha256 {got[1][:12]}"
    return ManifestError(
        f"the far side's {path} {found}; the manifest says {want[0]} bytes, sha256 {want[1][:12]}. "
        f"Pulling again cannot fix that: put the sealed file back at {far_path}, then `doit pull verify run={run_id}`; "
        f"or, if it is lost, run the job again as a new run (change its code, data or trainer settings)")


def batches(items: Iterable[T], size: Callable[[T], int]) -> list[list[T]]:
    """Consecutive groups of at most BATCH bytes each (a larger item alone)."""
    groups: list[list[T]] = [[]]
    total = 0
    for item in items:
        if groups[-1] and total + size(item) > BATCH:
            groups.append([])
            total = 0
        groups[-1].append(item)
        total += size(item)
    return [g for g in groups if g]


def unpack(data: bytes, expected: dict[str, tuple[str, int, str]], progress: Any,
           changed: Callable[[str, tuple[int, str], tuple[int, str]], Exception]) -> None:
    """Write each member of a tar to its local place (path, bytes, sha256), checked, via `.part`.

    The far side's `send` reads its files as they are now, so a member that does not match is
    the far side's copy changed after sealing: `changed(path, wanted, got)` is raised. Each file
    is hashed from the bytes written, and remembered, so a verify in this process need not read it.
    """
    import tarfile  # only a pull needs it

    with tarfile.open(fileobj=io.BytesIO(data), mode="r") as tar:
        for member in tar.getmembers():
            if member.name not in expected or not member.isfile():
                raise ManifestError(f"the far side sent {member.name!r}, which was not asked for")
            local, size, sha256 = expected.pop(member.name)
            os.makedirs(os.path.dirname(local), exist_ok=True)
            with tar.extractfile(member) as source:
                body = source.read()
            got = (len(body), hashlib.sha256(body).hexdigest())
            if got != (size, sha256):
                raise changed(member.name, (size, sha256), got)
            with open(local + PART, "wb") as out:
                out.write(body)
            os.replace(local + PART, local)
            manifest.remember(local, sha256)
            progress.update(member.size)
    if expected:
        raise ManifestError(f"the far side did not send {sorted(expected)[:5]}: run the pull again")


def tar_into(out: Any, files: list[tuple[str, str]], moved: Callable[[int], None]) -> None:
    """Write the local files [(name in the archive, path)] to the file `out` as one tar stream, in
    1 MiB pieces: memory stays flat however large a file is; `moved(n)` after each file."""
    import tarfile  # only a push needs it

    with tarfile.open(fileobj=out, mode="w|", bufsize=TAR_BUFFER) as tar:
        for name, local in files:
            with open(local, "rb") as f:
                info = tar.gettarinfo(arcname=name, fileobj=f)
                tar.addfile(info, _Counted(f, moved))


class _Counted:
    """A file being read, telling `moved` of every piece (a large file's bar moves as it travels)."""

    def __init__(self, f: Any, moved: Callable[[int], None]) -> None:
        self.f, self.moved = f, moved

    def read(self, size: int = -1) -> bytes:
        data = self.f.read(size)
        self.moved(len(data))
        return data

    def readinto(self, buffer: Any) -> int:
        n = self.f.readinto(buffer)
        self.moved(n)
        return n


def bar(total: int, what: str) -> Any:
    """A bytes progress bar on stderr (silent when stderr is not a terminal and total is small)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=what, unit="B", unit_scale=True, unit_divisor=1024,
                file=sys.stderr, leave=False, disable=None)


def matches(path: str, size: int, sha256: str) -> bool:
    """Whether the local file at `path` has exactly this size and SHA-256."""
    try:
        if os.path.getsize(path) != size:
            return False
    except FileNotFoundError:
        return False
    return sha256_file(path)[0] == sha256


def get_resumable(read_from: Callable[[int, Callable[[bytes], None]], None], local: str, size: int, sha256: str,
                  progress: Any, changed: Callable[[tuple[int, str], Optional[tuple[int, str]]], Exception]) -> None:
    """Download into `local`.part, continuing a partial one, check size and SHA-256, then rename.

    `read_from(offset, write)` streams the far file from `offset`, in order, into `write`. The
    bytes are hashed as they land (a continued part is hashed first). A continued part that does
    not add up is fetched once more from zero; a whole fresh copy that does not is the far side's
    file changed after sealing: `changed(wanted, got)` is raised.
    """
    part = local + PART
    os.makedirs(os.path.dirname(local), exist_ok=True)
    have = os.path.getsize(part) if os.path.exists(part) else 0
    if have > size:  # not a prefix of this file (another version's, or damaged): never continued
        progress.write(f"discarding {os.path.basename(part)}: {have} bytes, longer than the {size} bytes the "
                       f"manifest lists; fetching it whole", file=sys.stdout)
        os.unlink(part)
        have = 0
    if have:
        progress.write(f"resuming {os.path.basename(local)} at {have / (1 << 20):.1f} of {size / (1 << 20):.1f} MiB",
                       file=sys.stdout)
    digest = hashlib.sha256()
    try:
        with open(part, "ab" if have else "wb") as dst:
            if have:
                with open(part, "rb") as before:
                    for chunk in iter(lambda: before.read(CHUNK), b""):
                        digest.update(chunk)
                progress.update(have)

            def write(chunk: bytes) -> None:
                dst.write(chunk)
                digest.update(chunk)
                progress.update(len(chunk))

            read_from(have, write)
            dst.flush()
            os.fsync(dst.fileno())
    except FileNotFoundError:  # the far side's copy was removed after sealing
        raise changed((size, sha256), None)
    got = (os.path.getsize(part), digest.hexdigest())
    if got != (size, sha256):
        os.unlink(part)
        if not have:
            raise changed((size, sha256), got)
        progress.update(-got[0])  # the continued part was stale (the far file changed, then was put back?)
        return get_resumable(read_from, local, size, sha256, progress, changed)
    os.replace(part, local)
    manifest.remember(local, sha256)


@contextlib.contextmanager
def room_for(run_id: str, folder: str) -> Iterator[None]:
    """A full local disk during a pull is one line naming the place and the fix; partial files stay `.part`
    (never accepted: a file is renamed into place only once its size and SHA-256 match)."""
    try:
        yield
    except OSError as err:
        if err.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        what = f" ({err.filename})" if err.filename else ""
        raise RunError(f"{run_id}: pull stopped: no space left on device in {folder}{what}; free space there, "
                       f"then `doit pull` continues where it stopped") from None

