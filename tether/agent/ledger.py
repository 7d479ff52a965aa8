"""The agent's own record of the runs it holds (agent.json in its workdir), written atomically."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from tether.remote.fileio import atomic_write_json, read_json

FILE = "agent.json"


@dataclass(frozen=True)
class Held:
    """One run this agent took: the request it answers, what of it is in the mailbox, and why it ended."""

    run_id: str
    nonce: str  # the request (attempt) it runs now
    request: dict = field(default_factory=dict)  # the verified Request of that attempt
    launched: bool = False  # its launcher started (else: claimed, still to be fetched and started)
    settings: dict = field(default_factory=dict)  # what its `start` got (a restart here gets the same)
    offsets: dict = field(default_factory=dict)  # mirrored file -> bytes the mailbox has
    uploaded: dict = field(default_factory=dict)  # result file -> SHA-256 put in the mailbox for this attempt
    interrupted: bool = False  # the agent stopped it itself (SIGTERM): it starts it again
    stopped: bool = False  # a stop request stopped it: never restarted by the agent
    home: bool = False  # the results and the final snapshot are in the mailbox

    @classmethod
    def of(cls, found: Any) -> "Held":
        """A record as agent.json holds it (keys it does not know are left out)."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in found.items() if k in names})

    def but(self, **changes: Any) -> "Held":
        """This record with `changes`."""
        return replace(self, **changes)


class Ledger:
    """The runs held, by run id, saved on every change (a SIGKILLed agent finds them on its next start)."""

    def __init__(self, workdir: str) -> None:
        self.path = os.path.join(workdir, FILE)
        found = read_json(self.path, dict) or {}
        self.runs: dict[str, Held] = {rid: Held.of(h) for rid, h in (found.get("runs") or {}).items()}
        self.taken: set[str] = set(found.get("taken") or [])  # every request nonce ever claimed here, kept past down

    def remember(self, nonce: str) -> None:
        """A request claimed here: never taken again, even once its run is gone (a replayed request file)."""
        self.taken.add(nonce)
        self.save()

    def put(self, held: Held) -> Held:
        """Record `held` (replacing that run's record) and save; `held` back."""
        if self.runs.get(held.run_id) != held:
            self.runs[held.run_id] = held
            self.save()
        return held

    def drop(self, run_id: str) -> None:
        """Forget a run (removed here, or never taken after all) and save."""
        if self.runs.pop(run_id, None) is not None:
            self.save()

    def busy(self) -> list[str]:
        """The runs whose results are not home yet (the agent takes nothing new while there is one)."""
        return sorted(rid for rid, held in self.runs.items() if not held.home)

    def save(self) -> None:
        """agent.json, written whole (tmp, fsync, rename)."""
        atomic_write_json(self.path, {"runs": {rid: asdict(h) for rid, h in sorted(self.runs.items())},
                                      "taken": sorted(self.taken)})
