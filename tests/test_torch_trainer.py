"""The built-in PyTorch trainer on real data: accuracy, bitwise-exact resume, preemption, the report."""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="the torch extra is part of the test install")

TORCH_CONFIG = """\
name: digits
backend: local
trainer:
  type: torch-classifier
  layers: [linear:64, relu, dropout:0.2, linear:32, relu]
  epochs: {epochs}
  batch_size: 64
  lr: 0.003
  seed: 0
  threads: 1
artifacts: [model.*, metrics.json, config.json]
checkpoint: {{keep: 3, every: {every}}}
restart: {{policy: {policy}, max_restarts: 3, backoff_s: 0.5}}
grace_seconds: 20
backends:
  local: {{type: local}}
"""


def use_torch(project, epochs: int = 6, every: int = 10, policy: str = "on-preempt") -> None:
    project.write_config(TORCH_CONFIG.format(epochs=epochs, every=every, policy=policy))


def model_sha(project) -> str:
    files = project.local_run() / "files" / "artifacts"
    (model,) = [p for p in files.iterdir() if p.name.startswith("model.")]
    return hashlib.sha256(model.read_bytes()).hexdigest()


def state(project) -> dict:
    path = project.remote_run() / "state.json"
    return json.loads(path.read_text()) if path.exists() else {}


def steps(project, attempt: int | None = None) -> int:
    """The newest step logged (by the given attempt, when named)."""
    newest, current = 0, 0
    for event in project.events():
        if event.get("event") == "launch":
            current = event["attempt"]
        if event.get("event") == "step" and (attempt is None or current == attempt):
            newest = event["step"]
    return newest


def preempt(project, at_step: int, attempt: int) -> None:
    """SIGTERM the trainer's process group once attempt `attempt` has passed `at_step`."""
    project.wait_for(lambda: steps(project, attempt) >= at_step, 120, f"step {at_step} of attempt {attempt}")
    os.killpg(state(project)["pgid"], signal.SIGTERM)


def crash(project, at_step: int, attempt: int) -> None:
    """SIGKILL the launcher and the trainer's group: no exit record, like a machine that died."""
    project.wait_for(lambda: steps(project, attempt) >= at_step, 120, f"step {at_step} of attempt {attempt}")
    current = state(project)
    os.kill(current["pid"], signal.SIGKILL)
    os.killpg(current["pgid"], signal.SIGKILL)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """One uninterrupted run of the test job: its model hash and metrics."""
    from conftest import Project, REPO

    root = tmp_path_factory.mktemp("reference")
    (root / "dodo.py").write_text((REPO / "dodo.py").read_text())
    project = Project(root)
    use_torch(project)
    project.doit("run", "train", check=True, timeout=300)
    metrics = json.loads((project.local_run() / "files" / "artifacts" / "metrics.json").read_text())
    return {"sha": model_sha(project), "metrics": metrics, "project": project}


def test_default_job_learns_the_digits(reference):
    metrics = reference["metrics"]
    assert metrics["classes"] == 10
    assert metrics["val_accuracy"] > 0.9, metrics  # chance is 0.1
    config = json.loads((reference["project"].local_run() / "files" / "artifacts" / "config.json").read_text())
    assert len(config["split"]["val"]) == round(1797 * 0.2)
    assert not set(config["split"]["val"]) & set(config["split"]["train"])


def test_interrupted_three_times_ends_bit_for_bit_where_uninterrupted_ends(project, reference):
    use_torch(project)
    chooser = random.Random(20261129)
    doit = project.start("run", "train")
    preempt(project, chooser.randint(5, 40), attempt=1)  # the far side relaunches under on-preempt
    preempt(project, chooser.randint(45, 80), attempt=2)
    crash(project, chooser.randint(85, 120), attempt=3)
    out, err = doit.communicate(timeout=120)
    assert doit.returncode != 0 and "was lost" in err, err  # the crash left no exit record
    # the far side's plan, seen in the 1-s backoff before attempt 2 or 3 (a poll may fall outside one of them)
    assert re.search(r"preempted; will restart from step \d+ in \d s \(attempt [23] of 4\)", err), err
    project.doit("run", "train", check=True, timeout=300)  # relaunches from the latest checkpoint
    launches = [e for e in project.events() if e.get("event") == "launch"]
    assert [e["attempt"] for e in launches] == [1, 2, 3, 4]
    assert all(e["resumed_from"] for e in launches[1:])
    assert model_sha(project) == reference["sha"]
    status = json.loads(project.doit("status", "json=1", check=True).stdout.splitlines()[-1])
    assert (status["status"], status["attempt"], status["restarts"]) == ("completed", 4, 3), status


def kill_inside_a_checkpoint_write(project) -> list[str]:
    """SIGKILL launcher and trainer as soon as a checkpoint's temporary file exists; what was left."""
    project.wait_for(lambda: project.run_ids() and (project.remote_run() / "checkpoints").is_dir(), 120)
    checkpoints = project.remote_run() / "checkpoints"
    def writing_after_a_whole_one() -> bool:
        names = os.listdir(checkpoints)
        return any(".tmp-" in n for n in names) and any(n.endswith(".ckpt") for n in names)
    project.wait_for(writing_after_a_whole_one, 120, "a checkpoint write after a complete one")
    current = state(project)
    os.kill(current["pid"], signal.SIGKILL)
    os.killpg(current["pgid"], signal.SIGKILL)
    return [n for n in os.listdir(checkpoints) if ".tmp-" in n]


