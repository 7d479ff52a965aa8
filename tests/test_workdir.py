"""Working directory and artifacts: a script that never heard of tether runs unchanged and brings its results home.

The trainer is written the way public training scripts are: no `tether` import, its data opened by
the project-relative path (`data/shakespeare_char/train.txt`), its results written next to itself
(`out/model.pt`, `outputs/final/model.safetensors`), print-style output. Every test runs the real
pipeline (`doit`), locally, over a real sshd, and on a real SLURM cluster (one test); nothing is mocked.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from conftest import Project, config_text
from helpers import sha256
from tether.remote import objects

pytest_plugins = ["slurm_fixtures"]  # the session's one cluster (only the SLURM test starts it)

DATA = "data/shakespeare_char/train.txt"
TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\n" * 50

SCRIPT = '''\
"""A character-level trainer as public ones are written: relative paths, its own out/ folder."""
import argparse, hashlib, json, os

parser = argparse.ArgumentParser()
parser.add_argument("--dataset", default="shakespeare_char")
parser.add_argument("--out_dir", default="out")
parser.add_argument("--append_to_data", action="store_true")  # a bug: writing into the dataset
args = parser.parse_args()

path = os.path.join("data", args.dataset, "train.txt")
with open(path) as f:
    text = f.read()
print(f"loaded {len(text)} characters from {path}")
if args.append_to_data:
    with open(path, "a") as f:
        f.write("garbage")
os.makedirs(args.out_dir, exist_ok=True)
with open(os.path.join(args.out_dir, "model.pt"), "w") as f:
    f.write(hashlib.sha256(text.encode()).hexdigest())
os.makedirs("outputs/final", exist_ok=True)
with open("outputs/final/model.safetensors", "wb") as f:  # the format's header, then the bytes
    header = json.dumps({"w": {"dtype": "U8", "shape": [64], "data_offsets": [0, 64]}}).encode()
    f.write(len(header).to_bytes(8, "little") + header + text.encode()[:64].ljust(64, b" "))
print("saved", os.path.join(args.out_dir, "model.pt"))
'''


def own_script(project: Project, artifacts: str, args: str = "", backend_name: str = "local",
               backend: str = "{type: local}") -> None:
    """The project holds train.py at its root and its dataset under data/; tether.yaml runs it unchanged."""
    (project.root / "train.py").write_text(SCRIPT)
    (project.root / DATA).parent.mkdir(parents=True, exist_ok=True)
    (project.root / DATA).write_text(TEXT)
    project.write_config(config_text(command=f"{{python}} train.py {args}".strip(), code="train.py", data=DATA,
                                     artifacts=artifacts, backend_name=backend_name, backend=backend))


def out(done) -> str:
    return f"exit {done.returncode}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"


def manifest_paths(project: Project) -> set[str]:
    return {e["path"] for e in json.loads((project.local_run() / "PULL_MANIFEST.json").read_text())["files"]}


def data_object(remote_dir: Path) -> Path:
    """The object store's copy of the dataset."""
    return Path(objects.object_path(str(remote_dir / "objects"), sha256_text(TEXT)))


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def assert_results_home(project: Project, far_run: Path) -> None:
    """out/model.pt and the safetensors file came home under work/, verified, byte for byte the far side's."""
    files = project.local_run() / "files"
    assert (project.local_run() / "PULL_VERIFIED.json").is_file()
    for rel in ("work/out/model.pt", "work/outputs/final/model.safetensors"):
        assert sha256(files / rel) == sha256(far_run / rel), rel
    assert (files / "work/out/model.pt").read_text() == sha256_text(TEXT)  # it read the right data
    assert f"loaded {len(TEXT)} characters from {DATA}" in (files / "train.log").read_text()


# ---------------------------------------------------------------- local


