"""The slurm backend end to end: `doit` on this machine, sshd as the login node, a real SLURM behind it.

The cluster (tests/slurm_fixtures.py) is real munged + slurmctld + slurmd with cred_expire=5 and KillWait 15,
so a requeued job runs again about 7-11 s later. The far side is this machine, so a test may read a run's
far-side files directly (REMOTE/runs/RUN_ID) and ask SLURM itself (squeue, scontrol) what it did.

The time-limit job takes about two minutes of wall time, most of it waiting for SLURM's time-limit
checks: the module-scoped `time_limited` fixture starts it in the background when the first cluster
test asks for it, and the last test of this file checks how it ended, so the wait overlaps the rest.

Every wait polls a condition against a deadline; no test sleeps a fixed time.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.register_assert_rewrite("slurm_fixtures")
pytest_plugins = ["slurm_fixtures"]  # the session's one cluster, shared with test_backend_slurm.py
pytestmark = pytest.mark.xdist_group("test_slurm")  # one xdist worker: one `time_limited` job, not one each

from conftest import DEMO, REPO, Project  # noqa: E402
from slurm_fixtures import (POLL_ACK, new_remote_dir, remove_remote_dir, slurm_backend_config,  # noqa: E402
                            slurm_yaml)
from tether.backends.slurm import SBATCH, Backend, Config, job_script, sbatch_lines  # noqa: E402
from tether.paths import RunPaths  # noqa: E402

# A trainer paced by the clock: --steps steps of --step-s seconds each, a checkpoint every --every
# steps and on SIGTERM/SIGUSR1 (then exit 75), resuming from TETHER_RESUME_FROM. --ignore-term
# makes it log SIGTERM and carry on (only SIGKILL ends it); --exit sets the exit code at the end.
PACED = r'''
import argparse, json, os, signal, sys, time
from tether.trainers import runtime

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--step-s", type=float, default=0.25)
parser.add_argument("--every", type=int, default=5)
parser.add_argument("--exit", type=int, default=0)
parser.add_argument("--ignore-term", action="store_true")
args = parser.parse_args()

if args.ignore_term:
    stop = None
    signal.signal(signal.SIGTERM, lambda signum, frame: runtime.log("term-ignored", pid=os.getpid()))
else:
    stop = runtime.stop_signal()
step = 0
if runtime.resume_from():
    with open(runtime.resume_from()) as f:
        step = json.load(f)["step"]
runtime.log("trainer-start", start=step, pid=os.getpid(), job=os.environ.get("SLURM_JOB_ID"),
            slurm_restart_count=os.environ.get("SLURM_RESTART_COUNT"))


def save():
    runtime.save_checkpoint(lambda f: f.write(json.dumps({"step": step}).encode()), step)


while step < args.steps:
    deadline = time.monotonic() + args.step_s
    while time.monotonic() < deadline and not (stop and stop.requested):
        time.sleep(min(0.02, max(0.0, deadline - time.monotonic())))
    if stop and stop.requested:
        save()
        runtime.log("preempting", signal=stop.signal_name, step=step)
        sys.exit(runtime.PREEMPTED_EXIT)
    step += 1
    runtime.log("step", step=step, total_steps=args.steps, loss=round(1.0 / step, 6))
    if step % args.every == 0:
        save()

out = os.environ["TETHER_ARTIFACTS_DIR"]
for name in ("model.json", "metrics.json"):
    with open(os.path.join(out, name), "w") as f:
        json.dump({"steps": step}, f)
print("done after", step, "steps", flush=True)
sys.exit(args.exit)
'''

FAILING = """\
import sys
from tether.trainers import runtime

runtime.log("step", step=1, total_steps=10, loss=2.5)
print("loading shard 7 of 9")
print("fatal: loss is NaN at step 1 (marker 27182)", flush=True)
sys.exit(3)
"""


# ---------------------------------------------------------------- helpers


class Background:
    """A background `doit` whose stdout and stderr are drained by threads (a full pipe never blocks it)."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self.chunks: dict[str, list[str]] = {"stdout": [], "stderr": []}
        self.threads = [threading.Thread(target=self._drain, args=(name,), daemon=True) for name in self.chunks]
        for thread in self.threads:
            thread.start()

    def _drain(self, name: str) -> None:
        for line in getattr(self.proc, name):
            self.chunks[name].append(line)

    def text(self, name: str) -> str:
        return "".join(self.chunks[name])

    def finish(self, timeout: float) -> int:
        code = self.proc.wait(timeout=timeout)
        for thread in self.threads:
            thread.join(timeout=10)
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)


