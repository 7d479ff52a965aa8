"""The controller killed anywhere: a seeded schedule of kill moments over a calibrated timeline, the kill-and-rerun loop, and the invariant checks, one typed result per moment."""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
KILLSITE = TESTS / "killsite"  # its sitecustomize arms the killed process (TETHER_KILL_POINT)
DEMO = REPO / "configs" / "demo"
EPOCHS = 2  # 50 steps: one checkpoint (every 50), about 0.1 s of training; the run is short, every phase is there
STRAY = re.compile(r"(\.part$|\.tmp-|^\.[^/]*tmp)")  # tether's partial downloads and atomic-write temporaries
DOWN = ("run", "down", "confirm=yes")

# what each killed command needs done first, uninterrupted, and what finishes the job after its reruns
SETUP = {"train": [], "pull": [("run", "watch")], "verify": [("run", "watch"), ("pull",)],
         "down": [("run", "train")], "repro": [("run", "train")]}
FINISH = {"train": [], "pull": [("run", "train")], "verify": [("run", "train")], "down": [], "repro": []}
INVARIANTS = [
    "exactly one launch event per attempt and one exit per launch (events.jsonl), one attempt (the detached "
    "launcher survived the kill) and one run per job",
    "artifacts and checkpoints pulled have the SHA-256 of an uninterrupted run's",
    "no temporary or partial file (.part, .tmp-) in the pulled files, the manifests or the far artifacts",
    "the local PULL_MANIFEST.json is byte-identical to the far side's",
    "a far run dir is gone only where PULL_VERIFIED.json exists here and matches the manifest and files",
]


@dataclass(frozen=True)
class Site:
    """Where the far side is: the local backend, or a real sshd (the far run dirs under far/ beside the project)."""

    backend: str  # "local" | "ssh"
    server: object = None  # tests/sshd.SSHServer for "ssh"

    def config(self, root: Path) -> str:
        from conftest import config_text, ssh_config_text

        if self.backend == "local":
            return config_text(epochs=EPOCHS)
        return ssh_config_text(self.server, root.parent / "far", epochs=EPOCHS)

    def far_runs(self, root: Path) -> Path:
        return root / ".tether" / "remote" / "runs" if self.backend == "local" else root.parent / "far" / "runs"


@dataclass(frozen=True)
class Moment:
    """Kill `command` at the `at`-th traced event (kind "event"), at the first event matching the regex
    `label` (kind "match"), or `at` seconds after its start (kind "delay")."""

    command: str  # train | pull | verify | down | repro
    kind: str
    at: float
    label: str = ""  # the event expected there, from the calibration

    def replay(self, seed: int, backend: str) -> str:
        if self.kind == "match":
            return f"python bench/faults_kill.py --only '{self.command}:match:{self.label}' --backend {backend}"
        return (f"python bench/faults_kill.py --seed {seed} --only {self.command}:{self.kind}:{self.at:g} "
                f"--backend {backend}")


@dataclass
class Outcome:
    """What one moment did: where the kill landed, how many reruns it took, which invariants failed."""

    moment: Moment
    landed: str
    reruns: int
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0


@dataclass(frozen=True)
class Timeline:
    """One uninterrupted, traced run of a command: its events in order and its wall time."""

    command: str
    events: list[dict]
    seconds: float


# ------------------------------------------------------------------ processes


