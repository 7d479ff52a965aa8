"""The agent backend end to end: `doit run train backend=desk` on a laptop, `tether agent` in another
process on the training machine, and a mailbox between them that each reaches (a folder, or a real
sshd as the relay). Real processes only: doit, the agent, the far-side launcher, the trainer.

The agent's folder (its workdir) is never read by the laptop's commands, and the laptop's project
never by the agent: the mailbox is all they share.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import config_text
from helpers import Background, sha256, stop_leftover_runs
from tether import signing
from test_resume import use_script


class Machines:
    """The laptop's key, the agent's key, the mailbox and the agents started on it (stopped after)."""

    def __init__(self, tmp: Path, url: str, folder: Path, relay: dict) -> None:
        self.tmp, self.url, self.folder, self.relay = tmp, url, folder, relay
        self.laptop, _ = signing.own_signer(str(tmp / "laptop" / "id_ed25519"))
        self.agents: list[Background] = []

    def backend(self, **extra) -> str:
        """The YAML flow text of the laptop's `desk` backend."""
        keys = dict(type="agent", mailbox=self.url, agent="desk", signing_key=self.laptop.path,
                    agent_key=str(self.tmp / "desk" / "key.pub"), queue_timeout_s=120, **self.relay)
        keys.update(extra)
        return json.dumps({k: v for k, v in keys.items() if v is not None})

    def start(self, name: str = "desk", trust: Path | None = None, *more: str) -> Background:
        """`tether agent` on the training machine: its own workdir, trusting the laptop's key."""
        home = self.tmp / name
        home.mkdir(exist_ok=True)
        argv = [sys.executable, "-m", "tether.cli", "agent", "--mailbox", self.url, "--name", name,
                "--workdir", str(home / "work"), "--key", str(home / "key"), "--poll-s", "0.2",
                "--trust", str(trust or Path(self.laptop.path + ".pub"))]
        for flag, key in (("--identity-file", "identity_file"), ("--known-hosts", "known_hosts")):
            if self.relay.get(key):
                argv += [flag, self.relay[key]]
        proc = subprocess.Popen(argv + list(more), cwd=home, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        agent = Background(proc)
        self.agents.append(agent)
        return agent

    def work(self, name: str = "desk") -> Path:
        return self.tmp / name / "work"

    def stop_all(self) -> None:
        for agent in self.agents:
            if agent.proc.poll() is None:
                agent.kill()
        for folder in self.tmp.glob("*/work"):
            stop_leftover_runs(folder)


@pytest.fixture(params=["folder", "relay"])
def machines(request, tmp_path):
    """A mailbox in a folder (file://) or on a real sshd (ssh://127.0.0.1:PORT/...)."""
    if request.param == "folder":
        made = Machines(tmp_path, f"file://{tmp_path}/mailbox", tmp_path / "mailbox", {})
    else:
        server = request.getfixturevalue("sshd")
        keys = server.backend_config(tmp_path / "relay")
        made = Machines(tmp_path, f"ssh://root@127.0.0.1:{server.port}{tmp_path}/relay", tmp_path / "relay",
                        {"identity_file": keys["identity_file"], "known_hosts": keys["known_hosts"],
                         "python": keys["python"]})
    yield made
    made.stop_all()


def desk(project, machines, **config) -> None:
    project.write_config(config_text(backend_name="desk", backend=machines.backend(), **config))


def mailbox_run(machines, run_id: str) -> Path:
    return machines.folder / "runs" / run_id


# ---------------------------------------------------------------- a whole run


def test_a_whole_train_goes_through_the_mailbox_to_an_agent_and_down_removes_both_copies(project, machines):
    desk(project, machines, epochs=8)
    agent = machines.start()
    done = project.doit("run", "train", timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr + agent.output()
    run_id = project.run_ids()[-1]
    assert "queued for agent desk" in done.stdout + done.stderr
    local = project.local_run(run_id)
    assert (local / "PULL_VERIFIED.json").is_file()
    assert json.loads((local / "files" / "artifacts" / "metrics.json").read_text())["accuracy"] > 0.5
    status = json.loads(project.doit("status", "json=1", check=True).stdout.strip().splitlines()[-1])
    assert status["status"] == "completed" and status["backend"] == "desk"
    assert (machines.work() / "runs" / run_id / "state.json").is_file()  # it ran there, on the agent
    assert not (project.root / ".tether" / "remote").exists()  # never here
    down = project.doit("run", "down", "confirm=yes", check=True)
    assert "agent" in down.stdout, down.stdout
    assert not mailbox_run(machines, run_id).exists()
    project.wait_for(lambda: not (machines.work() / "runs" / run_id).exists(), timeout=30,
                     what="the agent removing its copy")


# ---------------------------------------------------------------- a public-style script, interrupted


def script_on_desk(project, machines, steps: int = 80, sleep: float = 0.05) -> None:
    """The public-style script of test_resume (its own checkpoint file and --resume flag) on the agent."""
    use_script(project, text=config_text(command=f"{{python}} script/train.py --steps {steps} --sleep {sleep}",
                                         code="script/train.py", artifacts="weights.json", backend_name="desk",
                                         backend=machines.backend()))


def mailbox_step(machines, run_id: str) -> int:
    """The last `step N` the script printed, as the agent has mirrored it into the mailbox."""
    try:
        lines = (mailbox_run(machines, run_id) / "train.log").read_text().splitlines()
    except FileNotFoundError:
        return 0
    found = [int(line.split()[1]) for line in lines if line.startswith("step ")]
    return found[-1] if found else 0


def agent_state(machines, run_id: str, name: str = "desk") -> dict:
    try:
        return json.loads((machines.work(name) / "runs" / run_id / "state.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def requests(machines, run_id: str) -> list[Path]:
    return sorted((mailbox_run(machines, run_id) / "agent").glob("request-*.json"))


def pulled_log(project, run_id: str) -> str:
    return (project.local_run(run_id) / "files" / "train.log").read_text()


def test_the_laptop_killed_mid_watch_and_the_agent_killed_with_its_trainer_cost_nothing(project, machines):
    script_on_desk(project, machines)
    machines.start()
    train = Background(project.start("run", "train"))
    project.wait_for(lambda: project.run_ids() and mailbox_step(machines, project.run_ids()[-1]) >= 12,
                     timeout=90, what="step 12 mirrored into the mailbox")
    run_id = project.run_ids()[-1]
    train.kill()  # the laptop's watch, SIGKILLed
    state = agent_state(machines, run_id)
    machines.agents[0].kill()  # the agent, SIGKILLed ...
    os.kill(state["pid"], signal.SIGKILL)  # ... with its launcher and trainer, as a reboot would
    os.killpg(state["pgid"], signal.SIGKILL)
    machines.start()  # the training machine is back
    again = project.doit("run", "train", timeout=180)
    assert again.returncode == 0, again.stdout + again.stderr + machines.agents[-1].output()
    assert len(requests(machines, run_id)) == 1  # the rerun reattached: nothing was asked twice
    log = pulled_log(project, run_id)
    assert "resumed at step" in log and int(log.split("resumed at step")[1].split()[0]) >= 10, log
    weights = json.loads((project.local_run(run_id) / "files" / "artifacts" / "weights.json").read_text())
    assert weights["step"] == 80
    status = json.loads(project.doit("status", "json=1", check=True).stdout.strip().splitlines()[-1])
    assert (status["status"], status["attempt"]) == ("completed", 2), status


def test_doit_stop_reaches_the_agent_and_train_again_resumes_from_the_checkpoint(project, machines):
    script_on_desk(project, machines)
    machines.start()
    project.doit("run", "launch", check=True)
    run_id = project.run_ids()[-1]
    project.wait_for(lambda: mailbox_step(machines, run_id) >= 12, timeout=90, what="step 12 in the mailbox")
    stop = project.doit("stop", check=True)
    assert f"{run_id}: stopped" in stop.stdout, stop.stdout + stop.stderr
    assert agent_state(machines, run_id)["status"] == "stopped"
    again = project.doit("run", "train", timeout=180)
    assert again.returncode == 0, again.stdout + again.stderr + machines.agents[0].output()
    assert len(requests(machines, run_id)) == 2  # attempt 2 was asked for, once
    assert "resumed at step" in pulled_log(project, run_id)
    status = json.loads(project.doit("status", "json=1", check=True).stdout.strip().splitlines()[-1])
    assert (status["status"], status["attempt"]) == ("completed", 2), status


# ---------------------------------------------------------------- authority


def test_a_run_signed_by_a_key_the_agent_does_not_trust_is_refused_and_never_executed(project, machines, tmp_path):
    stranger, _ = signing.own_signer(str(tmp_path / "stranger" / "id_ed25519"))
    desk(project, machines, epochs=4)
    agent = machines.start("desk", Path(stranger.path + ".pub"))  # it trusts someone else
    done = project.doit("run", "train", timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    run_id = project.run_ids()[-1]
    assert "agent desk refused the run" in done.stderr and "not trusted" in done.stderr, done.stderr
    assert machines.laptop.fingerprint in agent.text()  # the agent's log names who signed it
    assert not (machines.work() / "runs" / run_id).exists()  # nothing of it was built, let alone run
    agent.kill()
    machines.start()  # now trusting the laptop's key: the README's fix
    again = project.doit("run", "train", "retry=1", timeout=120)
    assert again.returncode == 0, again.stdout + again.stderr + machines.agents[-1].output()
    assert (project.local_run(run_id) / "PULL_VERIFIED.json").is_file()


def test_results_changed_in_the_mailbox_are_caught_by_the_hash_and_a_new_manifest_by_the_signature(
        project, machines):
    desk(project, machines, epochs=4)
    machines.start()
    project.doit("run", "watch", check=True, timeout=120)
    run_id = project.run_ids()[-1]
    model = mailbox_run(machines, run_id) / "artifacts" / "model.json"
    model.write_text(model.read_text().replace("{", '{"backdoor": 1, ', 1))
    changed = project.doit("run", "train", timeout=60)
    assert changed.returncode == 1 and "artifacts/model.json" in changed.stderr, changed.stdout + changed.stderr
    assert not (project.local_run(run_id) / "PULL_VERIFIED.json").exists()
    manifest = mailbox_run(machines, run_id) / "PULL_MANIFEST.json"  # a forger rewrites the manifest to match
    record = json.loads(manifest.read_text())
    for entry in record["files"]:
        if entry["path"] == "artifacts/model.json":
            entry["sha256"], entry["bytes"] = sha256(model), model.stat().st_size
    manifest.write_text(json.dumps(record))
    forged = project.doit("run", "train", timeout=60)
    assert forged.returncode == 1 and "not the one the agent signed" in forged.stderr, forged.stdout + forged.stderr
    assert not (project.local_run(run_id) / "PULL_VERIFIED.json").exists()


# ---------------------------------------------------------------- two agents


@pytest.mark.parametrize("machines", ["folder"], indirect=True)  # the relay is the same code path
def test_a_sweep_for_any_agent_is_shared_by_two_agents_one_run_each(project, machines):
    project.write_config(config_text(command="{python} demo/train.py --epochs 6 --seed {seed}", backend_name="desk",
                                     backend=machines.backend(agent="", agent_key=None)) + "sweep:\n  seed: [0, 1]\n")
    machines.start("a")
    machines.start("b")
    done = project.doit("run", "train", timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr + "".join(a.output() for a in machines.agents)
    ids = project.run_ids()
    assert len(ids) == 2 and all((project.local_run(r) / "PULL_VERIFIED.json").is_file() for r in ids)
    takers = {json.loads(p.read_text())["agent"] for r in ids for p in (mailbox_run(machines, r) / "agent").glob(
        "claim-*.json")}
    assert takers == {"a", "b"}


# ---------------------------------------------------------------- the job's environment, built by the agent


@pytest.mark.parametrize("machines", ["folder"], indirect=True)
def test_the_jobs_venv_is_built_on_the_agents_machine_and_the_run_uses_it(project, machines, tmp_path, monkeypatch):
    from test_environment import SCRIPT as USES_TINYPKG, tiny_wheel

    tiny_wheel(tmp_path / "wheels")
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # the agent's installer sees only the local wheel
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "wheels"))
    (project.root / "demo" / "use.py").write_text(USES_TINYPKG)
    (project.root / "requirements.txt").write_text("tinypkg==1.0\n")
    project.write_config(config_text(command="{python} demo/use.py", code="demo/use.py", artifacts="env.json",
                                     backend_name="desk", backend=machines.backend())
                         + "environment:\n  requirements: requirements.txt\n  setup: ['export GREETING=hello']\n")
    machines.start()
    done = project.doit("run", "train", timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr + machines.agents[0].output()
    seen = json.loads((project.local_run() / "files" / "artifacts" / "env.json").read_text())
    assert Path(seen["prefix"]).parent == machines.work() / "venv" and seen["tinypkg"] == "1.0", seen
    assert seen["greeting"] == "hello", seen  # the setup line ran in the trainer's shell, on the agent
    assert not (machines.folder / "venv").exists()  # nothing was built in the mailbox
