"""The far-side protocol: the command table, the status words, the typed answers and serve's framing.

Stdlib only, Python >= 3.8: both sides import it (the far side from its copy of tether/remote/).

A request is one JSON line {"command": NAME, "input": {...}, "stream": BOOL}; when it streams,
chunks follow (a 4-byte big-endian length, then that many bytes; an empty chunk ends it). The
answer has the same shape: {"ok": true, "result": ..., "stream": BOOL} (+ chunks) or
{"ok": false, "error": TEXT, "kind": NAME}. A command may also say something to the client
before its answer ({"ask": ...}, see `push`): the client answers with a stream of its own.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field, fields
from typing import IO, Any, Dict, Iterator, List, Optional

# ---------------------------------------------------------------- the status words

PENDING, RUNNING, COMPLETED, FAILED = "pending", "running", "completed", "failed"
PREEMPTED, STOPPED, LOST, CANCELLED, ABSENT = "preempted", "stopped", "lost", "cancelled", "absent"
STALLED = "stalled"  # no output and no event for stall_timeout_s: ended by the launcher
ENDED_BADLY = (PREEMPTED, STALLED, FAILED, LOST, CANCELLED)  # with no launcher left, watch asks the policy

# launch and stop outcomes
STARTED, ALREADY_RUNNING, FINISHED, ERROR = "started", "running", "finished", "error"
WAS_NOT_RUNNING, STOPPED_NOW = "was not running", "stopped"


# ---------------------------------------------------------------- the command table


@dataclass(frozen=True)
class Command:
    """One far-side command: the function that answers it, and whether bytes travel with it."""

    module: str  # under tether.remote
    function: str
    takes_stream: bool = False  # the client streams bytes after the request (receive)
    gives_stream: bool = False  # the answer streams bytes before its result (send)


COMMANDS = {
    "probe": Command("launcher", "probe_all"),
    "start": Command("launcher", "start"),
    "stop": Command("launcher", "stop"),
    "cancel": Command("launcher", "cancel"),
    "seal": Command("rundir", "seal"),
    "reopen": Command("launcher", "reopen"),
    "checkpoint": Command("launcher", "checkpoint"),
    "check": Command("machine", "check"),
    "have": Command("objects", "have"),
    "push": Command("objects", "push", takes_stream=True),
    "materialize": Command("objects", "materialize"),
    "send": Command("objects", "send", gives_stream=True),
    "read": Command("objects", "read_file", gives_stream=True),
    "remove": Command("launcher", "remove"),
    "put": Command("objects", "put_file", takes_stream=True),
    "prune": Command("objects", "prune"),
    "submit": Command("scheduler", "submit"),
    "submit_array": Command("scheduler", "submit_array"),
    "environment": Command("environment", "ensure"),
    "create": Command("files", "create", takes_stream=True),  # a mailbox's files (tether/remote/files.py)
    "append": Command("files", "append", takes_stream=True),
    "peek": Command("files", "peek"),
    "delete": Command("files", "delete"),
}


# ---------------------------------------------------------------- the typed answers


def _known(cls: Any, found: Dict[str, Any]) -> Dict[str, Any]:
    """The keys of `found` that `cls` declares (a newer far side may say more)."""
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in found.items() if k in names}


@dataclass
class Snapshot:
    """One run as the far side sees it: its status, liveness, state.json and, on SLURM, the queue."""

    status: str
    final: bool = False
    alive: bool = False
    state: Dict[str, Any] = field(default_factory=dict)  # state.json as the launcher wrote it
    now: float = 0.0  # the far side's clock
    sealed: bool = False
    heartbeat_age_s: Optional[float] = None  # the launcher's: "it is alive"
    output_age_s: Optional[float] = None  # the trainer's last output or event: "it is making progress"
    notified: List[Dict[str, Any]] = field(default_factory=list)  # notifications the far side sent (notify.json)
    idle_stop: Dict[str, Any] = field(default_factory=dict)  # the box's idle stop, when configured
    job_id: Optional[str] = None
    queue: Optional[Dict[str, str]] = None  # squeue's entry for the job
    queue_error: Optional[str] = None
    scheduler: Optional[Dict[str, Any]] = None  # sacct's account of a job that left the queue

    @classmethod
    def of(cls, found: Dict[str, Any]) -> "Snapshot":
        return cls(**dict(_known(cls, found), state=found.get("state") or {}))


@dataclass
class LaunchResult:
    """What `start` (or a SLURM submit) did: started, already running, finished, or error."""

    outcome: str
    state: Dict[str, Any] = field(default_factory=dict)
    error: str = ""
    exit_code: Optional[int] = None
    job_id: Optional[str] = None
    flags: Optional[List[str]] = None
    message: str = ""  # the launch in the backend's own words, said as is (an agent's: queued for agent NAME)

    @classmethod
    def of(cls, found: Dict[str, Any]) -> "LaunchResult":
        return cls(**dict(_known(cls, found), state=found.get("state") or {}))

    @property
    def attempt(self) -> Optional[int]:
        return self.state.get("attempt")


@dataclass
class Removal:
    """What `remove` did to a run dir (removed, absent, alive), and the other runs still on the box."""

    outcome: str
    others: List[str] = field(default_factory=list)  # run ids left in the same runs/ folder

    @classmethod
    def of(cls, found: Dict[str, Any]) -> "Removal":
        return cls(**_known(cls, found))


@dataclass
class StopOutcome:
    """What `stop` (or `cancel`) did, honestly: stopped, was not running, or error."""

    outcome: str
    status: Optional[str] = None
    error: str = ""
    survivors: List[int] = field(default_factory=list)
    job_id: Optional[str] = None
    forced: Optional[bool] = None

    @classmethod
    def of(cls, found: Dict[str, Any]) -> "StopOutcome":
        return cls(**_known(cls, found))


@dataclass
class Preflight:
    """What the far side's `check` found: Python, disk, inodes, modules, GPUs, torch's kernels."""

    python: str = ""
    python_ok: bool = False
    executable: str = ""
    writable: bool = False
    free_mb: int = 0
    free_inodes: int = 0
    missing_modules: List[str] = field(default_factory=list)
    gpus: Optional[List[Dict[str, Any]]] = None
    gpu_env: Dict[str, str] = field(default_factory=dict)
    gpu_skipped: Dict[str, str] = field(default_factory=dict)  # GPU index -> why a run would not get it now
    gpu_error: Optional[str] = None
    no_gpu: Optional[str] = None
    torch: Optional[Dict[str, Any]] = None
    host: str = ""
    slurm: Optional[Dict[str, Any]] = None  # the scheduler's commands and partitions (slurm backends)

    @classmethod
    def of(cls, found: Dict[str, Any]) -> "Preflight":
        return cls(**_known(cls, found))


@dataclass
class EnvironmentInfo:
    """What `environment` found or did: the job's venv (reused, built, absent, failed) or none asked for."""

    outcome: str  # none | reused | built | absent (build=False) | failed
    python: str = ""  # the interpreter a run gets: the venv's, or (none) the base one
    venv: str = ""
    key: str = ""  # SHA-256 of the interpreter, the requirements and the packages
    installer: str = ""  # uv | pip
    seconds: Optional[float] = None  # how long the build took
    error: str = ""  # one line naming the fix (failed)
    tail: List[str] = field(default_factory=list)  # the installer's last lines (failed)
    base: Dict[str, Any] = field(default_factory=dict)  # the base interpreter: version, executable, real path
    interpreter: Optional[Dict[str, Any]] = None  # the run's interpreter, when described: version, torch, cuda

    @classmethod
    def of(cls, found: Dict[str, Any]) -> "EnvironmentInfo":
        return cls(**_known(cls, found))


