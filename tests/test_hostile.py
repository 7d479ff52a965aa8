"""Hostile and unlucky input, as data: each case is an input that once lost, leaked or wedged
something, the one-line error (or safe outcome) it now gets, and proof that what it threatened
is intact afterwards.

One section per area; each section's cases are a table of `pytest.param`s.
"""

from __future__ import annotations

import pytest  # noqa: F401


# ================================================================ remote_dir ownership and prune


# (end of section: remote_dir ownership and prune)


# ================================================================ seal, artifacts, launcher failures


# (end of section: seal, artifacts, launcher failures)


# ================================================================ GPUs and SLURM guards


# (end of section: GPUs and SLURM guards)


# ================================================================ config input and command line


# (end of section: config input and command line)


# ================================================================ pull, verify and transfers

# Each case damages a verified run (or its transfer), runs the command that must notice, then does
# exactly what the message advises (the commands in its backticks are run as they stand) and checks
# that this leads to a verified run that `down` accepts.

import hashlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import shlex  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from conftest import config_text as _config_text  # noqa: E402
from helpers import Background as _Background, poll as _poll  # noqa: E402


def _pulled(project, path: str = "artifacts/model.json"):
    return project.local_run() / "files" / path


def _far(project, path: str = "artifacts/model.json"):
    return project.remote_run() / path