def environment(trace: Optional[dict] = None) -> dict:
    """The environment for doit/tether: this tree first on the path; armed with a kill point when `trace`."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(KILLSITE) if trace else "", str(REPO),
                                                      env.get("PYTHONPATH", "")]))
    env.pop("TETHER_KILL_POINT", None)
    if trace:
        env["TETHER_KILL_POINT"] = json.dumps(trace)
    return env


WORDS = {"train": "doit run train", "pull": "doit pull", "verify": "doit run verify",
         "down": "doit run down confirm=yes", "repro": "tether repro .tether/runs/ID"}


def argv(command: str, root: Path) -> list[str]:
    if command == "repro":
        return [sys.executable, "-m", "tether.cli", "repro", str(local_runs(root)[0])]
    words = {"train": ("run", "train"), "pull": ("pull",), "verify": ("run", "verify"), "down": DOWN}[command]
    return [sys.executable, "-m", "doit", *words]


def run(root: Path, args: list[str], timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=root, env=environment(), text=True, capture_output=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def doit(root: Path, *words: str) -> subprocess.CompletedProcess:
    return run(root, [sys.executable, "-m", "doit", *words])


def start_armed(root: Path, args: list[str], trace: Path, kill_at: int, kill_match: str = "") -> subprocess.Popen:
    """The command in its own session (a closed laptop takes all of it), tracing into `trace`."""
    spec = {"root": str(root), "trace": str(trace), "kill_at": kill_at, "kill_match": kill_match}
    return subprocess.Popen(args, cwd=root, env=environment(spec), stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the whole process group (doit and its local far-side channel), then reap doit."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


def read_trace(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ------------------------------------------------------------------ projects


def new_project(base: Path, site: Site) -> Path:
    """A fresh folder with the demo trainer, dodo.py and tether.yaml for `site`."""
    root = base / "proj"
    (root / "demo").mkdir(parents=True)
    shutil.copy(DEMO / "train.py", root / "demo" / "train.py")
    shutil.copy(DEMO / "points.csv", root / "demo" / "points.csv")
    shutil.copy(REPO / "dodo.py", root / "dodo.py")
    (root / "tether.yaml").write_text(site.config(root))
    return root


def local_runs(root: Path) -> list[Path]:
    """The run folders here (not a run folder still being created: a dot-named temporary)."""
    folder = root / ".tether" / "runs"
    return sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")) \
        if folder.is_dir() else []


def unfinished(root: Path) -> list[str]:
    """Temporary run folders left in .tether/runs (a run's creation killed, not yet cleared by a rerun)."""
    folder = root / ".tether" / "runs"
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(".")) if folder.is_dir() else []


def must(done: subprocess.CompletedProcess, what: str) -> None:
    if done.returncode != 0:
        raise AssertionError(f"{what} exited {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")


def prepare(root: Path, command: str) -> None:
    for words in SETUP[command]:
        must(doit(root, *words), f"setup `doit {' '.join(words)}`")


def stop_leftovers(root: Path, site: Site) -> None:
    """Stop any launcher still holding a run (the far side is this machine either way)."""
    from tether.remote import launcher

    runs = site.far_runs(root)
    for run_dir in (runs.iterdir() if runs.is_dir() else []):
        if launcher.is_alive(str(run_dir)):
            launcher.stop(str(run_dir), 1.0)


# ------------------------------------------------------------------ calibration and schedule


def calibrate(base: Path, site: Site, command: str) -> Timeline:
    """Run `command` once uninterrupted and traced (after its setup): the events it passes through."""
    root = new_project(base, site)
    try:
        prepare(root, command)
        trace = base / "trace.jsonl"
        t0 = time.monotonic()
        proc = start_armed(root, argv(command, root), trace, -1)
        code = proc.wait(timeout=180)
        seconds = time.monotonic() - t0
        if code != 0:
            raise AssertionError(f"the uninterrupted `{command}` exited {code}")
        return Timeline(command, read_trace(trace), seconds)
    finally:
        stop_leftovers(root, site)


def reference(base: Path, site: Site) -> dict[str, str]:
    """SHA-256 of every artifact and checkpoint of one uninterrupted `doit run train`."""
    root = new_project(base, site)
    try:
        must(doit(root, "run", "train"), "the uninterrupted `doit run train`")
        return results(local_runs(root)[0])
    finally:
        stop_leftovers(root, site)


def schedule(seed: int, timeline: Timeline, count: int) -> list[Moment]:
    """`count` distinct moments: every distinct traced event first (in order, each matched by its label),
    then seeded event indices and seeded delays over the calibrated wall time, half and half."""
    rng = random.Random(f"{seed}:{timeline.command}")
    firsts: dict[str, int] = {}
    for e in timeline.events:
        firsts.setdefault(f"{e['kind']} {e['what']}", e["n"])
    labels = {e["n"]: f"{e['kind']} {e['what']}" for e in timeline.events}
    chosen = sorted(firsts.values())
    if len(chosen) > count:
        chosen = sorted(rng.sample(chosen, count))
    # each distinct event by its label (the first event that matches it), whatever the count before it
    moments = [Moment(timeline.command, "match", n, f"^{re.escape(labels[n])}$") for n in chosen]
    seen = {(m.kind, m.at) for m in moments}
    last = max(1, len(timeline.events) - 3)  # a later run may poll fewer times than the calibrated one
    tries = 0
    while len(moments) < count and tries < 100 * count:
        tries += 1
        if rng.random() < 0.5 and timeline.events:
            n = rng.randint(1, last)
            m = Moment(timeline.command, "event", n, labels[n])
        else:
            m = Moment(timeline.command, "delay", round(rng.uniform(0.05, 0.95 * timeline.seconds), 3))
        if (m.kind, m.at) not in seen:
            seen.add((m.kind, m.at))
            moments.append(m)
    return moments


