"""The trainer's runtime under the name users' scripts import: a re-export of tether.remote.runtime."""

from tether.remote.runtime import *  # noqa: F401,F403 (anything tether.remote.runtime adds to __all__)
from tether.remote.runtime import (  # noqa: F401 (the names, spelled out for readers and linters)
    CHECKPOINT_RE, PREEMPTED_EXIT, StopSignal, checkpoints, latest_checkpoint, log, resume_from, save_checkpoint,
    stop_signal,
)
