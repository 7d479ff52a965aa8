"""Resuming what did not complete: `doit stop` is a pause, `retry=1` relaunches a failed run from its
checkpoint, `resume_from=RUN_ID` seeds a new run, and signals from outside are classified by name.

Real processes only: doit, the far-side launcher, a trainer written the way public scripts are
(no tether import, its own checkpoint file and `--resume` flag), and signals sent to it with kill.
"""

from __future__ import annotations

import json
import os
import re
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
    """The launcher's state.json ({} before the launcher wrote one)."""
    try:
        return json.loads((project.remote_run(run_id) / "state.json").read_text())
    except FileNotFoundError:
        return {}


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


def test_stop_then_train_resumes_the_demo_trainer_from_its_step(project):
    project.write_config(epochs=400)
    project.doit("run", "launch", check=True)
    run_id = project.run_ids()[0]
    saved = lambda: [e for e in project.events(run_id) if e.get("event") == "checkpoint"]  # noqa: E731
    project.wait_for(lambda: len(saved()) >= 2, what="two checkpoints")
    assert project.doit("stop").returncode == 0
    step = far_state(project, run_id)["checkpoint"].split("-")[-1].split(".")[0]
    again = project.doit("run", "train", timeout=300)
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"resuming {run_id} from checkpoint step {int(step)}, attempt 2" in again.stderr, again.stderr
    status = project.doit("status", "json=1", check=True)
    info = json.loads(status.stdout.splitlines()[-1])
    assert (info["status"], info["attempt"]) == ("completed", 2)


# ---------------------------------------------------------------- signals from outside


def test_sigterm_to_the_trainer_is_preempted_and_restarted_by_the_policy(project):
    use_script(project, steps=60, restart="{policy: on-preempt, max_restarts: 2, backoff_s: 0.5}")
    doit = project.start("run", "train")
    try:
        project.wait_for(lambda: project.run_ids(), what="the run")
        run_id = project.run_ids()[0]
        kill_trainer(project, run_id, signal.SIGTERM, after_step=12)
        out, err = doit.communicate(timeout=180)
    finally:
        doit.kill() if doit.poll() is None else None
    assert doit.returncode == 0, out + err
    assert re.search(r"preempted; will restart from its latest checkpoint in \d s \(attempt 2 of 3\)", err), err
    assert "attempt 1 preempted" in err and "ago; restarted" in err, err  # the far side's plan, then its deed
    assert launches(project, run_id) == 2  # one launch per attempt: the far side's, never watch's too
    exits = [e for e in project.events(run_id) if e.get("event") == "exit"]
    assert (exits[0]["status"], exits[0]["signal"], exits[0]["signal_to"]) == ("preempted", "SIGTERM", "trainer")
    assert far_state(project, run_id)["status"] == "completed"
    assert "resumed at step" in (project.remote_run(run_id) / "train.log").read_text()


def test_sigkill_fails_names_the_signal_and_retry_resumes_it(project):
    use_script(project, steps=60, restart="{policy: on-preempt, max_restarts: 2, backoff_s: 0.5}")
    doit = project.start("run", "train")
    try:
        project.wait_for(lambda: project.run_ids(), what="the run")
        run_id = project.run_ids()[0]
        kill_trainer(project, run_id, signal.SIGKILL, after_step=12)
        out, err = doit.communicate(timeout=120)
    finally:
        doit.kill() if doit.poll() is None else None
    assert doit.returncode == 1, out + err
    assert f"run {run_id} failed: killed by SIGKILL" in err, err
    assert "its latest checkpoint is checkpoints/ckpt.json: `doit run train retry=1` relaunches it from there" in err
    state = far_state(project, run_id)
    assert (state["status"], state["signal"], state["final"]) == ("failed", "SIGKILL", True)
    status = project.doit("status", check=True)
    assert f"{run_id}: failed (killed by SIGKILL" in status.stdout, status.stdout

    refused = project.doit("run", "train", timeout=60)  # never relaunched silently
    assert refused.returncode == 1 and "`doit run train retry=1` relaunches it from there" in refused.stderr
    assert launches(project, run_id) == 1

    retried = project.doit("run", "train", "retry=1", timeout=180)
    assert retried.returncode == 0, retried.stdout + retried.stderr
    assert f"resuming {run_id} from checkpoint" in retried.stderr and "attempt 2" in retried.stderr
    assert "resumed at step" in (project.remote_run(run_id) / "train.log").read_text()
    assert far_state(project, run_id)["status"] == "completed"

    again = project.doit("run", "train", "retry=1", timeout=60)  # completed: final for ever
    lines = [line for line in again.stderr.splitlines() if line.startswith("error:")]
    assert again.returncode == 1 and len(lines) == 1, again.stderr
    assert f"retry=1: run {run_id} completed, and a completed run is final" in lines[0]
    assert launches(project, run_id) == 2


