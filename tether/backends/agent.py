"""The agent backend: a machine tether cannot reach runs what it finds in a mailbox both sides reach.

The transport is the mailbox (tether/mailbox.py): a folder on a relay over ssh, or on this machine
(a shared mount), served by tether's own far-side process there, so push, pull, tail and the event
reader work on it unchanged. The policy is the agent's (`tether agent`, tether/agent/): a launch is
a signed request it claims, a stop a signed request it honours; the run's state is what the agent
last reported, aged on the mailbox's clock.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import socket
import sys
import time
from dataclasses import dataclass
from typing import Any, Optional

from tether import mailbox, signing
from tether.backends.base import Backend as BaseBackend
from tether.backends.base import Report
from tether.backends.openssh import Connection, SSHTransport
from tether.backends.transport import LocalTransport, Transport
from tether.errors import ConfigError, SignatureError
from tether.paths import RunPaths
from tether.remote.protocol import (ABSENT, ALREADY_RUNNING, FAILED, PENDING, STARTED, STOPPED, STOPPED_NOW,
                                    WAS_NOT_RUNNING, EnvironmentInfo, LaunchResult, Peeked, Snapshot, StopOutcome)

STOP_ANSWER_S = 30.0  # beyond grace_s, how long `stop` waits for the agent's answer (it polls every POLL_S)


@dataclass(frozen=True, kw_only=True)
class Config(Connection):
    """backends: {NAME: {type: agent, mailbox: URL, agent: NAME, ...}}: runs go through a mailbox to an agent.

    mailbox: file:///shared/path, or ssh://[user@]host[:port]/path (the relay; the ssh keys below,
    as on an ssh backend, reach it; python: is the relay's). agent: the agent's name (default: any
    agent of the mailbox). queue_timeout_s: a run no agent claims in this long fails. signing_key:
    the private key that signs each run (default ~/.ssh/id_ed25519); agent_key: the agent's public
    key (a .pub or authorized_keys file): when set, results it did not sign are refused.
    """

    type: str = "agent"
    host: str = ""  # from the mailbox URL
    mailbox: str = ""
    agent: str = ""
    queue_timeout_s: float = 600.0
    signing_key: str = "~/.ssh/id_ed25519"
    agent_key: Optional[str] = None
    python: Optional[str] = None  # type: ignore[assignment]  # the relay's (ssh://) or this one's (file://)
    remote_dir: str = ""  # from the mailbox URL

    def address(self) -> mailbox.Address:
        return mailbox.address(self.mailbox)

    def problems(self) -> list[str]:
        if not self.mailbox:
            return ["mailbox is missing: give file:///shared/path or ssh://[user@]host[:port]/path, a folder "
                    "both this machine and the agent reach"]
        try:
            where = self.address()
        except ConfigError as err:
            return err.problems
        found = [p for p in Connection.problems(self.relay(where)) if not p.startswith("remote_dir")] \
            if where.scheme == "ssh" else []
        found += [p for p in [mailbox.agent_name_problem(self.agent)] if p and self.agent]
        if self.queue_timeout_s <= 0:
            found.append(f"queue_timeout_s {self.queue_timeout_s:g} must be positive: the seconds a run may wait "
                         f"for an agent to claim it (e.g. 600)")
        return found

    def relay(self, where: mailbox.Address) -> Connection:
        """The ssh keys of an ssh:// mailbox as a Connection to its relay, remote_dir its path."""
        return Connection(**dict(
            {f.name: getattr(self, f.name) for f in dataclasses.fields(Connection)},
            type="ssh", host=where.host, user=where.user or self.user, port=where.port or self.port,
            remote_dir=where.path, python=self.python or "python3"))


@dataclass(frozen=True)
class Seen:
    """An agent as the mailbox shows it: its record and how long ago it wrote it (the mailbox's clock)."""

    record: mailbox.AgentRecord
    age_s: float


