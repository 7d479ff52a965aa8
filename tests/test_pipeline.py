"""The pipeline end to end on the local backend, with real processes and real signals (no mocks).

Interruptions: SIGKILL of the whole doit process group at each phase boundary, in the middle of
watch and in the middle of pull; Ctrl-C (SIGINT to the group) and SIGTERM during watch. Safety:
a corrupted pulled file, and `down` refused until the results here are verified. `doit stop` on
a trainer with children, run identity (what mints a new run), the `tether` command, and a
trainer that fails. The last section holds what these tests found missing: watch handing over
to pull before the far side sealed its manifest, a launcher killed before sealing, a half-built
code snapshot, and `down` trusting file timestamps.

Every wait polls a condition (`project.wait_for`, or `poll` for windows of milliseconds); nothing
sleeps a fixed time.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
from pathlib import Path

import pytest

from conftest import config_text
from helpers import Background, alive, poll, sha256


def use_trainer(project, name: str, source: str, artifacts: str, grace: int = 5) -> None:
    """Put a trainer script into the project and point tether.yaml at it."""
    (project.root / "demo" / name).write_text(source)
    project.write_config(config_text(command="{python} demo/" + name, code="demo/" + name, artifacts=artifacts,
                                     grace=grace))


# ---------------------------------------------------------------- helpers


def start(project, *args: str) -> Background:
    return Background(project.start(*args))


def only_run_id(project) -> str:
    """The one run id here; and the far side, where it has any, holds that run and no other."""
    ids = project.run_ids()
    assert len(ids) == 1, f"expected exactly one run, found {ids}"
    folder = project.root / ".tether" / "remote" / "runs"
    far = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
    assert far in ([], ids), f"local runs {ids} but far-side runs {far}"
    return ids[0]


def launches(project, run_id: str) -> int:
    return sum(1 for e in project.events(run_id) if e.get("event") == "launch")


def far_state(project, run_id: str) -> dict:
    path = project.remote_run(run_id) / "state.json"
    return json.loads(path.read_text()) if path.exists() else {}


def far_listing(project, run_id: str) -> dict[str, str]:
    """Every file of the far-side run dir and its SHA-256 (to prove a refused `down` left it intact)."""
    root = project.remote_run(run_id)
    return {str(p.relative_to(root)): sha256(p) for p in sorted(root.rglob("*")) if p.is_file()}


def assert_verified(project, run_id: str, artifacts=("model.json", "metrics.json")) -> dict:
    """PULL_VERIFIED.json is there, matches the far side's manifest, and every listed file is intact here."""
    local = project.local_run(run_id)
    far_bytes = (project.remote_run(run_id) / "PULL_MANIFEST.json").read_bytes()
    far = json.loads(far_bytes)
    verified = json.loads((local / "PULL_VERIFIED.json").read_text())
    assert verified["manifest_sha256"] == hashlib.sha256(far_bytes).hexdigest()
    listed = {e["path"]: e for e in far["files"]}
    assert set(verified["files"]) == set(listed)
    for name in artifacts:
        assert f"artifacts/{name}" in listed, f"{name} is not in the manifest: {sorted(listed)}"
    assert far["missing"] == []
    for path, entry in listed.items():
        pulled = local / "files" / path
        assert pulled.stat().st_size == entry["bytes"], path
        assert sha256(pulled) == entry["sha256"], path
    leftovers = [str(p) for p in (local / "files").rglob("*") if p.name.endswith(".part")]
    assert leftovers == [], leftovers
    return verified


def steps(project, run_id: str | None = None) -> int:
    if not project.run_ids():
        return 0
    return sum(1 for e in project.events(run_id) if e.get("event") == "step")


def stamp(project, phase: str) -> bool:
    """Whether the phase's stamp is written (up's belongs to the backend, the others to the run)."""
    if phase == "up":
        return any((project.root / ".tether" / "backends").glob("local-*.json"))
    return bool(project.run_ids()) and (project.local_run() / f"{phase}.json").exists()


