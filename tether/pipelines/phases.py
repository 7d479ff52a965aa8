"""The phases up to verify as plain functions over a Session (down: tether.pipelines.teardown); each
decides from stamps and far-side state.

Every phase is idempotent: it first asks whether its work is already done (a local stamp, the
far side's files), so a doit process killed at any point loses nothing when run again.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from typing import Any, Callable

from tether import manifest
from tether.config import asdict
from tether.errors import BackendError, RemoteCommandError, RunError
from tether.paths import RunPaths
from tether.pipelines import plans, resuming, transfer
from tether.pipelines.observe import EventReader, LastLine, queue_text, tail_text
from tether.pipelines.session import Session, flag
from tether.remote.fileio import atomic_write_json, read_json
from tether.remote.protocol import (ALREADY_RUNNING, CANCELLED, COMPLETED, ENDED_BADLY, ERROR, FAILED, FINISHED,
                                    LOST, PENDING, PREEMPTED, RUNNING, STALLED, STARTED, STOPPED, Snapshot)
from tether.remote.rundir import restart_allowed


RECONNECT_MAX_S = 30.0  # backoff ceiling while the far side is unreachable


def write_stamp(run: RunPaths, phase: str, **fields) -> None:
    atomic_write_json(run.stamp(phase), dict(fields, phase=phase, at=round(time.time(), 3)))


def up_slice(s: Session) -> str:
    """What `up` depends on: the backend's config and the launcher's version."""
    parts = [s.job.backend, asdict(s.backend.config), s.backend.version]
    if s.backend.environment.venv:  # a new venv means a new preflight (a job without one keeps its stamp)
        parts.append(s.backend.environment.request())
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


# ------------------------------------------------------------------ is it done already?


def up_stamp(s: Session) -> str:
    """up's stamp belongs to the backend's config, not to a run: a new run of a ready backend skips it."""
    return os.path.join(s.state_dir, "backends", f"{s.job.backend}-{up_slice(s)[:16]}.json")


def up_done(s: Session) -> bool:
    return os.path.exists(up_stamp(s))


def push_done(s: Session) -> bool:
    run = s.current()
    return run is not None and os.path.exists(run.stamp("push"))


def launch_done(s: Session) -> bool:
    run = s.current()
    if run is None or not os.path.exists(run.stamp("launch")):
        return False
    if flag(s.variables, "retry"):
        return False  # launch decides: it relaunches an ended run, or refuses retry=1 of a completed one
    if watch_done(s):
        return True
    snap = s.snapshot(run)
    queued = snap.status == PENDING and snap.queue  # waiting in the scheduler's queue
    ended = snap.final and snap.status == COMPLETED  # stopped: resumed; failed: refused
    restarting = snap.alive and not snap.final  # its launcher waits out a restart's backoff
    return snap.status == RUNNING or ended or bool(queued) or restarting


def watch_done(s: Session) -> bool:
    run = s.current()
    if run is None:
        return False
    return resuming.verified_complete(run) or (read_json(run.stamp("watch")) or {}).get("status") == COMPLETED


def pulled_done(s: Session) -> bool:
    try:
        return manifest.still_verified(s.observed())
    except RunError:
        return False


# ------------------------------------------------------------------ the phases


def up(s: Session) -> str:
    """Preflight the backend and copy the launcher there (once per version); no run is needed yet."""
    copied = s.backend.install_launcher()
    s.backend.prepare()
    report = s.backend.check(s.job.trainer.requires())
    if not report.ready:
        raise BackendError(report.text() + "\nfix the checks marked NO, then run `doit run train` again")
    atomic_write_json(up_stamp(s), {"slice": up_slice(s), "launcher": s.backend.version,
                                    "report": report.as_dict(), "at": round(time.time(), 3)})
    return f"backend {s.job.backend} ready" + (" (launcher copied)" if copied else "")


def push(s: Session) -> str:
    """Upload what the far side's object store lacks and build the run's frozen snapshot: one request."""
    run = s.run()
    unique = {e.sha256: e for e in s.entries}
    listing = [{"root": e.root, "path": e.path, "sha256": e.sha256, "mode": e.mode} for e in s.entries]
    sent: dict[str, int] = {}

    def send(need: list[str], out: Any) -> None:
        sendable = [h for h in need if unique[h].local]  # a reproduction's absent data: the far side must have it
        total = sum(unique[h].size for h in sendable)
        with transfer.bar(total, "push") as progress:
            transfer.tar_into(out, [(h, unique[h].local) for h in sendable], progress.update)
        sent.update(files=len(sendable), bytes=total)

    done = s.backend.far.push(f"{s.backend.remote_dir}/objects", run.remote_abs, listing, send,
                              s.backend.stall_timeout_s)
    if done.bad:
        raise BackendError(f"the far side refused {done.bad[:3]}: the files changed while being pushed? "
                           f"run the push again")
    if done.missing:  # a reproduction counted on objects the far side had a moment ago
        gone = sorted({unique[h].path for h in done.missing})
        raise BackendError(f"{', '.join(gone)}: not here, and no longer on the far side: put the files back")
    write_stamp(run, "push", files=len(s.entries), sent=sent.get("files", 0), bytes_sent=sent.get("bytes", 0))
    what = f"built {' and '.join(done.built)}" if done.built else "snapshot already there"
    return (f"{run.run_id}: pushed {sent.get('files', 0)} of {len(s.entries)} files ({sent.get('bytes', 0)} bytes); "
            f"{what}")


def ensure_sealed(s: Session, run: RunPaths, snap: Snapshot) -> bool:
    """Whether the run's manifest exists; seals it when its launcher died between "final" and the seal."""
    if snap.sealed:
        return True
    if snap.final and not snap.alive:
        s.backend.far.seal(run.remote_abs)
        return True
    return False


