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
FIX = "list paths relative to the run's artifacts/ folder (TETHER_ARTIFACTS_DIR) where the trainer writes them"


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


HF_LIKE = """\
import json, os
from tether.trainers import runtime
for step in range(1, 4):
    runtime.log("step", step=step, total_steps=3, loss=1.0 / step)
os.makedirs("outputs/checkpoint-3", exist_ok=True)  # what Hugging Face's Trainer leaves: a folder
with open("outputs/checkpoint-3/model.safetensors", "wb") as f:
    f.write(b"weights")
with open(os.path.join(os.environ["TETHER_ARTIFACTS_DIR"], "model.json"), "w") as f:
    json.dump({"step": 3}, f)
"""

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
    run read as lost (machine rebooted?) and would have trained again."""
    _use(project, "hf.py", HF_LIKE, "model.json", trainer="  checkpoint: outputs\n")
    done = project.doit("run", "train", timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    run_id = project.run_ids()[0]
    state = json.loads((project.remote_run(run_id) / "state.json").read_text())
    assert state["status"] == "completed" and state["final"] is True and "launcher_error" not in state
    assert (project.local_run(run_id) / "files" / "artifacts" / "model.json").is_file()
    skipped = [e for e in project.events(run_id) if e["event"] == "checkpoint_not_kept"]
    assert [e["path"] for e in skipped] == ["outputs"]
    assert (project.remote_run(run_id) / "code" / "outputs" / "checkpoint-3" / "model.safetensors").read_bytes() \
        == b"weights"  # the folder itself stays where the script wrote it


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


# (end of section: seal, artifacts, launcher failures)


# ================================================================ GPUs and SLURM guards


# (end of section: GPUs and SLURM guards)


# ================================================================ config input and command line


# (end of section: config input and command line)


# ================================================================ pull, verify and transfers


# (end of section: pull, verify and transfers)