def use_trainer(project: Project, cluster, remote: Path, name: str, source: str, args: str = "", **options) -> None:
    """Put a trainer script into the project and point tether.yaml (backend hpc: the cluster) at it."""
    (project.root / "demo" / name).write_text(source)
    project.write_config(slurm_yaml(cluster, remote, f"{{python}} demo/{name} {args}".strip(),
                                    code=f"demo/{name}", **options))


def only_run_id(project: Project) -> str:
    ids = project.run_ids()
    assert len(ids) == 1, f"expected exactly one run, found {ids}"
    return ids[0]


def far(remote: Path, run_id: str) -> Path:
    """The run's far-side folder (the login node and the compute node are this machine)."""
    return remote / "runs" / run_id


def far_json(remote: Path, run_id: str, name: str) -> dict:
    path = far(remote, run_id) / name
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):  # not written yet (writes are atomic renames)
        return {}


def far_events(remote: Path, run_id: str) -> list[dict]:
    try:
        text = (far(remote, run_id) / "events.jsonl").read_text()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.split("\n")[:-1] if line.strip()]


def named(events: list[dict], name: str) -> list[dict]:
    return [e for e in events if e.get("event") == name]


def job_of(remote: Path, project: Project) -> str:
    """The SLURM job id of the project's only run, once launch has submitted it."""
    project.wait_for(lambda: project.run_ids() and far_json(remote, project.run_ids()[0], "slurm.json"),
                     60, "the run's slurm.json")
    return far_json(remote, only_run_id(project), "slurm.json")["job_id"]


def queue_state(cluster, job_id: str) -> str:
    """The job's state as squeue shows it ('' once it has left the queue)."""
    done = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], env=cluster.env, capture_output=True,
                          text=True)
    return done.stdout.strip()


def job_fields(cluster, job_id: str) -> dict[str, str]:
    """`scontrol show job -o` as a dict (kept MinJobAge=600 s after the job ends)."""
    out = cluster.run("scontrol", "show", "job", "-o", job_id)
    return dict(word.partition("=")[::2] for word in out.split())


