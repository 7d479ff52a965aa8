"""The far side runs itself: with the laptop's `doit` gone, its launcher restarts a preempted or stalled
trainer from its checkpoint, ends a run at max_wall_seconds, and says what it plans in `doit status`.

Real processes only: doit (SIGKILLed to play the closed laptop), the detached far-side launcher, a
real sshd on 127.0.0.1, real SLURM, and a script written the way public scripts are (test_resume.py:
no tether import, its own `out/ckpt.json` and `--resume`; here also one that hangs once). Every wait
polls a condition against a deadline.
"""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import pytest

pytest.register_assert_rewrite("slurm_fixtures")
pytest_plugins = ["slurm_fixtures"]

from helpers import Background  # noqa: E402
from test_notify import Hook, dead_url  # noqa: E402,F401 (a fixture)
from tether.remote import notify  # noqa: E402
from test_own_script_backends import (  # noqa: E402
    assert_resumed_at, expected_weights, exits, kept_step, out, pulled_weights, slurm_jobs, slurm_script_job,
    ssh_script_job,
)
from test_resume import SCRIPT, far_state, launches, printed_step, use_script  # noqa: E402

# SCRIPT, hanging for good at step --hang-at on its first attempt only (a resumed one never hangs): no
# output and no event, as a deadlocked data loader or collective looks from outside.
HANGING = SCRIPT.replace(
    'parser.add_argument("--resume", default="")',
    'parser.add_argument("--resume", default="")\nparser.add_argument("--hang-at", type=int, default=0)',
).replace(
    '    if state["step"] % args.every == 0:\n        save()\n',
    '    if state["step"] % args.every == 0:\n        save()\n'
    '    if state["step"] == args.hang_at and not args.resume:\n        time.sleep(3600)\n',
)
assert "--hang-at" in HANGING and "args.hang_at" in HANGING


@pytest.fixture(params=["local", "ssh"])
def job(request, project, tmp_path):
    """job(steps, restart, sleep=0.05) -> the project whose trainer is SCRIPT: on the local backend, or
    on the real sshd (its far side in tmp/far); either way its own checkpoint file is mapped."""
    def make(steps: int, restart: str = "{policy: never}", sleep: float = 0.05):
        if request.param == "local":
            use_script(project, steps=steps, sleep=sleep, restart=restart)
            return project
        far = ssh_script_job(project, request.getfixturevalue("sshd"), tmp_path / "far", steps=steps, sleep=sleep)
        path = far.root / "tether.yaml"
        path.write_text(path.read_text().replace("restart: {policy: never}", f"restart: {restart}"))
        assert f"restart: {restart}" in path.read_text()
        return far
    return make


def add_config(project, text: str) -> None:
    path = project.root / "tether.yaml"
    path.write_text(path.read_text() + text)


def close_the_laptop(doit: Background) -> None:
    """SIGKILL the whole `doit` process group: nothing on this side watches the run any more."""
    doit.kill()
    assert doit.proc.returncode == -signal.SIGKILL


def preempt_with_nobody_watching(project, steps: int = 60) -> str:
    """`doit run train`, killed once the run trains; then SIGTERM to the trainer from outside. The far
    side must relaunch it and finish on its own. The run id."""
    doit = Background(project.start("run", "train"))
    try:
        project.wait_for(lambda: project.run_ids(), what="the run")
        run_id = project.run_ids()[0]
        project.wait_for(lambda: far_state(project, run_id).get("status") == "running"
                         and printed_step(project, run_id) >= 12, timeout=120, what="step 12")
    finally:
        close_the_laptop(doit)
    os.kill(int(far_state(project, run_id)["pgid"]), signal.SIGTERM)
    project.wait_for(lambda: (project.remote_run(run_id) / "PULL_MANIFEST.json").exists(), timeout=120,
                     what="the far side to finish and seal the run by itself")
    return run_id