def launch(s: Session) -> str:
    """Start the run detached, unless it is running or has ended (then only record that)."""
    run = s.run()
    snap = s.snapshot(run, fresh=True)
    # An ended run runs again only by an explicit verb: a stopped one resumes, retry=1 relaunches a
    # failed one; relaunch() refuses the rest in one line, or answers "" (completed: left alone).
    retry = flag(s.variables, "retry")
    if snap.final and snap.status not in (STOPPED, COMPLETED) and not retry:
        raise RunError(_ended_message(s, run, snap))  # failed or preempted: never relaunched silently
    reopened = resuming.relaunch(s, run, snap, retry) if snap.final else "open"
    if snap.status == RUNNING or reopened in ("", RUNNING):
        write_stamp(run, "launch", outcome="already " + snap.status)
        return f"{run.run_id}: already {snap.status}; not launched again"
    if s.backend.launches_arrays and s.siblings:
        return _launch_array(s)
    _record_launch(s, run, snap)
    result = s.backend.launch(run)
    if result.outcome == ERROR:
        log = tail_text(s.backend.far, run, "launcher.log")
        raise BackendError(f"{run.run_id}: the launcher did not start: {result.error}\n{log}")
    s.forget_snapshot(run)
    write_stamp(run, "launch", outcome=result.outcome, attempt=result.attempt)
    if result.message:
        return f"{run.run_id}: {result.message}"
    verb = {STARTED: "launched", ALREADY_RUNNING: "already running", FINISHED: "already finished"}
    which = f"SLURM job {result.job_id}" if result.job_id else f"attempt {result.attempt}"
    return f"{run.run_id}: {verb[result.outcome]} ({which})"


def _record_launch(s: Session, run: RunPaths, snap: Snapshot) -> None:
    """run.json, here and on the far side, with the artifact roster and the far side's controls as of launch."""
    if snap.status in ("absent", PENDING):
        record = dict(s.record(run), artifacts=list(s.job.artifacts), controls=s.controls())
        atomic_write_json(run.run_json, record)
        s.backend.far.put(run.remote_file("run.json"), json.dumps(record, indent=2, sort_keys=True).encode())


def _launch_array(s: Session) -> str:
    """Every pushed point of the sweep in one job array (the far side adopts what already has a job)."""
    pushed = [(point, point.current()) for point in s.siblings]
    pushed = [(point, run) for point, run in pushed if run and os.path.exists(run.stamp("push"))]
    snaps = s.backend.states([run for _, run in pushed])
    for point, run in pushed:
        _record_launch(point, run, snaps[run.run_id])
    results = s.backend.launch_many([run for _, run in pushed], s.job.name)
    for point, run in pushed:
        point.forget_snapshot(run)
        write_stamp(run, "launch", outcome=results[run.run_id].outcome, job_id=results[run.run_id].job_id)
    mine = results[s.run().run_id]
    return f"{s.run().run_id}: {mine.outcome} (SLURM job {mine.job_id})"


