"""A real SLURM (munged, slurmctld, one slurmd per node) for the tests, with sshd as its login node.

One node by default. `nodes=2` runs two slurmd on this machine (Slurm's multiple-slurmd mode: the
Debian build has it): nodes tether1, tether2, each its own `-N` name, port, spool, log and pid file,
all with NodeAddr 127.0.0.1, so a 2-node job's steps really run under two slurmd.
`cred_expire` (how long a requeued job waits) and `kill_wait` (KillWait) are settable per cluster.

The daemons run in the foreground as children of the test process and are stopped by pid;
jobs are cancelled first (killing slurmd does not kill running jobs).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from sshd import SSHServer, free_port


def _wait(check, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.1)
    raise RuntimeError(f"{what} not ready within {seconds}s")


class SlurmCluster:
    """munged + slurmctld + slurmd on this machine; `login` is an sshd whose sessions see SLURM_CONF."""

    def __init__(self, base: Path, nodes: int = 1, cred_expire: int = 5, kill_wait: int = 5) -> None:
        self.base, self.cred_expire, self.kill_wait = base, cred_expire, kill_wait
        self.node = socket.gethostname().split(".")[0]
        self.nodes = [self.node] if nodes == 1 else [f"tether{i}" for i in range(1, nodes + 1)]
        spools = ["spool"] if nodes == 1 else [f"spool-{name}" for name in self.nodes]
        for sub in ("munge", "state", *spools):
            (base / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(base, 0o755)
        os.chmod(base / "munge", 0o755)  # munged wants every parent of its socket world-executable
        self.conf = base / "slurm.conf"
        self.socket = base / "munge" / "munge.socket.2"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        self.processes: list[subprocess.Popen] = []
        self.login = SSHServer(base / "ssh", env={"SLURM_CONF": str(self.conf)})

    def _config(self) -> str:
        cpus = os.cpu_count() or 1
        mem_mb = int(int(open("/proc/meminfo").read().split()[1]) / 1024 * 0.9)
        many = "-%n" if len(self.nodes) > 1 else ""  # each slurmd its own files, by node name
        return f"""ClusterName=tethertest
SlurmctldHost={self.node}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.socket},cred_expire={self.cred_expire}
StateSaveLocation={self.base}/state
SlurmdSpoolDir={self.base}/spool{many}
SlurmctldPidFile={self.base}/slurmctld.pid
SlurmdPidFile={self.base}/slurmd{many}.pid
SlurmctldLogFile={self.base}/slurmctld.log
SlurmdLogFile={self.base}/slurmd{many}.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
KillWait={self.kill_wait}
MinJobAge=600
InactiveLimit=0
Waittime=0
{self._node_lines(cpus, mem_mb)}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""

    def _node_lines(self, cpus: int, mem_mb: int) -> str:
        if len(self.nodes) == 1:
            return f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={mem_mb} State=UNKNOWN"
        return "\n".join(f"NodeName={name} NodeHostname={self.node} NodeAddr=127.0.0.1 Port={free_port()} "
                         f"CPUs={cpus} RealMemory={mem_mb // len(self.nodes)} State=UNKNOWN" for name in self.nodes)

    def _daemon(self, argv: list[str]) -> None:
        with open(self.base / f"{argv[0]}.stderr", "ab") as err:
            self.processes.append(subprocess.Popen(argv, env=self.env, start_new_session=True,
                                                   stdout=subprocess.DEVNULL, stderr=err))

    def run(self, *argv: str) -> str:
        return subprocess.run(argv, env=self.env, capture_output=True, text=True, check=True).stdout

    def start(self) -> "SlurmCluster":
        self.conf.write_text(self._config())
        key = self.base / "munge" / "munge.key"
        if not key.exists():
            subprocess.run(["mungekey", "--create", f"--keyfile={key}"], check=True)
        os.chmod(key, 0o600)
        self._daemon(["munged", "-F", "--force", f"--key-file={key}", f"--socket={self.socket}",
                      f"--pid-file={self.base}/munge/munged.pid", f"--log-file={self.base}/munge/munged.log",
                      f"--seed-file={self.base}/munge/munged.seed"])
        _wait(self.socket.exists, 10, "munged")
        self._daemon(["slurmctld", "-D", "-i", "-f", str(self.conf)])
        _wait(lambda: subprocess.run(["scontrol", "ping"], env=self.env, capture_output=True).returncode == 0,
              30, "slurmctld")
        for name in self.nodes:
            self._daemon(["slurmd", "-D", "-f", str(self.conf), "-N", name])
        _wait(self._nodes_up, 30, "slurmd")
        self.login.start()
        return self

    def _nodes_up(self) -> bool:
        states = self.run("sinfo", "-h", "-N", "-o", "%N %T").split()[1::2]
        return len(states) == len(self.nodes) and all(s in ("idle", "mixed", "allocated") for s in states)

    def stop(self) -> None:
        jobs = subprocess.run(["squeue", "-h", "-o", "%A"], env=self.env, capture_output=True, text=True).stdout.split()
        if jobs:
            subprocess.run(["scancel", *jobs], env=self.env, capture_output=True)
            _wait(lambda: not subprocess.run(["squeue", "-h", "-o", "%A"], env=self.env, capture_output=True,
                                             text=True).stdout.split(), 20 + self.kill_wait, "job cancellation")
        self.login.stop()
        for process in reversed(self.processes):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
                try:
                    process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait(timeout=10)
        self.processes.clear()
