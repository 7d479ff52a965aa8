"""A mailbox: the folder both the laptop and an agent can reach, where runs wait, get claimed and report back.

Its root is a remote_dir like any other (objects/ and runs/<id>/ exactly as `push` writes them);
what the two sides say to each other are small JSON files beside them, each written whole
(`put`, or `create` when only one writer may win) and read many at a time (`peek`):

    agents/<name>.json                    the agent, every poll: host, Python, GPUs, what it runs
                                          (its age on the mailbox's clock is "last seen")
    agents/<name>/down-<run_id>.json      signed (laptop): remove your copy of this verified run
    runs/<id>/agent/request-<nonce>.json  signed (laptop): run this, once; one per launch (attempt)
    runs/<id>/agent/claim-<nonce>.json    the agent that took that request (created exclusively)
    runs/<id>/agent/refused-<nonce>.json  why an agent would not run it (never executed)
    runs/<id>/agent/stop-<nonce>.json     signed (laptop): SIGTERM the run, SIGKILL after grace_s
    runs/<id>/agent/stopped-<nonce>.json  what the stop did (agent)
    runs/<id>/agent/snapshot.json         the agent's own probe of the run (Snapshot's fields), written
                                          after everything it mirrors; final only once results are home
    runs/<id>/agent/manifest.sig.json     signed (agent): the SHA-256 of PULL_MANIFEST.json
    runs/<id>/{events.jsonl, train.log, launcher.log, PULL_MANIFEST.json, and the manifest's files}
                                          mirrored by the agent at their usual places, so pull,
                                          verify, tail and the event reader work unchanged

Both sides judge ages by the mailbox's clock (`peek` gives each file's age), never by each
other's. Nonces are fresh per request, so a request is handled once however often it is read.
"""

from __future__ import annotations

import posixpath
import re
import secrets
import urllib.parse
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Optional

from tether.errors import ConfigError

WITHDRAWN = "(withdrawn)"  # a Claim's agent when the laptop took its own request back (a stop before any claim)
POLL_S = 2.0  # how often an agent looks at the mailbox (tether agent --poll-s)
STALE_S = 30.0  # an agent whose record or snapshot is older than this is "not seen" (its runs: state unknown)
AGENT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
NONCE = re.compile(r"[0-9a-f]{16}")


def new_nonce() -> str:
    return secrets.token_hex(8)


# ------------------------------------------------------------------ where things are


def agent_record(name: str) -> str:
    return f"agents/{name}.json"


def down_request(agent: str, run_id: str) -> str:
    return f"agents/{agent}/down-{run_id}.json"


def run_file(run_id: str, kind: str, nonce: str = "") -> str:
    """runs/<id>/agent/<kind>[-<nonce>].json: kind is request, claim, refused, stop, stopped,
    snapshot or manifest.sig."""
    return f"runs/{run_id}/agent/{kind}-{nonce}.json" if nonce else f"runs/{run_id}/agent/{kind}.json"


def run_files(run_id: str) -> str:
    """The glob of a run's agent files, for `peek`."""
    return f"runs/{run_id}/agent/*.json"


def parse_name(path: str) -> tuple[str, str]:
    """(kind, nonce) of a runs/<id>/agent/ file name: ("claim", "ab12...") or ("snapshot", "")."""
    stem = posixpath.basename(path)[: -len(".json")]
    kind, _, nonce = stem.partition("-")
    return (kind, nonce) if NONCE.fullmatch(nonce) else (stem, "")


# ------------------------------------------------------------------ what the files hold


class Record:
    """A mailbox file's JSON as a frozen dataclass: `of` reads one (unknown keys ignored), `as_dict` writes it."""

    @classmethod
    def of(cls, found: Any) -> Any:
        if not isinstance(found, dict):
            raise ValueError(f"a {cls.__name__} must be a JSON object")
        names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
        return cls(**{k: v for k, v in found.items() if k in names})

    def as_dict(self) -> dict:
        return asdict(self)  # type: ignore[call-overload]