def _flip(path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _behind_mtime(project) -> None:
    """Bit rot, or a tool that puts timestamps back: same size, same mtime, other bytes."""
    pulled = _pulled(project)
    before = pulled.stat()
    _flip(pulled)
    os.utime(pulled, ns=(before.st_atime_ns, before.st_mtime_ns))


def _far_changed(path: str):
    """The far side's copy is damaged after sealing, and the copy here is lost: pull fetches damage."""
    def damage(project) -> None:
        far = _far(project, path)
        project.root.joinpath("sealed.bin").write_bytes(far.read_bytes())  # what the advice puts back
        _flip(far)
        _pulled(project, path).unlink()
    return damage


def _far_gone(path: str):
    """The far side's copy is removed after sealing, and the copy here is lost."""
    def damage(project) -> None:
        far = _far(project, path)
        project.root.joinpath("sealed.bin").write_bytes(far.read_bytes())
        far.unlink()
        _pulled(project, path).unlink()
    return damage


def _extra_file(project) -> None:
    """A file the user (or a tool) left in files/, which no manifest lists."""
    _pulled(project, "artifacts/notes.txt").write_text("my notes\n")


def _sealed_again(project) -> None:
    """The far side's manifest is rewritten after this side verified the run (a second seal)."""
    far = _far(project)
    far.write_text('{"w": [3, 4]}')
    path = project.remote_run() / "PULL_MANIFEST.json"
    listed = json.loads(path.read_text())
    for entry in listed["files"]:
        if entry["path"] == "artifacts/model.json":
            entry.update(bytes=far.stat().st_size, sha256=hashlib.sha256(far.read_bytes()).hexdigest())
    path.write_text(json.dumps(listed, indent=2, sort_keys=True))


def _advised(project, message: str) -> list[str]:
    """Do what the message says: put a sealed file back where it names, run its backticked commands."""
    found = re.search(r"put the sealed file back at (\S+),", message)
    if found:
        Path(found.group(1)).write_bytes(project.root.joinpath("sealed.bin").read_bytes())
    ran = []
    for command in re.findall(r"`([^`]+)`", message):
        words = shlex.split(command)
        if words[0] == "doit":
            done = project.doit(*words[1:])
        else:
            done = subprocess.run(words, capture_output=True, text=True, cwd=project.root)
        assert done.returncode == 0, f"the advised `{command}` failed:\n{done.stdout}\n{done.stderr}"
        ran.append(command)
    return ran


FIVE_MIB = """\
import os
out = os.environ["TETHER_ARTIFACTS_DIR"]
with open(os.path.join(out, "big.bin"), "wb") as f:
    f.write(os.urandom(5 << 20))  # above transfer.SMALL: fetched resumably, not in a tar batch
with open(os.path.join(out, "model.json"), "w") as f:
    f.write('{"w": [1, 2]}')
"""

PULL_CASES = [
    pytest.param(_behind_mtime, ("run", "verify"), False, ("artifacts/model.json", "failed verification"),
                 ("not in the manifest",), None, id="same size and mtime: an explicit verify re-hashes"),
    pytest.param(_behind_mtime, ("run", "train"), True, ("pulled 1 of",), ("-- train",), None,
                 id="same size and mtime: train's up-to-date check sees the ctime"),
    pytest.param(_far_changed("artifacts/model.json"), ("pull",), False,
                 ("the far side's artifacts/model.json no longer matches its sealed manifest", "cannot fix"),
                 ("pull again",), None, id="far copy changed after sealing, small file"),
    pytest.param(_far_changed("artifacts/big.bin"), ("pull",), False,
                 ("the far side's artifacts/big.bin no longer matches its sealed manifest", "cannot fix"),
                 ("pull again",), FIVE_MIB, id="far copy changed after sealing, large file"),
    pytest.param(_far_gone("artifacts/model.json"), ("pull",), False,
                 ("the far side's artifacts/model.json is gone (removed after sealing)", "cannot fix"),
                 ("pull again", "Traceback", "exited 1"), None, id="far copy removed after sealing, small file"),
    pytest.param(_far_gone("artifacts/big.bin"), ("pull",), False,
                 ("the far side's artifacts/big.bin is gone (removed after sealing)", "cannot fix"),
                 ("pull again", "Traceback"), FIVE_MIB, id="far copy removed after sealing, large file"),
    pytest.param(_extra_file, ("run", "verify"), False, ("artifacts/notes.txt: not in the manifest", "`rm "),
                 ("fetches",), None, id="an extra file in files/"),
    pytest.param(_sealed_again, ("run", "down", "confirm=yes"), False,
                 ("manifest changed after it was verified here", "`doit pull verify run="), ("`doit pull run=",),
                 None, id="the far manifest sealed again after verify"),
]


@pytest.mark.parametrize("damage, command, succeeds, says, never, trainer", PULL_CASES)
def test_pull_and_verify_notice_damage_and_their_advice_works(project, damage, command, succeeds, says, never,
                                                             trainer):
    if trainer:
        (project.root / "demo" / "big.py").write_text(trainer)
        project.write_config(_config_text(command="{python} demo/big.py", code="demo/big.py",
                                          artifacts="big.bin, model.json"))
    project.doit("run", "train", check=True)
    damage(project)
    done = project.doit(*command)
    said = done.stdout + done.stderr
    assert (done.returncode == 0) == succeeds, said
    for text in says:
        assert text in said, said
    for text in never:
        assert text not in said, said
    assert "Traceback" not in said, said
    if not succeeds:
        assert _advised(project, done.stderr), f"no command to run in the advice:\n{done.stderr}"
    project.doit("run", "verify", check=True)
    again = project.doit("pull", check=True)
    assert "already pulled and verified" in again.stdout, again.stdout
    gone = project.doit("run", "down", "confirm=yes", check=True)
    assert "removed" in gone.stdout, gone.stdout


SIZED = """\
import os
out = os.environ["TETHER_ARTIFACTS_DIR"]
with open(os.path.join(out, "big.bin"), "wb") as f:
    f.truncate({size})  # sparse on the far side: cheap to write, a real {size} bytes to pull
with open(os.path.join(out, "model.json"), "w") as f:
    f.write('{{"w": [1, 2]}}')
"""

SIZE_CASES = [
    pytest.param(2 << 20, {"max_artifact_mb": 1}, "left on the far side: artifacts/big.bin (2.0 MB is above "
                 "max_artifact_mb (1))", id="max_artifact_mb on the local backend"),
    pytest.param((1 << 30) + (100 << 20), {}, "pulling artifacts/big.bin (1.1 GiB); set max_artifact_mb to leave "
                 "such files on the far side", id="an artifact above 1 GiB is announced"),
]


@pytest.mark.parametrize("size, limits, line", SIZE_CASES)
def test_large_artifacts_are_announced_or_left(project, size, limits, line):
    (project.root / "demo" / "sized.py").write_text(SIZED.format(size=size))
    project.write_config(_config_text(command="{python} demo/sized.py", code="demo/sized.py",
                                      artifacts="big.bin, model.json",
                                      backend=json.dumps(dict(type="local", **limits))))
    train = project.doit("run", "train", timeout=300)
    assert train.returncode == 0, train.stdout + train.stderr
    assert line in train.stdout, train.stdout
    pulled = _pulled(project, "artifacts/big.bin")
    assert pulled.exists() == (not limits)
    if not limits:
        pulled.unlink()  # 1.1 GiB: give the disk back now
        return
    refused = project.doit("run", "down", "confirm=yes")
    assert refused.returncode != 0 and "artifacts/big.bin" in refused.stderr, refused.stderr
    assert "then `doit pull`" in refused.stderr, refused.stderr
    project.write_config(_config_text(command="{python} demo/sized.py", code="demo/sized.py",  # the limit raised
                                      artifacts="big.bin, model.json", backend="{type: local, max_artifact_mb: 4}"))
    fetched = project.doit("pull", check=True)  # what the refusal advises
    assert "pulled 1 of" in fetched.stdout, fetched.stdout
    project.doit("run", "verify", check=True)
    gone = project.doit("run", "down", "confirm=yes", check=True)
    assert "removed" in gone.stdout, gone.stdout


BIG_SSH = """\
import os
out = os.environ["TETHER_ARTIFACTS_DIR"]
block = os.urandom(1 << 20)
with open(os.path.join(out, "big.bin"), "wb") as f:
    for i in range(300):  # 300 MiB, every MiB different
        f.write(i.to_bytes(4, "big") + block[4:])
for i in range(20):  # 60 MiB of small files: one tar batch
    with open(os.path.join(out, "part-%02d.bin" % i), "wb") as f:
        f.write(os.urandom(3 << 20))
"""


def _sftp_under_way(project, far) -> bool:
    """The large file is coming in over SFTP (its .part grows)."""
    try:
        return _pulled(project, "artifacts/big.bin.part").stat().st_size > 0
    except (FileNotFoundError, AssertionError):
        return False


def _tar_under_way(project, far) -> bool:
    """The far side's `send` of this run (not another test's) is streaming the small files' tar."""
    mine = f"launcher.py\0send\0{far}/runs/".encode()
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and mine in (entry / "cmdline").read_bytes():
                return True
        except OSError:
            continue
    return False


STALL_CASES = [
    pytest.param(_sftp_under_way, True, id="frozen during the SFTP download of a large file"),
    pytest.param(_tar_under_way, False, id="frozen during the tar of small files"),
]


def _signal_sessions(server, sig) -> None:
    """Signal every connection sshd serves (each is a session of its own), not the listener."""
    for pid in server.sessions():
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            pass


@pytest.mark.parametrize("under_way, resumes", STALL_CASES)
def test_a_stalled_transfer_fails_in_bounded_time_and_the_rerun_resumes(project, tmp_path, under_way, resumes):
    from sshd import SSHServer

    server = SSHServer(tmp_path / "sshd").start()
    far = tmp_path / "far"
    artifacts = "big.bin, " + ", ".join(f"part-{i:02d}.bin" for i in range(20))
    (project.root / "demo" / "big.py").write_text(BIG_SSH)
    project.write_config(_config_text(command="{python} demo/big.py", code="demo/big.py", artifacts=artifacts,
                                      backend_name="lab",
                                      backend=json.dumps(server.backend_config(far, stall_timeout_s=2))))
    try:
        project.doit("run", "launch", check=True)
        run_id = project.run_ids()[-1]
        _poll(lambda: (far / "runs" / run_id / "PULL_MANIFEST.json").exists(), 120, "the seal", interval=0.05)
        pulling = _Background(project.start("pull"))
        try:
            _poll(lambda: under_way(project, far) or pulling.proc.poll() is not None, 120, "the pull under way")
            assert pulling.proc.poll() is None, f"the pull ended before it could be frozen:\n{pulling.output()}"
            _signal_sessions(server, signal.SIGSTOP)
            frozen = time.monotonic()
            code = pulling.finish(timeout=60)  # bounded: without the watchdog it waits for ever
        finally:
            _signal_sessions(server, signal.SIGCONT)
            if pulling.proc.poll() is None:
                pulling.kill()
        took = time.monotonic() - frozen
        said = pulling.text("stdout") + pulling.text("stderr")
        assert code != 0, said
        assert "the copy from root@127.0.0.1 sent nothing for 2 s; nothing is lost: run the same command again" \
            in said, said
        assert took < 20, f"the stall was reported {took:.0f}s after the freeze"
        part = _pulled(project, "artifacts/big.bin.part")
        inode = part.stat().st_ino if resumes else None
        if resumes:
            assert 0 < part.stat().st_size < 300 << 20, part.stat().st_size
        again = project.doit("run", "train", timeout=300)
        assert again.returncode == 0, again.stdout + again.stderr
        assert ("resuming big.bin at" in again.stdout) == resumes, again.stdout
        if resumes:
            assert _pulled(project, "artifacts/big.bin").stat().st_ino == inode  # appended to, not fetched anew
        verified = json.loads((project.local_run() / "PULL_VERIFIED.json").read_text())
        assert len(verified["files"]) == len(json.loads((far / "runs" / run_id / "PULL_MANIFEST.json")
                                                        .read_text())["files"])
    finally:
        server.stop()


# (end of section: pull, verify and transfers)
