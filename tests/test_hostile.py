"""Hostile and unlucky input, as data: each case is an input that once lost, leaked or wedged
something, the one-line error (or safe outcome) it now gets, and proof that what it threatened
is intact afterwards.

One section per area; each section's cases are a table of `pytest.param`s.
"""

from __future__ import annotations

import pytest  # noqa: F401


# ================================================================ remote_dir ownership and prune

import hashlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from conftest import config_text  # noqa: E402
from tether import config as tether_config  # noqa: E402
from tether.backends.local import Backend as LocalBackend, Config as LocalConfig  # noqa: E402
from tether.errors import BackendError, ConfigError  # noqa: E402

HOURS_AGO = 2 * 3600  # older than the prune's age rule: only the rules on names and content keep these


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


MINE = b"the user's own bytes\n"
H = _sha(MINE)
OTHER = "00" if not H.startswith("00") else "11"  # a two-hex folder that is not H's


def _plant(root: Path, files: dict) -> None:
    """Write `files` under root (bytes: a file; str: a symlink to that target), all hours old."""
    old = time.time() - HOURS_AGO
    for rel, content in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, str):
            path.symlink_to(content)
        else:
            path.write_bytes(content)
        os.utime(path, (old, old), follow_symlinks=False)


def _tree(root: Path) -> dict:
    """Every file and link under root, by relative path: its bytes, or where the link points."""
    if not root.is_dir():
        return {}
    return {str(p.relative_to(root)): (os.readlink(p) if p.is_symlink() else p.read_bytes())
            for p in sorted(root.rglob("*")) if p.is_symlink() or p.is_file()}


def _local(tmp_path: Path, far: Path) -> LocalBackend:
    return LocalBackend("local", LocalConfig(remote_dir=str(far)), str(tmp_path / ".tether"))


# Files under objects/ of a remote_dir tether owns, which prune must leave alone: not SHA-256 hex
# in the two-level layout, or not hashing to the name, or not a plain file.
FOREIGN_OBJECTS = [
    pytest.param({"objects/notes.txt": MINE}, id="a file at the top of objects/"),
    pytest.param({f"objects/{H[:2]}/{H[:2]}{'0' * 62}": MINE}, id="a hex name its content does not hash to"),
    pytest.param({f"objects/{OTHER}/{H}": MINE}, id="the right hash in the wrong folder"),
    pytest.param({f"objects/{H[:2]}/{H.upper()}": MINE}, id="an upper-case hex name"),
    pytest.param({f"objects/{H[:2]}/{H[:2]}/{H}": MINE}, id="three levels deep"),
    pytest.param({f"objects/{H[:2]}/{H}.bak": MINE}, id="an object name with a suffix"),
    pytest.param({f"objects/{H[:2]}/{H}.tmp-mine": MINE}, id="a partial-upload look-alike tether never names"),
    pytest.param({"mine.txt": MINE, f"objects/{H[:2]}/{H}": "../../mine.txt"}, id="a link named as the object"),
    pytest.param({"objects/photos/2024/a.jpg": MINE, "objects/photos/b.jpg": MINE * 2}, id="a folder of photos"),
]


@pytest.mark.parametrize("files", FOREIGN_OBJECTS)
def test_prune_removes_only_objects_tether_wrote(tmp_path, files):
    far = tmp_path / "far"
    backend = _local(tmp_path, far)
    backend.install_launcher()
    ours = b"an object of a run that is gone\n"
    _plant(far, {f"objects/{_sha(ours)[:2]}/{_sha(ours)}": ours})  # prune's proper work: it still goes
    _plant(far, files)
    planted = {rel: content for rel, content in _tree(far).items() if not rel.startswith("tether/")}
    del planted[f"objects/{_sha(ours)[:2]}/{_sha(ours)}"]

    found = backend.prune()

    assert (found["removed"], found["bytes"]) == (1, len(ours)), found
    assert found["foreign"] == sum(rel.startswith("objects/") for rel in files), found
    after = _tree(far)
    assert {rel: after.get(rel) for rel in planted} == planted  # byte for byte


def _assert_refused(message: str, far: Path) -> None:
    assert message.startswith(f"remote_dir {far} is not empty and was not created by tether"), message
    assert "point remote_dir at a new or empty folder" in message and "\n" not in message, message


# What a remote_dir may already hold when tether is pointed at it, and must then refuse to adopt.
REFUSED_FOLDERS = [
    pytest.param({"objects/notes.txt": MINE, f"objects/{H[:2]}/{H}": MINE}, id="an objects/ of the user's own"),
    pytest.param({"thesis.tex": MINE}, id="a folder of documents"),
    pytest.param({"tether/README.md": MINE, "runs/a.txt": MINE}, id="a tether/ that is no launcher folder"),
    pytest.param({"tether/0123456789abcdef/COMPLETE": b"0123456789abcdef", "objects/x": MINE,
                  "photos/a.jpg": MINE}, id="an older tether's layout plus a folder of the user's"),
    pytest.param({"tether/0123456789abcdef/COMPLETE": b"0123456789abcdef", "runs": "/nonexistent-runs"},
                 id="an older tether's layout with a link for runs/"),
]


@pytest.mark.parametrize("files", REFUSED_FOLDERS)
def test_a_folder_tether_did_not_create_is_refused_and_left_alone(tmp_path, files):
    far = tmp_path / "far"
    _plant(far, files)
    before = _tree(far)
    backend = _local(tmp_path, far)
    for entry in (backend.install_launcher, backend.prune):
        with pytest.raises(BackendError) as refused:
            entry()
        _assert_refused(str(refused.value), far)
    report = backend.check()
    assert not report.ready and f"remote_dir {far} is not empty" in report.text(), report.text()
    assert _tree(far) == before  # nothing written, nothing removed
    assert sorted(p.name for p in far.iterdir()) == sorted({rel.split("/")[0] for rel in files})


@pytest.mark.parametrize("kind", ["local", "ssh"])
def test_doit_prune_in_a_users_folder_refuses_and_deletes_nothing(project, request, kind):
    far = project.root.parent / "users-folder"
    _plant(far, {"objects/notes.txt": MINE, f"objects/{H[:2]}/{H}": MINE, "objects/b/c.bin": MINE * 3})
    before = _tree(far)
    if kind == "ssh":
        server = request.getfixturevalue("sshd")
        backend = json.dumps(server.backend_config(far))
        project.write_config(config_text(backend_name="lab", backend=backend))
    else:
        project.write_config(config_text(backend=json.dumps({"type": "local", "remote_dir": str(far)})))

    prune = project.doit("prune")

    shown = prune.stdout + prune.stderr
    assert prune.returncode != 0, shown
    assert "unreferenced" not in shown, shown
    assert f"remote_dir {far} is not empty and was not created by tether" in shown, shown
    assert _tree(far) == before


def test_doit_prune_says_what_it_left_alone(project):
    assert project.doit("check").returncode == 0  # tether creates (and marks) .tether/remote
    far = project.root / ".tether" / "remote"
    _plant(far, {"objects/notes.txt": MINE, f"objects/{OTHER}/{H}": MINE})
    before = _tree(far / "objects")

    prune = project.doit("prune")

    assert prune.returncode == 0, prune.stdout + prune.stderr
    assert "removed 0 unreferenced objects (0 bytes); kept 0; left alone 2 files under objects/ that tether " \
           "did not write" in prune.stdout, prune.stdout
    assert _tree(far / "objects") == before


UNREADABLE_TREES = [
    pytest.param(b"null", id="null"),
    pytest.param(b"{}", id="no file list"),
    pytest.param(b'{"files": [', id="cut short"),
    pytest.param(b'{"files": [{"path": "x"}]}', id="an entry without its hash"),
]


