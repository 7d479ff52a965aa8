"""The agent backend: a machine tether cannot reach runs what it finds in a mailbox both sides reach.

The transport is the mailbox (tether/mailbox.py): a folder on a relay over ssh, or on this machine
(a shared mount), served by tether's own far-side process there, so push, pull, tail and the event
reader work on it unchanged. The policy is the agent's (`tether agent`, tether/agent/): a launch is
a signed request it claims, a stop a signed request it honours; the run's state is what the agent
last reported, aged on the mailbox's clock.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from typing import Optional

from tether import mailbox
from tether.backends.base import Backend as BaseBackend
from tether.backends.openssh import Connection, SSHTransport
from tether.backends.transport import LocalTransport, Transport
from tether.errors import ConfigError


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


class Backend(BaseBackend):
    """The agent policy over a mailbox transport."""

    type = "agent"
    config: Config

    def make_transport(self) -> Transport:
        where = self.config.address()
        if where.scheme == "file":
            return LocalTransport(where.path, self.config.python or sys.executable)
        return SSHTransport(self.config.relay(where), self.state_dir)
