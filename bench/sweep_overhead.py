"""What a sweep costs beyond its runs: a 2 x 3 sweep of the stdlib demo trainer on the local backend.

    python bench/sweep_overhead.py [--repeat 5]

Measures, in fresh temporary projects: the whole sweep with `doit run train` (one point after
the other) and with `doit -n 2 -P process train`; a no-op `doit run train` once every point is
done (every per-point task answers "up to date"), against the same no-op for a single job; and
`doit status` over the six points.
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
SWEEP = """
sweep:
  lr: [0.1, 0.03]
  seed: [0, 1, 2]
"""


def make_project(root: Path, sweep: bool) -> None:
    shutil.copytree(REPO / "configs" / "demo", root / "demo")
    shutil.copy(REPO / "dodo.py", root / "dodo.py")
    text = (REPO / "configs" / "command.yaml").read_text()
    if sweep:
        text = text.replace("--epochs 30", "--epochs 30 --lr {lr} --seed {seed}") + SWEEP
    (root / "tether.yaml").write_text(text)


def timed(root: Path, *args: str) -> float:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "doit", *args], cwd=root, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"doit {args} failed:\n{done.stdout}\n{done.stderr}")
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    found: dict[str, object] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, command in (("sweep_serial_s", ("run", "train")), ("sweep_n2_process_s", ("-n", "2", "-P", "process", "train"))):
            root = Path(tmp) / name
            make_project(root, sweep=True)
            found[name] = round(timed(root, *command), 3)
        root = Path(tmp) / "sweep_serial_s"
        found["sweep_noop_median_s"] = round(statistics.median(timed(root, "run", "train") for _ in range(args.repeat)), 3)
        found["sweep_status_median_s"] = round(statistics.median(timed(root, "status") for _ in range(args.repeat)), 3)
        single = Path(tmp) / "single"
        make_project(single, sweep=False)
        timed(single, "run", "train")
        found["single_noop_median_s"] = round(statistics.median(timed(single, "run", "train") for _ in range(args.repeat)), 3)
    print(json.dumps(found, indent=2))


if __name__ == "__main__":
    main()