def watch(s: Session, poll_min: float = 0.2, deadline: float | None = None) -> str:
    """Follow the run's events with a progress bar until it ends; Ctrl-C leaves it running.

    `deadline` (time.monotonic()): StillGoing (a TimeoutError) once it passes with the run still going (it goes on).
    """
    from tqdm import tqdm

    run = s.run()
    reader, log = EventReader(s.backend, run), LastLine(s.backend, run)
    poll_max = s.backend.poll_interval_s
    interval, lost_since, seen = poll_min, None, {}
    label = s.point.label if s.point else "train"
    with tqdm(desc=label, unit="step", file=sys.stderr, dynamic_ncols=True, bar_format="{desc}") as progress:
        while True:
            try:
                snap = s.snapshot(run, fresh=True)
                events = reader.read()
                line = log.read() if "step" not in reader.last else None  # no steps: what the log says
            except BackendError as err:  # the far side is unreachable, not the run dead: wait and retry
                lost_since = lost_since or time.monotonic()
                interval = min(RECONNECT_MAX_S, max(1.0, interval * 2))
                progress.write(f"{run.run_id}: {err}; retrying in {interval:.0f}s (the run goes on; Ctrl-C to leave it)",
                               file=sys.stderr)
                s.backend.reconnect()
                _check_deadline(run, deadline)
                time.sleep(interval)
                continue
            if lost_since is not None:
                progress.write(f"{run.run_id}: reconnected after {time.monotonic() - lost_since:.0f}s", file=sys.stderr)
                lost_since = None
            if line is None:
                _show(progress, reader, events, label)
            else:
                _show_waiting(progress, label, snap, line)
            _show_queue(progress, run, snap, seen)
            _show_far_side(progress, run, snap, seen)
            if snap.final and ensure_sealed(s, run, snap):
                break  # final and sealed: pull can start
            if snap.status in ENDED_BADLY and not snap.alive and not snap.queue_error and _settled(s, snap, seen):
                _restart(s, run, snap)  # no launcher left to restart it: the policy is applied from here
            _check_health(s, run, snap)
            interval = poll_min if events else min(poll_max, interval * 1.5)
            _check_deadline(run, deadline)
            time.sleep(interval)
    state = snap.state
    write_stamp(run, "watch", status=snap.status, exit_code=state.get("exit_code"))
    if snap.status != COMPLETED:
        raise RunError(_ended_message(s, run, snap))
    return f"{run.run_id}: completed after {state.get('ended_at', 0) - state.get('started_at', 0):.1f}s"


class StillGoing(TimeoutError):
    """A watch's deadline passed with the run still going: the watch ends, the run does not."""


def _check_deadline(run: RunPaths, deadline: float | None) -> None:
    """StillGoing (a TimeoutError) once `deadline` has passed: the watch ends, the run does not."""
    if deadline is not None and time.monotonic() >= deadline:
        raise StillGoing(f"run {run.run_id} has not ended yet; it goes on: wait again, or look with "
                           f"`doit status run={run.run_id}`")


def _show(progress, reader: EventReader, events: list[dict], label: str) -> None:
    """The bar at the newest step event; loss and lr stay shown until a newer event carries them."""
    step = reader.last["step"]
    if progress.bar_format is not None:  # the first step: from the log line to the bar
        progress.bar_format = None
        progress.set_description_str(label, refresh=False)
    total = step.get("total_steps")
    if total and progress.total != total:
        progress.total = total
    progress.n = step.get("step", progress.n)
    fields = {k: e[k] for e in events if e.get("event") == "step"  # the newest of each in this read
              for k in ("loss", "lr") if isinstance(e.get(k), (int, float))}
    if fields:  # a bar position read from the script's output carries no loss: keep the last one
        progress.set_postfix({k: f"{v:.4g}" for k, v in fields.items()}, refresh=False)
    progress.refresh()


