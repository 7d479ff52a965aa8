"""Part B of the fault suite: sshd killed or frozen at seeded moments of push, watch and pull, and its checks."""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from helpers import Background, sha256
from sshd import SSHServer

REPO = Path(__file__).resolve().parent.parent
PHASES = ("push", "watch", "pull")

# A public-style training script: no tether import, relative paths, its own checkpoint file and
# --resume flag, print output; a deterministic result (a hash chain) and a blob large enough
# that the push of its data and the pull of its blob each take a moment to kill sshd in.
SCRIPT = """\
import argparse, hashlib, json, os, time
parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--sleep", type=float, default=0.05)
parser.add_argument("--blob-mb", type=int, default=16)
parser.add_argument("--resume", default="")
args = parser.parse_args()
state = {"step": 0, "w": "seed"}
if args.resume:
    with open(args.resume) as f:
        state = json.load(f)
    print("resumed at step", state["step"], flush=True)
def save():
    os.makedirs("out", exist_ok=True)
    with open("out/ckpt.json.tmp", "w") as f:
        json.dump(state, f)
    os.replace("out/ckpt.json.tmp", "out/ckpt.json")
with open("data/points.bin", "rb") as f:
    salt = hashlib.sha256(f.read()).hexdigest()
while state["step"] < args.steps:
    state["step"] += 1
    state["w"] = hashlib.sha256((state["w"] + salt + str(state["step"])).encode()).hexdigest()
    print("step %d/%d" % (state["step"], args.steps), flush=True)
    if state["step"] % 5 == 0:
        save()
    time.sleep(args.sleep)
save()
results = os.environ.get("TETHER_ARTIFACTS_DIR", "results")
os.makedirs(results, exist_ok=True)
with open(os.path.join(results, "weights.json"), "w") as f:
    json.dump(state, f)
block = hashlib.sha256(state["w"].encode()).digest() * 32768
with open(os.path.join(results, "blob.bin"), "wb") as f:
    for i in range(args.blob_mb):
        f.write(block)
"""

CONFIG = """\
name: net
backend: lab
code:
  paths: [script/train.py]
data:
  paths: [data/points.bin]
trainer:
  type: command
  checkpoint: out/ckpt.json
  resume_args: ["--resume", "{{checkpoint}}"]
  command: "{{python}} script/train.py --steps {steps} --sleep {sleep}"
artifacts: [weights.json, blob.bin]
restart: {{policy: {policy}}}
validation:
  acknowledge: ["is below 10 s: every poll"]
heartbeat_timeout_s: 60
grace_seconds: 5
backends:
  lab: {backend}
"""


@dataclass
class Outcome:
    """One injected fault: where it landed, and every invariant that failed (none: survived)."""

    seed: int
    phase: str
    moment: str = ""
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def make_project(root: Path, server: SSHServer, far: Path, seed: int, steps: int = 20, sleep: float = 0.05,
                 policy: str = "never", drop: tuple[str, ...] = (), **backend) -> Path:
    """A project folder: the script, 16 MB of seeded data, tether.yaml with backend `lab` = server
    (its keys without `drop`, plus `backend`)."""
    (root / "script").mkdir(parents=True)
    (root / "data").mkdir()
    (root / "script" / "train.py").write_text(SCRIPT)
    (root / "data" / "points.bin").write_bytes(random.Random(seed).randbytes(16 << 20))
    shutil.copy(REPO / "dodo.py", root / "dodo.py")
    settings = server.backend_config(far, **dict({"connect_timeout_s": 3}, **backend))
    settings = {k: v for k, v in settings.items() if k not in drop}
    (root / "tether.yaml").write_text(CONFIG.format(steps=steps, sleep=sleep, policy=policy,
                                                    backend=json.dumps(settings)))
    return root


def expected_artifacts(root: Path, steps: int) -> dict[str, str]:
    """SHA-256 of the artifacts of an uninterrupted run of the script (run here, with no tether at all)."""
    out = root / "expected"
    out.mkdir(exist_ok=True)
    shutil.copytree(root / "data", out / "data", dirs_exist_ok=True)
    subprocess.run([sys.executable, str(root / "script" / "train.py"), "--steps", str(steps), "--sleep", "0"],
                   cwd=out, check=True, capture_output=True, env=dict(os.environ, TETHER_ARTIFACTS_DIR=str(out / "a")))
    return {f"artifacts/{p.name}": sha256(p) for p in (out / "a").iterdir()}


def doit(root: Path, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "doit", *args], cwd=root, text=True, capture_output=True,
                          timeout=timeout, stdin=subprocess.DEVNULL, env=dict(os.environ, TETHER_TRACE="1"))


def start(root: Path, *args: str) -> Background:
    return Background(subprocess.Popen([sys.executable, "-m", "doit", *args], cwd=root, text=True,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                       start_new_session=True, env=dict(os.environ, TETHER_TRACE="1")))


