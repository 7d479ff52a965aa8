"""A real 2-node SLURM job: `nodes: 2` runs a gloo script on both nodes, interrupted twice, resumed, verified.

The module's own cluster (tests/slurm_fixtures.py's `started_cluster(nodes=2)`) is two slurmd on
this machine in Slurm's multiple-slurmd mode (nodes tether1 and tether2, one port, spool and log
each, NodeAddr 127.0.0.1), so the job's srun step really runs one task under each slurmd. The
single-node tests never start it. The far side is this machine: the test reads the run's far-side
files directly and asks SLURM itself what it did. Every wait polls a condition with a deadline.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.register_assert_rewrite("slurm_fixtures")

from helpers import Background  # noqa: E402
from slurm_fixtures import new_remote_dir, remove_remote_dir, slurm_yaml, started_cluster  # noqa: E402
from tether.remote import nodes  # noqa: E402

# A public-style DDP script: no tether import, its own out/ckpt.pt (written by rank 0) and --resume,
# print output. Every step all-reduces (rank + 1) * step over gloo (env:// rendezvous), so the sum
# after N steps is 3 * N (N + 1) / 2 only if both ranks took part in every step exactly once. A
# TERM or USR1 sets a flag that is all-reduced too, so both ranks stop at the same step; rank 0
# saves, and both exit 128 + the signal.
SCRIPT = """\
import argparse, json, os, signal, socket, sys, time
import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--every", type=int, default=5)
parser.add_argument("--sleep", type=float, default=0.2)
parser.add_argument("--resume", default="")
args = parser.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
node = os.environ.get("SLURMD_NODENAME", socket.gethostname())
print(f"rank {rank} of {world} on {node} via {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}", flush=True)
stop = []
for sig in (signal.SIGTERM, signal.SIGUSR1):
    signal.signal(sig, lambda signum, frame: stop.append(signum))

state = {"step": 0, "total": 0.0}
if args.resume:
    state = torch.load(args.resume)
    print(f"rank {rank} resumed at step {state['step']}", flush=True)

def save():
    if rank == 0:
        os.makedirs("out", exist_ok=True)
        torch.save(state, "out/ckpt.pt.tmp")
        os.replace("out/ckpt.pt.tmp", "out/ckpt.pt")
    dist.barrier()

