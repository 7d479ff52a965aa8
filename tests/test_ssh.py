"""The pipeline end to end over ssh, against real OpenSSH servers on loopback (no mocks).

Every test runs `doit` in a throwaway project whose backend `lab` is an sshd on 127.0.0.1; the
"far side" is a folder of this machine (`far`), so what the far side holds is checked on disk.
Covered: train then down; an ssh_config alias; ProxyJump through a second sshd; sshd going away
in the middle of watch; SIGKILL in the middle of a 300 MB push; refused connections (wrong key,
unknown or changed host key, closed or silent port); hostile run ids, remote_dirs and manifest
paths; GPU choice from replayed real nvidia-smi output (tests/data/nvidia-smi/SOURCES.md);
secrets kept off command lines; size limits on pull; a venv for `packages:`; prune.

Servers a test starts are stopped with SSHServer.stop(), which also ends their established
connections (each connection's sshd runs in a session of its own: tests/sshd.py finds and kills them).

Every wait polls a condition against a deadline; nothing sleeps a fixed time.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from conftest import config_text, ssh_config_text
from helpers import Background, poll, sha256, stop_leftover_runs
from sshd import SSHServer, free_port, keygen
from tether.remote import owner

DATA = Path(__file__).resolve().parent / "data" / "nvidia-smi"


def job_text(backend: dict, command: str = "{python} demo/train.py --epochs 30", code: str = "demo/train.py",
             data: str = "demo/points.csv", artifacts: str = "model.json, metrics.json") -> str:
    """A tether.yaml whose backend `lab` has exactly the keys in `backend` (JSON is YAML)."""
    return config_text(command=command, code=code, data=data, artifacts=artifacts, backend_name="lab",
                       backend=json.dumps(backend))


def use_trainer(project, name: str, source: str, backend: dict, artifacts: str) -> None:
    """Put a trainer script into the project and point tether.yaml at it."""
    (project.root / "demo" / name).write_text(source)
    project.write_config(job_text(backend, command="{python} demo/" + name, code="demo/" + name,
                                  artifacts=artifacts))


# ---------------------------------------------------------------- helpers


def out(done: subprocess.CompletedProcess) -> str:
    return f"exit {done.returncode}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def far_run(far: Path, run_id: str) -> Path:
    return far / "runs" / run_id


def far_state(far: Path, run_id: str) -> dict:
    path = far_run(far, run_id) / "state.json"
    return json.loads(path.read_text()) if path.exists() else {}


def far_events(far: Path, run_id: str) -> list[dict]:
    path = far_run(far, run_id) / "events.jsonl"
    if not path.exists():
        return []
    lines = path.read_text().split("\n")[:-1]  # a line still being written is not an event yet
    return [json.loads(line) for line in lines if line.strip()]


def launches(far: Path, run_id: str) -> int:
    return sum(1 for e in far_events(far, run_id) if e.get("event") == "launch")


def only_run_id(project, far: Path) -> str:
    """The one run here; the far side holds that run and no other."""
    ids = project.run_ids()
    assert len(ids) == 1, f"expected exactly one run, found {ids}"
    runs = far / "runs"
    there = sorted(p.name for p in runs.iterdir()) if runs.is_dir() else []
    assert there in ([], ids), f"local runs {ids}, far-side runs {there}"
    return ids[0]


def assert_verified(project, far: Path, run_id: str, artifacts=()) -> dict:
    """PULL_VERIFIED.json matches the far side's manifest and every file fetched here is intact."""
    local = project.local_run(run_id)
    far_bytes = (far_run(far, run_id) / "PULL_MANIFEST.json").read_bytes()
    verified = json.loads((local / "PULL_VERIFIED.json").read_text())
    assert verified["manifest_sha256"] == sha256_bytes(far_bytes)
    listed = {e["path"]: e for e in json.loads(far_bytes)["files"]}
    for name in artifacts:
        assert f"artifacts/{name}" in listed, f"{name} is not in the manifest: {sorted(listed)}"
    assert set(verified["files"]) == set(listed) - set(verified.get("remote_only", {}))
    for path in verified["files"]:
        pulled = local / "files" / path
        assert pulled.stat().st_size == listed[path]["bytes"], path
        assert sha256(pulled) == listed[path]["sha256"], path
    return verified


def object_files(far: Path) -> dict[str, Path]:
    """Every file of the far side's object store (temporary uploads included), by relative path."""
    root = far / "objects"
    return {str(p.relative_to(root)): p for p in sorted(root.rglob("*")) if p.is_file()} if root.is_dir() else {}


def partial_uploads(far: Path) -> list[Path]:
    return [p for name, p in object_files(far).items() if ".tmp-" in name]


def assert_objects_whole(far: Path) -> None:
    """Every object under its final name objects/<xx>/<sha256> is whole: it hashes to its name."""
    for name, path in object_files(far).items():
        if ".tmp-" in name:
            continue  # an upload in progress (or abandoned) under its temporary name
        folder, sha = name.split("/")
        assert re.fullmatch(r"[0-9a-f]{64}", sha) and folder == sha[:2], f"odd object name {name}"
        assert sha256(path) == sha, f"objects/{name} does not hash to its name: a partial file under the final name"


def tree(root: Path) -> dict[str, tuple]:
    """Every path under `root` with its type, size and mtime (doit's database, Python's caches and a far run
    dir's `read_at`, which every request that reads the run touches (tether/remote/idle.py), left out)."""
    found = {}
    for path in root.rglob("*"):
        rel = str(path.relative_to(root))
        if path.name.startswith("doit.db") or "__pycache__" in path.parts or path.name == "read_at":
            continue
        st = path.lstat()
        found[rel] = (stat.S_IFMT(st.st_mode), st.st_size if path.is_file() else 0,
                      st.st_mtime_ns if path.is_file() else 0)
    return found