def wait(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.002)


def run_dirs(far: Path) -> list[Path]:
    runs = far / "runs"
    return sorted(runs.iterdir()) if runs.is_dir() else []


def far_file(far: Path, name: str) -> Optional[Path]:
    found = run_dirs(far)
    return found[-1] / name if found else None


def far_lines(far: Path, name: str) -> list[str]:
    path = far_file(far, name)
    try:
        return path.read_text().splitlines() if path else []
    except FileNotFoundError:
        return []


def requests(bg: Background, command: str) -> int:
    """How many far-side `command` requests the doit has sent (TETHER_TRACE=1 names each on stderr)."""
    return len(re.findall(rf"\[far [^\]\n]*\] {command}\b", bg.text()))


def trigger(phase: str, far: Path, bg: Background) -> Callable[[], bool]:
    """The condition after which the phase's fault is injected: its request (or its progress) seen."""
    if phase == "push":
        return lambda: requests(bg, "push") > 0
    if phase == "watch":
        return lambda: any(line.startswith("step ") for line in far_lines(far, "train.log"))
    return lambda: requests(bg, "send") > 0  # the pull's first tar batch (only a pull sends)


def inject(phase: str, far: Path, bg: Background, delay_s: float, hit: Callable[[], None]) -> str:
    """Wait for the phase's trigger, then the seeded delay, then `hit()`; the moment in words."""
    wait(lambda: trigger(phase, far, bg)() or bg.proc.poll() is not None, 120, f"the {phase} phase")
    if bg.proc.poll() is not None:
        return f"doit ended (exit {bg.proc.returncode}) before the {phase} trigger"
    time.sleep(delay_s)  # the seeded timing IS the fault's moment
    hit()
    return f"{phase} + {delay_s * 1000:.0f} ms"


def check_run(root: Path, far: Path, expected: dict[str, str]) -> list[str]:
    """The invariants after the reruns: one run, one launch and one exit, no restart, artifacts equal to
    an uninterrupted run's, PULL_VERIFIED on the far side's manifest, no temporary file left as a result."""
    failures = []
    runs = run_dirs(far)
    if len(runs) != 1:
        return [f"expected one run on the far side, found {[p.name for p in runs]}"]
    events = [json.loads(line) for line in far_lines(far, "events.jsonl") if line.strip()]
    kinds = [e.get("event") for e in events]
    if kinds.count("launch") != 1 or kinds.count("exit") != 1:
        failures.append(f"launch/exit events {kinds.count('launch')}/{kinds.count('exit')}, want 1/1")
    state = json.loads((runs[0] / "state.json").read_text())
    if state.get("status") != "completed" or state.get("restarts"):
        failures.append(f"far state {state.get('status')} with {state.get('restarts')} restarts")
    local = root / ".tether" / "runs" / runs[0].name
    if not (runs[0] / "PULL_MANIFEST.json").is_file():
        return failures + ["the run was never sealed (no PULL_MANIFEST.json on the far side)"]
    manifest = (runs[0] / "PULL_MANIFEST.json").read_bytes()
    try:
        verified = json.loads((local / "PULL_VERIFIED.json").read_text())
    except FileNotFoundError:
        return failures + ["no PULL_VERIFIED.json here"]
    if verified.get("manifest_sha256") != hashlib.sha256(manifest).hexdigest():
        failures.append("PULL_VERIFIED.json is not on the far side's manifest")
    for path, want in expected.items():
        got = local / "files" / path
        if not got.exists() or sha256(got) != want:
            failures.append(f"{path} differs from the uninterrupted run's")
    stray = [str(p) for p in (local / "files").rglob("*") if p.name.endswith((".part", ".tmp")) or ".tmp-" in p.name]
    if stray:
        failures.append(f"temporary files left among the results: {stray}")
    return failures


def rerun_until_done(root: Path, tries: int = 3) -> tuple[int, str]:
    """`doit run train` until it succeeds (at most `tries`); (reruns used, the last output)."""
    for used in range(1, tries + 1):
        done = doit(root, "run", "train")
        if done.returncode == 0:
            return used, ""
    return tries + 1, f"exit {done.returncode}\n{done.stdout[-1500:]}\n{done.stderr[-3000:]}"


def sshd_killed(root: Path, server: SSHServer, far: Path, phase: str, seed: int, expected: dict[str, str],
                outage_s: float = 0.0) -> Outcome:
    """`doit run train`; sshd SIGKILLed (listener and sessions) at a seeded moment of `phase`, started again
    on the same port and key after `outage_s`; the doit finishes or is rerun until done; invariants checked."""
    rng = random.Random(seed)
    result = Outcome(seed, phase)
    bg = start(root, "run", "train")
    try:
        result.moment = inject(phase, far, bg, rng.uniform(0, 0.25), server.kill)
        time.sleep(outage_s)
        server.start()
        code = finish(bg, result, 180)
    finally:
        bg.kill()
        if server.process is None:
            server.start()
    return rerun_and_check(root, far, expected, code, result)


