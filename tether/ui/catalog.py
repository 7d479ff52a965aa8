"""The runs this project knows, with their far-side state: one round trip per backend per refresh."""

from __future__ import annotations

import dataclasses
import math
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

from tether import manifest
from tether.errors import ManifestError, RunError, TetherError
from tether.paths import RunPaths, check_run_id, runs_dir
from tether.pipelines import observe, results
from tether.pipelines.session import Session
from tether.remote.fileio import TornFile, read_json
from tether.sweep import Point

REFRESH_S = 2.0  # the pages reload this often; snapshots younger than this are served from memory
EVENT_FIELDS = ("event", "t", "step", "epoch", "total_steps", "source")  # an event's own keys, not metrics


def number(value: Any) -> Optional[float]:
    """`value` when it is a finite int or float (not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return value


@dataclass(frozen=True)
class Row:
    """One run as the runs page shows it; `error` says why the far side's part is missing."""

    run_id: str
    backend: str
    config: str
    point: str
    created_at: float
    status: str = "unknown"
    step: Optional[int] = None
    total: Optional[int] = None
    loss: Optional[float] = None
    metrics: tuple[tuple[str, float], ...] = ()
    heartbeat_age_s: Optional[float] = None
    queue: Optional[str] = None
    host: Optional[str] = None
    attempt: Optional[int] = None
    verified: bool = False
    error: str = ""
    details: tuple[tuple[str, str], ...] = ()  # every status value, as text, for the run's page


@dataclass
class Curves:
    """A run's loss and metric series, read from its events.jsonl incrementally (only new bytes)."""

    reader: observe.EventReader
    series: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    total: Optional[int] = None

    def read(self) -> None:
        """Add the events written since the last read (one far-side request)."""
        for event in self.reader.read():
            step = number(event.get("step"))
            if step is None:
                continue
            if event.get("event") == "step":
                self.total = event.get("total_steps") if number(event.get("total_steps")) else self.total
                self._add("loss", step, event.get("loss"))
            elif event.get("event") == "epoch":
                for name, value in event.items():
                    if name not in EVENT_FIELDS:
                        self._add(str(name), step, value)

    def _add(self, name: str, step: float, value: Any) -> None:
        if number(value) is not None:
            self.series.setdefault(name, []).append((step, value))


@dataclass(frozen=True)
class Detail:
    """A run's page: its row, curves, log tail, manifest and verification record."""

    row: Row
    series: Mapping[str, tuple[tuple[float, float], ...]]
    log: str
    files: tuple[manifest.FileEntry, ...]
    manifest_note: str  # why there is no manifest here, or ''
    verified: Optional[dict]  # PULL_VERIFIED.json, when it exists


@dataclass(frozen=True)
class SweepTable:
    """A sweep's results (results.collect) of one backend, once some point is verified."""

    backend: str
    keys: tuple[str, ...]
    metrics: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]  # the setting's values, n, then one cell per metric
    excluded: tuple[tuple[str, str], ...]  # (point, why)


