"""`repro PATH`: re-run recorded runs from their recorded code, data and settings, and compare.

PATH is a pulled run folder (`.tether/runs/<id>`), a sweep's `results.json`, or its
`results.provenance.json`. The recorded folder must still match its own manifest; the code
files here must hash to the recorded snapshot (the data may also be on the backend already).
Each reproduction is a run of its own (`repro_of` in its run.json), so running the same
command again resumes it instead of training twice.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from tether import config as config_mod
from tether import environment, manifest
from tether.config import Problems, Restart
from tether.errors import ConfigError, RunError
from tether.hashing import Entry
from tether.paths import RunPaths, check_run_id
from tether.pipelines import phases, transfer
from tether.pipelines.runs import recorded_spec
from tether.pipelines.session import Session
from tether.remote.fileio import read_json, sha256_file
from tether.sweep import Point
from tether.trainers.registry import TRAINER_TYPES

DEFAULT_TOLERANCE = 0.01  # relative, per metric, for trainers that are not bitwise deterministic
RESULTS = ("artifacts/", "work/")  # manifest paths of declared results: TETHER_ARTIFACTS_DIR and the working dir


@dataclass(frozen=True)
class Recorded:
    """A recorded run folder that matched its manifest: its run.json, tree.json and manifest."""

    run: RunPaths
    spec: dict
    tree: list[dict]
    manifest: dict


def repro(s: Session, paths: list[str]) -> str:
    """Reproduce every run the paths name; fail unless all of them reproduce."""
    if not paths:
        raise RunError("repro needs a PATH: a run folder (.tether/runs/ID), a results.json or its "
                       "results.provenance.json, e.g. `tether repro .tether/runs/ID backend=local`")
    tolerance = _tolerance(s.variables.get("tolerance"))
    recorded = [r for path in paths for r in find(path, s.state_dir)]
    verdicts = [reproduce(s, r, tolerance) for r in recorded]
    for ok, line in verdicts:
        print(line)
    failed = sum(not ok for ok, _ in verdicts)
    if failed:
        raise RunError(f"{failed} of {len(verdicts)} run(s) did not reproduce (see above)")
    return f"reproduced: all {len(verdicts)} run(s), on backend {s.job.backend}"


def _tolerance(text: str | None) -> float:
    try:
        value = float(text) if text is not None else DEFAULT_TOLERANCE
    except ValueError:
        value = -1.0
    if not 0 <= value < 1:
        raise ConfigError(f"tolerance={text!r}: give a relative tolerance between 0 and 1, e.g. tolerance=0.01")
    return value


# ------------------------------------------------------------------ what was recorded


def find(path: str, state_dir: str) -> list[Recorded]:
    """The recorded runs PATH names, each checked against its own manifest (and the one cited)."""
    path = os.path.abspath(path)
    if os.path.isdir(path):
        return [load(path)]
    data = read_json(path) if os.path.isfile(path) else None
    listed = (data.get("points") or data.get("runs")) if isinstance(data, dict) else None
    if not listed:
        raise RunError(f"{path}: not a run folder, a results.json or a results.provenance.json")
    found = []
    for entry in listed:
        if not isinstance(entry, dict) or not entry.get("run_id") or not entry.get("manifest_sha256"):
            raise RunError(f"{path}: an entry without run_id and manifest_sha256: {entry!r}")
        recorded = load(_locate(path, check_run_id(entry["run_id"]), state_dir))
        cited = entry["manifest_sha256"]
        if recorded.manifest["sha256"] != cited:
            raise RunError(f"run folder {recorded.run.local} has manifest sha256 {recorded.manifest['sha256']}, "
                           f"but {os.path.basename(path)} cites {cited}: it is not the run those results came from")
        found.append(recorded)
    return found


def _locate(cited_by: str, run_id: str, state_dir: str) -> str:
    """A cited run's folder: beside the results (runs/ID), in the .tether they were made in, or here."""
    here = os.path.dirname(cited_by)
    for folder in (os.path.join(here, "runs", run_id), os.path.join(here, "..", "..", "runs", run_id),
                   os.path.join(state_dir, "runs", run_id)):
        if os.path.isfile(os.path.join(folder, "PULL_MANIFEST.json")):
            return os.path.normpath(folder)
    raise RunError(f"the run folder of {run_id} (cited by {cited_by}) is not in {here}/runs/, "
                   f"{os.path.normpath(os.path.join(here, '..', '..', 'runs'))}/ or {state_dir}/runs/: copy it there")


