"""Looking at a run from anywhere: status, tail, stop, check; and reading events as they grow."""

from __future__ import annotations

import collections
import json
import re
import sys
import time
from dataclasses import dataclass, fields
from typing import Any, Optional

from tether import manifest
from tether.backends.base import Report
from tether.errors import BackendError, RunError
from tether.paths import RunPaths
from tether.remote.fileio import json_lines
from tether.pipelines import plans, resuming
from tether.pipelines.session import Session, flag
from tether.remote.endings import words as signal_words
from tether.remote.protocol import ERROR, FAILED, PENDING, PREEMPTED, RUNNING, STALLED, Snapshot

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")  # colours and cursor moves (tqdm's nested bars)


class EventReader:
    """Reads events.jsonl from where it left off; only whole lines count."""

    def __init__(self, backend: Any, run: RunPaths, name: str = "events.jsonl") -> None:
        self.far, self.path, self.offset = backend.far, run.remote_file(name), 0
        self.last: dict[str, dict] = {}  # the newest event of each kind

    def read_bytes(self) -> bytes:
        try:
            data = self.far.cat(self.path, self.offset)
        except FileNotFoundError:
            return b""
        except BackendError as err:
            raise BackendError(f"lost the far side while reading {self.path}: {err}") from err
        end = data.rfind(b"\n") + 1
        self.offset += end
        return data[:end]

    def read(self) -> list[dict]:
        events = json_lines(self.read_bytes())[0]  # a trainer's junk or a torn line must not stop the watch
        for event in events:
            self.last[event.get("event", "")] = event
        return events


class LastLine:
    """The newest non-empty line of a far-side log; each read costs one request and at most TAIL_BYTES."""

    TAIL_BYTES = 4096  # a screen line is far shorter; a log that grew by megabytes is not read whole

    def __init__(self, backend: Any, run: RunPaths, name: str = "train.log") -> None:
        self.far, self.path, self.offset, self.line = backend.far, run.remote_file(name), 0, ""

    def read(self) -> str:
        try:
            data, start = self.far.tail(self.path, self.TAIL_BYTES, self.offset)
        except FileNotFoundError:
            return self.line
        except BackendError as err:
            raise BackendError(f"lost the far side while reading {self.path}: {err}") from err
        self.offset = start + len(data)
        lines = [_printable(p) for p in re.split(r"[\r\n]", data.decode(errors="replace"))]
        self.line = next((line for line in reversed(lines) if line), self.line)
        return self.line


def _printable(text: str) -> str:
    """A log line without terminal escapes or control characters, its spaces collapsed."""
    return " ".join("".join(c for c in ANSI.sub("", text) if c.isprintable()).split())


def tail_text(far: Any, run: RunPaths, name: str = "train.log", lines: int = 20) -> str:
    """The last `lines` lines of a far-side file (empty when it does not exist)."""
    try:
        text = far.tail(run.remote_file(name), 16384)[0].decode(errors="replace")
    except FileNotFoundError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


@dataclass(frozen=True)
class RunStatus:
    """What `status` reports of one run; `as_dict()` is `doit status json=1`'s object, key for key."""

    run_id: str
    status: str  # the run's state: pending, running, completed, failed, stopped, preempted, ...
    backend: str
    host: Optional[str]
    step: Optional[int]
    total: Optional[int]  # the step count the trainer announced (its step events' total_steps)
    loss: Optional[float]  # the last step event's loss
    heartbeat_age_s: Optional[float]  # the launcher's: "it is alive"
    elapsed_s: Optional[float]
    attempt: Optional[int]
    restarts: Optional[int]
    exit_code: Optional[int]
    where: str  # the run dir on the far side
    metric: dict[str, float]  # the last epoch event's numbers (accuracy, ...)
    queue: Optional[str]  # the scheduler's state text (queue_text); None off a scheduler
    resume_from: Optional[dict]  # the run this one was seeded from (resume_from=ID)
    signal: Optional[str]
    reason: Optional[str]
    output_age_s: Optional[float]  # the trainer's last output or event: "it is making progress"
    gpus: Optional[str]
    far_side: tuple[str, ...]  # what the far side will do next, in words (plans.far_side_words)

    @property
    def metrics(self) -> dict[str, float]:
        """The last epoch metrics (the same as `metric`, the JSON's key)."""
        return self.metric

    def as_dict(self) -> dict[str, Any]:
        """The JSON object of `doit status json=1`."""
        found = {f.name: getattr(self, f.name) for f in fields(self)}
        return dict(found, far_side=list(self.far_side))


