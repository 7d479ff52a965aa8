"""`tether agent`: real agent processes on a mailbox folder (and one over a real sshd relay), filled the way the
laptop fills it: `doit run push` of the demo project into it, then run.json and a signed request beside it."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import config_text
from helpers import poll, stop_leftover_runs
from tether import mailbox, signing

POLL = "0.2"


class Mailbox:
    """A file:// mailbox in tmp, a trusted laptop key, an untrusted one, and the agents started on it."""

    def __init__(self, tmp_path: Path) -> None:
        self.root, self.tmp = tmp_path / "mailbox", tmp_path
        self.laptop = signing.own_signer(str(tmp_path / "keys" / "laptop"))[0]
        self.stranger = signing.own_signer(str(tmp_path / "keys" / "stranger"))[0]
        self.agents: list[subprocess.Popen] = []
        self.workdirs: list[Path] = []

    # ------------------------------------------------------------ the laptop's side, by hand

    def push(self, project, epochs: int = 30) -> str:
        """`doit run push` of the project into the mailbox folder; the run's id."""
        project.write_config(config_text(epochs=epochs, backend=json.dumps({"type": "local",
                                                                           "remote_dir": str(self.root)})))
        project.doit("run", "push", check=True)
        return project.run_ids()[-1]

    def request(self, project, run_id: str, signer=None, unsigned: bool = False, run_json: bytes = b"",
                timeout_s: float = 600.0) -> str:
        """run.json beside the pushed run, and a request for it (signed by the laptop unless told; for the
        given run.json's hash if any); its nonce."""
        pushed = (project.local_run(run_id) / "run.json").read_bytes()
        (self.run(run_id) / "run.json").write_bytes(pushed)
        tree = (self.run(run_id) / "tree.json").read_bytes()
        nonce = mailbox.new_nonce()
        body = mailbox.Request(run_id, nonce, "", _sha(run_json or pushed), _sha(tree), {"env": {"AGENT_TEST": "1"}},
                               {}, "", timeout_s).as_dict()
        self.put(mailbox.run_file(run_id, "request", nonce), body if unsigned else (signer or self.laptop).sign(body))
        return nonce

    def stop(self, run_id: str) -> str:
        nonce = mailbox.new_nonce()
        self.put(mailbox.run_file(run_id, "stop", nonce), self.laptop.sign(mailbox.StopRequest(run_id, nonce, 5.0).as_dict()))
        return nonce

    def put(self, rel: str, body: dict) -> None:
        path = self.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        (path.parent / (path.name + ".part")).write_text(json.dumps(body))
        os.replace(path.parent / (path.name + ".part"), path)

    def run(self, run_id: str) -> Path:
        return self.root / "runs" / run_id

    def agent_file(self, run_id: str, kind: str, nonce: str = "") -> Path:
        return self.root / mailbox.run_file(run_id, kind, nonce)

    def snapshot(self, run_id: str) -> dict:
        try:
            return json.loads(self.agent_file(run_id, "snapshot").read_text())
        except FileNotFoundError:
            return {}

    # ------------------------------------------------------------ agents

    def start(self, name: str = "box", *more: str, workdir: Path | None = None, url: str = "") -> subprocess.Popen:
        """`tether agent` in the background (its stderr kept in a file: agent-NAME.log)."""
        workdir = workdir or self.tmp / f"work-{name}"
        self.workdirs.append(workdir)
        log = open(self.tmp / f"agent-{name}.log", "ab")
        argv = [sys.executable, "-m", "tether.cli", "agent", "--mailbox", url or f"file://{self.root}", "--name", name,
                "--workdir", str(workdir), "--trust", self.laptop.path + ".pub", "--key", str(self.tmp / "keys" / name),
                "--gpus", "none", "--poll-s", POLL, *more]
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        self.agents.append(proc)
        return proc

    def log(self, name: str = "box") -> str:
        return (self.tmp / f"agent-{name}.log").read_text()

    def agent_key(self, name: str = "box") -> list:
        return signing.trusted(str(self.tmp / "keys" / f"{name}.pub"), "agent key")

    def local_run(self, run_id: str, name: str = "box") -> Path:
        return self.tmp / f"work-{name}" / "runs" / run_id

    def close(self) -> None:
        for proc in self.agents:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
        for workdir in self.workdirs:
            stop_leftover_runs(workdir)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def box(tmp_path):
    found = Mailbox(tmp_path)
    yield found
    found.close()


def events(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().split("\n")[:-1] if line.strip()]


