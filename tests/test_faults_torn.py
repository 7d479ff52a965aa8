"""Torn and hostile files: state.json, run.json, stamps, manifests, events lines and .part files that lie."""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Callable

import pytest

from conftest import DEMO, REPO, Project, config_text
from faults_torn import garbage, torn_bytes
from helpers import stop_leftover_runs

SEED = int(os.environ.get("TETHER_FAULT_SEED", "15"))
REPLAY = f"replay: TETHER_FAULT_SEED={SEED} pytest tests/test_faults_torn.py"


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> tuple[Path, Path]:
    """One short, verified local run of the stdlib demo trainer: (where cases run, its pristine copy)."""
    base = tmp_path_factory.mktemp("torn")
    root = base / "proj"
    (root / "demo").mkdir(parents=True)
    for name in ("train.py", "points.csv"):
        shutil.copy(DEMO / name, root / "demo")
    shutil.copy(REPO / "dodo.py", root)
    project = Project(root)
    project.write_config(config_text(epochs=2))
    project.doit("run", "train", check=True)
    shutil.copytree(root, base / "pristine", symlinks=True)
    yield root, base / "pristine"
    stop_leftover_runs(root / ".tether" / "remote")


@pytest.fixture
def run(finished) -> Project:
    """The finished run as it was, restored in place (the run id and paths stay the same)."""
    root, pristine = finished
    stop_leftover_runs(root / ".tether" / "remote")
    shutil.rmtree(root)
    shutil.copytree(pristine, root, symlinks=True)
    return Project(root)


def _far(p: Project, name: str) -> Path:
    return p.remote_run() / name


def _here(p: Project, name: str) -> Path:
    return p.local_run() / name


def _cut(path: Callable[[Project], Path]) -> Callable[[Project, random.Random], str]:
    def damage(p: Project, rng: random.Random) -> str:
        target = path(p)
        cut, data = torn_bytes(target.read_bytes(), rng)
        target.write_bytes(data)
        return f"{target.name} cut at byte {cut}"
    return damage


def _junk(path: Callable[[Project], Path]) -> Callable[[Project, random.Random], str]:
    def damage(p: Project, rng: random.Random) -> str:
        data = garbage(rng)
        path(p).write_bytes(data)
        return f"{path(p).name} replaced by {data[:16]!r}..."
    return damage


def _text(path: Callable[[Project], Path], text: str) -> Callable[[Project, random.Random], str]:
    def damage(p: Project, rng: random.Random) -> str:
        path(p).write_text(text)
        return f"{path(p).name} = {text}"
    return damage


def _listed(edit: Callable[[list], None]) -> Callable[[Project, random.Random], str]:
    """The far side's PULL_MANIFEST.json, valid JSON, with wrong content; nothing pulled here yet."""
    def damage(p: Project, rng: random.Random) -> str:
        sealed = _far(p, "PULL_MANIFEST.json")
        listed = json.loads(sealed.read_text())
        edit(listed["files"])
        sealed.write_text(json.dumps(listed))
        shutil.rmtree(p.local_run() / "files")
        for name in ("PULL_MANIFEST.json", "PULL_VERIFIED.json", "pull.json"):
            _here(p, name).unlink(missing_ok=True)
        return f"far manifest edited to {listed['files'][-2:]}"
    return damage


def _wrong_hash(files: list) -> None:
    files[0]["sha256"] = "0" * 64


def _extra(files: list) -> None:
    files.append({"path": "artifacts/extra.bin", "bytes": 3, "sha256": "a" * 64})


def _bad_types(files: list) -> None:
    files[0]["bytes"] = "many"


def _here_manifest_wrong_hash(p: Project, rng: random.Random) -> str:
    """This side's copy of the manifest changed after verify: down must not trust PULL_VERIFIED.json."""
    path = _here(p, "PULL_MANIFEST.json")
    listed = json.loads(path.read_text())
    listed["files"][rng.randrange(len(listed["files"]))]["sha256"] = "0" * 64
    path.write_text(json.dumps(listed))
    return "local manifest hash zeroed"


FAR_STATE = lambda p: _far(p, "state.json")  # noqa: E731
TORN = "is torn or damaged"
CASES = [
    pytest.param(_cut(FAR_STATE), ("status",), TORN, id="far state.json truncated: status"),
    pytest.param(_junk(FAR_STATE), ("status",), TORN, id="far state.json garbage: status"),
    pytest.param(_text(FAR_STATE, "[1, 2]"), ("status",), TORN, id="far state.json a list: status"),
    pytest.param(_cut(FAR_STATE), ("run", "down", "confirm=yes"), TORN, id="far state.json truncated: down"),
    pytest.param(_cut(lambda p: _here(p, "run.json")), ("status",), TORN, id="run.json here truncated: status"),
    pytest.param(_junk(lambda p: _here(p, "run.json")), ("pull",), TORN, id="run.json here garbage: pull"),
    pytest.param(_cut(lambda p: _here(p, "PULL_VERIFIED.json")), ("run", "down", "confirm=yes"), "not verified",
                 id="PULL_VERIFIED.json truncated: down refuses"),
    pytest.param(_here_manifest_wrong_hash, ("run", "down", "confirm=yes"), "doit pull verify",
                 id="manifest here changed after verify: down refuses"),
    pytest.param(_listed(_wrong_hash), ("pull",), "no longer matches its sealed manifest",
                 id="far manifest wrong hash: pull"),
    pytest.param(_listed(_extra), ("pull",), "artifacts/extra.bin is gone", id="far manifest extra entry: pull"),
    pytest.param(_listed(_bad_types), ("pull",), "is not a valid manifest", id="far manifest wrong types: pull"),
    pytest.param(_listed(_extra), ("run", "verify"), "no pulled manifest", id="far manifest extra entry: verify"),
]


