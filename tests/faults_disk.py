"""Disk-full helpers for the fault tests and the soak: tmpfs mounts, a filler that leaves a seeded free size."""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path
from typing import Iterator

import pytest

DATA = Path(__file__).resolve().parent / "data"
UNIT = 2 << 20  # the script's checkpoint grows by this each epoch (its --grow)
SLACK = 3 << 19  # the launcher's 1 MiB reserve (tether.remote.room) and its small writes, with room to spare
COMMAND = "{python} demo/disk_train.py --epochs 3 --grow %d" % UNIT


def config(remote_dir: Path, in_place: bool = False) -> str:
    """A tether.yaml for tests/data/disk_train.py (its own out/ckpt.pt and --resume) with `remote_dir`."""
    command = COMMAND + (" --in-place" if in_place else "")
    return f"""\
name: disk
backend: local
code:
  paths: [demo/disk_train.py]
data:
  paths: [demo/points.csv]
trainer:
  type: command
  command: "{command}"
  checkpoint: out/ckpt.pt
  resume_args: ["--resume", "{{checkpoint}}"]
artifacts: [out/final.json]
checkpoint: {{keep: 1}}
heartbeat_timeout_s: 60
grace_seconds: 5
backends:
  local: {{type: local, remote_dir: {remote_dir}}}
"""


def mount_tmpfs(where: Path, size: int) -> None:
    """Mount a tmpfs of `size` bytes at `where`; skip (with the reason) where this machine cannot."""
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=%d" % size, "tmpfs", str(where)],
                          capture_output=True, text=True)
    if done.returncode:
        pytest.skip("cannot mount a tmpfs here (needs root): %s" % done.stderr.strip())


def unmount(where: Path) -> None:
    subprocess.run(["umount", "-l", str(where)], capture_output=True)


@contextlib.contextmanager
def tmpfs(where: Path, size: int) -> Iterator[Path]:
    """A tmpfs at `where` for the block; unmounted after, even on failure."""
    mount_tmpfs(where, size)
    try:
        yield where
    finally:
        unmount(where)


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def fill(folder: Path, leave: int) -> Path:
    """Write a filler file so that `leave` bytes stay free on `folder`'s filesystem (blocks really taken)."""
    filler = folder / "filler.bin"
    with open(filler, "wb") as f:
        os.posix_fallocate(f.fileno(), 0, max(0, free_bytes(folder) - leave))
    return filler


def leave_for_second_checkpoint(offset: int) -> int:
    """Free bytes at launch so that epoch 1's checkpoint fits and epoch 2's write fails `offset` bytes in."""
    return UNIT + SLACK + offset