def assert_results_home(box: Mailbox, run_id: str, name: str = "box") -> None:
    """The mailbox holds the run's logs, its manifest's files (hashes matching), the agent's signature, a final snapshot."""
    run = box.run(run_id)
    assert any(e.get("event") == "exit" for e in events(run / "events.jsonl"))
    assert (run / "train.log").stat().st_size > 0
    sealed = (run / "PULL_MANIFEST.json").read_bytes()
    listed = json.loads(sealed)["files"]
    assert {"events.jsonl", "artifacts/model.json", "artifacts/metrics.json"} <= {e["path"] for e in listed}
    for entry in listed:
        assert _sha((run / entry["path"]).read_bytes()) == entry["sha256"], entry["path"]
    body, _ = signing.verified(json.loads(box.agent_file(run_id, "manifest.sig").read_text()), box.agent_key(name),
                               "manifest.sig.json")
    assert body == {"run_id": run_id, "manifest_sha256": _sha(sealed)}
    snap = box.snapshot(run_id)
    assert (snap["final"], snap["status"], snap["agent"]) == (True, "completed", name), snap


# ---------------------------------------------------------------- one run, start to end


def test_once_runs_a_signed_request_and_sends_back_signed_results(project, box):
    run_id = box.push(project)
    nonce = box.request(project, run_id)
    agent = box.start("box", "--once")
    assert agent.wait(timeout=60) == 0, box.log()
    claim = json.loads(box.agent_file(run_id, "claim", nonce).read_text())
    assert claim["agent"] == "box"
    assert_results_home(box, run_id)
    record = mailbox.AgentRecord.of(json.loads((box.root / mailbox.agent_record("box")).read_text()))
    assert record.key == (box.tmp / "keys" / "box.pub").read_text().strip() and record.pid == agent.pid
    assert "made a key" in box.log() and "SHA256:" in box.log()
    assert "AGENT_TEST" in (box.local_run(run_id) / "launch_env.json").read_text()  # the request's env
    down = mailbox.down_request("box", run_id)
    box.put(down, box.laptop.sign(mailbox.DownRequest(run_id, mailbox.new_nonce()).as_dict()))
    assert box.start("box", "--once").wait(timeout=60) == 0, box.log()
    assert not box.local_run(run_id).exists() and not (box.root / down).exists()
    assert json.loads((box.tmp / "work-box" / "agent.json").read_text())["runs"] == {}
    # whoever can write the mailbox puts the old signed request (and its files) back: it is not run again
    box.agent_file(run_id, "claim", nonce).unlink()
    assert box.start("box", "--once").wait(timeout=60) == 0, box.log()
    refused = json.loads(box.agent_file(run_id, "refused", nonce).read_text())
    assert "was run here before" in refused["reason"] and not box.local_run(run_id).exists()


# ---------------------------------------------------------------- authority


def test_unsigned_untrusted_and_changed_requests_are_refused_and_never_run(project, box):
    run_id = box.push(project)
    unsigned = box.request(project, run_id, unsigned=True)
    forged = box.request(project, run_id, signer=box.stranger)
    changed = box.request(project, run_id, run_json=b"{}")  # run.json is not what was signed
    void = box.request(project, run_id, timeout_s=0.001)  # older than its queue_timeout_s: left alone
    agent = box.start("box", "--once")
    assert agent.wait(timeout=60) == 0, box.log()
    for nonce, why in ((unsigned, "not signed"), (forged, "not trusted"), (changed, "not the one the request signed")):
        refused = json.loads(box.agent_file(run_id, "refused", nonce).read_text())
        assert refused["agent"] == "box" and why in refused["reason"], refused
        assert not box.agent_file(run_id, "claim", nonce).exists()
    assert not box.local_run(run_id).exists()  # nothing of it came here, nothing ran
    assert not box.agent_file(run_id, "claim", void).exists() and not box.agent_file(run_id, "refused", void).exists()
    assert box.stranger.fingerprint in box.log() and "(unsigned)" in box.log(), box.log()
    assert "no run is waiting" in box.log()


# ---------------------------------------------------------------- two agents


def test_two_agents_on_one_mailbox_take_different_runs(project, box):
    runs = [box.push(project, epochs=30), box.push(project, epochs=31)]
    nonces = [box.request(project, run_id) for run_id in runs]
    agents = [box.start("east", "--once"), box.start("west", "--once")]
    for agent, name in zip(agents, ("east", "west")):
        assert agent.wait(timeout=60) == 0, box.log(name)
    takers = [json.loads(box.agent_file(r, "claim", n).read_text())["agent"] for r, n in zip(runs, nonces)]
    assert sorted(takers) == ["east", "west"], takers
    for run_id, name in zip(runs, takers):
        assert_results_home(box, run_id, name)


# ---------------------------------------------------------------- stop, SIGTERM, SIGKILL