def load(folder: str) -> Recorded:
    """A run folder (or its files/ folder), refused unless every file matches its manifest."""
    if os.path.basename(folder.rstrip("/")) == "files":
        folder = os.path.dirname(folder.rstrip("/"))
    spec = read_json(os.path.join(folder, "files", "run.json"))
    if not os.path.isfile(os.path.join(folder, "PULL_MANIFEST.json")) or not spec:
        raise RunError(f"{folder} is not a pulled run folder (it needs PULL_MANIFEST.json and files/run.json): "
                       f"pass .tether/runs/ID after `doit run train`")
    run = RunPaths(check_run_id(spec["run_id"]), os.path.dirname(folder), "", folder=folder)
    try:
        manifest.check(run, manifest.left_remote(run))
    except Exception as err:
        raise RunError(f"refusing to reproduce {run.run_id}: its recorded folder {folder} does not match its "
                       f"manifest, so it is not what the run produced: {err}") from err
    tree = read_json(run.pulled("tree.json"))
    if tree is None:
        raise RunError(f"{run.run_id} has no tree.json (recorded by an older tether): its code cannot be checked")
    listed, digest = manifest.load(run)
    verified = read_json(run.verified) or {}
    if verified.get("manifest_sha256", digest) != digest:
        raise RunError(f"refusing to reproduce {run.run_id}: its PULL_MANIFEST.json (sha256 {digest}) is not the "
                       f"one its PULL_VERIFIED.json verified ({verified['manifest_sha256']})")
    return Recorded(run, spec, tree["files"], dict(listed, sha256=digest))


# ------------------------------------------------------------------ the reproduction


def reproduce(s: Session, recorded: Recorded, tolerance: float) -> tuple[bool, str]:
    """Run it again on this backend (or resume that), then compare with the record."""
    again = session_for(s, recorded)
    if recorded.spec.get("tether_version") != s.backend.version:
        print(f"note: {recorded.run.run_id} ran with tether's far-side code {recorded.spec.get('tether_version')}; "
              f"this is {s.backend.version} (the built-in trainer lives there)")
    for done, phase in ((phases.up_done, phases.up), (phases.push_done, phases.push),
                        (phases.launch_done, phases.launch), (phases.watch_done, phases.watch)):
        if phase is phases.launch and not done(again):
            resume_source(s, recorded, again)  # before its first attempt: the same checkpoint, or why not
        if not done(again):
            print(phase(again))
    if not phases.pulled_done(again):
        print(phases.pull(again))
        print(phases.verify(again))
    return compare(recorded, again.run(), _deterministic(recorded.spec), tolerance)


def session_for(s: Session, recorded: Recorded) -> Session:
    """A session whose job is the recorded one: its trainer settings, spec, and code and data files."""
    spec = recorded.spec
    why = environment.differs(spec.get("environment"), s.job.environment, s.job.root)
    if why:  # the venv would hold other packages than the run had
        raise RunError(f"refusing to reproduce {recorded.run.run_id}: {why}: check out the commit the run was made "
                       f"from (its run.json records the environment)")
    trainer = _trainer(spec["trainer"])
    job = dataclasses.replace(s.job, name=spec["name"], trainer=trainer, artifacts=tuple(spec.get("artifacts", ())),
                              restart=Restart(**spec["restart"]), sweep={})
    params = spec.get("params")
    again = Session(job, s.backend, s.state_dir, s.variables, repro_of=recorded.run.run_id,
                    point=Point(tuple(params.items())) if params else None,
                    hashed=files_for(s, recorded), spec=recorded_spec(spec))
    if again.tree_hashes != {"code": spec.get("code_hash"), "data": spec.get("data_hash")}:
        raise RunError(f"{recorded.run.run_id}: tree.json does not give the code and data hashes its run.json "
                       f"records: the record is inconsistent")
    return again


def resume_source(s: Session, recorded: Recorded, again: Session) -> None:
    """A run that was seeded by `resume_from=` re-runs from that same checkpoint, checked by SHA-256:
    the source run's copy on the backend, else a pulled copy here (uploaded into the new run); else
    a refusal naming where it looked and what it found."""
    source = recorded.spec.get("resume_from")
    if not source:
        return
    src = s.paths(source["run_id"])
    far = s.backend.far.checkpoint(src.remote_abs, source["checkpoint"])
    if far.outcome == "found" and far.sha256 == source["sha256"]:
        print(f"{recorded.run.run_id}: resuming from {source['run_id']}'s checkpoint {source['checkpoint']} on "
              f"backend {s.job.backend} (sha256 matches)")
        return
    there = {"absent": f"run {source['run_id']} is not on backend {s.job.backend} (`doit down` removed it?)",
             "missing": f"run {source['run_id']} on backend {s.job.backend} no longer has it"}.get(
        far.outcome, f"backend {s.job.backend} has other bytes (sha256 {(far.sha256 or '')[:12]})")
    local = src.pulled(source["checkpoint"])
    here = sha256_file(local)[0] if os.path.isfile(local) else None
    if here != source["sha256"]:
        found = f"other bytes (sha256 {here[:12]})" if here else "missing"
        raise RunError(f"refusing to reproduce {recorded.run.run_id}: it resumed from run {source['run_id']}'s "
                       f"checkpoint {source['checkpoint']} (sha256 {source['sha256']}); {there}, and {local} is "
                       f"{found}: `doit pull run={source['run_id']}` where it still exists, or copy the run folder here")
    mapped = again.launch_spec.get("checkpoint_path")
    name = os.path.basename(mapped) if mapped else os.path.basename(source["checkpoint"])
    run = again.run()
    with transfer.bar(os.path.getsize(local), "checkpoint") as progress:
        s.backend.far.put_file(run.remote_file(f"checkpoints/{name}"), local, progress.update)
    print(f"{recorded.run.run_id}: {there}; uploaded the pulled copy of its checkpoint {source['checkpoint']} "
          f"(sha256 matches) to resume from")


