"""A real 2-node SLURM job: `nodes: 2` runs a gloo script on both nodes, requeued mid-run, resumed, verified.

The module's own cluster (tests/slurm_fixtures.py's `started_cluster(nodes=2)`) is two slurmd on
this machine in Slurm's multiple-slurmd mode (nodes tether1 and tether2, one port, spool and log
each, NodeAddr 127.0.0.1), so the job's srun step really runs one task under each slurmd. The
single-node tests never start it. The far side is this machine: the test reads the run's far-side
files directly and asks SLURM itself what it did. Every wait polls a condition with a deadline.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.register_assert_rewrite("slurm_fixtures")

from helpers import Background, poll  # noqa: E402
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
parser.add_argument("--sleep", type=float, default=0.15)
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
    """Two slurmd. A requeued job waits out cred_expire (5: Slurm's least); KillWait (the time between
    a requeue's SIGTERM and its SIGKILL) is Slurm's default 30 s, not 5, for two torch ranks, srun and
    the launcher to save and record on two busy cores (a job whose processes end sooner ends sooner)."""
    with started_cluster(nodes=2, cred_expire=5, kill_wait=30) as found:
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


def test_two_node_gloo_job_requeued_mid_run_resumes_and_verifies(project, two_nodes, remote):
    """`doit run train` with `nodes: 2` over the login node; `scontrol requeue` mid-run; it completes."""
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

        # a requeue from outside (preemption's shape): SIGTERM to every process of the job, srun too
        project.wait_for(lambda: last_step(run_dir) >= 8, 90, "attempt 1 at step 8")
        two_nodes.run("scontrol", "requeue", job_id)
        assert doit.finish(timeout=120) == 0, doit.output()
    finally:
        doit.kill()

    # every attempt ran rank 0 on tether1 and rank 1 on tether2, through the allocation's rendezvous
    ranks = log_lines(run_dir, r"^rank (\d) of 2 on (\S+) via (\S+):(\d+)$")
    assert sorted(r[:2] for r in ranks) == [("0", "tether1")] * 2 + [("1", "tether2")] * 2, ranks
    assert {r[2] for r in ranks} == {"127.0.0.1"}, ranks  # tether1's NodeAddr: "tether1" resolves nowhere
    for port in {r[3] for r in ranks}:  # each attempt's own port, never 29500, the same for both ranks
        on_port = [r[0] for r in ranks if r[3] == port]
        assert port != "29500" and on_port.count("0") == on_port.count("1"), ranks
    # TERM reached both ranks (srun's own SIGKILL did not cut them short), which stopped at the same
    # step and saved; the next attempt went on from exactly there
    stopped = log_lines(run_dir, r"^rank (\d) checkpointed at step (\d+) on signal (\d+)$")
    assert sorted((r[0], r[2]) for r in stopped) == [("0", "15"), ("1", "15")], stopped
    step = stopped[0][1]
    assert stopped[1][1] == step and int(step) < STEPS, stopped
    assert sorted(log_lines(run_dir, r"^rank (\d) resumed at step (\d+)$")) == [("0", step), ("1", step)]
    assert [int(s) for (s,) in log_lines(run_dir, r"^step (\d+) ")] == list(range(1, STEPS + 1))

    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines() if line]
    exits = [e for e in events if e.get("event") == "exit"]
    job_out = "".join(p.read_text(errors="replace")[-2000:] for p in sorted(run_dir.glob("slurm-*.out")))
    assert [(e["status"], e.get("signal")) for e in exits] == [("preempted", "SIGTERM"), ("completed", None)], \
        (exits, job_out)  # a `lost` first exit: its launcher was SIGKILLed before it could record the end
    assert far_json(run_dir, "slurm.json")["jobs"] == [job_id]  # requeued, submitted once
    fields = dict(f.partition("=")[::2] for f in two_nodes.run("scontrol", "show", "job", "-o", job_id).split())
    assert (fields["JobState"], fields["NumNodes"], fields["Restarts"]) == ("COMPLETED", "2", "1"), fields
    result = json.loads((project.local_run() / "files" / "work" / "out" / "result.json").read_text())
    assert result == {"steps": STEPS, "total": 3 * STEPS * (STEPS + 1) / 2, "world": 2}, result
    assert (project.local_run() / "PULL_VERIFIED.json").is_file()


def test_the_step_command_and_each_tasks_ranks(tmp_path):
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


# A stdlib task that logs the signals it gets; on TERM it "checkpoints" for a while, then exits 75.
TASK = """\
import os, signal, sys, time
log = open(os.path.join(sys.argv[1], "task-%s.log" % os.environ["RANK"]), "a", buffering=1)
signal.signal(signal.SIGUSR1, lambda signum, frame: log.write("USR1\\n"))
signal.signal(signal.SIGTERM, lambda signum, frame: log.write("TERM\\n"))
log.write("start %s on %s\\n" % (os.environ["RANK"], os.environ["SLURMD_NODENAME"]))
while "TERM" not in open(log.name).read():
    time.sleep(0.05)
time.sleep(0.5)  # a checkpoint that srun's own SIGKILL would cut short
log.write("saved\\n")
sys.exit(75)
"""


def test_the_step_wrapper_passes_usr1_and_term_to_the_tasks_on_both_nodes(two_nodes, tmp_path):
    """nodes.py's `step` in a real 2-node job: USR1 and TERM sent to it (as the launcher sends them)
    reach both tasks, and TERM as TERM: srun's "forcing job termination" would SIGKILL them."""
    (tmp_path / "task.py").write_text(TASK)
    (tmp_path / "job.sh").write_text(f"""#!/bin/bash
#SBATCH --nodes=2
#SBATCH --output={tmp_path}/slurm.out
{sys.executable} {nodes.__file__} step srun --nodes=2 --ntasks-per-node=1 -- {sys.executable} {tmp_path}/task.py {tmp_path} &
echo $! > {tmp_path}/step.pid
wait $!
echo $? > {tmp_path}/step.exit
""")
    two_nodes.run("sbatch", "--parsable", str(tmp_path / "job.sh"))
    logs = [tmp_path / "task-0.log", tmp_path / "task-1.log"]

    def all_logged(word: str) -> bool:
        return all(log.is_file() and word in log.read_text() for log in logs)

    step = tmp_path / "step.pid"
    poll(lambda: all_logged("start") and step.is_file() and step.read_text().strip(), 60, "both tasks", 0.05)
    os.kill(int(step.read_text()), signal.SIGUSR1)
    poll(lambda: all_logged("USR1"), 30, "USR1 in both tasks", 0.05)
    os.kill(int(step.read_text()), signal.SIGTERM)
    exit_file = tmp_path / "step.exit"
    poll(lambda: exit_file.is_file() and exit_file.read_text().strip(), 30, "the step's end", 0.05)
    out = (tmp_path / "slurm.out").read_text()
    assert exit_file.read_text().strip() == "75", out  # the tasks' own exit code
    assert [log.read_text() for log in logs] == ["start 0 on tether1\nUSR1\nTERM\nsaved\n",
                                                 "start 1 on tether2\nUSR1\nTERM\nsaved\n"], out
    assert "forcing job termination" not in out, out