def summary(s: Session, run: RunPaths, snap: Snapshot) -> RunStatus:
    """What `status` reports: state, step, last loss, the launcher's and the trainer's ages, where, how
    long, and what the far side will do next (plans.far_side_words)."""
    reader = EventReader(s.backend, run)
    events = reader.read()
    state = snap.state
    step = reader.last.get("step", {})
    losses = [e["loss"] for e in events if e.get("event") == "step" and isinstance(e.get("loss"), (int, float))]
    epoch = {k: v for k, v in reader.last.get("epoch", {}).items()
             if k not in ("event", "t", "step", "epoch") and isinstance(v, (int, float))}
    started, ended = state.get("started_at"), state.get("ended_at")
    elapsed = ((ended or snap.now or time.time()) - started) if started else None
    refused = [f"not started: {state['refused']}"] if state.get("refused") and snap.status == PENDING else []
    return RunStatus(
        run_id=run.run_id, status=snap.status, backend=s.job.backend, host=state.get("host"),
        step=step.get("step"), total=step.get("total_steps"),
        loss=losses[-1] if losses else None,  # a bar position read from the output carries none
        heartbeat_age_s=snap.heartbeat_age_s, elapsed_s=round(elapsed, 1) if elapsed else None,
        attempt=state.get("attempt"), restarts=state.get("restarts"), exit_code=state.get("exit_code"),
        where=run.remote_abs, metric=epoch, queue=queue_text(snap), resume_from=s.record(run).get("resume_from"),
        signal=state.get("signal"), reason=state.get("reason"), output_age_s=snap.output_age_s,
        gpus=gpus_text(state), far_side=tuple(plans.far_side_words(snap) + refused))


def gpus_text(state: dict) -> Optional[str]:
    """The GPUs the run got, `0,1 (NVIDIA H200, NVIDIA H200)`, or `CPU (why)`; None when it chose none."""
    if state.get("gpus") is None:
        return None
    if not state["gpus"]:
        return f"CPU ({state['gpus_on_cpu']})" if state.get("gpus_on_cpu") else "CPU"
    names = ", ".join(state.get("gpu_names") or [])
    return ",".join(map(str, state["gpus"])) + (f" ({names})" if names else "")


def queue_text(snap: Snapshot) -> Optional[str]:
    """The queue's view, e.g. `job 12_3 PENDING (Priority)` or `job 12 RUNNING on node07` (SLURM),
    or the backend's own words (`queue["text"]`: queued for agent NAME ...); None without a queue."""
    queue = snap.queue
    if snap.queue_error and snap.job_id is None:  # a report that did not come (an agent's): decide nothing
        return f"{snap.queue_error}; waiting for its next report (the run is left alone)"
    if snap.queue_error:  # the scheduler did not answer: say so, decide nothing
        return f"job {snap.job_id}: {snap.queue_error}; waiting for the scheduler (the job is left alone)"
    if not queue:
        return None
    if queue.get("text"):
        return queue["text"]
    reason = f" ({queue['reason']})" if queue.get("reason") not in (None, "", "None") else ""
    text = f"RUNNING on {queue['nodes']}" if queue["state"] == "RUNNING" else f"{queue['state']}{reason}"
    return f"job {snap.job_id} {text}"


def show_status(s: Session, info: RunStatus) -> None:
    """Print a run's RunStatus as `doit status` does: as JSON (json=1), or as lines."""
    if flag(s.variables, "json"):
        print(json.dumps(info.as_dict(), sort_keys=True))
        return
    ended = signal_words({"signal": info.signal}) if info.status in (FAILED, PREEMPTED, STALLED) else ""
    ended = "; ".join(filter(None, (info.reason, ended)))
    print(f"{info.run_id}: {info.status}" + (f" ({ended})" if ended else ""))
    for line in filter(None, [resuming.lineage({"resume_from": info.resume_from}), *info.far_side]):
        print(f"  {line}")
    for key in ("queue", "step", "loss", "heartbeat_age_s", "output_age_s", "elapsed_s", "restarts", "exit_code",
                "host", "gpus", "where"):
        if getattr(info, key) is not None:
            print(f"  {key:16} {getattr(info, key)}")


