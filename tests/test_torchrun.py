"""Several processes on one host (`trainer.processes`): the trainer under torchrun, with real PyTorch.

The script is written the way public DDP scripts are (no tether import): torchrun's environment,
the gloo backend on the CPU, synthetic data, its own `out/ckpt.pt` written by rank 0 only, a
`--resume` flag, `step N/M loss X` lines, and SIGTERM/SIGUSR1 handled by checkpointing and exiting
75. It runs with 2 processes on the local backend and over ssh (a real sshd on loopback), through
`doit stop` (every rank checkpoints, the run is stopped) and `doit run train` (the next attempt
resumes from rank 0's checkpoint, completes, and is pulled and verified). Each attempt starts three
Pythons that import torch, so there are only these two; the pure parts (argv, counts, how an attempt
ended, the config) and a rank's own behaviour (its output, its record, its end when torchrun is
gone) are fast tests of their own.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path


from conftest import config_text, ssh_config_text
from helpers import alive, poll, stop_leftover_runs
from tether.remote import rank, ranks, runtime
from tether.trainers.command import Config

SCRIPT = """\
import argparse, os, signal, sys, time
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--every", type=int, default=3)
parser.add_argument("--sleep", type=float, default=0.05)
parser.add_argument("--resume", default="")
args = parser.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
signal.signal(signal.SIGUSR1, lambda *_: stop.append(1))

torch.manual_seed(0)
model = DistributedDataParallel(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
start = 0
if args.resume:
    state = torch.load(args.resume, weights_only=True)
    model.module.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    start = state["step"]
    if rank == 0:
        print(f"resumed at step {start}", flush=True)
print(f"rank {rank} of {world} starts at step {start}", flush=True)


def save(step):
    if rank == 0:  # the state is the same on every rank: one copy
        os.makedirs("out", exist_ok=True)
        torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step}, "out/ckpt.pt.tmp")
        os.replace("out/ckpt.pt.tmp", "out/ckpt.pt")


for step in range(start + 1, args.steps + 1):
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(1000 * step + rank))
    loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    if rank == 0:
        print(f"step {step}/{args.steps} loss {loss.item():.4f}", flush=True)
    flag = torch.tensor([float(bool(stop))])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # every rank stops at the same step
    if step % args.every == 0 or flag.item():
        save(step)
    if flag.item():
        print(f"rank {rank}: checkpointed at step {step}, exiting", flush=True)
        dist.destroy_process_group()
        sys.exit(75)
    time.sleep(args.sleep)

save(args.steps)
if rank == 0:
    with open("out/final.json", "w") as f:
        f.write('{"world_size": %d, "steps": %d}' % (world, args.steps))
dist.destroy_process_group()
"""

TRAINER = """\
  processes: 2
  checkpoint: out/ckpt.pt
  resume_args: ["--resume", "{checkpoint}"]
  progress: 'step (?P<step>\\d+)/(?P<total>\\d+) loss (?P<loss>\\S+)'
  total_steps: total
"""
STEPS, STEP_S = 60, 0.15  # 9 s of steps at least: a stop asked for after 2 steps lands mid-training even on
# a loaded machine (with 30 steps of 0.05 s, an ssh stop came after the last step, while the script exited)
GRACE = 20  # each rank's checkpoint and exit, with room for a loaded machine (torchrun SIGKILLs after it)


def use_ddp(project, text: str) -> None:
    """SCRIPT as the job's trainer with 2 processes, its own checkpoint file mapped for resumes."""
    (project.root / "ddp").mkdir(exist_ok=True)
    (project.root / "ddp" / "train.py").write_text(SCRIPT)
    command = "{python} demo/train.py --epochs 30"
    assert command in text, text
    text = text.replace(command, f"{{python}} ddp/train.py --steps {STEPS} --sleep {STEP_S}").replace(
        "paths: [demo/train.py]", "paths: [ddp/train.py]").replace(
        "artifacts: [model.json, metrics.json]", "artifacts: [out/final.json]")
    text = text.replace('  command: "', TRAINER + '  command: "', 1)
    project.write_config(text)


# ---------------------------------------------------------------- what the far side reads


def far(run_dir: Path, name: str) -> dict:
    return json.loads((run_dir / name).read_text())


