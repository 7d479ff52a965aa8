"""Bring your own script on the ssh and SLURM backends: signals from outside, `retry=1`, `resume_from=`,
and a script's own checkpoint folders, with real services only.

The scripts and helpers are those of the local tests (test_resume.py: a public-style script with its
own `out/ckpt.json` and `--resume`; test_checkpoint_dirs.py: Hugging Face-style `checkpoint-N/`
folders). The far side is this machine (sshd on loopback; slurmd runs the jobs here), so a test reads
a run's far-side files directly and signals the trainer by the pgid the launcher recorded, as an
administrator or the kernel would. Every wait polls a condition against a deadline.
"""

from __future__ import annotations

import hashlib
import json
import re
import signal
from pathlib import Path

import pytest

pytest.register_assert_rewrite("slurm_fixtures")
pytest_plugins = ["slurm_fixtures"]  # the session's one cluster (started only by the SLURM tests here)

from conftest import Project, ssh_config_text  # noqa: E402
from helpers import Background, sha256, stop_leftover_runs  # noqa: E402
from slurm_fixtures import slurm_yaml  # noqa: E402
from test_checkpoint_dirs import assert_pulled_and_verified, kept_names, uninterrupted, use_hf  # noqa: E402
from test_resume import SCRIPT, far_state, kill_trainer, launches, printed_step, use_script  # noqa: E402


class FarProject(Project):
    """The test's project whose far side is `remote` (not .tether/remote): the local tests' helpers,
    which read `project.remote_run(...)` and `project.events(...)`, then work unchanged."""

    def __init__(self, root: Path, remote: Path) -> None:
        super().__init__(root)
        self.remote = remote

    def remote_run(self, run_id: str | None = None) -> Path:
        return self.remote / "runs" / (run_id or self.run_ids()[-1])


def out(done) -> str:
    return f"exit {done.returncode}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"


def expected_weights(steps: int) -> dict:
    """What SCRIPT's weights.json holds after `steps` steps, however often it was interrupted."""
    w = "seed"
    for step in range(1, steps + 1):
        w = hashlib.sha256((w + str(step)).encode()).hexdigest()
    return {"w": w, "step": steps}


def pulled_weights(project, run_id: str) -> dict:
    return json.loads((project.local_run(run_id) / "files" / "artifacts" / "weights.json").read_text())


def kept_step(project, run_id: str) -> int:
    """The step of the checkpoint the launcher kept (checkpoints/ckpt.json, the script's own file)."""
    return json.loads((project.remote_run(run_id) / "checkpoints" / "ckpt.json").read_text())["step"]


def assert_resumed_at(project, run_id: str, step: int, steps: int) -> None:
    """train.log: the second attempt says it resumed at `step`, then trains step+1 .. steps, nothing else."""
    log = (project.remote_run(run_id) / "train.log").read_text()
    assert log.count("resumed at step") == 1 and f"resumed at step {step}\n" in log, log
    after = log.split(f"resumed at step {step}\n", 1)[1].splitlines()
    assert [int(line.split()[1]) for line in after if line.startswith("step ")] == list(range(step + 1, steps + 1))


def slurm_script_job(project, cluster, remote: Path, steps: int, restart: str, sleep: float = 0.05) -> FarProject:
    """SCRIPT as the trainer of a job on backend hpc (the cluster), its checkpoint file mapped."""
    text = slurm_yaml(cluster, remote, f"{{python}} script/train.py --steps {steps} --sleep {sleep}",
                      code="script/train.py", artifacts="weights.json")
    text, replaced = re.subn(r"^restart: .*\n", "", text, flags=re.M)  # use_script sets the policy
    assert replaced == 1, text
    use_script(project, text=text, restart=restart)
    return FarProject(project.root, remote)


