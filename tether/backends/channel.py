"""One far-side serve process over pipes: framed requests out, answers in, every wait bounded.

The process is a local `python -c BOOTSTRAP` or an `ssh HOST python -c BOOTSTRAP`; either way
this side only sees its stdin and stdout. A read that gets no byte within its timeout (a frozen
peer, a dead route) raises Stalled; the process ending raises ChannelLost with its stderr's tail.
"""

from __future__ import annotations

import collections
import os
import select
import subprocess
import threading
import time
from typing import Any, Callable, Optional

from tether.remote import protocol

STDERR_TAIL = 8192
PIPE_BYTES = 1 << 20


class ChannelLost(EOFError):
    """The serve process ended (or never started); `stderr` is what it said last."""

    def __init__(self, stderr: str, code: Optional[int]) -> None:
        super().__init__(stderr.strip().splitlines()[-1] if stderr.strip() else f"exit status {code}")
        self.stderr, self.code = stderr, code


class Stalled(TimeoutError):
    """No byte came (or could be sent) for `seconds`."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"nothing moved for {seconds:g} s")
        self.seconds = seconds


class FarSideError(Exception):
    """A far-side command failed: `kind` names the exception there, the text is its message."""

    def __init__(self, kind: str, text: str) -> None:
        super().__init__(text)
        self.kind = kind


def _widen(fd: int) -> None:
    """A 1 MiB pipe instead of Linux's 64 KiB: a sixteenth of the wake-ups per byte moved (best effort)."""
    try:
        import fcntl

        fcntl.fcntl(fd, getattr(fcntl, "F_SETPIPE_SZ", 1031), PIPE_BYTES)
    except (ImportError, OSError):
        pass  # another OS, or above /proc/sys/fs/pipe-max-size: the default works too


class Channel:
    """The pipes of one serve process, read and written with bounded waits."""

    def __init__(self, argv: list[str]) -> None:
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, bufsize=0)
        for pipe in (self.proc.stdin, self.proc.stdout):
            _widen(pipe.fileno())
        self._buffer = bytearray()
        self._stderr: collections.deque[bytes] = collections.deque()
        self._stderr_size = 0
        threading.Thread(target=self._drain_stderr, daemon=True, name="tether-far-stderr").start()
        self.timeout_s: Optional[float] = None  # per wait; None: until the process ends
        self.moved: Callable[[int], None] = lambda n: None  # told of every byte read (a watchdog)

    # ------------------------------------------------------------ the process

    def _drain_stderr(self) -> None:
        for line in iter(self.proc.stderr.readline, b""):
            self._stderr.append(line)
            self._stderr_size += len(line)
            while self._stderr_size > STDERR_TAIL and len(self._stderr) > 1:
                self._stderr_size -= len(self._stderr.popleft())

    def stderr_text(self) -> str:
        return b"".join(self._stderr).decode(errors="replace")

    def lost(self) -> ChannelLost:
        """The process is gone (or going): wait a moment for its exit status and last words."""
        try:
            code = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.close()
            code = self.proc.returncode
        time.sleep(0.01)  # the stderr thread's last line
        return ChannelLost(self.stderr_text(), code)

    def close(self) -> None:
        """End the serve process: closing its stdin ends it; a process that hangs is killed."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=2)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    # ------------------------------------------------------------ bytes

    def _wait(self, fd: int, write: bool) -> None:
        ready = select.select([], [fd], [], self.timeout_s) if write else select.select([fd], [], [], self.timeout_s)
        if not any(ready):
            raise Stalled(self.timeout_s or 0)

    def _fill(self) -> None:
        fd = self.proc.stdout.fileno()
        self._wait(fd, write=False)
        data = os.read(fd, 1 << 20)
        if not data:
            raise self.lost()
        self.moved(len(data))
        self._buffer += data

    def readline(self) -> bytes:
        while b"\n" not in self._buffer:
            self._fill()
        end = self._buffer.index(b"\n") + 1
        line = bytes(self._buffer[:end])
        del self._buffer[:end]
        return line

    def read(self, size: int) -> bytes:
        """Up to `size` bytes (at least one)."""
        if not self._buffer:
            self._fill()
        data = bytes(self._buffer[:size])
        del self._buffer[:size]
        return data

    def write(self, data: bytes) -> int:
        fd = self.proc.stdin.fileno()
        view = memoryview(data)
        while view:
            self._wait(fd, write=True)
            try:
                sent = os.write(fd, view[:1 << 20])
            except (BrokenPipeError, ConnectionResetError):
                raise self.lost() from None
            self.moved(sent)
            view = view[sent:]
        return len(data)

    def flush(self) -> None:
        pass

    # ------------------------------------------------------------ messages

    def message(self) -> dict[str, Any]:
        return protocol.read_message(self)  # type: ignore[arg-type]

    def request(self, command: str, given: dict[str, Any], answer: Optional[Callable[[dict, Any], None]] = None,
                receive: Optional[Callable[[bytes], None]] = None) -> Any:
        """Send one request and read its answer: `answer(question, out)` writes the bytes a command
        asks for into the file `out`, `receive(chunk)` takes the bytes a command streams back."""
        protocol.write_message(self, {"command": command, "input": given})  # type: ignore[arg-type]
        while True:
            reply = self.message()
            if "ask" in reply:
                writer = protocol.ChunkWriter(self)  # type: ignore[arg-type]
                if answer is not None:
                    answer(reply["ask"], writer)
                writer.close()
                self.timeout_s = None  # what follows is the far side's own work (building a snapshot)
            elif reply.get("stream"):
                for chunk in protocol.read_chunks(self):  # type: ignore[arg-type]
                    if receive is not None:
                        receive(chunk)
            elif reply.get("ok"):
                return reply.get("result")
            else:
                raise FarSideError(reply.get("kind", ""), reply.get("error", ""))
