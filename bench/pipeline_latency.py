"""How long tether itself takes: a no-op `doit run train`, `doit run train` to the first event, and DVC.

    python bench/pipeline_latency.py [--repeat 5]        # DVC=/opt/dvc-venv/bin/dvc to name dvc

Runs in a fresh temporary project with the stdlib demo trainer (configs/demo), on the local
backend, so the numbers are tether's overhead rather than a trainer's start-up. With `dvc` on
PATH (or in $DVC), the same one-stage pipeline (the same command, code and data as deps, the
artifacts as outs) is timed as a no-op `dvc repro` beside it, the runs alternating, and the
ratio of the medians is printed; so is the no-op of doit by itself (DOIT_ALONE): the part of
tether's time that is the interpreter and doit. tether runs from this checkout, its bytecode
compiled first, as an installed package's (and DVC's) is; DVC runs without its analytics.
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
           DVC_NO_ANALYTICS="1")
# The demo trainer's places, as the launcher would give them, for the DVC stage (it runs in place).
STAGE_ENV = {"TETHER_DATA_DIR": ".", "TETHER_ARTIFACTS_DIR": ".", "TETHER_EVENTS": "events.jsonl",
             "TETHER_CHECKPOINT_DIR": "checkpoints", "PYTHONPATH": str(REPO)}


# doit by itself: the same five up-to-date tasks as `train` (up, push, launch, watch, train), the same
# dependency file, nothing else; what any dodo.py pays before tether does anything.
DOIT_ALONE = """DOIT_CONFIG = {"default_tasks": ["train"], "dep_file": ".tether/doit.db", "backend": "tether-sqlite"}
NAMES = ["up", "push", "launch", "watch", "train"]
def creator(i):
    return lambda: {"actions": [], "uptodate": [True], "task_dep": NAMES[i - 1:i] if i else []}
globals().update(("task_" + name, creator(i)) for i, name in enumerate(NAMES))
"""


def make_project(root: Path) -> None:
    shutil.copytree(REPO / "configs" / "demo", root / "demo")
    shutil.copy(REPO / "dodo.py", root / "dodo.py")
    text = (REPO / "configs" / "command.yaml").read_text()
    (root / "tether.yaml").write_text(text)


def first_event_s(root: Path) -> float:
    """Seconds from starting `doit run train` to the first line in the far side's events.jsonl."""
    started = time.perf_counter()
    doit = subprocess.Popen([sys.executable, "-m", "doit", "run", "train"], cwd=root, env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    runs = root / ".tether" / "remote" / "runs"
    while True:
        found = list(runs.glob("*/events.jsonl")) if runs.exists() else []
        if found and found[0].stat().st_size > 0:
            elapsed = time.perf_counter() - started
            break
        time.sleep(0.002)
    if doit.wait(timeout=300) != 0:
        raise SystemExit("doit run train failed")
    return elapsed


def noop_s(root: Path) -> float:
    """Seconds of a `doit run train` in `root` that runs nothing (everything is up to date)."""
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "doit", "run", "train"], cwd=root, env=ENV, capture_output=True,
                          text=True)
    elapsed = time.perf_counter() - started
    if done.returncode != 0 or ".  " in done.stdout:
        raise SystemExit(f"not a no-op:\n{done.stdout}\n{done.stderr}")
    return elapsed


def dvc_program() -> Optional[str]:
    """$DVC, else `dvc` on PATH, else None (DVC is then left out)."""
    return os.environ.get("DVC") or shutil.which("dvc")


def dvc_project(root: Path, dvc: str) -> None:
    """The tether project's job as a one-stage DVC pipeline, reproduced once (the training run)."""
    from tether import config

    make_project(root)
    job = config.load(str(root / "tether.yaml"))
    argv = [sys.executable if word == "{python}" else word for word in job.trainer.argv()]
    command = " ".join(["mkdir -p checkpoints &&", "env"] + [f"{k}={shlex.quote(v)}" for k, v in STAGE_ENV.items()]
                       + [shlex.quote(word) for word in argv])
    stage = {"cmd": command, "deps": list(job.code.paths + job.data.paths), "outs": list(job.artifacts)}
    (root / "dvc.yaml").write_text(json.dumps({"stages": {"train": stage}}, indent=2) + "\n")  # JSON is YAML
    for args in (["init", "--no-scm", "-q"], ["repro"]):
        done = subprocess.run([dvc, *args], cwd=root, env=ENV, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"dvc {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}")


def dvc_noop_s(root: Path, dvc: str) -> float:
    started = time.perf_counter()
    done = subprocess.run([dvc, "repro"], cwd=root, env=ENV, capture_output=True, text=True)
    elapsed = time.perf_counter() - started
    if done.returncode != 0 or "Running stage" in done.stdout:
        raise SystemExit(f"not a no-op `dvc repro`:\n{done.stdout}\n{done.stderr}")
    return elapsed


def startup_s(python: str, repeat: int) -> float:
    """Median seconds of `python -c pass`: the interpreter and its site-packages' .pth files."""
    def once() -> float:
        started = time.perf_counter()
        subprocess.run([python, "-c", "pass"], env=ENV, check=True)
        return time.perf_counter() - started
    return statistics.median(once() for _ in range(repeat))


def dvc_python(dvc: str) -> Optional[str]:
    """The interpreter in the dvc script's #! line, if it has one."""
    with open(shutil.which(dvc) or dvc, "rb") as f:
        first = f.readline().decode(errors="replace")
    return first[2:].strip() if first.startswith("#!") and "python" in first else None


def median(values: list[float]) -> float:
    return round(statistics.median(values), 3)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    compileall.compile_dir(str(REPO / "tether"), quiet=1)
    dvc = dvc_program()
    found: dict[str, object] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root, alone, other = Path(tmp) / "tether", Path(tmp) / "doit", Path(tmp) / "dvc"
        make_project(root)
        found["first_event_s"] = round(first_event_s(root), 3)
        (alone / ".tether").mkdir(parents=True)
        (alone / "dodo.py").write_text(DOIT_ALONE)
        if dvc:
            dvc_project(other, dvc)
        noops, alone_noops, dvc_noops = [], [], []
        for _ in range(args.repeat):  # alternating, so a busy moment slows each alike
            noops.append(noop_s(root))
            alone_noops.append(noop_s(alone))
            if dvc:
                dvc_noops.append(dvc_noop_s(other, dvc))
    found.update(noop_median_s=median(noops), noop_s=[round(n, 3) for n in noops],
                 doit_alone_noop_median_s=median(alone_noops),
                 python_startup_s=round(startup_s(sys.executable, args.repeat), 3))
    if dvc:
        version = subprocess.run([dvc, "--version"], env=ENV, capture_output=True, text=True).stdout.strip()
        python = dvc_python(dvc)
        found["dvc"] = {"program": dvc, "version": version, "noop_median_s": median(dvc_noops),
                        "noop_s": [round(n, 3) for n in dvc_noops],
                        "python_startup_s": round(startup_s(python, args.repeat), 3) if python else None}
        found["ratio_tether_to_dvc"] = round(statistics.median(noops) / statistics.median(dvc_noops), 3)
        found["ratio_doit_alone_to_dvc"] = round(statistics.median(alone_noops) / statistics.median(dvc_noops), 3)
    print(json.dumps(found, indent=2))
    if dvc:
        print(f"no-op: tether {found['noop_median_s']} s, DVC {median(dvc_noops)} s: "
              f"{found['ratio_tether_to_dvc']}x", file=sys.stderr)


if __name__ == "__main__":
    main()
