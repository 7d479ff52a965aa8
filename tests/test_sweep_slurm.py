"""Sweeps on the slurm backend, end to end against the session's real cluster (tests/slurm_fixtures.py):
one job array per `launch` for every point that has no job yet, one squeue per poll for every point in
flight, and a sweep point trained on the cluster reproduced bit for bit on the local backend from a
fresh copy of the project.

What SLURM did is read from SLURM itself (slurmctld's log, squeue, scontrol) and from the far-side
files (the far side is this machine); how many squeue calls a poll makes is counted by a logging
`squeue` first on the PATH of a second login node in front of the same cluster. Every wait polls a
condition against a deadline; nothing sleeps a fixed time.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.register_assert_rewrite("slurm_fixtures")
pytest_plugins = ["slurm_fixtures"]  # the session's one cluster, shared with the other slurm tests

from conftest import Project  # noqa: E402
from slurm_fixtures import POLL_ACK, slurm_backend_config  # noqa: E402
from sshd import SSHServer  # noqa: E402

SUBMIT_LINE = "_slurm_rpc_submit_batch_job"  # slurmctld logs one per accepted sbatch (an array is one)
GRID = [(lr, seed) for lr in ("0.1", "0.03") for seed in (0, 1, 2)]

SWEEP_JOB = """\
name: {name}
backend: hpc
code: {{paths: [{code}]}}
data: {{paths: [demo/points.csv]}}
trainer:
  type: command
  command: "{command}"
sweep:
  lr: [0.1, 0.03]
  seed: [{seeds}]
artifacts: [model.json, metrics.json]
validation: {{acknowledge: ["{ack}"]}}
backends:
  hpc: {hpc}
"""

# A trainer paced by the clock (0.1 s a step) that takes the sweep's values; it checkpoints every 5
# steps and on SIGTERM/SIGUSR1 (then exit 75), and resumes from TETHER_RESUME_FROM: an element
# requeued mid-training must go on from its checkpoint.
RESUMABLE = r'''
import argparse, json, os, sys, time
from tether.trainers import runtime

parser = argparse.ArgumentParser()
parser.add_argument("--lr", type=float)
parser.add_argument("--seed", type=int)
parser.add_argument("--steps", type=int, default=60)
args = parser.parse_args()
stop = runtime.stop_signal()
step = 0
if runtime.resume_from():
    with open(runtime.resume_from()) as f:
        step = json.load(f)["step"]
runtime.log("trainer-start", start=step, job=os.environ.get("SLURM_JOB_ID"))
save = lambda: runtime.save_checkpoint(lambda f: f.write(json.dumps({"step": step}).encode()), step)
while step < args.steps:
    deadline = time.monotonic() + 0.1
    while time.monotonic() < deadline and not stop.requested:
        time.sleep(0.02)
    if stop.requested:
        save()
        sys.exit(runtime.PREEMPTED_EXIT)
    step += 1
    runtime.log("step", step=step, total_steps=args.steps, loss=round(args.lr / step, 6))
    if step % 5 == 0:
        save()
out = os.environ["TETHER_ARTIFACTS_DIR"]
for name in ("model.json", "metrics.json"):
    with open(os.path.join(out, name), "w") as f:
        json.dump({"steps": step, "seed": args.seed, "lr": args.lr}, f)
'''


TORCH_SWEEP = """\
name: digits
backend: hpc
code: {{paths: [demo/train.py]}}
data: {{paths: [demo/points.csv]}}
trainer:
  type: torch-classifier
  layers: [linear:16, relu]
  epochs: 1
  batch_size: 64
  threads: 1
sweep:
  lr: [0.003, 0.001]
  seed: [2]
artifacts: [model.*, metrics.json, config.json]
validation:
  acknowledge: ["{ack}"]
backends:
  local: {{type: local}}
  hpc: {hpc}
"""


# ---------------------------------------------------------------- helpers


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def submissions(cluster) -> list[str]:
    """slurmctld's log line of every batch submission it has accepted so far (a job array is one)."""
    return [line for line in (cluster.base / "slurmctld.log").read_text(errors="replace").splitlines()
            if SUBMIT_LINE in line]


