"""The job's environment: a real venv built by real pip, on local, over ssh and for a real SLURM job.

pip needs no network here: each test writes a tiny wheel into its tmp folder and points pip at it
(PIP_NO_INDEX, PIP_FIND_LINKS): on local through the environment tether runs in, over ssh through
the backend's `env:`, which proves that env: reaches the installer. The unit tests cover the rest
without a venv: the uv commands (uv is not installed here), the setup lines under a real /bin/sh,
job.sh's order, the config's errors and the run's identity.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import zipfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

pytest.register_assert_rewrite("slurm_fixtures")
pytest_plugins = ["slurm_fixtures"]  # the session's one cluster, shared with test_slurm.py

from conftest import config_text  # noqa: E402
from slurm_fixtures import new_remote_dir, remove_remote_dir, slurm_yaml  # noqa: E402
from tether import config as config_mod  # noqa: E402
from tether.backends.local import Backend, Config  # noqa: E402
from tether.backends.slurm import Config as SlurmConfig  # noqa: E402
from tether.backends.slurm import job_script  # noqa: E402
from tether import environment as environment_mod  # noqa: E402
from tether.environment import Wanted  # noqa: E402
from tether.errors import ConfigError  # noqa: E402
from tether.paths import RunPaths  # noqa: E402
from tether.pipelines.identity import launch_spec  # noqa: E402
from tether.remote import environment  # noqa: E402

SCRIPT = """\
import json, os, sys
import tinypkg
os.makedirs("out", exist_ok=True)
with open(os.path.join(os.environ["TETHER_ARTIFACTS_DIR"], "env.json"), "w") as f:
    json.dump({"prefix": sys.prefix, "tinypkg": tinypkg.VERSION, "greeting": os.environ.get("GREETING")}, f)
print("trained with tinypkg", tinypkg.VERSION)
"""


def tiny_wheel(folder: Path, version: str = "1.0") -> Path:
    """A real, minimal wheel of the module `tinypkg` (what `pip wheel` would write, without its seconds)."""
    folder.mkdir(parents=True, exist_ok=True)
    info = f"tinypkg-{version}.dist-info"
    files = {"tinypkg.py": f"VERSION = {version!r}\n",
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: tinypkg\nVersion: {version}\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = [f"{name},sha256={base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b'=').decode()},"
              f"{len(text.encode())}" for name, text in files.items()]
    files[f"{info}/RECORD"] = "\n".join(record + [f"{info}/RECORD,,"]) + "\n"
    path = folder / f"tinypkg-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    return path


def environment_job(backend: str, backend_name: str = "local", setup: str = "[]") -> str:
    """The project's job: SCRIPT under tether, its packages from requirements.txt, with setup lines."""
    text = config_text(command="{python} demo/use.py", code="demo/use.py", artifacts="env.json",
                       backend_name=backend_name, backend=backend)
    return text + f"environment:\n  requirements: requirements.txt\n  setup: {setup}\n"


def venvs(remote: Path) -> dict[str, dict]:
    """The whole venvs under remote_dir (those with a READY marker), by folder name."""
    folder = remote / "venv"
    found = sorted(p for p in folder.iterdir() if p.is_dir()) if folder.is_dir() else []
    return {p.name: json.loads((p / "READY").read_text()) for p in found if (p / "READY").exists()}


def out(done: subprocess.CompletedProcess) -> str:
    return f"exit {done.returncode}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"


def pulled_env(project, run_id: str) -> dict:
    return json.loads((project.local_run(run_id) / "files" / "artifacts" / "env.json").read_text())


# ---------------------------------------------------------------- end to end


