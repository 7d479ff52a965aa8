"""A hook's shell command on the far side: /bin/sh in its own session, bounded, its group killed on timeout.

Stdlib only, Python >= 3.8 (copied to the far side with the launcher): notifications' `command`
(tether.remote.notify) and the box's idle stop (tether.remote.idle) run through it.
"""

from __future__ import annotations

import os
import signal
import subprocess
from typing import Any, Dict, Optional, Tuple


def run(command: str, cwd: str, env: Dict[str, str], timeout_s: float, stdin: Optional[bytes] = None,
        stdout: Any = subprocess.DEVNULL, stderr: Any = subprocess.PIPE) -> Tuple[Optional[int], bytes]:
    """Its exit code (None: it ran past timeout_s and its whole group was killed) and its stderr when piped.

    OSError when /bin/sh cannot be started.
    """
    child = subprocess.Popen(["/bin/sh", "-c", command], cwd=cwd, env=env, start_new_session=True,
                             stdin=subprocess.DEVNULL if stdin is None else subprocess.PIPE,
                             stdout=stdout, stderr=stderr)
    try:
        _, err = child.communicate(stdin, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(child.pid, signal.SIGKILL)  # its own session: the shell and all it started
        except OSError:
            pass
        child.communicate()  # reaped, its pipes closed
        return None, b""
    return child.returncode, err or b""