@pytest.mark.parametrize("tree", UNREADABLE_TREES)
def test_prune_removes_nothing_while_a_runs_tree_json_cannot_be_read(tmp_path, tree):
    import hashlib

    from tether.remote import objects, owner

    far = tmp_path / "far"
    owner.claim(str(far))
    content = b"the only copy of run b's data"
    sha = hashlib.sha256(content).hexdigest()
    obj = far / "objects" / sha[:2] / sha
    _plant(far, {f"objects/{sha[:2]}/{sha}": content, "runs/b/tree.json": tree})
    os.utime(obj, (0, 0))  # old enough to be pruned, were it unreferenced
    with pytest.raises(SystemExit) as refused:
        objects.prune(str(far))
    assert "runs/b/tree.json cannot be read" in str(refused.value) and "prune removed nothing" in str(refused.value)
    assert obj.read_bytes() == content
    (far / "runs" / "b" / "tree.json").write_text(json.dumps({"files": []}))  # readable: now it is unreferenced
    assert objects.prune(str(far))["removed"] == 1 and not obj.exists()

# What a remote_dir may hold when tether is pointed at it, and may adopt (writing its marker).
ADOPTED_FOLDERS = [
    pytest.param(None, "created", id="no folder yet"),
    pytest.param({}, "created", id="an empty folder"),
    pytest.param({"tether/0123456789abcdef/COMPLETE": b"0123456789abcdef",
                  "tether/.0123456789abcdef.x1y2/tether/__init__.py": b"",
                  f"objects/{H[:2]}/{H}": MINE, "runs/old-run/tree.json": b'{"files": []}',
                  "venv/abc/READY": b"", "slurm/1_0.out": b""}, "adopted", id="an older tether's remote_dir"),
]


@pytest.mark.parametrize("files, how", ADOPTED_FOLDERS)
def test_tether_marks_the_folders_it_creates_or_adopts(tmp_path, files, how):
    far = tmp_path / "far"
    if files is not None:
        far.mkdir()
        _plant(far, files)
    before = _tree(far)
    backend = _local(tmp_path, far)
    assert backend.install_launcher() is True
    marker = json.loads((far / ".tether-remote").read_text())
    assert marker["by"] == "tether" and marker["how"].startswith(how) and marker["version"] == backend.version
    assert {rel: _tree(far).get(rel) for rel in before} == before
    assert backend.check().ready


def _problems(tmp_path: Path, backend: dict, name: str = "local") -> list:
    root = tmp_path / "proj"
    (root / "demo").mkdir(parents=True)
    for rel in ("demo/train.py", "demo/points.csv"):
        (root / rel).write_text("x\n")
    path = root / "tether.yaml"
    text = config_text(backend_name=name, backend=json.dumps(backend))
    path.write_text(text)
    line = next(n for n, t in enumerate(text.splitlines(), 1) if t.startswith(f"  {name}:"))
    with pytest.raises(ConfigError) as caught:
        tether_config.load(str(path))
    return [p for p in caught.value.problems if p.startswith(f"{path}:{line}: error: remote_dir")]


HOME = os.path.expanduser("~")
# remote_dir values that would let tether write, prune and delete in a folder it must never own.
DANGEROUS_REMOTE_DIRS = [
    pytest.param("local", "/", "the filesystem root", id="local /"),
    pytest.param("local", "//", "the filesystem root", id="local //"),
    pytest.param("local", "/./", "the filesystem root", id="local /./"),
    pytest.param("local", "~", "the home folder itself", id="local ~"),
    pytest.param("local", "~/.", "the home folder itself", id="local ~/."),
    pytest.param("local", "~/", "the home folder itself", id="local ~/"),
    pytest.param("local", HOME, "the home folder itself", id="local $HOME"),
    pytest.param("local", "/home", "a system folder", id="local /home"),
    pytest.param("local", "/usr", "a system folder", id="local /usr"),
    pytest.param("local", "/home/someone", "someone's home folder", id="local /home/someone"),
    pytest.param("ssh", "/", "the filesystem root", id="ssh /"),
    pytest.param("ssh", "//", "the filesystem root", id="ssh //"),
    pytest.param("ssh", "/./", "the filesystem root", id="ssh /./"),
    pytest.param("ssh", "~", "the home folder itself", id="ssh ~"),
    pytest.param("ssh", "~/", "the home folder itself", id="ssh ~/"),
    pytest.param("ssh", "~/.", "the home folder itself", id="ssh ~/."),
    pytest.param("ssh", "~//./", "the home folder itself", id="ssh ~//./"),
    pytest.param("ssh", ".", "the home folder itself", id="ssh . (relative to the home folder)"),
    pytest.param("ssh", "/etc", "a system folder", id="ssh /etc"),
]


@pytest.mark.parametrize("kind, remote_dir, why", DANGEROUS_REMOTE_DIRS)
def test_a_dangerous_remote_dir_is_a_config_error(tmp_path, kind, remote_dir, why):
    backend = {"type": kind, "remote_dir": remote_dir}
    if kind == "ssh":
        backend["host"] = "example.org"
    found = _problems(tmp_path, backend)
    assert len(found) == 1, found
    assert f"remote_dir {remote_dir!r} is {why}: point remote_dir at a folder of its own" in found[0], found


@pytest.mark.parametrize("remote_dir", ["~/far", "~/./far/"])
def test_local_remote_dir_expands_the_home_folder(tmp_path, monkeypatch, remote_dir):
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir(), cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    backend = LocalBackend("local", LocalConfig(remote_dir=remote_dir), str(tmp_path / ".tether"))
    assert backend.remote_dir == str(home / "far")
    backend.install_launcher()
    assert (home / "far" / "tether" / backend.version / "COMPLETE").is_file()
    assert list(cwd.iterdir()) == []  # no folder literally named ~


# (end of section: remote_dir ownership and prune)


# ================================================================ seal, artifacts, launcher failures
#
# The far side's seal and launcher against what a trainer leaves in its run dir (links out of it,
# pipes, tether's own files named as artifacts) and against the launcher's own failures. Far-side
# cases run the real launcher in the foreground (as a SLURM job does) on a run dir built by hand;
# the rest run `doit` in a throwaway project.

import hashlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from conftest import config_text  # noqa: E402
from tether import config  # noqa: E402
from tether.errors import ConfigError  # noqa: E402
from tether.paths import RunPaths  # noqa: E402
from tether.remote import rundir  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SECRET_ENV = {"HF_TOKEN": "hf_secret_do_not_pull"}  # what launch_env.json (0600) holds on the far side

SEAL_TRAINER = """\
import json, os, sys
A, R, OUTSIDE = os.environ["TETHER_ARTIFACTS_DIR"], os.environ["TETHER_RUN_DIR"], os.environ["OUTSIDE"]
with open(os.path.join(A, "model.json"), "w") as f:
    json.dump({"step": 3}, f)
"""

# (what the trainer does after writing artifacts/model.json, the artifacts of run.json, the paths the
# manifest must refuse -> words of the reason). A run.json pattern that config validation refuses
# stands for a run launched by an older tether: the seal refuses it too.
SEAL_CASES = [
    pytest.param("os.symlink('/', A + '/dir')", ["**/*"], {"artifacts/dir": "a symlink to /:"},
                 id="link-to-the-root-under-a-recursive-glob"),
    pytest.param("os.symlink('/etc/passwd', A + '/passwd')", ["*"], {"artifacts/passwd": "a symlink to /etc/passwd"},
                 id="link-to-a-file-outside"),
    pytest.param("os.symlink(OUTSIDE, A + '/weights.bin')", ["model.json", "*.bin"],
                 {"artifacts/weights.bin": "a symlink to "}, id="link-to-a-large-file-outside"),
    pytest.param("os.symlink(A, A + '/loop')", ["**/*.json"], {"artifacts/loop": "a symlink to "},
                 id="link-loop-inside-the-run-dir"),
    pytest.param("os.unlink(R + '/train.log'); os.symlink('/dev/zero', R + '/train.log')", ["model.json"],
                 {"train.log": "a symlink to /dev/zero"}, id="train-log-replaced-by-a-link-to-dev-zero"),
    pytest.param("os.mkfifo(A + '/pipe')", ["*"], {"artifacts/pipe": "not a regular file"}, id="a-named-pipe"),
    pytest.param("", ["model.json", "/etc/passwd"], {"/etc/passwd": "is an absolute path"},
                 id="absolute-pattern"),
    pytest.param("", ["model.json", "../../../../../../../etc/passwd"],
                 {"../../../../../../../etc/passwd": "is outside the run folder"}, id="deep-dotdot-pattern"),
    pytest.param("", ["model.json", "x/../../launch_env.json"],
                 {"x/../../launch_env.json": "names tether's own run file launch_env.json"},
                 id="dotdot-to-launch-env"),
    pytest.param("", ["model.json", "../*.json"], {"../*.json": "names tether's own run file"},
                 id="glob-over-the-run-dir"),
]