def assert_finished_by_the_far_side(project, run_id: str, steps: int = 60) -> None:
    first, second = exits(project, run_id)
    assert (first["status"], first["signal_to"], first["final"]) == ("preempted", "trainer", False), first
    assert (second["status"], second["final"]) == ("completed", True), second
    assert launches(project, run_id) == 2  # one launch per attempt
    relaunch = [e for e in project.events(run_id) if e.get("event") == "launch"][1]
    assert relaunch["t"] - first["t"] < 0.5 + 10, (first, relaunch)  # backoff_s, then "within seconds"
    planned = [e for e in project.events(run_id) if e.get("event") == "restart_planned"]
    assert [(p["attempt"], p["of"], p["after"]) for p in planned] == [(2, 3, "preempted")], planned
    state = far_state(project, run_id)
    assert (state["status"], state["attempt"], state["restarts"], state["plan"]) == ("completed", 2, 1, None), state
    assert state["previous"]["status"] == "preempted" and state["previous"]["attempt"] == 1, state
    preempted_at = json.loads((project.remote_run(run_id) / "checkpoints" / "ckpt.json").read_text())["step"]
    log = (project.remote_run(run_id) / "train.log").read_text()
    resumed = int(re.search(r"resumed at step (\d+)", log).group(1))
    assert 10 <= resumed < steps and resumed % 5 == 0 and preempted_at == steps, (resumed, preempted_at)

    again = project.doit("run", "train", timeout=180)  # the laptop opens: it only pulls and verifies
    assert again.returncode == 0, out(again)
    assert launches(project, run_id) == 2 and project.run_ids() == [run_id]
    assert (project.local_run(run_id) / "PULL_VERIFIED.json").is_file()
    assert pulled_weights(project, run_id) == expected_weights(steps)  # as if never interrupted


RESTARTS = "{policy: on-preempt, max_restarts: 2, backoff_s: 0.5}"


def test_a_preempted_trainer_is_restarted_by_the_far_side_with_the_laptop_closed(job):
    project = job(steps=60, restart=RESTARTS)
    run_id = preempt_with_nobody_watching(project)
    assert_finished_by_the_far_side(project, run_id)


def stalling(project, stall_s: float) -> None:
    """The job's script hangs at step 12 of its first attempt; the job says stall_timeout_s."""
    (project.root / "script" / "train.py").write_text(HANGING)
    path = project.root / "tether.yaml"
    text = path.read_text().replace("--steps 30", "--steps 30 --hang-at 12")
    assert "--hang-at 12" in text, text
    ack = "stall_timeout_s below 10 s"
    text = text.replace("  acknowledge: [", f"  acknowledge: [{ack}, ") if "  acknowledge: [" in text \
        else text + f"validation: {{acknowledge: [{ack}]}}\n"
    path.write_text(text + f"stall_timeout_s: {stall_s:g}\n")


def test_a_stalled_trainer_is_declared_stalled_and_restarted_and_status_says_so(job):
    project = job(steps=30, restart="{policy: on-preempt, max_restarts: 2, backoff_s: 3}")
    stalling(project, 2)
    project.doit("run", "launch", check=True)
    run_id = project.run_ids()[0]
    project.wait_for(lambda: (far_state(project, run_id).get("plan") or {}).get("after") == "stalled", timeout=60,
                     what="the stall declared and a restart planned")
    status = project.doit("status", check=True)
    assert f"{run_id}: stalled (no output and no event for 2 s (stall_timeout_s)" in status.stdout, status.stdout
    assert re.search(r"stalled; will restart from its latest checkpoint in \d s \(attempt 2 of 3\)", status.stdout), \
        status.stdout
    assert re.search(r"heartbeat_age_s +\d", status.stdout) and re.search(r"output_age_s +\d", status.stdout), \
        status.stdout  # both ages: the launcher lives, the trainer went quiet

    # the final `exit` event, not state.json's `final`: the launcher writes the state a moment before the event
    project.wait_for(lambda: any(e.get("final") for e in exits(project, run_id)), timeout=120,
                     what="the restarted run to end")
    first, second = exits(project, run_id)
    assert (first["status"], first["final"], first["reason"]) == \
        ("stalled", False, "no output and no event for 2 s (stall_timeout_s)"), first
    quiet_from = max(e["t"] for e in project.events(run_id) if e.get("event") == "launch" and e["attempt"] == 1)
    limit = [e for e in project.events(run_id) if e.get("event") == "limit"]
    assert len(limit) == 1 and limit[0]["status"] == "stalled" and limit[0]["t"] - quiet_from >= 2, limit
    assert second["status"] == "completed" and launches(project, run_id) == 2
    assert_resumed_at(project, run_id, 10, 30)
    done = project.doit("run", "train", timeout=120)
    assert done.returncode == 0 and launches(project, run_id) == 2, out(done)
    assert pulled_weights(project, run_id) == expected_weights(30)