def sweep_status(s: Session) -> None:
    """One line per sweep point (state, step, last loss and metric, verified here), then a summary;
    every point's far-side state comes from one round trip."""
    found = []
    for point in s.points:
        try:
            found.append((point, point.observed()))
        except RunError:
            found.append((point, None))
    runs = [run for _, run in found if run]
    snaps = s.backend.states(runs) if runs else {}
    rows = []
    for point, run in found:
        info = summary(point, run, snaps[run.run_id]).as_dict() if run else {"run_id": None, "status": "not started"}
        info.update(point=point.point.label, verified=bool(run) and manifest.still_verified(run))
        rows.append(info)
    counts = collections.Counter(r["status"] for r in rows)
    verified = sum(r["verified"] for r in rows)
    line = (f"{len(rows)} points: " + ", ".join(f"{n} {status}" for status, n in counts.most_common())
            + f"; {verified} verified here")
    if flag(s.variables, "json"):
        print(json.dumps({"points": rows, "summary": line}, sort_keys=True))
        return
    width = max(len(r["point"]) for r in rows)
    for r in rows:
        print(f"{r['point']:{width}}  {_row(r)}")
    print(line)


def _row(r: dict) -> str:
    parts = [r["status"]] + ([r["queue"]] if r.get("queue") else [])
    if r.get("step") is not None:
        parts.append(f"step {r['step']}")
    if isinstance(r.get("loss"), (int, float)):
        parts.append(f"loss {r['loss']:.4g}")
    parts += [f"{k} {v:.4g}" for k, v in sorted((r.get("metric") or {}).items())]
    if r["verified"]:
        parts.append("verified")
    return "  ".join(parts) + (f"  {r['run_id']}" if r["run_id"] else "")


def tail(s: Session, poll_s: float = 0.5) -> None:
    """Print train.log from the start, following it until the run is terminal."""
    run = s.observed()
    reader = EventReader(s.backend, run, "train.log")
    while True:
        snap = s.snapshot(run, fresh=True)
        sys.stdout.write(reader.read_bytes().decode(errors="replace"))
        sys.stdout.flush()
        if snap.status not in (RUNNING, PENDING) and not (snap.alive and not snap.final):  # not mid-restart
            sys.stdout.write(reader.read_bytes().decode(errors="replace"))
            print(f"[run {run.run_id} is {snap.status}]")
            return
        time.sleep(poll_s)


def stop(s: Session) -> str:
    run = s.observed()
    outcome = s.backend.stop(run, s.job.grace_seconds)
    if outcome.outcome == ERROR:
        raise BackendError(f"stop of {run.run_id}: {outcome.error}: look at them with `ps -o pid,pgid,cmd`")
    return f"{run.run_id}: {outcome.outcome}"


def preflight(s: Session) -> Report:
    """The backend's preflight: this tether's launcher installed there, the far side prepared and checked
    against what the trainer requires. Not being ready is the report's `.ready`, no error."""
    s.backend.install_launcher()
    s.backend.prepare()
    return s.backend.check(s.job.trainer.requires())


def show_check(s: Session, report: Report) -> None:
    """Print a preflight as `doit check` does (json=1: as JSON); BackendError when it is not ready."""
    print(json.dumps(report.as_dict(), sort_keys=True) if flag(s.variables, "json") else report.text())
    if not report.ready:
        raise BackendError(f"backend {s.job.backend} is not ready: fix the checks marked NO")


def prune(s: Session) -> str:
    """Remove far-side objects that no run (on that backend) references any more."""
    found = s.backend.prune()
    foreign = found["foreign"]  # files under objects/ that tether did not write: never removed
    return (f"backend {s.job.backend}: removed {found['removed']} unreferenced objects "
            f"({found['bytes']} bytes); kept {found['kept']}"
            + (f"; left alone {foreign} files under objects/ that tether did not write" if foreign else ""))
