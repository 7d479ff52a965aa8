"""A script's own checkpoint folders (Hugging Face's `outputs/checkpoint-<step>/`), kept, sealed, pulled and resumed.

The trainer is written the way public scripts are: no tether import, a relative output folder,
its own `--resume_from_checkpoint PATH`. It is deterministic, so a resumed run's weights can be
compared with an uninterrupted run of the same script outside tether. Real processes throughout.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import config_text, ssh_config_text
from helpers import stop_leftover_runs
from tether.config import load
from tether.errors import ConfigError
from tether.manifest import content_problem
from tether.remote import launcher

HF_STYLE = """\
import argparse, json, os, signal, struct, time

parser = argparse.ArgumentParser()
parser.add_argument("--max_steps", type=int, default=12)
parser.add_argument("--save_steps", type=int, default=3)
parser.add_argument("--output_dir", default="outputs")
parser.add_argument("--resume_from_checkpoint", default=None)
parser.add_argument("--crash_saving", type=int, default=0)  # die half-way through saving this step
parser.add_argument("--hold_at", type=int, default=0)  # after saving this step, wait (to be stopped)
args = parser.parse_args()


def f32(values):  # what a safetensors file holds: the same floats on every attempt
    return list(struct.unpack("<%df" % len(values), struct.pack("<%df" % len(values), *values)))


def save_safetensors(path, weights):  # the real layout: 8-byte header length, JSON header, raw data
    data = struct.pack("<%df" % len(weights), *weights)
    header = json.dumps({"w": {"dtype": "F32", "shape": [len(weights)], "data_offsets": [0, len(data)]}}).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header + data)


