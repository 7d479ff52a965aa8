"""Soak of fault-suite part B: sshd killed or frozen over push/watch/pull, a flaky SLURM scheduler; figures as JSON."""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import signal
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))

from faults_net import PHASES, Outcome, expected_artifacts, kill_each_phase, link_frozen, make_project  # noqa: E402
from faults_scheduler import MODES, SLURM, FlakyScheduler, ended_in_outage, healthy_through, queued_through  # noqa: E402
from helpers import stop_leftover_runs  # noqa: E402
from sshd import SSHServer  # noqa: E402

OUT = REPO / "bench" / "results" / "faults_net.json"
ALIVE_S = 4

ABOUT = {
    "sshd killed mid-push": "One `doit run train` over ssh (the public-style script, 16 MB of seeded data, a 16 MB "
        "artifact); sshd, the listener and every live session, is SIGKILLed a seeded 0-200 ms after the push request "
        "goes out, then started again on the same port and host key after a seeded outage; doit is rerun until done.",
    "sshd killed mid-watch": "The same run, sshd SIGKILLed a seeded moment after the job's script printed its first "
        "step (watch polling it), then started again: watch must retry and carry on, the run must not notice.",
    "sshd killed mid-pull": "The same run, sshd SIGKILLed a seeded moment after the pull's first tar batch was "
        "asked for, then started again; the failed pull is rerun until the artifacts verify.",
    "silent link": "sshd (listener and sessions) SIGSTOPped at a seeded moment of push, watch or pull, so the link "
        f"goes silent without closing; with alive_timeout_s {ALIVE_S} and connect_timeout_s 3, doit must print a line "
        "naming the host and what to do within the bound; then sshd continues and the run is completed.",
    "flaky squeue": "A healthy SLURM job (the real single-node cluster) watched through squeue outages of seeded "
        "kind (exit 1, a hang past the 2 s timeout, garbage on stdout, empty output) and seeded length ({polls} polls "
        "at poll_interval_s 1; a hang makes a poll last the 2 s timeout), several per run, through a wrapper first on "
        "the login node's PATH.",
    "queued job": "A job held PENDING (sbatch --begin an hour away) while squeue prints garbage, prints nothing "
        "or fails, each for a seeded 2-5 polls, in seeded order: watch must keep waiting and never submit it again "
        "(the status-fetch snowball of SkyPilot issue 10155).",
    "ended in outage": "squeue and scontrol fail or hang (seeded) while the job is really scancelled; watch must "
        "decide nothing while they are down ({polls} polls) and, once they answer, report the job's real end "
        "(cancelled from outside).",
}
INVARIANTS = {
    "kill": ["the rerun completes (at most 3 reruns)", "exactly one launch and one exit event (events.jsonl)",
             "the far state is completed with 0 restarts", "artifacts' SHA-256 equal an uninterrupted run's",
             "PULL_VERIFIED.json carries the far side's PULL_MANIFEST.json SHA-256",
             "no temporary file among the pulled results", "no traceback; watch never gives up after sshd returns"],
    "frozen": ["a line naming the host and what to do within alive_timeout_s + connect_timeout_s + 6 s",
               "no traceback", "the run completes after sshd continues (at most 3 reruns)",
               "exactly one launch and one exit event", "artifacts' SHA-256 equal an uninterrupted run's",
               "PULL_VERIFIED.json carries the far side's manifest SHA-256"],
    "squeue": ["watch does not end during the outage", "watch prints a line naming squeue and its error",
               "the job is submitted once (slurm.json) and never cancelled", "exactly one launch and one exit event",
               "0 restarts; the run completes", "artifacts' SHA-256 equal an uninterrupted run's"],
    "queued": ["watch does not end while the job is queued", "the job is submitted exactly once (slurm.json)"],
    "ended": ["watch does not end while squeue and scontrol are down",
              "afterwards watch reports the real reason (cancelled from outside tether)",
              "the job is never submitted again"],
}


