"""tether: take a training job up, push, launch, watch, pull, verify and down, as doit tasks."""

import importlib

__version__ = "0.1.0"

# The public API, imported on first use (PEP 562): the far side imports this package with the stdlib only.
_LAZY = {"Job": "tether.api", "Run": "tether.api", "RunStatus": "tether.api", "Verified": "tether.api",
         "TetherError": "tether.errors", "ConfigError": "tether.errors", "RunError": "tether.errors",
         "BackendError": "tether.errors", "RemoteCommandError": "tether.errors", "ManifestError": "tether.errors"}


def __getattr__(name: str):
    """`tether.Job`, `tether.Run`, `tether.RunStatus`, `tether.Verified` and the errors, imported when asked."""
    if name not in _LAZY:
        raise AttributeError(f"module 'tether' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)