def events(run_dir: Path, kind: str) -> list[dict]:
    lines = (run_dir / "events.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e.get("event") == kind]


def printed(run_dir: Path) -> list[int]:
    """The steps rank 0 printed, in order (train.log holds rank 0's output only)."""
    try:
        lines = (run_dir / "train.log").read_text().splitlines()
    except FileNotFoundError:
        return []
    return [int(line.split()[1].split("/")[0]) for line in lines if line.startswith("step ")]


def steps_of_attempt(run_dir: Path, attempt: int) -> int:
    """How many steps rank 0 printed in attempt `attempt` (its lines follow its "rank 0 of" line)."""
    try:
        parts = (run_dir / "train.log").read_text().split("rank 0 of 2 starts at step")
    except FileNotFoundError:
        return 0
    return sum(line.startswith("step ") for line in parts[attempt].splitlines()) if len(parts) > attempt else 0


def wait_running_past(project, run_dir: Path, steps: int, attempt: int) -> None:
    project.wait_for(lambda: (run_dir / "state.json").exists() and far(run_dir, "state.json")["status"] == "running"
                     and steps_of_attempt(run_dir, attempt) >= steps, timeout=90,
                     what=f"{steps} steps of attempt {attempt}")


def assert_attempt_ended(run_dir: Path, attempt: int, status: str) -> int:
    """Attempt `attempt` ended as `status` with both ranks checkpointing on the signal (exit 75);
    the step of rank 0's checkpoint that the launcher kept."""
    ended = [e for e in events(run_dir, "exit") if e["attempt"] == attempt]
    assert [(e["status"], e["exit_code"]) for e in ended] == [(status, 75)], ended
    assert events(run_dir, "ranks")[attempt - 1]["exits"] == {"0": 75, "1": 75}, events(run_dir, "ranks")
    import torch

    return torch.load(run_dir / "checkpoints" / "ckpt.pt", weights_only=True)["step"]


def assert_ran_as(run_dir: Path, resumed: list[int]) -> None:
    """Every attempt had 2 ranks on its own free port; attempt k+1 resumed at resumed[k], then trained on."""
    started = events(run_dir, "torchrun")
    assert [e["world_size"] for e in started] == [2] * (len(resumed) + 1), started
    assert all(1024 <= e["master_port"] <= 65535 for e in started), started
    log = (run_dir / "train.log").read_text()
    assert [int(line.split()[-1]) for line in log.splitlines() if line.startswith("resumed at step")] == resumed
    after = log.split(f"resumed at step {resumed[-1]}\n", 1)[1]
    assert printed(run_dir)[-(STEPS - resumed[-1]):] == list(range(resumed[-1] + 1, STEPS + 1)), after
    assert "rank 1 of" not in log  # rank 1's output is kept apart, not mixed into the progress stream
    read = [e["step"] for e in events(run_dir, "step")]  # `progress:` read rank 0's lines (rate-limited)
    assert read == sorted(set(read)) and read[-1] == STEPS, read
    own = (run_dir / "ranks" / "rank-1.log").read_text()
    assert [f"rank 1 of 2 starts at step {s}" in own for s in [0] + resumed] == [True] * (len(resumed) + 1), own


def stop_then_train(project, run_dir: Path, attempt: int) -> int:
    """`doit stop` mid-attempt: stopped, both ranks checkpointed; the step of the kept checkpoint."""
    wait_running_past(project, run_dir, 2, attempt)
    stopped = project.doit("stop", timeout=60)
    assert stopped.returncode == 0 and ": stopped" in stopped.stdout, stopped.stdout + stopped.stderr
    assert far(run_dir, "state.json")["status"] == "stopped"
    step = assert_attempt_ended(run_dir, attempt, "stopped")
    assert 1 <= step < STEPS, step
    again = project.doit("run", "train", timeout=180)
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"attempt {attempt + 1}" in again.stderr, again.stderr
    return step


def assert_completed_and_verified(project, run_dir: Path) -> None:
    state = far(run_dir, "state.json")
    assert (state["status"], state["exit_code"]) == ("completed", 0), state
    final = project.local_run() / "files" / "work" / "out" / "final.json"  # where the script wrote it
    assert json.loads(final.read_text()) == {"world_size": 2, "steps": STEPS}
    assert (project.local_run() / "PULL_VERIFIED.json").is_file()


def test_torchrun_locally_stop_then_train_resumes_from_rank_0s_checkpoint(project):
    use_ddp(project, config_text(grace=GRACE))
    project.doit("run", "launch", check=True, timeout=120)
    run_dir = project.remote_run()
    stopped = stop_then_train(project, run_dir, 1)
    assert_ran_as(run_dir, [stopped])
    assert_completed_and_verified(project, run_dir)


def test_torchrun_over_ssh_stop_then_train_resumes(project, sshd, tmp_path):
    remote = tmp_path / "far"
    use_ddp(project, ssh_config_text(sshd, remote).replace("grace_seconds: 5", f"grace_seconds: {GRACE}"))
    try:
        project.doit("run", "launch", check=True, timeout=120)
        run_dir = remote / "runs" / project.run_ids()[0]
        stopped = stop_then_train(project, run_dir, 1)
    finally:
        stop_leftover_runs(remote)
    assert_ran_as(run_dir, [stopped])
    assert_completed_and_verified(project, run_dir)


# ---------------------------------------------------------------- the pure parts


def test_processes_config_is_checked_and_changes_nothing_at_its_default():
    plain = Config(command="{python} train.py --lr 0.1")
    assert "processes" not in plain.launch_spec() and plain.requires() == ()  # run ids of old jobs stay
    two = Config(command="{python} train.py", processes=2)
    assert two.launch_spec()["processes"] == 2 and two.requires() == ("torch",) and two.problems() == []
    assert Config(command="python3 -m pkg.train --x 1", processes="auto").problems() == []
    assert Config(command="/usr/bin/python3.11 train.py", processes=4).problems() == []
    for bad, words in [(0, "1 or more"), ("many", "or auto"), (-2, "1 or more")]:
        [problem] = Config(command="{python} train.py", processes=bad).problems()
        assert problem.startswith("trainer.processes must be") and words in problem, problem
    for command in ["bash run.sh", "{python} -u train.py", "{python}", "{python} -m", "torchrun train.py"]:
        [problem] = Config(command=command, processes=2).problems()
        assert 'write the command as "{python} SCRIPT ..."' in problem and command in problem, problem


def test_the_torchrun_command_has_a_free_port_and_a_count_from_the_gpus():
    spec = {"processes": 2, "grace_seconds": 7}
    argv = ranks.command(["/py", "train.py", "--lr", "1"], spec, {})
    assert argv[:3] == ["env", "PET_SIGNALS_TO_HANDLE=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
                        "TORCH_ELASTIC_SHUTDOWN_TIMEOUT=7"]
    assert argv[3:8] == ["/py", "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2"]
    assert argv[-9:] == ["-m", "tether.remote.rank", "--grace", "7", "--", "/py", "train.py", "--lr", "1"]
    assert "--master_addr=127.0.0.1" in argv and "--max_restarts=0" in argv
    port = int(next(a for a in argv if a.startswith("--master_port=")).split("=")[1])
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))  # free when chosen
    assert ranks.command(["/py", "t.py"], {"processes": 1}, {}) == ["/py", "t.py"]
    assert ranks.command(["/py", "t.py"], {}, {}) == ["/py", "t.py"]
    for visible, n in [("0,1,2", 3), ("", 1), ("-1", 1), ("GPU-aa,GPU-bb", 2), ("3,-1,2", 1), ("4", 1)]:
        assert ranks.count("auto", {"CUDA_VISIBLE_DEVICES": visible}) == n, visible
    assert ranks.count("auto", {}) == 1 and ranks.count(3, {"CUDA_VISIBLE_DEVICES": "0"}) == 3


