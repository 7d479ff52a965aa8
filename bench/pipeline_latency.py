"""How long tether itself takes: a no-op `doit run train`, and `doit run train` to the first event.

    python bench/pipeline_latency.py [--repeat 5]

Runs in a fresh temporary project with the stdlib demo trainer (configs/demo), on the local
backend, so the numbers are tether's overhead rather than a trainer's start-up.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def make_project(root: Path) -> None:
    shutil.copytree(REPO / "configs" / "demo", root / "demo")
    shutil.copy(REPO / "dodo.py", root / "dodo.py")
    text = (REPO / "configs" / "command.yaml").read_text()
    (root / "tether.yaml").write_text(text)


def first_event_s(root: Path) -> float:
    """Seconds from starting `doit run train` to the first line in the far side's events.jsonl."""
    started = time.perf_counter()
    doit = subprocess.Popen([sys.executable, "-m", "doit", "run", "train"], cwd=root,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    runs = root / ".tether" / "remote" / "runs"
    while True:
        found = list(runs.glob("*/events.jsonl")) if runs.exists() else []
        if found and found[0].stat().st_size > 0:
            elapsed = time.perf_counter() - started
            break
        time.sleep(0.002)
    if doit.wait(timeout=300) != 0:
        raise SystemExit("doit run train failed")
    return elapsed


def noop_s(root: Path) -> float:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "doit", "run", "train"], cwd=root, capture_output=True, text=True)
    elapsed = time.perf_counter() - started
    if done.returncode != 0 or ".  " in done.stdout:
        raise SystemExit(f"not a no-op:\n{done.stdout}\n{done.stderr}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        make_project(root)
        first = first_event_s(root)
        noops = [noop_s(root) for _ in range(args.repeat)]
    print(json.dumps({"first_event_s": round(first, 3), "noop_median_s": round(statistics.median(noops), 3),
                      "noop_s": [round(n, 3) for n in noops]}, indent=2))


if __name__ == "__main__":
    main()
