"""The README's main command in a fresh project: train completes, and a second run does nothing."""

import json


def test_train_verifies_then_is_up_to_date(project):
    first = project.doit("run", "train", check=True)
    run = project.local_run()
    verified = json.loads((run / "PULL_VERIFIED.json").read_text())
    assert set(verified["files"]) >= {"artifacts/model.json", "artifacts/metrics.json", "events.jsonl"}
    assert ".  launch" in first.stdout
    again = project.doit("run", "train", check=True)
    assert ".  " not in again.stdout, again.stdout  # every phase reported up to date ("-- ")
    assert again.stdout.count("-- ") == 5
