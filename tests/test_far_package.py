"""What ships to the far side stands alone: copied by itself, every module imports on the oldest Python it supports."""

from __future__ import annotations

import ast
import glob
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tether import shipping
from tether.remote import runtime
from tether.remote.machine import OLDEST_PYTHON
from tether.shipping import PACKAGE_ROOT, shipped_files

OLDEST = "%d.%d" % OLDEST_PYTHON
TRAINER_PACKAGES = {  # the only imports beyond the stdlib that ship: a built-in trainer's own, on the trainer's Python
    "tether.remote.builtin.torch_classifier": {"torch", "numpy", "sklearn", "safetensors"},
}
IMPORT_ALL = """
import importlib, json, sys
copy, names, needs = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
sys.path.insert(0, copy)
found = {}
for name in names:
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as err:
        top = (err.name or "").split(".")[0]
        found[name] = "needs " + top if top in needs.get(name, []) else "ModuleNotFoundError: %s" % err
    except BaseException as err:
        found[name] = "%s: %s" % (type(err).__name__, err)
    else:
        where = module.__file__ or ""
        found[name] = "ok" if where.startswith(copy + "/") else "imported from " + where
print(json.dumps(found))
"""


def module_name(rel: str) -> str:
    parts = rel[:-len(".py")].split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(rel: str) -> set[str]:
    """Every module `rel` imports, anywhere in it (function bodies too), as absolute dotted names."""
    package = module_name(rel) if rel.endswith("/__init__.py") else module_name(rel).rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(Path(PACKAGE_ROOT, rel).read_text(), rel)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            names = [f"{base}.{alias.name}" for alias in node.names] if base in ("tether", "tether.remote") else [base]
            found.update(names)
    return found


def oldest_python() -> str:
    """An interpreter of the oldest Python the far side supports: pyenv's first, then PATH (checked, not trusted)."""
    roots = {os.environ.get("PYENV_ROOT") or "", os.path.expanduser("~/.pyenv")} - {""}
    candidates = sorted(p for root in roots for p in glob.glob(f"{root}/versions/{OLDEST}*/bin/python{OLDEST}"))
    candidates += [p for p in [shutil.which(f"python{OLDEST}")] if p]  # a pyenv shim may point nowhere: asked below
    for candidate in candidates:
        said = subprocess.run([candidate, "-S", "-I", "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                              capture_output=True, text=True)
        if said.returncode == 0 and said.stdout.strip() == OLDEST:
            return candidate
    places = ", ".join([f"{root}/versions" for root in sorted(roots)] + ["PATH"])
    pytest.fail(f"no Python {OLDEST} found (tried {candidates or 'nothing'}; looked in {places}): the far side "
                f"supports {OLDEST}, so this test needs it; install one, e.g. `pyenv install {OLDEST}`")


@pytest.fixture(scope="module")
def far_copy(tmp_path_factory: pytest.TempPathFactory) -> str:
    """What ships, and nothing else, copied as install_launcher unpacks it."""
    root = tmp_path_factory.mktemp("far") / "version"
    for rel in shipped_files():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(Path(PACKAGE_ROOT, rel), root / rel)
    return str(root)


def import_all(python: str, flags: list[str], copy: str, names: list[str], cwd: Path) -> dict[str, str]:
    needs = {name: sorted(packages) for name, packages in TRAINER_PACKAGES.items()}
    done = subprocess.run([python, *flags, "-c", IMPORT_ALL, copy, json.dumps(names), json.dumps(needs)],
                          capture_output=True, text=True, cwd=cwd, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_every_shipped_module_imports_from_the_copy_alone_on_the_oldest_python(far_copy, tmp_path):
    names = [module_name(rel) for rel in shipped_files()]
    found = import_all(oldest_python(), ["-S", "-I"], far_copy, names, tmp_path)
    # a built-in trainer gets as far as its own packages (so the whole file compiled on this Python)
    expected = {name: "needs torch" if name in TRAINER_PACKAGES else "ok" for name in names}
    assert found == expected


def test_the_built_in_trainers_import_from_the_copy_with_their_packages(far_copy, tmp_path):
    pytest.importorskip("torch", reason="the torch extra is part of the test install")
    found = import_all(sys.executable, ["-I"], far_copy, sorted(TRAINER_PACKAGES), tmp_path)
    assert found == {name: "ok" for name in TRAINER_PACKAGES}


def test_the_far_side_installs_and_serves_on_the_oldest_python(tmp_path):
    """The bootstrap as every backend starts it (`python -c SCRIPT REMOTE_DIR VERSION`), on Python 3.8:
    it claims the folder, asks for the package, installs it, and answers requests."""
    from tether.backends.channel import Channel
    from tether.remote.protocol import ChunkWriter
    from tether.shipping import bootstrap_script, launcher_version, package_tar

    far = tmp_path / "far"
    channel = Channel([oldest_python(), "-c", bootstrap_script(), str(far), launcher_version()])
    try:
        channel.timeout_s = 60
        assert channel.message() == {"install": launcher_version()}
        writer = ChunkWriter(channel)
        writer.write(package_tar())
        writer.close()
        hello = channel.message()
        assert hello["remote_dir"] == str(far) and hello["python"].startswith("3.8."), hello
        answer = channel.request("probe", {"run_dirs": [str(far / "runs" / "none")]})
        assert answer == {str(far / "runs" / "none"): {"status": "absent"}}
    finally:
        channel.close()
    assert (far / "tether" / launcher_version() / "COMPLETE").read_text() == launcher_version()
    assert (far / ".tether-remote").is_file()


def test_what_ships_imports_only_the_stdlib_and_tether_remote():
    wrong = {}
    for rel in shipped_files():
        allowed = TRAINER_PACKAGES.get(module_name(rel), set())
        for name in imported(rel):
            top = name.split(".")[0]
            if top == "tether":
                ok = name == "tether.remote" or name.startswith("tether.remote.")
            else:
                ok = top in sys.stdlib_module_names or top in allowed
            if not ok:
                wrong.setdefault(rel, []).append(name)
    assert wrong == {}, "the far side has only what ships: import from tether.remote or the stdlib"


def test_every_shipped_folder_is_a_package():
    folders = {rel.rpartition("/")[0] for rel in shipped_files()}
    assert {f for f in folders if f"{f}/__init__.py" not in shipped_files()} == set()


def test_the_walk_takes_modules_only(tmp_path, monkeypatch):
    keep = ["tether/__init__.py", "tether/trainers/__init__.py", "tether/trainers/runtime.py",
            "tether/remote/__init__.py", "tether/remote/a.py", "tether/remote/sub/__init__.py",
            "tether/remote/sub/b.py"]
    leftovers = ["tether/remote/a.py.orig", "tether/remote/.#a.py", "tether/remote/a-copy.py", "tether/other.py",
                 "tether/remote/notes.txt", "tether/remote/__pycache__/a.cpython-311.pyc", "tether/remote/.hidden/c.py"]
    for rel in keep + leftovers:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    monkeypatch.setattr(shipping, "PACKAGE_ROOT", str(tmp_path))
    assert shipping.shipped_files() == sorted(keep)


def test_scripts_still_import_the_runtime_by_its_old_name():
    from tether.trainers import runtime as old_name

    assert old_name.__all__ == runtime.__all__  # a name added to the runtime is added to the re-export too
    assert {n: getattr(old_name, n) for n in runtime.__all__} == {n: getattr(runtime, n) for n in runtime.__all__}
    assert "tether/trainers/runtime.py" in shipped_files()
