"""Soak for part C (disk full, torn files): seeded faults, one results table, bench/results/faults_disk.json."""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tether.remote import mapped  # noqa: E402
from tether.remote.fileio import append_line, atomic_write_json  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "faults_disk.json")


@dataclass
class Scenario:
    name: str
    about: str
    invariants: List[str]
    faults: int = 0
    survived: int = 0
    failures: List[dict] = field(default_factory=list)
    reproduce: str = ""


def _zip_bytes(rng: random.Random) -> bytes:
    """A zip like torch.save's (stored members), of seeded size."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", b"p" * rng.randrange(100, 5000))
        z.writestr("archive/data/0", os.urandom(rng.randrange(1000, 200000)))
    return buffer.getvalue()


def torn_checkpoint(rng: random.Random, top: str) -> str:
    """One in-place checkpoint write cut at a seeded byte: the torn file is never kept; the kept copy stays."""
    run = os.path.join(top, "run")
    os.makedirs(os.path.join(run, "work", "out"))
    good = _zip_bytes(rng)
    with open(os.path.join(run, "work", "out", "ckpt.pt"), "wb") as f:
        f.write(good)
    mapped.keep(run, "out/ckpt.pt", 1)
    kept = os.path.join(run, "checkpoints", "ckpt.pt")
    before = hashlib.sha256(open(kept, "rb").read()).hexdigest()
    new = _zip_bytes(rng)
    cut = rng.randrange(0, len(new) - 22)  # anywhere before the end record's last byte
    with open(os.path.join(run, "work", "out", "ckpt.pt"), "wb") as f:
        f.write(new[:cut])
    _, skipped = mapped.keep(run, "out/ckpt.pt", 1)
    if hashlib.sha256(open(kept, "rb").read()).hexdigest() != before:
        return "the kept copy was replaced by a torn one (cut at %d of %d)" % (cut, len(new))
    if cut >= 4 and not any("torn" in why for why in skipped.values()):
        return "the torn file was not named as torn (cut at %d): %s" % (cut, skipped)
    if mapped.resume_point(run, "out/ckpt.pt") != kept:
        return "the resume point is not the intact kept copy (cut at %d)" % cut
    return ""


def torn_events(rng: random.Random, top: str) -> str:
    """events.jsonl whose last line a full disk cut at a seeded byte: the next event is a line of its own."""
    path = os.path.join(top, "events.jsonl")
    first = (json.dumps({"event": "step", "step": rng.randrange(1000)}) + "\n").encode()
    torn = (json.dumps({"event": "step", "step": 2, "pad": "x" * rng.randrange(50)}) + "\n").encode()
    with open(path, "wb") as f:
        f.write(first + torn[:rng.randrange(1, len(torn) - 1)])
    append_line(path, (json.dumps({"event": "exit", "status": "failed"}) + "\n").encode())
    lines = open(path, "rb").read().split(b"\n")
    if lines[-1] != b"" or json.loads(lines[-2]).get("event") != "exit" or json.loads(lines[0])["event"] != "step":
        return "the event after a torn line is not readable: %r" % lines[-3:]
    return ""


def full_state(rng: random.Random, top: str) -> str:
    """state.json rewritten on a tmpfs with a seeded free size: the old file or the whole new one, never torn."""
    mount = os.path.join(top, "mnt")
    os.makedirs(mount)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", mount], check=True)
    try:
        path = os.path.join(mount, "state.json")
        atomic_write_json(path, {"status": "running", "attempt": 1})
        with open(os.path.join(mount, "filler"), "wb") as f:
            st = os.statvfs(mount)
            f.write(b"\0" * max(0, st.f_bavail * st.f_frsize - rng.randrange(0, 3) * 4096))
        new = {"status": "failed", "reason": "x" * rng.randrange(1000, 20000)}
        try:
            atomic_write_json(path, new)
        except OSError:
            pass
        got = json.load(open(path))
        if got not in ({"status": "running", "attempt": 1}, new):
            return "state.json is neither the old nor the new one"
        if [n for n in os.listdir(mount) if ".tmp" in n]:
            return "a temporary file was left on the full disk"
        return ""
    finally:
        subprocess.run(["umount", "-l", mount], check=False)


def _torn_or_junk(rng: random.Random, whole: bytes) -> bytes:
    """A seeded cut of `whole`, or seeded garbage, or valid JSON of the wrong shape."""
    kind = rng.randrange(4)
    if kind < 2:
        return whole[:rng.randrange(0, len(whole) - 1)]
    if kind == 2:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200)))
    return rng.choice([b"[]", b"null", b"5", b'"completed"', b"[{\"status\": \"completed\"}]"])


def torn_state(rng: random.Random, top: str) -> str:
    """A finished run's state.json torn or garbage: probe and start refuse it in words and touch nothing."""
    from tether.remote import launcher
    from tether.remote.fileio import TornFile

    run = os.path.join(top, "run")
    os.makedirs(run)
    whole = json.dumps({"status": "completed", "final": True, "exit_code": 0, "attempt": rng.randrange(1, 5),
                        "reason": "x" * rng.randrange(100)}).encode()
    data = _torn_or_junk(rng, whole)
    with open(os.path.join(run, "state.json"), "wb") as f:
        f.write(data)
    for command in (launcher.probe, launcher.start):
        try:
            command(run)
        except TornFile as err:
            if "state.json is torn or damaged" not in str(err):
                return "%s: the message does not name the torn file: %s (%r)" % (command.__name__, err, data[:40])
        except Exception as err:  # noqa: BLE001 (anything else is the finding)
            return "%s: %s instead of a clear message (%r)" % (command.__name__, type(err).__name__, data[:40])
        else:
            return "%s trusted a torn state.json (%r)" % (command.__name__, data[:40])
    if os.listdir(run) != ["state.json"]:
        return "a command acted on a torn state.json: %s" % sorted(os.listdir(run))
    return ""