def _trainer(section: dict) -> Any:
    kind = section.get("type")
    if kind not in TRAINER_TYPES:
        raise RunError(f"the recorded trainer type {kind!r} is not known to this tether: "
                       f"{', '.join(sorted(TRAINER_TYPES))}")
    problems = Problems("the recorded trainer")
    trainer = config_mod.build(config_mod.load_class(TRAINER_TYPES[kind] + ":Config"), section, problems, "trainer")
    if problems.errors:
        raise RunError("the recorded trainer settings do not load here: " + "; ".join(problems.errors))
    return trainer


def files_for(s: Session, recorded: Recorded) -> list[Entry]:
    """The recorded code and data, found here by hash; code must be here, data may be on the backend."""
    entries, wrong, absent = [], [], {}
    for item in recorded.tree:
        local = os.path.join(s.job.root, *item["path"].split("/"))
        found = sha256_file(local)[0] if os.path.isfile(local) else None  # every byte: no timestamp is trusted
        if found == item["sha256"]:
            entries.append(Entry(item["root"], item["path"], local, found, os.path.getsize(local), item["mode"]))
        elif item["root"] == "code":
            wrong.append(f"{item['path']}: recorded sha256 {item['sha256']}, here "
                         + (found or "missing"))
        else:
            absent[item["sha256"]] = (item, found)
            entries.append(Entry(item["root"], item["path"], "", item["sha256"], 0, item["mode"]))
    if wrong:
        raise RunError(f"refusing to reproduce {recorded.run.run_id}: the code here is not its recorded snapshot "
                       f"(code sha256 {recorded.spec.get('code_hash')}): " + "; ".join(wrong)
                       + f". Check out the commit it ran from, in {s.job.root}")
    _data_on_backend(s, recorded, absent)
    return sorted(entries, key=lambda e: (e.root, e.path))


def _data_on_backend(s: Session, recorded: Recorded, absent: dict[str, tuple[dict, str | None]]) -> None:
    """Data files that are not here must already be in the backend's object store."""
    if not absent:
        return
    s.backend.install_launcher()
    lacking = s.backend.far.have(f"{s.backend.remote_dir}/objects", list(absent))
    if lacking:
        described = [f"{absent[sha][0]['path']} (sha256 {sha}; here: {absent[sha][1] or 'missing'})" for sha in lacking]
        raise RunError(f"refusing to reproduce {recorded.run.run_id}: its data is neither here nor on backend "
                       f"{s.job.backend}: " + "; ".join(described) + f". Put the original files under {s.job.root}")


def _deterministic(spec: dict) -> bool:
    kind = spec["trainer"].get("type")
    return bool(getattr(config_mod.load_class(TRAINER_TYPES[kind] + ":Config"), "deterministic", False))


def compare(recorded: Recorded, run: RunPaths, deterministic: bool, tolerance: float) -> tuple[bool, str]:
    """Bit-identical artifacts; for a trainer that is not deterministic, metrics within `tolerance`."""
    new_manifest, _ = manifest.load(run)
    old = {e["path"]: e["sha256"] for e in recorded.manifest["files"] if e["path"].startswith(RESULTS)}
    new = {e["path"]: e["sha256"] for e in new_manifest["files"] if e["path"].startswith(RESULTS)}
    differ = sorted(p for p in set(old) | set(new) if old.get(p) != new.get(p))
    head = f"{recorded.run.run_id} -> {run.run_id}:"
    if not differ:
        return True, f"{head} reproduced ({len(old)} artifacts bit-identical by sha256: {', '.join(sorted(old))})"
    what = "; ".join(f"{p}: recorded sha256 {old.get(p, 'absent')}, now {new.get(p, 'absent')}" for p in differ)
    if deterministic:
        return False, f"{head} NOT reproduced: the trainer is deterministic but {what}"
    far = _metrics_apart(recorded, run, tolerance)
    if far:
        return False, f"{head} NOT reproduced: metrics beyond tolerance {tolerance:g} (relative): {far}"
    return True, (f"{head} reproduced (metrics within tolerance {tolerance:g}, relative; "
                  f"{len(differ)} artifact(s) differ in bits)")


def _metrics_apart(recorded: Recorded, run: RunPaths, tolerance: float) -> str:
    old = read_json(recorded.run.pulled("artifacts/metrics.json"))
    new = read_json(run.pulled("artifacts/metrics.json"))
    if old is None or new is None:
        return "no artifacts/metrics.json to compare"
    far = []
    for key, before in sorted(old.items()):
        after = new.get(key)
        if isinstance(before, (int, float)) and not isinstance(before, bool):
            if not isinstance(after, (int, float)) or abs(after - before) > tolerance * max(abs(before), abs(after)):
                far.append(f"{key}: recorded {before}, now {after}")
        elif after != before:
            far.append(f"{key}: recorded {before!r}, now {after!r}")
    return "; ".join(far)