def _show_waiting(progress, label: str, snap: Snapshot, line: str) -> None:
    """No step events (yet): the run's elapsed time and its latest log line, cut to the terminal."""
    state = snap.state
    started, until = state.get("started_at"), state.get("ended_at") or snap.now
    elapsed = progress.format_interval(max(0.0, until - started)) if started and until else "--:--"
    text = f"{label}: {snap.status} {elapsed}" + (f" | {line}" if line else "")
    width = shutil.get_terminal_size((80, 24)).columns - 1
    progress.set_description_str(text if len(text) <= width else text[:width - 3] + "...", refresh=True)


def _show_queue(progress, run: RunPaths, snap: Snapshot, seen: dict) -> None:
    """Print each change of the scheduler's view: PENDING (Priority), RUNNING on node07, ..."""
    text = queue_text(snap)
    if text and seen.get("queue") != text:
        seen["queue"] = text
        progress.write(f"{run.run_id}: {text}", file=sys.stderr)


def _show_far_side(progress, run: RunPaths, snap: Snapshot, seen: dict) -> None:
    """Print what the far side decided on its own (a planned restart, the stall before it), once each."""
    attempt = snap.state.get("attempt")
    for kind, line in (("plan", plans.restart_words(snap)), ("previous", plans.previous_words(snap))):
        if line and (kind, attempt) not in seen:
            seen[(kind, attempt)] = True
            progress.write(f"{run.run_id}: {line}", file=sys.stderr)


def _settled(s: Session, snap: Snapshot, seen: dict) -> bool:
    """A run that just vanished gets exit_grace_s for its final state to reach shared storage."""
    first = seen.setdefault(("ended", snap.status), time.monotonic())
    return time.monotonic() - first >= s.backend.exit_grace_s


def _restart(s: Session, run: RunPaths, snap: Snapshot) -> None:
    """Relaunch from the latest checkpoint when the restart policy allows it, else say what to do."""
    if snap.final:
        return  # it ended for good and its launcher is still sealing: watch waits for the manifest
    status, restarts = snap.status, int(snap.state.get("restarts") or 0)
    policy, most, spec = s.job.restart.policy, s.job.restart.max_restarts, {"restart": asdict(s.job.restart)}
    allowed = restart_allowed(status, spec, attempt=1)  # does the policy cover this end at all?
    if restart_allowed(status, spec, attempt=restarts + 1):
        result = s.backend.launch(run)
        print(f"\n{run.run_id}: {status}; relaunched from its latest checkpoint "
              f"(restart {restarts + 1} of at most {most}, {result.outcome})", file=sys.stderr)
        return
    scheduler = snap.scheduler or {}
    if status == CANCELLED:
        raise RunError(f"run {run.run_id}: SLURM job {snap.job_id} {scheduler.get('words')}; "
                       f"`doit run train` submits it again, resuming from its latest checkpoint")
    if status == LOST:
        why = (f"SLURM job {snap.job_id} {scheduler['words']} (exit code {scheduler.get('exit_code')})"
               if scheduler else "its launcher and trainer are gone without an exit record (machine rebooted?)")
        raise RunError(f"run {run.run_id} was lost: {why}, before it could checkpoint and exit. "
                       f"`doit run train` relaunches it from its latest checkpoint")
    why = f"restart policy {policy!r}" + (f", {restarts} of {most} restarts used" if allowed else "")
    saved = _checkpoint_words(snap.state)
    raise RunError(f"run {run.run_id} is {status} ({why}); {saved}: `doit run train` "
                   + ("resumes it from there" if snap.state.get("checkpoint") else "runs it again"))


def _ended_message(s: Session, run: RunPaths, snap: Snapshot) -> str:
    """watch's (and a refused relaunch's) account of a run that ended without completing."""
    log = tail_text(s.backend.far, run)
    return (f"run {run.run_id} {_ended_words(s, snap)}; the end of train.log:\n{log}\n"
            f"`doit pull run={run.run_id}` brings its files home")