def test_an_attempt_ends_as_its_first_failing_rank_says():
    done = {"exit": 0, "ended": 5.0, "world_size": 2}
    assert ranks.attempt_code(0, [dict(done, rank=0), dict(done, rank=1)]) == 0
    assert ranks.attempt_code(1, [dict(done, rank=0), dict(done, rank=1)]) == 0  # torchrun signalled after the end
    assert ranks.attempt_code(1, [dict(done, rank=0)]) == 1  # rank 1 never started: torchrun's word stands
    crash_then_asked = [{"rank": 0, "exit": 75, "ended": 3.0}, {"rank": 1, "exit": 1, "ended": 2.0}]
    assert ranks.attempt_code(1, crash_then_asked) == 1  # rank 1 crashed first; rank 0 only obeyed torchrun
    assert ranks.attempt_code(1, [{"rank": 0, "exit": 75, "ended": 1.0}, {"rank": 1, "exit": -15, "ended": 1.1}]) == 75
    assert ranks.attempt_code(1, [dict(done, rank=0), {"rank": 1, "exit": None}]) == -signal.SIGKILL
    assert ranks.attempt_code(1, []) == 1  # torchrun failed before any rank started (no torch, a bad flag)
    assert ranks.attempt_code(-9, []) == -9


def test_runtime_helpers_write_only_on_rank_0(tmp_path, monkeypatch):
    monkeypatch.setenv("TETHER_EVENTS", str(tmp_path / "events.jsonl"))
    monkeypatch.setenv("TETHER_CHECKPOINT_DIR", str(tmp_path / "ckpt"))
    (tmp_path / "ckpt").mkdir()
    monkeypatch.setenv("RANK", "1")
    path = runtime.save_checkpoint(lambda f: f.write(b"x"), step=3)
    runtime.log(loss=1.0)
    assert os.path.basename(path) == "ckpt-000000000003.ckpt" and not os.listdir(tmp_path / "ckpt")
    assert not (tmp_path / "events.jsonl").exists()
    monkeypatch.setenv("RANK", "0")
    assert os.path.isfile(runtime.save_checkpoint(lambda f: f.write(b"x"), step=3))
    assert [json.loads(line)["event"] for line in (tmp_path / "events.jsonl").read_text().splitlines()] == \
        ["checkpoint"]