def _far_run(tmp_path: Path, script: str, artifacts: list[str], **spec) -> Path:
    """A far-side run dir built by hand: code/train.py, run.json, and the 0600 launch_env.json `start` writes."""
    run_dir = tmp_path / "remote" / "runs" / "h1"
    (run_dir / "code").mkdir(parents=True)
    (run_dir / "code" / "train.py").write_text(script)
    record = dict({"run_id": "h1", "argv": ["{python}", "train.py"], "artifacts": artifacts, "grace_seconds": 1,
                   "restart": {"policy": "on-preempt", "max_restarts": 3}}, **spec)
    (run_dir / "run.json").write_text(json.dumps(record))
    rundir.write_private(str(run_dir / "launch_env.json"), SECRET_ENV)
    return run_dir


def _launcher_run(run_dir: Path, timeout: float = 30) -> subprocess.CompletedProcess:
    """`launcher.py run RUN_DIR` in the foreground, as a SLURM job script runs it."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "tether.remote.launcher", "run", str(run_dir)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def _assert_secret_stayed(run_dir: Path, manifest: dict) -> None:
    """launch_env.json is still on the far side, 0600, unchanged, and no manifest entry carries it."""
    secret = run_dir / "launch_env.json"
    assert secret.stat().st_mode & 0o777 == 0o600
    assert json.loads(secret.read_text()) == SECRET_ENV
    assert "launch_env.json" not in {e["path"] for e in manifest["files"]}
    assert hashlib.sha256(secret.read_bytes()).hexdigest() not in {e["sha256"] for e in manifest["files"]}


@pytest.mark.parametrize("action, artifacts, refused", SEAL_CASES)
def test_seal_never_follows_a_link_nor_leaves_the_run_dir(tmp_path, action, artifacts, refused):
    outside = tmp_path / "outside.bin"
    outside.write_bytes(os.urandom(4 << 20))  # a large file outside the run dir
    before = hashlib.sha256(outside.read_bytes()).hexdigest()
    run_dir = _far_run(tmp_path, SEAL_TRAINER + action + "\n", artifacts, env={"OUTSIDE": str(outside)})
    done = _launcher_run(run_dir)  # before the fix: the walk of / or /dev/zero never ends (timeout)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    manifest = json.loads((run_dir / "PULL_MANIFEST.json").read_text())
    assert manifest["status"] == "completed"
    here = RunPaths("h1", str(tmp_path / "here"), str(tmp_path / "remote"))
    for entry in manifest["files"]:  # every listed path can be pulled: relative, inside, a plain file
        here.pulled(entry["path"])
        assert (run_dir / entry["path"]).is_file() and not (run_dir / entry["path"]).is_symlink(), entry
    assert "artifacts/model.json" in {e["path"] for e in manifest["files"]}  # the real result is still sealed
    _assert_secret_stayed(run_dir, manifest)
    assert hashlib.sha256(outside.read_bytes()).hexdigest() == before
    assert before not in {e["sha256"] for e in manifest["files"]}
    reasons = {e["path"]: e["reason"] for e in manifest.get("refused", [])}
    for path, words in refused.items():  # named, with the reason, so pull can say what stayed behind
        assert words in reasons.get(path, ""), manifest.get("refused")


def test_seal_walk_is_bounded(tmp_path, monkeypatch):
    """A results folder larger than the walk's cap is sealed at once, the cap named in the manifest."""
    monkeypatch.setattr(rundir, "MAX_WALK", 50)
    run_dir = _far_run(tmp_path, "", ["**/*.txt"])
    (run_dir / "artifacts" / "many").mkdir(parents=True)
    for i in range(200):
        (run_dir / "artifacts" / "many" / f"{i}.txt").write_text(str(i))
    manifest = rundir.seal(str(run_dir))
    assert [e["reason"] for e in manifest["refused"]] == [
        "more than 50 entries: the seal stopped looking there; declare narrower artifacts"]
    assert len([e for e in manifest["files"] if e["path"].startswith("artifacts/")]) <= 50
    _assert_secret_stayed(run_dir, manifest)


# (pattern in tether.yaml's artifacts:, the error after `tether.yaml:LINE: error: `)
BAD_PATTERNS = [
    pytest.param("/etc/passwd", "artifact '/etc/passwd' is an absolute path", id="absolute"),
    pytest.param("../../../../../../../etc/passwd", "artifact '../../../../../../../etc/passwd' is outside "
                 "the run folder", id="deep-dotdot"),
    pytest.param("x/../../launch_env.json", "artifact 'x/../../launch_env.json' names tether's own run file "
                 "launch_env.json (never an artifact)", id="dotdot-to-launch-env"),
    pytest.param("../state.json", "artifact '../state.json' names tether's own run file state.json", id="state"),
    pytest.param("../*", "artifact '../*' names tether's own run file", id="glob-over-the-run-dir"),
]
FIX = ("list paths relative to where the trainer writes them: the run's artifacts/ folder (TETHER_ARTIFACTS_DIR) "
       "or its working directory (the project root: out/model.pt)")


@pytest.mark.parametrize("pattern, says", BAD_PATTERNS)
def test_artifact_patterns_are_checked_at_config_time(project, pattern, says):
    text = config_text(artifacts=f"model.json, '{pattern}'")
    path = project.write_config(text)
    with pytest.raises(ConfigError) as refused:
        config.load(str(path))
    line = next(n for n, row in enumerate(text.splitlines(), 1) if row.startswith("artifacts:"))
    [problem] = refused.value.problems
    assert problem.startswith(f"{path}:{line}: error: {says}") and problem.endswith(FIX), problem


def test_artifact_pattern_refused_before_anything_runs(project):
    """`x/../../launch_env.json` would bring home the 0600 file of the backend's environment: refused
    before a run exists, so nothing is pushed or launched."""
    project.write_config(config_text(artifacts="model.json, x/../../launch_env.json"))
    done = project.doit("run", "train")
    assert done.returncode != 0
    assert "error: artifact 'x/../../launch_env.json' names tether's own run file launch_env.json" in done.stderr
    assert project.run_ids() == [] and not (project.root / ".tether" / "remote" / "runs").exists()


LINKING = """\
import json, os
from tether.trainers import runtime
A = os.environ["TETHER_ARTIFACTS_DIR"]
with open(os.path.join(A, "model.json"), "w") as f:
    json.dump({"step": 1}, f)
os.symlink("/", os.path.join(A, "dir"))
runtime.log("step", step=1, total_steps=1, loss=0.5)
"""


def _use(project, name: str, source: str, artifacts: str, extra: str = "", trainer: str = "") -> str:
    """The project's tether.yaml runs demo/NAME; `extra`: top-level YAML, `trainer`: keys of trainer:."""
    (project.root / "demo" / name).write_text(source)
    text = config_text(command="{python} demo/" + name, code="demo/" + name, artifacts=artifacts)
    command = f'  command: "{{python}} demo/{name}"\n'
    project.write_config(text.replace(command, command + trainer) + extra)
    return name


def test_a_link_to_the_root_is_refused_by_name_at_pull(project):
    _use(project, "linking.py", LINKING, "'**/*'")
    done = project.doit("run", "train", timeout=120)  # before the fix: the seal hashes the filesystem
    assert done.returncode == 0, done.stdout + done.stderr
    run = project.local_run()
    assert (run / "PULL_VERIFIED.json").is_file()
    assert (run / "files" / "artifacts" / "model.json").is_file()
    assert not os.path.lexists(run / "files" / "artifacts" / "dir")
    pulled = project.doit("pull")
    assert pulled.returncode == 0
    again = json.loads((run / "PULL_MANIFEST.json").read_text())
    assert [e["path"] for e in again["refused"]] == ["artifacts/dir"]