def _ended_words(s: Session, snap: Snapshot) -> str:
    """How a run that will not run again ended, for watch's last line: whose failure, what it left."""
    state = snap.state
    if state.get("start_error"):
        return (f"failed: its trainer could not start: {state['start_error']}: install the program on the "
                f"far side (its PATH is the launcher's) and run `doit run train retry=1`, "
                f"or correct trainer.command")
    if state.get("launcher_error"):
        return (f"ended because the launcher failed: {state['launcher_error']} "
                f"(launcher.log has the traceback; please report it)")
    if state.get("resume_error"):
        return f"failed before its trainer started: {state['resume_error']}"
    if snap.status == STOPPED:
        why = (f"{state['reason']} (max_wall_seconds {s.job.max_wall_seconds:.0f}, counted from its first start)"
               if state.get("reason") else f"exit code {state.get('exit_code')}")
        return (f"stopped: {why}; {_checkpoint_words(state)}: "
                f"`doit run train` resumes it" + (" from there" if state.get("checkpoint") else ""))
    text = resuming.how_it_ended(snap)
    if snap.status in (PREEMPTED, STALLED):  # final: the restart policy will not resume it
        restart = s.job.restart
        used = f", {state.get('restarts', 0)} of {restart.max_restarts} restarts used" if restart.policy != "never" else ""
        text += f" and is not restarted (restart policy {restart.policy!r}{used})"
    if snap.status in (PREEMPTED, STALLED, FAILED):
        text += f"; {_checkpoint_words(state)}: {resuming.retry_hint(state)}"
    return text


def _checkpoint_words(state: dict) -> str:
    """What a run left to resume from, as the launcher recorded it (older launchers did not)."""
    return resuming.checkpoint_words(state)


def _check_health(s: Session, run: RunPaths, snap: Snapshot) -> None:
    """A launcher that stopped beating is reported (its own limits, max_wall_seconds and stall_timeout_s,
    are enforced on the far side)."""
    status, state = snap.status, snap.state
    if snap.queue_error and snap.job_id is None:  # the whole report is stale (an agent's): its ages prove nothing
        return
    age = snap.heartbeat_age_s
    beating = status == RUNNING and state.get("status") == RUNNING  # not a requeued job starting up
    if beating and age is not None and age > s.job.heartbeat_timeout_s:
        raise RunError(f"run {run.run_id}: no heartbeat for {age:.0f}s (heartbeat_timeout_s is "
                       f"{s.job.heartbeat_timeout_s:.0f}): the far side may be hung; `doit status` to look, "
                       f"`doit stop` to end it")


def pull(s: Session) -> str:
    """Fetch the far side's manifest, then every listed file not already here intact.

    Always asks the far side (one round trip): a manifest that changed there after this side
    verified it is pulled again, never answered with "up to date".
    """
    run = s.observed()
    verified = read_json(run.verified) if manifest.still_verified(run) else None
    try:
        data = far_manifest(s, run)
        if data is not None:
            s.backend.vouch(run, data)  # before anything of it is saved here
    except Exception as err:  # unreachable: what is verified here stays verified
        if verified is None or not s.backend.is_transport_error(err):
            raise
        return f"{run.run_id}: already pulled and verified (the far side did not answer: {err})"
    if data is None:
        if verified is not None:
            return f"{run.run_id}: already pulled and verified (the far side no longer has its run dir)"
        snap = s.snapshot(run, fresh=True)
        if ensure_sealed(s, run, snap):  # its launcher died between "final" and the seal
            return pull(s)
        raise RunError(f"run {run.run_id} is {snap.status} and has no manifest yet (it is sealed "
                       f"when the run ends): `doit run watch` waits for that")
    listed = manifest.parse_far(run, data)
    left = {e.path: s.backend.fetch_policy(e.path, e.bytes) for e in listed.files}
    left = {path: why for path, why in left.items() if why}
    if verified is not None and listed.sha256 == verified["manifest_sha256"] \
            and set(left) == set(verified["remote_only"]):  # a raised max_artifact_mb fetches what it left
        return f"{run.run_id}: already pulled and verified"
    for entry in listed.files:
        run.pulled(entry.path)  # refuses absolute paths and `..` before anything is written
    with transfer.room_for(run.run_id, run.local):
        warning = manifest.save_pulled(run, data)  # durably; a changed one ends the verification here
        if warning:
            print(warning)
        for path, why in sorted(left.items()):
            print(f"left on the far side: {path} ({why})")
        todo = [e for e in listed.files if e.path not in left
                and not transfer.matches(run.pulled(e.path), e.bytes, e.sha256)]
        total = sum(e.bytes for e in todo)
        _fetch(s, run, todo, total)
        write_stamp(run, "pull", manifest_sha256=listed.sha256, fetched=len(todo), bytes=total, left=left)
    _warn_roster(s, listed)
    return f"{run.run_id}: pulled {len(todo)} of {len(listed.files)} files ({total} bytes)"


