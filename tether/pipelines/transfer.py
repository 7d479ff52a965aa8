"""Moving bytes through an fsspec filesystem: atomic uploads, resumable downloads, one tqdm bar."""

from __future__ import annotations

import io
import os
import sys
import tarfile
import uuid
from typing import Any, Callable, Iterable, TypeVar

from tether.errors import ManifestError
from tether.remote.fileio import CHUNK, sha256_file

SMALL = 4 << 20  # files up to this size travel in tar batches: one round trip per batch, not three per file
BATCH = 64 << 20  # bytes per batch: memory stays bounded whatever the total
T = TypeVar("T")


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


def unpack(data: bytes, expected: dict[str, tuple[str, int, str]], progress: Any) -> None:
    """Write each member of a tar to its local place (path, bytes, sha256), checked, via `.part`."""
    with tarfile.open(fileobj=io.BytesIO(data), mode="r") as tar:
        for member in tar.getmembers():
            if member.name not in expected or not member.isfile():
                raise ManifestError(f"the far side sent {member.name!r}, which was not asked for")
            local, size, sha256 = expected.pop(member.name)
            os.makedirs(os.path.dirname(local), exist_ok=True)
            with tar.extractfile(member) as source, open(local + ".part", "wb") as out:
                out.write(source.read())
            progress.update(member.size)
            if not matches(local + ".part", size, sha256):
                os.unlink(local + ".part")
                raise ManifestError(f"{member.name}: the bytes received do not match the manifest: pull again")
            os.replace(local + ".part", local)
    if expected:
        raise ManifestError(f"the far side did not send {sorted(expected)[:5]}: pull again")


def bar(total: int, what: str) -> Any:
    """A bytes progress bar on stderr (silent when stderr is not a terminal and total is small)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=what, unit="B", unit_scale=True, unit_divisor=1024,
                file=sys.stderr, leave=False, disable=None)


def bar_callback(progress: Any) -> Any:
    """An fsspec callback feeding one shared tqdm bar (fsspec imported only when bytes move)."""
    from fsspec.callbacks import Callback

    class BarCallback(Callback):
        def __init__(self) -> None:
            super().__init__()
            self.reported = 0

        def call(self, *args: Any, **kwargs: Any) -> None:
            progress.update(self.value - self.reported)
            self.reported = self.value

    return BarCallback()


def put_atomic(fs: Any, local: str, remote: str, progress: Any) -> None:
    """Upload `local` under a temporary name, then rename: a partial file never has the final name."""
    tmp = f"{remote}.tmp-{uuid.uuid4().hex[:12]}"
    fs.makedirs(os.path.dirname(remote), exist_ok=True)
    try:
        fs.put_file(local, tmp, callback=bar_callback(progress))
        fs.mv(tmp, remote)
    except BaseException:
        try:
            fs.rm(tmp)
        except (OSError, FileNotFoundError):
            pass  # a killed push's partial file is cleared by the next `have` of the same content
        raise


def pipe_atomic(fs: Any, remote: str, data: bytes) -> None:
    """Write small `data` to `remote` atomically (temporary name, then rename)."""
    tmp = f"{remote}.tmp-{uuid.uuid4().hex[:12]}"
    fs.makedirs(os.path.dirname(remote), exist_ok=True)
    fs.pipe_file(tmp, data)
    fs.mv(tmp, remote)


def matches(path: str, size: int, sha256: str) -> bool:
    """Whether the local file at `path` has exactly this size and SHA-256."""
    try:
        if os.path.getsize(path) != size:
            return False
    except FileNotFoundError:
        return False
    return sha256_file(path)[0] == sha256


def get_resumable(fs: Any, remote: str, local: str, size: int, sha256: str, progress: Any) -> None:
    """Download into `local`.part, continuing a partial one, check size and SHA-256, then rename."""
    part = local + ".part"
    os.makedirs(os.path.dirname(local), exist_ok=True)
    have = os.path.getsize(part) if os.path.exists(part) else 0
    if have > size:
        os.unlink(part)
        have = 0
    progress.update(have)
    if have == 0:  # a whole file: the filesystem's own get, with many requests in flight
        fs.get_file(remote, part, callback=bar_callback(progress))
    else:  # continue a partial one where it stopped
        with fs.open(remote, "rb") as src, open(part, "ab") as dst:
            src.seek(have)
            for chunk in iter(lambda: src.read(CHUNK), b""):
                dst.write(chunk)
                progress.update(len(chunk))
    with open(part, "rb+") as done:
        os.fsync(done.fileno())
    if not matches(part, size, sha256):
        os.unlink(part)  # a resumed part that does not add up is restarted from zero next time
        raise ManifestError(f"{remote}: the downloaded bytes do not match the manifest "
                            f"(changed on the far side after sealing?): run the pull again")
    os.replace(part, local)