# ------------------------------------------------------------------ one moment


def kill_at(root: Path, moment: Moment, trace: Path) -> str:
    """Run the command armed and kill its group at the moment; where it landed, in words."""
    at = int(moment.at) if moment.kind == "event" else -1
    proc = start_armed(root, argv(moment.command, root), trace, at, moment.label if moment.kind == "match" else "")
    if moment.kind == "delay":
        try:
            proc.wait(timeout=moment.at)  # the seeded delay IS the fault's timing
        except subprocess.TimeoutExpired:
            pass
    else:
        try:
            proc.wait(timeout=180)
        except subprocess.TimeoutExpired:
            pass
    finished = proc.poll() == 0
    kill_group(proc)
    events = read_trace(trace)
    if finished:
        return "after the end (the command finished first)"
    if not events:
        return "startup (before any traced event)"
    last = events[-1]
    return f"{'at' if last.get('killed') else 'after'} {last['kind']} {last['what']}"


def rerun(root: Path, moment: Moment, site: Site, failures: list[str], tries: int = 3) -> int:
    """Run the killed command again until it succeeds (checking the teardown gate after each); the count."""
    for n in range(1, tries + 1):
        done = run(root, argv(moment.command, root))
        failures.extend(down_gate(root, site))
        if done.returncode == 0:
            return n
        last = n == tries
        if last or "Traceback" in done.stderr:
            tail = (done.stderr.strip() or done.stdout.strip()).splitlines()[-1:] or [""]
            failures.append(f"rerun {n} of `{moment.command}` exited {done.returncode}: {tail[0][:300]}")
            if "Traceback" in done.stderr:
                return n
    return tries


def next_second() -> None:
    """Wait for the wall clock's next second: a rerun comes later than its kill, as a user's would, and a
    run id carries the second it was minted in (so a rerun within the same second would hide a second run)."""
    now = int(time.time())
    deadline = time.monotonic() + 2
    while int(time.time()) == now and time.monotonic() < deadline:
        time.sleep(0.01)


def try_down_early(root: Path, site: Site, failures: list[str]) -> None:
    """`down confirm=yes` right after the kill, before anything is verified: it must refuse, deleting nothing."""
    if any((r / "PULL_VERIFIED.json").exists() for r in local_runs(root)) or not local_runs(root):
        return
    done = doit(root, *DOWN)
    if "Traceback" in done.stderr:
        failures.append(f"down after the kill: a traceback: {done.stderr.strip().splitlines()[-1][:300]}")
    failures.extend(down_gate(root, site))


def run_moment(base: Path, site: Site, moment: Moment, expected: dict[str, str], early_down: bool = False) -> Outcome:
    """Kill at `moment`, rerun until done, finish the job, check every invariant."""
    t0 = time.monotonic()
    root = new_project(base, site)
    failures: list[str] = []
    try:
        prepare(root, moment.command)
        before = check_all(root, site, expected, runs=1) if moment.command == "down" else []
        failures.extend(f"before the kill: {f}" for f in before)
        landed = kill_at(root, moment, base / "trace.jsonl")
        next_second()
        failures.extend(down_gate(root, site))
        if early_down and moment.command == "train":
            try_down_early(root, site, failures)
        reruns = rerun(root, moment, site, failures)
        for words in FINISH[moment.command]:
            done = doit(root, *words)
            if done.returncode != 0:
                failures.append(f"finishing `doit {' '.join(words)}` exited {done.returncode}: "
                                f"{done.stderr.strip()[-300:]}")
        if moment.command == "down":
            failures.extend(torn_down(root, site))
        else:
            failures.extend(check_all(root, site, expected, runs=2 if moment.command == "repro" else 1))
    finally:
        stop_leftovers(root, site)
    return Outcome(moment, landed, reruns, failures, round(time.monotonic() - t0, 2))


# ------------------------------------------------------------------ invariants


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def results(local: Path) -> dict[str, str]:
    """SHA-256 of the pulled artifacts and checkpoints of a local run folder, by path in the run."""
    files = local / "files"
    return {str(p.relative_to(files)): sha256(p) for sub in ("artifacts", "checkpoints")
            for p in sorted((files / sub).rglob("*")) if p.is_file()}


def events_of(path: Path) -> list[dict]:
    lines = path.read_text().split("\n")[:-1]
    return [json.loads(line) for line in lines if line.strip()]