def load_safetensors(path):
    with open(path, "rb") as f:
        size = struct.unpack("<Q", f.read(8))[0]
        f.read(size)
        data = f.read()
    return list(struct.unpack("<%df" % (len(data) // 4), data))


step, weights, resumed = 0, f32([1.0, -2.0, 0.5, 3.0]), bool(args.resume_from_checkpoint)
if resumed:
    with open(os.path.join(args.resume_from_checkpoint, "trainer_state.json")) as f:
        step = json.load(f)["global_step"]
    weights = load_safetensors(os.path.join(args.resume_from_checkpoint, "model.safetensors"))
    print("Resuming training from checkpoint %s at step %d" % (args.resume_from_checkpoint, step), flush=True)
while step < args.max_steps:
    step += 1
    weights = f32([w * 0.5 + 0.25 * step for w in weights])
    print({"loss": round(sum(w * w for w in weights), 4), "learning_rate": 0.001, "step": step}, flush=True)
    if step % args.save_steps == 0:
        folder = os.path.join(args.output_dir, "checkpoint-%d" % step)
        os.makedirs(folder, exist_ok=True)
        save_safetensors(os.path.join(folder, "model.safetensors"), weights)
        if step == args.crash_saving and not resumed:
            print("killed while saving %s" % folder, flush=True)
            os._exit(1)
        with open(os.path.join(folder, "trainer_state.json"), "w") as f:  # written last, as the Trainer does
            json.dump({"global_step": step, "resumed": resumed}, f)
        print("Saving model checkpoint to %s" % folder, flush=True)
        if step == args.hold_at and not resumed:
            while True:  # the Trainer does not catch SIGTERM: a signal ends it here
                time.sleep(0.05)
save_safetensors(os.path.join(args.output_dir, "model.safetensors"), weights)
print("Training completed at step %d" % step, flush=True)
"""

RESUME = '  resume_args: ["--resume_from_checkpoint", "{checkpoint}"]\n'


def use_hf(project, args: str = "", keep: int = 3, restart: str = "", checkpoint: str = "outputs/checkpoint-*",
           text: str | None = None) -> None:
    """tether.yaml (`text`, default the local one) runs demo/hf.py with its checkpoint folders mapped."""
    (project.root / "demo" / "hf.py").write_text(HF_STYLE)
    command = f"{{python}} demo/hf.py {args}".strip()
    text = (text or config_text()).replace("paths: [demo/train.py]", "paths: [demo/hf.py]")
    text = text.replace("artifacts: [model.json, metrics.json]", "artifacts: []")
    text = text.replace('  command: "{python} demo/train.py --epochs 30"\n',
                        f'  command: "{command}"\n  checkpoint: {checkpoint}\n' + RESUME)
    text = text.replace("checkpoint: {keep: 3, every: 50}", f"checkpoint: {{keep: {keep}, every: 50}}")
    assert "demo/train.py" not in text and "demo/hf.py" in text, text
    project.write_config(text + (f"restart: {restart}\n" if restart else ""))


def out(done) -> str:
    return f"exit {done.returncode}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def uninterrupted(tmp_path: Path, max_steps: int = 12) -> str:
    """SHA-256 of the final weights of HF_STYLE run straight through, outside tether."""
    folder = tmp_path / "straight"
    folder.mkdir()
    (folder / "hf.py").write_text(HF_STYLE)
    subprocess.run([sys.executable, "hf.py", "--max_steps", str(max_steps)], cwd=folder, check=True,
                   capture_output=True, timeout=60)
    return sha256(folder / "outputs" / "model.safetensors")


def launches(project, run_id: str) -> list[dict]:
    return [e for e in project.events(run_id) if e["event"] == "launch"]


def kept_names(project, run_id: str) -> list[str]:
    return sorted(p.name for p in (project.remote_run(run_id) / "checkpoints").iterdir())


def assert_pulled_and_verified(project, run_id: str, kept: str) -> dict:
    """Every file of the kept folder is in the manifest, pulled byte for byte, and PULL_VERIFIED.json says so."""
    far, local = project.remote_run(run_id), project.local_run(run_id)
    manifest = json.loads((far / "PULL_MANIFEST.json").read_text())
    listed = {e["path"]: e for e in manifest["files"]}
    folder = far / "checkpoints" / kept
    files = sorted(str(p.relative_to(far)) for p in folder.rglob("*") if p.is_file())
    assert files == [f"checkpoints/{kept}/model.safetensors", f"checkpoints/{kept}/trainer_state.json"], files
    assert set(files) <= set(listed) and not manifest["refused"], manifest
    verified = json.loads((local / "PULL_VERIFIED.json").read_text())
    for path in files:
        assert path in verified["files"], path
        assert sha256(local / "files" / path) == listed[path]["sha256"] == sha256(far / path), path
    return manifest


# ---------------------------------------------------------------- local


def test_the_newest_complete_folders_are_kept_sealed_pulled_and_verified(project, tmp_path):
    use_hf(project, keep=2)
    done = project.doit("run", "train", timeout=180)
    assert done.returncode == 0, out(done)
    run_id = project.run_ids()[0]
    assert kept_names(project, run_id) == ["checkpoint-12", "checkpoint-9"]  # keep: 2 of 3, 6, 9, 12
    manifest = assert_pulled_and_verified(project, run_id, "checkpoint-12")
    assert not [e for e in manifest["files"] if "checkpoint-9/" in e["path"]]  # only the newest comes home
    state = json.loads((project.remote_run(run_id) / "state.json").read_text())
    assert state["checkpoint"] == "checkpoints/checkpoint-12"
    kept = [e["path"] for e in project.events(run_id) if e["event"] == "checkpoint_kept"]
    assert kept == ["checkpoints/checkpoint-12"]
    final = project.remote_run(run_id) / "work" / "outputs" / "model.safetensors"
    assert sha256(final) == uninterrupted(tmp_path)


def test_a_folder_half_saved_by_a_crash_is_never_taken_and_the_relaunch_resumes_before_it(project, tmp_path):
    use_hf(project, "--crash_saving 9", restart="{policy: on-failure, max_restarts: 1, backoff_s: 0.5}")
    done = project.doit("run", "train", timeout=180)
    assert done.returncode == 0, out(done)
    run_id = project.run_ids()[0]
    skipped = [(e["path"], e["reason"]) for e in project.events(run_id) if e["event"] == "checkpoint_not_kept"]
    assert skipped == [("outputs/checkpoint-9", "incomplete: no trainer_state.json (Hugging Face's Trainer "
                                                "writes it last)")], skipped
    first, second = launches(project, run_id)
    code = str(project.remote_run(run_id) / "work")
    assert first["resumed_from"] is None and "--resume_from_checkpoint" not in first["argv"]
    assert second["argv"][-2:] == ["--resume_from_checkpoint", f"{code}/outputs/checkpoint-6"], second
    log = (project.remote_run(run_id) / "train.log").read_text()
    assert f"Resuming training from checkpoint {code}/outputs/checkpoint-6 at step 6" in log, log
    assert log.count("{'loss'") == 9 + 6  # steps 1-9, then 7-12: nothing before step 6 trained twice
    assert_pulled_and_verified(project, run_id, "checkpoint-12")
    assert sha256(project.remote_run(run_id) / "work" / "outputs" / "model.safetensors") == uninterrupted(tmp_path)


def hold_then(project, signal_launcher: bool) -> str:
    """Launch HF_STYLE holding after checkpoint-6; once it holds, SIGTERM its launcher or `doit stop` it."""
    project.doit("run", "launch", check=True, timeout=120)
    run_id = project.run_ids()[0]
    log = project.remote_run(run_id) / "train.log"
    project.wait_for(lambda: log.exists() and "checkpoint-6\n" in log.read_text(), timeout=60,
                     what="the trainer to save checkpoint-6 and hold")
    if signal_launcher:  # an administrator, or a scheduler's preemption: a signal tether did not send
        os.kill(json.loads((project.remote_run(run_id) / "state.json").read_text())["pid"], signal.SIGTERM)
    else:
        stopped = project.doit("stop")
        assert stopped.returncode == 0 and f"{run_id}: stopped" in stopped.stdout, out(stopped)
    return run_id


def test_sigterm_from_outside_relaunches_from_the_newest_folder_by_policy(project, tmp_path):
    use_hf(project, "--hold_at 6", restart="{policy: on-preempt, max_restarts: 1}")
    run_id = hold_then(project, signal_launcher=True)
    done = project.doit("run", "train", timeout=180)
    assert done.returncode == 0, out(done)
    first, second = launches(project, run_id)
    code = str(project.remote_run(run_id) / "work")
    assert second["argv"][-2:] == ["--resume_from_checkpoint", f"{code}/outputs/checkpoint-6"], second
    assert second["resumed_from"] == f"{code}/outputs/checkpoint-6"
    log = (project.remote_run(run_id) / "train.log").read_text()
    assert f"from checkpoint {code}/outputs/checkpoint-6 at step 6" in log, log
    assert_pulled_and_verified(project, run_id, "checkpoint-12")
    assert sha256(project.remote_run(run_id) / "work" / "outputs" / "model.safetensors") == uninterrupted(tmp_path)


def test_a_stopped_run_keeps_seals_and_brings_home_its_newest_folder(project):
    use_hf(project, "--hold_at 6")
    run_id = hold_then(project, signal_launcher=False)
    state = json.loads((project.remote_run(run_id) / "state.json").read_text())
    assert state["status"] == "stopped" and state["checkpoint"] == "checkpoints/checkpoint-6", state
    assert kept_names(project, run_id) == ["checkpoint-3", "checkpoint-6"]
    pulled = project.doit("run", "pull", "verify", timeout=120)
    assert pulled.returncode == 0, out(pulled)
    assert_pulled_and_verified(project, run_id, "checkpoint-6")


def test_a_run_whose_launcher_was_killed_keeps_its_newest_folder_when_stopped(project):
    use_hf(project, "--hold_at 6")
    project.doit("run", "launch", check=True, timeout=120)
    run_id = project.run_ids()[0]
    log = project.remote_run(run_id) / "train.log"
    project.wait_for(lambda: log.exists() and "checkpoint-6\n" in log.read_text(), timeout=60,
                     what="the trainer to save checkpoint-6 and hold")
    os.kill(json.loads((project.remote_run(run_id) / "state.json").read_text())["pid"], signal.SIGKILL)
    stopped = project.doit("stop")  # the trainer still runs (it holds the lock); stop ends it and closes the run
    assert stopped.returncode == 0 and f"{run_id}: stopped" in stopped.stdout, out(stopped)
    state = json.loads((project.remote_run(run_id) / "state.json").read_text())
    assert state["status"] == "stopped" and state["checkpoint"] == "checkpoints/checkpoint-6", state
    manifest = json.loads((project.remote_run(run_id) / "PULL_MANIFEST.json").read_text())
    assert "checkpoints/checkpoint-6/trainer_state.json" in [e["path"] for e in manifest["files"]], manifest


# ---------------------------------------------------------------- over ssh (a real sshd)


def test_checkpoint_folders_over_ssh(project, sshd, tmp_path):
    far = tmp_path / "far"
    use_hf(project, text=ssh_config_text(sshd, far))
    try:
        done = project.doit("run", "train", timeout=240)
        assert done.returncode == 0, out(done)
        run_id = project.run_ids()[0]
        remote = far / "runs" / run_id
        assert sorted(p.name for p in (remote / "checkpoints").iterdir()) == ["checkpoint-12", "checkpoint-6",
                                                                                "checkpoint-9"]
        local = project.local_run(run_id)
        for name in ("model.safetensors", "trainer_state.json"):
            path = f"checkpoints/checkpoint-12/{name}"
            assert sha256(local / "files" / path) == sha256(remote / path)
            assert path in json.loads((local / "PULL_VERIFIED.json").read_text())["files"]
    finally:
        stop_leftover_runs(far)


# ---------------------------------------------------------------- refused before anything launches


@pytest.mark.parametrize("checkpoint, says", [
    ("../outputs/checkpoint-*", "trainer.checkpoint '../outputs/checkpoint-*' leaves the run folder ('..')"),
    ("outputs/../../checkpoint-*", "leaves the run folder ('..')"),
    ("/tmp/outputs/checkpoint-*", "trainer.checkpoint '/tmp/outputs/checkpoint-*' is an absolute path"),
    ("~/outputs/checkpoint-*", "is an absolute path"),
    ("outputs/*/checkpoint-*", "has a wildcard before its last part: only the last part may be a glob"),
    ("outputs/", "ends in '/': name the folder without it, e.g. 'outputs'"),
], ids=["dotdot", "dotdot-inside", "absolute", "home", "glob-in-folder", "trailing-slash"])
def test_a_checkpoint_glob_that_escapes_the_run_is_refused(project, checkpoint, says):
    use_hf(project, checkpoint=f"'{checkpoint}'")
    with pytest.raises(ConfigError) as caught:
        load(str(project.root / "tether.yaml"))
    assert len(caught.value.problems) == 1 and says in caught.value.problems[0], caught.value.problems


def test_an_escaping_checkpoint_glob_stops_train_with_one_line_before_launch(project):
    use_hf(project, checkpoint="'../outputs/checkpoint-*'")
    done = project.doit("run", "train", timeout=120)
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if "trainer.checkpoint" in line]
    assert len(lines) == 1 and "leaves the run folder" in lines[0], out(done)
    assert not (project.root / ".tether" / "remote" / "runs").exists()  # nothing was pushed or launched


# ---------------------------------------------------------------- the launcher alone, on a hand-made run dir


NANO_STYLE = """\
import os, sys
os.makedirs("out", exist_ok=True)
start = 0
if "--init_from=resume" in sys.argv:
    with open("out/ckpt.pt") as f:
        start = int(f.read())
    print("resuming from iter %d" % start, flush=True)
with open("out/ckpt.pt", "w") as f:
    f.write(str(start + 100))
"""


def hand_made_run(tmp_path: Path, source: str, checkpoint: str, resume_args: list, keep: int = 3) -> str:
    run_dir = tmp_path / "runs" / "r1"
    (run_dir / "code").mkdir(parents=True)
    (run_dir / "code" / "train.py").write_text(source)
    spec = {"run_id": "r1", "argv": ["{python}", "train.py"], "artifacts": [], "grace_seconds": 1,
            "checkpoint_keep": keep, "checkpoint_path": checkpoint, "resume_args": resume_args}
    (run_dir / "run.json").write_text(json.dumps(spec))
    return str(run_dir)


def run_once(run_dir: str) -> dict:
    """One attempt of the launcher in the foreground, then the run reopened for another (as a restart does)."""
    subprocess.run([sys.executable, launcher.__file__, "run", run_dir], check=True, timeout=60, capture_output=True)
    state = json.loads(Path(run_dir, "state.json").read_text())
    Path(run_dir, "PULL_MANIFEST.json").unlink()
    Path(run_dir, "state.json").write_text(json.dumps(dict(state, final=False, status="preempted")))
    return state


def test_a_plain_checkpoint_file_is_kept_restored_when_lost_and_resumed_from(tmp_path):
    run_dir = hand_made_run(tmp_path, NANO_STYLE, "out/ckpt.pt", ["--init_from=resume"])
    first = run_once(run_dir)
    assert first["checkpoint"] == "checkpoints/ckpt.pt" and first["resumed_from"] is None
    assert Path(run_dir, "checkpoints", "ckpt.pt").read_text() == "100"
    os.unlink(os.path.join(run_dir, "code", "out", "ckpt.pt"))  # the script's folder lost it
    second = run_once(run_dir)
    assert second["resumed_from"] == os.path.join(run_dir, "code", "out", "ckpt.pt")
    assert "resuming from iter 100" in Path(run_dir, "train.log").read_text()
    assert Path(run_dir, "checkpoints", "ckpt.pt").read_text() == "200"  # kept again after the second exit


def test_a_lost_checkpoint_folder_is_restored_and_a_link_out_is_never_kept(tmp_path):
    run_dir = hand_made_run(tmp_path, HF_STYLE, "outputs/checkpoint-*", ["--resume_from_checkpoint", "{checkpoint}"],
                            keep=2)
    elsewhere = tmp_path / "elsewhere" / "checkpoint-99"
    elsewhere.mkdir(parents=True)
    (elsewhere / "trainer_state.json").write_text('{"global_step": 99}')
    Path(run_dir, "code", "outputs").mkdir()
    os.symlink(elsewhere, os.path.join(run_dir, "code", "outputs", "checkpoint-99"))  # newer by name, not ours
    run_once(run_dir)
    assert sorted(os.listdir(os.path.join(run_dir, "checkpoints"))) == ["checkpoint-12", "checkpoint-9"]
    outputs = Path(run_dir, "code", "outputs")
    for name in ("checkpoint-3", "checkpoint-6", "checkpoint-9", "checkpoint-12"):  # the script's folder lost them
        for f in (outputs / name).iterdir():
            f.unlink()
        (outputs / name).rmdir()
    second = run_once(run_dir)
    restored = str(outputs / "checkpoint-12")
    assert second["resumed_from"] == restored
    assert json.loads(Path(restored, "trainer_state.json").read_text())["global_step"] == 12
    assert f"Resuming training from checkpoint {restored} at step 12" in Path(run_dir, "train.log").read_text()
    assert not [e for e in os.listdir(os.path.join(run_dir, "checkpoints")) if e.startswith(".")]  # no scratch left


def test_a_safetensors_file_is_verified_by_its_header(tmp_path):
    """verify opens what a checkpoint folder holds: a .safetensors file's header must be there and parse."""
    header = b'{"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}'
    good, bad, short = tmp_path / "model.safetensors", tmp_path / "b.safetensors", tmp_path / "c.safetensors"
    good.write_bytes(len(header).to_bytes(8, "little") + header + b"\0\0\0\0")
    bad.write_bytes(b"weights")  # an empty file's cousin: what a write cut short leaves
    short.write_bytes((1000).to_bytes(8, "little") + header)
    assert content_problem(str(good), {}) == ""
    assert content_problem(str(bad), {}).startswith("ValueError: not a safetensors file: its header length")
    assert content_problem(str(short), {}).startswith("ValueError: not a safetensors file: its header length")
