"""Signatures over a mailbox's files: OpenSSH keys (ed25519 by default), read and used through asyncssh.

Whoever can write a mailbox could otherwise run code on an agent, or change results on their way
home; so the laptop signs what it asks an agent to run, the agent signs what it sends back, and
each side trusts only public keys it was given (an authorized_keys file, or one `.pub` line).
A signature covers a JSON body in one canonical form: its keys sorted, no spaces.
"""

from __future__ import annotations

import base64
import json
import os
from dataclasses import dataclass
from typing import Any

from tether.errors import SignatureError


def canonical(body: Any) -> bytes:
    """The bytes a signature covers: `body` as JSON with sorted keys and no spaces."""
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


@dataclass(frozen=True)
class Signer:
    """A private key that signs, and the public line (`ssh-ed25519 AAAA... comment`) that checks it."""

    key: Any  # asyncssh.SSHKey
    path: str

    @property
    def public(self) -> str:
        return self.key.convert_to_public().export_public_key().decode().strip()

    @property
    def fingerprint(self) -> str:
        return self.key.get_fingerprint()

    def sign(self, body: Any) -> dict:
        """`body` with its signature: {"body", "key" (the public line), "signature" (base64)}."""
        signature = self.key.sign(canonical(body), self.key.sig_algorithms[0])
        return {"body": body, "key": self.public, "signature": base64.b64encode(signature).decode()}


def signer(path: str, purpose: str) -> Signer:
    """The private key at `path` (an OpenSSH key without a passphrase); `purpose` names its config key."""
    import asyncssh

    full = os.path.expanduser(path)
    try:
        return Signer(asyncssh.read_private_key(full), full)
    except FileNotFoundError:
        raise SignatureError(f"{purpose} {path}: no such key: make one with `ssh-keygen -t ed25519 -N '' -f {path}` "
                             f"or point {purpose} at yours") from None
    except (asyncssh.KeyImportError, ValueError) as err:
        raise SignatureError(f"{purpose} {path}: not a usable private key ({err}): give an OpenSSH key "
                             f"without a passphrase (ssh-keygen -t ed25519 -N '')") from None


def own_signer(path: str) -> tuple[Signer, bool]:
    """The key at `path`, made now (ed25519, mode 0600, with its .pub beside it) if there is none;
    (the signer, whether it was made)."""
    import asyncssh

    full = os.path.expanduser(path)
    if os.path.exists(full):
        return signer(path, "--key"), False
    os.makedirs(os.path.dirname(full) or ".", mode=0o700, exist_ok=True)
    key = asyncssh.generate_private_key("ssh-ed25519", comment=f"tether-agent@{os.uname().nodename}")
    key.write_private_key(full)
    os.chmod(full, 0o600)
    key.write_public_key(full + ".pub")
    return Signer(key, full), True


def trusted(path: str, purpose: str) -> list[Any]:
    """The public keys of an authorized_keys file or a `.pub` file (options before a key are skipped)."""
    import asyncssh

    full = os.path.expanduser(path)
    try:
        with open(full, encoding="utf-8", errors="replace") as f:
            lines = [line.split() for line in f if line.strip() and not line.lstrip().startswith("#")]
    except FileNotFoundError:
        raise SignatureError(f"{purpose} {path}: no such file: give a file of trusted public keys "
                             f"(one `ssh-ed25519 AAAA...` line each)") from None
    keys = []
    for words in lines:
        for at, word in enumerate(words[:-1]):
            try:
                keys.append(asyncssh.import_public_key(f"{word} {words[at + 1]}"))
                break
            except (asyncssh.KeyImportError, ValueError):
                continue
    if not keys:
        raise SignatureError(f"{purpose} {path}: holds no public key: add the signer's `ssh-ed25519 AAAA...` line")
    return keys


def verified(signed: Any, keys: list[Any], what: str) -> tuple[Any, str]:
    """The body of `signed` if one of `keys` signed it: (body, the signer's fingerprint); else SignatureError."""
    import asyncssh

    if not isinstance(signed, dict) or not {"body", "key", "signature"} <= set(signed):
        raise SignatureError(f"{what} is not signed: only runs from a laptop whose key is trusted are taken")
    try:
        key = asyncssh.import_public_key(str(signed["key"]))
        signature = base64.b64decode(str(signed["signature"]), validate=True)
    except (asyncssh.KeyImportError, ValueError):
        raise SignatureError(f"{what}: its key or signature does not parse") from None
    if not any(k.public_data == key.public_data for k in keys):
        raise SignatureError(f"{what} is signed by {key.get_fingerprint()}, which is not trusted here: "
                             f"add its public key to the trusted keys if it is yours")
    if not key.verify(canonical(signed["body"]), signature):
        raise SignatureError(f"{what}: the signature of {key.get_fingerprint()} does not match: "
                             f"the file was changed after it was signed")
    return signed["body"], key.get_fingerprint()