def test_killed_while_writing_a_checkpoint_keeps_the_previous_one(project, reference):
    from tether.trainers.runtime import latest_checkpoint

    use_torch(project, every=1)  # a checkpoint every step, so a kill can land inside a write
    for attempt in range(1, 6):
        doit = project.start("run", "train")
        left = kill_inside_a_checkpoint_write(project)
        doit.communicate(timeout=60)
        if left:
            break  # the kill caught a write half-done: its temporary file is still there
    assert left, "no kill landed inside a checkpoint write in 5 tries"
    latest = latest_checkpoint(str(project.remote_run() / "checkpoints"))
    loaded = torch.load(latest, weights_only=True)  # the previous checkpoint is whole
    assert loaded["step"] == int(Path(latest).name[5:17])
    project.doit("run", "train", check=True, timeout=300)
    assert model_sha(project) == reference["sha"]


def test_preempted_run_under_never_is_sealed_and_comes_home_with_its_checkpoint(project):
    use_torch(project, epochs=3, policy="never")
    doit = project.start("run", "train")
    preempt(project, 10, attempt=1)
    out, err = doit.communicate(timeout=180)
    assert doit.returncode == 1 and "preempted (exit code 75) and is not restarted (restart policy 'never')" in err, err
    assert "its latest checkpoint is checkpoints/" in err and "retry=1" in err
    status = json.loads(project.doit("status", "json=1", check=True).stdout.splitlines()[-1])
    assert status["status"] == "preempted"
    project.doit("pull", "verify", check=True, timeout=300)  # sealed: what the message promises comes home
    verified = json.loads((project.local_run() / "PULL_VERIFIED.json").read_text())
    assert any(path.startswith("checkpoints/") for path in verified["files"])
    assert verified["torch_loaded"] >= 1  # the checkpoint that came home loads with weights_only=True
    refused = project.doit("run", "train", timeout=120)  # never relaunched silently: retry=1 is named
    assert refused.returncode == 1 and "`doit run train retry=1` relaunches it from there" in refused.stderr
    assert [e["event"] for e in project.events()].count("launch") == 1
    project.doit("run", "train", "retry=1", check=True, timeout=300)
    status = json.loads(project.doit("status", "json=1", check=True).stdout.splitlines()[-1])
    assert (status["status"], status["attempt"], status["restarts"]) == ("completed", 2, 0)  # retry=1: a fresh budget


@pytest.mark.parametrize("change, message", [
    ("layers: [linear:64, conv, relu]", "unknown layer type 'conv'"),
    ("data: {path: demo/points.csv, label_column: species}", "no column 'species'"),
    ("data: {path: demo/empty.csv}", "the file is empty"),
])
def test_bad_trainer_config_is_refused_before_anything_launches(project, change, message):
    (project.root / "demo" / "empty.csv").write_text("")
    text = TORCH_CONFIG.format(epochs=1, every=10, policy="never").replace(
        "  layers: [linear:64, relu, dropout:0.2, linear:32, relu]", "  " + change)
    project.write_config("data:\n  paths: [demo]\n" + text)
    done = project.doit("run", "train")
    assert done.returncode == 1
    assert message in done.stderr, done.stderr
    assert project.run_ids() == []  # nothing was created, let alone launched


def test_trains_on_the_users_csv_with_a_recorded_split(project):
    text = TORCH_CONFIG.format(epochs=5, every=10, policy="never").replace(
        "  layers:", "  data: {path: demo/points.csv, label_column: label}\n  layers:")
    project.write_config("data:\n  paths: [demo/points.csv]\n" + text)
    project.doit("run", "train", check=True, timeout=300)
    files = project.local_run() / "files" / "artifacts"
    metrics = json.loads((files / "metrics.json").read_text())
    config = json.loads((files / "config.json").read_text())
    assert metrics["classes"] == 2 and metrics["val_accuracy"] > 0.8
    assert len(config["split"]["val"]) == 80 and config["split"]["seed"] == 0


def test_report_reads_every_number_from_the_verified_files(reference):
    project = reference["project"]
    project.doit("report", check=True)
    folder = project.local_run() / "report"
    assert (folder / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = (folder / "report.md").read_text()
    metrics = reference["metrics"]
    assert f"| val_accuracy | {metrics['val_accuracy']} |" in text
    events = [json.loads(l) for l in (project.local_run() / "files" / "events.jsonl").read_text().splitlines()]
    last_step = [e for e in events if e["event"] == "step"][-1]["step"]
    assert f"| steps | {last_step} |" in text and "| restarts | 0 |" in text


def test_report_refuses_an_unverified_run_and_names_the_fix(reference):
    project = reference["project"]
    verified = project.local_run() / "PULL_VERIFIED.json"
    saved = verified.read_bytes()
    verified.unlink()
    try:
        done = project.doit("report")
        assert done.returncode == 1 and "has no verified pull" in done.stderr
    finally:
        verified.write_bytes(saved)


def test_report_without_matplotlib_says_how_to_install_it(tmp_path):
    code = ("import sys; sys.modules['matplotlib'] = None\n"
            "from tether.pipelines import report\n"
            "from tether.errors import RunError\n"
            "try:\n    report.plot(None, {}, 'x.png')\nexcept RunError as err:\n    print(err)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "pip install 'tether[report]'" in out


def test_model_falls_back_to_a_weights_only_state_dict_without_safetensors(tmp_path):
    code = ("import sys; sys.modules['safetensors'] = None; sys.modules['safetensors.torch'] = None\n"
            "import torch\n"
            "from tether.remote.builtin.torch_classifier import save_model\n"
            f"print(save_model(torch.nn.Linear(3, 2), {str(tmp_path)!r}))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    path = out.strip().splitlines()[-1]
    assert path.endswith("model.pt")
    weights = torch.load(path, weights_only=True)
    assert set(weights) == {"weight", "bias"}
