"""A job's identity pinned for a fixed tiny project: the job hash (and so every run id) of a plain
job, of a sweep point and of a reproduction must not change when the code that computes it moves.

The values were computed once and written here; a change to them mints new ids for runs that
already exist, so it is a decision, not a refactor.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

TRAIN = "import sys\nprint('step', 1)\n"
POINTS = "x,y\n0,1\n1,3\n"
CONFIG = """\
name: pinned
backend: local
code:
  paths: [train.py]
data:
  paths: [points.csv]
trainer:
  type: command
  command: "{python} train.py --lr {lr}"
checkpoint: {keep: 3, every: 50}
grace_seconds: 5
backends:
  local: {type: local}
"""
SWEEP = "sweep:\n  lr: [0.1, 0.01]\n"

PLAIN_HASH = "d3e4f8d26744a4c8bf4dae51ae241ffd27ab49477b979f66d015799edd4fd579"
POINT_HASHES = ["09ca09fb47306fabb7da05fa116e1358323a103aba9a8a1d120007059e0027d9",
                "30933026a9437243a8b704f0d2bc41dcf6a8268e6052ba842ae09162d4fd778c"]
REPRO_HASH = "9ac925d3fa156e749560a954f4e5b5e3a55321e72567ca67c6de5ec54683efde"
RECORD_KEYS = ["argv", "artifacts", "backend", "backend_type", "checkpoint_every", "checkpoint_keep",
               "checkpoint_path", "code_hash", "config", "created_at", "created_on", "data_hash", "env",
               "grace_seconds", "job_hash", "name", "restart", "resume_args", "run_id", "tether_package",
               "tether_version", "trainer"]
RECORDED_ID = "pinned-20240101T000000Z-00000000"  # the run a reproduction names (its repro_of)


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    """The project: two files of fixed bytes and modes, and a config."""
    root = tmp_path / "tiny"
    root.mkdir()
    for name, text in (("train.py", TRAIN), ("points.csv", POINTS)):
        (root / name).write_text(text)
        os.chmod(root / name, 0o644)  # the mode is part of the tree hash: no umask may decide it
    (root / "tether.yaml").write_text(CONFIG.replace("--lr {lr}", "--lr 0.5"))
    return root


def open_session(root: Path):
    from tether.pipelines.session import Session

    return Session.open({}, cwd=str(root))


def test_the_job_hash_of_a_plain_job_is_pinned(tiny):
    s = open_session(tiny)
    assert s.tree_hashes == {"code": "a4b85d0440632e6a0cc4d22901ed5da3b4e9ae173678b7428bfa35516583f4af",
                             "data": "5445fec468dd966f3e924b19b617aa15a5cc13c6a52e89209069614707c22ac7"}
    assert s.job_hash == PLAIN_HASH
    record = json.loads(Path(s.run().run_json).read_text())
    assert record["job_hash"] == PLAIN_HASH and record["run_id"].endswith("-" + PLAIN_HASH[:8])
    assert sorted(record) == RECORD_KEYS


def test_the_job_hash_of_each_sweep_point_is_pinned(tiny):
    (tiny / "tether.yaml").write_text(CONFIG + SWEEP)
    s = open_session(tiny)
    assert [p.job_hash for p in s.points] == POINT_HASHES
    assert [p.launch_spec["params"] for p in s.points] == [{"lr": 0.1}, {"lr": 0.01}]


def test_the_job_hash_of_a_reproduction_is_pinned(tiny):
    from tether.paths import RunPaths
    from tether.pipelines import repro
    from tether.pipelines.runs import RECORD_FIELDS

    s = open_session(tiny)
    run = s.run()
    spec = json.loads(Path(run.run_json).read_text())
    tree = [{"root": e.root, "path": e.path, "sha256": e.sha256, "mode": e.mode} for e in s.entries]
    recorded = repro.Recorded(RunPaths(RECORDED_ID, s.state_dir, ""), dict(spec, run_id=RECORDED_ID), tree, {})
    again = repro.session_for(s, recorded)
    assert again.tree_hashes == s.tree_hashes
    assert dict(again.launch_spec) == {k: v for k, v in spec.items() if k not in RECORD_FIELDS}
    assert again.job_hash == REPRO_HASH


# ---------------------------------------------------------------- the pieces a Session composes


def test_an_identity_cannot_be_changed_by_whoever_holds_it(tiny):
    import dataclasses

    s = open_session(tiny)
    ident = s.identity
    with pytest.raises(dataclasses.FrozenInstanceError):
        ident.job_hash = "0" * 64  # type: ignore[misc]
    with pytest.raises(TypeError):
        ident.launch_spec["argv"] = ["other"]  # type: ignore[index]
    spec = s.launch_spec  # a copy: changing it changes nothing that is hashed or recorded
    spec["argv"].append("--more")
    spec["trainer"]["command"] = "other"
    assert s.launch_spec == dict(ident.launch_spec) and s.job_hash == PLAIN_HASH
    assert s.identity is ident  # built once


def test_sweep_points_share_the_hashed_files_and_one_snapshot_cache(tiny):
    (tiny / "tether.yaml").write_text(CONFIG + SWEEP)
    s = open_session(tiny)
    points = s.points
    assert all(p.entries is s.entries for p in points)  # hashed once, for every point
    assert points[0].snapshots is points[1].snapshots and points[0].snapshots is not s.snapshots
    assert all(p.siblings is points for p in points)


def test_one_poll_also_refreshes_the_followed_runs_in_flight(tmp_path):
    from tether.paths import RunPaths
    from tether.pipelines.runs import SnapshotCache

    class Backend:
        def __init__(self) -> None:
            self.polls: list[list[str]] = []

        def states(self, runs: list[RunPaths]) -> dict[str, dict]:
            self.polls.append([r.run_id for r in runs])
            return {r.run_id: {"status": "running"} for r in runs}

    class Resolver:  # what the cache asks of a RunResolver
        def __init__(self, run_id: str, launched: bool) -> None:
            self.run = RunPaths(run_id, str(tmp_path), "")
            if launched:
                os.makedirs(self.run.local, exist_ok=True)
                Path(self.run.stamp("launch")).write_text("{}")

        def current(self) -> RunPaths:
            return self.run

    backend = Backend()
    cache = SnapshotCache(backend)  # type: ignore[arg-type]
    a, b, c = Resolver("a-1", True), Resolver("b-1", True), Resolver("c-1", False)
    for one in (a, b, c):
        cache.follow(one)  # type: ignore[arg-type]
    assert cache.snapshot(a.run) == {"status": "running"}
    assert backend.polls == [["a-1", "b-1"]]  # c was never launched: not polled
    cache.snapshot(b.run)
    assert len(backend.polls) == 1  # cached by the first poll
    cache.forget(b.run)
    cache.snapshot(b.run)
    assert backend.polls[-1] == ["b-1", "a-1"]
    assert set(cache.states) == {"a-1", "b-1"}


def test_a_recorded_spec_needs_the_run_it_reproduces(tiny):
    from tether.pipelines.session import Session

    s = open_session(tiny)
    with pytest.raises(ValueError):
        Session(s.job, s.backend, s.state_dir, spec=s.launch_spec)


def test_no_module_writes_another_objects_dict():
    """Cached values are given through constructors, never written into another object's __dict__."""
    package = Path(__file__).resolve().parent.parent / "tether"
    writes = re.compile(r"__dict__\s*(\.update\b|\.setdefault\b|\[[^]]*\]\s*=[^=])")
    found = [str(p) for p in package.rglob("*.py") if writes.search(p.read_text())]
    assert found == []
