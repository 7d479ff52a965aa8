"""The manifest module on its own: parsing the far side's bytes, the durable save, down's one gate."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from tether import manifest
from tether.errors import ManifestError, RunError
from tether.paths import RunPaths

MODEL = b'{"w": [1, 2]}'
LEFT = {"artifacts/big.bin": "2.0 MB is above max_artifact_mb (1)"}


def sealed(files: dict[str, bytes], **extra) -> bytes:
    """A manifest shaped like the far side's seal (tether.remote.rundir.seal) for `files`."""
    entries = [{"path": p, "bytes": len(b), "sha256": hashlib.sha256(b).hexdigest()} for p, b in sorted(files.items())]
    body = {"format": 1, "run_id": "demo-1", "status": "completed", "sealed_at": 1.0, "files": entries,
            "missing": [], "refused": [], "artifacts": ["model.json"]}
    return (json.dumps(dict(body, **extra), indent=2, sort_keys=True) + "\n").encode()


@pytest.fixture
def run(tmp_path: Path) -> RunPaths:
    return RunPaths("demo-1", str(tmp_path / ".tether"), "/far/remote")


def pulled(run: RunPaths, files: dict[str, bytes]) -> bytes:
    """`files` pulled here with their manifest saved; the manifest's bytes."""
    for path, data in files.items():
        Path(run.pulled(path)).parent.mkdir(parents=True, exist_ok=True)
        Path(run.pulled(path)).write_bytes(data)
    data = sealed(files)
    assert manifest.save_pulled(run, data) == ""
    return data


# ---------------------------------------------------------------- parsing


def test_a_sealed_manifest_parses_into_typed_entries():
    data = sealed({"artifacts/model.json": MODEL, "train.log": b""},
                  refused=[{"path": "artifacts/link", "reason": "a symbolic link"}], missing=["extra.bin"])
    listed = manifest.Manifest.parse(data, "here", "fix it")
    assert listed.files == (manifest.FileEntry("artifacts/model.json", len(MODEL), hashlib.sha256(MODEL).hexdigest()),
                            manifest.FileEntry("train.log", 0, hashlib.sha256(b"").hexdigest()))
    assert listed.refused == (manifest.Refused("artifacts/link", "a symbolic link"),)
    assert (listed.missing, listed.artifacts, listed.status) == (("extra.bin",), ("model.json",), "completed")
    assert listed.sha256 == hashlib.sha256(data).hexdigest()
    bare = manifest.Manifest.parse(b'{"files": []}', "here", "fix it")  # an older seal's optional keys
    assert (bare.files, bare.refused, bare.missing, bare.artifacts, bare.status) == ((), (), (), (), None)


GOOD = {"path": "a.txt", "bytes": 1, "sha256": "0" * 64}
MALFORMED = [
    pytest.param(b"{not json", "Expecting property name", id="not JSON"),
    pytest.param(b"\xff\xfe", "codec can't decode", id="not UTF-8"),
    pytest.param(b"[]", "no list of files", id="not an object"),
    pytest.param(b'{"files": {}}', "no list of files", id="files not a list"),
    pytest.param(json.dumps({"files": ["a.txt"]}).encode(), "a files item is str", id="an item not an object"),
    pytest.param(json.dumps({"files": [dict(GOOD, bytes="1")]}).encode(), "no size", id="bytes a string"),
    pytest.param(json.dumps({"files": [dict(GOOD, bytes=True)]}).encode(), "no size", id="bytes a bool"),
    pytest.param(json.dumps({"files": [dict(GOOD, bytes=-1)]}).encode(), "no size", id="bytes negative"),
    pytest.param(json.dumps({"files": [dict(GOOD, path="")]}).encode(), "no path", id="an empty path"),
    pytest.param(json.dumps({"files": [dict(GOOD, sha256="ABC")]}).encode(), "not 64 hex digits", id="a bad digest"),
    pytest.param(json.dumps({"files": [GOOD, GOOD]}).encode(), "a.txt is listed twice", id="a path twice"),
    pytest.param(json.dumps({"files": [], "refused": [{"path": "x"}]}).encode(), "lacks 'reason'",
                 id="a refusal without its reason"),
    pytest.param(json.dumps({"files": [], "missing": "model.json"}).encode(), "missing is not a list of strings",
                 id="missing not a list"),
    pytest.param(json.dumps({"files": [], "status": 3}).encode(), "status and run_id", id="a numeric status"),
]


@pytest.mark.parametrize("data, why", MALFORMED)
def test_a_malformed_far_manifest_is_one_clear_error(run, data, why):
    with pytest.raises(ManifestError) as caught:
        manifest.parse_far(run, data)
    said = str(caught.value)
    assert said.startswith("the far side's /far/remote/runs/demo-1/PULL_MANIFEST.json is not a valid manifest ("), said
    assert why in said, said
    assert f"`doit pull run={run.run_id}`" in said, said


def test_a_malformed_local_copy_names_its_file_and_the_fix(run):
    pulled(run, {"artifacts/model.json": MODEL})
    Path(run.manifest).write_bytes(b'{"files": 3}')
    with pytest.raises(ManifestError, match="fetches the far side's again") as caught:
        manifest.verify(run)
    assert str(caught.value).startswith(f"{run.manifest} is not a valid manifest (no list of files)")


