"""The built-in trainer on this machine: accuracy, steps per second, checkpoint size and cost.

    python bench/checkpoint_overhead.py [--epochs 20] [--repeat 3]

Trains configs/local.yaml's job with `checkpoint.every` 50 and with 0 (never), alternating,
in fresh temporary projects, and reads every number from the pulled, verified files: the
training time is the span from the launcher's `launch` event to its `exit` event.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def train(root: Path, every: int, epochs: int) -> dict:
    root.mkdir(parents=True)
    shutil.copy(REPO / "dodo.py", root / "dodo.py")
    text = (REPO / "configs" / "local.yaml").read_text()
    text = text.replace("checkpoint: {keep: 3, every: 50}", f"checkpoint: {{keep: 3, every: {every}}}")
    text = text.replace("epochs: 20", f"epochs: {epochs}")
    (root / "tether.yaml").write_text(text)
    done = subprocess.run([sys.executable, "-m", "doit", "run", "train"], cwd=root, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(done.stderr)
    (run,) = (root / ".tether" / "runs").iterdir()
    files = run / "files"
    events = [json.loads(line) for line in (files / "events.jsonl").read_text().splitlines()]
    launch = next(e["t"] for e in events if e["event"] == "launch")
    exit_ = next(e["t"] for e in events if e["event"] == "exit")
    steps = [e for e in events if e["event"] == "step"]
    saved = [e for e in events if e["event"] == "checkpoint"]
    metrics = json.loads((files / "artifacts" / "metrics.json").read_text())
    return {"wall_s": exit_ - launch, "steps": steps[-1]["step"],
            "loop_s": steps[-1]["t"] - steps[0]["t"], "checkpoints": len(saved),
            "checkpoint_bytes": saved[-1]["bytes"] if saved else 0, "val_accuracy": metrics["val_accuracy"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    results: dict[int, list[dict]] = {50: [], 0: []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeat):
            for every in (50, 0):  # alternating, so drift in the machine's load hits both alike
                results[every].append(train(Path(tmp) / f"{every}-{i}", every, args.epochs))
    loop = {k: statistics.median(r["loop_s"] for r in v) for k, v in results.items()}
    every50 = results[50][0]
    print(json.dumps({
        "val_accuracy": every50["val_accuracy"], "steps": every50["steps"],
        "steps_per_s_never": round(every50["steps"] / loop[0], 1),
        "steps_per_s_every_50": round(every50["steps"] / loop[50], 1),
        "checkpoint_bytes": every50["checkpoint_bytes"], "checkpoints_written": every50["checkpoints"],
        "loop_s_median": {"every_50": round(loop[50], 3), "never": round(loop[0], 3)},
        "overhead_pct": round(100 * (loop[50] - loop[0]) / loop[0], 1),
        "launch_to_exit_s_median": {str(k): round(statistics.median(r["wall_s"] for r in v), 3)
                                    for k, v in results.items()},
    }, indent=2))


if __name__ == "__main__":
    main()