def replay(args, only: str) -> str:
    """The command that replays one scenario of this soak (every round of it, the same seeds)."""
    longer = "" if args.outage_polls == (2, 6) else " --outage-polls %d-%d --step-s %g" % (*args.outage_polls, args.step_s)
    return f"python bench/faults_net.py --seed {args.seed} --rounds {args.rounds} --only {only}{longer}"


def record(scenarios: dict, name: str, kind: str, outcome: Outcome, reproduce: str) -> None:
    entry = scenarios.setdefault(name, {"name": name, "about": ABOUT[name], "faults": 0, "survived": 0,
                                        "invariants": INVARIANTS[kind], "failures": [], "reproduce": reproduce})
    entry["faults"] += 1
    if outcome.failures:
        entry["failures"].append({"seed": outcome.seed, "moment": f"{outcome.phase}: {outcome.moment}",
                                  "what": "; ".join(outcome.failures)[:2000]})
    else:
        entry["survived"] += 1
    print(f"  {name:22} seed {outcome.seed:>6} {outcome.moment:48} {'ok' if not outcome.failures else 'FAILED'}",
          flush=True)


def ssh_rounds(args, base: Path, scenarios: dict) -> None:
    server = SSHServer(base / "sshd").start()
    try:
        for i in range(args.rounds if wants(args, "ssh") else 0):
            seed = args.seed + i
            root, far = base / f"kill-{i}", base / f"far-kill-{i}"
            make_project(root, server, far, seed, steps=40)
            expected = expected_artifacts(root, 40)
            for outcome in kill_each_phase(root, server, far, seed, expected, most_outage_s=1.0):
                record(scenarios, f"sshd killed mid-{outcome.phase}", "kill", outcome,
                       replay(args, "ssh"))
            stop_leftover_runs(far)
        for i in range(args.rounds if wants(args, "frozen") else 0):
            seed, phase = args.seed + i, PHASES[(args.seed + i) % 3]
            root, far = base / f"frozen-{i}", base / f"far-frozen-{i}"
            make_project(root, server, far, seed, steps=40, alive_timeout_s=ALIVE_S)
            outcome = link_frozen(root, server, far, phase, seed, expected_artifacts(root, 40), alive_s=ALIVE_S)
            record(scenarios, "silent link", "frozen", outcome,
                   replay(args, "frozen"))
            stop_leftover_runs(far)
    finally:
        server.thaw(server.sessions() + ([server.process.pid] if server.process else []))
        server.stop()