while state["step"] < args.steps:
    flag = torch.tensor([float(stop[0]) if stop else 0.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item():
        save()
        print(f"rank {rank} checkpointed at step {state['step']} on signal {int(flag.item())}", flush=True)
        sys.exit(128 + int(flag.item()))
    state["step"] += 1
    value = torch.tensor([float((rank + 1) * state["step"])])
    dist.all_reduce(value)
    state["total"] += value.item()
    if rank == 0:
        print(f"step {state['step']} total {state['total']:g}", flush=True)
    if state["step"] % args.every == 0:
        save()
    time.sleep(args.sleep)
save()
if rank == 0:
    with open("out/result.json", "w") as f:
        json.dump({"steps": state["step"], "total": state["total"], "world": world}, f)
dist.destroy_process_group()
"""

MAPPED = """\
  checkpoint: out/ckpt.pt
  resume_args: ["--resume", "{checkpoint}"]
"""
STEPS = 30


@pytest.fixture(scope="module")
def two_nodes():
    with started_cluster(nodes=2) as found:
        yield found


@pytest.fixture
def remote(two_nodes):
    folder = new_remote_dir()
    yield folder
    remove_remote_dir(two_nodes, folder)


def far_json(run_dir: Path, name: str) -> dict:
    try:
        return json.loads((run_dir / name).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def log_lines(run_dir: Path, pattern: str) -> list[tuple[str, ...]]:
    """The groups of every train.log line that matches `pattern` (all attempts, in order)."""
    try:
        text = (run_dir / "train.log").read_text()
    except FileNotFoundError:
        return []
    return [m.groups() for m in re.finditer(pattern, text, flags=re.M)]


def last_step(run_dir: Path) -> int:
    steps = log_lines(run_dir, r"^step (\d+) ")
    return int(steps[-1][0]) if steps else 0


def launches(run_dir: Path) -> int:
    try:
        lines = (run_dir / "events.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return 0
    return sum('"event": "launch"' in line for line in lines)


def test_two_node_gloo_job_interrupted_twice_resumes_and_verifies(project, two_nodes, remote):
    (project.root / "script").mkdir()
    (project.root / "script" / "ddp.py").write_text(SCRIPT)
    text = slurm_yaml(two_nodes, remote, f"{{python}} script/ddp.py --steps {STEPS}", code="script/ddp.py",
                      artifacts="out/result.json", nodes=2)
    project.write_config(text.replace('  command: "', MAPPED + '  command: "', 1))
    doit = Background(project.start("run", "train"))
    try:
        project.wait_for(lambda: project.run_ids(), 60, "the run")
        run_dir = remote / "runs" / project.run_ids()[0]
        project.wait_for(lambda: far_json(run_dir, "slurm.json").get("job_id"), 60, "the job")
        job_id = far_json(run_dir, "slurm.json")["job_id"]

        # 1. the time-limit warning: what --signal=B:USR1@N sends, the batch shell alone gets it
        project.wait_for(lambda: last_step(run_dir) >= 6, 90, "attempt 1 at step 6")
        two_nodes.run("scancel", "--batch", "--signal=USR1", job_id)
        # 2. a requeue from outside (preemption's shape): SIGTERM to every process of the job
        project.wait_for(lambda: launches(run_dir) == 2 and last_step(run_dir) >= 14, 90, "attempt 2 at step 14")
        two_nodes.run("scontrol", "requeue", job_id)
        assert doit.finish(timeout=120) == 0, doit.output()
    finally:
        doit.kill()

    # every attempt ran rank 0 on tether1 and rank 1 on tether2, through the allocation's rendezvous
    ranks = log_lines(run_dir, r"^rank (\d) of 2 on (\S+) via (\S+):(\d+)$")
    assert sorted(r[:2] for r in ranks) == [("0", "tether1")] * 3 + [("1", "tether2")] * 3, ranks
    assert {r[2] for r in ranks} == {"127.0.0.1"}, ranks  # tether1's NodeAddr
    for port in {r[3] for r in ranks}:  # each attempt's own port, never 29500, the same for both ranks
        on_port = [r[0] for r in ranks if r[3] == port]
        assert port != "29500" and on_port.count("0") == on_port.count("1"), ranks
    # USR1, then TERM reached both ranks, which stopped at the same step; each attempt went on from there
    stopped = log_lines(run_dir, r"^rank (\d) checkpointed at step (\d+) on signal (\d+)$")
    assert sorted((r[0], r[2]) for r in stopped) == [("0", "10"), ("0", "15"), ("1", "10"), ("1", "15")], stopped
    at = {signum: {r[1] for r in stopped if r[2] == signum} for signum in ("10", "15")}
    assert all(len(steps) == 1 for steps in at.values()), stopped
    resumed = log_lines(run_dir, r"^rank (\d) resumed at step (\d+)$")
    assert sorted(resumed) == sorted((rank, step) for rank in "01" for (step,) in at.values()), resumed
    assert [int(s) for (s,) in log_lines(run_dir, r"^step (\d+) ")] == list(range(1, STEPS + 1))

    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines() if line]
    exits = [e for e in events if e.get("event") == "exit"]
    assert [(e["status"], e.get("signal")) for e in exits] == [
        ("preempted", "SIGUSR1"), ("preempted", "SIGTERM"), ("completed", None)], exits
    assert far_json(run_dir, "slurm.json")["jobs"] == [job_id]  # requeued twice, submitted once
    fields = dict(f.partition("=")[::2] for f in two_nodes.run("scontrol", "show", "job", "-o", job_id).split())
    assert (fields["JobState"], fields["NumNodes"], fields["Restarts"]) == ("COMPLETED", "2", "2"), fields
    result = json.loads((project.local_run() / "files" / "work" / "out" / "result.json").read_text())
    assert result == {"steps": STEPS, "total": 3 * STEPS * (STEPS + 1) / 2, "world": 2}, result
    assert (project.local_run() / "PULL_VERIFIED.json").is_file()


def test_the_step_wrapper_passes_ranks_and_keeps_srun_out_of_the_trainers_group(tmp_path):
    """No cluster: the argv the launcher starts, and the environment a task's trainer gets."""
    argv = nodes.step_command("srun --nodes=2 --ntasks-per-node=1", ["/py", "train.py", "--resume", "a b"])
    assert argv == [sys.executable, nodes.__file__, "step", "srun", "--nodes=2", "--ntasks-per-node=1", "--",
                    "/py", "train.py", "--resume", "a b"]
    env = nodes.task_env({"SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NTASKS": "4", "SLURM_NODEID": "1",
                          "RANK": "stale", "PATH": "/bin"})
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["NODE_RANK"], env["PATH"]) == ("3", "1", "4", "1",
                                                                                                   "/bin")
    # `task` execs the trainer itself: no process between srun and the trainer
    record = tmp_path / "env.txt"
    task = subprocess.Popen([sys.executable, nodes.__file__, "task", "/bin/sh", "-c", f'echo "$RANK $$" > {record}'],
                            env={"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "PATH": "/bin:/usr/bin"})
    assert task.wait(timeout=30) == 0
    assert record.read_text().split() == ["1", str(task.pid)]