PREEMPTS = """\
import sys
from tether.trainers import runtime
runtime.log("step", step=1, total_steps=10, loss=1.0)
if {save}:
    runtime.save_checkpoint(lambda f: f.write(b"step 1"), 1)
print("preempted by the scheduler (marker 4242)", flush=True)
sys.exit(runtime.PREEMPTED_EXIT)
"""
CKPT = "checkpoints/ckpt-000000000001.ckpt"

# (restart: section, whether the trainer saves a checkpoint, what watch must say)
NOT_RESTARTED = [
    pytest.param("{policy: never}", True, "preempted (exit code 75) and is not restarted (restart policy 'never'); "
                 f"its latest checkpoint is {CKPT}", id="never-with-a-checkpoint"),
    pytest.param("{policy: never}", False, "preempted (exit code 75) and is not restarted (restart policy "
                 "'never'); it saved no checkpoint", id="never-without-a-checkpoint"),
    pytest.param("{policy: on-preempt, max_restarts: 0}", True, "preempted (exit code 75) and is not restarted "
                 f"(restart policy 'on-preempt', 0 of 0 restarts used); its latest checkpoint is {CKPT}",
                 id="restarts-used-up"),
]


@pytest.mark.parametrize("restart, save, says", NOT_RESTARTED)
def test_preempted_run_the_policy_will_not_restart_is_sealed_and_comes_home(project, restart, save, says):
    _use(project, "preempts.py", PREEMPTS.format(save=save), "model.json", extra=f"restart: {restart}\n")
    first = project.doit("run", "train", timeout=120)
    assert first.returncode != 0 and says in first.stderr, first.stdout + first.stderr
    assert "saved its progress" not in first.stderr
    run_id = project.run_ids()[0]
    far = project.remote_run(run_id)
    assert (far / "PULL_MANIFEST.json").is_file()
    pulled = project.doit("pull", timeout=120)  # before the fix: "no manifest yet: `doit run watch`" (a relaunch)
    assert pulled.returncode == 0, pulled.stdout + pulled.stderr
    files = project.local_run(run_id) / "files"
    assert "marker 4242" in (files / "train.log").read_text()
    assert (files / CKPT).is_file() == save
    again = project.doit("run", "train", timeout=120)  # says the same, and never launches it again
    assert again.returncode != 0 and says in again.stderr, again.stdout + again.stderr
    assert [e["event"] for e in project.events(run_id)].count("launch") == 1


EMPTY_SAFETENSORS = (2).to_bytes(8, "little") + b"{}"  # the smallest real one: a header, no tensors
HF_LIKE = """\
import json, os
from tether.trainers import runtime
for step in range(1, 4):
    runtime.log("step", step=step, total_steps=3, loss=1.0 / step)
os.makedirs("outputs/checkpoint-3", exist_ok=True)  # what Hugging Face's Trainer leaves: a folder
with open("outputs/checkpoint-3/model.safetensors", "wb") as f:
    f.write(%r)
with open(os.path.join(os.environ["TETHER_ARTIFACTS_DIR"], "model.json"), "w") as f:
    json.dump({"step": 3}, f)
""" % EMPTY_SAFETENSORS

SABOTEUR = """\
import json, os
from tether.trainers import runtime
runtime.log("step", step=1, total_steps=1, loss=0.5)
os.makedirs("out", exist_ok=True)
with open("out/ckpt.pt", "wb") as f:
    f.write(b"weights")
os.makedirs(os.path.join(os.environ["TETHER_CHECKPOINT_DIR"], "ckpt.pt"))  # where tether copies out/ckpt.pt
with open(os.path.join(os.environ["TETHER_ARTIFACTS_DIR"], "model.json"), "w") as f:
    json.dump({"step": 1}, f)
"""