def torn_verified(rng: random.Random, top: str) -> str:
    """PULL_VERIFIED.json torn or garbage: it proves nothing (still_verified is False), never a traceback."""
    from tether import manifest
    from tether.paths import RunPaths

    run = RunPaths("torn-run", top, "/far")
    os.makedirs(run.files)
    whole = json.dumps({"run_id": "torn-run", "manifest_sha256": "0" * 64, "files": {}}).encode()
    with open(run.manifest, "wb") as f:
        f.write(json.dumps({"files": []}).encode())
    with open(run.verified, "wb") as f:
        f.write(_torn_or_junk(rng, whole))
    try:
        trusted = manifest.still_verified(run)
    except Exception as err:  # noqa: BLE001
        return "still_verified raised %s: %s" % (type(err).__name__, err)
    return "a torn PULL_VERIFIED.json was trusted" if trusted else ""


def part_longer(rng: random.Random, top: str) -> str:
    """A .part file longer than the file it is for (or of the same size, other bytes): never continued."""
    from tether.pipelines import transfer

    data = os.urandom(rng.randrange(1, 100000))
    local = os.path.join(top, "here", "f.bin")
    os.makedirs(os.path.dirname(local))
    with open(local + transfer.PART, "wb") as f:
        f.write(os.urandom(len(data) + rng.randrange(0, 5000)))
    said = []

    class Progress:
        def write(self, text: str, file=None) -> None:
            said.append(text)

        def update(self, n: int) -> None:
            pass

    sha = hashlib.sha256(data).hexdigest()
    transfer.get_resumable(lambda offset, write: write(data[offset:]), local, len(data), sha, Progress(),
                           lambda want, got: RuntimeError("the far file changed: %s %s" % (want, got)))
    if open(local, "rb").read() != data:
        return "the result is not the far file"
    if os.path.exists(local + transfer.PART):
        return "the .part file was left"
    return ""


SCENARIOS = {
    "torn checkpoint": (torn_checkpoint, "A script's checkpoint written in place (a zip, as torch.save writes) is cut at a "
                        "seeded byte, as a full disk or a kill leaves it; the launcher's keep() and resume_point() "
                        "run on it with an intact kept copy from an earlier exit.",
                        ["the kept copy's SHA-256 is unchanged", "the torn file is named as torn",
                         "the resume point is the intact kept copy"]),
    "torn events line": (torn_events, "events.jsonl ends in a line cut at a seeded byte (a write a full disk cut "
                         "short); the launcher appends its next event.",
                         ["the appended event is a whole JSON line of its own", "earlier lines still parse"]),
    "state.json on a full disk": (full_state, "state.json is rewritten atomically on a 1 MiB tmpfs that a filler "
                                  "leaves 0-2 pages free, with a new state of seeded size.",
                                  ["state.json is the old or the whole new one", "no temporary file is left"]),
    "torn state.json": (torn_state, "A finished run's state.json is cut at a seeded byte, replaced by seeded "
                        "garbage or by valid JSON of the wrong shape; the far-side launcher's probe and start run "
                        "on it.", ["probe and start raise TornFile naming state.json (one line, no traceback)",
                                   "nothing is started or written in the run dir"]),
    "torn PULL_VERIFIED.json": (torn_verified, "This side's PULL_VERIFIED.json is cut at a seeded byte or replaced "
                                "by garbage or wrong-shaped JSON; the cheap up-to-date check reads it.",
                                ["no exception", "a torn record never counts as verified"]),
    ".part longer than its file": (part_longer, "A resumable download finds a .part file as long as or longer "
                                   "than the far file (seeded sizes, other bytes).",
                                   ["the result is byte-equal to the far file", "no .part is left"]),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seed", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=20, help="faults per scenario")
    parser.add_argument("--max-seconds", type=float, default=600)
    args = parser.parse_args()
    started, t0 = datetime.now(timezone.utc).isoformat(timespec="seconds"), time.monotonic()
    command = "python bench/faults_disk.py --seed %d --rounds %d" % (args.seed, args.rounds)
    done = []
    for index, (name, (run, about, invariants)) in enumerate(SCENARIOS.items()):
        sc = Scenario(name, about, invariants, reproduce=command)
        for round_ in range(args.rounds):
            if time.monotonic() - t0 > args.max_seconds:
                break
            seed = args.seed * 1000003 + index * 1009 + round_
            with tempfile.TemporaryDirectory() as top:
                what = run(random.Random(seed), top)
            sc.faults += 1
            if what:
                sc.failures.append({"seed": seed, "moment": "round %d" % round_, "what": what})
            else:
                sc.survived += 1
        done.append(sc)
    print("%-28s %7s %9s %11s  reproduce" % ("scenario", "faults", "survived", "invariants"))
    for sc in done:
        print("%-28s %7d %9d %11d  %s" % (sc.name, sc.faults, sc.survived, len(sc.invariants), sc.reproduce))
    out = {"part": "disk", "command": command, "seed": args.seed, "started": started,
           "seconds": round(time.monotonic() - t0, 1), "machine": "%s, %d cores" % (platform.machine(), os.cpu_count()),
           "scenarios": [asdict(sc) for sc in done]}
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w") as f:
        json.dump(out, f, indent=2)
        f.write("\n")


if __name__ == "__main__":
    main()