def processes_of_run(run_id: str, run_dir: Path, pgid: int) -> list[str]:
    """Live processes that belong to the run: its trainer's group, its environment, or its launcher."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if stat[0] == "Z":
                continue
            environ = (entry / "environ").read_bytes().split(b"\0")
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if (int(stat[2]) == pgid or f"TETHER_RUN_ID={run_id}".encode() in environ
                or str(run_dir).encode() in cmdline):
            found.append(f"{entry.name}: {cmdline.decode(errors='replace')}")
    return found


# ---------------------------------------------------------------- SIGKILL anywhere, then the same command


def _kill_when(project, proc: Background, condition, what: str, may_finish: bool = False) -> None:
    """SIGKILL doit's whole process group (not the detached launcher) once `condition` holds.

    `may_finish`: the command may have ended by itself (successfully) just as the condition came true.
    """
    try:
        poll(lambda: condition() or proc.proc.poll() is not None, timeout=90, what=what, interval=0.002)
    finally:
        ended = proc.proc.poll()
        try:
            proc.killpg(signal.SIGKILL)
        except ProcessLookupError:
            pass
        code = proc.finish()
    output = proc.text("stdout") + proc.text("stderr")
    if may_finish and ended == 0:
        return
    assert ended is None, f"doit ended by itself (exit {ended}) before {what}:\n{output}"
    assert code == -signal.SIGKILL, output


def _rerun_completes(project, run_id: str | None, artifacts=("model.json", "metrics.json")) -> None:
    """`doit run train` again finishes run `run_id` (None: the one it makes), launched once, verified."""
    again = project.doit("run", "train", timeout=120)
    assert again.returncode == 0, again.stdout + again.stderr
    run_id = run_id or only_run_id(project)
    assert only_run_id(project) == run_id and project.remote_run(run_id).is_dir()
    assert launches(project, run_id) == 1, [e for e in project.events(run_id) if e.get("event") == "launch"]
    assert far_state(project, run_id)["status"] == "completed"
    assert_verified(project, run_id, artifacts)
    # and now everything is up to date
    third = project.doit("run", "train", check=True)
    assert ".  " not in third.stdout, third.stdout


@pytest.mark.parametrize("boundary", ["run.json", "up.json", "push.json", "launcher-started", "launch.json"])
def test_sigkill_at_each_phase_boundary_then_train_completes(project, boundary):
    def reached() -> bool:
        if boundary == "up.json":  # up belongs to the backend: no run exists yet
            return stamp(project, "up")
        if not project.run_ids():
            return False
        if boundary == "launcher-started":  # the far side holds a run, launch.json is not written yet
            return far_state(project, project.run_ids()[-1]).get("status") == "running"
        if boundary == "run.json":
            return (project.local_run() / boundary).exists()
        return stamp(project, boundary.removesuffix(".json"))

    proc = start(project, "run", "train")
    _kill_when(project, proc, reached, boundary)
    if boundary == "up.json" and not project.run_ids():  # killed before push recorded the run
        _rerun_completes(project, None)
        return
    run_id = only_run_id(project)
    assert not (project.local_run(run_id) / "PULL_VERIFIED.json").exists(), "killed too late to test anything"
    assert launches(project, run_id) <= 1
    _rerun_completes(project, run_id)


def test_sigkill_during_separate_phase_commands(project):
    """`doit run up`, `doit run push`, `doit run launch` one by one, each SIGKILLed at its own stamp."""
    for phase in ("up", "push", "launch"):
        proc = start(project, "run", phase)
        _kill_when(project, proc, lambda: stamp(project, phase), f"{phase}.json", may_finish=True)
        # the same command again is complete and up to date, or finishes the job
        again = project.doit("run", phase)
        assert again.returncode == 0, again.stdout + again.stderr
    run_id = only_run_id(project)
    assert launches(project, run_id) == 1
    _rerun_completes(project, run_id)


def test_sigkill_during_watch_then_train_completes(project):
    project.write_config(epochs=600)
    proc = start(project, "run", "train")
    _kill_when(project, proc, lambda: stamp(project, "launch") and steps(project) > 0, "step events")
    run_id = only_run_id(project)
    assert not (project.local_run(run_id) / "watch.json").exists()
    _rerun_completes(project, run_id)


BIG = """\
import os
from tether.trainers import runtime