def test_own_script_reads_its_data_by_relative_path_and_its_results_come_home(project):
    own_script(project, "out/model.pt, 'outputs/**/*.safetensors'")
    done = project.doit("run", "train", timeout=120)
    assert done.returncode == 0, out(done)
    far_run = project.remote_run()
    assert_results_home(project, far_run)
    assert {"work/out/model.pt", "work/outputs/final/model.safetensors"} <= manifest_paths(project)
    work_data = far_run / "work" / DATA  # linked from the object store, never copied per run
    assert work_data.stat().st_ino == data_object(project.root / ".tether" / "remote").stat().st_ino
    assert work_data.stat().st_mode & 0o222 == 0
    assert (far_run / "data" / DATA).read_text() == TEXT  # TETHER_DATA_DIR's layout is unchanged
    down = project.doit("run", "down", "confirm=yes", timeout=60)
    assert down.returncode == 0, out(down)


def test_writing_into_a_data_file_fails_and_the_object_store_is_intact(project):
    """As root too (this suite runs as root here): the trainer obeys the object's 0444."""
    own_script(project, "out/model.pt", args="--append_to_data")
    done = project.doit("run", "train", timeout=120)
    assert done.returncode != 0, out(done)
    far_run = project.remote_run()
    log = (far_run / "train.log").read_text()
    assert "PermissionError" in log and DATA in log, log
    assert sha256(data_object(project.root / ".tether" / "remote")) == sha256_text(TEXT)
    assert (far_run / "data" / DATA).read_text() == TEXT and (project.root / DATA).read_text() == TEXT
    assert json.loads((far_run / "state.json").read_text())["status"] == "failed"
    # a failed run did not produce out/model.pt: expected, so its logs still come home and verify
    verified = project.doit("pull", "verify", timeout=60)
    assert verified.returncode == 0, out(verified)
    assert (project.local_run() / "files" / "train.log").is_file()


def test_a_glob_over_the_working_directory_never_pulls_the_pushed_code_or_data(project):
    own_script(project, "'**/*'")
    done = project.doit("run", "train", timeout=120)
    assert done.returncode == 0, out(done)
    listed = manifest_paths(project)
    assert {"work/out/model.pt", "work/outputs/final/model.safetensors"} <= listed
    pushed = [p for p in listed if p.endswith("train.txt") or p.endswith("train.py")]
    assert pushed == [], listed  # inputs: tree.json lists them, they are never results
    assert not (project.local_run() / "files" / "work" / "data").exists()


def test_a_missing_literal_artifact_fails_verify_by_name_and_down_stays_refused(project):
    own_script(project, "out/model.pt, out/best.pt")
    done = project.doit("run", "train", timeout=120)
    assert done.returncode != 0, out(done)
    said = "artifact out/best.pt was declared but the run did not produce it"
    assert said in done.stderr, out(done)
    assert not (project.local_run() / "PULL_VERIFIED.json").exists()
    down = project.doit("run", "down", "confirm=yes", timeout=60)
    assert down.returncode != 0 and "refusing to tear down" in down.stderr, out(down)
    assert project.remote_run().is_dir()
    again = project.doit("run", "verify", timeout=60)  # verify alone says the same
    assert again.returncode != 0 and said in again.stderr, out(again)
    # dropping the name from artifacts: accepts the run without it (the same run: artifacts are not its identity)
    project.write_config(config_text(command="{python} train.py", code="train.py", data=DATA, artifacts="out/model.pt"))
    accepted = project.doit("run", "verify", timeout=60)
    assert accepted.returncode == 0, out(accepted)
    assert project.doit("run", "down", "confirm=yes", timeout=60).returncode == 0


def test_a_glob_that_matches_nothing_is_only_a_warning(project):
    own_script(project, "out/model.pt, 'results/*.bin'")
    done = project.doit("run", "train", timeout=120)
    assert done.returncode == 0, out(done)
    assert "warning: declared artifacts that the run did not produce: results/*.bin" in done.stdout, out(done)
    assert (project.local_run() / "PULL_VERIFIED.json").is_file()


def test_repro_compares_the_results_a_script_wrote_in_its_working_directory(project):
    """Before: repro compared artifacts/ only, and called a run whose results are in out/ `reproduced (0 artifacts)`."""
    own_script(project, "out/model.pt")
    project.doit("run", "train", check=True, timeout=120)
    (run_id,) = project.run_ids()
    done = project.tether("repro", f".tether/runs/{run_id}", timeout=180)
    assert done.returncode == 0, out(done)
    assert "reproduced (1 artifacts bit-identical by sha256: work/out/model.pt)" in done.stdout, out(done)


