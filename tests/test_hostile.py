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


# (end of section: seal, artifacts, launcher failures)


# ================================================================ GPUs and SLURM guards


# (end of section: GPUs and SLURM guards)


# ================================================================ config input and command line


# (end of section: config input and command line)


# ================================================================ pull, verify and transfers


# (end of section: pull, verify and transfers)