@pytest.mark.parametrize("damage, command, says", CASES)
def test_a_torn_or_lying_file_is_one_clear_line_and_never_trusted(run, damage, command, says, request):
    rng = random.Random(f"{SEED}-{request.node.callspec.id}")
    what = damage(run, rng)
    far = sorted(str(p.relative_to(run.remote_run())) for p in run.remote_run().rglob("*"))
    done = run.doit(*command)
    said = done.stdout + done.stderr
    why = f"seed {SEED}, {what} ({REPLAY})\n{said}"
    assert done.returncode == 1 and "Traceback" not in said, why
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and says in errors[0], why
    assert sorted(str(p.relative_to(run.remote_run())) for p in run.remote_run().rglob("*")) == far, \
        f"the far run dir changed: {why}"
    assert not run.local_run().joinpath("down.json").exists(), why


TORN_EVENTS = """\
import json, os
for name in ("model.json", "metrics.json"):
    with open(os.path.join(os.environ["TETHER_ARTIFACTS_DIR"], name), "w") as f:
        json.dump({"accuracy": 1.0}, f)
with open(os.environ["TETHER_EVENTS"], "ab") as f:  # killed mid-line: what a full disk or SIGKILL leaves
    f.write(%r)
print("done")
"""


def test_torn_events_lines_are_skipped_by_watch_verify_and_report_and_counted(project):
    rng = random.Random(SEED)
    line = json.dumps({"event": "step", "step": 2, "loss": 0.25}).encode()
    cut, torn = torn_bytes(line, rng)
    lines = b'{"event": "step", "step": 1, "loss": 0.5}\n%d\n["x"]\n' % rng.randrange(10) + torn
    (project.root / "demo" / "torn.py").write_text(TORN_EVENTS % lines)
    project.write_config(config_text(command="{python} demo/torn.py", code="demo/torn.py"))
    done = project.doit("run", "train")
    said = done.stdout + done.stderr
    expect = 3 if cut else 2  # a cut at byte 0 leaves no line at all
    assert done.returncode == 0 and "Traceback" not in said, f"seed {SEED}: cut at {cut}\n{said}"
    assert f"{expect} torn line(s) in events.jsonl skipped" in done.stdout, f"seed {SEED}: cut at {cut}\n{said}"
    last = (project.remote_run() / "events.jsonl").read_bytes().split(b"\n")[-2]
    assert json.loads(last)["event"] == "exit", f"seed {SEED}: the launcher's exit is not a line of its own: {last!r}"
    assert "removed" in project.doit("run", "down", "confirm=yes", check=True).stdout


@pytest.mark.parametrize("extra", [1, 4096])
def test_a_part_file_longer_than_its_file_is_named_discarded_and_fetched_whole(tmp_path, extra, capsys):
    from tether.pipelines import transfer
    from tether.remote.fileio import sha256_file

    rng = random.Random(f"{SEED}-{extra}")
    data = rng.randbytes(rng.randrange(1000, 50000))
    (tmp_path / "far.bin").write_bytes(data)
    local = str(tmp_path / "here" / "far.bin")
    os.makedirs(os.path.dirname(local))
    Path(local + transfer.PART).write_bytes(data + rng.randbytes(extra))
    sha = sha256_file(str(tmp_path / "far.bin"))[0]

    def read_from(offset: int, write: Callable[[bytes], None]) -> None:
        write(data[offset:])

    progress = _Progress()
    transfer.get_resumable(read_from, local, len(data), sha, progress, lambda want, got: AssertionError(want, got))
    assert Path(local).read_bytes() == data, f"seed {SEED}"
    assert not Path(local + transfer.PART).exists()
    assert any("discarding far.bin.part" in w and "longer than" in w for w in progress.said), progress.said


class _Progress:
    """tqdm's two methods the transfer uses."""

    def __init__(self) -> None:
        self.said: list[str] = []

    def write(self, text: str, file=None) -> None:
        self.said.append(text)

    def update(self, n: int) -> None:
        pass


@pytest.mark.parametrize("command", ["probe", "start"])
def test_the_launcher_never_trusts_a_torn_state_json(tmp_path, command):
    from tether.remote import launcher
    from tether.remote.fileio import TornFile

    rng = random.Random(f"{SEED}-{command}")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    whole = json.dumps({"status": "completed", "final": True, "exit_code": 0, "attempt": 1}).encode()
    for _ in range(5):
        cut, data = torn_bytes(whole, rng)
        (run_dir / "state.json").write_bytes(data)
        with pytest.raises(TornFile) as err:
            getattr(launcher, command)(str(run_dir))
        assert "state.json is torn or damaged" in str(err.value), f"seed {SEED}: cut at {cut}"
        assert sorted(os.listdir(run_dir)) == ["state.json"], f"seed {SEED}: cut at {cut}: it acted on it"
