"""Torn-file helpers for the fault tests and the soak: seeded truncation points and seeded garbage."""

from __future__ import annotations

import random


def torn_bytes(whole: bytes, rng: random.Random) -> tuple[int, bytes]:
    """(cut, whole[:cut]) for a seeded cut strictly inside `whole`: what a writer killed mid-write leaves."""
    cut = rng.randrange(0, len(whole) - 1)
    return cut, whole[:cut]


def garbage(rng: random.Random) -> bytes:
    """Seeded bytes that are not JSON: binary noise, or text that starts like JSON and goes wrong."""
    kind = rng.randrange(3)
    if kind == 0:
        return bytes(rng.randrange(128, 256) for _ in range(rng.randrange(1, 64)))
    if kind == 1:
        return b'{"status": ' + bytes(rng.randrange(1, 32) for _ in range(rng.randrange(1, 16)))
    return b"\x00" * rng.randrange(1, 4096)
