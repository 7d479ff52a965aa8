"""Progress from a trainer's own output: lines of train.log turned into `step` events (stdlib only).

Copied to the far side with the launcher (Python >= 3.8). `trainer.progress` is a preset name or
a regular expression with named groups, searched in every line (split at `\\n` and at `\\r`, since
tqdm redraws its bar with `\\r`):

    tqdm   a bar's `N/M [` gives step and total_steps, its postfix `loss=2.31, lr=3e-4` the metrics
    dict   tqdm's bars, and a line like `{'loss': 2.31, 'learning_rate': 3e-4, 'epoch': 0.5}` (as
           Hugging Face's Trainer prints them) gives the metrics; its step is the line's `step` or
           `global_step` key, else the bar's position (the Trainer draws one), else the count of
           such lines so far

When several tqdm bars share the output (an evaluation bar inside the training bar), the one with
the largest total is followed: a script whose main bar is not the longest needs its own regex.
A group named `step` becomes an int, `total_steps` an int, every other group a float where it
parses (a group whose text is no number is left out). Events are rate-limited (RATE_S): lines
with metrics and bare bar positions each have their own budget, and the newest of each is
always written when the trainer ends.
"""

from __future__ import annotations

import ast
import json
import math
import re
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

from tether.remote.fileio import append_line

# tqdm redraws many times a second and a script may print a loss every step: a live bar needs two
# events a second, a curve four points a second (about 1.5 MB of events an hour, read by watch).
RATE_S = {"bar": 0.5, "metrics": 0.25}
MAX_LINE = 2000  # longer lines are cut: a regex on an endless line must not stall the launcher
READ_CHUNK = 65536
POLL_S = 0.2  # how often the tail looks for new bytes in train.log
RESERVED = ("event", "t", "source")  # an event's own keys: never overwritten by a metric of the same name
PRESETS = ("tqdm", "dict")
BAR = re.compile(r"(?<![\d.])(\d+)/(\d+) \[([^\]]*)\]")  # tqdm: `45/100 [00:01<00:01, 40.1it/s, loss=2.3]`
POSTFIX = re.compile(r"([A-Za-z_][\w.]*)=([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)")
DICT_LINE = re.compile(r"\{\s*['\"][^{}]*\}")  # a printed dict with string keys: `{'loss': 2.31, ...}`
PAIR = re.compile(r"['\"](\w+)['\"]:\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)")  # when a value is no literal
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")  # cursor moves of nested tqdm bars

Fields = Dict[str, Any]


def problems(progress: Optional[str], total_steps: Union[int, str, None]) -> List[str]:
    """What is wrong with a `progress:` setting (empty when nothing is): checked before any launch."""
    if progress is None:
        return ["trainer.total_steps needs trainer.progress (the steps come from the script's output)"] \
            if total_steps is not None else []
    if progress in PRESETS:
        if isinstance(total_steps, str) and progress == "tqdm":
            return ["trainer.total_steps: the tqdm preset reads the total from the bar; give a number or leave it out"]
        return []
    try:
        pattern = re.compile(progress)
    except re.error as err:
        return ["trainer.progress: '%s' is not a regular expression (%s): fix it, or use a preset: %s"
                % (progress, err, ", ".join(PRESETS))]
    found = []
    if "step" not in pattern.groupindex:
        found.append("trainer.progress: '%s' names no step: add a group (?P<step>\\d+), or use a preset: %s"
                     % (progress, ", ".join(PRESETS)))
    if isinstance(total_steps, str) and total_steps not in pattern.groupindex:
        found.append("trainer.total_steps: %r is no group of trainer.progress: add (?P<%s>\\d+) to it, "
                     "or give a number" % (total_steps, total_steps))
    if isinstance(total_steps, int) and total_steps <= 0:
        found.append("trainer.total_steps must be a positive number, not %d" % total_steps)
    return found


def number(text: str) -> Optional[float]:
    """A group's text as a number (`2.31`, `3e-4`, `1,024`), or None: events carry numbers only."""
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