# ---------------------------------------------------------------- over ssh (a real sshd)


def test_own_script_over_ssh_results_come_home_and_data_stays_read_only(project, sshd, tmp_path):
    far = tmp_path / "far"
    own_script(project, "out/model.pt, 'outputs/**/*.safetensors', '**/*.txt'", backend_name="lab",
               backend=json.dumps(sshd.backend_config(far)))
    done = project.doit("run", "train", timeout=180)
    assert done.returncode == 0, out(done)
    far_run = far / "runs" / project.run_ids()[-1]
    assert_results_home(project, far_run)
    assert not [p for p in manifest_paths(project) if p.endswith("train.txt")]  # the dataset is an input
    assert data_object(far).stat().st_mode & 0o777 == 0o444
    assert (far_run / "work" / DATA).stat().st_ino == data_object(far).stat().st_ino


# ---------------------------------------------------------------- on SLURM (real slurmctld and slurmd)


def test_own_script_on_slurm_reads_relative_data_and_brings_out_model_home(project, cluster, remote):
    from slurm_fixtures import slurm_yaml

    (project.root / "train.py").write_text(SCRIPT)
    (project.root / DATA).parent.mkdir(parents=True, exist_ok=True)
    (project.root / DATA).write_text(TEXT)
    text = slurm_yaml(cluster, remote, "{python} train.py", code="train.py", artifacts="out/model.pt")
    project.write_config(text.replace("paths: [demo/points.csv]", f"paths: [{DATA}]"))
    done = project.doit("run", "train", timeout=240)
    assert done.returncode == 0, out(done)
    far_run = remote / "runs" / project.run_ids()[-1]
    files = project.local_run() / "files"
    assert sha256(files / "work/out/model.pt") == sha256(far_run / "work/out/model.pt")
    assert (files / "work/out/model.pt").read_text() == sha256_text(TEXT)
    assert (project.local_run() / "PULL_VERIFIED.json").is_file()


# ---------------------------------------------------------------- the far side alone: materialize and seal


def test_work_dir_links_data_and_the_seal_lists_results_never_inputs(tmp_path):
    """A file pushed as both code and data is linked (never copied per run); a glob skips inputs, a literal
    naming one is refused by name, a literal that is nowhere is `missing`."""
    from tether.remote import rundir

    remote, run_dir = tmp_path / "remote", tmp_path / "remote" / "runs" / "w1"
    blobs = {"train.py": b"print('hi')\n", DATA: TEXT.encode()}
    for data in blobs.values():
        obj = Path(objects.object_path(str(remote / "objects"), sha256_text(data.decode())))
        obj.parent.mkdir(parents=True, exist_ok=True)
        obj.write_bytes(data)
    tree = {"files": [{"root": "code", "path": "train.py", "sha256": sha256_text(blobs["train.py"].decode()),
                       "mode": 0o644}]
            + [{"root": root, "path": DATA, "sha256": sha256_text(TEXT), "mode": 0o644} for root in ("code", "data")]}
    objects.materialize(str(run_dir), tree)
    assert (run_dir / "work" / DATA).stat().st_ino == data_object(remote).stat().st_ino
    assert (run_dir / "work" / "train.py").stat().st_mode & 0o777 == 0o444  # a frozen copy
    (run_dir / "work" / "out").mkdir()
    (run_dir / "work" / "out" / "model.pt").write_bytes(b"weights")
    (run_dir / "run.json").write_text(json.dumps({"run_id": "w1", "artifacts": ["**/*", DATA, "out/none.pt"]}))
    (run_dir / "state.json").write_text(json.dumps({"status": "completed"}))
    for name in ("events.jsonl", "train.log"):
        (run_dir / name).write_text("")
    manifest = rundir.seal(str(run_dir))
    listed = {e["path"] for e in manifest["files"]}
    assert "work/out/model.pt" in listed and not [p for p in listed if p.endswith(("train.py", "train.txt"))]
    assert [e["path"] for e in manifest["refused"]] == [f"work/{DATA}"]
    assert "pushed input" in manifest["refused"][0]["reason"]
    assert manifest["missing"] == ["out/none.pt"]
