"""tether's push and pull over ssh, side by side with rsync, scp and sha256sum, on one loopback sshd.

    python bench/transfer_ssh.py [--big-mb 1024] [--small 2000] [--repeat 5]

Starts a real sshd on 127.0.0.1 (tests/sshd.py), then times, in each of REPEAT runs (fresh
folders and files, the same sshd):
  push   one big file, SMALL small files, and the small files again with one changed:
         `doit run push` (hashing, object upload, snapshot) vs `rsync -a` vs `scp -r`
  pull   the same files as a run's artifacts: `doit run pull verify` vs `rsync -a` + `sha256sum -c`
and the peak resident memory of the tether process (GNU time's %M). Prints JSON: per case the
median seconds of each tool, the median of the runs' ratios to rsync and every run's ratio, and
the peak memory's maximum over the runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from sshd import SSHServer  # noqa: E402

TRAINER = """import os, shutil, sys
src, out = os.path.join(os.environ["TETHER_DATA_DIR"], "payload"), os.environ["TETHER_ARTIFACTS_DIR"]
shutil.copytree(src, os.path.join(out, "payload"))
"""


def timed(argv: list[str], cwd: Path | None = None) -> tuple[float, int]:
    """(seconds, peak RSS in KiB) of a command, which must succeed."""
    started = time.perf_counter()
    done = subprocess.run(["/usr/bin/time", "-f", "%M", *argv], cwd=cwd, capture_output=True, text=True)
    elapsed = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{argv} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return elapsed, int(done.stderr.strip().splitlines()[-1])


class Bench:
    def __init__(self, root: Path, server: SSHServer, reuse: float | None = None) -> None:
        self.reuse = reuse  # reuse_connection_s for tether (None: its default)
        self.root, self.server = root, server
        self.ssh = (f"ssh -i {server.client_key} -p {server.port} -o BatchMode=yes "
                    f"-o UserKnownHostsFile={server.known_hosts}")

    def project(self, name: str, payload: Path) -> Path:
        """A tether project whose data is `payload` and whose trainer copies it into its artifacts."""
        proj = self.root / name
        proj.mkdir()
        shutil.copy(REPO / "dodo.py", proj / "dodo.py")
        (proj / "copy_payload.py").write_text(TRAINER)
        shutil.move(str(payload), proj / "payload")
        backend = self.server.backend_config(self.root / f"{name}-remote")
        backend.pop("reuse_connection_s")  # tether's default: the connection is kept for the next command
        if self.reuse is not None:
            backend["reuse_connection_s"] = self.reuse
        (proj / "tether.yaml").write_text(
            f"name: {name}\nbackend: lab\ncode: {{paths: [copy_payload.py]}}\ndata: {{paths: [payload]}}\n"
            f"trainer: {{type: command, command: \"{{python}} copy_payload.py\"}}\nartifacts: [\"payload/**\"]\n"
            f"backends:\n  lab: {json.dumps(backend)}\n")
        return proj

    def doit(self, proj: Path, *tasks: str) -> tuple[float, int]:
        return timed([sys.executable, "-m", "doit", "run", *tasks], cwd=proj)

    def rsync(self, source: str, target: str) -> float:
        return timed(["rsync", "-a", "-e", self.ssh, source, target])[0]

    def scp(self, source: Path, target: str) -> float:
        return timed(["scp", "-q", "-r", "-i", str(self.server.client_key), "-P", str(self.server.port),
                      "-o", "BatchMode=yes", "-o", f"UserKnownHostsFile={self.server.known_hosts}",
                      str(source), target])[0]

    def remote(self, path: Path) -> str:
        return f"root@127.0.0.1:{path}"


def make_big(folder: Path, mb: int) -> None:
    folder.mkdir(parents=True)
    with open(folder / "big.bin", "wb") as f:
        for _ in range(mb):
            f.write(os.urandom(1 << 20))


def make_small(folder: Path, count: int) -> None:
    folder.mkdir(parents=True)
    for i in range(count):
        (folder / f"f{i:05d}.txt").write_bytes(os.urandom(8192))


def case(bench: Bench, name: str, payload: Path, change_one: bool = False) -> dict:
    """Push, (changed push), pull+verify of one payload by tether, rsync and scp."""
    copy = bench.root / f"{name}-copy"
    shutil.copytree(payload, copy)
    proj = bench.project(name, payload)
    push_s, push_kib = bench.doit(proj, "push")
    rsync_dest, scp_dest = bench.root / f"{name}-rsync", bench.root / f"{name}-scp"
    rsync_s = bench.rsync(f"{copy}/", bench.remote(rsync_dest))
    scp_s = bench.scp(copy, bench.remote(scp_dest))
    result = {"push_s": {"tether": push_s, "rsync": rsync_s, "scp": scp_s}, "push_peak_rss_mb": push_kib / 1024}
    if change_one:
        first = sorted((proj / "payload").iterdir())[0]
        first.write_bytes(os.urandom(8192))
        shutil.copy(first, copy / first.name)
        (proj / "copy_payload.py").write_text(TRAINER + "# a new run\n")
        changed_s, _ = bench.doit(proj, "push")
        result["changed_push_s"] = {"tether": changed_s, "rsync": bench.rsync(f"{copy}/", bench.remote(rsync_dest))}
    bench.doit(proj, "watch")  # the run copies the payload into its artifacts; the far side seals it
    pull_s, pull_kib = bench.doit(proj, "pull", "verify")
    (run,) = [p for p in (bench.root / f"{name}-remote" / "runs").iterdir() if (p / "PULL_MANIFEST.json").exists()]
    home = bench.root / f"{name}-home"
    sums = bench.root / f"{name}.sha256"
    subprocess.run(f"cd {copy} && sha256sum $(ls) > {sums}", shell=True, check=True)
    rsync_pull = bench.rsync(f"{bench.remote(run / 'artifacts' / 'payload')}/", str(home))
    check_s = timed(["sh", "-c", f"cd {home} && sha256sum --quiet -c {sums}"])[0]
    result["pull_verify_s"] = {"tether": pull_s, "rsync+sha256sum": rsync_pull + check_s}
    result["pull_peak_rss_mb"] = pull_kib / 1024
    return result


BASES = ("rsync", "rsync+sha256sum")  # what the ratios are to


def ratios(result: dict) -> dict:
    """Each tool's seconds over rsync's (or rsync and sha256sum's), per measurement of one run."""
    out = {}
    for key, values in result.items():
        if isinstance(values, dict):
            base = values.get("rsync", values.get("rsync+sha256sum"))
            out[key] = {k: round(v / base, 2) for k, v in values.items() if k not in BASES}
    return out


def one_run(root: Path, server: SSHServer, big_mb: int, small: int, reuse: float | None) -> dict:
    """Both cases, in the fresh folder `root` (removed afterwards: a 1 GiB case leaves several copies)."""
    root.mkdir()
    try:
        bench = Bench(root, server, reuse)
        make_big(root / "big-src", big_mb)
        make_small(root / "small-src", small)
        return {f"one {big_mb} MiB file": case(bench, "big", root / "big-src"),
                f"{small} small files": case(bench, "small", root / "small-src", change_one=True)}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def summary(runs: list[dict]) -> dict:
    """One case over every run: median seconds per tool, median and every ratio, peak memory's maximum."""
    timed_keys = [k for k, v in runs[0].items() if isinstance(v, dict)]
    each = [ratios(r) for r in runs]
    return {
        "seconds_median": {k: {tool: round(statistics.median(r[k][tool] for r in runs), 2) for tool in runs[0][k]}
                           for k in timed_keys},
        "ratio_to_rsync_median": {k: {tool: round(statistics.median(r[k][tool] for r in each), 2)
                                      for tool in each[0][k]} for k in timed_keys},
        "ratios_to_rsync": {k: {tool: [r[k][tool] for r in each] for tool in each[0][k]} for k in timed_keys},
        "peak_rss_mb_max": {k: round(max(r[k] for r in runs), 1) for k, v in runs[0].items()
                            if not isinstance(v, dict)},
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--big-mb", type=int, default=1024)
    parser.add_argument("--small", type=int, default=2000)
    parser.add_argument("--repeat", type=int, default=5, help="whole comparisons, each in fresh folders")
    parser.add_argument("--reuse-connection-s", type=float, default=None,
                        help="tether's reuse_connection_s (default: tether's own; 0: a fresh ssh connection per command)")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="tether-bench-"))
    server = SSHServer(root / "sshd").start()
    try:
        runs = [one_run(root / f"run{i}", server, args.big_mb, args.small, args.reuse_connection_s)
                for i in range(args.repeat)]
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)
    report = {"repeat": args.repeat, "reuse_connection_s": args.reuse_connection_s, **{name: summary([r[name] for r in runs]) for name in runs[0]}}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
