"""A `sweep:` grid over trainer settings: its points, their labels, and each point's own job."""

from __future__ import annotations

import dataclasses
import itertools
import re
from dataclasses import dataclass
from typing import Any

SEED_KEY = "seed"  # the replicate axis: report averages over it
KEY_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
VALUE_RE = re.compile(r"[A-Za-z0-9._+-]+")  # what a value may look like inside a doit task name


@dataclass(frozen=True)
class Point:
    """One setting of every swept key, e.g. {lr: 0.001, seed: 2}."""

    params: tuple[tuple[str, Any], ...]

    @property
    def values(self) -> dict[str, Any]:
        return dict(self.params)

    @property
    def label(self) -> str:
        """`lr:0.001,seed:2`, the doit sub-task name (doit forbids '=' in task names)."""
        return ",".join(f"{key}:{value_text(value)}" for key, value in self.params)


def value_text(value: Any) -> str:
    """A swept value as it is written into task names and commands (booleans as true/false)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def points(grid: dict[str, list]) -> list[Point]:
    """Every combination, the last key varying fastest (the config's key order)."""
    keys = list(grid)
    values = [[_plain(v) for v in grid[k]] for k in keys]
    return [Point(tuple(zip(keys, combo))) for combo in itertools.product(*values)]


def _plain(value: Any) -> Any:
    """A YAML scalar as the plain Python value (ruamel's subclasses keep formatting we do not want)."""
    for kind in (bool, int, float, str):
        if isinstance(value, kind):
            return kind(value)
    return value


def problems(grid: dict[str, Any], trainer: Any) -> list[str]:
    """What is wrong with a `sweep:` section for this trainer (empty when nothing is)."""
    found = []
    for key, values in grid.items():
        if not KEY_RE.fullmatch(key):
            found.append(f"sweep: key {key!r} is not a setting name")
        elif not isinstance(values, list) or not values:
            found.append(f"sweep.{key}: give a non-empty list of values, e.g. {key}: [1, 2]")
        elif any(isinstance(v, (dict, list)) or v is None for v in values):
            found.append(f"sweep.{key}: values must be numbers, strings or booleans")
        elif len(set(map(value_text, values))) != len(values):
            found.append(f"sweep.{key}: a value is listed twice")
        elif not all(VALUE_RE.fullmatch(value_text(v)) for v in values):
            found.append(f"sweep.{key}: values may use letters, digits and ._+- only (they name doit tasks)")
    if found or trainer is None:
        return found
    return found + list(trainer.sweep_problems(list(grid)))


def job_for(job: Any, point: Point) -> Any:
    """The job with the point's values in its trainer settings (and recorded as its params)."""
    return dataclasses.replace(job, trainer=job.trainer.with_params(point.values), sweep={})
