"""Disk full on both sides: a checkpoint that does not fit on the far side, a pull that does not fit here."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys

from faults_disk import DATA, config, fill, leave_for_second_checkpoint, tmpfs
from helpers import sha256

SEED = int(os.environ.get("TETHER_FAULT_SEED", "15"))


def _reference(root):
    """The script run here without faults, in the background, for its final result (which --grow does not
    change: the history is only stored, so a tiny one keeps this run cheap)."""
    (root / "demo").mkdir(parents=True)
    shutil.copy(DATA / "disk_train.py", root / "demo")
    shutil.copy(DATA.parent.parent / "configs" / "demo" / "points.csv", root / "demo")
    return subprocess.Popen([sys.executable, "demo/disk_train.py", "--epochs", "3", "--grow", "4"], cwd=root,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _whole_zip(path) -> None:
    """The checkpoint at `path` is whole: a zip (torch.save's format) whose every member matches its CRC.
    That it is epoch 1's, loads and gives the fault-free result, the resume below shows."""
    import zipfile

    with zipfile.ZipFile(path) as z:
        assert z.testzip() is None and any(n.endswith("data.pkl") for n in z.namelist()), f"seed {SEED}: {path}"


def test_a_checkpoint_that_fills_the_far_disk_keeps_the_previous_one_and_resumes(project, tmp_path):
    offset = random.Random(SEED).randrange(0, 1 << 20)
    print(f"seed {SEED}: epoch 2's checkpoint write meets a full disk {offset} bytes in "
          f"(replay: TETHER_FAULT_SEED={SEED} pytest tests/test_faults_disk.py)")
    reference = _reference(tmp_path / "ref")
    shutil.copy(DATA / "disk_train.py", project.root / "demo")
    far, here = tmp_path / "far", project.root / ".tether" / "runs"
    with tmpfs(far, 600 << 20), tmpfs(here, 4 << 20):
        project.write_config(config(far / "remote"))
        project.doit("run", "up", check=True)  # the preflight wants 500 MB free: fill after it
        filler = fill(far, leave_for_second_checkpoint(offset))
        failed = project.doit("run", "train")
        said = failed.stdout + failed.stderr
        error = [line for line in failed.stderr.splitlines() if line.startswith("error:")]
        run = far / "remote" / "runs" / project.run_ids()[-1]
        far_logs = "".join((run / n).read_text() for n in ("launcher.log", "events.jsonl") if (run / n).exists())
        assert failed.returncode == 1 and error and "no space left on device" in error[0], \
            f"seed {SEED}\n{said}\n{far_logs}"
        state = json.loads((run / "state.json").read_text())
        assert state["status"] == "failed" and state["reason"].startswith("no space left on device"), state
        assert "no space left on device" in project.doit("status").stdout
        _whole_zip(run / "work" / "out" / "ckpt.pt")  # the previous checkpoint, intact
        assert not list((run / "checkpoints").glob(".keep-*")), "a copy cut short was left on the full disk"
        filler.unlink()
        pulled = project.doit("run", "train", "retry=1")  # the far side has room; this side's 4 MiB has not
        assert pulled.returncode == 1 and "pull stopped: no space left on device in" in pulled.stderr, pulled.stderr
        assert "Traceback" not in pulled.stderr, pulled.stderr
        assert list(here.glob("*/files/**/*.part")), "the partial file should wait as .part"
        assert project.doit("run", "verify").returncode == 1  # a partial file is never accepted
        assert project.doit("run", "down", "confirm=yes").returncode == 1
        subprocess.run(["mount", "-o", "remount,size=%d" % (64 << 20), str(here)], check=True)
        project.doit("run", "train", check=True)  # the rerun pulls what is left and verifies, in one process
        log = (run / "train.log").read_text()
        assert "resumed from" in log and "at epoch 1" in log, log
        final = project.local_run() / "files" / "work" / "out" / "final.json"
        assert reference.wait(timeout=120) == 0
        assert final.read_bytes() == (tmp_path / "ref" / "out" / "final.json").read_bytes()
        assert "removed" in project.doit("run", "down", "confirm=yes", check=True).stdout


def _zip(path, size: int) -> bytes:
    import zipfile
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data/0", os.urandom(size))
    return path.read_bytes()


def test_a_checkpoint_torn_in_place_is_never_kept_nor_resumed(tmp_path):
    from tether.remote import mapped

    rng = random.Random(SEED)
    out = tmp_path / "work" / "out"
    out.mkdir(parents=True)
    _zip(out / "ckpt.pt", 5000)
    mapped.keep(str(tmp_path), "out/ckpt.pt", 1)
    kept = tmp_path / "checkpoints" / "ckpt.pt"
    before = sha256(kept)
    for _ in range(8):
        new = _zip(out / "new.zip", rng.randrange(1000, 9000))
        cut = rng.randrange(4, len(new) - 22)
        (out / "ckpt.pt").write_bytes(new[:cut])
        _, skipped = mapped.keep(str(tmp_path), "out/ckpt.pt", 1)
        assert sha256(kept) == before, f"seed {SEED}: cut at {cut}"
        assert "torn" in skipped[str(out / "ckpt.pt")], f"seed {SEED}: cut at {cut}: {skipped}"
        assert mapped.resume_point(str(tmp_path), "out/ckpt.pt") == str(kept)


def test_an_event_after_a_torn_line_is_a_line_of_its_own(tmp_path):
    from tether.remote.fileio import append_line

    path = tmp_path / "events.jsonl"
    path.write_bytes(b'{"event": "step", "step": 1}\n{"event": "st')
    append_line(str(path), b'{"event": "exit"}\n')
    assert path.read_bytes().split(b"\n")[-2:] == [b'{"event": "exit"}', b""]