# ---------------------------------------------------------------- the durable save


def test_save_pulled_warns_and_forgets_the_verification_only_when_the_manifest_changed(run):
    first = pulled(run, {"artifacts/model.json": MODEL})
    manifest.verify(run)
    assert manifest.save_pulled(run, first) == ""  # the same bytes again: still verified
    assert manifest.still_verified(run)
    second = sealed({"artifacts/model.json": MODEL}, sealed_at=2.0)
    warning = manifest.save_pulled(run, second)
    assert warning == (f"warning: the far side's PULL_MANIFEST.json changed since it was pulled here (sha256 "
                       f"{manifest.digest(first)[:12]}, now {manifest.digest(second)[:12]}): pulling what it lists now")
    assert not os.path.exists(run.verified)
    assert Path(run.manifest).read_bytes() == second


def test_a_save_that_dies_at_the_rename_leaves_the_old_manifest_whole(run, monkeypatch):
    old = pulled(run, {"artifacts/model.json": MODEL})

    def crash(src: str, dst: str) -> None:
        raise OSError(5, "Input/output error (simulated crash at the rename)")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="simulated crash"):
        manifest.save_pulled(run, sealed({"artifacts/model.json": MODEL}, sealed_at=2.0))
    monkeypatch.undo()
    assert Path(run.manifest).read_bytes() == old
    assert sorted(os.listdir(run.local)) == ["PULL_MANIFEST.json", "files"]  # no temporary file left behind
    assert not os.path.exists(run.verified)  # forgotten first: a crash never leaves a stale verification


def test_save_pulled_fsyncs_the_file_before_the_rename_and_the_folder_after(run, monkeypatch):
    os.makedirs(run.local)
    seen: list[tuple[str, int]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:  # the real fsync, recorded by the inode it made durable
        seen.append(("fsync", os.fstat(fd).st_ino))
        real_fsync(fd)

    def replace(src: str, dst: str) -> None:
        seen.append(("replace", os.stat(src).st_ino))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    manifest.save_pulled(run, sealed({}))
    monkeypatch.undo()
    file_ino, folder_ino = os.stat(run.manifest).st_ino, os.stat(run.local).st_ino
    assert seen == [("fsync", file_ino), ("replace", file_ino), ("fsync", folder_ino)], seen


# ---------------------------------------------------------------- down's gate


def test_gate_teardown_refuses_in_order_then_answers_the_verification(run):
    files = {"artifacts/model.json": MODEL, "artifacts/big.bin": b"\0" * 64}
    far = pulled(run, files)
    os.unlink(run.pulled("artifacts/big.bin"))  # left on the far side by the pull
    Path(run.stamp("pull")).write_text(json.dumps({"left": LEFT}))
    model = Path(run.pulled("artifacts/model.json"))
    model.write_bytes(b'{"w": [1, 3]}')
    rid = run.run_id

    def refusal(far_bytes: bytes | None, alive: bool, keep: bool) -> str:
        with pytest.raises((RunError, ManifestError)) as caught:
            manifest.gate_teardown(run, far_bytes, alive, keep, ("model.json",))
        return str(caught.value)

    everything_wrong = (b"{}", True, False)
    assert refusal(*everything_wrong) == (
        f"refusing to tear down {rid}: its results are not verified here ({run.verified} is missing). "
        f"Run `doit run train` (or `doit pull verify`) first")

    model.write_bytes(MODEL)
    manifest.verify(run, LEFT)
    model.write_bytes(b'{"w": [1, 3]}')  # damaged after it was verified: every file is hashed again
    assert refusal(*everything_wrong).startswith(f"run {rid} failed verification (1 of 1 files): artifacts/model.json")
    assert not os.path.exists(run.verified)

    model.write_bytes(MODEL)
    manifest.verify(run, LEFT)
    assert refusal(*everything_wrong) == (
        f"refusing to tear down {rid}: 1 file(s) were left on the far side (artifacts/big.bin): fetch them first "
        f"(fetch_artifacts / max_artifact_mb, then `doit pull`), or set keep_remote: true")

    changed = (f"refusing to tear down {rid}: the far side's manifest changed after it was verified here: "
               f"`doit pull verify run={rid}` fetches and checks what it lists now")
    assert refusal(b"{}", True, True) == changed  # keep_remote: nothing is deleted, so nothing left is lost
    assert refusal(None, True, True) == changed  # the far side has the run dir but no manifest

    assert refusal(far, True, True) == f"refusing to tear down {rid}: it is still running: `doit stop` first"

    verified = manifest.gate_teardown(run, far, False, True, ("model.json",))
    assert verified["manifest_sha256"] == manifest.digest(far)
    assert sorted(verified["files"]) == ["artifacts/model.json"] and verified["remote_only"] == LEFT
    assert json.loads(Path(run.verified).read_text())["files"] == verified["files"]


def test_gate_teardown_passes_a_fully_pulled_run_without_keep_remote(run):
    far = pulled(run, {"artifacts/model.json": MODEL})
    manifest.verify(run)
    assert manifest.left_remote(run) == {}  # no pull stamp: nothing was left behind
    verified = manifest.gate_teardown(run, far, False, False, ("model.json",))
    assert verified["remote_only"] == {} and list(verified["files"]) == ["artifacts/model.json"]