def command_lines() -> dict[int, bytes]:
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    found[int(entry)] = f.read()
            except OSError:
                continue
    return found


@pytest.fixture
def far(tmp_path: Path) -> Path:
    """The far side's remote_dir (a folder of this machine); nothing is left running there."""
    path = tmp_path / "far"
    yield path
    stop_leftover_runs(path)


@pytest.fixture
def servers():
    """servers(base, **kw) -> an SSHServer of the test's own (stopped, sessions and all, at the end)."""
    made: list[SSHServer] = []

    def make(base: Path, **kwargs) -> SSHServer:
        server = SSHServer(base, **kwargs)
        made.append(server)
        return server

    yield make
    for server in made:
        server.stop()


# ---------------------------------------------------------------- the whole life of a run


def test_train_then_down_over_ssh(project, sshd, far):
    project.write_config(ssh_config_text(sshd, far))
    train = project.doit("run", "train")
    assert train.returncode == 0, out(train)
    run_id = only_run_id(project, far)
    assert far_state(far, run_id)["status"] == "completed"
    assert launches(far, run_id) == 1
    verified = assert_verified(project, far, run_id, artifacts=("model.json", "metrics.json"))
    objects = {name: sha256(p) for name, p in object_files(far).items()}
    assert len(objects) == 2 and not partial_uploads(far), objects  # train.py and points.csv
    assert (far / "tether").is_dir()

    again = project.doit("run", "train", check=True)
    assert ".  " not in again.stdout, again.stdout  # everything up to date: nothing runs twice

    down = project.doit("run", "down", "confirm=yes")
    assert down.returncode == 0, out(down)
    assert f"removed {far_run(far, run_id)}" in down.stdout, down.stdout
    assert not far_run(far, run_id).exists()
    assert {name: sha256(p) for name, p in object_files(far).items()} == objects  # the objects stay
    local = project.local_run(run_id)
    manifest = {e["path"]: e for e in json.loads((local / "PULL_MANIFEST.json").read_text())["files"]}
    assert set(verified["files"]) == set(manifest)
    for path, entry in manifest.items():  # the results here are still the verified ones
        assert sha256(local / "files" / path) == entry["sha256"], path
    assert (local / "down.json").exists()

    twice = project.doit("run", "down", "confirm=yes")
    assert twice.returncode == 0, out(twice)
    assert "already removed" in twice.stdout, twice.stdout


