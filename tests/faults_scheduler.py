"""Part B of the fault suite: a flaky squeue/scontrol on the login node (fail, hang, garbage, empty), switched by files."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from sshd import SSHServer

MODES = ("fail", "hang", "garbage", "empty")
TIMEOUT_S = 2  # the far side's TETHER_SCHEDULER_TIMEOUT_S here: a hang is past it within one poll

WRAPPER = """\
#!/bin/sh
# {name} as the file {mode} says: fail | hang | garbage | empty; no file: the real {name}
case "$(cat {mode} 2>/dev/null)" in
  fail) echo "{name}: error: Unable to contact slurm controller (connect failure)" >&2; exit 1 ;;
  hang) exec sleep 600 ;;
  garbage) echo "slurm_load_jobs error: <html><body>502 Bad Gateway</body></html>"; exit 0 ;;
  empty) exit 0 ;;
esac
exec {real} "$@"
"""

# What watch prints for each mode of squeue (the far side's words, tether/remote/scheduler.py)
SAID = {"fail": "squeue exited 1: squeue: error: Unable to contact slurm controller",
        "hang": f"squeue did not answer within {TIMEOUT_S:g} s",
        "garbage": "squeue printed an unreadable line"}


class FlakyScheduler:
    """squeue and scontrol stand-ins first on the PATH of a login sshd of the cluster's own (its other sshd)."""

    def __init__(self, base: Path, slurm_conf: str) -> None:
        self.bin = base / "bin"
        self.bin.mkdir(parents=True, exist_ok=True)
        for name in ("squeue", "scontrol"):
            real = shutil.which(name)
            assert real, f"{name} is not installed"
            script = self.bin / name
            script.write_text(WRAPPER.format(name=name, mode=self.bin / f"{name}.mode", real=real))
            script.chmod(0o755)
        self.login = SSHServer(base / "ssh", path_prepend=str(self.bin),
                               env={"SLURM_CONF": slurm_conf, "TETHER_SCHEDULER_TIMEOUT_S": str(TIMEOUT_S)})

    def set(self, name: str, mode: str | None) -> None:
        """Switch `name` (squeue or scontrol) to `mode`, or back to the real one (None)."""
        path = self.bin / f"{name}.mode"
        if mode is None:
            path.unlink(missing_ok=True)
        else:
            path.write_text(mode)

    def heal(self) -> None:
        self.set("squeue", None)
        self.set("scontrol", None)


def jobs_submitted(far: Path) -> list[str]:
    """Every job id submitted for the far side's one run (slurm.json keeps them all)."""
    runs = sorted((far / "runs").iterdir())
    return json.loads((runs[-1] / "slurm.json").read_text()).get("jobs", [])


def scheduler_lines(text: str) -> list[str]:
    """watch's lines about the scheduler not answering."""
    return [line for line in text.splitlines() if re.search(r"job \S+: .*waiting for the scheduler", line)]