def test_local_venv_from_requirements_built_once_reused_and_rebuilt_when_they_change(project, tmp_path,
                                                                                     monkeypatch):
    wheels = tmp_path / "wheels"
    tiny_wheel(wheels)
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # the local far side inherits this environment, as pip does
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    (project.root / "demo" / "use.py").write_text(SCRIPT)
    (project.root / "requirements.txt").write_text("tinypkg==1.0\n")
    project.write_config(environment_job("{type: local}", setup='["export GREETING=hello"]'))
    remote = project.root / ".tether" / "remote"

    first = project.doit("run", "train", timeout=300)
    assert first.returncode == 0, out(first)
    assert "environment: building" in first.stdout and "environment: built" in first.stdout, out(first)
    [(name, ready)] = venvs(remote).items()
    assert ready["installer"] == "pip" and ready["requirements_sha256"] == hashlib.sha256(b"tinypkg==1.0\n").hexdigest()
    [run1] = project.run_ids()
    seen = pulled_env(project, run1)
    assert Path(seen["prefix"]) == remote / "venv" / name and seen["tinypkg"] == "1.0", seen
    assert seen["greeting"] == "hello", seen  # the setup line ran in the trainer's shell
    spec = json.loads((project.remote_run(run1) / "run.json").read_text())
    assert spec["environment"]["requirements_sha256"] == ready["requirements_sha256"], spec

    # a new run (the script changed), the same requirements: the venv is reused, not built again
    (project.root / "demo" / "use.py").write_text(SCRIPT + "# v2\n")
    marker = (remote / "venv" / name / "READY").stat().st_mtime_ns
    again = project.doit("run", "train", timeout=300)
    assert again.returncode == 0, out(again)
    assert "environment: build" not in again.stdout, out(again)
    assert (remote / "venv" / name / "READY").stat().st_mtime_ns == marker and list(venvs(remote)) == [name]
    run2 = next(r for r in project.run_ids() if r != run1)
    assert Path(pulled_env(project, run2)["prefix"]) == remote / "venv" / name

    # a changed requirements file: a new run in a new venv; the old one stays for the runs that use it
    (project.root / "requirements.txt").write_text("tinypkg>=1.0\n")
    changed = project.doit("run", "train", timeout=300)
    assert changed.returncode == 0, out(changed)
    assert len(project.run_ids()) == 3 and len(venvs(remote)) == 2, out(changed)
    run3 = next(r for r in project.run_ids() if r not in (run1, run2))
    assert Path(pulled_env(project, run3)["prefix"]).name != name