@dataclass(frozen=True)
class Request(Record):
    """What the laptop signs to have a run executed: the run's files by hash, and how to run it."""

    run_id: str
    nonce: str
    agent: str  # the agent it is for ('' : any agent of the mailbox)
    run_json_sha256: str  # runs/<id>/run.json as pushed
    tree_sha256: str  # runs/<id>/tree.json: every code and data object the run uses, by hash
    settings: dict  # the backend's settings for `start` (env); remote_dir, python and GPUs are the agent's
    environment: dict  # the job's environment (tether.environment.Wanted.request()); {} : none asked for
    version: str  # the laptop's launcher version
    queue_timeout_s: float  # after this (on the mailbox's clock) unclaimed, the request is void
    signer: str = ""  # the laptop's key fingerprint, for messages



@dataclass(frozen=True)
class Claim(Record):
    """The agent that took a request, and when (its own clock, for messages only)."""

    agent: str
    host: str
    at: float



@dataclass(frozen=True)
class StopRequest(Record):
    """What the laptop signs to stop a run: SIGTERM, then SIGKILL after grace_s."""

    run_id: str
    nonce: str
    grace_s: float



@dataclass(frozen=True)
class DownRequest(Record):
    """What the laptop signs to have an agent remove its copy of a run (after `down`'s gate passed here)."""

    run_id: str
    nonce: str



@dataclass(frozen=True)
class AgentRecord(Record):
    """An agent as it describes itself on every poll; its file's age is when it was last seen."""

    name: str
    host: str
    python: str  # the interpreter its runs get, and its version: "/usr/bin/python3 (3.11.2)"
    version: str  # its launcher version
    gpus: list = field(default_factory=list)  # one line per GPU ("0: NVIDIA A100, 40000/40960 MB free")
    free_mb: int = 0  # free space in its workdir
    running: list = field(default_factory=list)  # run ids it runs now
    key: str = ""  # the public key it signs results with
    pid: int = 0



# ------------------------------------------------------------------ the mailbox's address


@dataclass(frozen=True)
class Address:
    """A mailbox URL taken apart: file:///path or ssh://[user@]host[:port]/path."""

    scheme: str  # file | ssh
    path: str
    host: str = ""
    user: Optional[str] = None
    port: Optional[int] = None

    def __str__(self) -> str:
        if self.scheme == "file":
            return f"file://{self.path}"
        who = f"{self.user}@" if self.user else ""
        return f"ssh://{who}{self.host}{f':{self.port}' if self.port else ''}{self.path}"


def address(url: str, key: str = "mailbox") -> Address:
    """The Address of a mailbox URL; ConfigError naming the forms that work."""
    parsed = urllib.parse.urlsplit(url)
    forms = "file:///shared/path or ssh://[user@]host[:port]/path (a folder on a host both sides reach)"
    if parsed.scheme not in ("file", "ssh"):
        more = " (an object store has no atomic create, so two agents could take one run)" \
            if parsed.scheme in ("s3", "gs", "gcs", "az", "abfs") else ""
        raise ConfigError(f"{key} {url!r}: the scheme {parsed.scheme or '(none)'!r} is not a mailbox tether "
                          f"can use{more}: give {forms}")
    path = urllib.parse.unquote(parsed.path)
    if not path.startswith("/") or path.rstrip("/") == "" or ".." in path.split("/"):
        raise ConfigError(f"{key} {url!r}: give an absolute folder without '..': {forms}")
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise ConfigError(f"{key} {url!r}: a file:// URL names a folder on this machine: file:///path")
        return Address("file", path.rstrip("/"))
    try:
        port = parsed.port
    except ValueError:
        raise ConfigError(f"{key} {url!r}: the port is not a number") from None
    if not parsed.hostname:
        raise ConfigError(f"{key} {url!r}: no host: {forms}")
    return Address("ssh", path.rstrip("/"), parsed.hostname, parsed.username, port)


def agent_name_problem(name: str, key: str = "agent") -> Optional[str]:
    """Why `name` cannot name an agent (it becomes a file name in the mailbox), or None."""
    if AGENT_NAME.fullmatch(name):
        return None
    return f"{key} {name!r}: use letters, digits and ._- (at most 64, starting with a letter or digit)"
