"""What one look at the mailbox found for this agent: requests it may take, stops and downs, signatures checked."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from tether import mailbox, signing
from tether.errors import SignatureError
from tether.remote.protocol import Peeked

REQUEST, STOP, DOWN = "request", "stop", "down"
ANSWERS = {REQUEST: ("claim", "refused"), STOP: ("stopped", "refused")}  # a file that says it was handled


@dataclass(frozen=True)
class Letter:
    """One file the laptop wrote for an agent: which run, which request, its text and its age."""

    kind: str  # request | stop | down
    run_id: str
    nonce: str  # '' for a down request (its file is named by the run)
    path: str
    text: str
    age_s: float

    def unverified(self) -> dict:
        """Its body as written, before any signature is checked: only to decide whether to look closer."""
        try:
            found = json.loads(self.text)
        except ValueError:
            return {}
        body = found.get("body", found) if isinstance(found, dict) else {}
        return body if isinstance(body, dict) else {}


@dataclass(frozen=True)
class Inbox:
    """The letters of one poll, each not yet answered: launches for this agent (or any), stops, downs."""

    requests: list[Letter]
    stops: list[Letter]
    downs: list[Letter]


def patterns(name: str) -> list[str]:
    """The globs one `peek` reads: every run's agent files, and this agent's down requests."""
    return ["runs/*/agent/*.json", mailbox.down_request(name, "*")]


def sort(peeked: Peeked, name: str) -> Inbox:
    """The unanswered requests addressed to `name` or to any agent (and not yet void), stops and downs."""
    letters, answered = [], set()
    for path, found in peeked.files.items():
        parts = path.split("/")
        if parts[0] == "agents" and len(parts) == 3 and parts[2].startswith("down-"):
            letters.append(Letter(DOWN, parts[2][len("down-"):-len(".json")], "", path, found.text or "", found.age_s))
        elif parts[0] == "runs" and len(parts) == 4 and found.text is not None:
            kind, nonce = mailbox.parse_name(path)
            if kind in (REQUEST, STOP) and nonce:
                letters.append(Letter(kind, parts[1], nonce, path, found.text, found.age_s))
            elif nonce:
                answered.add((parts[1], kind, nonce))
    open_ = [x for x in letters if not any((x.run_id, a, x.nonce) in answered for a in ANSWERS.get(x.kind, ()))]
    requests = [x for x in open_ if x.kind == REQUEST and _for(x, name)]
    return Inbox(sorted(requests, key=lambda x: -x.age_s), [x for x in open_ if x.kind == STOP],
                 [x for x in open_ if x.kind == DOWN])


def _for(letter: Letter, name: str) -> bool:
    """Whether a request names this agent (or none), and is younger than its own queue_timeout_s."""
    body = letter.unverified()
    try:
        timeout = float(body.get("queue_timeout_s", math.inf))
    except (TypeError, ValueError):
        timeout = math.inf  # a body that does not parse is refused once its signature is looked at
    return str(body.get("agent") or "") in ("", name) and letter.age_s < timeout


def verified(letter: Letter, keys: list[Any], record: Any) -> Any:
    """The letter's body as `record` (Request, StopRequest, DownRequest) if a trusted key signed it and
    it names its own file's run (and nonce); SignatureError saying why not."""
    what = f"{letter.kind} {letter.path}"
    try:
        signed = json.loads(letter.text)
    except ValueError:
        raise SignatureError(f"{what} is not JSON (unsigned)") from None
    body, _ = signing.verified(signed, keys, what)
    try:
        found = record.of(body)
    except (TypeError, ValueError) as err:
        raise SignatureError(f"{what}: its signed body is not a {record.__name__} ({err})") from None
    if found.run_id != letter.run_id or (letter.nonce and found.nonce != letter.nonce):
        raise SignatureError(f"{what}: it is signed for run {found.run_id} ({found.nonce}), not for this file")
    return found


def signer_of(letter: Letter) -> str:
    """The fingerprint of the key a letter says signed it ('(unsigned)' when none), for the log."""
    import asyncssh

    try:
        return asyncssh.import_public_key(str(json.loads(letter.text)["key"])).get_fingerprint()
    except (ValueError, KeyError, TypeError, asyncssh.KeyImportError):  # no signature at all
        return "(unsigned)"