class Parser:
    """Turns lines of output into step fields, following one setting (a preset or a regex)."""

    def __init__(self, progress: str, total_steps: Union[int, str, None] = None) -> None:
        self.total_steps = total_steps
        self.bar_total = 0  # the largest bar total seen: the bar that is followed
        self.bar_step: Optional[int] = None
        self.lines = 0  # dict lines so far: the step of last resort
        self.pattern = None if progress in PRESETS else re.compile(progress)
        self.parse: Callable[[str], Optional[Fields]] = {"tqdm": self._tqdm, "dict": self._dict}.get(
            progress, self._regex)

    def feed(self, line: str) -> Optional[Fields]:
        """The step fields one line gives (step, total_steps, metrics), or None when it gives none."""
        found = self.parse(ANSI.sub("", line[:MAX_LINE]).strip())
        if not found or not isinstance(found.get("step"), int):
            return None
        total = self.total_steps if isinstance(self.total_steps, int) else found.get("total_steps")
        if isinstance(self.total_steps, str):
            total = found.pop(self.total_steps, None)
        found.pop("total_steps", None)
        if isinstance(total, (int, float)) and total > 0:
            found["total_steps"] = int(total)
        return found

    def _regex(self, line: str) -> Optional[Fields]:
        match = self.pattern.search(line) if self.pattern else None
        if not match or match.group("step") is None:
            return None
        fields = {k: number(v) for k, v in match.groupdict().items() if v is not None and k not in RESERVED}
        fields = {k: v for k, v in fields.items() if v is not None}
        step = fields.get("step")
        fields["step"] = int(step) if step is not None and math.isfinite(step) else None
        return fields

    def _bar(self, line: str) -> Optional[Fields]:
        """The followed bar's position and postfix metrics in this line, if it draws that bar."""
        bars = [m for m in BAR.finditer(line) if int(m.group(2)) > 0]
        if not bars:
            return None
        bar = max(bars, key=lambda m: int(m.group(2)))
        step, total = int(bar.group(1)), int(bar.group(2))
        if total < self.bar_total:
            return None  # an inner bar (evaluation): not the run's steps
        self.bar_total, self.bar_step = total, step
        fields: Fields = {k: float(v) for k, v in POSTFIX.findall(bar.group(3)) if k not in RESERVED}
        fields.update(step=step, total_steps=total)
        return fields

    def _tqdm(self, line: str) -> Optional[Fields]:
        return self._bar(line)

    def _dict(self, line: str) -> Optional[Fields]:
        match = DICT_LINE.search(line)
        values = _literal_dict(match.group(0)) if match else None
        if values is None and match:  # `'grad_norm': tensor(1.2)` is no literal: keep the plain numbers
            values = {k: float(v) for k, v in PAIR.findall(match.group(0))} or None
        if values is None:
            return self._bar(line)  # the bar moves between logs (every 500 steps by default in the Trainer)
        self.lines += 1
        fields = {k: float(v) for k, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
                  and k not in RESERVED}
        own = values.get("step", values.get("global_step"))
        step = own if isinstance(own, int) and not isinstance(own, bool) else self.bar_step
        fields.pop("global_step", None)
        fields["step"] = step if step is not None else self.lines
        if self.bar_total and "total_steps" not in fields:
            fields["total_steps"] = self.bar_total
        return fields


def _literal_dict(text: str) -> Optional[Dict[str, Any]]:
    """A printed dict of plain values, read safely (ast.literal_eval: no code runs), or None."""
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return None
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        return None
    return value


def split_lines(buffer: bytes, data: bytes) -> Tuple[List[str], bytes]:
    """Whole lines of `buffer + data` (ended by \\n or \\r) and the unfinished rest, kept under MAX_LINE."""
    text = buffer + data
    parts = re.split(rb"[\r\n]", text)
    rest = parts.pop()
    if len(rest) > MAX_LINE:  # a line without an end: parse what we have, drop the rest of it
        parts.append(rest[:MAX_LINE])
        rest = b""
    return [p.decode("utf-8", "replace") for p in parts if p.strip()], rest


