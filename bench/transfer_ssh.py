"""tether's push and pull over ssh, side by side with rsync, scp and sha256sum, on one loopback sshd.

    python bench/transfer_ssh.py [--big-mb 1024] [--small 2000]

Starts a real sshd on 127.0.0.1 (tests/sshd.py), then times, in one run:
  push   one big file, SMALL small files, and the small files again with one changed:
         `doit run push` (hashing, object upload, snapshot) vs `rsync -a` vs `scp -r`
  pull   the same files as a run's artifacts: `doit run pull verify` vs `rsync -a` + `sha256sum -c`
and the peak resident memory of the tether process (GNU time's %M). Prints JSON with ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
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
    def __init__(self, root: Path, server: SSHServer) -> None:
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


def ratios(result: dict) -> dict:
    out = {}
    for key, values in result.items():
        if isinstance(values, dict):
            base = values.get("rsync", values.get("rsync+sha256sum"))
            out[key] = {k: round(v / base, 2) for k, v in values.items()}
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--big-mb", type=int, default=1024)
    parser.add_argument("--small", type=int, default=2000)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="tether-bench-"))
    server = SSHServer(root / "sshd").start()
    try:
        bench = Bench(root, server)
        make_big(root / "big-src", args.big_mb)
        make_small(root / "small-src", args.small)
        results = {f"one {args.big_mb} MiB file": case(bench, "big", root / "big-src"),
                   f"{args.small} small files": case(bench, "small", root / "small-src", change_one=True)}
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)
    report = {name: {"seconds": {k: ({n: round(t, 2) for n, t in v.items()} if isinstance(v, dict) else round(v, 1))
                                 for k, v in r.items()}, "ratio_to_rsync": ratios(r)} for name, r in results.items()}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