def test_a_checkpoint_folder_does_not_crash_the_launcher(project):
    """`checkpoint: outputs` (a Hugging Face output folder) once killed the launcher after training: the
    run read as lost (machine rebooted?) and would have trained again. A folder is kept whole now."""
    _use(project, "hf.py", HF_LIKE, "model.json", trainer="  checkpoint: outputs\n")
    done = project.doit("run", "train", timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    run_id = project.run_ids()[0]
    state = json.loads((project.remote_run(run_id) / "state.json").read_text())
    assert state["status"] == "completed" and state["final"] is True and "launcher_error" not in state
    assert state["checkpoint"] == "checkpoints/outputs"
    files = project.local_run(run_id) / "files"
    assert (files / "artifacts" / "model.json").is_file()
    assert (files / "checkpoints" / "outputs" / "checkpoint-3" / "model.safetensors").read_bytes() == EMPTY_SAFETENSORS
    assert (project.local_run(run_id) / "PULL_VERIFIED.json").is_file()
    assert (project.remote_run(run_id) / "work" / "outputs" / "checkpoint-3" / "model.safetensors").read_bytes() \
        == EMPTY_SAFETENSORS  # the folder itself stays where the script wrote it


def test_a_launcher_failure_is_reported_as_one_and_its_results_come_home(project):
    _use(project, "saboteur.py", SABOTEUR, "model.json", trainer="  checkpoint: out/ckpt.pt\n")
    first = project.doit("run", "train", timeout=120)
    assert first.returncode != 0
    says = "ended because the launcher failed: IsADirectoryError: "
    assert says in first.stderr and "(launcher.log has the traceback; please report it)" in first.stderr, \
        first.stdout + first.stderr
    assert "rebooted" not in first.stderr
    run_id = project.run_ids()[0]
    far = project.remote_run(run_id)
    state = json.loads((far / "state.json").read_text())
    assert state["status"] == "failed" and state["final"] is True
    assert state["launcher_error"].startswith("IsADirectoryError: ")
    assert [e["error"] for e in project.events(run_id) if e["event"] == "launcher_error"] == [state["launcher_error"]]
    log = (far / "launcher.log").read_text()
    assert "Traceback (most recent call last)" in log and "_keep_mapped_checkpoint" in log
    pulled = project.doit("pull", timeout=120)
    assert pulled.returncode == 0, pulled.stdout + pulled.stderr
    assert json.loads((project.local_run(run_id) / "files" / "artifacts" / "model.json").read_text()) == {"step": 1}
    again = project.doit("run", "train", timeout=120)
    assert again.returncode != 0 and says in again.stderr
    assert [e["event"] for e in project.events(run_id)].count("launch") == 1  # never trained again



def test_a_trainer_program_that_is_not_there_is_the_commands_fault_not_a_launcher_bug(project):
    project.write_config(config_text(command="no-such-trainer-program --epochs 3", code="demo/train.py"))
    first = project.doit("run", "train", timeout=120)
    assert first.returncode != 0
    assert "its trainer could not start: FileNotFoundError: " in first.stderr, first.stdout + first.stderr
    assert "no-such-trainer-program" in first.stderr and "correct trainer.command" in first.stderr
    assert "please report it" not in first.stderr and "rebooted" not in first.stderr
    run_id = project.run_ids()[0]
    state = json.loads((project.remote_run(run_id) / "state.json").read_text())
    assert state["status"] == "failed" and state["final"] is True and "launcher_error" not in state
    assert (project.remote_run(run_id) / "PULL_MANIFEST.json").is_file()  # sealed: the log comes home
    pulled = project.doit("pull", timeout=120)
    assert pulled.returncode == 0, pulled.stdout + pulled.stderr
    log = (project.local_run(run_id) / "files" / "train.log").read_text()
    assert "the trainer could not start" in log

# (end of section: seal, artifacts, launcher failures)


# ================================================================ GPUs and SLURM guards

# The GPU cases replay real captured nvidia-smi output (tests/data/nvidia-smi/SOURCES.md says whose)
# through a stand-in `nvidia-smi` first on PATH, and run the far side's real preflight code on it;
# the SLURM cases are configs, checked by Config as `doit validate` does, against sbatch's own
# option table (which test_sbatch_option_table_is_the_installed_sbatchs compares with the real one).

import os  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
from pathlib import Path  # noqa: E402

from tether.backends.slurm import (OWN_OPTIONS, SBATCH_LONG, SBATCH_NO_ARG, SBATCH_REQUIRED_ARG, Config,  # noqa: E402
                                   sbatch_words)
import helpers  # noqa: E402
from tether.remote import machine  # noqa: E402

# Real torch.cuda.get_arch_list() of stock builds (SOURCES.md, "torch arch lists").
CU126 = {"torch": "2.7.0+cu126", "cuda": "12.6", "arch_list": "sm_50 sm_60 sm_70 sm_75 sm_80 sm_86 sm_90".split()}
CU128 = {"torch": "2.7.0+cu128", "cuda": "12.8", "arch_list": "sm_75 sm_80 sm_86 sm_90 sm_100 sm_120".split()}
CU102 = {"torch": "1.7.1", "cuda": "10.2", "arch_list": "sm_35 sm_37 sm_50 sm_60 sm_61 sm_70 sm_75".split()}
CU80 = {"torch": "1.0.1", "cuda": "8.0", "arch_list": "sm_35 sm_37 sm_50 sm_52 sm_53 sm_60 sm_61".split()}
CPU_ONLY = {"torch": "2.13.0+cpu", "cuda": None, "arch_list": []}


@pytest.fixture
def replay_nvidia_smi(tmp_path, monkeypatch):
    """replay(memory, code, capability): nvidia-smi on PATH now prints those captured files and exits `code`."""
    def replay(memory: str, code: int = 0, capability: str = "query-gpu-compute_cap.txt") -> None:
        script = helpers.replay_nvidia_smi(tmp_path / "bin", memory, code, capability)
        monkeypatch.setenv("PATH", f"{script.parent}{os.pathsep}{os.environ['PATH']}")
    return replay


def gpu_lines(found: dict, settings: dict) -> dict:
    """The preflight's GPU lines, by name, as `doit check` shows them."""
    return helpers.preflight_lines(found, settings)


# replayed output, its exit code, gpus:, min_free_gpu_mb, whether check passes, what its gpu line
# says, and what a launch gets (the launcher's gpu_env: CUDA_VISIBLE_DEVICES, or its one-line error)
NVIDIA_SMI_CASES = [
    pytest.param("no-devices.txt", 6, "auto", 2000, True,
                 "no usable GPU (nvidia-smi exited 6: No devices were found): the trainer runs on the CPU", {},
                 id="no-devices-trains-on-cpu"),
    pytest.param("driver-failure.txt", 9, "auto", 2000, True,
                 "no usable GPU (nvidia-smi exited 9: NVIDIA-SMI has failed because it couldn't communicate with "
                 "the NVIDIA driver. Make sure that the latest NVIDIA driver is installed and running.): the "
                 "trainer runs on the CPU", {}, id="driver-failure-trains-on-cpu"),
    pytest.param("no-devices.txt", 6, "0", 2000, False,
                 "gpus '0' names GPUs, but nvidia-smi exited 6: No devices were found: fix the driver, or set "
                 "gpus: auto to train on the CPU", "gpus '0' names GPUs, but nvidia-smi exited 6",
                 id="no-devices-but-gpus-named"),
    pytest.param("nvml-mismatch.txt", 18, "auto", 2000, False,
                 "nvidia-smi exited 18: Failed to initialize NVML: Driver/library version mismatch NVML library "
                 "version: 535.161: make nvidia-smi work on the far side, or set gpus: none",
                 "Failed to initialize NVML: Driver/library version mismatch", id="other-failures-say-why"),
    pytest.param("query-gpu-memory-gb10.txt", 0, "auto", 2000, False,
                 "needs 1 GPU(s) with ≥ 2000 MB free; found 0 (0: free memory unknown): wait for memory to free up "
                 "(or lower min_free_gpu_mb), or set gpus: none to train on the CPU (min_free_gpu_mb: 0 accepts "
                 "a GPU whose free memory nvidia-smi cannot report)",
                 "needs 1 GPU(s) with ≥ 2000 MB free; found 0 (0: free memory unknown)",
                 id="na-memory-is-unknown-not-a-crash"),
    pytest.param("query-gpu-memory-gb10.txt", 0, "auto", 0, True,
                 "0: NVIDIA GB10, free memory unknown ([N/A]), 0% busy; a run gets CUDA_VISIBLE_DEVICES=0",
                 {"CUDA_VISIBLE_DEVICES": "0"}, id="na-memory-accepted-when-nothing-asked"),
    pytest.param("query-gpu-memory-util-na.txt", 0, "auto", 1000, True,
                 "0: NVIDIA RTX A4000, 932/16376 MB free, utilization unknown; 1: NVIDIA RTX A5000, 9087/24564 MB "
                 "free, utilization unknown; a run gets CUDA_VISIBLE_DEVICES=1 (passed over: 0: 932 MB free)",
                 {"CUDA_VISIBLE_DEVICES": "1"}, id="na-utilization-is-unknown-not-a-crash"),
]


@pytest.mark.parametrize("output, code, gpus, min_free, ok, detail, launch", NVIDIA_SMI_CASES)
def test_nvidia_smi_edge_cases(replay_nvidia_smi, tmp_path, output, code, gpus, min_free, ok, detail, launch):
    replay_nvidia_smi(output, code, capability=output if code else "query-gpu-compute_cap.txt")
    settings = {"remote_dir": str(tmp_path / "far"), "gpus": gpus, "min_free_gpu_mb": min_free}
    found = machine.check(settings)  # the far side's real preflight
    line = gpu_lines(found, settings)["gpu"]
    assert (line["ok"], line["detail"]) == (ok, detail), found
    if isinstance(launch, dict):
        assert machine.gpu_env(settings) == launch  # what the launcher starts the trainer with
    else:
        with pytest.raises(ValueError, match=re.escape(launch)):
            machine.gpu_env(settings)


# torch's probe on the far side, GPUs replayed from the captures (query-gpu-memory.txt: GPU 1 has the
# most free memory; query-gpu-compute_cap.txt: GPU 0 is sm_70, GPU 1 sm_89), whether the host is
# accepted, which GPUs are usable, what the torch line says, and the GPU a run gets (at check and launch)
TORCH_KERNEL_CASES = [
    pytest.param(CU126, True, [0, 1], ["torch 2.7.0+cu126 (CUDA 12.6) has kernels for these GPUs"], "1",
                 id="sm_89-runs-the-stock-sm_86-cubin"),
    pytest.param(CU128, True, [1], ["has kernels for GPU(s) 1; skipped: 0 (sm_70): torch's arch list "
                                    "(sm_75, sm_80, sm_86, sm_90, sm_100, sm_120) has nothing for sm_70"], "1",
                 id="one-gpu-without-kernels-is-skipped"),
    pytest.param(CU102, True, [0], ["has kernels for GPU(s) 0; skipped: 1 (sm_89)"], "0",
                 id="the-freest-gpu-without-kernels-is-not-chosen"),
    pytest.param(CU80, False, [], ["has kernels for no GPU here: 0 (sm_70): ", "1 (sm_89): ",
                                   "install a torch build for these GPUs"], None, id="no-gpu-has-kernels-refuses"),
    pytest.param(CPU_ONLY, False, [], ["0 (sm_70): torch 2.13.0+cpu is a CPU-only build; 1 (sm_89): torch "
                                       "2.13.0+cpu is a CPU-only build"], None, id="cpu-only-torch-refuses"),
]


@pytest.mark.parametrize("probe, ok, usable, details, chosen", TORCH_KERNEL_CASES)
def test_torch_kernels_per_gpu(replay_nvidia_smi, tmp_path, probe, ok, usable, details, chosen):
    replay_nvidia_smi("query-gpu-memory.txt")
    settings = {"remote_dir": str(tmp_path), "gpus": "auto", "min_free_gpu_mb": 900}
    found = machine.gpu_check(settings, torch_needed=True, torch_probe=probe)
    assert found["torch"]["usable"] == usable, found
    lines = gpu_lines(found, settings)
    assert lines["torch kernels"]["ok"] is ok, lines
    for detail in details:
        assert detail in lines["torch kernels"]["detail"], lines
    if chosen is None:  # no GPU has kernels: the run is refused, each GPU named with its reason
        assert not lines["gpu"]["ok"] and "needs 1 GPU(s)" in lines["gpu"]["detail"], lines
        with pytest.raises(ValueError, match="0: no kernels: .*; 1: no kernels: "):
            machine.gpu_env(settings)  # the launch, which does not probe torch: the preflight's verdict
    else:
        assert lines["gpu"]["ok"] and f"a run gets CUDA_VISIBLE_DEVICES={chosen}" in lines["gpu"]["detail"], lines
        assert machine.gpu_env(settings) == {"CUDA_VISIBLE_DEVICES": chosen}  # the launch, which does not probe torch
    machine.gpu_check(settings, torch_needed=False)  # a trainer without torch: no GPU is skipped any more
    assert machine.gpu_env(settings) == {"CUDA_VISIBLE_DEVICES": "1"}


# torch's rule, one GPU at a time: compute capability, arch list, the entry that runs it (None: none)
KERNEL_RULE_CASES = [
    pytest.param((8, 9), CU126["arch_list"], "sm_86", id="sm_89-gets-sm_86"),
    pytest.param((8, 6), CU126["arch_list"], "sm_86", id="exact"),
    pytest.param((8, 0), ["sm_86"], None, id="a-newer-minor-cubin-does-not-run-on-an-older-gpu"),
    pytest.param((9, 0), ["sm_86"], None, id="cubins-stay-within-their-major"),
    pytest.param((12, 1), CU128["arch_list"], "sm_120", id="gb10-sm_121-gets-sm_120"),
    pytest.param((9, 0), ["sm_80", "compute_80"], "compute_80", id="ptx-is-jit-compiled-for-newer-gpus"),
    pytest.param((8, 0), ["compute_86"], None, id="ptx-not-for-older-gpus"),
    pytest.param((9, 0), ["sm_90a"], "sm_90a", id="arch-specific-on-its-gpu"),
    pytest.param((10, 3), ["sm_100a"], None, id="arch-specific-nowhere-else"),
    pytest.param((8, 9), [], None, id="empty-arch-list"),
]


@pytest.mark.parametrize("capability, arch_list, expected", KERNEL_RULE_CASES)
def test_torch_kernel_rule(capability, arch_list, expected):
    assert machine.kernel_for(capability, arch_list) == expected


# sbatch_options, and the one-line error each gets from `doit validate` (None: accepted)
SBATCH_OPTION_CASES = [
    pytest.param(("--out=x",), "'--out=x' is set by tether itself (sbatch reads it as --output)", id="long-prefix"),
    pytest.param(("--outp", "x"), "'--outp x' is set by tether itself (sbatch reads it as --output)",
                 id="long-prefix-value-apart"),
    pytest.param(("-D/",), "'-D/' is set by tether itself (sbatch reads it as --chdir)", id="short-value-attached"),
    pytest.param(("-ofile",), "'-ofile' is set by tether itself (sbatch reads it as --output)", id="short-o-attached"),
    pytest.param(("-HD/",), "'-HD/' is set by tether itself (sbatch reads it as --chdir)", id="short-bunched"),
    pytest.param(("--chd=/elsewhere",), "'--chd=/elsewhere' is set by tether itself (sbatch reads it as --chdir): "
                 "remove it: the job starts in its run dir",
                 id="chdir-prefix"),
    pytest.param(("--job=mine",), "'--job=mine' is set by tether itself (sbatch reads it as --job-name): set job_name: "
                 "instead", id="job-name-prefix"),
    pytest.param(("--pars",), "'--pars' is set by tether itself (sbatch reads it as --parsable)", id="parsable-prefix"),
    pytest.param(("--sig=USR1@5",), "'--sig=USR1@5' is set by tether itself (sbatch reads it as --signal): set "
                 "signal_grace_s: instead", id="signal-prefix"),
    pytest.param(("-t", "5"), "'-t 5' is set by tether itself (sbatch reads it as --time): set time: instead",
                 id="time-overrides-the-time-key"),
    pytest.param(("--no-requeue",), "'--no-requeue' is set by tether itself: remove it: the restart policy",
                 id="no-requeue"),
    pytest.param(("--o=x",), "'--o=x' is ambiguous: sbatch reads it as one of --open-mode, --output, --overcommit, "
                 "--oversubscribe; write the option in full", id="ambiguous-prefix"),
    pytest.param(("--acount=ml",), "'--acount=ml' is not an sbatch option (did you mean --account", id="unknown-long"),
    pytest.param(("-X",), "'-X': -X is not an sbatch option", id="unknown-short"),
    pytest.param(("--account",), "'--account' needs a value: --account=VALUE", id="missing-value"),
    pytest.param(("--hold=yes",), "'--hold=yes' takes no value: --hold", id="value-for-a-flag"),
    pytest.param(("gpu:1",), "'gpu:1' is not an option: write each one as --name=value", id="not-an-option"),
    pytest.param(("--gres=gpu:1",), "'--gres=gpu:1' is set by tether itself: set gres: instead", id="gres-key"),
    pytest.param(("--account=ml", "--qos=high", "-A", "ml", "--mail-type", "END", "-Hv", "--exclusive", "--nice"),
                 "'--nice' is set by tether itself: set nice: instead", id="nice-key"),
    pytest.param(("--account=ml", "--qos=high", "--gpus-per-node=2", "-A", "ml", "--mail-type", "END", "-Hv",
                  "--exclusive", "--acco=ml", "-k"), None, id="ordinary-options-pass"),
]


@pytest.mark.parametrize("options, error", SBATCH_OPTION_CASES)
def test_sbatch_options_are_resolved_as_sbatch_does(options, error):
    problems = Config(host="login", remote_dir="~/tether", sbatch_options=options).problems()
    if error is None:
        assert problems == []
    else:
        assert len(problems) == 1 and problems[0].startswith(f"sbatch_options: {error}"), problems


# remote_dir, and whether it is refused as /tmp (which compute nodes do not share)
REMOTE_DIR_CASES = [
    pytest.param("//tmp/x", True, id="double-slash"),
    pytest.param("///tmp", True, id="triple-slash"),
    pytest.param("/var//tmp/runs", True, id="inner-double-slash"),
    pytest.param("/var/./tmp", True, id="dot"),
    pytest.param("/tmp/", True, id="trailing-slash"),
    pytest.param("//scratch/tmp/tether", False, id="shared-folder-named-tmp"),
]


@pytest.mark.parametrize("remote_dir, refused", REMOTE_DIR_CASES)
def test_remote_dir_under_tmp_is_refused_however_written(remote_dir, refused):
    problems = Config(host="login", remote_dir=remote_dir).problems()
    expected = [f"remote_dir {remote_dir!r} is under /tmp or /var/tmp, which compute nodes do not share: use a "
                f"folder on shared storage (e.g. ~/tether or /scratch/$USER/tether)"] if refused else []
    assert problems == expected


# time, signal_grace_s, and the error (None: accepted)
SIGNAL_GRACE_CASES = [
    pytest.param("00:01:00", 120, "signal_grace_s 120 is not below time 00:01:00 (60 s): the time-limit warning "
                 "would come as the job starts; lower signal_grace_s well below 60, or raise time", id="above"),
    pytest.param("2", 120, "signal_grace_s 120 is not below time 2 (120 s)", id="equal-in-plain-minutes"),
    pytest.param("00:10:00", 120, None, id="below"),
    pytest.param("1-00:00:00", 600, None, id="days"),
]


@pytest.mark.parametrize("time, grace, error", SIGNAL_GRACE_CASES)
def test_signal_grace_must_be_below_the_time_limit(time, grace, error):
    problems = Config(host="login", remote_dir="~/tether", time=time, signal_grace_s=grace).problems()
    if error is None:
        assert problems == []
    else:
        assert len(problems) == 1 and problems[0].startswith(error), problems


def _sbatch_resolves(prefix: str, env: dict) -> str:
    """What the real sbatch's getopt_long makes of `--prefix`: a long name, 'ambiguous' or 'unknown' (or
    'accepted' for an option whose argument is optional: getopt then names nothing)."""
    def first_line(*args: str) -> str:
        done = subprocess.run(["sbatch", *args], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              env=env, timeout=30)
        return (done.stderr + done.stdout).strip().splitlines()[0]

    said = first_line(f"--{prefix}=1")
    if "is ambiguous" in said or "unrecognized option" in said:
        return "ambiguous" if "is ambiguous" in said else "unknown"
    named = re.search(r"option '--([a-z-]+)' (doesn't allow|requires)", said) or \
        re.search(r"option '--([a-z-]+)' requires", first_line(f"--{prefix}"))
    return named.group(1) if named else "accepted"


def _tether_resolves(prefix: str) -> str:
    """What Config makes of `--prefix`, in _sbatch_resolves's words."""
    found, problems = sbatch_words((f"--{prefix}=1",))
    return found[0][1] if found else ("ambiguous" if "is ambiguous" in problems[0] else "unknown")


@pytest.mark.skipif(shutil.which("sbatch") is None, reason="sbatch is not installed here")
def test_sbatch_option_table_is_the_installed_sbatchs(tmp_path):
    """The committed table against the real sbatch: every long name (from its own "possibilities"),
    and the prefixes the cases above rely on. sbatch parses options before it needs a controller."""
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=x\nSlurmctldHost=localhost\nNodeName=localhost CPUs=1 State=UNKNOWN\n"
                    "PartitionName=debug Nodes=localhost Default=YES\n")
    env = dict(os.environ, SLURM_CONF=str(conf))
    listed = set()
    for letter in "abcdefghijklmnopqrstuvwxyz":
        done = subprocess.run(["sbatch", f"--{letter}=1"], stdin=subprocess.DEVNULL, capture_output=True,
                              text=True, env=env, timeout=30)
        listed |= set(re.findall(r"'--([a-z-]+)'", done.stderr.splitlines()[0])) - {f"{letter}=1"}
    singles = {name for name in SBATCH_LONG if sum(n[0] == name[0] for n in SBATCH_LONG) == 1}
    assert listed | singles == set(SBATCH_LONG)
    for prefix, expected in [("out", "output"), ("outp", "output"), ("chd", "chdir"), ("job", "job-name"),
                             ("pars", "parsable"), ("sig", "signal"), ("o", "ambiguous"), ("acount", "unknown"),
                             ("acco", "account"), ("acc", "ambiguous"), ("hold", "hold")]:
        assert (_sbatch_resolves(prefix, env), _tether_resolves(prefix)) == (expected, expected), prefix
    # each option's argument, for those whose argument decides what the next word is (a value or an option)
    for name in sorted(set(OWN_OPTIONS) | (set(SBATCH_LONG) - SBATCH_NO_ARG - SBATCH_REQUIRED_ARG)):
        assert (_sbatch_resolves(name, env) == "accepted") == (name not in SBATCH_NO_ARG | SBATCH_REQUIRED_ARG), name