@dataclass(frozen=True)
class PeekedFile:
    """One small file as `peek` found it: its text (None above 1 MiB), size and age on the far side's clock."""

    text: Optional[str]
    size: int
    age_s: float


@dataclass
class Peeked:
    """`peek`'s answer: the far side's clock and the files found, by path under remote_dir."""

    now: float = 0.0
    files: Dict[str, PeekedFile] = field(default_factory=dict)

    @classmethod
    def of(cls, found: Dict[str, Any]) -> "Peeked":
        return cls(found.get("now", 0.0), {p: PeekedFile(f.get("text"), f.get("size", 0), f.get("age_s", 0.0))
                                          for p, f in (found.get("files") or {}).items()})


@dataclass
class PushResult:
    """A push's answer: objects stored (and refused), and which of code/, data/, work/ were built."""

    stored: int = 0
    bad: List[str] = field(default_factory=list)
    built: List[str] = field(default_factory=list)
    missing: List[str] = field(default_factory=list)  # objects still lacking (sent by nobody)

    @classmethod
    def of(cls, found: Dict[str, Any]) -> "PushResult":
        return cls(**_known(cls, found))


@dataclass
class CheckpointInfo:
    """A run's checkpoint as `checkpoint` describes it (resume_from=, repro)."""

    outcome: str
    checkpoint: Optional[str] = None
    status: Optional[str] = None
    bytes: Optional[int] = None
    sha256: Optional[str] = None
    step: Optional[int] = None

    @classmethod
    def of(cls, found: Dict[str, Any]) -> "CheckpointInfo":
        return cls(**_known(cls, found))


