"""A sweep's citable results: results.json (the single source), then a table, a figure and their provenance.

Every number comes from a point's pulled `artifacts/metrics.json`, checked against its verified
manifest. The table and the figure are rendered from results.json as written to disk, never from
values held in memory, so they cannot disagree with it. Points that are not verified are named
and left out, never averaged in.
"""

from __future__ import annotations

import json
import os
import statistics
import time

from tether import manifest
from tether.errors import RunError
from tether.paths import RunPaths
from tether.pipelines.session import Session
from tether.remote.fileio import atomic_write_bytes, atomic_write_json, json_lines, read_json, sha256_file
from tether.sweep import SEED_KEY

METRICS_FILE = "artifacts/metrics.json"
EVENTS_FILE = "events.jsonl"
PROGRESS_FIELDS = ("event", "t", "source", "step", "total_steps")  # a step event's own keys, not metrics
MAX_PANELS = 4


def report(s: Session) -> str:
    """results.json, results.md, results.png and results.provenance.json for the sweep."""
    folder = os.path.join(s.state_dir, "reports", f"{s.job.name}-{s.job.backend}")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "results.json")
    atomic_write_json(path, collect(s))
    with open(path, encoding="utf-8") as f:
        results = json.load(f)  # everything below is rendered from the file itself
    if not results["points"]:
        raise RunError(f"no point of the sweep is verified here, so there is nothing to report "
                       f"({len(results['excluded'])} left out): `doit run train` first")
    table = os.path.join(folder, "results.md")
    atomic_write_bytes(table, markdown(results).encode())
    figure = os.path.join(folder, "results.png")
    plot(results, figure)
    atomic_write_json(os.path.join(folder, "results.provenance.json"), provenance(results, path, table, figure))
    names = ", ".join(e["point"] for e in results["excluded"])
    left = f"; left out (not verified): {names}" if names else ""
    return (f"{s.job.name}: {len(results['points'])} verified points in {folder} (results.json, results.md, "
            f"results.png, results.provenance.json){left}")


def collect(s: Session) -> dict:
    """Per point: its params, run id, manifest SHA-256 and final metrics; the unverified ones, named."""
    points, excluded = [], []
    for point in s.points:
        run = point.current()  # this exact code, data and settings: an older run is not this result
        label = point.point.label
        if run is None:
            excluded.append({"point": label, "run_id": None, "why": "not run with the current code, data and "
                                                                    "settings: `doit run train`"})
        elif not manifest.still_verified(run):
            excluded.append({"point": label, "run_id": run.run_id, "why": f"not verified here: `doit run train` "
                                                                          f"(or `doit pull verify run={run.run_id}`)"})
        else:
            try:
                points.append(dict(point=label, params=point.point.values, run_id=run.run_id,
                                   **_verified_metrics(run)))
            except RunError as err:
                excluded.append({"point": label, "run_id": run.run_id, "why": str(err)})
    return {"format": 1, "name": s.job.name, "backend": s.job.backend, "config": os.path.basename(s.job.source),
            "config_sha256": sha256_file(s.job.source)[0], "tether_version": s.backend.version,
            "sweep": {k: list(v) for k, v in s.job.sweep.items()}, "seed_key": SEED_KEY,
            "metrics_file": METRICS_FILE, "created_at": round(time.time(), 3), "points": points,
            "excluded": excluded}


def _verified_metrics(run: RunPaths) -> dict:
    """The run's numeric final metrics, after checking the file's bytes against its manifest entry.

    From artifacts/metrics.json; a run without one whose `progress:` read metrics from its output
    gives the newest value of each of those instead (from its verified events.jsonl).
    """
    listed, manifest_sha = manifest.load(run)
    entries = {e["path"]: e for e in listed["files"]}
    source = METRICS_FILE if METRICS_FILE in entries else EVENTS_FILE
    if source not in entries:
        raise RunError(f"run {run.run_id} has no {METRICS_FILE} in its manifest: the trainer must write it "
                       f"and artifacts: must list metrics.json (or set trainer.progress to read its output)")
    sha, _ = sha256_file(run.pulled(source))
    if sha != entries[source]["sha256"]:
        raise RunError(f"run {run.run_id}: {source} no longer matches its manifest: `doit pull verify "
                       f"run={run.run_id}` fetches it again")
    metrics = (read_json(run.pulled(METRICS_FILE)) or {}) if source == METRICS_FILE else _progress_metrics(run)
    numbers = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    if not numbers and source == EVENTS_FILE:
        raise RunError(f"run {run.run_id} has no {METRICS_FILE} in its manifest and its output gave no metrics: "
                       f"write {METRICS_FILE} (listed in artifacts:), or set trainer.progress to read them")
    return {"manifest_sha256": manifest_sha, "metrics_sha256": sha, "metrics": numbers, "metrics_file": source}


def _progress_metrics(run: RunPaths) -> dict:
    """The newest value of each metric that `progress:` read from the run's output (step events)."""
    found: dict = {}
    with open(run.pulled(EVENTS_FILE), "rb") as f:
        events = json_lines(f.read())[0]
    for event in events:
        if event.get("event") == "step" and event.get("source") == "progress":
            found.update({k: v for k, v in event.items() if k not in PROGRESS_FIELDS})
    return found