# ---------------------------------------------------------------- resume_from=RUN_ID


def test_resume_from_starts_a_new_run_from_the_old_runs_checkpoint(project, tmp_path):
    use_script(project, steps=30)
    project.doit("run", "launch", check=True)
    old = project.run_ids()[0]
    kill_trainer(project, old, signal.SIGKILL, after_step=12)  # the code had a bug: it crashed
    project.wait_for(lambda: far_state(project, old).get("final"), what="the crash recorded")
    checkpoint = project.remote_run(old) / "checkpoints" / "ckpt.json"
    digest, step = sha256(checkpoint), json.loads(checkpoint.read_text())["step"]

    (project.root / "script" / "train.py").write_text(SCRIPT.replace("time.sleep(args.sleep)", "pass"))  # fixed
    done = project.doit("run", "train", f"resume_from={old}", timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    new = [r for r in project.run_ids() if r != old]
    assert len(new) == 1
    record = json.loads((project.local_run(new[0]) / "run.json").read_text())
    assert record["resume_from"]["run_id"] == old and record["resume_from"]["sha256"] == digest
    assert record["resume_from"]["checkpoint"] == "checkpoints/ckpt.json"
    far = json.loads((project.remote_run(new[0]) / "run.json").read_text())
    assert far["resume_from"] == record["resume_from"]
    assert f"resumed at step {step}" in (project.remote_run(new[0]) / "train.log").read_text()
    status = project.doit("status", f"run={new[0]}", check=True)
    assert f"resumed from {old} (checkpoint checkpoints/ckpt.json" in status.stdout and digest in status.stdout
    report = project.doit("report", f"run={new[0]}")
    assert report.returncode == 0, report.stdout + report.stderr
    summary = next((project.local_run(new[0])).rglob("*.md")).read_text()
    assert f"resumed from {old}" in summary

    fresh = project.doit("run", "train", timeout=60)  # the fixed code without resume_from: yet another run
    assert fresh.returncode == 0, fresh.stdout + fresh.stderr
    assert len(project.run_ids()) == 3


@pytest.mark.parametrize("words, says", [
    (["resume_from=nosuch-run"], "resume_from=nosuch-run: no such run here or on backend local"),
    (["resume_from=../x"], "resume_from: invalid run id '../x'"),
    (["retry=maybe"], "retry=maybe: use 1/0, yes/no"),
])
def test_bad_resume_words_are_one_line_before_anything_launches(project, words, says):
    use_script(project, steps=5)
    done = project.doit("run", "train", *words, timeout=60)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode != 0 and len(errors) == 1 and says in errors[0], done.stdout + done.stderr
    assert not (project.root / ".tether" / "remote" / "runs").is_dir() or not any(
        (project.root / ".tether" / "remote" / "runs").glob("*/state.json"))


def test_resume_from_a_run_without_a_checkpoint_is_refused(project):
    use_script(project, steps=3, sleep=0)
    project.write_config(project.root.joinpath("tether.yaml").read_text().replace(MAPPED, ""))  # nothing mapped
    project.doit("run", "train", check=True, timeout=120)
    old = project.run_ids()[0]
    done = project.doit("run", "train", f"resume_from={old}", timeout=60)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 1 and len(errors) == 1, done.stderr
    assert f"resume_from={old}: run {old} (completed) saved no checkpoint" in errors[0]
    assert project.run_ids() == [old]


# ---------------------------------------------------------------- over ssh


def test_stop_then_train_resumes_over_ssh(project, sshd, tmp_path):
    remote = tmp_path / "far"
    text = ssh_config_text(sshd, remote).replace("{python} demo/train.py --epochs 30",
                                                 "{python} script/train.py --steps 60 --sleep 0.05")
    text = text.replace("paths: [demo/train.py]", "paths: [script/train.py]").replace(
        "artifacts: [model.json, metrics.json]", "artifacts: [weights.json]")
    use_script(project, text=text)
    project.doit("run", "launch", check=True, timeout=120)
    run_id = project.run_ids()[0]
    log = remote / "runs" / run_id / "train.log"
    step = lambda: max([int(l.split()[1]) for l in log.read_text().splitlines() if l.startswith("step ")] or [0]) \
        if log.exists() else 0  # noqa: E731
    project.wait_for(lambda: step() >= 12, what="step 12")
    assert project.doit("stop", timeout=60).returncode == 0
    again = project.doit("run", "train", timeout=240)
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"resuming {run_id} from checkpoint" in again.stderr and "attempt 2" in again.stderr, again.stderr
    state = json.loads((remote / "runs" / run_id / "state.json").read_text())
    assert (state["status"], state["attempt"]) == ("completed", 2)
    assert "resumed at step" in log.read_text()


def test_repro_of_a_resumed_run_uses_the_same_checkpoint_or_says_why_not(project):
    use_script(project, steps=30)
    project.doit("run", "launch", check=True)
    old = project.run_ids()[0]
    kill_trainer(project, old, signal.SIGKILL, after_step=12)
    project.wait_for(lambda: far_state(project, old).get("final"), what="the crash recorded")
    project.doit("pull", f"run={old}", check=True)  # its checkpoint is pulled here too
    project.doit("run", "train", f"resume_from={old}", check=True, timeout=180)
    new = next(r for r in project.run_ids() if r != old)

    done = project.tether("repro", f".tether/runs/{new}")
    assert f"resuming from {old}'s checkpoint checkpoints/ckpt.json on backend local (sha256 matches)" \
        in done.stdout, done.stdout + done.stderr
    repro = next(r for r in project.run_ids() if r not in (old, new))
    assert json.loads((project.local_run(repro) / "run.json").read_text())["resume_from"]["run_id"] == old
    assert "resumed at step" in (project.remote_run(repro) / "train.log").read_text()

    shutil.rmtree(project.remote_run(old))  # the source is gone from the backend: the pulled copy is used
    shutil.rmtree(project.remote_run(repro))
    shutil.rmtree(project.local_run(repro))
    done = project.tether("repro", f".tether/runs/{new}")
    assert f"run {old} is not on backend local" in done.stdout and "uploaded the pulled copy" in done.stdout, \
        done.stdout + done.stderr

    (project.local_run(old) / "files" / "checkpoints" / "ckpt.json").unlink()  # nowhere now: refused, naming why
    for name in [r for r in project.run_ids() if r not in (old, new)]:
        shutil.rmtree(project.remote_run(name))
        shutil.rmtree(project.local_run(name))
    refused = project.tether("repro", f".tether/runs/{new}")
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert f"it resumed from run {old}'s checkpoint checkpoints/ckpt.json" in refused.stderr, refused.stderr
    assert "is missing" in refused.stderr


# ---------------------------------------------------------------- crashes, and how endings are named


def test_a_crash_is_failed_with_the_signal_named(project):
    (project.root / "demo" / "crash.py").write_text("import os\nprint('about to abort', flush=True)\nos.abort()\n")
    project.write_config(config_text(command="{python} demo/crash.py", code="demo/crash.py",
                                     artifacts="model.json") + "restart: {policy: on-failure, max_restarts: 0}\n")
    done = project.doit("run", "train", timeout=120)
    run_id = project.run_ids()[0]
    assert done.returncode == 1 and f"run {run_id} failed: killed by SIGABRT;" in done.stderr, done.stderr
    assert "it saved no checkpoint: `doit run train retry=1` relaunches it from the start" in done.stderr
    state = far_state(project, run_id)
    assert (state["status"], state["signal"], state["exit_code"]) == ("failed", "SIGABRT", -signal.SIGABRT)


@pytest.mark.parametrize("returncode, received, status, said", [
    (-signal.SIGTERM, "", "preempted", "ended by SIGTERM"),
    (-signal.SIGINT, "", "preempted", "ended by SIGINT"),
    (-signal.SIGHUP, "", "preempted", "ended by SIGHUP"),
    (-signal.SIGKILL, "SIGTERM", "preempted", "ended by SIGTERM"),  # the launcher's grace SIGKILL after a TERM
    (-signal.SIGKILL, "", "failed", "killed by SIGKILL"),
    (-signal.SIGSEGV, "", "failed", "killed by SIGSEGV"),
    (75, "", "preempted", ""),
    (1, "", "failed", ""),
])
def test_endings_are_named_by_their_signal(returncode, received, status, said):
    from tether.remote import endings

    ended = endings.outcome(returncode, False, received, None)
    assert (ended["status"], endings.words(ended)) == (status, said)


def test_a_sigkill_reads_out_of_memory_only_when_the_cgroup_counted_one():
    from tether.remote import endings

    now = endings.oom_kills()  # read without privileges where the kernel offers it; None where not
    assert now is None or now >= 0
    unchanged = endings.outcome(-signal.SIGKILL, False, "", now)
    assert endings.words(unchanged) == "killed by SIGKILL"
    if now is not None:
        counted = endings.outcome(-signal.SIGKILL, False, "", now - 1)  # one OOM kill since the attempt began
        assert endings.words(counted) == "killed by SIGKILL (out of memory?)"
