"""A sweep over the ssh backend, with doit's process pool."""

from __future__ import annotations

import json

from conftest import ssh_config_text

SWEEP = "sweep:\n  lr: [0.1, 0.03]\n  seed: [0, 1]\n"


def run_records(project) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((project.root / ".tether" / "runs").glob("*/run.json"))]


def test_sweep_over_ssh_with_two_worker_processes(project, sshd, tmp_path):
    """Every point launched first, then `doit -n 2 -P process train` follows them in two worker
    processes: each point is watched, pulled and verified once, and status reads them all."""
    text = ssh_config_text(sshd, tmp_path / "far", epochs=3).replace(
        "--epochs 3", "--epochs 3 --lr {lr} --seed {seed}") + SWEEP
    project.write_config(text)
    project.doit("run", "launch", check=True, timeout=120)
    done = project.doit("-n", "2", "-P", "process", "train", timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    records = run_records(project)
    assert sorted((r["params"]["lr"], r["params"]["seed"]) for r in records) == [
        (0.03, 0), (0.03, 1), (0.1, 0), (0.1, 1)]
    assert all((project.root / ".tether" / "runs" / r["run_id"] / "PULL_VERIFIED.json").is_file() for r in records)

    status = project.doit("status", "json=1", check=True)
    listed = json.loads(status.stdout.splitlines()[-1])
    assert [p["point"] for p in listed["points"]] == ["lr:0.1,seed:0", "lr:0.1,seed:1", "lr:0.03,seed:0",
                                                      "lr:0.03,seed:1"]
    assert {p["status"] for p in listed["points"]} == {"completed"} and all(p["verified"] for p in listed["points"])
    assert listed["summary"] == "4 points: 4 completed; 4 verified here"

    again = project.doit("run", "train", check=True)
    assert "launched" not in again.stdout and "pulled" not in again.stdout, again.stdout