def slurm_rounds(args, base: Path, scenarios: dict) -> None:
    from slurm_fixtures import new_remote_dir, remove_remote_dir, started_cluster

    with started_cluster() as cluster:
        scheduler = FlakyScheduler(base / "flaky", str(cluster.conf))
        scheduler.login.start()
        try:
            per_run = 3
            for i in range(-(-args.rounds // per_run) if wants(args, "squeue") else 0):
                seed = args.seed + i
                rng = random.Random(seed)
                stretches = [(rng.choice(MODES), rng.randint(*args.outage_polls)) for _ in range(per_run)]
                remote = new_remote_dir()
                try:
                    root = make_project(base / f"sq-{i}", scheduler.login, remote, seed, steps=1000,
                                        sleep=args.step_s, policy="on-failure", **SLURM)
                    for outcome in healthy_through(root, scheduler, remote, seed, 1000, stretches):
                        record(scenarios, "flaky squeue", "squeue", outcome,
                               replay(args, "squeue"))
                finally:
                    remove_remote_dir(cluster, remote)
            for i in range(-(-args.rounds // per_run) if wants(args, "queued") else 0):
                seed = args.seed + i
                remote = new_remote_dir()
                try:
                    root = make_project(base / f"q-{i}", scheduler.login, remote, seed, steps=20,
                                        policy="on-failure", sbatch_options=["--begin=now+3600"], **SLURM)
                    for outcome in queued_through(root, scheduler, remote, seed):
                        record(scenarios, "queued job", "queued", outcome,
                               replay(args, "queued"))
                finally:
                    remove_remote_dir(cluster, remote)
            for i in range(args.rounds if wants(args, "ended") else 0):
                seed = args.seed + i
                rng = random.Random(seed)
                remote = new_remote_dir()
                try:
                    root = make_project(base / f"end-{i}", scheduler.login, remote, seed, steps=600,
                                        sleep=args.step_s, policy="on-failure", **SLURM)
                    outcome = ended_in_outage(root, scheduler, remote, seed, cluster, rng.choice(("fail", "hang")),
                                              rng.randint(*args.outage_polls))
                    record(scenarios, "ended in outage", "ended", outcome,
                           replay(args, "ended"))
                finally:
                    remove_remote_dir(cluster, remote)
        finally:
            scheduler.heal()
            scheduler.login.stop()


def wants(args, *kinds: str) -> bool:
    """Whether --only asks for any of these scenario kinds."""
    return "all" in args.only or bool(args.only & set(kinds))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seed", type=int, default=1515)
    parser.add_argument("--rounds", type=int, default=10, help="runs per scenario (each kill run hits 3 phases)")
    parser.add_argument("--only", type=lambda v: set(v.split(",")), default={"all"},
                        help="all, or a comma list of ssh, frozen, squeue, queued, ended")
    parser.add_argument("--outage-polls", type=lambda v: tuple(int(p) for p in v.split("-")), default=(2, 6),
                        help="LO-HI: a scheduler outage lasts a seeded LO..HI polls of watch (poll_interval_s 1); "
                             "120-180 holds squeue down for minutes")
    parser.add_argument("--step-s", type=float, default=0.05, help="the SLURM jobs' seconds per step (1000 or 600 "
                        "steps): raise it with --outage-polls so a job outlasts its outages")
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stopped soak still stops its daemons and runs
    command = "python bench/faults_net.py " + " ".join(sys.argv[1:])
    polls = "%d-%d" % args.outage_polls
    for name in ("flaky squeue", "ended in outage"):
        ABOUT[name] = ABOUT[name].format(polls=polls)
    started, began = datetime.now(timezone.utc), time.monotonic()
    print(f"faults_net: seed {args.seed}, {args.rounds} rounds ({command})", flush=True)
    scenarios: dict = {}
    base = Path(tempfile.mkdtemp(prefix="tether-faults-net-"))
    try:
        run_parts(args, base, scenarios)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    part = "B: network, far-side daemons, flaky scheduler"
    part += "" if args.outage_polls == (2, 6) else f" (scheduler outages of {polls} polls)"
    result = {"part": part, "command": command, "seed": args.seed,
              "started": started.isoformat(timespec="seconds"), "seconds": round(time.monotonic() - began, 1),
              "machine": f"{platform.machine()}, {os.cpu_count()} cores", "scenarios": list(scenarios.values())}
    print(table(result))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if all(s["faults"] == s["survived"] for s in result["scenarios"]) else 1


def run_parts(args, base: Path, scenarios: dict) -> None:
    if wants(args, "ssh", "frozen"):
        ssh_rounds(args, base, scenarios)
    if wants(args, "squeue", "queued", "ended"):
        slurm_rounds(args, base, scenarios)


def table(result: dict) -> str:
    lines = [f"{'scenario':24} {'faults':>6} {'survived':>8} {'invariants':>10}  reproduce"]
    for s in result["scenarios"]:
        lines.append(f"{s['name']:24} {s['faults']:>6} {s['survived']:>8} {len(s['invariants']):>10}  {s['reproduce']}")
    return "\n".join(lines) + f"\n{result['seconds']:.0f} s, {result['machine']}"


if __name__ == "__main__":
    sys.exit(main())
