"""Backends by short type name: the module holding its `Config` dataclass and `Backend` class."""

BACKEND_TYPES = {
    "local": "tether.backends.local",
    "ssh": "tether.backends.ssh",
    "slurm": "tether.backends.slurm",
    "agent": "tether.backends.agent",
}