def ssh_script_job(project, sshd, remote: Path, steps: int, sleep: float = 0.05) -> FarProject:
    """SCRIPT as the trainer of a job on backend lab (the sshd), its checkpoint file mapped."""
    text = ssh_config_text(sshd, remote).replace("{python} demo/train.py --epochs 30",
                                                 f"{{python}} script/train.py --steps {steps} --sleep {sleep}")
    text = text.replace("paths: [demo/train.py]", "paths: [script/train.py]").replace(
        "artifacts: [model.json, metrics.json]", "artifacts: [weights.json]")
    assert "script/train.py --steps" in text and "weights.json" in text, text
    use_script(project, text=text)
    return FarProject(project.root, remote)


def slurm_jobs(project, run_id: str) -> list[str]:
    return json.loads((project.remote_run(run_id) / "slurm.json").read_text())["jobs"]


def exits(project, run_id: str) -> list[dict]:
    return [e for e in project.events(run_id) if e.get("event") == "exit"]


def sigkill_then_retry(project, kill_after: int = 12, steps: int = 60, timeout: float = 180) -> str:
    """`doit run train`; SIGKILL the trainer mid-run: failed, named; a plain train refuses; retry=1 resumes.
    The run id."""
    doit = Background(project.start("run", "train"))
    try:
        project.wait_for(lambda: project.run_ids(), what="the run")
        run_id = project.run_ids()[0]
        kill_trainer(project, run_id, signal.SIGKILL, after_step=kill_after)
        code = doit.finish(timeout=timeout)
    finally:
        doit.kill()
    err = doit.text("stderr")
    assert code == 1, doit.output()
    assert f"run {run_id} failed: killed by SIGKILL" in err, doit.output()
    assert "its latest checkpoint is checkpoints/ckpt.json: `doit run train retry=1` relaunches it from there" in err
    state = far_state(project, run_id)
    assert (state["status"], state["signal"], state["final"], state["attempt"]) == ("failed", "SIGKILL", True, 1)
    killed_at = kept_step(project, run_id)
    assert killed_at >= 10 and killed_at % 5 == 0 and killed_at <= printed_step(project, run_id) < steps, killed_at
    assert launches(project, run_id) == 1

    refused = project.doit("run", "train", timeout=timeout)  # never relaunched silently
    assert refused.returncode == 1 and "`doit run train retry=1` relaunches it from there" in refused.stderr, \
        out(refused)
    assert launches(project, run_id) == 1

    retried = project.doit("run", "train", "retry=1", timeout=timeout)
    assert retried.returncode == 0, out(retried)
    assert f"resuming {run_id} from checkpoint" in retried.stderr and "attempt 2" in retried.stderr, out(retried)
    assert project.run_ids() == [run_id]
    state = far_state(project, run_id)
    assert (state["status"], state["attempt"]) == ("completed", 2), state
    assert launches(project, run_id) == 2  # exactly one more launch
    assert_resumed_at(project, run_id, killed_at, steps)
    assert pulled_weights(project, run_id) == expected_weights(steps)  # as if never interrupted
    assert (project.local_run(run_id) / "PULL_VERIFIED.json").is_file()
    return run_id