def test_max_wall_seconds_ends_a_run_with_nobody_watching(job):
    project = job(steps=2000, restart=RESTARTS)
    add_config(project, "max_wall_seconds: 3\n")
    project.doit("run", "launch", check=True)
    run_id = project.run_ids()[0]
    project.wait_for(lambda: far_state(project, run_id).get("final"), timeout=60, what="the wall time to end it")
    state = far_state(project, run_id)
    assert (state["status"], state["reason"], state["attempt"]) == ("stopped", "wall time exceeded", 1), state
    assert 3 <= state["ended_at"] - state["wall_since"] < 3 + 5 + 5, state  # the limit, plus grace and a poll
    assert printed_step(project, run_id) < 2000 and launches(project, run_id) == 1  # ended, never restarted
    status = project.doit("status", check=True)
    assert f"{run_id}: stopped (wall time exceeded" in status.stdout, status.stdout
    project.doit("pull", "verify", check=True)  # what it saved is sealed and comes home verified
    assert (project.local_run(run_id) / "files" / "checkpoints" / "ckpt.json").is_file()


def test_a_stop_during_the_backoff_ends_the_run_and_no_attempt_follows(job):
    project = job(steps=60, restart="{policy: on-preempt, max_restarts: 2, backoff_s: 60}")
    project.doit("run", "launch", check=True)
    run_id = project.run_ids()[0]
    project.wait_for(lambda: printed_step(project, run_id) >= 12, what="step 12")
    os.kill(int(far_state(project, run_id)["pgid"]), signal.SIGTERM)
    project.wait_for(lambda: far_state(project, run_id).get("plan"), timeout=30, what="the restart planned")
    again = project.doit("run", "launch")  # a second laptop: the far side handles it, nothing is started
    assert again.returncode == 0 and "launched" not in again.stdout and launches(project, run_id) == 1, out(again)
    stopped = project.doit("stop", timeout=60)
    assert stopped.returncode == 0 and f"{run_id}: stopped" in stopped.stdout, out(stopped)
    state = far_state(project, run_id)
    assert (state["status"], state["final"], state["plan"]) == ("stopped", True, None), state
    assert launches(project, run_id) == 1 and (project.remote_run(run_id) / "PULL_MANIFEST.json").exists()
    project.doit("pull", "verify", check=True)  # the exit event landed before the seal: verify holds


# ---------------------------------------------------------------- notifications, sent by the far side


def secret_in_any_command_line(secret: str) -> list[str]:
    found = []
    for path in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if secret.encode() in path.read_bytes():
                found.append(path.parent.name)
        except OSError:
            continue
    return found


def test_notifications_reach_a_webhook_once_each_with_the_secret_from_a_0600_file(job, tmp_path):
    secret = "Bearer s3cr3t-" + os.urandom(6).hex()
    token = tmp_path / "hook-token"
    token.write_text(secret + "\n")
    token.chmod(0o600)
    hook = Hook()
    try:
        project = job(steps=40, restart=RESTARTS)
        add_config(project, f"notify:\n  webhook: {hook.url}\n  headers: {{Authorization: {{file: {token}}}}}\n")
        run_id = preempt_with_nobody_watching(project, steps=40)
        assert secret_in_any_command_line(secret) == []  # never on a command line, not even while sending
        project.wait_for(lambda: len(hook.bodies()) >= 2, timeout=30, what="two notifications")
        got = hook.bodies()
        assert [b["event"] for b in got] == ["restarted", "completed"], got  # once each, in order
        assert all(r["headers"].get("Authorization") == secret for r in hook.requests), hook.requests
        done = got[1]
        assert (done["run_id"], done["state"], done["attempt"]) == (run_id, "completed", 2), done
        assert done["where"].endswith(":" + str(project.remote_run(run_id))), done
        status = project.doit("status", check=True)
        assert re.search(r"notified completed at \d\d:\d\d \(webhook\)", status.stdout), status.stdout
        assert secret not in status.stdout + json.dumps(far_state(project, run_id))
        done = project.doit("run", "train", timeout=180)  # notify.json is private: verify still holds
        assert done.returncode == 0 and len(hook.bodies()) == 2, out(done)
    finally:
        hook.close()