def rerun_and_check(root: Path, far: Path, expected: dict[str, str], code: Optional[int], result: Outcome) -> Outcome:
    """Rerun a failed command until done (at most 3 times), then every invariant of the finished run."""
    used, output = (0, "") if code == 0 else rerun_until_done(root)
    if used > 3:
        result.failures.append(f"the rerun did not complete: {output}")
    result.failures += check_run(root, far, expected)
    return result


def finish(bg: Background, result: Outcome, timeout: float) -> Optional[int]:
    """The doit's exit code, a hang past `timeout` recorded as a failure (None), a traceback as one too."""
    try:
        code: Optional[int] = bg.finish(timeout=timeout)
    except subprocess.TimeoutExpired:
        result.failures.append(f"doit did not end within {timeout:g}s after the fault (a hang)")
        code = None
    if "Traceback" in bg.text():
        result.failures.append("a traceback instead of a message: " + bg.text()[-2000:])
    result.notes.append(f"doit exit {code}")
    return code


BOUND_SLACK_S = 6.0  # process starts and one poll interval on a loaded two-core machine


def link_frozen(root: Path, server: SSHServer, far: Path, phase: str, seed: int, expected: dict[str, str],
                alive_s: float, connect_s: float = 3) -> Outcome:  # connect_s: the project's connect_timeout_s
    """`doit run train`; at a seeded moment of `phase` sshd (listener and sessions) is SIGSTOPped, a link that
    goes silent without closing: within alive_timeout_s + connect_timeout_s (+ slack) doit must say so in one
    line naming the host and what to do; then sshd is continued and the run completes (rerun if doit ended)."""
    rng = random.Random(seed)
    result = Outcome(seed, phase)
    bg = start(root, "run", "train")
    frozen: list[int] = []
    try:
        def freeze() -> None:
            frozen.extend(server.freeze())
        result.moment = inject(phase, far, bg, rng.uniform(0, 0.25), freeze)
        since, began = len(bg.text()), time.monotonic()
        bound = alive_s + connect_s + BOUND_SLACK_S
        try:
            wait(lambda: bool(said_host(bg.text()[since:])) or bg.proc.poll() is not None, bound, "a message")
        except AssertionError:
            result.failures.append(f"no message naming the host within {bound:g}s of the link going silent "
                                   f"(it said: {bg.text()[since:][-800:]!r})")
        else:
            line = said_host(bg.text()[since:])
            result.notes.append(f"after {time.monotonic() - began:.1f}s: {line}")
            if not line:
                result.failures.append(f"doit ended without naming the host: {bg.text()[since:][-800:]!r}")
        server.thaw(frozen)
        frozen.clear()
        code = finish(bg, result, 180)
    finally:
        server.thaw(frozen)
        bg.kill()
    return rerun_and_check(root, far, expected, code, result)


def said_host(text: str) -> str:
    """The first line that names the host and what to do (run again, retrying, is the host up)."""
    for line in text.splitlines():
        if "127.0.0.1" in line and re.search(r"run the command again|retrying|run the same command again|"
                                             r"is the host up", line):
            return line.strip()
    return ""


def kill_each_phase(root: Path, server: SSHServer, far: Path, seed: int, expected: dict[str, str],
                    most_outage_s: float = 0.0) -> list[Outcome]:
    """One run, sshd SIGKILLed once mid-push, once mid-watch and once mid-pull (seeded moments), each time
    started again on the same port and key after a seeded outage; a push or pull that ended is rerun,
    a watch must ride it out; the end-of-run invariants count for all three faults."""
    rng = random.Random(seed)
    results, bg = [], None
    try:
        for phase in PHASES:
            result = Outcome(seed, phase)
            if bg is not None and bg.proc.poll() not in (None, 0) and results[-1].phase == "watch":
                results[-1].failures.append(f"watch gave up after sshd came back: {bg.text()[-1500:]}")
            if bg is None or bg.proc.poll() is not None:
                bg = start(root, "run", "train")
            result.moment = inject(phase, far, bg, rng.uniform(0, 0.2), server.kill)
            time.sleep(rng.uniform(0, most_outage_s))  # the seeded length of the outage
            server.start()
            if phase != "watch":  # push and pull end (one line, rerun); watch retries, then pulls
                finish(bg, result, 120)
            results.append(result)
        used, output = rerun_until_done(root)
    finally:
        if bg is not None:
            bg.kill()
        if server.process is None:
            server.start()
    common = [f"the rerun did not complete: {output}"] if used > 3 else []
    common += check_run(root, far, expected)
    for result in results:
        result.failures += common
    return results