def groups(results: dict) -> list[dict]:
    """The points grouped by setting (all params but the seed), in sweep order, with each metric's values."""
    found: dict[str, dict] = {}
    for point in results["points"]:
        setting = {k: v for k, v in point["params"].items() if k != results["seed_key"]}
        key = json.dumps(setting, sort_keys=True)
        group = found.setdefault(key, {"setting": setting, "runs": [], "values": {}})
        group["runs"].append(point["run_id"])
        for name, value in point["metrics"].items():
            group["values"].setdefault(name, []).append(value)
    return list(found.values())


def mean_sd(values: list[float]) -> tuple[float, float | None]:
    """Mean and sample standard deviation (n - 1); None for a single value."""
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else None)


def cell(values: list[float]) -> str:
    mean, sd = mean_sd(values)
    return f"{mean:.4g} ± {sd:.4g}" if sd is not None else f"{mean:.4g}"


def metric_names(results: dict) -> list[str]:
    names: list[str] = []
    for point in results["points"]:
        names += [n for n in point["metrics"] if n not in names]
    return names


def markdown(results: dict) -> str:
    """The table: one row per setting, mean ± sample standard deviation over seeds, and n."""
    names, rows = metric_names(results), groups(results)
    keys = [k for k in results["sweep"] if k != results["seed_key"]]
    lines = [f"# Sweep {results['name']} (backend {results['backend']})", "",
             f"Mean ± sample standard deviation (n − 1) over {results['seed_key']}s of each metric in "
             f"{_sources(results)}; n is the number of verified runs in the row.", "",
             "| " + " | ".join(keys + ["n"] + names) + " |", "|" + "---|" * (len(keys) + 1 + len(names))]
    for group in rows:
        values = [str(group["setting"][k]) for k in keys] + [str(len(group["runs"]))]
        values += [cell(group["values"][n]) if n in group["values"] else "" for n in names]
        lines.append("| " + " | ".join(values) + " |")
    lines += ["", "Generated from `results.json`; `results.provenance.json` lists every run and the SHA-256 "
                  "of its manifest.", ""]
    if results["excluded"]:
        lines += ["## Left out (not averaged in)", ""]
        lines += [f"- `{e['point']}`" + (f" (run `{e['run_id']}`)" if e["run_id"] else "") + f": {e['why']}"
                  for e in results["excluded"]]
        lines.append("")
    return "\n".join(lines)


def _sources(results: dict) -> str:
    """Where the points' metrics were read: metrics.json, or what `progress:` read from the output."""
    files = sorted({p.get("metrics_file", results["metrics_file"]) for p in results["points"]})
    return " and ".join(f"`{f}`" + (" (the newest value `progress:` read from the output)" if f == EVENTS_FILE else "")
                        for f in files)


def plot(results: dict, path: str) -> None:
    """The mean per setting with ±1 sample standard deviation as error bars, every run as a dot beside it."""
    try:
        import matplotlib
    except ImportError:
        raise RunError("the report's figure needs matplotlib: pip install 'tether[report]' (or pip install matplotlib)")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, names = groups(results), metric_names(results)
    varying = [n for n in names if len({v for g in rows for v in g["values"].get(n, [])}) > 1] or names[:1]
    shown = varying[:MAX_PANELS]
    labels = [",".join(f"{k}={v}" for k, v in g["setting"].items()) or "all" for g in rows]
    fig, axes = plt.subplots(1, len(shown), figsize=(4.5 * len(shown), 4), squeeze=False)
    for axis, name in zip(axes[0], shown):
        for x, group in enumerate(rows):
            values = group["values"].get(name, [])
            if not values:
                continue
            mean, sd = mean_sd(values)
            axis.errorbar(x, mean, yerr=sd or 0, fmt="s", color="black", capsize=6, markersize=6)
            axis.plot([x + 0.15] * len(values), values, "o", color="#3182bd", alpha=0.7, markersize=4)
        axis.set_xticks(range(len(rows)), labels, rotation=20, ha="right")
        axis.set_xlim(-0.5, len(rows) - 0.5)
        axis.set(title=name, ylabel=name)
        axis.grid(axis="y", alpha=0.3)
        axis.ticklabel_format(axis="y", useOffset=False)
    fig.suptitle(f"{results['name']}: mean ± sample sd over {results['seed_key']}s (dots: runs)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def provenance(results: dict, path: str, table: str, figure: str) -> dict:
    """What the figure and the table came from: every run, its manifest hash, and the files' hashes."""
    return {"format": 1, "results": os.path.basename(path), "results_sha256": sha256_file(path)[0],
            "table": os.path.basename(table), "table_sha256": sha256_file(table)[0],
            "figure": os.path.basename(figure), "figure_sha256": sha256_file(figure)[0],
            "runs": [{k: p[k] for k in ("point", "run_id", "manifest_sha256", "metrics_sha256")}
                     for p in results["points"]],
            "excluded": results["excluded"]}