@dataclass(frozen=True)
class Attempt:
    """A run's newest request and what answered it, as one peek found them."""

    nonce: str
    request: mailbox.Request
    age_s: float  # the request's age on the mailbox's clock
    claim: Optional[mailbox.Claim] = None
    refused: Optional[dict] = None
    snapshot: Optional[dict] = None  # the agent's snapshot.json, when it is of this request
    snapshot_age_s: float = 0.0


def _json(peeked: Peeked, path: str) -> Any:
    """A peeked file's JSON (None: missing, too large or not JSON: as if it were not there yet)."""
    found = peeked.files.get(path)
    try:
        return json.loads(found.text) if found is not None and found.text is not None else None
    except ValueError:
        return None


def agents_seen(peeked: Peeked) -> dict[str, Seen]:
    """Every agent whose record `agents/*.json` the peek found, by name."""
    seen = {}
    for path, found in peeked.files.items():
        body = _json(peeked, path) if path.startswith("agents/") and path.count("/") == 1 else None
        try:
            record = mailbox.AgentRecord.of(body)
        except (TypeError, ValueError):
            continue
        seen[record.name] = Seen(record, found.age_s)
    return seen


def attempt(run_id: str, peeked: Peeked) -> Optional[Attempt]:
    """The run's newest request (a newer one supersedes the older) with its claim, refusal and snapshot."""
    prefix = f"runs/{run_id}/agent/"
    requests = []
    for path, found in peeked.files.items():
        kind, nonce = mailbox.parse_name(path) if path.startswith(prefix) else ("", "")
        signed = _json(peeked, path) if kind == "request" else None
        try:
            requests.append((found.age_s, nonce, mailbox.Request.of((signed or {}).get("body"))))
        except (TypeError, ValueError):
            continue
    if not requests:
        return None
    age, nonce, request = min(requests, key=lambda r: r[0])
    claim, refused = _json(peeked, mailbox.run_file(run_id, "claim", nonce)), \
        _json(peeked, mailbox.run_file(run_id, "refused", nonce))
    snapshot = _json(peeked, mailbox.run_file(run_id, "snapshot"))
    ours = isinstance(snapshot, dict) and snapshot.get("nonce") == nonce
    try:
        taken = mailbox.Claim.of(claim) if claim is not None else None
    except (TypeError, ValueError):
        taken = None
    return Attempt(nonce, request, age, taken, refused if isinstance(refused, dict) else None,
                   snapshot if ours else None,
                   peeked.files[mailbox.run_file(run_id, "snapshot")].age_s if ours else 0.0)


def _ago(age: Optional[float]) -> str:
    return "never seen" if age is None else f"last seen {age:.0f} s ago"


def _waiting(name: str, seen: dict[str, Seen]) -> str:
    """`queued for agent NAME (last seen 12 s ago)` or `queued for any agent (2 seen: a 3 s ago, ...)`."""
    if name:
        return f"queued for agent {name} ({_ago(seen[name].age_s if name in seen else None)})"
    listed = ", ".join(f"{n} {s.age_s:.0f} s ago" for n, s in sorted(seen.items(), key=lambda kv: kv[1].age_s))
    return f"queued for any agent ({len(seen)} seen: {listed})" if seen else "queued for any agent (none seen)"


def _unclaimed(att: Attempt, seen: dict[str, Seen], now: float) -> Snapshot:
    """A request no agent took: queued, or failed once its queue_timeout_s (and two polls) passed."""
    name = att.request.agent
    if att.age_s <= att.request.queue_timeout_s + 2 * mailbox.POLL_S:
        return Snapshot(PENDING, now=now, queue={"text": _waiting(name, seen)})
    who = f"agent {name}" if name else "agent"
    ages = [s.age_s for n, s in seen.items() if n == name or not name]
    if ages and min(ages) < att.age_s:  # seen since the launch, yet it did not take the run
        reason = f"no {who} claimed the run in {att.age_s:.0f} s"
    else:
        reason = f"no {who} has been seen for {min(ages + [att.age_s]):.0f} s"
    return _ended(FAILED, now, reason)


