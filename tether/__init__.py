"""tether: take a training job up, push, launch, watch, pull, verify and down, as doit tasks."""

__version__ = "0.1.0"