def doit_status(project: Project, *args: str) -> dict:
    done = project.doit("status", "json=1", *args, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def new_project(root: Path) -> Project:
    """A project folder like conftest's `project` fixture, for module-scoped fixtures."""
    (root / "demo").mkdir(parents=True)
    shutil.copy(DEMO / "train.py", root / "demo" / "train.py")
    shutil.copy(DEMO / "points.csv", root / "demo" / "points.csv")
    shutil.copy(REPO / "dodo.py", root / "dodo.py")
    return Project(root)


# ---------------------------------------------------------------- validation (no cluster needed)


VALIDATED = """\
name: demo
backend: hpc
code: {{paths: [demo/train.py]}}
data: {{paths: [demo/points.csv]}}
trainer: {{type: command, command: "{{python}} demo/train.py"}}
artifacts: [model.json, metrics.json]
{validation}backends:
  hpc:
    type: slurm
    host: login.example.org
    remote_dir: {remote_dir}
{extra}"""


def validated(project: Project, extra: str = "", remote_dir: str = "~/tether", validation: str = "",
              *args: str) -> subprocess.CompletedProcess:
    """`doit validate` of a slurm config with `extra` lines in its backend section."""
    project.write_config(VALIDATED.format(extra="".join(f"    {line}\n" for line in extra.splitlines()),
                                          remote_dir=remote_dir, validation=validation))
    return project.doit("validate", *args)


@pytest.mark.parametrize("remote_dir", ["/tmp/x", "/var/tmp/runs", "/tmp"])
def test_validate_refuses_remote_dir_under_tmp(project, remote_dir):
    done = validated(project, remote_dir=remote_dir)
    assert done.returncode != 0, done.stdout
    assert (f"error: remote_dir '{remote_dir}' is under /tmp or /var/tmp, which compute nodes do not share"
            in done.stdout), done.stdout
    assert "1 error(s)" in done.stderr, done.stderr


def test_validate_accepts_a_shared_remote_dir_that_merely_mentions_tmp(project):
    done = validated(project, remote_dir="/scratch/tmp/tether")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ok (0 warning(s)); backend hpc" in done.stdout, done.stdout


@pytest.mark.parametrize("option", ["--output=x", "-o", "--chdir=/elsewhere", "--job-name=mine", "--parsable",
                                    "-o out.txt", "--output out.txt", "-J mine"])
def test_validate_refuses_sbatch_options_tether_sets_itself(project, option):
    done = validated(project, f'sbatch_options: ["--account=ml", "{option}"]')
    assert done.returncode != 0, done.stdout
    assert f"error: sbatch_options: '{option}' is set by tether itself" in done.stdout, done.stdout
    assert "--account=ml" not in done.stdout  # only the offending option is named
    assert "1 error(s)" in done.stderr, done.stderr


def test_validate_refuses_nice_outside_its_range(project):
    done = validated(project, "nice: 5000")
    assert done.returncode != 0, done.stdout
    assert "error: nice 5000 is outside 0-2000" in done.stdout, done.stdout
    assert validated(project, "nice: 2000").returncode == 0


def test_validate_warns_of_a_long_time_limit_unless_acknowledged(project):
    warned = validated(project, 'time: "12:00:00"')
    assert warned.returncode == 0, warned.stdout + warned.stderr
    assert ("warning: backend 'hpc': time 12:00:00 is above 6 hours: long jobs wait longer in most queues"
            in warned.stdout), warned.stdout
    assert "ok (1 warning(s))" in warned.stdout

    strict = validated(project, 'time: "12:00:00"', "~/tether", "", "strict=1")
    assert strict.returncode != 0 and "1 warning(s) and strict=1" in strict.stderr, strict.stdout + strict.stderr

    acknowledged = validated(project, 'time: "12:00:00"', "~/tether",
                             'validation: {acknowledge: ["is above 6 hours"]}\n', "strict=1")
    assert acknowledged.returncode == 0, acknowledged.stdout + acknowledged.stderr
    assert "warning:" not in acknowledged.stdout and "ok (0 warning(s))" in acknowledged.stdout

    short = validated(project, 'time: "06:00:00"')
    assert "warning:" not in short.stdout and "ok (0 warning(s))" in short.stdout, short.stdout


def test_validate_refuses_a_time_slurm_cannot_read(project):
    done = validated(project, 'time: "4h"')
    assert done.returncode != 0
    assert "error: time '4h': use SLURM's [D-]HH:MM:SS" in done.stdout, done.stdout


# ---------------------------------------------------------------- job.sh as rendered


RUN_ID = "demo-20260101T000000Z-abcdef12"


def test_sbatch_lines_hold_every_sbatch_key_that_is_set(tmp_path):
    fields = {f.name for f in dataclasses.fields(Config)}
    assert set(SBATCH) <= fields, f"SBATCH keys that are not Config fields: {set(SBATCH) - fields}"
    values = {"partition": "gpu", "gres": "gpu:a100:2", "time": "1-02:03:04", "nice": 10, "cpus_per_task": 8,
              "mem": "64G", "nodes": 4}
    assert set(values) == set(SBATCH), "this test must set every SBATCH key"
    cfg = Config(host="login", remote_dir="~/tether", sbatch_options=("--account=ml", "--qos=high"), **values)
    run = RunPaths(RUN_ID, str(tmp_path / ".tether"), "/shared/tether")
    lines = sbatch_lines(cfg, run)
    assert lines[:3] == [f"#SBATCH --job-name=tether-{RUN_ID[-8:]}",  # the run's hash: unique in squeue
                         f"#SBATCH --output={run.remote_abs}/slurm-%j.out",
                         f"#SBATCH --chdir={run.remote_abs}"]
    for key, flag in SBATCH.items():
        assert f"#SBATCH {flag}={values[key]}" in lines, (key, lines)
    assert lines[-2:] == ["#SBATCH --account=ml", "#SBATCH --qos=high"]  # the user's own come last
    assert len(lines) == 3 + len(SBATCH) + 2

    unset = sbatch_lines(Config(host="login", remote_dir="~/tether"), run)
    assert unset == lines[:3] + ["#SBATCH --time=04:00:00"]  # the defaults: no partition, one node
    script = job_script(cfg, run, "/shared/tether/tether/v1/tether/remote/launcher.py", "python3")
    assert script.startswith("#!/bin/bash\n" + "\n".join(lines) + "\n")


def test_job_script_for_two_nodes_exports_the_rendezvous(cluster, tmp_path, monkeypatch):
    """Runs the rendered job.sh under bash with the variables SLURM sets for a 2-node job on nodes
    this cluster does not have (the real 2-node run: test_slurm_multinode.py). The "python" it starts
    records its environment."""
    from tether.remote import controller, nodes

    run = RunPaths(RUN_ID, str(tmp_path / ".tether"), str(tmp_path / "far"))
    Path(run.remote_abs).mkdir(parents=True)
    recorder = tmp_path / "record-env"
    recorder.write_text('#!/bin/sh\n[ "$1" = -c ] && exec python3 "$@"  # the free port\n'
                        'env > "$3/env.txt"\necho "$@" > "$3/argv.txt"\n')
    recorder.chmod(0o755)
    script = job_script(Config(host="login", remote_dir="~/tether", nodes=2), run, "/far/launcher.py", str(recorder))
    assert "#SBATCH --nodes=2" in script.splitlines() and "29500" not in script
    job = tmp_path / "job.sh"
    job.write_text(script)
    env = dict(cluster.env, SLURM_JOB_ID="4242", SLURM_NNODES="2", SLURM_JOB_NODELIST="gpu[07-08]",
               SLURM_CPUS_PER_TASK="6")
    ports = set()
    for _ in range(2):  # every attempt picks its own free port
        done = subprocess.run(["bash", str(job)], env=env, capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stderr
        recorded = dict(line.partition("=")[::2] for line in (Path(run.remote_abs) / "env.txt").read_text().splitlines())
        ports.add(recorded["MASTER_PORT"])
    assert recorded["MASTER_ADDR"] == "gpu07"  # the first host: no NodeAddr known for it, its name
    assert all(p.isdigit() and 1024 < int(p) < 65536 and p != "29500" for p in ports) and len(ports) == 2, ports
    assert recorded["WORLD_SIZE"] == "2" and recorded["NNODES"] == "2"
    assert recorded["TETHER_SRUN"] == "srun --nodes=2 --ntasks-per-node=1 --cpus-per-task=6"  # 22.05: not inherited
    assert (Path(run.remote_abs) / "argv.txt").read_text().split() == ["/far/launcher.py", "run", run.remote_abs]
    assert (Path(run.remote_abs) / "exit_code.4242").read_text().strip() == "0"

    # the launcher starts one trainer per node: srun runs nodes.py's per-task rank wrapper around it
    monkeypatch.setenv("TETHER_SRUN", recorded["TETHER_SRUN"])
    argv = controller._trainer_command({"argv": ["{python}", "train.py"]}, None)
    assert argv == [sys.executable, nodes.__file__, "step", "srun", "--nodes=2", "--ntasks-per-node=1",
                    "--cpus-per-task=6", "--", sys.executable, "train.py"]

    single = job_script(Config(host="login", remote_dir="~/tether"), run, "/far/launcher.py", str(recorder))
    assert "MASTER_ADDR" not in single and "TETHER_SRUN" not in single and "--nodes" not in single


def test_rendered_job_script_is_accepted_by_sbatch(cluster, tmp_path):
    """The real sbatch parses the #SBATCH lines (--test-only: nothing is queued)."""
    run = RunPaths(RUN_ID, str(tmp_path / ".tether"), str(tmp_path / "far"))
    Path(run.remote_abs).mkdir(parents=True)
    cfg = Config(host="login", remote_dir="~/tether", partition="debug", time="00:05:00", nice=10, cpus_per_task=1,
                 mem="100M", sbatch_options=("--requeue",))
    job = tmp_path / "job.sh"
    job.write_text(job_script(cfg, run, "/far/launcher.py", "python3"))
    done = subprocess.run(["sbatch", "--test-only", str(job)], env=cluster.env, capture_output=True, text=True)
    assert done.returncode == 0 and "to start at" in done.stderr, done.stderr


# ---------------------------------------------------------------- the slow one, started early


TIME_LIMITED_STEPS = 100  # steps of 0.5 s: 50 s of work; see time_limited


@pytest.fixture(scope="module")
def time_limited(cluster, tmp_path_factory):
    """A run whose work outlasts its SLURM time limit, started in the background (`doit run train`).

    With `time: 00:01:00` and `--signal=B:USR1@30`, slurmctld sends USR1 at its first time-limit
    check (every 30 s) after the job starts, since it adds that period to the warning time: the
    first attempt works 0-30 s, a requeued one about 19 s (it restarts ~11 s after the check that
    signalled its predecessor, sooner on a quiet machine, and then up to the next check). 50 s of
    work therefore needs at least two attempts, usually three, and at most four, which
    max_restarts 3 allows. (About 100 s of work cannot finish in four attempts: at most 30 + 3 x 19 s.)
    """
    project = new_project(tmp_path_factory.mktemp("time-limited") / "proj")
    remote = new_remote_dir()
    use_trainer(project, cluster, remote, "paced.py", PACED,
                f"--steps {TIME_LIMITED_STEPS} --step-s 0.5 --every 10",
                time="00:01:00", signal_grace_s=30, policy="on-preempt", max_restarts=3)
    background = Background(project.start("run", "train"))
    yield SimpleNamespace(project=project, remote=remote, doit=background, started=time.monotonic())
    background.kill()
    remove_remote_dir(cluster, remote)


# ---------------------------------------------------------------- the whole cycle


def test_train_verify_down_through_the_login_node(project, cluster, remote, time_limited):
    """(`time_limited` is requested here only to start that slow job early; the last test checks it.)"""
    project.write_config(slurm_yaml(cluster, remote, "{python} demo/train.py --epochs 30"))
    trained = project.doit("run", "train", timeout=180)
    assert trained.returncode == 0, trained.stdout + trained.stderr
    run_id = only_run_id(project)
    run_dir = far(remote, run_id)

    record = far_json(remote, run_id, "slurm.json")
    job_id = record["job_id"]
    assert job_id.isdigit() and record["jobs"] == [job_id], record
    assert f"SLURM job {job_id}" in trained.stdout, trained.stdout
    script = (run_dir / "job.sh").read_text()
    assert script.startswith("#!/bin/bash\n")
    sbatch = [line for line in script.splitlines() if line.startswith("#SBATCH ")]
    assert sbatch == [f"#SBATCH --job-name=tether-{run_id[-8:]}", f"#SBATCH --output={run_dir}/slurm-%j.out",
                      f"#SBATCH --chdir={run_dir}", "#SBATCH --partition=debug", "#SBATCH --time=00:10:00"]

    fields = job_fields(cluster, job_id)  # what SLURM itself ran
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", fields
    assert fields["Comment"] == f"tether:{run_id}" and fields["WorkDir"] == str(run_dir)
    assert fields["Command"] == str(run_dir / "job.sh")
    assert (run_dir / f"exit_code.{job_id}").read_text().strip() == "0"
    assert far_json(remote, run_id, "state.json")["status"] == "completed"

    local = project.local_run(run_id)
    verified = json.loads((local / "PULL_VERIFIED.json").read_text())
    assert verified["manifest_sha256"] == hashlib.sha256((run_dir / "PULL_MANIFEST.json").read_bytes()).hexdigest()
    for name in ("model.json", "metrics.json"):
        assert sha256(local / "files" / "artifacts" / name) == sha256(run_dir / "artifacts" / name)
    status = doit_status(project)
    assert (status["status"], status["run_id"], status["exit_code"]) == ("completed", run_id, 0)

    again = project.doit("run", "train", check=True)
    assert ".  " not in again.stdout, again.stdout  # everything up to date: no second sbatch
    assert far_json(remote, run_id, "slurm.json")["jobs"] == [job_id]

    down = project.doit("run", "down", "confirm=yes", timeout=60)
    assert down.returncode == 0, down.stdout + down.stderr
    assert f"{run_id}: removed {run_dir}" in down.stdout, down.stdout
    assert not run_dir.exists()
    assert (local / "files" / "artifacts" / "model.json").is_file()  # the verified results stay here
    assert (remote / "objects").is_dir()  # the object store outlives the run
    gone = project.doit("run", "down", "confirm=yes", check=True)
    assert "already removed" in gone.stdout, gone.stdout


def test_one_polling_cycle_is_one_far_side_command(project, cluster, remote):
    use_trainer(project, cluster, remote, "paced.py", PACED, "--steps 400 --step-s 0.25")
    project.doit("run", "launch", check=True, timeout=120)
    run_id = only_run_id(project)
    job_id = job_of(remote, project)
    project.wait_for(lambda: named(far_events(remote, run_id), "step"), 60, "the first step")
    backend = Backend("hpc", Config(**slurm_backend_config(cluster, remote)), str(project.root / ".tether"))
    run = RunPaths(run_id, str(project.root / ".tether"), backend.remote_dir)  # remote_dir: resolved once, here
    other = RunPaths("demo-never-launched", str(project.root / ".tether"), backend.remote_dir)

    before = backend.commands
    snaps = backend.states([run])
    assert backend.commands - before == 1
    snap = snaps[run_id]
    assert snap.status == "running" and snap.alive is True
    assert snap.job_id == job_id and snap.queue["state"] == "RUNNING"  # squeue was in that one command

    before = backend.commands
    snaps = backend.states([run, other])
    assert backend.commands - before == 1
    assert snaps[run_id].queue["state"] == "RUNNING" and snaps[other.run_id].status == "absent"


# ---------------------------------------------------------------- requeue, time limit


TORCH_JOB = """\
name: digits
backend: {backend}
{data}trainer:
  type: torch-classifier
  layers: [linear:64, relu, dropout:0.2, linear:32, relu]
  epochs: 40
  batch_size: 64
  lr: 0.003
  seed: 0
  threads: 1
artifacts: [model.*, metrics.json, config.json]
checkpoint: {{keep: 3, every: 20}}
restart: {{policy: on-preempt, max_restarts: 3}}
grace_seconds: 20
validation:
  acknowledge: ["{ack}"]
backends:
  local: {{type: local}}
  hpc: {hpc}
"""


def model_sha(project: Project, run_id: str) -> str:
    files = project.local_run(run_id) / "files" / "artifacts"
    (model,) = [p for p in files.iterdir() if p.name.startswith("model.")]
    return sha256(model)


def torch_job(cluster, remote: Path, data: str = "data: {paths: [demo/points.csv]}\n") -> str:
    """The torch-classifier job of test_torch_trainer.py, longer (40 epochs), on backend hpc (the cluster).

    It pushes points.csv, which the digits trainer never reads: a job with nothing to push hangs in
    push on this backend (test_a_job_with_nothing_to_push_gets_through_push), not what this tests.
    """
    return TORCH_JOB.format(backend="hpc", ack=POLL_ACK, data=data,
                            hpc=json.dumps(slurm_backend_config(cluster, remote)))


def test_a_job_with_nothing_to_push_gets_through_push(project, cluster, remote):
    """The built-in trainers need no code or data paths, so push has no object to ask the far side
    about: `launcher.py have` then gets an empty stdin, which must still end (EOF), not wait forever."""
    project.write_config(torch_job(cluster, remote, data=""))
    try:
        pushed = project.doit("run", "push", timeout=30)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"`doit run push` of a job with no code or data paths hung for {err.timeout}s "
                    f"(far side: `launcher.py have` waiting on stdin)")
    assert pushed.returncode == 0, pushed.stdout + pushed.stderr
    assert "pushed 0 of 0 files (0 bytes)" in pushed.stdout, pushed.stdout


def test_scontrol_requeue_mid_training_resumes_bit_for_bit(project, cluster, remote, tmp_path):
    pytest.importorskip("torch", reason="the torch extra is part of the test install")
    text = torch_job(cluster, remote)
    project.write_config(text)
    reference = new_project(tmp_path / "reference")  # the same trainer settings, uninterrupted, locally
    reference.write_config(text.replace("backend: hpc", "backend: local"))
    uninterrupted = Background(reference.start("run", "train"))  # meanwhile

    doit = Background(project.start("run", "train"))
    try:
        job_id = job_of(remote, project)
        run_id = only_run_id(project)

        def training_past_a_checkpoint() -> bool:
            events = far_events(remote, run_id)
            return bool(named(events, "checkpoint")) and max([e["step"] for e in named(events, "step")] or [0]) >= 50
        project.wait_for(training_past_a_checkpoint, 120, "attempt 1 to pass step 50 and a checkpoint")
        cluster.run("scontrol", "requeue", job_id)
        assert doit.finish(timeout=180) == 0, doit.text("stdout") + doit.text("stderr")
    finally:
        doit.kill()
    assert uninterrupted.finish(timeout=180) == 0, uninterrupted.text("stderr")

    events = far_events(remote, run_id)
    launches = named(events, "launch")
    assert [e["attempt"] for e in launches] == [1, 2], launches
    assert launches[0]["resumed_from"] is None and launches[1]["resumed_from"], launches
    exits = named(events, "exit")
    assert exits[0]["status"] == "preempted" and exits[0]["exit_code"] == 75, exits
    stopped_at = max(e["step"] for e in named(events[:events.index(exits[0])], "step"))
    total = named(events, "step")[-1]["total_steps"]
    assert stopped_at < total, "the requeue came after training had ended: nothing was resumed"
    assert Path(launches[1]["resumed_from"]).name.startswith("ckpt-")
    assert far_json(remote, run_id, "slurm.json")["jobs"] == [job_id]  # the same job ran again, no sbatch
    fields = job_fields(cluster, job_id)
    assert fields["Restarts"] == "1" and fields["JobState"] == "COMPLETED", fields
    status = doit_status(project)
    assert (status["status"], status["restarts"]) == ("completed", 1)
    assert model_sha(project, run_id) == model_sha(reference, only_run_id(reference))


# ---------------------------------------------------------------- ended from outside, failed


def test_scancel_from_outside_fails_watch_with_the_reason(project, cluster, remote):
    use_trainer(project, cluster, remote, "paced.py", PACED, "--steps 400 --step-s 0.25")
    doit = Background(project.start("run", "train"))
    try:
        job_id = job_of(remote, project)
        run_id = only_run_id(project)
        project.wait_for(lambda: named(far_events(remote, run_id), "step"), 60, "the first step")
        cluster.run("scancel", job_id)
        project.wait_for(lambda: doit.proc.poll() is not None or job_fields(cluster, job_id)["Restarts"] != "0",
                         60, "watch to end (or the job to come back)")
        fields = job_fields(cluster, job_id)
        assert fields["Restarts"] == "0", f"the cancelled job requeued itself and is {fields['JobState']} again"
        code = doit.finish(timeout=60)
    finally:
        doit.kill()
    err = doit.text("stderr")
    assert code != 0, doit.text("stdout") + err
    assert f"SLURM job {job_id} was cancelled from outside tether" in err, err
    assert "`doit run train` submits it again" in err
    assert queue_state(cluster, job_id) == ""
    assert job_fields(cluster, job_id)["JobState"] == "CANCELLED"
    assert doit_status(project)["status"] == "cancelled"


def test_failed_trainer_is_reported_with_its_exit_code_and_log(project, cluster, remote):
    use_trainer(project, cluster, remote, "failing.py", FAILING, artifacts="model.json")
    failed = project.doit("run", "train", timeout=120)
    assert failed.returncode != 0, failed.stdout + failed.stderr
    run_id = only_run_id(project)
    assert f"run {run_id} failed (exit code 3)" in failed.stderr, failed.stderr
    assert "fatal: loss is NaN at step 1 (marker 27182)" in failed.stderr
    assert "loading shard 7 of 9" in failed.stderr
    state = far_json(remote, run_id, "state.json")
    assert (state["status"], state["exit_code"], state["final"]) == ("failed", 3, True)
    job_id = far_json(remote, run_id, "slurm.json")["job_id"]
    assert queue_state(cluster, job_id) == ""  # the policy (on-preempt) does not requeue a failure
    assert job_fields(cluster, job_id)["Restarts"] == "0"

    again = project.doit("run", "train", timeout=120)
    assert again.returncode != 0 and "marker 27182" in again.stderr, again.stdout + again.stderr
    assert far_json(remote, run_id, "slurm.json")["jobs"] == [job_id]  # never submitted again
    assert len(named(far_events(remote, run_id), "launch")) == 1


# ---------------------------------------------------------------- the laptop goes away


def test_laptop_killed_mid_watch_the_job_goes_on_and_train_reattaches(project, cluster, remote):
    use_trainer(project, cluster, remote, "paced.py", PACED, "--steps 40 --step-s 0.25")
    doit = Background(project.start("run", "train"))
    try:
        job_id = job_of(remote, project)
        run_id = only_run_id(project)
        project.wait_for(lambda: (project.local_run(run_id) / "launch.json").exists()
                         and named(far_events(remote, run_id), "step"), 60, "launch.json and the first step")
        doit.kill()  # SIGKILL: no cleanup of any kind on this side
    finally:
        doit.kill()
    assert not (project.local_run(run_id) / "watch.json").exists()
    assert queue_state(cluster, job_id) == "RUNNING"  # the job, not the laptop, owns the run
    steps = len(named(far_events(remote, run_id), "step"))
    project.wait_for(lambda: len(named(far_events(remote, run_id), "step")) > steps, 30, "steps after the kill")

    again = project.doit("run", "train", timeout=120)
    assert again.returncode == 0, again.stdout + again.stderr
    assert only_run_id(project) == run_id
    assert "-- launch" in again.stdout and ".  watch" in again.stdout, again.stdout  # reattached, not relaunched
    assert far_json(remote, run_id, "slurm.json")["jobs"] == [job_id]  # one sbatch in all
    assert len(named(far_events(remote, run_id), "launch")) == 1
    assert far_json(remote, run_id, "state.json")["status"] == "completed"
    assert json.loads((project.local_run(run_id) / "files" / "artifacts" / "model.json").read_text()) == {"steps": 40}
    assert job_fields(cluster, job_id)["JobState"] == "COMPLETED"


# ---------------------------------------------------------------- stop


def process_alive(pid: int) -> bool:
    """Whether `pid` is a process that has not exited (a zombie has)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_stop_scancels_term_then_kill_and_ends_stopped(project, cluster, remote):
    use_trainer(project, cluster, remote, "paced.py", PACED, "--steps 400 --step-s 0.25 --ignore-term", grace=2)
    project.doit("run", "launch", check=True, timeout=120)
    run_id = only_run_id(project)
    job_id = job_of(remote, project)
    project.wait_for(lambda: named(far_events(remote, run_id), "step"), 60, "the first step")
    trainer = named(far_events(remote, run_id), "trainer-start")[0]["pid"]
    assert queue_state(cluster, job_id) == "RUNNING" and process_alive(trainer)

    started = time.monotonic()
    stopped = project.doit("stop", timeout=120)
    took = time.monotonic() - started
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert f"{run_id}: stopped" in stopped.stdout, stopped.stdout
    assert named(far_events(remote, run_id), "term-ignored"), "the trainer never saw SIGTERM"
    assert not process_alive(trainer)  # it ignored SIGTERM: only SIGKILL ended it
    assert took >= 2, "SIGKILL came before the grace time (grace_seconds: 2) was over"
    assert queue_state(cluster, job_id) == ""
    assert jobs_of_run(cluster, run_id) == []
    state = far_json(remote, run_id, "state.json")
    assert (state["status"], state["final"]) == ("stopped", True), state
    assert state["signal"] == "SIGTERM" and state["exit_code"] == -signal.SIGKILL, state  # TERM first, then KILL
    scancels = (cluster.base / "slurmctld.log").read_text().count(f"REQUEST_KILL_JOB JobId={job_id} ")
    assert scancels >= 1, "the job was not stopped through scancel"
    assert (far(remote, run_id) / "PULL_MANIFEST.json").is_file()  # sealed: its files can come home
    assert doit_status(project)["status"] == "stopped"

    again = project.doit("stop", check=True)
    assert f"{run_id}: was not running" in again.stdout, again.stdout
    launched = project.doit("run", "launch", check=True)  # stop is a pause: launch submits its next attempt
    assert f"resuming {run_id} from" in launched.stderr, launched.stdout + launched.stderr
    jobs = far_json(remote, run_id, "slurm.json")["jobs"]
    assert jobs[0] == job_id and len(jobs) == 2, launched.stdout
    assert (far(remote, run_id) / "PULL_MANIFEST.attempt-1.json").is_file()
    assert project.doit("stop", timeout=120).returncode == 0


def jobs_of_run(cluster, run_id: str) -> list[str]:
    """Jobs in the queue whose comment names the run (tether's --comment=tether:RUN_ID)."""
    out = cluster.run("squeue", "-h", "-o", "%i|%k")
    return [job for job, _, comment in (line.partition("|") for line in out.splitlines())
            if comment == f"tether:{run_id}"]


# ---------------------------------------------------------------- the time limit (started at the top)


def test_time_limit_usr1_checkpoint_requeue_until_done(time_limited, cluster):
    project, remote, doit = time_limited.project, time_limited.remote, time_limited.doit
    code = doit.finish(timeout=max(30.0, 300 - (time.monotonic() - time_limited.started)))
    assert code == 0, doit.text("stdout") + doit.text("stderr")
    run_id = only_run_id(project)
    events = far_events(remote, run_id)
    timeline = "\n".join(f"{e['t'] - events[0]['t']:6.1f}s {e['event']} "
                          + json.dumps({k: e[k] for k in ("attempt", "status", "signal", "step", "start") if k in e})
                          for e in events if e["event"] in ("launch", "trainer-start", "preempting", "exit"))
    print(timeline)  # shown when the test fails
    launches = named(events, "launch")
    resumed = [e for e in launches if e["resumed_from"]]
    assert len(resumed) >= 1, timeline
    assert launches[0]["resumed_from"] is None
    exits = named(events, "exit")
    assert [e["status"] for e in exits] == ["preempted"] * (len(launches) - 1) + ["completed"], timeline
    preempted = named(events, "preempting")  # the trainer's own "checkpointed on request" (one per attempt,
    assert preempted and all(e["signal"] == "SIGUSR1" for e in preempted), timeline  # unless USR1 beat its handler)
    starts = named(events, "trainer-start")
    assert len(starts) == len(launches)
    for start in starts[1:]:  # each attempt went on from the newest checkpoint before it
        saved = [e["step"] for e in events[:events.index(start)] if e["event"] == "checkpoint"]
        assert start["start"] == saved[-1] > 0, timeline
    assert [e["slurm_restart_count"] for e in starts] == [None] + [str(i) for i in range(1, len(starts))]
    job_id = far_json(remote, run_id, "slurm.json")["job_id"]
    assert far_json(remote, run_id, "slurm.json")["jobs"] == [job_id]  # the job requeued itself: one sbatch
    assert job_fields(cluster, job_id)["Restarts"] == str(len(launches) - 1)
    status = doit_status(project)
    assert status["status"] == "completed" and status["restarts"] >= 1, status
    assert status["restarts"] == len(launches) - 1
    metrics = json.loads((project.local_run(run_id) / "files" / "artifacts" / "metrics.json").read_text())
    assert metrics == {"steps": TIME_LIMITED_STEPS}
