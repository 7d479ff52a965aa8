"""The agent's command line: `tether agent --mailbox URL --name NAME [...]`, parsed into one Options."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import Optional

from tether import mailbox
from tether.errors import ConfigError

USAGE_FIX = "see `tether agent --help`"


@dataclass(frozen=True)
class Options:
    """Where the mailbox is, who this agent is, where and how it runs what it takes."""

    mailbox: str
    name: str
    once: bool = False
    workdir: str = ""  # default ~/.cache/tether/agent/NAME
    python: str = sys.executable
    gpus: str = "auto"
    trust: str = "~/.ssh/authorized_keys"
    key: str = "~/.ssh/id_ed25519"
    poll_s: float = mailbox.POLL_S
    identity_file: Optional[str] = None  # the relay's ssh keys (ssh:// mailboxes)
    known_hosts: Optional[str] = None
    ssh_config: Optional[str] = None
    relay_python: Optional[str] = None

    @property
    def folder(self) -> str:
        """The workdir, absolute: the local far side's remote_dir."""
        return os.path.abspath(os.path.expanduser(self.workdir or f"~/.cache/tether/agent/{self.name}"))

    def problems(self) -> list[str]:
        """Every reason these options cannot work, one line each naming the fix."""
        found = [p for p in [mailbox.agent_name_problem(self.name, "--name")] if p]
        try:
            mailbox.address(self.mailbox, "--mailbox")
        except ConfigError as err:
            found += err.problems
        if not self.poll_s > 0:
            found.append(f"--poll-s {self.poll_s:g} must be positive: the seconds between two looks at the mailbox")
        return found


def parser() -> argparse.ArgumentParser:
    """The argparse parser of `tether agent`."""
    p = argparse.ArgumentParser(prog="tether agent", description="Run what a mailbox's signed requests ask for, "
                                "on this machine (it only ever connects out, to the mailbox).")
    p.add_argument("--mailbox", required=True, help="file:///shared/path or ssh://[user@]host[:port]/path")
    p.add_argument("--name", required=True, help="this agent's name in the mailbox (letters, digits, ._-)")
    p.add_argument("--once", action="store_true", help="handle one run to its end, then exit")
    p.add_argument("--workdir", default="", help="where runs live here (default ~/.cache/tether/agent/NAME)")
    p.add_argument("--python", default=sys.executable, help="the interpreter runs get (default: this one)")
    p.add_argument("--gpus", default="auto", help="auto, none, a count or indices such as 0,1 (default auto)")
    p.add_argument("--trust", default="~/.ssh/authorized_keys", help="the public keys whose requests run here")
    p.add_argument("--key", default="~/.ssh/id_ed25519", help="the key results are signed with (made if missing)")
    p.add_argument("--poll-s", type=float, default=mailbox.POLL_S, help="seconds between two looks at the mailbox")
    p.add_argument("--identity-file", help="ssh key for an ssh:// mailbox's relay")
    p.add_argument("--known-hosts", help="known_hosts file for the relay")
    p.add_argument("--ssh-config", help="ssh config file for the relay")
    p.add_argument("--relay-python", help="the relay's Python (default python3)")
    return p


def parse(argv: list[str]) -> Options:
    """Options from the command line; ConfigError listing every problem (argparse exits 2 on its own)."""
    got = parser().parse_args(argv)
    options = Options(mailbox=got.mailbox, name=got.name, once=got.once, workdir=got.workdir, python=got.python,
                      gpus=got.gpus, trust=got.trust, key=got.key, poll_s=got.poll_s,
                      identity_file=got.identity_file, known_hosts=got.known_hosts, ssh_config=got.ssh_config,
                      relay_python=got.relay_python)
    found = options.problems()
    if found:
        raise ConfigError(found)
    return options