def train_counting_submissions(project: Project, cluster, timeout: float):
    """`doit run train` (which must succeed) and the sbatch submissions it made."""
    before = submissions(cluster)
    done = project.doit("run", "train", timeout=timeout)
    assert done.returncode == 0, done.stdout + done.stderr
    return done, submissions(cluster)[len(before):]


def far_json(remote: Path, run_id: str, name: str) -> dict:
    try:
        return json.loads((remote / "runs" / run_id / name).read_text())
    except (FileNotFoundError, json.JSONDecodeError):  # not written yet (writes are atomic renames)
        return {}


def far_events(remote: Path, run_id: str) -> list[dict]:
    try:
        text = (remote / "runs" / run_id / "events.jsonl").read_text()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.split("\n")[:-1] if line.strip()]


def named(events: list[dict], name: str) -> list[dict]:
    return [e for e in events if e.get("event") == name]


def params_of(project: Project) -> dict[str, dict]:
    """Run id -> the params its local run.json records, for every run folder here."""
    return {run_id: json.loads((project.local_run(run_id) / "run.json").read_text()).get("params")
            for run_id in project.run_ids()}


def status_summary(project: Project) -> str:
    done = project.doit("status", "json=1", check=True, timeout=60)
    return json.loads(done.stdout.strip().splitlines()[-1])["summary"]


def array_elements(cluster, array_job: str) -> dict[str, dict[str, str]]:
    """`scontrol show job -o ARRAY`: one record per element, by `<A>_<a>` (kept MinJobAge=600 s)."""
    found = {}
    for line in cluster.run("scontrol", "show", "job", "-o", array_job).splitlines():
        fields = dict(word.partition("=")[::2] for word in line.split())
        found[f"{fields['ArrayJobId']}_{fields['ArrayTaskId']}"] = fields
    return found


# ---------------------------------------------------------------- 1. one job array per launch


def test_sweep_is_one_job_array_and_a_new_seed_is_one_more(project, cluster, remote):
    hpc = json.dumps(slurm_backend_config(cluster, remote, array_limit=2))
    sweep_job = dict(name="sw", code="demo/train.py", ack=POLL_ACK, hpc=hpc,
                     command="{python} demo/train.py --epochs 3 --lr {lr} --seed {seed}")
    project.write_config(SWEEP_JOB.format(seeds="0, 1, 2", **sweep_job))

    trained, submitted = train_counting_submissions(project, cluster, 150)
    assert len(submitted) == 1, f"a 2 x 3 sweep must be ONE sbatch (a job array): {submitted}"

    runs = params_of(project)
    assert sorted((str(p["lr"]), p["seed"]) for p in runs.values()) == sorted(GRID), runs  # one run per point
    records = {run_id: far_json(remote, run_id, "slurm.json") for run_id in runs}
    (array_job,) = {r.get("array_job") for r in records.values()}
    assert array_job and array_job.isdigit(), records
    assert f"JobId={array_job} " in submitted[0], submitted
    assert sorted(r["job_id"] for r in records.values()) == [f"{array_job}_{i}" for i in range(6)], records
    for run_id, record in records.items():
        assert record["jobs"] == [record["job_id"]], record
        assert "--array=0-5%2" in record["flags"], record
        assert far_json(remote, run_id, "state.json")["status"] == "completed"
        assert (remote / "slurm" / f"{record['job_id']}.out").is_file()
    assert f"job array {array_job} for 6 run(s)" in trained.stdout, trained.stdout
    scripts = list((remote / "slurm").glob("array-*.sh"))
    assert len(scripts) == 1, scripts
    assert all(str(remote / "runs" / run_id) in scripts[0].read_text() for run_id in runs)

    elements = array_elements(cluster, array_job)  # what SLURM itself ran
    assert sorted(elements) == sorted(r["job_id"] for r in records.values()), elements
    for job_id, fields in elements.items():
        assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", fields
        assert fields["Comment"] == "tether:sw", fields
        assert fields["ArrayTaskThrottle"] == "2", fields  # array_limit: 2, as SLURM holds it
    for run_id in runs:
        assert len(named(far_events(remote, run_id), "launch")) == 1  # each point trained once
        # the verified files are the ones the far side sealed
        local = project.local_run(run_id) / "files" / "artifacts" / "model.json"
        assert sha256(local) == sha256(remote / "runs" / run_id / "artifacts" / "model.json")
    assert status_summary(project) == "6 points: 6 completed; 6 verified here"

    # a fourth seed: only its two points are trained, as one more (two-element) array
    first_records = records
    project.write_config(SWEEP_JOB.format(seeds="0, 1, 2, 3", **sweep_job))
    again, submitted = train_counting_submissions(project, cluster, 120)
    assert len(submitted) == 1, f"the two new points must be ONE more sbatch: {submitted}"
    now = params_of(project)
    new = {run_id: p for run_id, p in now.items() if run_id not in runs}
    assert set(runs) <= set(now) and len(now) == 8, now
    assert sorted((str(p["lr"]), p["seed"]) for p in new.values()) == [("0.03", 3), ("0.1", 3)], new
    new_records = {run_id: far_json(remote, run_id, "slurm.json") for run_id in new}
    (second,) = {r.get("array_job") for r in new_records.values()}
    assert second and second != array_job and f"JobId={second} " in submitted[0], (new_records, submitted)
    assert sorted(r["job_id"] for r in new_records.values()) == [f"{second}_0", f"{second}_1"], new_records
    assert all("--array=0-1%2" in r["flags"] for r in new_records.values()), new_records
    assert sorted(array_elements(cluster, second)) == [f"{second}_0", f"{second}_1"]
    for run_id, record in first_records.items():  # the six that ran are left alone
        assert far_json(remote, run_id, "slurm.json") == record
        assert len(named(far_events(remote, run_id), "launch")) == 1
    for run_id in new:
        assert far_json(remote, run_id, "state.json")["status"] == "completed"
    assert status_summary(project) == "8 points: 8 completed; 8 verified here"


