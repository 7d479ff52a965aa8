"""The `command` trainer: any program, run as-is; a script that resumes itself is mapped, not edited."""

from __future__ import annotations

import dataclasses
import re
import shlex
from dataclasses import dataclass, field
from typing import Optional, Union

from tether.errors import ConfigError
from tether.remote import progress

RESERVED = ("python", "checkpoint")  # placeholders the launcher fills on the far side
MAGIC = re.compile(r"[*?[]")  # what makes a path part a glob (as the far side reads it)
PYTHON = re.compile(r"\{python\}|python(3(\.\d+)?)?")  # what torchrun's workers may be started with


@dataclass(frozen=True)
class Config:
    """trainer: {type: command, command: "{python} train.py", resume_args: [...], checkpoint: PATH}

    `{python}` in the command is the far side's interpreter; `{checkpoint}` in resume_args is
    the checkpoint to resume from. `checkpoint` names what the script writes itself, relative to
    where it runs: a file (out/ckpt.pt), a folder, or a glob in its last part
    (outputs/checkpoint-*: the newest complete match). It is kept with the run and restored
    before a resume.
    `requires` lists the Python modules the far side must have (checked before launch; with torch,
    also whether it has kernels for each GPU).
    `progress` (a preset, `tqdm` or `dict`, or a regex with a (?P<step>...) group) reads step
    events from the script's own output; `total_steps` is a number or the name of a group.
    `processes` (above 1, or `auto`: one per GPU the run got) starts it under torchrun on the far
    side (tether.remote.ranks); 1 runs it as it is.
    """

    command: Union[str, tuple[str, ...]]
    type: str = "command"
    resume_args: tuple[str, ...] = ()
    checkpoint: Optional[str] = None
    env: dict = field(default_factory=dict)
    progress: Optional[str] = None
    total_steps: Union[int, str, None] = None
    requires: tuple[str, ...] = ()  # modules the far side must have; with torch, check asks for kernels per GPU
    processes: Union[int, str] = 1

    def __post_init__(self) -> None:
        # `requires` is both the key and every trainer's requires() (the modules `check` looks for);
        # torchrun (processes above 1) needs torch whatever the list says
        object.__setattr__(self, "requires", Modules(self.requires, ("torch",) if self.processes != 1 else ()))

    def argv(self) -> list[str]:
        """The command's words, split as a POSIX shell would; ConfigError for unbalanced quotes."""
        if not isinstance(self.command, str):
            return list(self.command)
        try:
            return shlex.split(self.command)
        except ValueError as err:  # "No closing quotation" or "No escaped character" (a trailing \\)
            fix = "balance the quotes" if "quotation" in str(err) else "remove the trailing backslash"
            raise ConfigError(f"trainer.command: {err}: {self.command!r}: {fix}, or give the command "
                              f"as a list of words")

    def launch_spec(self) -> dict:
        """What the launcher needs to start this trainer (stored in run.json)."""
        spec = {"argv": self.argv(), "resume_args": list(self.resume_args),
                "checkpoint_path": self.checkpoint, "env": {str(k): str(v) for k, v in self.env.items()}}
        if self.progress:  # only when set: the run.json (and id) of a run without it stays as it was
            spec.update(progress=self.progress, total_steps=self.total_steps)
        if self.processes != 1:  # likewise
            spec["processes"] = self.processes
        return spec

    def sweep_problems(self, keys: list[str]) -> list[str]:
        """A swept key reaches the program as `{key}` in the command, e.g. --lr {lr}."""
        text = self.command if isinstance(self.command, str) else " ".join(self.command)
        return [f"sweep.{key}: write {{{key}}} into trainer.command (e.g. --{key} {{{key}}}) so the program "
                f"gets the value" if key not in RESERVED else f"sweep.{key}: {{{key}}} is tether's own placeholder; "
                f"rename the key" for key in keys if key in RESERVED or "{%s}" % key not in text]

    def with_params(self, values: dict) -> "Config":
        """This trainer with `{key}` in the command replaced by each swept value."""
        from tether.sweep import value_text

        def fill(text: str) -> str:
            for key, value in values.items():
                text = text.replace("{%s}" % key, value_text(value))
            return text
        command = fill(self.command) if isinstance(self.command, str) else tuple(map(fill, self.command))
        return dataclasses.replace(self, command=command)

    def problems(self) -> list[str]:
        """What is wrong with this section beyond types (empty when nothing is)."""
        try:
            argv = self.argv()
        except ConfigError as err:
            return err.problems
        found = []
        if not argv:
            found.append("trainer.command is empty: give the program to run, e.g. \"{python} train.py\"")
        if self.checkpoint is not None:
            found += [p for p in [checkpoint_problem(self.checkpoint)] if p]
        if self.resume_args and not self.checkpoint and not any("{checkpoint}" in a for a in self.resume_args):
            found.append("trainer.resume_args never mention {checkpoint}: the script cannot know where to resume from")
        found += [f"trainer.requires: {m!r} is not a module name: give what the script imports, e.g. torch"
                  for m in self.requires if not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", m)]
        return found + progress.problems(self.progress, self.total_steps) + processes_problems(self.processes, argv)


def processes_problems(processes: Union[int, str], argv: list[str]) -> list[str]:
    """What keeps `trainer.processes` from starting the command under torchrun (empty when nothing does)."""
    if processes == 1:
        return []
    if isinstance(processes, str) and processes != "auto" or isinstance(processes, int) and processes < 1:
        return [f"trainer.processes must be a number of processes (1 or more) or auto (one per GPU the run "
                f"got), got {processes!r}"]
    script = len(argv) >= 2 and (argv[1] == "-m" and len(argv) >= 3 or not argv[1].startswith("-"))
    if argv and PYTHON.fullmatch(argv[0].rsplit("/", 1)[-1]) and script:
        return []
    return [f"trainer.processes: {processes} runs the command under torchrun, which starts a Python script or "
            f"module: write the command as \"{{python}} SCRIPT ...\" or \"{{python}} -m MODULE ...\" "
            f"(got {' '.join(argv)!r})"]


class Modules(tuple):
    """The `requires:` list (what equality and the run's identity see), which is also called as the
    trainer's `requires()`: the list plus the modules tether's own launch needs (`needed`)."""

    def __new__(cls, names: tuple[str, ...] = (), needed: tuple[str, ...] = ()) -> "Modules":
        modules = super().__new__(cls, names)
        modules.needed = tuple(m for m in needed if m not in names)
        return modules

    def __call__(self) -> tuple[str, ...]:
        return tuple(self) + self.needed


def checkpoint_problem(path: str) -> str:
    """Why `trainer.checkpoint` cannot name a checkpoint inside the run, as a sentence naming the fix ('' if it can)."""
    fix = "name it relative to where the script runs, e.g. out/ckpt.pt or outputs/checkpoint-*"
    parts = path.replace("\\", "/").split("/")
    if path.replace("\\", "/").startswith("/") or path.startswith("~"):
        return f"trainer.checkpoint {path!r} is an absolute path, outside the run: {fix}"
    if ".." in parts:
        return f"trainer.checkpoint {path!r} leaves the run folder ('..'): {fix}"
    if parts[-1] == "" and path.strip("/"):
        return f"trainer.checkpoint {path!r} ends in '/': name the folder without it, e.g. {path.rstrip('/')!r}"
    if parts[-1] in ("", ".") or not path.strip():
        return f"trainer.checkpoint {path!r} names no file or folder: {fix}"
    if any(MAGIC.search(part) for part in parts[:-1]):
        return (f"trainer.checkpoint {path!r} has a wildcard before its last part: only the last part may be "
                f"a glob, e.g. outputs/checkpoint-*")
    return ""