def resume_from_a_crashed_run(project, steps: int = 30, timeout: float = 180) -> tuple[str, str]:
    """Launch, SIGKILL the trainer (a crash), fix the script, `resume_from=OLD`: a new run from OLD's
    checkpoint, the lineage in run.json on both sides and in `doit status`. (old, new)."""
    project.doit("run", "launch", check=True, timeout=timeout)
    old = project.run_ids()[0]
    kill_trainer(project, old, signal.SIGKILL, after_step=12)
    project.wait_for(lambda: far_state(project, old).get("final"), timeout=60, what="the crash recorded")
    assert (far_state(project, old)["status"], far_state(project, old)["signal"]) == ("failed", "SIGKILL")
    checkpoint = project.remote_run(old) / "checkpoints" / "ckpt.json"
    digest, step = sha256(checkpoint), json.loads(checkpoint.read_text())["step"]
    assert 10 <= step < steps, step

    (project.root / "script" / "train.py").write_text(SCRIPT.replace("time.sleep(args.sleep)", "pass"))  # fixed
    done = project.doit("run", "train", f"resume_from={old}", timeout=timeout)
    assert done.returncode == 0, out(done)
    new = [r for r in project.run_ids() if r != old]
    assert len(new) == 1, project.run_ids()
    new = new[0]
    record = json.loads((project.local_run(new) / "run.json").read_text())
    assert record["resume_from"]["run_id"] == old and record["resume_from"]["sha256"] == digest, record
    assert record["resume_from"]["checkpoint"] == "checkpoints/ckpt.json"
    far = json.loads((project.remote_run(new) / "run.json").read_text())
    assert far["resume_from"] == record["resume_from"]
    log = (project.remote_run(new) / "train.log").read_text()
    assert log.startswith(f"resumed at step {step}\n"), log  # its first attempt already starts from there
    assert (far_state(project, new)["status"], far_state(project, new)["attempt"]) == ("completed", 1)
    assert pulled_weights(project, new) == expected_weights(steps)
    status = project.doit("status", f"run={new}", check=True, timeout=timeout)
    assert f"resumed from {old} (checkpoint checkpoints/ckpt.json" in status.stdout and digest in status.stdout, \
        status.stdout
    assert far_state(project, old)["status"] == "failed" and launches(project, old) == 1  # the old run untouched
    return old, new


# ---------------------------------------------------------------- SLURM (real slurmctld and slurmd)


def test_slurm_sigkill_fails_names_the_signal_and_retry_submits_again_and_resumes(project, cluster, remote):
    far = slurm_script_job(project, cluster, remote, steps=60, restart="{policy: on-preempt, max_restarts: 2}")
    run_id = sigkill_then_retry(far)
    jobs = slurm_jobs(far, run_id)
    assert len(jobs) == 2 and jobs[0] != jobs[1], jobs  # retry=1 is one more sbatch, and only one


def test_slurm_sigterm_to_the_trainer_is_preempted_and_the_job_requeues_itself(project, cluster, remote):
    far = slurm_script_job(project, cluster, remote, steps=60, restart="{policy: on-preempt, max_restarts: 2}")
    doit = Background(far.start("run", "train"))
    try:
        far.wait_for(lambda: far.run_ids(), what="the run")
        run_id = far.run_ids()[0]
        kill_trainer(far, run_id, signal.SIGTERM, after_step=12)
        far.wait_for(lambda: exits(far, run_id), timeout=60, what="attempt 1 to end")
        preempted_at = kept_step(far, run_id)  # read before attempt 2 ends (the requeue waits cred_expire)
        code = doit.finish(timeout=180)
    finally:
        doit.kill()
    assert code == 0, doit.output()
    first, second = exits(far, run_id)
    assert (first["status"], first["signal"], first["signal_to"], first["final"]) == \
        ("preempted", "SIGTERM", "trainer", False), first
    assert second["status"] == "completed", second
    state = far_state(far, run_id)
    assert (state["status"], state["attempt"], state["restarts"]) == ("completed", 2, 1), state
    assert launches(far, run_id) == 2
    jobs = slurm_jobs(far, run_id)
    assert len(jobs) == 1, f"not requeued by the job itself: watch submitted it again ({jobs})"
    job = jobs[0]  # the same job ran again: it requeued itself, no second sbatch
    fields = dict(w.partition("=")[::2] for w in cluster.run("scontrol", "show", "job", "-o", job).split())
    assert (fields["Restarts"], fields["JobState"]) == ("1", "COMPLETED"), fields
    assert 10 <= preempted_at < 60 and preempted_at % 5 == 0, preempted_at
    assert_resumed_at(far, run_id, preempted_at, 60)
    assert pulled_weights(far, run_id) == expected_weights(60)