out = os.environ["TETHER_ARTIFACTS_DIR"]
block = os.urandom(1 << 20)
with open(os.path.join(out, "big.bin"), "wb") as f:
    for i in range(200):  # 200 MiB, every MiB different
        f.write(i.to_bytes(4, "big") + block[4:])
        runtime.log("step", step=i + 1, total_steps=200, loss=0.5)
with open(os.path.join(out, "model.json"), "w") as f:
    f.write('{"w": [1, 2]}')
"""


def test_sigkill_during_pull_resumes_the_partial_file(project):
    use_trainer(project, "big.py", BIG, "big.bin, model.json")
    project.doit("run", "launch", check=True)
    run_id = only_run_id(project)
    project.wait_for(lambda: (project.remote_run(run_id) / "PULL_MANIFEST.json").exists(), what="the seal")
    big_part = project.local_run(run_id) / "files" / "artifacts" / "big.bin.part"

    def mid_pull() -> bool:
        try:
            return big_part.stat().st_size > 0
        except FileNotFoundError:
            return False

    proc = start(project, "run", "train")
    _kill_when(project, proc, mid_pull, "a partial big.bin.part")
    partial = big_part.stat().st_size
    assert 0 < partial < 200 << 20, f"the pull was not caught in the middle ({partial} bytes)"
    assert not (project.local_run(run_id) / "PULL_VERIFIED.json").exists()
    inode = big_part.stat().st_ino
    _rerun_completes(project, run_id, artifacts=("big.bin", "model.json"))
    # the partial file was continued (the same file, appended to), not fetched again from zero
    assert (project.local_run(run_id) / "files" / "artifacts" / "big.bin").stat().st_ino == inode


# ---------------------------------------------------------------- Ctrl-C and SIGTERM leave the run going


@pytest.mark.parametrize("how", ["SIGINT to the process group", "SIGTERM to doit"])
def test_interrupt_during_watch_leaves_the_run_going(project, how):
    project.write_config(epochs=1000)
    proc = start(project, "run", "train")
    project.wait_for(lambda: "train:" in proc.text("stderr") and steps(project) > 0, timeout=60,
                     what="watch showing progress")
    run_id = only_run_id(project)
    if how.startswith("SIGINT"):
        proc.killpg(signal.SIGINT)  # Ctrl-C: the terminal signals the whole foreground group
    else:
        proc.proc.send_signal(signal.SIGTERM)
    code = proc.finish(timeout=30)
    message = proc.text("stdout") + proc.text("stderr")
    assert code != 0, message
    assert "interrupted" in message and f"doit status run={run_id}" in message, message
    assert "again" in message, message  # how to resume
    assert "Traceback" not in message, message
    assert not (project.local_run(run_id) / "watch.json").exists()

    # the run goes on without doit
    seen = steps(project, run_id)
    project.wait_for(lambda: steps(project, run_id) > seen + 100, timeout=30, what="the run progressing")
    status = project.doit("status", f"run={run_id}")
    assert status.returncode == 0, status.stdout + status.stderr
    assert f"{run_id}: running" in status.stdout, status.stdout

    # the same command reattaches (no second launch) and completes
    again = project.doit("run", "train", timeout=120)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "-- launch" in again.stdout and ".  watch" in again.stdout, again.stdout
    assert launches(project, run_id) == 1
    assert far_state(project, run_id)["status"] == "completed"
    assert_verified(project, run_id)
    done = project.doit("status", f"run={run_id}", check=True)
    assert f"{run_id}: completed" in done.stdout


# ---------------------------------------------------------------- a corrupted pulled file


def test_flipped_byte_fails_verify_blocks_down_and_pull_repairs_it(project):
    project.doit("run", "train", check=True)
    run_id = only_run_id(project)
    pulled = project.local_run(run_id) / "files" / "artifacts" / "model.json"
    original = pulled.read_bytes()
    corrupt = bytearray(original)
    corrupt[len(corrupt) // 2] ^= 0x01
    pulled.write_bytes(bytes(corrupt))
    far_before = far_listing(project, run_id)

    refused = project.doit("run", "down", "confirm=yes")
    assert refused.returncode != 0, refused.stdout + refused.stderr
    assert "artifacts/model.json" in refused.stderr, refused.stderr
    assert far_listing(project, run_id) == far_before

    failed = project.doit("run", "verify")
    assert failed.returncode != 0, failed.stdout + failed.stderr
    assert "artifacts/model.json" in failed.stderr, failed.stderr
    assert "metrics.json" not in failed.stderr  # only the broken file is named
    assert not (project.local_run(run_id) / "PULL_VERIFIED.json").exists()
    refused = project.doit("run", "down", "confirm=yes")
    assert refused.returncode != 0, refused.stdout + refused.stderr
    assert far_listing(project, run_id) == far_before

    repaired = project.doit("run", "pull", check=True)
    assert "pulled 1 of" in repaired.stdout, repaired.stdout  # only the broken file travels again
    assert pulled.read_bytes() == original
    project.doit("run", "verify", check=True)
    assert_verified(project, run_id)

    # `train` (pull, then verify) repairs it the same way
    pulled.write_bytes(bytes(corrupt))
    train = project.doit("run", "train", check=True)
    assert "pulled 1 of" in train.stdout, train.stdout
    assert pulled.read_bytes() == original
    assert_verified(project, run_id)
    assert launches(project, run_id) == 1


# ---------------------------------------------------------------- down


def test_down_is_refused_until_verified_then_removes_once(project):
    project.write_config(epochs=60)
    project.doit("run", "launch", check=True)  # launched, never watched or pulled
    run_id = only_run_id(project)
    project.wait_for(lambda: far_state(project, run_id).get("status") == "completed"
                     and (project.remote_run(run_id) / "PULL_MANIFEST.json").exists(), what="the run to end")
    far_before = far_listing(project, run_id)
    for args in (("run", "down", "confirm=yes"), ("-s", "down", "confirm=yes"),
                 ("run", "--always-execute", "down", "confirm=yes"), ("run", "down")):
        refused = project.doit(*args)
        assert refused.returncode != 0, (args, refused.stdout, refused.stderr)
        assert "refusing" in refused.stderr and "not verified" in refused.stderr, (args, refused.stderr)
        assert far_listing(project, run_id) == far_before, args
        assert not (project.local_run(run_id) / "down.json").exists()

    project.doit("run", "train", check=True)
    assert_verified(project, run_id)
    unconfirmed = project.doit("run", "down")
    assert unconfirmed.returncode != 0, unconfirmed.stdout + unconfirmed.stderr
    assert "confirm=yes" in unconfirmed.stderr, unconfirmed.stderr
    assert far_listing(project, run_id) == far_before

    removed = project.doit("run", "down", "confirm=yes")
    assert removed.returncode == 0, removed.stdout + removed.stderr
    assert not project.remote_run(run_id).exists()
    assert (project.local_run(run_id) / "down.json").exists()
    kept = json.loads((project.local_run(run_id) / "PULL_VERIFIED.json").read_text())
    for path in kept["files"]:
        assert (project.local_run(run_id) / "files" / path).is_file(), path

    again = project.doit("run", "down", "confirm=yes")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "already removed" in again.stdout, again.stdout

    # a torn-down run is finished business: train does not launch it again
    train = project.doit("run", "train")
    assert train.returncode == 0, train.stdout + train.stderr
    assert ".  launch" not in train.stdout, train.stdout
    assert not project.remote_run(run_id).exists()


# ---------------------------------------------------------------- stop


SPAWNER = """\
import multiprocessing
import subprocess
import sys
import time