def test_a_whole_train_starts_two_far_side_pythons(project, sshd, far, tmp_path):
    """One serve process per invocation and the detached launcher: every other far-side command of
    up, push, launch, watch, pull and verify goes through that one process (counted by a wrapper
    that logs each start of the far side's interpreter, then execs it under its own name)."""
    log = tmp_path / "starts.log"
    wrapper = tmp_path / "python"
    wrapper.write_text("#!/bin/bash\n" "first=${1//$'\\n'/ } second=${2//$'\\n'/ }\n"
                       f'echo "${{first:0:200}} ${{second:0:40}}" >> {log}\nexec -a "$0" {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    project.write_config(ssh_config_text(sshd, far, python=str(wrapper)))
    train = project.doit("run", "train")
    assert train.returncode == 0, out(train)

    def tether_starts() -> list[str]:  # the trainer (demo/train.py) is the user's program, not tether's
        return [line for line in log.read_text().splitlines() if "demo/train.py" not in line]

    started = tether_starts()
    assert len(started) == 2, started
    assert sum(line.startswith("-c ") for line in started) == 1, started  # the serve process
    assert sum(line.endswith("launcher.py run") for line in started) == 1, started  # the detached launcher
    log.write_text("")
    again = project.doit("run", "train", check=True)
    assert ".  " not in again.stdout, again.stdout
    assert len(tether_starts()) <= 1, tether_starts()  # a no-op: at most the serve process opened early


def test_a_kept_connection_serves_the_next_command_and_only_with_the_same_key(project, far, tmp_path):
    """reuse_connection_s: the second invocation rides the first one's connection (no new login); one
    with another key gets its own connection, so a key that sshd refuses is refused."""
    server = SSHServer(tmp_path / "own-sshd").start()  # its own log: no other test's logins in it
    try:
        def logins() -> int:
            return server.log.read_text(errors="replace").count("Accepted publickey")

        project.write_config(ssh_config_text(server, far, reuse_connection_s=30))
        for _ in range(2):
            done = project.doit("check")
            assert done.returncode == 0, out(done)
        poll(lambda: logins() > 0, 30, "sshd to log the login")
        assert logins() == 1, "the second command did not reuse the first one's connection"
        stranger = tmp_path / "stranger"
        keygen(stranger, "not-authorized")
        project.write_config(ssh_config_text(server, far, reuse_connection_s=30, identity_file=str(stranger)))
        refused = project.doit("check")
        assert refused.returncode != 0 and "authentication failed" in refused.stderr, out(refused)
    finally:
        server.stop()


def test_ssh_config_alias_alone_reaches_the_host(project, sshd, far, tmp_path):
    """`host: <alias>` + `ssh_config:` only: port, user, key and known hosts all come from the file."""
    alias = f"tether-lab-{uuid.uuid4().hex[:6]}"
    config = tmp_path / "ssh_config"
    config.write_text(f"Host {alias}\n  HostName 127.0.0.1\n  Port {sshd.port}\n  User root\n"
                      f"  IdentityFile {sshd.client_key}\n  UserKnownHostsFile {sshd.known_hosts}\n"
                      f"  IdentitiesOnly yes\n")
    backend = {"type": "ssh", "host": alias, "ssh_config": str(config), "python": sys.executable,
               "remote_dir": str(far), "gpus": "none", "connect_timeout_s": 5}
    project.write_config(job_text(backend))
    train = project.doit("run", "train")
    assert train.returncode == 0, out(train)
    run_id = only_run_id(project, far)
    assert far_state(far, run_id)["status"] == "completed"
    assert_verified(project, far, run_id, artifacts=("model.json", "metrics.json"))

    # the file is what made it work: without it the alias is no host at all
    del backend["ssh_config"]
    project.write_config(job_text(backend))
    status = project.doit("status", f"run={run_id}")
    assert status.returncode != 0, out(status)
    assert alias in status.stderr and "Traceback" not in status.stderr, out(status)


def test_proxyjump_through_a_second_sshd(project, servers, far, tmp_path):
    jump = servers(tmp_path / "jump")
    jump.config.write_text(jump.config.read_text().replace("LogLevel VERBOSE", "LogLevel DEBUG1"))
    jump.start()
    inner = servers(tmp_path / "inner").start()
    config = tmp_path / "ssh_config"
    config.write_text(
        f"Host tether-jump\n  HostName 127.0.0.1\n  Port {jump.port}\n  User root\n"
        f"  IdentityFile {jump.client_key}\n  UserKnownHostsFile {jump.known_hosts}\n\n"
        f"Host tether-inner\n  HostName 127.0.0.1\n  Port {inner.port}\n  User root\n"
        f"  IdentityFile {inner.client_key}\n  UserKnownHostsFile {inner.known_hosts}\n"
        f"  ProxyJump tether-jump\n")
    backend = {"type": "ssh", "host": "tether-inner", "ssh_config": str(config), "python": sys.executable,
               "remote_dir": str(far), "gpus": "none", "connect_timeout_s": 5}
    project.write_config(job_text(backend))
    train = project.doit("run", "train")
    assert train.returncode == 0, out(train)
    run_id = only_run_id(project, far)
    assert_verified(project, far, run_id, artifacts=("model.json", "metrics.json"))
    # the inner server was reached through a tunnel that the jump host opened to it
    jump_log = jump.log.read_text(errors="replace")
    assert f"target 127.0.0.1 port {inner.port}" in jump_log, jump_log[-3000:]
    assert "Accepted publickey for root" in inner.log.read_text(errors="replace")


# ---------------------------------------------------------------- the far side goes away, the doit process dies


WAITER = """\
import json, os, time
from tether.trainers import runtime

run_dir = os.environ["TETHER_RUN_DIR"]
for step in range(1, 4):
    runtime.log("step", step=step, total_steps=3, loss=1.0 / step)
while not os.path.exists(os.path.join(run_dir, "go")):
    time.sleep(0.02)
with open(os.path.join(os.environ["TETHER_ARTIFACTS_DIR"], "model.json"), "w") as f:
    json.dump({"steps": 3}, f)
"""


def test_sshd_stopped_during_watch_then_rerun_reattaches(project, servers, far, tmp_path, monkeypatch):
    server = servers(tmp_path / "sshd").start()
    monkeypatch.setenv("TETHER_TRACE", "1")  # the far-side requests on doit's stderr: watch's probes are seen there
    use_trainer(project, "waiter.py", WAITER, server.backend_config(far, connect_timeout_s=3), "model.json")
    bg = Background(project.start("run", "train"))
    try:
        project.wait_for(lambda: "train:" in bg.text() and bool(project.run_ids())
                         and any(e.get("event") == "step" for e in far_events(far, project.run_ids()[-1]))
                         or bg.proc.poll() is not None, timeout=60, what="watch following the run")
        assert bg.proc.poll() is None, bg.output()
        run_id = only_run_id(project, far)

        # stop sshd while watch's probe of the run is under way: the loss then surfaces in the
        # probe, which watch retries (see test_event_reading_reports_a_lost_connection_as_a_backend_error
        # for a loss that surfaces in the events read right after it)
        before = probes_sent(bg)
        poll(lambda: probes_sent(bg) > before, timeout=30, what="watch probing the run", interval=0.001)
        server.stop()  # the listener and the connection watch is using
        project.wait_for(lambda: "retrying" in bg.output() or bg.proc.poll() is not None, timeout=30,
                         what="watch noticing the lost connection")
        assert bg.proc.poll() is None, "watch gave up when sshd went away:\n" + bg.output()

        (far_run(far, run_id) / "go").touch()  # the run finishes on the far side, unwatched
        project.wait_for(lambda: far_state(far, run_id).get("status") == "completed"
                         and (far_run(far, run_id) / "PULL_MANIFEST.json").exists(), timeout=60,
                         what="the run to complete and seal on the far side")
        assert bg.proc.poll() is None, bg.output()  # still waiting for the far side to come back
    finally:
        bg.kill()
    assert not (project.local_run(run_id) / "watch.json").exists()

    server.start()
    again = project.doit("run", "train", timeout=120)
    assert again.returncode == 0, out(again)
    assert "-- launch" in again.stdout and ".  watch" in again.stdout, again.stdout  # reattached
    assert launches(far, run_id) == 1
    assert_verified(project, far, run_id, artifacts=("model.json",))


def probes_sent(bg: Background) -> int:
    """How many `probe` requests this background doit has sent to the far side's serve process (watch
    polls with them; TETHER_TRACE=1 names each request on stderr as it is sent, a progress bar may precede one)."""
    return len(re.findall(r"\[far [^\]\n]*\] probe\b", bg.text()))


def test_event_reading_reports_a_lost_connection_as_a_backend_error(servers, far, tmp_path):
    """watch retries when a poll raises BackendError ("the far side is unreachable, not the run dead").
    Each poll is a probe, then a read of events.jsonl with EventReader; a connection lost between
    the two must surface from the read as a BackendError too, or `doit run train` dies with a
    traceback instead of waiting for the far side to come back."""
    from tether.backends.ssh import Backend, Config
    from tether.errors import BackendError
    from tether.paths import RunPaths
    from tether.pipelines.observe import EventReader

    server = servers(tmp_path / "sshd").start()
    backend = Backend("lab", Config(**server.backend_config(far, connect_timeout_s=3)), str(tmp_path / ".tether"))
    run = RunPaths("demo-20250101T000000Z-0123abcd", str(tmp_path / ".tether"), backend.remote_dir)
    backend.install_launcher()  # the first contact claims remote_dir, as `up` does, before anything is put there
    fs = backend.filesystem()
    fs.makedirs(run.remote, exist_ok=True)
    fs.pipe_file(run.remote_file("events.jsonl"), b'{"event": "step", "step": 1}\n')
    reader = EventReader(backend, run)
    assert [e["step"] for e in reader.read()] == [1]
    server.stop()
    with pytest.raises(BackendError):
        reader.read()


def test_sigkill_in_the_middle_of_a_large_push(project, sshd, far):
    """doit SIGKILLed while a 300 MB data file is on its way: no partial file ever has the final name."""
    size = 300 << 20
    big = project.root / "demo" / "big.bin"
    block = os.urandom(1 << 20)
    with open(big, "wb") as f:
        for i in range(size >> 20):  # every MiB different
            f.write(i.to_bytes(4, "big") + block[4:])
    big_sha = sha256(big)
    final = far / "objects" / big_sha[:2] / big_sha
    project.write_config(ssh_config_text(sshd, far).replace("paths: [demo/points.csv]",
                                                             "paths: [demo/points.csv, demo/big.bin]"))
    seen_sizes: set[int] = set()
    watching = threading.Event()

    def watch_final_name() -> None:  # the final name, whenever it exists, holds every byte
        while not watching.is_set():
            try:
                seen_sizes.add(final.stat().st_size)
            except FileNotFoundError:
                pass
            time.sleep(0.001)

    watcher = threading.Thread(target=watch_final_name, daemon=True)
    watcher.start()
    try:
        bg = Background(project.start("run", "train"))
        try:
            poll(lambda: any(p.name.startswith(big_sha + ".tmp-") for p in partial_uploads(far))
                 or bg.proc.poll() is not None, timeout=120, what="the big file's temporary object under objects/",
                 interval=0.002)
        finally:
            ended = bg.proc.poll()
            code = bg.kill()
        assert ended is None, f"doit ended (exit {ended}) before the push was caught:\n{bg.output()}"
        assert code == -signal.SIGKILL
        partial = [p for p in partial_uploads(far) if p.name.startswith(big_sha + ".tmp-")]
        assert len(partial) == 1 and partial[0].stat().st_size < size, partial  # caught in the middle
        assert not final.exists() or final.stat().st_size == size
        assert_objects_whole(far)
        run_id = only_run_id(project, far)
        assert not (project.local_run(run_id) / "push.json").exists()

        again = project.doit("run", "train", timeout=300)
        assert again.returncode == 0, out(again)
    finally:
        watching.set()
        watcher.join(timeout=10)
    assert seen_sizes <= {size}, f"the final name held a partial file ({sorted(seen_sizes)} bytes)"
    assert final.stat().st_size == size
    assert_objects_whole(far)  # the 300 MB object hashes to its name
    assert launches(far, run_id) == 1
    assert_verified(project, far, run_id, artifacts=("model.json", "metrics.json"))
    data = far_run(far, run_id) / "data" / "demo" / "big.bin"
    assert os.stat(data).st_ino == os.stat(final).st_ino  # the run's data/ is the verified object


def test_push_clears_partial_uploads_a_killed_push_left(project, sshd, far):
    """The push: "the far side cleans objects/*.tmp-* on the next push of the same file".

    A push killed in the middle of a large file leaves `objects/<xx>/<sha>.tmp-<random>` behind
    (test_sigkill_in_the_middle_of_a_large_push catches one). The next push of that file must not
    leave it there for good: for a large file that is gigabytes of the far side's disk. (The
    leftover here is two hours old, so a cleanup that spares young uploads in flight passes too.)"""
    data = project.root / "demo" / "medium.bin"
    data.write_bytes(os.urandom(6 << 20))  # above transfer.SMALL (once sent on its own; now in the push's tar like the rest)
    sha = sha256(data)
    owner.claim(str(far))  # a far side tether made (a killed push of its own left the partial file)
    leftover = far / "objects" / sha[:2] / f"{sha}.tmp-0123456789ab"
    leftover.parent.mkdir(parents=True)
    leftover.write_bytes(data.read_bytes()[: 1 << 20])  # what a SIGKILLed upload leaves
    hours_ago = time.time() - 2 * 3600
    os.utime(leftover, (hours_ago, hours_ago))  # long abandoned: no push still writes it
    project.write_config(ssh_config_text(sshd, far).replace("paths: [demo/points.csv]",
                                                             "paths: [demo/points.csv, demo/medium.bin]"))
    train = project.doit("run", "train")
    assert train.returncode == 0, out(train)
    assert sha256(far / "objects" / sha[:2] / sha) == sha
    assert partial_uploads(far) == [], "the next push of the same file left the killed push's partial upload"


# ---------------------------------------------------------------- connections refused, clearly and at once


def _silent_port():
    """A port that accepts TCP connections and never says a word (no SSH banner)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    return sock


REFUSALS = {
    "wrong key": ("authentication failed", "identity_file"),
    "unknown host key": ("host key not verified",),
    "changed host key": ("host key not verified", "changed key"),
    "closed port": ("cannot connect", "port"),
    "silent port": ("no answer within connect_timeout_s (3s)",),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_connection_refused_with_one_clear_line(project, sshd, far, tmp_path, case):
    extra: dict = {"connect_timeout_s": 3}
    listener = None
    if case == "wrong key":
        keygen(tmp_path / "stranger", "not-authorized")
        extra["identity_file"] = str(tmp_path / "stranger")
    elif case == "unknown host key":
        (tmp_path / "known_hosts").write_text("")
        extra["known_hosts"] = str(tmp_path / "known_hosts")
    elif case == "changed host key":
        keygen(tmp_path / "impostor", "another-host")
        public = " ".join((tmp_path / "impostor.pub").read_text().split()[:2])
        (tmp_path / "known_hosts").write_text(f"[127.0.0.1]:{sshd.port} {public}\n")
        extra["known_hosts"] = str(tmp_path / "known_hosts")
    elif case == "closed port":
        extra["port"] = free_port()
    else:
        listener = _silent_port()
        extra["port"] = listener.getsockname()[1]
    project.write_config(ssh_config_text(sshd, far, **extra))
    try:
        started = time.monotonic()
        check = project.doit("check")
        waited = time.monotonic() - started
    finally:
        if listener is not None:
            listener.close()
    assert check.returncode != 0, out(check)
    assert "Traceback" not in check.stderr, out(check)
    lines = [line for line in check.stderr.splitlines() if line.startswith("error: check:")]
    assert len(lines) == 1, out(check)
    message = lines[0]
    assert check.stderr.strip() == message, "the refusal is not one line:\n" + out(check)
    for words in REFUSALS[case]:
        assert words in message, f"{case}: {words!r} not in {message!r}"
    limit = extra["connect_timeout_s"]
    if case == "silent port":
        assert limit <= waited < limit + 3, f"gave up after {waited:.1f}s, connect_timeout_s is {limit}"
    else:
        assert waited < limit, f"{case} took {waited:.1f}s: a refusal must not wait for the timeout ({limit}s)"
    assert not far.exists() or not (far / "runs").exists()


# ---------------------------------------------------------------- hostile input


def _home() -> Path:
    return Path(os.path.expanduser("~root"))


@pytest.fixture
def marker(tmp_path: Path) -> Path:
    """An absolute path that exists only if someone's shell ran `touch M`."""
    path = tmp_path / "M"
    yield path
    assert not path.exists(), "a shell ran the injected command"


HOSTILE_RUN_IDS = ["x;touch {M}", "$(touch {M})", "`touch {M}`", "a b", "../../etc/passwd", "/etc/passwd",
                   "x\ntouch {M}", "demo-20250101T000000Z-abcdef12\n"]


@pytest.mark.parametrize("template", HOSTILE_RUN_IDS, ids=repr)
def test_hostile_run_id_is_refused_before_anything_runs(project, sshd, far, tmp_path, marker, template):
    project.write_config(ssh_config_text(sshd, far))
    run_id = template.format(M=marker)
    (project.root / ".tether").mkdir(exist_ok=True)  # as dodo.py does before any task
    before, home = tree(tmp_path), sorted(os.listdir(_home()))
    for command in ("status", "stop"):  # a look, and the one that sends signals
        refused = project.doit(command, f"run={run_id}")
        assert refused.returncode != 0, out(refused)
        assert "invalid run id" in refused.stderr, out(refused)
        assert "Traceback" not in refused.stderr, out(refused)
        assert not marker.exists()
    assert tree(tmp_path) == before  # nothing written anywhere in the project or the far side
    assert sorted(os.listdir(_home())) == home


HOSTILE_REMOTE_DIRS = ["x;touch {M}", "$(touch {M})", "`touch {M}`", "a b", "../../x", "x\ntouch {M}",
                       "{far}\n"]


@pytest.mark.parametrize("template", HOSTILE_REMOTE_DIRS, ids=repr)
def test_hostile_remote_dir_is_refused_before_anything_runs(project, sshd, far, tmp_path, marker, template):
    remote_dir = template.format(M=marker, far=far)
    project.write_config(job_text(dict(sshd.backend_config(far), remote_dir=remote_dir)))
    (project.root / ".tether").mkdir(exist_ok=True)  # as dodo.py does before any task
    before, home = tree(tmp_path), sorted(os.listdir(_home()))
    check = project.doit("check")
    assert check.returncode != 0, out(check)
    assert "remote_dir" in check.stderr, out(check)
    assert "Traceback" not in check.stderr, out(check)
    assert not marker.exists()
    assert tree(tmp_path) == before, sorted(set(tree(tmp_path)) ^ set(before))
    assert sorted(os.listdir(_home())) == home


def test_pull_refuses_manifest_paths_that_leave_the_run_folder(project, sshd, far, tmp_path):
    project.write_config(ssh_config_text(sshd, far))
    project.doit("run", "launch", check=True)
    run_id = only_run_id(project, far)
    manifest = far_run(far, run_id) / "PULL_MANIFEST.json"
    project.wait_for(manifest.exists, what="the far side to seal the run")
    honest = manifest.read_bytes()
    passwd = sha256(Path("/etc/passwd"))
    outside = tmp_path.parent / f"escape-{uuid.uuid4().hex[:8]}"
    for bad in ("../../escape", "/etc/passwd", "artifacts/../../../escape", f"../../../../{outside.name}",
                str(outside)):
        listed = json.loads(honest)
        listed["files"].append({"path": bad, "bytes": 6, "sha256": sha256_bytes(b"owned\n")})
        manifest.write_text(json.dumps(listed))
        before = tree(tmp_path)
        pulled = project.doit("pull")
        assert pulled.returncode != 0, (bad, out(pulled))
        assert "refusing path" in pulled.stderr and "Traceback" not in pulled.stderr, (bad, out(pulled))
        after = tree(tmp_path)
        assert after == before, (bad, sorted(set(after) ^ set(before)))
        assert not outside.exists()
        assert not list(tmp_path.rglob("escape*"))
        assert sha256(Path("/etc/passwd")) == passwd
        assert not (project.local_run(run_id) / "PULL_MANIFEST.json").exists()
    manifest.write_bytes(honest)  # the honest manifest comes home as usual
    train = project.doit("run", "train")
    assert train.returncode == 0, out(train)
    assert_verified(project, far, run_id, artifacts=("model.json", "metrics.json"))


# ---------------------------------------------------------------- GPUs: a stand-in nvidia-smi replaying real output

STAND_IN = """\
#!/bin/sh
# A stand-in for nvidia-smi (no GPU here): replays real captured output, see {data}/SOURCES.md
case "$*" in
  "--query-gpu=index,name,memory.total,memory.free,utilization.gpu --format=csv,noheader,nounits")
    exec cat {data}/query-gpu-memory.txt ;;
  "--query-gpu=index,compute_cap --format=csv,noheader")
    exec cat {data}/query-gpu-compute_cap.txt ;;
esac
echo "stand-in nvidia-smi: no captured output for: $*" >&2
exit 2
"""


def replayed_gpus() -> list[dict]:
    gpus = []
    for line in (DATA / "query-gpu-memory.txt").read_text().splitlines():
        index, name, total, free, util = [part.strip() for part in line.split(",")]
        gpus.append({"index": int(index), "name": name, "total": int(total), "free": int(free), "util": int(util)})
    return gpus


@pytest.fixture(scope="module")
def gpu_sshd(tmp_path_factory):
    """An sshd whose sessions find the stand-in nvidia-smi first on PATH."""
    base = tmp_path_factory.mktemp("gpu-sshd")
    folder = base / "bin"
    folder.mkdir()
    script = folder / "nvidia-smi"
    script.write_text(STAND_IN.format(data=shlex.quote(str(DATA))))
    script.chmod(0o755)
    server = SSHServer(base / "server", path_prepend=str(folder)).start()
    yield server
    server.stop()


def check_json(done: subprocess.CompletedProcess) -> dict:
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, out(done)
    return json.loads(lines[0])


def test_check_lists_both_gpus_and_picks_the_freest(project, gpu_sshd, far):
    gpus = replayed_gpus()
    assert len(gpus) == 2 and len({g["free"] for g in gpus}) == 2
    freest = max(gpus, key=lambda g: g["free"])
    project.write_config(ssh_config_text(gpu_sshd, far, gpus="auto", min_free_gpu_mb=1000))
    check = project.doit("check", "json=1")
    assert check.returncode == 0, out(check)
    report = check_json(check)
    assert report["ready"] is True, report
    item = next(i for i in report["checks"] if i["check"] == "gpu")
    assert item["ok"] is True, item
    for g in gpus:
        assert f"{g['index']}: {g['name']}, {g['free']}/{g['total']} MB free, {g['util']}% busy" in item["detail"], item
    assert f"a run gets CUDA_VISIBLE_DEVICES={freest['index']}" in item["detail"], item


def test_no_gpu_free_enough_refuses_check_and_launch(project, gpu_sshd, far):
    need = max(g["free"] for g in replayed_gpus()) + 1
    project.write_config(ssh_config_text(gpu_sshd, far, gpus="auto", min_free_gpu_mb=need))
    check = project.doit("check", "json=1")
    assert check.returncode == 1, out(check)
    report = check_json(check)
    item = next(i for i in report["checks"] if i["check"] == "gpu")
    assert report["ready"] is False and item["ok"] is False, report
    assert f"needs 1 GPU(s) with \u2265 {need} MB free; found 0" in item["detail"], item
    assert "not ready" in check.stderr, out(check)

    train = project.doit("run", "train")
    assert train.returncode != 0, out(train)
    assert f"needs 1 GPU(s) with \u2265 {need} MB free; found 0" in out(train), out(train)
    assert "lower min_free_gpu_mb" in out(train), out(train)
    for run_id in project.run_ids():  # never launched: nothing started on the far side
        assert not (project.local_run(run_id) / "launch.json").exists()
        assert far_state(far, run_id) == {}
        assert launches(far, run_id) == 0


GPU_TRAINER = """\
import json, os
with open(os.path.join(os.environ["TETHER_ARTIFACTS_DIR"], "cuda.json"), "w") as f:
    json.dump({"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES")}, f)
"""


def test_trainer_gets_the_chosen_gpu(project, gpu_sshd, far):
    freest = max(replayed_gpus(), key=lambda g: g["free"])
    use_trainer(project, "gpu.py", GPU_TRAINER, gpu_sshd.backend_config(far, gpus="auto", min_free_gpu_mb=1000),
                "cuda.json")
    train = project.doit("run", "train")
    assert train.returncode == 0, out(train)
    run_id = only_run_id(project, far)
    assert_verified(project, far, run_id, artifacts=("cuda.json",))
    seen = json.loads((project.local_run(run_id) / "files" / "artifacts" / "cuda.json").read_text())
    assert seen == {"CUDA_VISIBLE_DEVICES": str(freest["index"])}


def test_check_names_gpus_the_far_side_torch_lacks_kernels_for(project, gpu_sshd, far):
    """A CPU-only torch on the far side has kernels for no GPU: the replayed compute capabilities are named."""
    pytest.importorskip("torch")
    caps = sorted({"sm_" + line.split(",")[1].strip().replace(".", "")
                   for line in (DATA / "query-gpu-compute_cap.txt").read_text().splitlines()})
    backend = json.dumps(gpu_sshd.backend_config(far, gpus="auto", min_free_gpu_mb=1000))
    project.write_config(f"name: digits\nbackend: lab\ntrainer: {{type: torch-classifier, epochs: 1}}\n"
                         f"artifacts: [metrics.json]\nbackends:\n  lab: {backend}\n")
    check = project.doit("check", "json=1", timeout=180)
    report = check_json(check)
    item = next((i for i in report["checks"] if i["check"] == "torch kernels"), None)
    assert item is not None, report
    import torch

    if torch.cuda.get_arch_list():  # a CUDA build here: it may well have kernels for these GPUs
        pytest.skip("torch on this machine is a CUDA build")
    assert item["ok"] is False and check.returncode == 1, report
    for cap in caps:
        assert cap in item["detail"], item


# ---------------------------------------------------------------- secrets stay off command lines


SECRET_TRAINER = """\
import hashlib, json, os, time
from tether.trainers import runtime

run_dir = os.environ["TETHER_RUN_DIR"]
token = os.environ.get("API_TOKEN", "")
runtime.log("ready", pid=os.getpid())
while not os.path.exists(os.path.join(run_dir, "go")):
    time.sleep(0.02)
with open(os.path.join(os.environ["TETHER_ARTIFACTS_DIR"], "token.json"), "w") as f:
    json.dump({"sha256": hashlib.sha256(token.encode()).hexdigest(), "length": len(token)}, f)
"""


def test_secret_is_on_no_command_line_and_reaches_the_trainer(project, sshd, far):
    secret = f"s3cr3t-{uuid.uuid4().hex}"
    use_trainer(project, "secret.py", SECRET_TRAINER, sshd.backend_config(far, env={"API_TOKEN": secret}),
                "token.json")
    leaks: list[str] = []
    trainer_seen = threading.Event()
    done = threading.Event()

    def scan() -> None:  # every process on this machine (both sides of the ssh connection)
        while not done.is_set():
            for pid, cmdline in command_lines().items():
                if secret.encode() in cmdline:
                    leaks.append(f"{pid}: {cmdline!r}")
                if b"demo/secret.py" in cmdline:
                    trainer_seen.set()
            time.sleep(0.002)

    scanner = threading.Thread(target=scan, daemon=True)
    scanner.start()
    try:
        launch = project.doit("run", "launch")  # up, push and the far-side `start`, all scanned
        assert launch.returncode == 0, out(launch)
        run_id = only_run_id(project, far)
        project.wait_for(lambda: any(e.get("event") == "ready" for e in far_events(far, run_id)),
                         what="the trainer to start")
        project.wait_for(trainer_seen.is_set, what="the scan to see the trainer's command line")
        trainer = next(e for e in far_events(far, run_id) if e.get("event") == "ready")["pid"]
        with open(f"/proc/{trainer}/environ", "rb") as f:
            assert f"API_TOKEN={secret}".encode() in f.read().split(b"\0")
    finally:
        done.set()
        scanner.join(timeout=10)
    assert leaks == [], leaks

    env_file = far_run(far, run_id) / "launch_env.json"
    assert stat.S_IMODE(env_file.stat().st_mode) == 0o600
    holding = [str(p) for p in far.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]
    assert holding == [str(env_file)], holding
    (far_run(far, run_id) / "go").touch()
    train = project.doit("run", "train")
    assert train.returncode == 0, out(train)
    token = json.loads((project.local_run(run_id) / "files" / "artifacts" / "token.json").read_text())
    assert token == {"sha256": sha256_bytes(secret.encode()), "length": len(secret)}
    local = [str(p) for p in (project.root / ".tether").rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]
    assert local == [], local


# ---------------------------------------------------------------- what stays on the far side


BIG_ARTIFACT = """\
import os
out = os.environ["TETHER_ARTIFACTS_DIR"]
with open(os.path.join(out, "big.bin"), "wb") as f:
    f.write(os.urandom(2 << 20))
with open(os.path.join(out, "small.json"), "w") as f:
    f.write('{"ok": true}')
"""


@pytest.mark.parametrize("limits", [{"max_artifact_mb": 1}, {"fetch_artifacts": False}], ids=str)
def test_artifacts_left_on_the_far_side_are_named_and_block_down(project, sshd, far, limits):
    use_trainer(project, "big.py", BIG_ARTIFACT, sshd.backend_config(far, **limits), "big.bin, small.json")
    train = project.doit("run", "train")
    assert train.returncode == 0, out(train)
    run_id = only_run_id(project, far)
    left = ["artifacts/big.bin"] + ([] if "max_artifact_mb" in limits else ["artifacts/small.json"])
    for path in left:
        assert f"left on the far side: {path} (" in train.stdout, train.stdout
        assert not (project.local_run(run_id) / "files" / path).exists()
        assert (far_run(far, run_id) / path).is_file()
    if "max_artifact_mb" in limits:
        assert "above max_artifact_mb" in train.stdout, train.stdout
        assert (project.local_run(run_id) / "files" / "artifacts" / "small.json").is_file()
    verified = assert_verified(project, far, run_id)
    assert sorted(verified["remote_only"]) == left
    verify = project.doit("run", "verify")
    assert verify.returncode == 0, out(verify)

    refused = project.doit("run", "down", "confirm=yes")
    assert refused.returncode != 0, out(refused)
    assert "left on the far side" in refused.stderr and "artifacts/big.bin" in refused.stderr, out(refused)
    assert far_run(far, run_id).is_dir() and (far_run(far, run_id) / "artifacts" / "big.bin").is_file()

    project.write_config(job_text(sshd.backend_config(far, keep_remote=True, **limits),
                                  command="{python} demo/big.py", code="demo/big.py",
                                  artifacts="big.bin, small.json"))
    kept = project.doit("run", "down", "confirm=yes")
    assert kept.returncode == 0, out(kept)
    assert "keep_remote" in kept.stdout, out(kept)
    assert (far_run(far, run_id) / "artifacts" / "big.bin").is_file()


# ---------------------------------------------------------------- packages: a venv on the far side


WHICH_PYTHON = """\
import json, os, sys
import tqdm
with open(os.path.join(os.environ["TETHER_ARTIFACTS_DIR"], "python.json"), "w") as f:
    json.dump({"executable": sys.executable, "prefix": sys.prefix, "tqdm": tqdm.__file__}, f)
"""


def test_packages_build_one_venv_that_runs_use(project, sshd, far):
    backend = sshd.backend_config(far, packages=["tqdm"])
    use_trainer(project, "which.py", WHICH_PYTHON, backend, "python.json")
    up = project.doit("run", "up", timeout=300)
    assert up.returncode == 0, out(up)
    venvs = sorted((far / "venv").iterdir())
    venvs = [v for v in venvs if v.is_dir()]  # beside them: each one's build lock
    assert len(venvs) == 1 and re.fullmatch(r"[0-9a-f]{16}", venvs[0].name), venvs
    venv = venvs[0]
    assert "include-system-site-packages = true" in (venv / "pyvenv.cfg").read_text()
    assert json.loads((venv / "READY").read_text())["packages"] == ["tqdm"]
    from tether.config import load

    warned = load(str(project.root / "tether.yaml")).warnings
    assert any("packages: is deprecated: move the list to the job's environment" in w for w in warned), warned
    built = {name: (venv / name).stat().st_mtime_ns for name in ("READY", "pyvenv.cfg", "bin/python")}

    train = project.doit("run", "train", timeout=300)
    assert train.returncode == 0, out(train)
    first = only_run_id(project, far)
    seen = json.loads((project.local_run(first) / "files" / "artifacts" / "python.json").read_text())
    assert Path(seen["prefix"]).resolve() == venv.resolve(), seen
    assert Path(seen["executable"]).parent == venv / "bin", seen

    # a new run (changed command): `up` again, the same venv, not rebuilt
    (project.root / "demo" / "which.py").write_text(WHICH_PYTHON + "# second run\n")
    again = project.doit("run", "train", timeout=300)
    assert again.returncode == 0, out(again)
    assert len(project.run_ids()) == 2
    assert [v for v in sorted((far / "venv").iterdir()) if v.is_dir()] == [venv]
    assert {name: (venv / name).stat().st_mtime_ns for name in built} == built
    second = next(r for r in project.run_ids() if r != first)
    seen = json.loads((project.local_run(second) / "files" / "artifacts" / "python.json").read_text())
    assert Path(seen["prefix"]).resolve() == venv.resolve(), seen


# ---------------------------------------------------------------- prune


def test_prune_removes_objects_no_run_references(project, sshd, far):
    project.write_config(ssh_config_text(sshd, far))
    project.doit("run", "train", check=True)
    first = only_run_id(project, far)
    old_code = sha256(project.root / "demo" / "train.py")
    data = sha256(project.root / "demo" / "points.csv")
    down = project.doit("run", "down", "confirm=yes")
    assert down.returncode == 0, out(down)

    (project.root / "demo" / "train.py").write_text((project.root / "demo" / "train.py").read_text() + "# v2\n")
    project.doit("run", "train", check=True)
    second = next(r for r in project.run_ids() if r != first)
    new_code = sha256(project.root / "demo" / "train.py")
    young = b"pushed a moment ago by another invocation\n"
    young_sha = sha256_bytes(young)
    (far / "objects" / young_sha[:2]).mkdir(exist_ok=True)
    (far / "objects" / young_sha[:2] / young_sha).write_bytes(young)
    assert {old_code, new_code, data, young_sha} <= {p.name for p in object_files(far).values()}
    hours_ago = time.time() - 2 * 3600
    for name, path in object_files(far).items():
        if not name.endswith(young_sha):
            os.utime(path, (hours_ago, hours_ago))

    prune = project.doit("prune")
    assert prune.returncode == 0, out(prune)
    assert "removed 1 unreferenced objects" in prune.stdout, prune.stdout
    left = {p.name for p in object_files(far).values()}
    assert left == {new_code, data, young_sha}, left
    assert_objects_whole(far)
    assert (far / "tether").is_dir()
    still = project.doit("run", "train", check=True)  # the remaining run is intact and up to date
    assert ".  " not in still.stdout, still.stdout
    assert (far_run(far, second) / "code" / "demo" / "train.py").read_text().endswith("# v2\n")