def shim(tmp_path: Path, rank_id: int, code: str, **kwargs) -> subprocess.CompletedProcess:
    env = dict(os.environ, RANK=str(rank_id), TETHER_RUN_DIR=str(tmp_path), WORLD_SIZE="2", MASTER_PORT="1234")
    return subprocess.run([sys.executable, "-m", "tether.remote.rank", "--grace", "5", "--", sys.executable, "-c",
                           code], env=env, capture_output=True, text=True, timeout=30, **kwargs)


def test_a_rank_keeps_its_output_apart_and_records_how_it_ended(tmp_path):
    failed = shim(tmp_path, 1, "import sys; print('rank one works'); sys.exit('rank one broke')")
    assert failed.returncode == 1 and failed.stdout == failed.stderr == "", failed  # not in train.log
    own = (tmp_path / "ranks" / "rank-1.log").read_text()
    assert "rank one works" in own and "rank one broke" in own
    record = json.loads((tmp_path / "ranks" / "rank-1.json").read_text())
    assert (record["exit"], record["rank"], record["torchrun_pid"], record["world_size"]) == (1, 1, os.getpid(), 2)
    (tmp_path / "train.log").write_bytes(b"torchrun's own report\n")
    assert ranks.settle(str(tmp_path), {"processes": 2}, os.getpid(), 1) == 1  # (rank 0's record: none yet)
    log = (tmp_path / "train.log").read_text()  # the failure message shows train.log's last lines: these
    assert log.endswith("tether: rank 1 failed first (exit code 1); the end of its output (ranks/rank-1.log):\n"
                        "  --- rank 1, torchrun pid %d, %s\n  rank one works\n  rank one broke\n"
                        % (os.getpid(), own.split(", ")[2].split("\n")[0])), log
    assert events(tmp_path, "ranks")[-1]["exits"] == {"1": 1}
    killed = shim(tmp_path, 0, "import os, signal; print('rank zero'); os.kill(os.getpid(), signal.SIGKILL)")
    assert killed.returncode == -signal.SIGKILL and killed.stdout == "rank zero\n", killed  # as the script died
    assert json.loads((tmp_path / "ranks" / "rank-0.json").read_text())["exit"] == -signal.SIGKILL
    assert [e["world_size"] for e in events(tmp_path, "torchrun")] == [2]  # rank 0 names the rendezvous


def test_a_rank_whose_torchrun_is_gone_asks_its_script_to_checkpoint_and_exit(tmp_path):
    script = ("import signal, sys, time; signal.signal(signal.SIGTERM, lambda *_: sys.exit(75)); "
              "print('ready', flush=True); time.sleep(60)")
    env = dict(os.environ, RANK="0", TETHER_RUN_DIR=str(tmp_path))
    # Its parent, a shell, exits once the script runs: as a torchrun killed outright would.
    orphan = subprocess.run(
        ["sh", "-c", '"$0" -m tether.remote.rank --grace 5 -- "$0" -c "$1" > "$2" 2>&1 & '
         'until grep -q ready "$2"; do sleep 0.05; done; echo $!', sys.executable, script, str(tmp_path / "out")],
        env=env, capture_output=True, text=True, timeout=20)
    pid, record = int(orphan.stdout), tmp_path / "ranks" / "rank-0.json"
    poll(lambda: "exit" in json.loads(record.read_text()), 10, "the orphaned rank's end")
    ended = json.loads(record.read_text())
    assert (ended["exit"], ended["signal_seen"]) == (75, "SIGTERM"), ended
    poll(lambda: not alive(pid), 10, "the rank process to exit")
    assert ended["ended"] - ended["started"] < 5 * rank.PARENT_POLL_S + 5  # noticed within a few polls
