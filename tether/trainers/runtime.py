"""The trainer's runtime under the name users' scripts import: a re-export of tether.remote.runtime."""

from tether.remote.runtime import (
    CHECKPOINT_RE, PREEMPTED_EXIT, StopSignal, checkpoints, latest_checkpoint, log, resume_from, save_checkpoint,
    stop_signal,
)

__all__ = ["CHECKPOINT_RE", "PREEMPTED_EXIT", "StopSignal", "checkpoints", "latest_checkpoint", "log", "resume_from",
           "save_checkpoint", "stop_signal"]  # tests/test_far_package.py keeps this equal to tether.remote.runtime's