class Tail:
    """A thread that follows train.log from an offset and appends step events to events.jsonl.

    It reads the log the trainer writes, rather than sitting between the trainer and the log on a
    pipe: a launcher that dies (SIGKILL, OOM) then costs only progress events, never the
    trainer's output or the trainer itself (a pipe with no reader kills the writer with SIGPIPE).
    """

    def __init__(self, log_path: str, events_path: str, parser: Parser, offset: int) -> None:
        self.log_path, self.events_path, self.parser, self.offset = log_path, events_path, parser, offset
        self.buffer = b""
        self.pending: Dict[str, Fields] = {}  # "bar" and "metrics": the newest not yet written of each
        self.written: Dict[str, float] = {}
        self.last_step = 0
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.closed = False  # once set, nothing more is written: the seal may read events.jsonl
        self.thread = threading.Thread(target=self._follow, daemon=True)

    def start(self) -> "Tail":
        LIVE.append(self)
        self.thread.start()
        return self

    def finish(self, timeout_s: float = 5.0) -> None:
        """Read the log to its end, write the newest pending events, and stop writing for good."""
        self.done.set()
        self.thread.join(timeout_s)
        with self.lock:
            self.closed = True
        if self in LIVE:
            LIVE.remove(self)

    def _follow(self) -> None:
        try:
            with open(self.log_path, "rb") as log:
                log.seek(self.offset)
                while True:
                    ending = self.done.is_set()  # read once more after the trainer ended: its last lines
                    data = log.read(READ_CHUNK)
                    self._take(data, final=ending and not data)
                    if ending and not data:
                        return
                    if not data:
                        self.done.wait(POLL_S)
        except Exception as err:  # progress is a nicety: it never ends the run
            self._append({"event": "progress_error", "error": "%s: %s" % (type(err).__name__, err)})

    def _take(self, data: bytes, final: bool) -> None:
        lines, self.buffer = split_lines(self.buffer, data)
        if final and self.buffer.strip():
            lines.append(self.buffer.decode("utf-8", "replace"))
            self.buffer = b""
        for line in lines:
            fields = self.parser.feed(line)
            if fields is not None:
                self.pending["metrics" if set(fields) - {"step", "total_steps"} else "bar"] = fields
        self._flush(force=final)

    def _flush(self, force: bool) -> None:
        """Write what is pending, each kind at most once per RATE_S[kind] (all of it when forced)."""
        now = time.time()
        due = [k for k in ("metrics", "bar") if k in self.pending
               and (force or now - self.written.get(k, 0.0) >= RATE_S[k])]
        for kind in sorted(due, key=lambda k: self.pending[k]["step"]):
            fields = self.pending.pop(kind)
            if kind == "bar" and fields["step"] < self.last_step:
                continue  # a log line at a later step went out first: the bar never moves back
            self.written[kind], self.last_step = now, max(self.last_step, fields["step"])
            self._append(dict(fields, event="step", source="progress"))

    def _append(self, record: Fields) -> None:
        with self.lock:
            if not self.closed:
                append_event(self.events_path, record)


def append_event(events_path: str, record: Fields) -> None:
    """Append one event with its time to events.jsonl."""
    line = (json.dumps(dict(record, t=round(time.time(), 3)), sort_keys=True) + "\n").encode()
    append_line(events_path, line)  # one write of one line: never mixed with the launcher's own events


LIVE: List[Tail] = []  # started and not finished: the launcher's own failure ends them before it seals


def finish_all() -> None:
    """Finish every live Tail (the launcher failed mid-attempt and is about to seal)."""
    for tail in list(LIVE):
        tail.finish(timeout_s=1.0)


def follow(log_path: str, events_path: str, spec: Dict[str, Any], offset: int) -> Optional[Tail]:
    """A started Tail from `offset` (this attempt's first byte) for run.json's `progress`, or None."""
    setting = spec.get("progress")
    if not setting:
        return None
    try:
        parser = Parser(setting, spec.get("total_steps"))
    except (re.error, TypeError) as err:  # checked on the laptop, but this Python's `re` may differ
        append_event(events_path, {"event": "progress_error", "error": "%s: %s" % (type(err).__name__, err)})
        return None
    return Tail(log_path, events_path, parser, offset).start()
