"""What a job is: its hashed code and data, its launch spec, and the job hash its run ids carry.

A `JobIdentity` is built once by `identify` (a job as configured, or one point of its sweep) or by
`reproduction` (a recorded run's own spec) and never changes afterwards. Two jobs with the same
identity are the same run; any change to what is hashed here mints a new run id.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping, Optional, Sequence

from tether import environment
from tether.config import Job, asdict, changed_fields
from tether.hashing import Entry, HashCache, tree, tree_hash
from tether.sweep import Point

ROOTS = ("code", "data")  # the trees a job pushes, each hashed on its own


@dataclass(frozen=True)
class JobIdentity:
    """The files, launch spec and hashes of one job (read-only: the mappings are views)."""

    entries: tuple[Entry, ...]
    tree_hashes: Mapping[str, Optional[str]]  # SHA-256 per root, None for a root with no files
    launch_spec: Mapping[str, Any]  # what the launcher needs (stored in run.json)
    job_hash: str


def scan(job: Job, state_dir: str) -> tuple[Entry, ...]:
    """The job's code and data files, hashed (unchanged ones from the hash cache in `state_dir`)."""
    cache = HashCache(os.path.join(state_dir, "hashcache.json"))
    found = (tree("code", job.root, job.code.paths, job.code.exclude, cache)
             + tree("data", job.root, job.data.paths, job.data.exclude, cache))
    os.makedirs(state_dir, exist_ok=True)
    cache.save()
    return tuple(found)


def launch_spec(job: Job, point: Optional[Point] = None, resume_from: Optional[dict] = None) -> dict:
    """What the launcher needs for `job`; everything in it is part of the run's identity."""
    spec = job.trainer.launch_spec()
    spec.update(checkpoint_keep=job.checkpoint.keep, checkpoint_every=job.checkpoint.every,
                grace_seconds=job.grace_seconds, trainer=asdict(job.trainer), restart=asdict(job.restart))
    if point:
        spec["params"] = point.values
    if (env := environment.identity(job.environment, job.root)) is not None:  # none: older run ids stay
        spec["environment"] = env
    if resume_from:
        spec["resume_from"] = resume_from  # the source run, checkpoint and SHA-256 (tether.pipelines.resuming)
    return spec


def tree_hashes(entries: Sequence[Entry]) -> dict[str, Optional[str]]:
    """SHA-256 of the code tree and of the data tree (None when nothing is pushed)."""
    found = {}
    for root in ROOTS:
        listed = [e for e in entries if e.root == root]
        found[root] = tree_hash(listed) if listed else None
    return found


def job_hash(job: Job, hashes: Mapping[str, Optional[str]], spec: Mapping[str, Any],
             repro_of: Optional[str] = None) -> str:
    """One SHA-256 of the name, backend, trees and launch spec (settings at their defaults left out)."""
    restart = {k: v for k, v in changed_fields(job.restart).items() if k != "backoff_s"}  # when, not what
    launch = dict(spec, trainer=changed_fields(job.trainer), restart=restart)
    parts = {"name": job.name, "backend": job.backend, **hashes, "launch": launch}
    if repro_of:
        parts["repro_of"] = repro_of  # a reproduction is a run of its own, never the original
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def identify(job: Job, entries: Sequence[Entry], point: Optional[Point] = None,
             resume_from: Optional[dict] = None, repro_of: Optional[str] = None) -> JobIdentity:
    """The identity of `job` as configured (one sweep point's when `point` is given)."""
    return _frozen(job, entries, launch_spec(job, point, resume_from), repro_of)


def reproduction(job: Job, entries: Sequence[Entry], spec: Mapping[str, Any], repro_of: str) -> JobIdentity:
    """The identity of a re-run of `repro_of`: its recorded launch spec as it stands, not one rebuilt."""
    return _frozen(job, entries, spec, repro_of)


def _frozen(job: Job, entries: Sequence[Entry], spec: Mapping[str, Any], repro_of: Optional[str]) -> JobIdentity:
    owned = copy.deepcopy(dict(spec))  # nobody holding the caller's dict can change this identity
    hashes = tree_hashes(entries)
    return JobIdentity(tuple(entries), MappingProxyType(hashes), MappingProxyType(owned),
                       job_hash(job, hashes, owned, repro_of))
