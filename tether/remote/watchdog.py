"""Ends an attempt that runs past the run's wall time, or that shows no sign of life for too long.

Stdlib only, Python >= 3.8 (copied to the far side with the launcher). A sign of life is the
trainer's: a new byte in train.log (its own output, a tqdm bar's redraw included) or a new line in
events.jsonl. The launcher's heartbeat is not one: it only says the launcher lives.
"""

from __future__ import annotations

import os
import time
from typing import Any, Dict, Optional, Tuple

from tether.remote.protocol import STALLED, STOPPED
from tether.remote.rundir import run_file

WALL = "wall time exceeded"  # the reason recorded with `stopped`


def _mark(path: str) -> Tuple[int, int]:
    try:
        found = os.stat(path)
    except OSError:
        return (-1, 0)
    return (found.st_size, found.st_mtime_ns)


def output_age_s(run_dir: str) -> Optional[float]:
    """Seconds since the trainer's last output or event (None before either exists)."""
    times = []
    for name in ("train.log", "events.jsonl"):
        try:
            times.append(os.stat(run_file(run_dir, name)).st_mtime)
        except OSError:
            pass
    return round(time.time() - max(times), 3) if times else None


class Watchdog:
    """Checked every poll of an attempt: which limit, if any, ends it now."""

    def __init__(self, run_dir: str, controls: Dict[str, Any], wall_since: float) -> None:
        wall = controls.get("max_wall_seconds")
        self.deadline = wall_since + float(wall) if wall else None
        self.stall_s = float(controls["stall_timeout_s"]) if controls.get("stall_timeout_s") else None
        self.files = [run_file(run_dir, name) for name in ("train.log", "events.jsonl")]
        self.marks = [_mark(path) for path in self.files]
        self.alive_at = time.time()
        self.verdict = None  # type: Optional[Dict[str, Any]]

    def check(self) -> Optional[Dict[str, Any]]:
        """{"status", "reason"} the first time a limit is passed (then None: it was said once)."""
        if self.verdict is not None:
            return None
        now = time.time()
        marks = [_mark(path) for path in self.files]
        if marks != self.marks:
            self.marks, self.alive_at = marks, now
        if self.deadline is not None and now >= self.deadline:
            self.verdict = {"status": STOPPED, "reason": WALL}
        elif self.stall_s is not None and now - self.alive_at >= self.stall_s:
            self.verdict = {"status": STALLED,
                            "reason": "no output and no event for %.0f s (stall_timeout_s)" % self.stall_s}
        return self.verdict
