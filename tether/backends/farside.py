"""The typed client of the far side: one method per command of the protocol, over one serve process.

The first call of an invocation starts the serve process (tether/remote/bootstrap.py): it claims
remote_dir, installs this tether's far-side package when it is missing (streamed on the same
channel), and answers every later request. A channel that drops is reopened once and the request
sent again (every request is idempotent); a stream that stops moving ends in one clear error.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any, Callable, Optional

from tether.backends.channel import Channel, ChannelLost, FarSideError, Stalled
from tether.shipping import bootstrap_script, package_tar
from tether.errors import BackendError, RemoteCommandError
from tether.remote.fileio import CHUNK
from tether.remote.protocol import ChunkWriter
from tether.remote.protocol import CheckpointInfo, LaunchResult, Preflight, PushResult, Removal, Snapshot, StopOutcome
from tether.remote.protocol import EnvironmentInfo, Peeked

if TYPE_CHECKING:
    from tether.backends.base import Backend


class FarSide:
    """One far side's serve process, opened on first use (again in a forked worker)."""

    def __init__(self, backend: "Backend") -> None:
        self.backend = backend
        self._channel: Optional[Channel] = None
        self._starting: Optional[Channel] = None  # spawned by open_soon, its hello not read yet
        self._pid = os.getpid()
        self.remote_dir: Optional[str] = None
        self.installed_now = False  # this invocation copied the far-side package there
        self.python_version = ""
        self.starts = 0  # serve processes started by this client (one, unless a channel dropped)
        self.requests = 0

    # ------------------------------------------------------------ the channel

    def channel(self) -> Channel:
        if self._pid != os.getpid():
            self._channel, self._starting, self._pid = None, None, os.getpid()  # a forked worker opens its own
        if self._channel is None:
            self._channel = self._open()
        return self._channel

    def open_soon(self) -> None:
        """Start the serve process now, without waiting for it: the connection is made while this
        side still hashes and decides (the first request reads its hello)."""
        if self._pid != os.getpid():
            self._channel, self._starting, self._pid = None, None, os.getpid()
        if self._channel is None and self._starting is None:
            try:
                self._starting = self._spawn()
            except BackendError:
                pass  # the first request reports it

    def _spawn(self) -> Channel:
        argv = self.backend.serve_argv(bootstrap_script(), self.backend.version)
        if os.environ.get("TETHER_TRACE"):
            print(f"[far {self.backend.where}] serve", file=sys.stderr)
        try:
            channel = Channel(argv)
        except FileNotFoundError as err:
            raise BackendError(f"{argv[0]}: {err.strerror}: " + self.backend.missing_program_hint(argv[0])) from None
        self.starts += 1
        return channel

    def _open(self) -> Channel:
        channel, self._starting = self._starting or self._spawn(), None
        channel.timeout_s = self.backend.open_timeout_s
        try:
            first = channel.message()
            if "install" in first:
                writer = ChunkWriter(channel)  # type: ignore[arg-type]
                writer.write(package_tar())
                writer.close()
                self.installed_now = True
                first = channel.message()
        except ChannelLost as err:
            raise self.backend.explain_lost(err) from None
        except Stalled:
            channel.kill()
            raise BackendError(f"{self.backend.where}: no answer within {channel.timeout_s:g} s: "
                               f"is the far side overloaded? run the command again") from None
        if "refused" in first:
            channel.close()
            raise BackendError(first["refused"])
        self.remote_dir, self.python_version = first["remote_dir"], first.get("python", "")
        channel.timeout_s = None
        return channel

    def reconnect(self) -> None:
        """Drop the channel; the next call opens a fresh one."""
        channel, self._channel = self._channel, None
        if channel is not None:
            channel.kill()

    def close(self) -> None:
        channel, self._channel = self._channel, None
        if channel is not None:
            channel.close()

    def call(self, command: str, retry: bool = True, answer: Optional[Callable[[dict, Any], None]] = None,
             receive: Optional[Callable[[bytes], None]] = None, stall_s: Optional[float] = None, **given: Any) -> Any:
        """One request; a dropped channel is reopened and the request sent once more (when `retry`)."""
        if os.environ.get("TETHER_TRACE"):
            print(f"[far {self.backend.where}] {command} {_brief(given)}", file=sys.stderr)
        self.requests += 1
        for last in (not retry, True):
            channel = self.channel()
            channel.timeout_s = stall_s
            try:
                return channel.request(command, given, answer, receive)
            except ChannelLost as err:
                self.reconnect()
                if last and err.code == 255:  # ssh's own failure (a silent link): the transport says why
                    raise self.backend.explain_lost(err) from None
                if last:
                    raise BackendError(f"{self.backend.where}: the connection was lost ({err}): "
                                       f"run the command again") from None
            except Stalled as err:
                self.reconnect()
                raise BackendError(f"the copy from {self.backend.where} sent nothing for {err.seconds:g} s; "
                                   f"nothing is lost: run the same command again") from None
            except FarSideError as err:
                raise _translated(command, err) from None
            except BaseException:  # this side failed mid-request (a file gone, Ctrl-C): the channel is out of step
                self.reconnect()
                raise
            finally:
                if self._channel is channel:
                    channel.timeout_s = None
        raise AssertionError("unreachable")

    # ------------------------------------------------------------ the commands

    def probe(self, run_dirs: list[str]) -> dict[str, Snapshot]:
        found = self.call("probe", run_dirs=run_dirs)
        return {d: Snapshot.of(found[d]) for d in run_dirs}

    def start(self, run_dir: str, settings: dict) -> LaunchResult:
        return LaunchResult.of(self.call("start", run_dir=run_dir, settings=settings))

    def stop(self, run_dir: str, grace_s: float) -> StopOutcome:
        return StopOutcome.of(self.call("stop", run_dir=run_dir, grace_s=grace_s))

    def cancel(self, run_dir: str, grace_s: float) -> StopOutcome:
        return StopOutcome.of(self.call("cancel", run_dir=run_dir, grace_s=grace_s))

    def seal(self, run_dir: str) -> dict:
        return self.call("seal", run_dir=run_dir)

    def reopen(self, run_dir: str) -> dict:
        return self.call("reopen", run_dir=run_dir)

    def checkpoint(self, run_dir: str, named: Optional[str] = None) -> CheckpointInfo:
        return CheckpointInfo.of(self.call("checkpoint", run_dir=run_dir, named=named))

    def check(self, settings: dict) -> Preflight:
        return Preflight.of(self.call("check", settings=settings))

    def environment(self, request: dict) -> EnvironmentInfo:
        """The job's venv: found, built (build=True) or failed (tether.remote.environment.ensure)."""
        return EnvironmentInfo.of(self.call("environment", **request))

    def have(self, objects_dir: str, hashes: list[str]) -> list[str]:
        return self.call("have", objects_dir=objects_dir, hashes=hashes)

    def push(self, objects_dir: str, run_dir: str, files: list[dict],
             send: Callable[[list[str], Any], None], stall_s: Optional[float]) -> PushResult:
        """Store what the object store lacks (it asks; `send(need, out)` writes them to `out` as a tar)
        and build the run's snapshot: one request."""
        return PushResult.of(self.call("push", objects_dir=objects_dir, run_dir=run_dir, files=files,
                                       answer=lambda ask, out: send(ask["need"], out), stall_s=stall_s))

    def materialize(self, run_dir: str) -> list[str]:
        return self.call("materialize", run_dir=run_dir)["built"]

    def send(self, run_dir: str, paths: list[str], receive: Callable[[bytes], None],
             stall_s: Optional[float]) -> None:
        """The run's files `paths` as one tar, chunk by chunk into `receive` (not retried: the caller resumes)."""
        self.call("send", retry=False, receive=receive, stall_s=stall_s, run_dir=run_dir, paths=paths)

    def read(self, path: str, receive: Callable[[bytes], None], offset: int = 0, length: int = -1,
             stall_s: Optional[float] = None) -> tuple[int, int]:
        """Bytes of remote_dir/`path` from `offset` (negative: from the end) into `receive`;
        (the file's size, where the bytes started). FileNotFoundError if there is no such file."""
        found = self.call("read", retry=False, receive=receive, stall_s=stall_s, root=self.root(), path=path,
                          offset=offset, length=length)
        return found["size"], found["start"]

    def cat(self, path: str, offset: int = 0) -> bytes:
        """remote_dir/`path` from `offset` to its end (small files: a manifest, a log's tail); FileNotFoundError if none."""
        for attempt in (1, 2):
            parts: list[bytes] = []
            try:
                self.read(path, parts.append, offset)
                return b"".join(parts)
            except BackendError:
                if attempt == 2:
                    raise
                self.reconnect()
        raise AssertionError("unreachable")

    def tail(self, path: str, nbytes: int, since: int = 0) -> tuple[bytes, int]:
        """At most the last `nbytes` of remote_dir/`path`, from no earlier than `since`; (bytes, where they start)."""
        parts: list[bytes] = []
        size, start = self.read(path, parts.append, -nbytes)
        if since > start and since <= size:
            return b"".join(parts)[since - start:], since
        return b"".join(parts), start

    def put(self, path: str, data: bytes) -> None:
        """Write remote_dir/`path` atomically."""
        self.call("put", root=self.root(), path=path, answer=lambda ask, out: out.write(data))

    def put_file(self, path: str, local: str, moved: Callable[[int], None]) -> None:
        """Upload the local file to remote_dir/`path` atomically, telling `moved` of every piece."""
        def send(ask: dict, out: Any) -> None:
            with open(local, "rb") as f:
                for chunk in iter(lambda: f.read(CHUNK), b""):
                    out.write(chunk)
                    moved(len(chunk))

        self.call("put", root=self.root(), path=path, answer=send, stall_s=self.backend.stall_timeout_s)

    def create(self, path: str, data: bytes) -> bool:
        """Write remote_dir/`path` whole unless it exists; whether this call made it (one of two racers does)."""
        return self.call("create", root=self.root(), path=path, answer=lambda ask, out: out.write(data))["created"]

    def append(self, path: str, offset: int, data: bytes) -> int:
        """Append `data` to remote_dir/`path` if it is `offset` bytes long; its size after (or now, if it was not)."""
        def send(ask: dict, out: Any) -> None:
            if "size" not in ask:
                out.write(data)

        return self.call("append", root=self.root(), path=path, offset=offset, answer=send)["size"]

    def peek(self, paths: list[str] = (), patterns: list[str] = ()) -> Peeked:  # type: ignore[assignment]
        """Small files of remote_dir, named or matched by globs, in one request."""
        return Peeked.of(self.call("peek", root=self.root(), paths=list(paths), patterns=list(patterns)))

    def delete(self, paths: list[str]) -> None:
        self.call("delete", root=self.root(), paths=list(paths))

    def remove(self, run_dir: str) -> Removal:
        return Removal.of(self.call("remove", run_dir=run_dir))

    def prune(self, remote_dir: str) -> dict:
        return self.call("prune", remote_dir=remote_dir)

    def submit(self, run_dir: str, settings: dict) -> LaunchResult:
        return LaunchResult.of(self.call("submit", run_dir=run_dir, settings=settings))

    def submit_array(self, remote_dir: str, settings: dict) -> dict:
        return self.call("submit_array", remote_dir=remote_dir, settings=settings)

    def root(self) -> str:
        self.channel()
        assert self.remote_dir is not None
        return self.remote_dir


def _translated(command: str, err: FarSideError) -> Exception:
    """A far-side failure as this side's exception: a missing file, a refusal, or a failed command."""
    if err.kind == "FileNotFoundError":
        return FileNotFoundError(str(err))
    if err.kind in ("refused", "NotOurs"):
        return BackendError(str(err).strip())
    return RemoteCommandError([command], 1, str(err))


def _brief(given: dict) -> str:
    text = " ".join(f"{k}={v}" for k, v in given.items() if isinstance(v, (str, int, float)))
    return text if len(text) < 200 else text[:197] + "..."