def _ended(status: str, now: float, reason: str) -> Snapshot:
    """A run this side knows has ended without the agent's own report: never claimed, refused, withdrawn."""
    return Snapshot(status, final=True, now=now, state={"status": status, "reason": reason})


def _plus(age: Optional[float], more: float) -> Optional[float]:
    return None if age is None else round(age + more, 3)


def _reported(att: Attempt, now: float) -> Snapshot:
    """The agent's own probe, aged by its snapshot's age; stale (older than STALE_S, not final): decide nothing."""
    assert att.claim is not None and att.snapshot is not None
    age, found = att.snapshot_age_s, Snapshot.of(att.snapshot)
    final = bool(found.final and found.sealed)  # final only once the results are in the mailbox
    stale = f"agent {att.claim.agent} last reported {age:.0f} s ago" if not final and age > mailbox.STALE_S else None
    # alive until final: the agent is the run's controller (its restart policy, its stop), never this side's watch
    return dataclasses.replace(found, final=final, alive=found.alive or not final, now=now, queue_error=stale,
                               heartbeat_age_s=_plus(found.heartbeat_age_s, age),
                               output_age_s=_plus(found.output_age_s, age))


def snapshot(run_id: str, peeked: Peeked, seen: dict[str, Seen]) -> Snapshot:
    """One run's Snapshot from a peek of the mailbox, on the mailbox's clock."""
    now, att = peeked.now, attempt(run_id, peeked)
    if f"runs/{run_id}/tree.json" not in peeked.files:
        return Snapshot(ABSENT, now=now)
    if att is None:
        return Snapshot(PENDING, now=now)  # pushed, not launched
    claim, refused = att.claim, att.refused
    if claim is not None and claim.agent == mailbox.WITHDRAWN:
        return _ended(STOPPED, now, "withdrawn before any agent claimed it")
    if refused is not None and (claim is None or claim.agent == refused.get("agent")):
        return _ended(FAILED, now, f"agent {refused.get('agent')} refused the run: {refused.get('reason')}")
    if claim is None:
        return _unclaimed(att, seen, now)
    if att.snapshot is None:
        return Snapshot(PENDING, now=now, queue={"text": f"claimed by agent {claim.agent} on {claim.host}; preparing"})
    return _reported(att, now)