# (end of section: GPUs and SLURM guards)


# ================================================================ config input and command line

import json  # noqa: E402
import shlex  # noqa: E402
import subprocess  # noqa: E402

from conftest import config_text, ssh_config_text  # noqa: E402
from sshd import keygen  # noqa: E402

CLEAN = config_text(epochs=3)
COMMAND = '  command: "{python} demo/train.py --epochs 3"\n'


def _edited(old: str, new: str, text: str = CLEAN) -> str:
    """`text` with `old` replaced by `new` (a stale `old` fails loudly instead of testing nothing)."""
    assert old in text, f"{old!r} is not in the config"
    return text.replace(old, new, 1)


def _line(text: str, needle: str) -> int:
    """1-based number of the first line of `text` that contains `needle`."""
    return next(n for n, line in enumerate(text.splitlines(), 1) if needle in line)


def _with_env(lines: str, text: str = CLEAN) -> str:
    """The clean config whose trainer has `env:` with these (indented) lines."""
    return _edited(COMMAND, COMMAND + "  env:\n" + lines, text)


# Billion laughs: nine levels of ten aliases each reach 10**9 strings from 10 short lines.
LAUGHS = _with_env("    L0: &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
    f"    L{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]\n" for i in range(1, 9)))
# One 200 KB string, aliased 60 times: 12 MB of text from a 200 KB file.
LONG_TEXT = _with_env(f"    A: &a \"{'x' * 200_000}\"\n    B: [{', '.join(['*a'] * 60)}]\n")
UNBALANCED = "{python} demo/train.py --epochs 3 --name 'x"
TRAILING_BACKSLASH = "{python} demo/train.py --epochs 3 \\"
ENV_LIST = _with_env("    A: [1, 2]\n")
ENV_NULL = _with_env("    A:\n")
SSH_ENV = config_text(epochs=3, backend_name="lab", backend="{type: ssh, host: example.org, env: {A: {x: 1}}}")
HUGE_INT = _edited("grace_seconds: 5", "grace_seconds: " + "9" * 5000)