def test_a_stop_request_stops_the_run(project, box):
    run_id = box.push(project, epochs=100000)
    box.request(project, run_id)
    agent = box.start("box")
    poll(lambda: box.snapshot(run_id).get("status") == "running", 30, "the run running, as the agent says")
    nonce = box.stop(run_id)
    poll(lambda: box.agent_file(run_id, "stopped", nonce).exists(), 30, "stopped-<nonce>.json")
    assert json.loads(box.agent_file(run_id, "stopped", nonce).read_text())["outcome"] == "stopped"
    poll(lambda: box.snapshot(run_id).get("final"), 30, "the final snapshot")
    assert box.snapshot(run_id)["status"] == "stopped"
    assert agent.poll() is None  # it goes on polling
    again = box.request(project, run_id)  # `doit run train` after `doit stop`: attempt 2, from its checkpoint
    poll(lambda: box.snapshot(run_id).get("nonce") == again and box.snapshot(run_id)["status"] == "running",
         30, "attempt 2 running")
    assert json.loads(box.agent_file(run_id, "claim", again).read_text())["agent"] == "box"
    assert box.snapshot(run_id)["state"]["attempt"] == 2 and not box.snapshot(run_id)["final"]
    last = box.stop(run_id)
    poll(lambda: box.agent_file(run_id, "stopped", last).exists(), 30, "the second stop")
    agent.send_signal(signal.SIGTERM)
    assert agent.wait(timeout=30) == 0, box.log()
    held = json.loads((box.tmp / "work-box" / "agent.json").read_text())["runs"][run_id]
    assert (held["stopped"], held["interrupted"]) == (True, False)  # a stopped run is not restarted


def _checkpointed(box: Mailbox, run_id: str, attempt: int) -> bool:
    """Whether the mailbox's events say attempt `attempt` has saved a checkpoint."""
    launched = 0
    for e in events(box.run(run_id) / "events.jsonl"):
        launched += e.get("event") == "launch"
        if launched == attempt and e.get("event") == "checkpoint":
            return True
    return False


def test_sigterm_then_a_sigkill_with_the_trainer_each_leave_the_run_for_the_next_agent_to_resume(project, box):
    run_id = box.push(project, epochs=200)
    box.request(project, run_id)
    agent = box.start("box")
    poll(lambda: _checkpointed(box, run_id, 1), 30, "a checkpoint of attempt 1, mirrored")
    agent.send_signal(signal.SIGTERM)
    assert agent.wait(timeout=30) == 0, box.log()
    state = json.loads((box.local_run(run_id) / "state.json").read_text())
    assert state["status"] == "stopped" and state.get("checkpoint"), state
    assert box.snapshot(run_id)["final"] is False  # the laptop keeps waiting
    agent = box.start("box")  # resumes it; then the machine "reboots": the agent, the launcher, the trainer
    poll(lambda: _checkpointed(box, run_id, 2), 30, "a checkpoint of attempt 2, mirrored")
    agent.kill()
    state = json.loads((box.local_run(run_id) / "state.json").read_text())
    os.kill(state["pid"], signal.SIGKILL)
    os.killpg(state["pgid"], signal.SIGKILL)
    agent.wait(timeout=30)
    assert box.start("box", "--once").wait(timeout=60) == 0, box.log()
    launches = [e for e in events(box.run(run_id) / "events.jsonl") if e.get("event") == "launch"]
    assert len(launches) == 3 and all(e["resumed_from"] for e in launches[1:]), launches
    assert json.loads((box.run(run_id) / "artifacts" / "metrics.json").read_text())["steps"] == 200 * 25
    assert_results_home(box, run_id)


# ---------------------------------------------------------------- over a relay


def test_once_over_an_ssh_relay(project, box, sshd):
    run_id = box.push(project)
    box.request(project, run_id)
    relay = sshd.backend_config(box.root)
    agent = box.start("box", "--once", "--identity-file", relay["identity_file"], "--known-hosts",
                      relay["known_hosts"], "--relay-python", sys.executable,
                      url=f"ssh://root@127.0.0.1:{relay['port']}{box.root}")
    assert agent.wait(timeout=60) == 0, box.log()
    assert_results_home(box, run_id)


def test_a_mailbox_it_cannot_reach_is_one_line_a_poll_until_it_can(box, tmp_path):
    agent = box.start("box", url=f"ssh://root@127.0.0.1:1{box.root}")  # nothing listens on port 1
    poll(lambda: box.log().count("failed") >= 2, 30, "two failed polls, each said")
    agent.send_signal(signal.SIGTERM)
    assert agent.wait(timeout=30) == 0, box.log()
    assert "Traceback" not in box.log() and "trying again" in box.log(), box.log()


def test_bad_options_are_one_line_each_naming_the_fix(box, tmp_path):
    (tmp_path / "theirs").mkdir()
    (tmp_path / "theirs" / "notes.txt").write_text("not tether's")
    done = subprocess.run([sys.executable, "-m", "tether.cli", "agent", "--mailbox", "s3://bucket/x", "--name", "a b",
                           "--poll-s", "0"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert len(done.stderr.splitlines()) == 3 and "--name 'a b'" in done.stderr and "s3" in done.stderr, done.stderr
    agent = box.start("box", "--once", workdir=tmp_path / "theirs")
    assert agent.wait(timeout=60) == 2
    assert "give --workdir" in box.log() and "Traceback" not in box.log(), box.log()
