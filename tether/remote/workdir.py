"""The trainer's working directory in a run dir: code and data at their project paths, plus its output.

Stdlib only, Python >= 3.8 (copied to the far side with the launcher).
"""

from __future__ import annotations

import os

WORK = "work"  # objects.materialize builds it; the launcher starts the trainer there


def work_dir(run_dir: str) -> str:
    """Where the trainer starts: work/, or code/ for a run dir without one (made by hand, or by an older tether)."""
    work, code = os.path.join(run_dir, WORK), os.path.join(run_dir, "code")
    return code if not os.path.isdir(work) and os.path.isdir(code) else work


def work_path(run_dir: str, relpath: str) -> str:
    """A path the trainer names relative to its working directory (a script's own checkpoint, say)."""
    return os.path.join(work_dir(run_dir), relpath)
