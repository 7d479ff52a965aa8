"""Soak: SIGKILL doit/tether at hundreds of seeded moments (local backend and a real sshd), rerun, check the invariants, write bench/results/faults_kill.json."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

import kill_points as kp  # noqa: E402

SHARE = {"train": 0.5, "pull": 0.15, "verify": 0.1, "down": 0.12, "repro": 0.13}  # of each backend's moments
SSH_SHARE = {"train": 0.6, "pull": 0.2, "down": 0.2}
ABOUT = {
    "train": "SIGKILL of the whole process group of `doit run train` (up, push, launch, watch, pull, verify) on "
             "the {backend} backend with the stdlib demo trainer: at every distinct traced moment of a calibrated "
             "uninterrupted run (each far-side command while the far side works on it, each file write before its "
             "bytes, each rename before it happens, each spawn), then at seeded event counts and seeded delays "
             "over its wall time. After the kill `doit run down confirm=yes` is tried once before anything is "
             "verified (it must refuse), then `doit run train` is rerun until it succeeds.",
    "pull": "SIGKILL of `doit pull` after an uninterrupted `doit run watch` on the {backend} backend, at every "
            "traced moment of the pull (the manifest's download and rename, each file's .part write and rename, "
            "the far side's send) and at seeded counts and delays; `doit pull` is rerun until it succeeds, then "
            "`doit run train` finishes the job.",
    "verify": "SIGKILL of `doit run verify` after an uninterrupted watch and pull on the {backend} backend, at each "
              "traced moment (the PULL_VERIFIED.json write and rename, far-side commands) and seeded delays; "
              "verify is rerun until it succeeds, then `doit run train` finishes.",
    "down": "SIGKILL of `doit run down confirm=yes` after an uninterrupted, verified train on the {backend} "
            "backend, at each traced moment (the far-side remove, the down.json write) and seeded delays; "
            "down is rerun until it succeeds; the far run dir must be gone only once verified here.",
    "repro": "SIGKILL of `tether repro .tether/runs/ID` (a second run from the recorded code, data and settings) "
             "on the {backend} backend at each traced moment and seeded delays; repro is rerun until it "
             "succeeds; both runs then meet every invariant and the reproduction's results equal the original's.",
}


def counts(total: int, share: dict[str, float]) -> dict[str, int]:
    names = list(share)
    got = {n: max(1, int(total * share[n])) for n in names}
    got[names[0]] += total - sum(got.values())
    return got


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--seed", type=int, default=15)
    p.add_argument("--local", type=int, default=200, help="moments on the local backend")
    p.add_argument("--ssh", type=int, default=50, help="moments over ssh (a real sshd on 127.0.0.1)")
    p.add_argument("--only", default="", help="COMMAND:KIND:AT, one moment (from a failure's reproduce line)")
    p.add_argument("--backend", default="", help="with --only: local or ssh")
    p.add_argument("--scenario", default="", help="COMMAND:BACKEND, only that scenario of the same schedule")
    p.add_argument("--max-seconds", type=float, default=3600, help="stop scheduling new moments after this")
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "faults_kill.json"))
    return p.parse_args()


def scenario(args: argparse.Namespace, site: kp.Site, command: str, outcomes: list[kp.Outcome],
             calibration: kp.Timeline) -> dict:
    seed = args.seed
    missed = [o for o in outcomes if o.landed.startswith("after the end")]  # no fault injected: not counted
    outcomes = [o for o in outcomes if o not in missed]
    failures = [{"seed": seed, "moment": f"{o.moment.kind} {o.moment.at:g} ({o.landed})",
                 "what": "; ".join(o.failures)[:800], "reproduce": o.moment.replay(seed, site.backend)}
                for o in outcomes if o.failures]
    landed = sorted({o.landed for o in outcomes})
    return {"name": f"kill {command} ({site.backend})", "about": ABOUT[command].format(backend=site.backend),
            "command": kp.WORDS[command],
            "backend": site.backend, "faults": len(outcomes), "survived": len(outcomes) - len(failures),
            "invariants": kp.INVARIANTS, "failures": failures,
            "calibration": {"events": len(calibration.events), "seconds": round(calibration.seconds, 2)},
            "moments_landed": landed, "finished_before_the_kill": len(missed), "reruns": sum(o.reruns for o in outcomes),
            "reproduce": f"python bench/faults_kill.py --seed {seed} --local {args.local} --ssh {args.ssh} "
                         f"--scenario {command}:{site.backend}"}


def soak_site(args: argparse.Namespace, site: kp.Site, total: int, share: dict[str, float], base: Path,
              deadline: float) -> list[dict]:
    seed, expected, out = args.seed, kp.reference(base / "reference", site), []
    for command, n in counts(total, share).items():
        if args.scenario and args.scenario != f"{command}:{site.backend}":
            continue
        timeline = kp.calibrate(base / f"calibrate-{command}", site, command)
        outcomes = []
        for i, moment in enumerate(kp.schedule(seed, timeline, n)):
            if time.monotonic() > deadline:
                break
            o = kp.run_moment(base / f"{command}-{i}", site, moment, expected, early_down=command == "train")
            outcomes.append(o)
            print(f"{site.backend:5} {command:6} {moment.kind:5} {moment.at:<7g} {o.landed[:70]:70} "
                  f"{'ok' if not o.failures else 'FAIL ' + '; '.join(o.failures)[:200]}", flush=True)
        out.append(scenario(args, site, command, outcomes, timeline))
    return out


def table(scenarios: list[dict]) -> str:
    rows = [f"{'scenario':24} {'faults':>6} {'survived':>8} {'invariants':>10}  reproduce"]
    rows += [f"{s['name']:24} {s['faults']:>6} {s['survived']:>8} {len(s['invariants']):>10}  {s['reproduce']}"
             for s in scenarios]
    return "\n".join(rows)


def main() -> int:
    args = parse()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stopped soak still stops its sshd and cleans up
    started, t0 = datetime.datetime.now(datetime.timezone.utc), time.monotonic()
    deadline = t0 + args.max_seconds
    scenarios: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="faults-kill-") as tmp:
        base = Path(tmp)
        server = None
        if args.ssh or args.backend == "ssh":
            from sshd import SSHServer
            server = SSHServer(base / "sshd").start()
        try:
            if args.only:
                return replay(args, base, server)
            if args.ssh:
                scenarios += soak_site(args, kp.Site("ssh", server), args.ssh, SSH_SHARE, base / "ssh", deadline)
            if args.local:
                scenarios += soak_site(args, kp.Site("local"), args.local, SHARE, base / "local", deadline)
        finally:
            if server is not None:
                server.stop()
    command = "python bench/faults_kill.py " + " ".join(sys.argv[1:])
    report = {"part": "kill", "command": command.strip(), "seed": args.seed, "started": started.isoformat(),
              "seconds": round(time.monotonic() - t0, 1), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
              "scenarios": scenarios}
    print(table(scenarios))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 1 if any(s["failures"] for s in scenarios) else 0


def replay(args: argparse.Namespace, base: Path, server: object) -> int:
    """One moment again, printing every invariant failure."""
    command, kind, at = args.only.split(":", 2)
    site = kp.Site(args.backend or "local", server)
    moment = kp.Moment(command, "match", 0, at) if kind == "match" else kp.Moment(command, kind, float(at))
    o = kp.run_moment(base / "replay", site, moment, kp.reference(base / "reference", site),
                      early_down=command == "train")
    print(f"seed {args.seed}: {command} {kind} {at}: landed {o.landed}; reruns {o.reruns}")
    print("\n".join(o.failures) or "every invariant held")
    return 1 if o.failures else 0


if __name__ == "__main__":
    sys.exit(main())
