"""What goes back to the mailbox for a run held here: its logs as they grow, its results once sealed, its snapshot."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Optional

from tether import mailbox
from tether.agent.ledger import Held
from tether.backends.farside import FarSide
from tether.pipelines.transfer import size_policy
from tether.remote.protocol import Snapshot
from tether.signing import Signer

GROWING = ("events.jsonl", "train.log", "launcher.log")  # appended to the mailbox's copies as they grow
APPEND_MAX = 4 << 20  # bytes of one file per append: a poll stays short however far behind the copy is


def logs(mail: FarSide, run_dir: str, held: Held) -> Held:
    """Append the new bytes of each growing file to its mailbox copy (resending from where that copy ends)."""
    offsets = dict(held.offsets)
    for name in GROWING:
        local = os.path.join(run_dir, name)
        size = os.path.getsize(local) if os.path.exists(local) else 0
        for _ in range(3):  # a copy that is not where we thought: its size, then once more from there
            sent = offsets.get(name, 0)
            if size <= sent:
                break
            with open(local, "rb") as f:
                f.seek(sent)
                data = f.read(min(size - sent, APPEND_MAX))
            offsets[name] = mail.append(f"runs/{held.run_id}/{name}", sent, data)
    return held.but(offsets=offsets)


def results(mail: FarSide, run_dir: str, held: Held, signer: Signer, max_artifact_mb: Optional[float]) -> Held:
    """The sealed manifest's files (not those left here by max_artifact_mb), then PULL_MANIFEST.json, then
    its signature: the held record says they are home (the final snapshot may follow)."""
    with open(os.path.join(run_dir, "PULL_MANIFEST.json"), "rb") as f:
        sealed = f.read()
    entries = [e for e in json.loads(sealed).get("files", []) if not size_policy(e["path"], e["bytes"], max_artifact_mb)]
    there = mail.peek(paths=[f"runs/{held.run_id}/{e['path']}" for e in entries]).files
    uploaded = dict(held.uploaded)
    for entry in entries:
        path = entry["path"]
        found = there.get(f"runs/{held.run_id}/{path}")
        same = found is not None and found.size == entry["bytes"] and \
            (uploaded.get(path) == entry["sha256"] or held.offsets.get(path) == entry["bytes"])
        if not same:
            mail.put_file(f"runs/{held.run_id}/{path}", os.path.join(run_dir, path), lambda moved: None)
            uploaded[path] = entry["sha256"]
    mail.put(f"runs/{held.run_id}/PULL_MANIFEST.json", sealed)
    signature = signer.sign({"run_id": held.run_id, "manifest_sha256": hashlib.sha256(sealed).hexdigest()})
    mail.put(mailbox.run_file(held.run_id, "manifest.sig"), json.dumps(signature).encode())
    return held.but(uploaded=uploaded, home=True)


def snapshot(mail: FarSide, held: Held, snap: Snapshot, agent: str) -> None:
    """runs/<id>/agent/snapshot.json: the local probe, final only once the results are home."""
    body = dict(dataclasses.asdict(snap), final=snap.final and held.home, agent=agent, nonce=held.nonce)
    mail.put(mailbox.run_file(held.run_id, "snapshot"), json.dumps(body, sort_keys=True).encode())