def test_a_dead_webhook_never_fails_a_run(project, dead_url):
    use_script(project, steps=20)  # local only: the retries take their 15 s whatever the transport
    add_config(project, f"notify:\n  webhook: {dead_url}\n  command: echo \"$TETHER_NOTIFY_EVENT\" >> ../../notes\n")
    done = project.doit("run", "train", timeout=180)  # while the far side still retries the webhook
    assert done.returncode == 0, out(done)
    run_id = project.run_ids()[0]
    assert far_state(project, run_id)["status"] == "completed"
    assert (project.local_run(run_id) / "PULL_VERIFIED.json").is_file()
    project.wait_for(lambda: notify.notified(str(project.remote_run(run_id))), timeout=30, what="the command's outcome")
    records = {r["to"]: r for r in notify.notified(str(project.remote_run(run_id)))}
    assert records["command"]["ok"] is True and not records.get("webhook", {}).get("ok"), records
    assert (project.remote_run(run_id).parent.parent / "notes").read_text() == "completed\n"
    # (the webhook's own record, after its retries, is tests/test_notify.py's: a dead one is recorded ok false)


# ---------------------------------------------------------------- the rented box's idle stop, from the launcher


def with_idle_stop(text: str, marker: Path) -> str:
    """`text` whose backend stops "the box" (appends to `marker`, never a real shutdown) 2 s after its last read."""
    stop = f"idle_stop: {{after_s: 2, command: 'echo stopped >> {marker}'}}, "
    backends = text.index("\nbackends:\n")
    text = text[:backends] + re.sub(r"^(  \w+: \{)", lambda m: m.group(1) + stop, text[backends:], count=1, flags=re.M)
    assert "idle_stop" in text, text
    ack = '"is below 60 s"'
    return text.replace("  acknowledge: [", f"  acknowledge: [{ack}, ") if "  acknowledge: [" in text \
        else text + f"validation: {{acknowledge: [{ack}]}}\n"


def assert_the_box_stops_once_after_the_run_idles(project, run_id: str, marker: Path) -> None:
    assert not marker.exists()  # the run went, then was pulled: never stopped meanwhile
    record = project.remote_run(run_id) / "idle.json"
    project.wait_for(lambda: marker.exists() and json.loads(record.read_text()).get("exit_code") is not None,
                     timeout=30, what="the idle stop, and its outcome recorded")
    idle = json.loads(record.read_text())
    assert idle["exit_code"] == 0 and idle["ran_at"] >= far_state(project, run_id)["ended_at"] + 2, idle
    status = project.doit("status", check=True)
    assert re.search(r"idle stop ran at \d\d:\d\d \(exit code 0\)", status.stdout), status.stdout
    assert marker.read_text() == "stopped\n"  # once, and a later read never runs it again
    assert project.doit("pull", "verify", check=True).returncode == 0  # the sealed files are untouched


def test_idle_stop_runs_once_after_the_sealed_run_idles(job, tmp_path):
    project = job(steps=20)
    marker = tmp_path / "box-stopped"
    (project.root / "tether.yaml").write_text(with_idle_stop((project.root / "tether.yaml").read_text(), marker))
    done = project.doit("run", "train", timeout=180)
    assert done.returncode == 0, out(done)
    assert_the_box_stops_once_after_the_run_idles(project, project.run_ids()[0], marker)


# ---------------------------------------------------------------- SLURM: the same policy through requeue


def test_slurm_a_stalled_job_is_requeued_once_and_resumes(project, cluster, remote):
    far = slurm_script_job(project, cluster, remote, steps=30, restart=RESTARTS)
    stalling(far, 3)
    done = far.doit("run", "train", timeout=240)
    assert done.returncode == 0, out(done)
    run_id = far.run_ids()[0]
    first, second = exits(far, run_id)
    assert (first["status"], first["final"]) == ("stalled", False) and second["status"] == "completed", (first, second)
    jobs = slurm_jobs(far, run_id)
    assert len(jobs) == 1, f"not requeued by the job itself ({jobs})"
    fields = dict(w.partition("=")[::2] for w in cluster.run("scontrol", "show", "job", "-o", jobs[0]).split())
    assert (fields["Restarts"], fields["JobState"]) == ("1", "COMPLETED"), fields
    assert launches(far, run_id) == 2 and kept_step(far, run_id) == 30
    assert_resumed_at(far, run_id, 10, 30)
    assert pulled_weights(far, run_id) == expected_weights(30)
