"""Write RELIABILITY.md from the fault soaks' results (bench/results/faults_*.json), never by hand.

    python bench/reliability.py            # rewrites RELIABILITY.md at the repository root

Each soak (bench/faults_*.py) writes one JSON file: the command that made it, its seed, and per
scenario the faults injected, how many every invariant survived, the invariants, the failures
with the seed and moment that replay each, and the command that reproduces the scenario.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"

HEAD = """# Reliability

tether's promise is that no interruption costs a result. These figures come from the fault soaks
in `bench/` (seeded and repeatable; they talk only to services on 127.0.0.1 that they start),
written into this file by `python bench/reliability.py` from `bench/results/faults_*.json`.
A fast subset of every scenario runs in the default test suite (`tests/test_faults_*.py`).
"""


@dataclass(frozen=True)
class Scenario:
    """One scenario of one soak, as its JSON gives it."""

    name: str
    about: str
    faults: int
    survived: int
    invariants: list[str]
    failures: list[dict]
    reproduce: str


@dataclass(frozen=True)
class Soak:
    """One soak's results file."""

    source: str
    part: str
    command: str
    seed: int
    started: str
    seconds: float
    machine: str
    scenarios: list[Scenario] = field(default_factory=list)


def read_soak(path: Path) -> Soak:
    raw = json.loads(path.read_text())
    scenarios = [Scenario(s["name"], s.get("about", ""), int(s["faults"]), int(s["survived"]),
                          list(s.get("invariants", [])), list(s.get("failures", [])), s.get("reproduce", ""))
                 for s in raw["scenarios"]]
    return Soak(path.name, raw["part"], raw["command"], raw.get("seed", 0), raw.get("started", ""),
                float(raw.get("seconds", 0)), raw.get("machine", ""), scenarios)


def soak_section(soak: Soak) -> list[str]:
    lines = [f"## {soak.part}", "", f"From `bench/results/{soak.source}`, made by:", "", f"    {soak.command}", "",
             f"Seed {soak.seed}; run {soak.started} on {soak.machine}; {_took(soak.seconds)}.", "",
             "| scenario | faults injected | survived | failures |", "|---|---|---|---|"]
    for s in soak.scenarios:
        lines.append(f"| {s.name} | {s.faults} | {s.survived} | {len(s.failures)} |")
    for s in soak.scenarios:
        lines += ["", f"### {s.name}", "", s.about, "", "Invariants checked after every fault:", ""]
        lines += [f"- {invariant}" for invariant in s.invariants]
        lines += ["", f"Reproduce: `{s.reproduce}`"]
        for failure in s.failures:
            lines.append(f"- failed at seed {failure.get('seed')}, {failure.get('moment')}: {failure.get('what')}")
    return lines + [""]


def _took(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} minutes"


def render(soaks: list[Soak]) -> str:
    total = sum(s.faults for soak in soaks for s in soak.scenarios)
    survived = sum(s.survived for soak in soaks for s in soak.scenarios)
    lines = [HEAD, f"**{survived} of {total} injected faults survived** over {len(soaks)} soaks.", ""]
    for soak in soaks:
        lines += soak_section(soak)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "RELIABILITY.md")
    args = parser.parse_args()
    soaks = [read_soak(path) for path in sorted(RESULTS.glob("faults_*.json"))]
    if not soaks:
        raise SystemExit(f"no soak results in {RESULTS}: run bench/faults_*.py first")
    args.out.write_text(render(soaks))
    print(f"wrote {args.out} from {len(soaks)} soak(s)")


if __name__ == "__main__":
    main()