def one_launch_per_attempt(events: list[dict]) -> list[str]:
    launches = Counter(e.get("attempt") for e in events if e.get("event") == "launch")
    exits = Counter(e.get("attempt") for e in events if e.get("event") == "exit")
    problems = [f"attempt {a} has {n} launch events" for a, n in sorted(launches.items()) if n != 1]
    problems += [f"attempt {a} has {n} exit events" for a, n in sorted(exits.items()) if n != 1]
    if set(launches) != set(exits):
        problems.append(f"launches for attempts {sorted(launches)} but exits for {sorted(exits)}")
    if len(launches) != 1:  # nothing here fails a trainer: a second attempt means the launcher died with doit
        problems.append(f"{len(launches)} attempts: the detached launcher did not survive the kill alone")
    return problems


def strays(local: Path, far: Path) -> list[str]:
    found = [str(p.relative_to(local)) for p in (local / "files").rglob("*") if STRAY.search(p.name)]
    listed = json.loads((local / "PULL_MANIFEST.json").read_text()).get("files", [])
    found += [f"manifest lists {f['path']}" for f in listed if STRAY.search(os.path.basename(f["path"]))]
    found += [f"far {p.relative_to(far)}" for sub in ("artifacts", "checkpoints") if (far / sub).is_dir()
              for p in (far / sub).rglob("*") if STRAY.search(p.name)]
    return found


def check_run(local: Path, far: Path, expected: dict[str, str]) -> list[str]:
    """Invariants 1-4 for one finished run (its far run dir still there)."""
    rid = local.name
    if not (local / "PULL_VERIFIED.json").is_file():
        return [f"{rid}: not verified after the reruns"]
    problems = [f"{rid}: {p}" for p in one_launch_per_attempt(events_of(far / "events.jsonl"))]
    got = results(local)
    if got != expected:
        differ = sorted(k for k in set(got) | set(expected) if got.get(k) != expected.get(k))
        problems.append(f"{rid}: results differ from the uninterrupted run's: {differ}")
    problems += [f"{rid}: stray temporary file accepted: {s}" for s in strays(local, far)]
    if (local / "PULL_MANIFEST.json").read_bytes() != (far / "PULL_MANIFEST.json").read_bytes():
        problems.append(f"{rid}: the local PULL_MANIFEST.json differs from the far side's")
    return problems


def check_all(root: Path, site: Site, expected: dict[str, str], runs: int) -> list[str]:
    locals_ = local_runs(root)
    fars = sorted(p.name for p in site.far_runs(root).iterdir()) if site.far_runs(root).is_dir() else []
    problems = [] if len(locals_) == runs and len(fars) == runs else \
        [f"expected {runs} run(s), found {len(locals_)} here and {len(fars)} on the far side: {fars}"]
    problems += [f"a temporary run folder was left: {name}" for name in unfinished(root)]
    for local in locals_:
        far = site.far_runs(root) / local.name
        problems += check_run(local, far, expected) if far.is_dir() else [f"{local.name}: far run dir missing"]
    return problems


def verified_here(local: Path) -> str:
    """'' when PULL_VERIFIED.json exists, cites this PULL_MANIFEST.json and every listed file matches; else why not."""
    verified, listed = local / "PULL_VERIFIED.json", local / "PULL_MANIFEST.json"
    if not verified.is_file() or not listed.is_file():
        return "no PULL_VERIFIED.json"
    if json.loads(verified.read_text()).get("manifest_sha256") != sha256(listed):
        return "PULL_VERIFIED.json cites another manifest"
    for f in json.loads(listed.read_text())["files"]:
        path = local / "files" / f["path"]
        if not path.is_file() or sha256(path) != f["sha256"]:
            return f"{f['path']} here does not match the manifest"
    return ""


def down_gate(root: Path, site: Site) -> list[str]:
    """Invariant 5: every run pushed from here (push.json: its far run dir was made) whose far run dir is
    gone was verified here first."""
    problems = []
    for local in local_runs(root):
        if (local / "push.json").exists() and not (site.far_runs(root) / local.name).exists():
            why = verified_here(local)
            if why:
                problems.append(f"{local.name}: the far run dir was deleted unverified ({why})")
    return problems


def torn_down(root: Path, site: Site) -> list[str]:
    problems = down_gate(root, site)
    for local in local_runs(root):
        if (site.far_runs(root) / local.name).exists():
            problems.append(f"{local.name}: down reported success but the far run dir is still there")
        if not (local / "down.json").is_file():
            problems.append(f"{local.name}: no down.json after down succeeded")
    return problems