# The config file's bytes -> the one line `doit status` says about it (after `error: status: `).
CONFIG_INPUTS = [
    pytest.param(_edited("name: demo", "name: d\xe9mo").encode("latin-1"),
                 "tether.yaml:1: error: not UTF-8 (byte 0xe9 at offset 7): save the file as UTF-8", id="latin-1"),
    pytest.param(_edited("grace_seconds: 5", "grace_seconds: 5 # \xff").encode("latin-1"),
                 f"tether.yaml:{_line(CLEAN, 'grace_seconds')}: error: not UTF-8 (byte 0xff at offset "
                 f"{CLEAN.index('grace_seconds: 5') + 19}): save the file as UTF-8", id="bad-byte-on-a-later-line"),
    pytest.param(CLEAN.encode("utf-16"), "tether.yaml:1: error: not UTF-8 (byte 0xff at offset 0): "
                 "save the file as UTF-8", id="utf-16"),
    pytest.param(_edited(COMMAND, f'  command: "{UNBALANCED}"\n').encode(),
                 f"tether.yaml:{_line(CLEAN, 'command:')}: error: trainer.command: No closing quotation: "
                 f"{UNBALANCED!r}: balance the quotes, or give the command as a list of words", id="unbalanced-quote"),
    pytest.param(_edited(COMMAND, f"  command: '{TRAILING_BACKSLASH}'\n").encode(),
                 f"tether.yaml:{_line(CLEAN, 'command:')}: error: trainer.command: No escaped character: "
                 f"{TRAILING_BACKSLASH!r}: remove the trailing backslash", id="trailing-backslash"),
    pytest.param(LAUGHS.encode(), f"tether.yaml:{_line(CLEAN, 'trainer:')}: error: the config expands to more "
                 f"than 100000 values (YAML aliases?)", id="billion-laughs-in-env"),
    pytest.param(LONG_TEXT.encode(), f"tether.yaml:{_line(CLEAN, 'trainer:')}: error: the config expands to more "
                 f"than 10 MiB of text (YAML aliases?)", id="aliased-long-text"),
    pytest.param(ENV_LIST.encode(), f"tether.yaml:{_line(ENV_LIST, 'A: [1, 2]')}: error: env 'A' in trainer "
                 f"(type command): expected a string, number or true/false, got a list (environment variables "
                 f"are text)", id="env-value-a-list"),
    pytest.param(ENV_NULL.encode(), f"tether.yaml:{_line(ENV_NULL, '    A:')}: error: env 'A' in trainer "
                 f"(type command): expected a string, number or true/false, got nothing (environment variables "
                 f"are text): give a value", id="env-value-missing"),
    pytest.param(SSH_ENV.encode(), f"tether.yaml:{_line(SSH_ENV, 'env:')}: error: env 'A' in backend 'lab' "
                 f"(type ssh): expected a string, number or true/false, got a mapping", id="backend-env-a-mapping"),
    pytest.param(CLEAN.encode() + b"#" * (1 << 20), "tether.yaml: error: larger than 1024 KiB, far more than a "
                 "config needs", id="over-1-MiB"),
    pytest.param(CLEAN.encode() + b"deep: " + b"[" * 5000 + b"]" * 5000 + b"\n",
                 f"tether.yaml:{CLEAN.count(chr(10)) + 1}: error: not a config: [ and {{ nested more than 64 deep: "
                 f"flatten it", id="deep-flow-nesting"),
    pytest.param(CLEAN.encode() + b"deep:\n" + b"- " * 5000 + b"x\n",
                 "tether.yaml: error: not a config: nested hundreds of levels deep: flatten it",
                 id="deep-block-nesting"),
    pytest.param(_edited("  type: command", "  type: [command]").encode(),
                 f"tether.yaml:{_line(CLEAN, 'type: command')}: error: unknown trainer type ['command']; available: ",
                 id="trainer-type-a-list"),
    pytest.param(_edited("name: demo", "name: de\amo").encode(),
                 "tether.yaml:1: error: not valid YAML: character '\\x07' is not allowed: remove it",
                 id="control-character"),
    pytest.param(HUGE_INT.encode(), "tether.yaml: error: not valid YAML: Exceeds the limit (4300 digits) for "
                 "integer string conversion: value has 5000 digits: shorten that value", id="5000-digit-number"),
]


