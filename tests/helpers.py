"""Helpers the test modules share: processes read from /proc, a background doit whose output is
drained, polling at a fine grain, file hashes, and stopping what a test left running on the far side."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import threading
import time
from pathlib import Path


# ---------------------------------------------------------------- processes (/proc)


def _stat(pid: int) -> list[str] | None:
    """Fields after the command name in /proc/PID/stat, or None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None


def alive(pid: int) -> bool:
    """Whether `pid` is a process that has not exited (a zombie has; nothing here reaps orphans)."""
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"


def group(pgid: int) -> list[int]:
    """Live (non-zombie) members of process group `pgid`, read from /proc."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat(int(entry))
            if fields and fields[0] != "Z" and int(fields[2]) == pgid:
                found.append(int(entry))
    return found


def stop_leftover_runs(remote_dir: Path) -> None:
    """Stop any launcher or trainer still holding a run under remote_dir (the far side is this machine)."""
    runs = Path(remote_dir) / "runs"
    if not runs.is_dir():
        return
    from tether.remote import launcher

    for run_dir in runs.iterdir():
        if launcher.is_alive(str(run_dir)):
            launcher.stop(str(run_dir), 1.0)


# ---------------------------------------------------------------- background doit, waits


class Background:
    """A `project.start(...)` process (doit in its own process group) whose stdout/stderr are drained
    by threads, so it never blocks on a full pipe."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self.chunks: dict[str, list[bytes]] = {"stdout": [], "stderr": []}
        self.threads = [threading.Thread(target=self._drain, args=(name,), daemon=True)
                        for name in self.chunks]
        for thread in self.threads:
            thread.start()

    def _drain(self, name: str) -> None:
        fd = getattr(self.proc, name).fileno()
        while True:
            data = os.read(fd, 65536)
            if not data:
                return
            self.chunks[name].append(data)

    def text(self, name: str = "stderr") -> str:
        return b"".join(self.chunks[name]).decode(errors="replace")

    def output(self) -> str:
        return f"--- stdout\n{self.text('stdout')}\n--- stderr\n{self.text('stderr')}"

    def killpg(self, sig: int) -> None:
        os.killpg(self.proc.pid, sig)

    def finish(self, timeout: float = 60) -> int:
        """Wait for the exit, then for the drained output; the exit code."""
        code = self.proc.wait(timeout=timeout)
        for thread in self.threads:
            thread.join(timeout=10)
        return code

    def kill(self) -> int:
        """SIGKILL the whole group (if still there) and finish."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return self.finish(timeout=30)


def poll(predicate, timeout: float, what: str, interval: float = 0.001) -> None:
    """`project.wait_for` with a finer grain, to catch windows of a few milliseconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


# ---------------------------------------------------------------- files


def sha256(path: Path) -> str:
    """SHA-256 of the file at `path`, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


NVIDIA_SMI_DATA = Path(__file__).resolve().parent / "data" / "nvidia-smi"
NVIDIA_SMI_STAND_IN = """\
#!/bin/sh
# A stand-in for nvidia-smi (no GPU here): replays real captured output, see {data}/SOURCES.md
case "$*" in
  "{memory_query}") cat {data}/{memory}; exit {code} ;;
  "{capability_query}") cat {data}/{capability}; exit {code} ;;
esac
echo "stand-in nvidia-smi: no captured output for: $*" >&2
exit 2
"""


def replay_nvidia_smi(folder: Path, memory: str, code: int, capability: str) -> Path:
    """Write `folder`/nvidia-smi, which prints these captured files (tether's two queries) and exits `code`."""
    from tether.remote import machine

    folder.mkdir(exist_ok=True)
    script = folder / "nvidia-smi"
    script.write_text(NVIDIA_SMI_STAND_IN.format(
        data=NVIDIA_SMI_DATA, memory=memory, capability=capability, code=code,
        memory_query=" ".join(machine.GPU_QUERY[1:]), capability_query=" ".join(machine.CAPABILITY_QUERY[1:])))
    script.chmod(0o755)
    return script


def preflight_lines(found: dict, settings: dict) -> dict:
    """The preflight's GPU lines, by name, as `doit check` shows them (from machine.check's answer,
    typed as the client reads it)."""
    from tether.backends.base import Report, _gpu_items
    from tether.remote.protocol import Preflight

    report = Report("lab")
    _gpu_items(report, Preflight.of(found), settings)
    return {item["check"]: item for item in report.items}
