"""Hostile and unlucky input, as data: each case is an input that once lost, leaked or wedged
something, the one-line error (or safe outcome) it now gets, and proof that what it threatened
is intact afterwards.

One section per area; each section's cases are a table of `pytest.param`s.
"""

from __future__ import annotations

import pytest  # noqa: F401


# ================================================================ remote_dir ownership and prune


# (end of section: remote_dir ownership and prune)


# ================================================================ seal, artifacts, launcher failures


# (end of section: seal, artifacts, launcher failures)


# ================================================================ GPUs and SLURM guards


# (end of section: GPUs and SLURM guards)


# ================================================================ config input and command line


# (end of section: config input and command line)


# ================================================================ pull, verify and transfers


# (end of section: pull, verify and transfers)
