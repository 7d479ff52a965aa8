"""`repro` beyond the bit-identical case: data found on the backend or refused, a trainer that is
not deterministic judged by its metrics against `tolerance`, and bad input refused.

Real processes on the local backend; nothing sleeps.
"""

from __future__ import annotations

import json
import shutil

from conftest import Project, config_text

# A trainer whose model bytes differ on every run (it records when it ran) and whose one metric
# wobbles by at most 1e-6 around a value set by its data: not bitwise reproducible, yet close.
NOISY = r'''
import json, os, random, time
data = open(os.path.join(os.environ["TETHER_DATA_DIR"], "demo", "points.csv")).read()
out = os.environ["TETHER_ARTIFACTS_DIR"]
with open(os.path.join(out, "model.json"), "w") as f:
    json.dump({"trained_at": time.time()}, f)
with open(os.path.join(out, "metrics.json"), "w") as f:
    json.dump({"accuracy": 0.5 + len(data) % 97 / 1000 + random.random() * 1e-6, "rows": data.count("\n")}, f)
'''


def train_one(project) -> str:
    project.doit("run", "train", check=True)
    (run_id,) = project.run_ids()
    return run_id


def verdicts(output: str) -> list[str]:
    return [line for line in output.splitlines() if " -> " in line]


def test_data_missing_here_is_taken_from_the_backend_or_refused(project, tmp_path):
    run_id = train_one(project)
    (project.root / "demo" / "points.csv").unlink()  # the object store of the local backend still has it

    done = project.tether("repro", f".tether/runs/{run_id}")
    assert done.returncode == 0, done.stdout + done.stderr
    (line,) = verdicts(done.stdout)
    assert line.startswith(f"{run_id} -> ") and ": reproduced (" in line, done.stdout

    # a fresh copy of the project without the data, and a backend that never saw it
    fresh = tmp_path / "fresh"
    shutil.copytree(project.root / "demo", fresh / "demo")
    shutil.copy(project.root / "tether.yaml", fresh / "tether.yaml")
    shutil.copytree(project.local_run(run_id), fresh / "recorded" / run_id)
    refused = Project(fresh).tether("repro", f"recorded/{run_id}")
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert "its data is neither here nor on backend local" in refused.stderr, refused.stderr
    assert "demo/points.csv" in refused.stderr and "missing" in refused.stderr, refused.stderr
    assert not (fresh / ".tether" / "runs").exists() or not list((fresh / ".tether" / "runs").iterdir())


def test_a_trainer_that_is_not_deterministic_is_judged_by_its_metrics(project):
    (project.root / "demo" / "noisy.py").write_text(NOISY)
    project.write_config(config_text(command="{python} demo/noisy.py", code="demo/noisy.py"))
    run_id = train_one(project)

    done = project.tether("repro", f".tether/runs/{run_id}")
    assert done.returncode == 0, done.stdout + done.stderr
    (line,) = verdicts(done.stdout)
    assert "reproduced (metrics within tolerance 0.01, relative; 2 artifact(s) differ in bits)" in line, line

    strict = project.tether("repro", f".tether/runs/{run_id}", "tolerance=0")  # the same reproduction, judged again
    assert strict.returncode == 1, strict.stdout + strict.stderr
    (line,) = verdicts(strict.stdout)
    assert "NOT reproduced: metrics beyond tolerance 0 (relative): accuracy: recorded" in line, line
    assert "rows" not in line  # equal values are not named
    assert "did not reproduce" in strict.stderr
    assert len(project.run_ids()) == 2  # judged twice, trained once


def test_bad_paths_and_tolerances_are_refused(project):
    run_id = train_one(project)
    cases = [((), "repro needs a PATH"),
             (("nowhere.json",), "not a run folder, a results.json or a results.provenance.json"),
             (("demo",), "is not a pulled run folder"),
             ((f".tether/runs/{run_id}", "tolerance=abc"), "tolerance='abc'")]
    for args, words in cases:
        done = project.tether("repro", *args)
        assert done.returncode == 1 and words in done.stderr, (args, done.stdout, done.stderr)
    results = project.root / "results.json"
    results.write_text(json.dumps({"points": [{"run_id": run_id, "manifest_sha256": "0" * 64}]}))
    cited = project.tether("repro", str(results))
    assert cited.returncode == 1 and "is not the run those results came from" in cited.stderr, cited.stderr
    assert len(project.run_ids()) == 1  # nothing ran


def test_a_manifest_rewritten_to_match_changed_results_is_refused(project):
    """Changing a result and its manifest entry together still fails: PULL_VERIFIED.json carries the
    SHA-256 of the manifest that was verified when the run came home."""
    import hashlib

    run_id = train_one(project)
    folder = project.local_run(run_id)
    metrics = folder / "files" / "artifacts" / "metrics.json"
    metrics.write_text(json.dumps({"accuracy": 0.999, "steps": 750}))
    listed = json.loads((folder / "PULL_MANIFEST.json").read_text())
    for entry in listed["files"]:
        if entry["path"] == "artifacts/metrics.json":
            entry.update(bytes=metrics.stat().st_size, sha256=hashlib.sha256(metrics.read_bytes()).hexdigest())
    (folder / "PULL_MANIFEST.json").write_text(json.dumps(listed))
    verified = json.loads((folder / "PULL_VERIFIED.json").read_text())
    verified["files"]["artifacts/metrics.json"] = [metrics.stat().st_size, metrics.stat().st_mtime_ns]
    (folder / "PULL_VERIFIED.json").write_text(json.dumps(verified))

    done = project.tether("repro", f".tether/runs/{run_id}")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "is not the one its PULL_VERIFIED.json verified" in done.stderr, done.stderr
    assert len(project.run_ids()) == 1
