"""The `report` task: curves and a Markdown summary, every number read from pulled, verified files."""

from __future__ import annotations

import json
import os

from tether import manifest
from tether.errors import RunError
from tether.paths import RunPaths
from tether.pipelines import resuming
from tether.pipelines.session import Session
from tether.remote.fileio import json_lines, read_json


def read_events(run: RunPaths) -> list[dict]:
    """The run's events; a torn or junk line (a trainer killed mid-write) is no event."""
    with open(run.pulled("events.jsonl"), "rb") as f:
        return json_lines(f.read())[0]


def facts(run: RunPaths) -> dict:
    """Everything the summary states, taken from the verified files and nothing else."""
    events = read_events(run)
    state = read_json(run.pulled("state.json")) or {}
    spec = read_json(run.pulled("run.json")) or {}
    metrics = read_json(run.pulled("artifacts/metrics.json")) if os.path.exists(
        run.pulled("artifacts/metrics.json")) else {}
    steps = [e for e in events if e.get("event") == "step"]
    launches = [e for e in events if e.get("event") == "launch"]
    exits = [e for e in events if e.get("event") == "exit"]
    wall = sum(x["t"] - l["t"] for l, x in zip(launches, exits))
    verified = read_json(run.verified)
    return {"run_id": run.run_id, "status": state.get("status"), "steps": steps[-1]["step"] if steps else 0,
            "wall_s": round(wall, 1), "restarts": state.get("restarts", 0), "host": state.get("host"),
            "backend": spec.get("backend"), "code_hash": spec.get("code_hash"), "data_hash": spec.get("data_hash"),
            "manifest_sha256": verified["manifest_sha256"], "metrics": metrics or {},
            "restart_steps": [_step_at(steps, l["t"]) for l in launches[1:]],
            "lineage": resuming.lineage(spec), "attempts": state.get("attempt")}


def _step_at(steps: list[dict], t: float) -> int:
    before = [e["step"] for e in steps if e["t"] <= t]
    return before[-1] if before else 0


def markdown(f: dict) -> str:
    lines = [f"# Run {f['run_id']}", "", "## Final metrics (artifacts/metrics.json)", "",
             "| metric | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in sorted(f["metrics"].items())]
    lines += ["", "## The run", "", "| | |", "|---|---|", f"| status | {f['status']} |",
              f"| steps | {f['steps']} |", f"| wall time (s) | {f['wall_s']} |",
              f"| restarts | {f['restarts']} |"] + \
             ([f"| attempts | {f['attempts']} |"] if f.get("attempts") else []) + \
             ([f"| lineage | {f['lineage']} |"] if f.get("lineage") else []) + [
              f"| ran on | {f['host']} (backend {f['backend']}) |",
              f"| code sha256 | {_hash(f['code_hash'])} |", f"| data sha256 | {_hash(f['data_hash'])} |",
              f"| manifest sha256 | `{f['manifest_sha256']}` |", "",
              "![curves](curves.png)", "",
              "Every value above is read from the run's pulled files, verified against its manifest.", ""]
    return "\n".join(lines)


def _hash(value: str | None) -> str:
    return f"`{value}`" if value else "(no files pushed)"


def plot(run: RunPaths, f: dict, path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        raise RunError("the report's figure needs matplotlib: pip install 'tether[report]' (or pip install matplotlib)")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    events = read_events(run)
    steps = [e for e in events if e.get("event") == "step" and "loss" in e]
    epochs = [e for e in events if e.get("event") == "epoch"]
    accuracy_key = "val_accuracy" if any("val_accuracy" in e for e in epochs) else "accuracy"
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot([e["step"] for e in steps], [e["loss"] for e in steps], linewidth=0.8)
    left.set(title="training loss", xlabel="step", ylabel="loss", yscale="log")
    right.plot([e["step"] for e in epochs if accuracy_key in e],
               [e[accuracy_key] for e in epochs if accuracy_key in e], marker="o")
    right.set(title=accuracy_key.replace("_", " "), xlabel="step", ylabel="accuracy")
    for axis in (left, right):
        for step in f["restart_steps"]:
            axis.axvline(step, color="grey", linestyle="--", linewidth=0.8)
        axis.grid(alpha=0.3)
    fig.suptitle(f"{f['run_id']} ({f['restarts']} restarts; dashed: resumed)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def report(s: Session) -> str:
    run = s.observed()
    if not manifest.still_verified(run):
        raise RunError(f"run {run.run_id} has no verified pull: `doit run train` (or `doit pull verify "
                       f"run={run.run_id}`) first; the report reads only verified files")
    folder = os.path.join(run.local, "report")
    os.makedirs(folder, exist_ok=True)
    found = facts(run)
    plot(run, found, os.path.join(folder, "curves.png"))
    with open(os.path.join(folder, "report.md"), "w", encoding="utf-8") as out:
        out.write(markdown(found))
    with open(os.path.join(folder, "facts.json"), "w", encoding="utf-8") as out:
        json.dump(found, out, indent=2, sort_keys=True)
    return f"{run.run_id}: report in {folder} (report.md, curves.png, facts.json)"
