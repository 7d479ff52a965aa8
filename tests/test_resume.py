"""Resuming what did not complete: `doit stop` is a pause, `retry=1` relaunches a failed run from its
checkpoint, `resume_from=RUN_ID` seeds a new run, and signals from outside are classified by name.

Real processes only: doit, the far-side launcher, a trainer written the way public scripts are
(no tether import, its own checkpoint file and `--resume` flag), and signals sent to it with kill.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest

from conftest import Project, config_text, ssh_config_text
from helpers import sha256, stop_leftover_runs

# A public-style script: reads data relative to nothing tether-specific (TETHER_DATA_DIR stays the
# contract for now), checkpoints to out/ckpt.json every few steps, resumes with --resume PATH, and is
# deterministic: the final weights depend on the steps taken, never on where it was interrupted.
SCRIPT = """\
import argparse, hashlib, json, os, sys, time
parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=60)
parser.add_argument("--every", type=int, default=5)
parser.add_argument("--sleep", type=float, default=0.05)
parser.add_argument("--resume", default="")
args = parser.parse_args()
state = {"step": 0, "w": "seed"}
if args.resume:
    with open(args.resume) as f:
        state = json.load(f)
    print("resumed at step", state["step"], flush=True)
def save():
    os.makedirs("out", exist_ok=True)
    with open("out/ckpt.json.tmp", "w") as f:
        json.dump(state, f)
    os.replace("out/ckpt.json.tmp", "out/ckpt.json")
while state["step"] < args.steps:
    state["step"] += 1
    state["w"] = hashlib.sha256((state["w"] + str(state["step"])).encode()).hexdigest()
    print("step %d" % state["step"], flush=True)
    if state["step"] % args.every == 0:
        save()
    time.sleep(args.sleep)
save()
with open(os.path.join(os.environ["TETHER_ARTIFACTS_DIR"], "weights.json"), "w") as f:
    json.dump({"w": state["w"], "step": state["step"]}, f)
"""

MAPPED = """\
  checkpoint: out/ckpt.json
  resume_args: ["--resume", "{checkpoint}"]
"""


def use_script(project, steps: int = 60, sleep: float = 0.05, restart: str = "{policy: never}", **backend) -> None:
    """The public-style script as the job's trainer, its own checkpoint file mapped for resumes."""
    (project.root / "script").mkdir(exist_ok=True)
    (project.root / "script" / "train.py").write_text(SCRIPT)
    text = (backend.pop("text", None) or config_text(
        command=f"{{python}} script/train.py --steps {steps} --sleep {sleep}", code="script/train.py",
        artifacts="weights.json"))
    text = text.replace('  command: "', MAPPED + '  command: "', 1) if "resume_args" not in text else text
    project.write_config(text + f"restart: {restart}\n")


def far_state(project, run_id: str) -> dict:
    return json.loads((project.remote_run(run_id) / "state.json").read_text())


def printed_step(project, run_id: str) -> int:
    """The last `step N` the script printed (its own output: no tether events)."""
    try:
        lines = (project.remote_run(run_id) / "train.log").read_text().splitlines()
    except FileNotFoundError:
        return 0
    found = [int(line.split()[1]) for line in lines if line.startswith("step ")]
    return found[-1] if found else 0


def kill_trainer(project, run_id: str, sig: int, after_step: int) -> None:
    """Send `sig` to the trainer only (not its launcher), as an administrator or the kernel would."""
    project.wait_for(lambda: far_state(project, run_id).get("status") == "running"
                     and printed_step(project, run_id) >= after_step, timeout=60, what=f"step {after_step}")
    os.kill(int(far_state(project, run_id)["pgid"]), sig)


def weights(project, run_id: str) -> str:
    return sha256(project.local_run(run_id) / "files" / "artifacts" / "weights.json")


@pytest.fixture
def twins():
    """Projects copied from a test's project; their leftover runs are stopped afterwards."""
    made: list[Path] = []
    yield made
    for root in made:
        stop_leftover_runs(root / ".tether" / "remote")


def twin(project, root: Path) -> Project:
    """A fresh copy of the project's files (no .tether): the same job, from scratch."""
    root.mkdir()
    for name in os.listdir(project.root):
        if name != ".tether":
            copy = shutil.copytree if (project.root / name).is_dir() else shutil.copy
            copy(project.root / name, root / name)
    return Project(root)


def launches(project, run_id: str) -> int:
    return [e.get("event") for e in project.events(run_id)].count("launch")


# ---------------------------------------------------------------- stop is a pause


def test_stop_then_train_resumes_from_the_checkpoint_with_the_same_weights(project, tmp_path, twins):
    use_script(project, steps=60)
    project.doit("run", "launch", check=True)
    run_id = project.run_ids()[0]
    project.wait_for(lambda: printed_step(project, run_id) >= 12, what="step 12")
    stopped = project.doit("stop")
    assert stopped.returncode == 0 and f"{run_id}: stopped" in stopped.stdout, stopped.stdout + stopped.stderr
    assert far_state(project, run_id)["status"] == "stopped"
    project.doit("pull", "verify", check=True)  # what the paused run saved comes home, and is verified
    assert (project.local_run(run_id) / "PULL_VERIFIED.json").is_file()

    again = project.doit("run", "train", timeout=180)
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"resuming {run_id} from checkpoint" in again.stderr and "attempt 2" in again.stderr, again.stderr
    assert project.run_ids() == [run_id]  # the same run, its next attempt
    state = far_state(project, run_id)
    assert (state["status"], state["attempt"]) == ("completed", 2)
    log = (project.remote_run(run_id) / "train.log").read_text()
    assert "resumed at step" in log and int(log.split("resumed at step")[1].split()[0]) >= 10
    far = project.remote_run(run_id)
    assert (far / "PULL_MANIFEST.attempt-1.json").is_file()  # the paused attempt's seal, kept aside
    assert json.loads((far / "PULL_MANIFEST.json").read_text())["status"] == "completed"
    assert (project.local_run(run_id) / "PULL_MANIFEST.attempt-1.json").is_file()
    resumed = weights(project, run_id)

    whole = twin(project, tmp_path / "uninterrupted")
    twins.append(whole.root)  # the same job, never stopped: the same final weights
    whole.doit("run", "train", check=True, timeout=180)
    assert weights(whole, whole.run_ids()[0]) == resumed

    done = project.doit("run", "train", timeout=60)  # completed: left alone, never launched again
    assert done.returncode == 0 and launches(project, run_id) == 2, done.stdout + done.stderr