def test_slurm_checkpoint_folders_the_newest_complete_one_is_kept_sealed_pulled_and_verified(
        project, cluster, remote, tmp_path):
    far = FarProject(project.root, remote)
    use_hf(far, keep=2, text=slurm_yaml(cluster, remote, "{python} demo/train.py --epochs 30"))
    done = far.doit("run", "train", timeout=180)
    assert done.returncode == 0, out(done)
    run_id = far.run_ids()[0]
    assert kept_names(far, run_id) == ["checkpoint-12", "checkpoint-9"]  # keep: 2 of 3, 6, 9, 12
    manifest = assert_pulled_and_verified(far, run_id, "checkpoint-12")
    assert not [e for e in manifest["files"] if "checkpoint-9/" in e["path"]]  # only the newest comes home
    assert far_state(far, run_id)["checkpoint"] == "checkpoints/checkpoint-12"
    assert sha256(far.remote_run(run_id) / "work" / "outputs" / "model.safetensors") == uninterrupted(tmp_path)


def test_slurm_a_half_saved_folder_is_never_taken_and_the_requeued_job_resumes_before_it(
        project, cluster, remote, tmp_path):
    far = FarProject(project.root, remote)
    text = slurm_yaml(cluster, remote, "{python} demo/train.py --epochs 30", policy="on-failure", max_restarts=1)
    use_hf(far, "--crash_saving 9", text=text)
    done = far.doit("run", "train", timeout=180)
    assert done.returncode == 0, out(done)
    run_id = far.run_ids()[0]
    skipped = [(e["path"], e["reason"]) for e in far.events(run_id) if e["event"] == "checkpoint_not_kept"]
    assert skipped == [("outputs/checkpoint-9", "incomplete: no trainer_state.json (Hugging Face's Trainer "
                                                "writes it last)")], skipped
    first, second = [e for e in far.events(run_id) if e["event"] == "launch"]
    work = str(far.remote_run(run_id) / "work")
    assert first["resumed_from"] is None and "--resume_from_checkpoint" not in first["argv"]
    assert second["argv"][-2:] == ["--resume_from_checkpoint", f"{work}/outputs/checkpoint-6"], second
    log = (far.remote_run(run_id) / "train.log").read_text()
    assert f"Resuming training from checkpoint {work}/outputs/checkpoint-6 at step 6" in log, log
    assert log.count("{'loss'") == 9 + 6  # steps 1-9, then 7-12
    jobs = slurm_jobs(far, run_id)  # requeued by the policy (on-failure), not submitted again
    assert len(jobs) == 1, f"not requeued by the job itself: watch submitted it again ({jobs})"
    assert_pulled_and_verified(far, run_id, "checkpoint-12")
    assert sha256(far.remote_run(run_id) / "work" / "outputs" / "model.safetensors") == uninterrupted(tmp_path)


def test_slurm_resume_from_starts_a_new_run_from_the_old_runs_checkpoint(project, cluster, remote):
    far = slurm_script_job(project, cluster, remote, steps=30, restart="{policy: never}")
    old, new = resume_from_a_crashed_run(far)
    assert len(slurm_jobs(far, old)) == 1 and len(slurm_jobs(far, new)) == 1


# ---------------------------------------------------------------- ssh (a real sshd)


def test_ssh_sigkill_fails_names_the_signal_and_retry_resumes(project, sshd, tmp_path):
    remote = tmp_path / "far"
    try:
        sigkill_then_retry(ssh_script_job(project, sshd, remote, steps=60))
    finally:
        stop_leftover_runs(remote)


def test_ssh_resume_from_starts_a_new_run_from_the_old_runs_checkpoint(project, sshd, tmp_path):
    remote = tmp_path / "far"
    try:
        resume_from_a_crashed_run(ssh_script_job(project, sshd, remote, steps=30))
    finally:
        stop_leftover_runs(remote)