# ---------------------------------------------------------------- 2. one squeue per poll


@pytest.fixture
def logged_login(cluster, tmp_path):
    """A second login node (sshd) in front of the session's cluster, whose sessions find a `squeue`
    first on their PATH that appends its arguments to a log, then runs the real one."""
    folder = tmp_path / "bin"
    folder.mkdir()
    log = tmp_path / "squeue.log"
    log.touch()
    wrapper = folder / "squeue"
    wrapper.write_text(f"#!/bin/sh\nprintf '%s\\n' \"$*\" >> {log}\nexec {shutil.which('squeue')} \"$@\"\n")
    wrapper.chmod(0o755)
    server = SSHServer(tmp_path / "login2", path_prepend=str(folder), env={"SLURM_CONF": str(cluster.conf)}).start()
    try:
        yield SimpleNamespace(login=server, log=log)
    finally:
        server.stop()


def squeue_calls(log: Path) -> list[str]:
    return log.read_text().splitlines()


def test_one_poll_of_a_sweep_is_one_command_and_one_squeue(project, cluster, remote, logged_login):
    from tether.pipelines.session import Session

    (project.root / "demo" / "paced.py").write_text(RESUMABLE)
    hpc = json.dumps(slurm_backend_config(logged_login, remote))  # no array_limit: the node decides
    project.write_config(SWEEP_JOB.format(name="poll", code="demo/paced.py", seeds="0, 1, 2", ack=POLL_ACK, hpc=hpc,
                                          command="{python} demo/paced.py --lr {lr} --seed {seed} --steps 1000"))
    before = submissions(cluster)
    launched = project.doit("run", "launch", timeout=120)
    assert launched.returncode == 0, launched.stdout + launched.stderr
    assert len(submissions(cluster)) - len(before) == 1
    runs = project.run_ids()
    assert len(runs) == 6, runs
    records = {run_id: far_json(remote, run_id, "slurm.json") for run_id in runs}
    (array_job,) = {r.get("array_job") for r in records.values()}
    project.wait_for(lambda: any(named(far_events(remote, r), "step") for r in runs), 60, "a point's first step")

    s = Session.open({"config": str(project.root / "tether.yaml")}, cwd=str(project.root))
    points = s.points
    assert len(points) == 6
    run = points[0].current()
    assert run is not None and run.run_id in runs
    assert len(points[0].in_flight()) == 6  # every point was launched and none is followed to its end

    calls, commands = len(squeue_calls(logged_login.log)), s.backend.commands
    points[0].snapshot(run, fresh=True)
    assert s.backend.commands - commands == 1, "one poll must be one far-side command"
    polled = squeue_calls(logged_login.log)[calls:]
    assert len(polled) == 1, f"one poll must be one squeue, the login node ran: {polled}"
    words = polled[0].split()
    assert "-r" in words, polled
    assert sorted(words[words.index("-j") + 1].split(",")) == sorted(r["job_id"] for r in records.values()), polled

    shared = points[0].snapshots
    cache = shared.states
    assert set(cache) == set(runs), "the poll must refresh every point in flight"
    for other in points:
        assert other.snapshots is shared  # one cache shared by the sweep's points
    states = {}
    for run_id, snap in cache.items():
        assert snap.job_id == records[run_id]["job_id"], (run_id, snap)
        assert snap.job_id.startswith(f"{array_job}_")
        assert snap.queue is not None, (run_id, snap)  # squeue listed it (pending or running)
        states[run_id] = snap.queue["state"]
    assert "RUNNING" in states.values(), states
    for run_id, state in states.items():  # the scheduler's word decides queued or running
        if state in ("RUNNING", "PENDING"):
            assert cache[run_id].status == state.lower(), cache[run_id]

    # a second poll from another point: again one command and one squeue, and nothing fetched twice
    calls, commands = len(squeue_calls(logged_login.log)), s.backend.commands
    points[3].snapshot(points[3].current(), fresh=True)
    assert s.backend.commands - commands == 1
    assert len(squeue_calls(logged_login.log)) - calls == 1
    commands = s.backend.commands
    for other in points:
        other.snapshot(other.current())  # cached: no round trip
    assert s.backend.commands == commands

    # status names each point's job and the scheduler's state (two CPUs: some wait for resources)
    status = json.loads(project.doit("status", "json=1", check=True).stdout.strip().splitlines()[-1])
    for row in status["points"]:
        job = records[row["run_id"]]["job_id"]
        assert row["queue"].startswith(f"job {job} ") and row["queue"].split()[2] in ("RUNNING", "PENDING"), row
    # the `remote` fixture cancels the array's jobs (their working folder is the remote dir)