def test_ssh_venv_with_the_backends_env_a_failing_requirement_in_one_line_then_fixed(project, sshd, tmp_path):
    far = tmp_path / "far"
    wheels = tmp_path / "wheels"
    tiny_wheel(wheels)
    backend = dict(sshd.backend_config(far), env={"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(wheels)})
    (project.root / "demo" / "use.py").write_text(SCRIPT)
    (project.root / "requirements.txt").write_text("tinypkg==1.0\nnonexistent-pkg==9\n")
    project.write_config(environment_job(json.dumps(backend), "lab", setup='["false"]'))

    failed = project.doit("run", "train", timeout=300)
    assert failed.returncode != 0, out(failed)
    line = ("environment: pip could not install nonexistent-pkg==9 (ERROR: No matching distribution found for "
            "nonexistent-pkg==9): fix requirements.txt")
    assert line in failed.stderr and "Traceback" not in failed.stderr, out(failed)
    assert "    ERROR: Could not find a version that satisfies the requirement nonexistent-pkg==9" in failed.stdout
    assert venvs(far) == {} and not [p for p in (far / "venv").iterdir() if p.is_dir()]  # nothing half-built

    # fixed: the venv is built with the backend's env:, and a failing setup line fails the attempt in train.log
    (project.root / "requirements.txt").write_text("tinypkg==1.0\n")
    broken = project.doit("run", "train", timeout=300)
    assert broken.returncode != 0 and "environment: built" in broken.stdout, out(broken)
    [run1] = project.run_ids()
    log = (far / "runs" / run1 / "train.log").read_text()
    assert "tether: setup line failed (exit 1): false" in log and "trained" not in log, log

    project.write_config(environment_job(json.dumps(backend), "lab", setup='["export GREETING=over-ssh"]'))
    [name] = venvs(far)
    good = project.doit("run", "train", timeout=300)
    assert good.returncode == 0 and "environment: build" not in good.stdout, out(good)
    run2 = next(r for r in project.run_ids() if r != run1)
    assert pulled_env(project, run2) == {"prefix": str(far / "venv" / name), "tinypkg": "1.0", "greeting": "over-ssh"}


def test_check_names_the_interpreter_its_torch_and_that_no_venv_is_asked_for(tmp_path):
    from importlib.metadata import version

    backend = Backend("local", Config(remote_dir=str(tmp_path / "remote")), str(tmp_path / ".tether"))
    try:
        [item] = [i for i in backend.check().items if i["check"] == "environment"]
    finally:
        backend.close()
    assert item["ok"], item  # torch's version and CUDA build read without importing it (seconds, a CUDA init)
    cuda = "none: a CPU build" if version("torch").endswith("+cpu") else ""
    assert item["detail"].startswith(f"Python {sys.version.split()[0]} ({sys.executable}); torch {version('torch')} "
                                     f"(CUDA {cuda}"), item
    assert item["detail"].endswith("; no venv (no environment: section)"), item


@pytest.fixture
def slurm_remote(cluster):
    folder = new_remote_dir()
    yield folder
    remove_remote_dir(cluster, folder)


def test_slurm_job_runs_in_the_venv_built_on_the_login_node_after_prelude_and_setup(project, cluster, slurm_remote,
                                                                                    tmp_path):
    tiny_wheel(tmp_path / "wheels")
    (project.root / "demo" / "use.py").write_text(SCRIPT)
    text = slurm_yaml(cluster, slurm_remote, "{python} demo/use.py", code="demo/use.py", artifacts="env.json",
                      env={"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(tmp_path / "wheels")},
                      prelude=["export GREETING=prelude"])
    text = text.replace('acknowledge: ["', 'acknowledge: ["prelude: is deprecated", "')
    project.write_config(text + "environment:\n  packages: [tinypkg]\n  setup: ['export GREETING=$GREETING+setup']\n")
    done = project.doit("run", "train", timeout=300)
    assert done.returncode == 0 and "environment: built" in done.stdout, out(done)
    [name] = venvs(slurm_remote)
    [run_id] = project.run_ids()
    assert pulled_env(project, run_id) == {"prefix": str(slurm_remote / "venv" / name), "tinypkg": "1.0",
                                           "greeting": "prelude+setup"}  # in job.sh, once each, in that order


# ---------------------------------------------------------------- the far side's module, directly


def _ensure(remote: str, wheels: str) -> dict:
    env = {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": wheels}
    return environment.ensure(remote, sys.executable, "tinypkg==1.0\n", "requirements.txt", (), env)


def test_runs_starting_together_build_once_a_half_built_venv_is_never_trusted_and_check_names_it(tmp_path):
    tiny_wheel(tmp_path / "wheels")
    remote = tmp_path / "remote"
    key = environment.venv_key(environment.probe(sys.executable), "tinypkg==1.0\n", ())
    half = Path(environment.folder_of(str(remote), key))
    (half / "bin").mkdir(parents=True)
    (half / "bin" / "python").symlink_to(sys.executable)  # a build killed before its READY marker
    (half / "left-by-a-killed-build").write_text("")
    (remote / ".tether-remote").write_text("")  # tether's folder (serve claims it before any request)
    assert environment.ensure(str(remote), sys.executable, "tinypkg==1.0\n", build=False)["outcome"] == "absent"

    with ProcessPoolExecutor(2) as pool:
        answers = list(pool.map(_ensure, [str(remote)] * 2, [str(tmp_path / "wheels")] * 2))
    assert sorted(a["outcome"] for a in answers) == ["built", "reused"], answers
    assert not (half / "left-by-a-killed-build").exists() and (half / "READY").exists()
    done = subprocess.run([str(half / "bin" / "python"), "-c", "import tinypkg; print(tinypkg.VERSION)"],
                          capture_output=True, text=True)
    assert done.stdout.strip() == "1.0", done.stderr

    # check names the venv a run gets, and its interpreter
    wanted = Wanted("tinypkg==1.0\n", "requirements.txt")
    backend = Backend("local", Config(remote_dir=str(remote)), str(tmp_path / ".tether"), environment=wanted)
    try:
        [item] = [i for i in backend.check().items if i["check"] == "environment"]
    finally:
        backend.close()
    assert item["detail"].startswith(f"Python {sys.version.split()[0]} ({half / 'bin' / 'python'}); torch "), item
    assert item["detail"].endswith(f"; venv {half} (built, reused by every run)") and item["ok"], item


def test_uv_builds_with_uv_and_pip_without_it(tmp_path, monkeypatch):
    assert environment.find_uv() is None or os.environ.get("TETHER_TEST_UV"), "uv is on PATH: this test assumes none"
    base = {"executable": "/usr/bin/python3", "has_pip": False}
    venv = str(tmp_path / "v")
    assert environment.build_argv(venv, base, "/r.txt", ["torch"], "/opt/uv") == [
        ["/opt/uv", "venv", "--python", "/usr/bin/python3", "--system-site-packages", venv],
        ["/opt/uv", "pip", "install", "--python", f"{venv}/bin/python", "-r", "/r.txt", "torch"]]
    pip = environment.build_argv(venv, base, None, ["torch"], None)
    assert pip == [["/usr/bin/python3", "-m", "venv", "--system-site-packages", venv],
                   [f"{venv}/bin/python", "-m", "pip", "install", "--disable-pip-version-check", "--no-input", "torch"]]
    lent = environment.build_argv(venv, dict(base, has_pip=True), None, [], None)[0]
    assert lent == ["/usr/bin/python3", "-m", "venv", "--system-site-packages", "--without-pip", venv]
    monkeypatch.setenv("UV_INDEX_URL", "https://mine.example/simple")
    env = environment.installer_env({"PIP_INDEX_URL": "https://mirror.example/simple", "PIP_NO_INDEX": "1"}, uv=True)
    assert env["UV_INDEX_URL"] == "https://mine.example/simple" and env["UV_NO_INDEX"] == "true"
    assert "UV_NO_INDEX" not in environment.installer_env({"PIP_NO_INDEX": "1"}, uv=False)


def test_failure_lines_name_the_requirement_and_the_installers_reason():
    pip = ["Looking in links: /w", "ERROR: Could not find a version that satisfies the requirement torch==9.9 "
           "(from versions: none)", "ERROR: No matching distribution found for torch==9.9"]
    assert environment.failure_line("pip", ["p", "-m", "pip"], pip) == (
        "pip could not install torch==9.9 (ERROR: No matching distribution found for torch==9.9)")
    venv = ["Error: Command '['/r/venv/x/bin/python', '-m', 'ensurepip']' returned non-zero exit status 1."]
    assert environment.failure_line("pip", ["python3", "-m", "venv", "x"], venv).startswith(
        "pip could not create the venv (Error: Command")


def test_setup_lines_run_in_the_trainers_shell_and_a_failing_one_ends_it_named(tmp_path, monkeypatch):
    monkeypatch.delenv(environment.SETUP_DONE, raising=False)
    spec = {"environment": {"setup": ["export A='x y'", "cd /"]}}
    argv = environment.with_setup([sys.executable, "-c", "import os; print(os.environ['A'], os.getcwd())"], spec)
    done = subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0 and done.stdout == "x y /\n", done
    failing = environment.with_setup(["echo", "trained"], {"environment": {"setup": ["true", "sh -c 'exit 3'", "true"]}})
    done = subprocess.run(failing, capture_output=True, text=True)
    assert (done.returncode, done.stdout) == (1, ""), done
    assert done.stderr == "tether: setup line failed (exit 3): sh -c 'exit 3'\n"
    assert environment.with_setup(["echo"], {}) == ["echo"]
    monkeypatch.setenv(environment.SETUP_DONE, "1")  # a SLURM job.sh ran them before the launcher
    assert environment.with_setup(["echo"], spec) == ["echo"]


def test_slurm_job_script_runs_the_prelude_then_the_setup_lines_before_the_launcher(tmp_path):
    cfg = SlurmConfig(host="login", remote_dir="~/tether", prelude=("module load cuda/12.4",))
    run = RunPaths("demo-20260101T000000Z-0123abcd", str(tmp_path / ".tether"), "/shared/tether")
    script = job_script(cfg, run, "/far/launcher.py", "/shared/tether/venv/0123/bin/python",
                        ("source setup.sh", "export X=1"))
    lines = script.splitlines()
    at = [lines.index(w) for w in ("module load cuda/12.4", "source setup.sh", "export X=1",
                                   "export TETHER_SETUP_DONE=1")]
    launcher = next(i for i, line in enumerate(lines) if "/far/launcher.py" in line)
    assert at == sorted(at) and at[-1] < launcher, script
    assert "/shared/tether/venv/0123/bin/python" in lines[launcher]
    assert "TETHER_SETUP_DONE" not in job_script(SlurmConfig(host="login", remote_dir="~/t"), run, "/l.py", "python3")
    assert any("prelude: is deprecated" in w for w in cfg.warnings())


# ---------------------------------------------------------------- the config and the run's identity


def _job(tmp_path: Path, section: str) -> config_mod.Job:
    (tmp_path / "train.py").write_text("print(1)\n")
    path = tmp_path / "tether.yaml"
    path.write_text("name: demo\ncode: {paths: [train.py]}\ntrainer: {type: command, command: \"{python} train.py\"}\n"
                    "artifacts: [x]\nbackends: {local: {type: local}}\n" + section)
    return config_mod.load(str(path))


@pytest.mark.parametrize("section, message", [
    ("environment: {requirements: reqs.txt}", "tether.yaml:6: error: environment.requirements 'reqs.txt' does not "
                                              "exist"),
    ("environment: {requirements: ../reqs.txt}", "leaves the project folder"),
    ("environment: {requirements: inc.txt}", "includes another file (-r base.txt): the far side gets this file alone"),
    ("environment: {packages: ['']}", "environment.packages: '' is not a package"),
    ("environment: {setup: ['  ']}", "environment.setup: an empty line"),
    ("environment: {requirement: r.txt}", "unknown key 'requirement' in environment (did you mean 'requirements'?)"),
])
def test_environment_errors_are_one_line_naming_the_fix(tmp_path, section, message):
    (tmp_path / "inc.txt").write_text("numpy\n-r base.txt\n")
    with pytest.raises(ConfigError) as err:
        _job(tmp_path, section + "\n")
    assert len(err.value.problems) == 1 and message in err.value.problems[0], err.value.problems


def test_the_requirements_sha256_is_in_the_runs_identity_and_no_section_keeps_old_ids(tmp_path):
    assert "environment" not in launch_spec(_job(tmp_path, ""))
    (tmp_path / "requirements.txt").write_text("numpy\n")
    spec = launch_spec(_job(tmp_path, "environment: {requirements: requirements.txt, packages: [tqdm]}\n"))
    assert spec["environment"] == {"requirements": "requirements.txt", "packages": ["tqdm"], "setup": [],
                                   "requirements_sha256": hashlib.sha256(b"numpy\n").hexdigest()}
    (tmp_path / "requirements.txt").write_text("numpy==2.0\n")
    changed = launch_spec(_job(tmp_path, "environment: {requirements: requirements.txt, packages: [tqdm]}\n"))
    assert changed["environment"]["requirements_sha256"] != spec["environment"]["requirements_sha256"]

    job = _job(tmp_path, "environment: {requirements: requirements.txt, packages: [tqdm]}\n")
    assert environment_mod.differs(changed["environment"], job.environment, job.root) == ""
    assert environment_mod.differs(spec["environment"], job.environment, job.root) == (
        "its environment differs here (requirements_sha256)")  # repro refuses: another venv than the run had
    assert environment_mod.differs(None, job.environment, job.root) == "the job here has an environment: section"
