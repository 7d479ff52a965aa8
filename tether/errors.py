"""The one exception tree: every message says what to run or edit next.

    TetherError
     +-- ConfigError          the YAML file or a command-line variable is wrong
     +-- RunError             a run id, a run's state or a phase's precondition is wrong
     +-- BackendError         the far side cannot be reached or refused an operation
     |    +-- RemoteCommandError   a far-side command exited non-zero (exit code, stderr tail)
     +-- ManifestError        pulled files do not match the far side's manifest
     +-- SignatureError       a mailbox file is unsigned, or signed by a key nobody trusts
"""

from __future__ import annotations


class TetherError(Exception):
    """Base of every error tether raises on purpose; its message names the fix."""


class ConfigError(TetherError):
    """The config file or a command-line variable is invalid; `problems` lists every one."""

    def __init__(self, problems: list[str] | str) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(self.problems))


class RunError(TetherError):
    """A run id is invalid, unknown, or a run is in a state that forbids the phase."""


class BackendError(TetherError):
    """The far side is unreachable, or refused an operation."""


class RemoteCommandError(BackendError):
    """A far-side command exited non-zero."""

    def __init__(self, argv: list[str], exit_code: int, stderr: str) -> None:
        self.argv, self.exit_code = argv, exit_code
        self.stderr_tail = "\n".join(stderr.strip().splitlines()[-10:])
        shown = " ".join(a if len(a) < 60 else a[:57] + "..." for a in argv[:3])
        super().__init__(f"far-side command `{shown}` exited {exit_code}: {self.stderr_tail}")


class ManifestError(TetherError):
    """Pulled files do not match the manifest built on the far side."""


class SignatureError(TetherError):
    """A file from a mailbox is unsigned, its signature is wrong, or its key is not trusted."""