class Backend(BaseBackend):
    """The agent policy over a mailbox transport: every phase's files are the mailbox's; a launch is a
    signed request, the state what the agent last reported."""

    type = "agent"
    config: Config
    poll_interval_s = mailbox.POLL_S  # the agent writes every POLL_S: a slower watch only lags behind it
    exit_grace_s = 3 * mailbox.POLL_S  # a final state reaches the mailbox within a poll or two of the agent

    def make_transport(self) -> Transport:
        where = self.config.address()
        if where.scheme == "file":
            return LocalTransport(where.path, self.config.python or sys.executable)
        return SSHTransport(self.config.relay(where), self.state_dir)

    # ------------------------------------------------------------ the mailbox, not the trainer's machine

    def venv(self) -> Optional[EnvironmentInfo]:
        """None: the agent builds the job's venv (the request carries what it asks for), never the mailbox."""
        return None

    def prepare(self) -> None:
        """Nothing to build: the mailbox only holds files."""

    def settings(self) -> dict:
        return {"remote_dir": self.remote_dir, "gpus": "none", "env": {}, "python": self.base_python}

    def check(self, require: tuple[str, ...] = ()) -> Report:
        """The mailbox's own lines (Python, writable, disk, inodes) and one line per agent seen there."""
        report = Report(self.name)
        if self._preflight(report, self.settings()) is not None:
            self._agent_lines(report, agents_seen(self.far.peek(patterns=["agents/*.json"])))
        return report

    def _agent_lines(self, report: Report, seen: dict[str, Seen]) -> None:
        for name, s in sorted(seen.items()):
            r = s.record
            report.add(f"agent {name}", True, f"{r.host}, {r.python}, tether {r.version}, GPUs: "
                       f"{'; '.join(map(str, r.gpus)) or 'none'}, {r.free_mb} MB free, running "
                       f"{', '.join(map(str, r.running)) or 'nothing'}; {_ago(s.age_s)}")
        want = self.config.agent
        fresh = [s for n, s in seen.items() if (n == want or not want) and s.age_s <= self.config.queue_timeout_s]
        if fresh:
            return
        if want:
            said = f"agent {want} {_ago(seen[want].age_s)}" if want in seen else f"no agent {want} seen in the mailbox yet"
        else:
            said = "no agent seen in the mailbox " + ("lately" if seen else "yet")
        report.add("agent", True, f"{said}: runs wait for one there; start it on the training machine: "
                   f"tether agent --mailbox {self.config.mailbox} --name {want or 'NAME'}")

    # ------------------------------------------------------------ runs

    def _peek(self, runs: list[RunPaths], agents: bool = True) -> Peeked:
        """Every file the runs' states need, in one request."""
        return self.far.peek(paths=[r.remote_file("tree.json") for r in runs],
                             patterns=[mailbox.run_files(r.run_id) for r in runs] + (["agents/*.json"] if agents else []))

    def states(self, runs: list[RunPaths]) -> dict[str, Snapshot]:
        """One snapshot per run from ONE peek of the mailbox."""
        peeked = self._peek(runs)
        seen = agents_seen(peeked)
        return {r.run_id: snapshot(r.run_id, peeked, seen) for r in runs}

    def _look(self, run: RunPaths) -> tuple[Optional[Attempt], Snapshot]:
        """The run's newest attempt and its snapshot, from one peek."""
        peeked = self._peek([run])
        return attempt(run.run_id, peeked), snapshot(run.run_id, peeked, agents_seen(peeked))

    def _signer(self) -> signing.Signer:
        return signing.signer(self.config.signing_key, "signing_key")

    def _sha256(self, run: RunPaths, name: str) -> str:
        return hashlib.sha256(self.far.cat(run.remote_file(name))).hexdigest()

    def launch(self, run: RunPaths) -> LaunchResult:
        """Drop a signed request for the run; never a second one while one is waiting, claimed or running."""
        who = f"agent {self.config.agent}" if self.config.agent else "any agent"
        att, snap = self._look(run)
        if att is not None and not snap.final:
            return LaunchResult(ALREADY_RUNNING, message=f"already launched for {who}; not queued again")
        signer, nonce = self._signer(), mailbox.new_nonce()
        request = mailbox.Request(
            run.run_id, nonce, self.config.agent, self._sha256(run, "run.json"), self._sha256(run, "tree.json"),
            settings={"env": self.config.trainer_env()},
            environment=self.environment.request() if self.environment.venv else {},
            version=self.version, queue_timeout_s=self.config.queue_timeout_s, signer=signer.fingerprint)
        self._put_signed(mailbox.run_file(run.run_id, "request", nonce), signer, request.as_dict())
        return LaunchResult(STARTED, message=f"queued for {who}")

    def _put_signed(self, path: str, signer: signing.Signer, body: dict) -> None:
        self.far.put(path, json.dumps(signer.sign(body), indent=1).encode())

    def stop(self, run: RunPaths, grace_s: float) -> StopOutcome:
        """Take back a request no agent claimed yet; ask the claiming agent to stop a claimed one."""
        att, snap = self._look(run)
        if att is None or snap.final:
            return StopOutcome(WAS_NOT_RUNNING, status=snap.status)
        if att.claim is None:
            withdrawn = mailbox.Claim(mailbox.WITHDRAWN, socket.gethostname(), time.time())
            if self.far.create(mailbox.run_file(run.run_id, "claim", att.nonce), json.dumps(withdrawn.as_dict()).encode()):
                return StopOutcome(STOPPED_NOW, status=STOPPED)
            att = attempt(run.run_id, self._peek([run])) or att  # an agent claimed it first: ask it to stop
        return self._ask_stop(run, att, grace_s)

    def _ask_stop(self, run: RunPaths, att: Attempt, grace_s: float) -> StopOutcome:
        """A signed stop request, then the agent's answer (or, in time, where the request waits)."""
        nonce = mailbox.new_nonce()
        self._put_signed(mailbox.run_file(run.run_id, "stop", nonce), self._signer(),
                         mailbox.StopRequest(run.run_id, nonce, grace_s).as_dict())
        answer, deadline = mailbox.run_file(run.run_id, "stopped", nonce), time.monotonic() + grace_s + STOP_ANSWER_S
        name = att.claim.agent if att.claim else (att.request.agent or "any")
        while time.monotonic() < deadline:
            peeked = self.far.peek(paths=[answer, mailbox.agent_record(name)])
            if isinstance(_json(peeked, answer), dict):
                return StopOutcome.of(_json(peeked, answer))
            time.sleep(0.5)
        last = peeked.files.get(mailbox.agent_record(name))
        return StopOutcome(f"stop requested: it waits in the mailbox for agent {name} "
                           f"({_ago(last.age_s if last else None)})")

    def teardown(self, run: RunPaths) -> tuple[str, list[str]]:
        """Remove the run from the mailbox, and ask each agent that claimed it to remove its copy."""
        peeked = self._peek([run], agents=False)
        claims = [_json(peeked, p) for p in peeked.files if mailbox.parse_name(p)[0] == "claim"]
        agents = sorted({c.get("agent") for c in claims if isinstance(c, dict)} - {mailbox.WITHDRAWN, None})
        done, others = super().teardown(run)
        signer = self._signer() if agents else None
        for name in agents:
            down = mailbox.DownRequest(run.run_id, mailbox.new_nonce())
            self._put_signed(mailbox.down_request(name, run.run_id), signer, down.as_dict())
        told = f"; agent {', '.join(agents)} removes its copy when it next polls" if agents else ""
        return done + told, others

    def reopen(self, run: RunPaths) -> dict:
        """The agent reopens its own copy when it takes the next request (the mailbox's files are its to
        write); here only the words: the attempt that ended and the checkpoint it mirrored."""
        attempt = int(self.state(run).state.get("attempt") or 0)
        found = self.far.checkpoint(run.remote_abs)
        return {"outcome": "reopened", "state": {"reopened": {"attempt": attempt}}, "next_attempt": attempt + 1,
                "checkpoint": found.checkpoint, "step": found.step}

    def vouch(self, run: RunPaths, manifest: bytes) -> None:
        """With agent_key: set, the manifest must carry the agent's signature over its very bytes."""
        if not self.config.agent_key:
            return
        what = f"{run.run_id}: PULL_MANIFEST.json"
        try:
            signed = json.loads(self.far.cat(mailbox.run_file(run.run_id, "manifest.sig")))
        except FileNotFoundError:
            raise SignatureError(f"{what} is not signed by the agent (no manifest.sig.json), and agent_key is set: "
                                 f"nothing pulled; the results did not come from a trusted agent") from None
        except ValueError:
            signed = None
        body, _ = signing.verified(signed, signing.trusted(self.config.agent_key, "agent_key"), what)
        digest = hashlib.sha256(manifest).hexdigest()
        if not isinstance(body, dict) or body.get("run_id") != run.run_id or body.get("manifest_sha256") != digest:
            raise SignatureError(f"{what} is not the one the agent signed (its SHA-256 differs): nothing pulled; "
                                 f"the mailbox's copy was changed after the agent sealed it")