# ---------------------------------------------------------------- 3. reproduced on another backend


def test_sweep_point_from_the_cluster_reproduces_locally_in_a_fresh_clone(project, cluster, remote, tmp_path):
    pytest.importorskip("torch", reason="the torch extra is part of the test install")
    text = TORCH_SWEEP.format(ack=POLL_ACK, hpc=json.dumps(slurm_backend_config(cluster, remote, array_limit=2)))
    project.write_config(text)
    before = submissions(cluster)
    trained = project.doit("run", "train", timeout=240)
    assert trained.returncode == 0, trained.stdout + trained.stderr
    assert len(submissions(cluster)) - len(before) == 1
    assert status_summary(project) == "2 points: 2 completed; 2 verified here"
    runs = params_of(project)
    (run_id,) = [r for r, p in runs.items() if p == {"lr": 0.001, "seed": 2}]
    recorded_model = next((project.local_run(run_id) / "files" / "artifacts").glob("model.*"))
    assert sha256(recorded_model) == sha256(remote / "runs" / run_id / "artifacts" / recorded_model.name)

    clone = Project(tmp_path / "clone")  # what a reader has: a clean clone, tether, and the run folder
    (clone.root / "recorded").mkdir(parents=True)
    shutil.copytree(project.root / "demo", clone.root / "demo")
    shutil.copy(project.root / "tether.yaml", clone.root / "tether.yaml")
    shutil.copytree(project.local_run(run_id), clone.root / "recorded" / run_id)

    done = clone.tether("repro", f"recorded/{run_id}", "backend=local", timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "reproduced: all 1 run(s)" in done.stdout, done.stdout
    (new_id,) = clone.run_ids()
    assert f"{run_id} -> {new_id}: reproduced (" in done.stdout, done.stdout
    record = json.loads((clone.local_run(new_id) / "run.json").read_text())
    assert (record["repro_of"], record["backend"], record["params"]) == (run_id, "local", {"lr": 0.001, "seed": 2})
    assert json.loads((clone.local_run(new_id) / "files" / "run.json").read_text())["params"] == record["params"]
    assert (clone.local_run(new_id) / "PULL_VERIFIED.json").is_file()
    (new_model,) = (clone.local_run(new_id) / "files" / "artifacts").glob("model.*")
    assert new_model.name == recorded_model.name
    assert sha256(new_model) == sha256(recorded_model), "the same point on another backend: other weights"
    assert [p.name for p in (clone.root / ".tether" / "remote" / "runs").iterdir()] == [new_id]

    # one byte of the code differs from the recorded snapshot: refused, named with both hashes, nothing runs
    script = clone.root / "demo" / "train.py"
    original = sha256(script)
    data = bytearray(script.read_bytes())
    data[-2] ^= 0x01
    script.write_bytes(bytes(data))
    changed = sha256(script)
    assert changed != original
    refused = clone.tether("repro", f"recorded/{run_id}", "backend=local", timeout=120)
    out = refused.stdout + refused.stderr
    assert refused.returncode == 1, out
    assert "demo/train.py" in out and original in out and changed in out, out
    assert "reproduced:" not in out, out
    assert clone.run_ids() == [new_id], "a refused reproduction started a run"
    assert [p.name for p in (clone.root / ".tether" / "remote" / "runs").iterdir()] == [new_id]


# ---------------------------------------------------------------- 4. one element of the array requeued

def test_an_array_element_requeued_mid_training_resumes_under_its_own_id(project, cluster, remote):
    """`scontrol requeue A_1` while element 1 trains: it checkpoints, SLURM runs the same element
    again, it resumes from its checkpoint, and the sweep finishes with no second sbatch."""
    (project.root / "demo" / "resumable.py").write_text(RESUMABLE)
    hpc = json.dumps(slurm_backend_config(cluster, remote))
    project.write_config(SWEEP_JOB.format(name="rq", code="demo/resumable.py", ack=POLL_ACK, hpc=hpc, seeds="0",
                                          command="{python} demo/resumable.py --lr {lr} --seed {seed}"))
    before = submissions(cluster)
    doit = project.start("run", "train")
    try:
        def element_one_training() -> str:
            for run_id in project.run_ids():
                job = far_json(remote, run_id, "slurm.json").get("job_id", "")
                steps = named(far_events(remote, run_id), "step")
                if job.endswith("_1") and steps and steps[-1]["step"] >= 10:
                    return run_id
            return ""
        project.wait_for(element_one_training, 90, "element 1 of the array to pass step 10")
        requeued = element_one_training()
        job_id = far_json(remote, requeued, "slurm.json")["job_id"]
        cluster.run("scontrol", "requeue", job_id)
        out, err = doit.communicate(timeout=180)
        assert doit.returncode == 0, out + err
    finally:
        if doit.poll() is None:
            doit.kill()
    assert len(submissions(cluster)[len(before):]) == 1, "the requeue must not submit anything"

    events = far_events(remote, requeued)
    launches = named(events, "launch")
    assert [e["attempt"] for e in launches] == [1, 2], launches
    assert launches[0]["resumed_from"] is None and Path(launches[1]["resumed_from"]).name.startswith("ckpt-")
    (first_exit, _) = named(events, "exit")
    # the trainer checkpointed on the requeue's SIGTERM and exited 75; with two test workers its launcher
    # is now and then gone before it records that end (`lost`, written by the next attempt's launcher;
    # the cause is not known yet); either way the next attempt resumed from the checkpoint
    assert (first_exit["status"], first_exit["exit_code"]) in (("preempted", 75), ("lost", None)), first_exit
    starts = named(events, "trainer-start")
    assert starts[0]["start"] == 0 and 0 < starts[1]["start"] < 60, starts  # went on from its checkpoint
    assert far_json(remote, requeued, "slurm.json")["jobs"] == [job_id]  # the same element ran again
    assert (remote / "runs" / requeued / f"exit_code.{job_id}").read_text().strip() == "0"
    pulled = json.loads((project.local_run(requeued) / "files" / "artifacts" / "metrics.json").read_text())
    assert pulled["steps"] == 60
    assert status_summary(project) == "2 points: 2 completed; 2 verified here"
