"""The far side's one process per invocation: framed requests on stdin, answers on stdout.

Stdlib only, Python >= 3.8. Started by the bootstrap (tether/remote/bootstrap.py) once per
invocation; every command of the table in protocol.py goes through it, so a push, a watch or a
status costs no Python start on the far side. Detached runs stay detached: `start` spawns the
launcher in its own session, never as a child that ends with this process.
"""

from __future__ import annotations

import contextlib
import importlib
import posixpath
import sys
import traceback
from typing import IO, Any, Dict, List

from tether.remote import idle, protocol


class Peer:
    """What a streaming command may do with the client: ask it something, then read its stream."""

    def __init__(self, source: IO[bytes], out: IO[bytes]) -> None:
        self.source, self.out = source, out
        self.reader = None  # type: Any

    def ask(self, question: Dict[str, Any]) -> protocol.ChunkReader:
        protocol.write_message(self.out, {"ask": question})
        self.out.flush()
        self.reader = protocol.ChunkReader(self.source)
        return self.reader


def answer(request: Dict[str, Any], source: IO[bytes], out: IO[bytes]) -> Dict[str, Any]:
    """Run one request; its answer message (a streamed answer's bytes are already written)."""
    command = protocol.COMMANDS.get(request.get("command", ""))
    if command is None:
        return {"ok": False, "kind": "unknown", "error": "unknown far-side command %r" % request.get("command")}
    function = getattr(importlib.import_module("tether.remote." + command.module), command.function)
    given = dict(request.get("input") or {})
    peer = Peer(source, out)
    writer = protocol.ChunkWriter(out) if command.gives_stream else None
    try:
        if command.takes_stream:
            given["peer"] = peer
        if writer is not None:
            protocol.write_message(out, {"stream": True})
            given["stream"] = writer
        with contextlib.ExitStack() as reads:
            for run_dir in runs_named(given):
                reads.enter_context(idle.reading(run_dir))  # the box's idle clock (tether/remote/idle.py)
            result = function(**given)
    except (Exception, SystemExit) as err:
        if writer is not None:
            writer.close()  # the client reads the stream's end before the error
        if peer.reader is not None:
            peer.reader.drain()
        kind = "refused" if isinstance(err, SystemExit) else type(err).__name__
        text = str(err) if isinstance(err, (SystemExit, ValueError, OSError)) else traceback.format_exc()
        return {"ok": False, "kind": kind, "error": text}
    if writer is not None:
        writer.close()
    if peer.reader is not None:
        peer.reader.drain()  # the stream's end marker (a tar reader stops before it)
    return {"ok": True, "result": result}


def runs_named(given: Dict[str, Any]) -> List[str]:
    """The run dirs a request is about: its `run_dir`, its `run_dirs`, or the run of a `path` under
    `<root>/runs/<run id>/`. Every such request (a status, watch or pull, and also a push, start or
    stop) is a read of the run that resets the box's idle clock; `check`, `have` and `prune` name none."""
    found = [given.get("run_dir")] + list(given.get("run_dirs") or [])
    parts = posixpath.normpath(str(given.get("path") or "")).split("/")
    if isinstance(given.get("root"), str) and len(parts) >= 3 and parts[0] == "runs" and parts[1] != "..":
        found.append(posixpath.join(given["root"], "runs", parts[1]))
    found = [posixpath.normpath(d) for d in found if isinstance(d, str) and d]
    return sorted({d for d in found if posixpath.basename(posixpath.dirname(d)) == "runs"})  # never remote_dir


def main(source: IO[bytes], out: IO[bytes]) -> int:
    """Answer requests until the client closes the channel."""
    sys.stdout = sys.stderr  # a stray print must never corrupt the framing
    while True:
        try:
            request = protocol.read_message(source)
        except EOFError:
            return 0
        protocol.write_message(out, answer(request, source, out))
        out.flush()