class Catalog:
    """Every local run record under .tether/runs, each read through a session of its backend.

    One lock serializes the far side (a backend's channel is not shared between threads); rows and
    details are kept for REFRESH_S, so page loads within it cost no round trip.
    """

    def __init__(self, sessions: Mapping[str, Session], problems: Mapping[str, str], state_dir: str,
                 refresh_s: float = REFRESH_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.sessions, self.problems, self.state_dir = dict(sessions), dict(problems), state_dir
        self.refresh_s, self.clock = refresh_s, clock
        self.lock = threading.Lock()
        self._rows: tuple[float, list[Row]] = (-math.inf, [])
        self._final: dict[str, tuple[Any, Row]] = {}  # ended runs' rows, by the launch they ended (see _launched)
        self._curves: dict[str, Curves] = {}
        self._details: dict[str, tuple[float, Detail]] = {}

    @classmethod
    def open(cls, s: Session) -> "Catalog":
        """The catalog of `s`'s project: a session per backend of its config (one that cannot be opened is
        named with its error in its runs' rows)."""
        sessions, problems = {s.job.backend: s}, {}
        for name in sorted(s.job.backends):
            if name != s.job.backend:
                try:
                    sessions[name] = Session.open(dict(s.variables, backend=name))
                except TetherError as err:
                    problems[name] = str(err)
        return cls(sessions, problems, s.state_dir)

    @property
    def backends(self) -> list[str]:
        """The config's backends, sorted."""
        return sorted(set(self.sessions) | set(self.problems))

    # ------------------------------------------------------------ which runs

    def records(self) -> dict[str, dict]:
        """run.json of every run recorded here, by run id (folders with another name, or a torn run.json, skipped)."""
        folder = runs_dir(self.state_dir)
        found = {}
        for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else ():
            try:
                record = read_json(os.path.join(folder, check_run_id(name), "run.json"), dict)
            except (RunError, TornFile):
                continue
            if record:
                found[name] = record
        return found

    def known(self, run_id: str) -> Optional[dict]:
        """The record of `run_id` if it is a valid id of a run recorded here, else None."""
        try:
            check_run_id(run_id)
        except RunError:
            return None
        return self.records().get(run_id)

    # ------------------------------------------------------------ the runs page

    def rows(self) -> list[Row]:
        """Every run, newest first; refreshed at most once per refresh_s."""
        with self.lock:
            taken, rows = self._rows
            if self.clock() - taken >= self.refresh_s:
                rows = self._fresh_rows()
                self._rows = (self.clock(), rows)
            return rows

    def _fresh_rows(self) -> list[Row]:
        by_backend: dict[str, list[tuple[str, dict]]] = {}
        for run_id, record in self.records().items():
            by_backend.setdefault(str(record.get("backend")), []).append((run_id, record))
        rows = []
        for backend, runs in by_backend.items():
            rows += self._backend_rows(backend, runs)
        return sorted(rows, key=lambda r: (r.created_at, r.run_id), reverse=True)

    def _backend_rows(self, backend: str, runs: list[tuple[str, dict]]) -> list[Row]:
        """The rows of one backend's runs, from one `states` round trip."""
        bare = {run_id: _bare(run_id, record) for run_id, record in runs}
        s = self.sessions.get(backend)
        if s is None:
            why = self.problems.get(backend) or f"backend {backend} is not in {os.path.basename(self._source())}: " \
                                                f"add it under backends: to see these runs' state"
            return [_replace(row, error=why, verified=_verified(self._paths_here(row.run_id))) for row in bare.values()]
        pending = [s.paths(run_id) for run_id in bare if not self._ended(s.paths(run_id))]
        try:
            snaps = s.backend.states(pending) if pending else {}
        except Exception as err:  # an unreachable backend shows its error in its rows, never breaks the page
            if not (isinstance(err, (TetherError, OSError)) or s.backend.is_transport_error(err)):
                raise
            snaps, error = {}, f"backend {backend} did not answer: {err}"
        else:
            error = ""
        return [self._row(s, bare[run_id], snaps.get(run_id), error) for run_id in bare]

    def _row(self, s: Session, bare: Row, snap: Any, error: str) -> Row:
        run = s.paths(bare.run_id)
        if self._ended(run):
            return _replace(self._final[bare.run_id][1], verified=_verified(run))
        if snap is None:
            return _replace(bare, error=error or "no state from the far side", verified=_verified(run))
        try:
            info = observe.summary(s, run, snap).as_dict()
        except (TetherError, OSError) as err:
            return _replace(bare, status=snap.status, error=str(err), verified=_verified(run))
        curves = self._curves.get(bare.run_id)
        row = _replace(bare, status=str(info.get("status")), step=info.get("step"),
                       total=info.get("total") or (curves.total if curves else None), loss=number(info.get("loss")),
                       metrics=tuple(sorted((str(k), v) for k, v in (info.get("metric") or {}).items()
                                            if number(v) is not None)),
                       heartbeat_age_s=number(info.get("heartbeat_age_s")), queue=info.get("queue"),
                       host=info.get("host"), attempt=info.get("attempt"), verified=_verified(run),
                       details=tuple((str(k), _text(v)) for k, v in sorted(info.items()) if v not in (None, [], {})))
        if snap.final and not snap.alive:  # its heartbeat's age would only grow: not shown once it ended
            self._final[bare.run_id] = (_launched(run), _replace(row, heartbeat_age_s=None))
        return row

    def _ended(self, run: RunPaths) -> bool:
        """Whether the run's row was kept when it ended, and it has not been launched again since."""
        kept = self._final.get(run.run_id)
        return kept is not None and kept[0] == _launched(run)

    def _paths_here(self, run_id: str) -> RunPaths:
        return RunPaths(run_id, self.state_dir, "")

    def _source(self) -> str:
        return next(iter(self.sessions.values())).job.source if self.sessions else "the config"

    def sweeps(self) -> list[SweepTable]:
        """The results table of each backend's sweep that has a verified point (local files only)."""
        found = []
        with self.lock:
            for backend, s in sorted(self.sessions.items()):
                if s.job.sweep:
                    table = _table(backend, results.collect(s))
                    if table.rows:
                        found.append(table)
        return found

    # ------------------------------------------------------------ a run's page

    def detail(self, run_id: str) -> Optional[Detail]:
        """The run's page, or None when the run is not one recorded here."""
        record = self.known(run_id)
        if record is None:
            return None
        row = next((r for r in self.rows() if r.run_id == run_id), None) or _bare(run_id, record)
        with self.lock:
            kept = self._details.get(run_id)
            if kept and self.clock() - kept[0] < self.refresh_s:
                return kept[1]
            detail = self._fresh_detail(row, self.sessions.get(row.backend))
            self._details[run_id] = (self.clock(), detail)
            return detail

    def _fresh_detail(self, row: Row, s: Optional[Session]) -> Detail:
        run = s.paths(row.run_id) if s else self._paths_here(row.run_id)
        series: dict[str, tuple[tuple[float, float], ...]] = {}
        log, total = "", row.total
        if s is not None:
            try:
                curves = self._curves.setdefault(row.run_id, Curves(observe.EventReader(s.backend, run)))
                curves.read()
                series, total = {k: tuple(v) for k, v in curves.series.items()}, total or curves.total
                log = observe.tail_text(s.backend.far, run, lines=40)
            except (TetherError, OSError) as err:
                log = f"(the far side did not answer: {err})"
        files, note = (), ""
        try:
            files = manifest.read(run).files
        except ManifestError as err:
            note = str(err) if os.path.exists(run.manifest) else "not pulled yet: `doit pull` brings it home"
        try:
            verified = read_json(run.verified, dict)
        except TornFile:
            verified = None
        return Detail(_replace(row, verified=_verified(run), total=total), series, log, files, note, verified)

    # ------------------------------------------------------------ the Check button

    def check(self, backend: str) -> Optional[str]:
        """`doit check` of a backend of the config, as text; None when there is no such backend."""
        if backend in self.problems:
            return self.problems[backend]
        s = self.sessions.get(backend)
        if s is None:
            return None
        with self.lock:
            try:
                s.backend.install_launcher()
                s.backend.prepare()
                return s.backend.check(s.job.trainer.requires()).text()
            except Exception as err:
                if not (isinstance(err, (TetherError, OSError)) or s.backend.is_transport_error(err)):
                    raise
                return f"backend {backend}: the preflight failed: {err}"


def _bare(run_id: str, record: dict) -> Row:
    """What the local record alone says about a run."""
    params = record.get("params")
    point = Point(tuple(params.items())).label if isinstance(params, dict) else ""
    if record.get("repro_of"):
        point = (point + " " if point else "") + f"(repro of {record['repro_of']})"
    created = number(record.get("created_at")) or 0.0
    return Row(run_id=run_id, backend=str(record.get("backend")), config=os.path.basename(str(record.get("config"))),
               point=point, created_at=created)


def _replace(row: Row, **changes: Any) -> Row:
    return dataclasses.replace(row, **changes)


def _launched(run: RunPaths) -> Any:
    """Which launch of the run this is (its launch stamp's change time; a relaunch writes it again)."""
    try:
        return os.stat(run.stamp("launch")).st_mtime_ns
    except FileNotFoundError:
        return None


def _verified(run: RunPaths) -> bool:
    return manifest.still_verified(run)


def _text(value: Any) -> str:
    if isinstance(value, list):
        return "; ".join(map(str, value))
    if isinstance(value, dict):
        return ", ".join(f"{k} {v}" for k, v in sorted(value.items()))
    return str(value)


def _table(backend: str, found: dict) -> SweepTable:
    """results.markdown's table, as cells."""
    keys = tuple(k for k in found["sweep"] if k != found["seed_key"])
    names = tuple(results.metric_names(found))
    rows = []
    for group in results.groups(found):
        cells = [str(group["setting"][k]) for k in keys] + [str(len(group["runs"]))]
        cells += [results.cell(group["values"][n]) if n in group["values"] else "" for n in names]
        rows.append(tuple(cells))
    excluded = tuple((e["point"], e["why"]) for e in found["excluded"])
    return SweepTable(backend, keys, names, tuple(rows), excluded)