# ---------------------------------------------------------------- framing

CHUNK_HEADER = struct.Struct(">I")
MAX_CHUNK = 1 << 20


def write_message(out: IO[bytes], message: Dict[str, Any]) -> None:
    out.write(json.dumps(message, sort_keys=True).encode() + b"\n")


def read_message(source: IO[bytes]) -> Dict[str, Any]:
    """The next JSON line; EOFError when the other side is gone."""
    line = source.readline()
    if not line.endswith(b"\n"):
        raise EOFError("the far side closed the channel")
    return json.loads(line)


def read_chunks(source: IO[bytes]) -> Iterator[bytes]:
    """The chunks of one stream, until its empty chunk."""
    while True:
        head = _exactly(source, CHUNK_HEADER.size)
        (size,) = CHUNK_HEADER.unpack(head)
        if size == 0:
            return
        yield _exactly(source, size)


def _exactly(source: IO[bytes], size: int) -> bytes:
    data = source.read(size)
    while len(data) < size:
        more = source.read(size - len(data))
        if not more:
            raise EOFError("the channel closed in the middle of a stream")
        data += more
    return data


class ChunkReader:
    """A stream of chunks read as a file (for tarfile's `r|`)."""

    def __init__(self, source: IO[bytes]) -> None:
        self._chunks = read_chunks(source)
        self._chunk, self._at, self._done = memoryview(b""), 0, False

    def read(self, size: int = -1) -> bytes:
        if self._at == len(self._chunk) and not self._next():
            return b""
        if 0 <= size <= len(self._chunk) - self._at:  # the common case: within the chunk at hand
            self._at += size
            return self._chunk[self._at - size:self._at].tobytes()
        parts = [self._chunk[self._at:].tobytes()]
        got, self._at = len(parts[0]), len(self._chunk)
        while (size < 0 or got < size) and self._next():
            take = len(self._chunk) if size < 0 else min(len(self._chunk), size - got)
            parts.append(self._chunk[:take].tobytes())
            got, self._at = got + take, take
        return b"".join(parts)

    def _next(self) -> bool:
        """Move to the next chunk; False at the stream's end."""
        if self._done:
            return False
        chunk = next(self._chunks, b"")
        self._chunk, self._at, self._done = memoryview(chunk), 0, not chunk
        return bool(chunk)

    def drain(self) -> None:
        """Read what the sender still sends (a command that stopped early must not desync the channel)."""
        while self._next():
            pass


class ChunkWriter:
    """A file whose writes go out as chunks of up to MAX_CHUNK bytes; close() ends the stream."""

    def __init__(self, out: IO[bytes]) -> None:
        self._out, self._buffer = out, bytearray()

    def write(self, data: bytes) -> int:
        self._buffer += data
        if len(self._buffer) >= MAX_CHUNK:
            self._send()
        return len(data)

    def _send(self) -> None:
        # The buffer is swapped out first and every view released even when a write fails: a view
        # left exported would make the next write (tarfile's close after a dropped channel) raise
        # BufferError and hide the real error behind a traceback.
        data, self._buffer = self._buffer, bytearray()
        with memoryview(data) as view:
            for start in range(0, len(view), MAX_CHUNK):
                with view[start:start + MAX_CHUNK] as part:
                    self._out.write(CHUNK_HEADER.pack(len(part)))
                    self._out.write(part)

    def flush(self) -> None:
        self._send()
        self._out.flush()

    def close(self) -> None:
        self._send()
        self._out.write(CHUNK_HEADER.pack(0))
        self._out.flush()