def far_manifest(s: Session, run: RunPaths) -> bytes | None:
    """The far side's PULL_MANIFEST.json, or None when it has none."""
    try:
        return s.backend.far.cat(run.remote_file("PULL_MANIFEST.json"))
    except FileNotFoundError:
        return None


def _fetch(s: Session, run: RunPaths, todo: list[manifest.FileEntry], total: int) -> None:
    """Small files in tar batches, large ones resumably; every byte hashed as it lands, every wait bounded."""
    far, stall_s = s.backend.far, s.backend.stall_timeout_s

    def changed(path: str, want: tuple[int, str], got: tuple[int, str] | None) -> Exception:
        return transfer.far_side_changed(run.run_id, path, f"{run.remote_abs}/{path}", want, got)

    with transfer.bar(total, "pull") as progress:
        for e in todo:
            warning = "" if s.backend.config.max_artifact_mb else transfer.large_warning(e.path, e.bytes)
            if warning:
                progress.write(warning, file=sys.stdout)
        small = [e for e in todo if e.bytes <= transfer.SMALL]
        for group in transfer.batches(small, lambda e: e.bytes):
            pieces: list[bytes] = []
            try:
                far.send(run.remote_abs, [e.path for e in group], pieces.append, stall_s)
            except (RemoteCommandError, FileNotFoundError):
                _gone(far, run, group, changed)  # a far file removed after sealing fails the whole `send`
                raise
            transfer.unpack(b"".join(pieces), {e.path: (run.pulled(e.path), e.bytes, e.sha256) for e in group},
                            progress, changed)
        for e in todo:
            if e.bytes > transfer.SMALL:
                def read_from(offset: int, write: Callable[[bytes], None], path: str = e.path) -> None:
                    far.read(run.remote_file(path), write, offset, stall_s=stall_s)

                transfer.get_resumable(read_from, run.pulled(e.path), e.bytes, e.sha256, progress,
                                       lambda want, got, p=e.path: changed(p, want, got))


def _gone(far: Any, run: RunPaths, group: list[manifest.FileEntry], changed: Callable[..., Exception]) -> None:
    """Raise `changed` for the first file of `group` that the far side no longer has."""
    for e in group:
        try:
            far.read(run.remote_file(e.path), lambda chunk: None, 0, 0)
        except FileNotFoundError:
            raise changed(e.path, (e.bytes, e.sha256), None)


def _warn_roster(s: Session, listed: manifest.Manifest) -> None:
    for entry in listed.refused:  # what the far side's seal would not list (links, tether's files)
        print(f"warning: not pulled: {entry.path}: {entry.reason}")
    if listed.missing:  # a completed run's literal names among them also fail verify
        print(f"warning: declared artifacts that the run did not produce: {', '.join(listed.missing)}")
    if sorted(listed.artifacts) != sorted(s.job.artifacts):
        print(f"warning: artifacts: in the config changed after this run was launched; its manifest "
              f"lists {list(listed.artifacts)}")


def verify(s: Session) -> str:
    """Size and SHA-256 of every pulled file against the manifest, the roster exact both ways.

    Always hashes every file again (the task has no up-to-date check): a timestamp proves nothing.
    """
    run = s.observed()
    verified = manifest.verify(run, manifest.left_remote(run), s.job.artifacts)
    loaded, found = verified["torch_loaded"], verified["torch_files"]
    torch = (f"; {loaded} torch checkpoint(s) loaded with weights_only=True" if loaded == found else
             f"; torch is not installed here, so {found} torch checkpoint(s) were checked by hash only "
             f"(pip install torch to load them)") if found else ""
    torn = verified.get("torn_event_lines", 0)
    torn = f"; {torn} torn line(s) in events.jsonl skipped (a writer cut short)" if torn else ""
    return (f"{run.run_id}: verified {len(verified['files'])} files ({verified['bytes']} bytes)"
            f"{torch}{torn}; results in {run.files}")