from tether.trainers import runtime


def work():
    while True:
        time.sleep(1)


if __name__ == "__main__":
    kids = [subprocess.Popen(["sleep", "1000"]) for _ in range(2)]
    stubborn = subprocess.Popen([sys.executable, "-c", "import signal, time; "
                                 "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(1000)"])
    workers = [multiprocessing.get_context("fork").Process(target=work) for _ in range(2)]
    for w in workers:
        w.start()
    runtime.log("children", pids=[k.pid for k in kids] + [stubborn.pid] + [w.pid for w in workers])
    step = 0
    while True:
        step += 1
        runtime.log("step", step=step, total_steps=10 ** 9, loss=1.0)
        time.sleep(0.05)
"""


def test_stop_ends_the_trainer_and_all_its_children(project):
    use_trainer(project, "spawner.py", SPAWNER, "model.json", grace=1)
    project.doit("run", "launch", check=True)
    run_id = only_run_id(project)
    project.wait_for(lambda: any(e.get("event") == "children" for e in project.events(run_id))
                     and steps(project, run_id) >= 2, what="the trainer's children and steps")
    state = far_state(project, run_id)
    children = next(e for e in project.events(run_id) if e.get("event") == "children")["pids"]
    pids = [state["pid"], state["pgid"], *children]
    assert len(children) == 5 and all(alive(p) for p in pids)
    run_dir = project.remote_run(run_id)
    assert processes_of_run(run_id, run_dir, state["pgid"])  # the scan does see the run

    stopped = project.doit("stop")
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert f"{run_id}: stopped" in stopped.stdout, stopped.stdout
    assert [p for p in pids if alive(p)] == []
    assert processes_of_run(run_id, run_dir, state["pgid"]) == []
    assert far_state(project, run_id)["status"] == "stopped"
    assert (run_dir / "PULL_MANIFEST.json").exists()  # sealed: its files can come home

    again = project.doit("stop")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "was not running" in again.stdout, again.stdout


def test_stop_on_a_finished_run_says_it_was_not_running(project):
    project.doit("run", "train", check=True)
    run_id = only_run_id(project)
    before = far_listing(project, run_id)
    stopped = project.doit("stop")
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert f"{run_id}: was not running" in stopped.stdout, stopped.stdout
    assert far_state(project, run_id)["status"] == "completed"
    assert far_listing(project, run_id) == before


# ---------------------------------------------------------------- what is a new run


def test_run_identity_trainer_edit_mints_artifacts_edit_does_not(project):
    project.doit("run", "train", check=True)
    first = only_run_id(project)
    steps_30 = json.loads((project.local_run(first) / "files" / "artifacts" / "metrics.json").read_text())["steps"]

    same = project.doit("run", "train", check=True)
    assert ".  " not in same.stdout, same.stdout
    assert project.run_ids() == [first]

    text = (project.root / "tether.yaml").read_text()
    edited = text.replace("artifacts: [model.json, metrics.json]",
                          "artifacts: [model.json, metrics.json, '*.txt']")
    assert edited != text
    project.write_config(edited)
    after_artifacts = project.doit("run", "train", check=True)
    assert project.run_ids() == [first]
    assert ".  launch" not in after_artifacts.stdout, after_artifacts.stdout
    assert launches(project, first) == 1

    project.write_config(epochs=31)
    minted = project.doit("run", "train", check=True)
    ids = project.run_ids()
    assert len(ids) == 2 and first in ids, ids
    second = next(i for i in ids if i != first)
    assert ".  launch" in minted.stdout and second in minted.stdout
    assert launches(project, first) == 1 and launches(project, second) == 1
    assert_verified(project, second)
    metrics = json.loads((project.local_run(second) / "files" / "artifacts" / "metrics.json").read_text())
    assert metrics["steps"] == steps_30 // 30 * 31  # the new run really trained 31 epochs
    assert project.remote_run(first).is_dir()

    # back to the first config: its run is found again and up to date
    project.write_config(epochs=30)
    back = project.doit("run", "train", check=True)
    assert ".  " not in back.stdout, back.stdout
    assert sorted(project.run_ids()) == sorted(ids)


# ---------------------------------------------------------------- the tether command


def test_tether_cli_train_is_doit_run_train(project):
    done = project.tether("train")
    assert done.returncode == 0, done.stdout + done.stderr
    for phase in ("up", "push", "launch", "watch", "train"):
        assert f".  {phase}\n" in done.stdout, done.stdout
    run_id = only_run_id(project)
    assert launches(project, run_id) == 1
    assert_verified(project, run_id)
    assert far_state(project, run_id)["status"] == "completed"
    # the same state and dependency file as doit: each sees the other's work as done
    by_doit = project.doit("run", "train", check=True)
    assert ".  " not in by_doit.stdout and by_doit.stdout.count("-- ") == 5, by_doit.stdout
    again = project.tether("train")
    assert again.returncode == 0 and ".  " not in again.stdout, again.stdout + again.stderr


# ---------------------------------------------------------------- a failing run


FAILING = """\
import sys
from tether.trainers import runtime