def _one_error_line(done: subprocess.CompletedProcess, task: str) -> str:
    """The single `error: TASK: ...` line that is all of stderr (no traceback, nothing else)."""
    everything = done.stdout + done.stderr
    assert "Traceback" not in everything, everything
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {task}: "), everything
    return lines[0]


@pytest.mark.parametrize("data, message", CONFIG_INPUTS)
def test_hostile_config_is_one_line_at_its_place(project, data, message):
    (project.root / "tether.yaml").write_bytes(data)
    done = project.doit("status", timeout=60)
    assert done.returncode == 1, done.stdout + done.stderr
    assert message in _one_error_line(done, "status")
    assert not (project.root / ".tether" / "runs").exists()


# Command-line words -> the task, and the one line it says (after `error: TASK: `).
COMMAND_LINES = [
    pytest.param("doit", ["status", "config=/etc"], "/etc: error: is a directory: pass config=PATH to a YAML file",
                 id="doit-config-is-a-directory"),
    pytest.param("tether", ["status", "config=/etc"], "/etc: error: is a directory: pass config=PATH to a YAML file",
                 id="tether-config-is-a-directory"),
    pytest.param("doit", ["check", "config=/dev/zero"], "/dev/zero: error: larger than 1024 KiB",
                 id="config-is-endless"),
    pytest.param("doit", ["check", "json=maybe"], "json=maybe: use 1/0, yes/no, true/false or on/off",
                 id="json-maybe"),
    pytest.param("tether", ["down", "confirm=sure"], "confirm=sure: use 1/0, yes/no, true/false or on/off",
                 id="confirm-sure"),
    pytest.param("doit", ["status", "json="], "json=: use 1/0, yes/no, true/false or on/off", id="json-empty"),
]


@pytest.mark.parametrize("runner, words, message", COMMAND_LINES)
def test_hostile_command_line_is_one_line(project, runner, words, message):
    (project.root / ".tether").mkdir(exist_ok=True)  # `tether` in a fresh folder is another item's
    done = getattr(project, runner)(*words, timeout=60)
    assert done.returncode == 1, done.stdout + done.stderr
    assert message in _one_error_line(done, words[0])


@pytest.mark.parametrize("word, is_json", [("0", False), ("off", False), ("No", False), ("false", False),
                                           ("1", True), ("on", True), ("TRUE", True), ("yes", True)])
def test_json_word_is_read_as_yes_or_no(project, word, is_json):
    done = project.doit("check", f"json={word}", timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    report = [line for line in done.stdout.splitlines() if line.startswith(("{", "ok "))]
    assert report, done.stdout
    assert report[0].startswith("{") is is_json, done.stdout
    if is_json:
        assert json.loads(report[0])["backend"] == "local"


@pytest.mark.parametrize("word, fails", [("on", True), ("Yes", True), ("off", False), ("0", False)])
def test_strict_word_is_read_as_yes_or_no(project, word, fails):
    project.write_config(_edited("artifacts: [model.json, metrics.json]\n", ""))  # warns: no artifacts
    done = project.doit("validate", f"strict={word}", timeout=60)
    assert "no artifacts declared" in done.stdout, done.stdout
    assert done.returncode == (1 if fails else 0), done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr


def test_auth_failure_names_the_exact_ssh_command(project, sshd, tmp_path):
    stranger = tmp_path / "stranger"
    keygen(stranger, "not-authorized")
    project.write_config(ssh_config_text(sshd, tmp_path / "far", identity_file=str(stranger), connect_timeout_s=5))
    done = project.doit("check", timeout=60)
    assert done.returncode == 1, done.stdout + done.stderr
    line = _one_error_line(done, "check")
    command = (f"ssh -o BatchMode=yes -o UserKnownHostsFile={sshd.known_hosts} -p {sshd.port} -i {stranger} "
               f"root@127.0.0.1 true")
    assert f"authentication failed: `{command}` must work without a prompt: put {stranger}.pub into" in line, line
    # The hint is the real thing: that command fails as tether did, and works with the authorized key.
    argv = shlex.split(line.split("`")[1])
    refused = subprocess.run(argv, capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
    assert refused.returncode == 255 and "Permission denied" in refused.stderr, refused.stderr
    argv[argv.index(str(stranger))] = str(sshd.client_key)
    assert subprocess.run(argv, capture_output=True, timeout=30, stdin=subprocess.DEVNULL).returncode == 0


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


def _sftp_under_way(project, far, running) -> bool:
    """The large file is coming in (its .part grows)."""
    try:
        return _pulled(project, "artifacts/big.bin.part").stat().st_size > 0
    except (FileNotFoundError, AssertionError):
        return False


def _tar_under_way(project, far, running) -> bool:
    """This pull has asked the far side's serve process to `send` this run's small files as one tar (not
    another test's): TETHER_TRACE=1 names each far-side request on doit's stderr as it is sent."""
    return f"] send run_dir={far}/runs/" in running.text("stderr")


STALL_CASES = [
    pytest.param(_sftp_under_way, True, id="frozen during the resumable read of a large file"),
    pytest.param(_tar_under_way, False, id="frozen during the tar of small files"),
]


def _signal_sessions(server, sig) -> None:
    """Signal every connection sshd serves (each is a session of its own), not the listener."""
    for pid in server.sessions():
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            pass


def _frozen_mid_transfer(project, server, command: list[str], under_way, says: str) -> None:
    """Start `doit COMMAND`, freeze every sshd session once `under_way(running)`, and require the stall's one
    line within a bounded time (without the watchdog the command waits for ever)."""
    running = _Background(project.start(*command))
    try:
        _poll(lambda: under_way(running) or running.proc.poll() is not None, 120, f"{command[-1]} under way")
        assert running.proc.poll() is None, f"{command[-1]} ended before it could be frozen:\n{running.output()}"
        _signal_sessions(server, signal.SIGSTOP)
        frozen = time.monotonic()
        code = running.finish(timeout=60)
    finally:
        _signal_sessions(server, signal.SIGCONT)
        if running.proc.poll() is None:
            running.kill()
    took = time.monotonic() - frozen
    said = running.text("stdout") + running.text("stderr")
    assert code != 0, said
    assert f"{says}; nothing is lost: run the same command again" in said, said
    assert took < 20, f"the stall was reported {took:.0f}s after the freeze"


@pytest.mark.parametrize("under_way, resumes", STALL_CASES)
def test_a_stalled_transfer_fails_in_bounded_time_and_the_rerun_resumes(project, tmp_path, monkeypatch, under_way,
                                                                       resumes):
    from sshd import SSHServer

    monkeypatch.setenv("TETHER_TRACE", "1")  # the far-side requests on stderr: _tar_under_way reads them

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
        _frozen_mid_transfer(project, server, ["pull"], lambda running: under_way(project, far, running),
                             "the copy from root@127.0.0.1 sent nothing for 2 s")
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
