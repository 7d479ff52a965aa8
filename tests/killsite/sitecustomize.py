"""Kill points for tests/kill_points.py: in the process armed by TETHER_KILL_POINT, record each file write, rename, removal, spawn and far-side command, and SIGKILL the whole process group at the N-th one."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time

WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


class KillPoint:
    """The armed process's timeline: one JSON line per event in `trace`; kill the group at event number
    `kill_at`, or at the first event whose "kind what" matches `kill_match`."""

    def __init__(self, spec: dict) -> None:
        self.root = os.path.realpath(spec["root"])
        self.kill_at = int(spec.get("kill_at", -1))
        self.kill_match = re.compile(spec["kill_match"]) if spec.get("kill_match") else None
        self.fd = os.open(spec["trace"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self.count = 0
        self.t0 = time.monotonic()
        self.busy = False

    def label(self, path: object) -> str:
        """`path` relative to the project root, run ids and pids replaced, or '' when outside it."""
        if not isinstance(path, (str, bytes)) or isinstance(path, bytes):
            return ""
        full = os.path.realpath(path)
        if not full.startswith(self.root + os.sep) or "__pycache__" in full:
            return ""
        rel = full[len(self.root) + 1:]
        rel = re.sub(r"[A-Za-z0-9]+-\d{8}T\d{6}Z-[0-9a-f]{8}", "ID", rel)
        return re.sub(r"(tmp|part)-?\d+", r"\1-N", rel)

    def event(self, kind: str, what: str) -> None:
        if self.busy or not what:
            return
        self.busy = True
        try:
            self.count += 1
            line = {"n": self.count, "t": round(time.monotonic() - self.t0, 4), "kind": kind, "what": what}
            kill = self.count == self.kill_at or bool(self.kill_match and self.kill_match.search(f"{kind} {what}"))
            line["killed"] = kill
            os.write(self.fd, (json.dumps(line) + "\n").encode())
            if kill:
                os.killpg(os.getpgrp(), signal.SIGKILL)
        finally:
            self.busy = False

    def audit(self, name: str, args: tuple) -> None:
        if name == "open" and len(args) >= 3 and self._writes(args[1], args[2]):
            self.event("write", self.label(args[0]))
        elif name == "os.rename":
            src, dst = self.label(args[0]), self.label(args[1])
            self.event("rename", src and f"{src} -> {dst}")
        elif name in ("os.remove", "shutil.rmtree"):
            self.event("remove", self.label(args[0]))
        elif name == "subprocess.Popen":
            argv = args[1] if isinstance(args[1], (list, tuple)) else [str(args[1])]
            self.event("spawn", " ".join(os.path.basename(str(a))[:24] for a in argv[:2]))

    @staticmethod
    def _writes(mode: object, flags: object) -> bool:
        if isinstance(mode, str):
            return any(c in mode for c in "wax+")
        return isinstance(flags, int) and bool(flags & WRITE_FLAGS)


def _watch_far_side(point: KillPoint) -> None:
    """A `far` event once each request is on its way and before its answer is read: the far side is at work."""
    from tether.backends import channel

    request, message = channel.Channel.request, channel.Channel.message

    def traced_request(self, command, given, *args, **kwargs):
        self._kill_point_command = command
        return request(self, command, given, *args, **kwargs)

    def traced_message(self):
        command = getattr(self, "_kill_point_command", None)
        if command:
            self._kill_point_command = None
            point.event("far", command)
        return message(self)

    channel.Channel.request, channel.Channel.message = traced_request, traced_message


def _arm() -> None:
    spec = os.environ.pop("TETHER_KILL_POINT", "")  # popped: children (the far side, the launcher) run unarmed
    if not spec:
        return
    point = KillPoint(json.loads(spec))
    sys.addaudithook(point.audit)
    _watch_far_side(point)


_arm()