runtime.log("step", step=1, total_steps=10, loss=2.5)
print("loading shard 7 of 9")
print("fatal: loss is NaN at step 1 (marker 31337)", flush=True)
sys.exit(3)
"""


def test_failed_run_reports_the_log_and_still_pulls(project):
    use_trainer(project, "failing.py", FAILING, "model.json")
    failed = project.doit("run", "train", timeout=120)
    assert failed.returncode != 0, failed.stdout + failed.stderr
    assert "fatal: loss is NaN at step 1 (marker 31337)" in failed.stderr, failed.stderr
    assert "loading shard 7 of 9" in failed.stderr
    assert "exit code 3" in failed.stderr, failed.stderr
    run_id = only_run_id(project)
    assert far_state(project, run_id)["status"] == "failed"
    assert far_state(project, run_id)["exit_code"] == 3
    assert not (project.local_run(run_id) / "PULL_VERIFIED.json").exists()

    pulled = project.doit("pull")
    assert pulled.returncode == 0, pulled.stdout + pulled.stderr
    log = project.local_run(run_id) / "files" / "train.log"
    assert "marker 31337" in log.read_text()
    assert json.loads((project.local_run(run_id) / "files" / "state.json").read_text())["status"] == "failed"
    assert "model.json" in pulled.stdout  # the declared artifact it never wrote is named

    # running train again does not launch the failed run a second time, and still says why
    again = project.doit("run", "train", timeout=120)
    assert again.returncode != 0 and "marker 31337" in again.stderr, again.stdout + again.stderr
    assert launches(project, run_id) == 1


# ---------------------------------------------------------------- gaps found while writing these tests


def probes_sent(proc: Background) -> int:
    """How many `probe` requests the background doit has sent to the far side's serve process so far
    (watch polls with them; TETHER_TRACE=1 names each request on stderr as it is sent)."""
    return len(re.findall(r"\[far [^\]\n]*\] probe\b", proc.text("stderr")))  # a progress bar may precede one


def test_watch_waits_for_the_seal_before_pull(project, monkeypatch):
    """The launcher records the run as completed, then hashes its files into PULL_MANIFEST.json (for a
    200 MiB artifact, a moment). The launcher is paused (SIGSTOP) in exactly that gap, standing for a
    slow disk: watch must keep waiting (polls seen) instead of handing over to a pull that fails."""
    use_trainer(project, "big.py", BIG, "big.bin, model.json")
    monkeypatch.setenv("TETHER_TRACE", "1")  # every far-side request on doit's stderr: the polls are counted there
    proc = start(project, "run", "train")

    def unsealed() -> bool:
        if not project.run_ids() or proc.proc.poll() is not None:
            return proc.proc.poll() is not None
        run_dir = project.remote_run()
        return (far_state(project, run_dir.name).get("status") == "completed"
                and not (run_dir / "PULL_MANIFEST.json").exists())

    poll(unsealed, timeout=90, what="the run completed but not sealed yet")
    assert proc.proc.poll() is None, proc.text("stdout") + proc.text("stderr")
    run_id = only_run_id(project)
    run_dir = project.remote_run(run_id)
    launcher = far_state(project, run_id)["pid"]
    os.kill(launcher, signal.SIGSTOP)
    try:
        assert not (run_dir / "PULL_MANIFEST.json").exists(), "sealed before the launcher could be paused"
        before = probes_sent(proc)

        def polls_or_exit() -> bool:  # a pull that gives up probes once too: four polls prove watch waits
            return probes_sent(proc) - before >= 4 or proc.proc.poll() is not None

        project.wait_for(polls_or_exit, timeout=60, what="watch polling the unsealed run")
        assert proc.proc.poll() is None, ("doit left watch while the run was completed but not sealed:\n"
                                          + proc.text("stdout") + proc.text("stderr"))
    finally:
        os.kill(launcher, signal.SIGCONT)
    assert proc.finish(timeout=120) == 0, ("train failed after the seal gap:\n"
                                           + proc.text("stdout") + proc.text("stderr"))
    assert launches(project, run_id) == 1
    assert_verified(project, run_id, artifacts=("big.bin", "model.json"))


def test_launcher_killed_before_the_seal_still_comes_home(project):
    """The far side's launcher SIGKILLed after it recorded `completed` and before PULL_MANIFEST.json:
    every result is on the far side, so the same `train` must seal and bring them home, not fail for good."""
    use_trainer(project, "big.py", BIG, "big.bin, model.json")
    project.doit("run", "launch", check=True)
    run_id = only_run_id(project)
    run_dir = project.remote_run(run_id)
    poll(lambda: far_state(project, run_id).get("status") == "completed"
         or (run_dir / "PULL_MANIFEST.json").exists(), timeout=90, what="the run to complete")
    os.kill(far_state(project, run_id)["pid"], signal.SIGKILL)
    assert not (run_dir / "PULL_MANIFEST.json").exists(), "sealed before the launcher could be killed"
    project.wait_for(lambda: not processes_of_run(run_id, run_dir, far_state(project, run_id)["pgid"]),
                     what="the launcher to be gone")

    again = project.doit("run", "train", timeout=60)
    assert again.returncode == 0, again.stdout + again.stderr
    assert launches(project, run_id) == 1
    assert_verified(project, run_id, artifacts=("big.bin", "model.json"))


def test_sigkill_while_the_code_snapshot_is_half_built(project):
    """push builds code/ then data/ on the far side; killed in between, the same command must still
    give the run its data (not launch it without, to fail for good)."""
    many = project.root / "demo" / "many"
    many.mkdir()
    for i in range(1000):  # enough files that linking data/ takes a moment
        (many / f"part-{i:04d}.txt").write_text(f"{i}\n")
    text = (project.root / "tether.yaml").read_text()
    project.write_config(text.replace("paths: [demo/points.csv]", "paths: [demo/points.csv, demo/many]"))
    proc = start(project, "run", "train")

    def half_built() -> bool:
        if proc.proc.poll() is not None:
            return True
        if not project.run_ids():
            return False
        run_dir = project.remote_run()
        return (run_dir / "code").is_dir() and not (run_dir / "data").is_dir()

    try:
        poll(half_built, timeout=90, what="code/ built and data/ not yet")
        assert proc.proc.poll() is None, proc.text("stdout") + proc.text("stderr")
    finally:
        proc.killpg(signal.SIGKILL)
        proc.finish()
    run_id = only_run_id(project)
    again = project.doit("run", "train", timeout=120)
    assert again.returncode == 0, again.stdout + again.stderr
    assert (project.remote_run(run_id) / "data" / "demo" / "points.csv").is_file()
    assert (project.remote_run(run_id) / "data" / "demo" / "many" / "part-0999.txt").read_text() == "999\n"
    assert launches(project, run_id) == 1
    assert_verified(project, run_id)


def test_down_rehashes_a_file_changed_behind_its_timestamp(project):
    """Bit rot (or a tool that restores mtimes) leaves size and mtime as they were: down must still refuse."""
    project.doit("run", "train", check=True)
    run_id = only_run_id(project)
    pulled = project.local_run(run_id) / "files" / "artifacts" / "model.json"
    before = pulled.stat()
    corrupt = bytearray(pulled.read_bytes())
    corrupt[len(corrupt) // 2] ^= 0x01
    pulled.write_bytes(bytes(corrupt))
    os.utime(pulled, ns=(before.st_atime_ns, before.st_mtime_ns))
    far_before = far_listing(project, run_id)

    refused = project.doit("run", "down", "confirm=yes")
    assert refused.returncode != 0, refused.stdout + refused.stderr
    assert "artifacts/model.json" in refused.stderr, refused.stderr
    assert far_listing(project, run_id) == far_before
