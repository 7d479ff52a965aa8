"""The agent backend's laptop side: its config, check, launch, states, stop and the results' signature,
over a real mailbox (a folder here, or one on a real sshd as the relay). The test writes the agent's
files itself, standing in for the agent; the agent program has tests of its own."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import threading
import time
from pathlib import Path

import pytest

from conftest import config_text
from helpers import poll
from tether.backends import agent
from tether.pipelines import phases
from tether import config as config_mod
from tether import mailbox, signing
from tether.errors import ConfigError, RunError, SignatureError
from tether.pipelines.session import Session
from tether.remote import rundir

RUN_ID = "demo-20260101T000000Z-00000000"


def agent_backend(mailbox_dir: Path, key: Path, **extra) -> str:
    """The YAML flow text of a `type: agent` backend over the folder `mailbox_dir`."""
    keys = dict({"type": "agent", "mailbox": f"file://{mailbox_dir}", "signing_key": str(key)}, **extra)
    return json.dumps(keys)


@pytest.fixture
def laptop_key(tmp_path: Path) -> signing.Signer:
    return signing.own_signer(str(tmp_path / "keys" / "laptop"))[0]


@pytest.fixture
def box(tmp_path: Path, project, laptop_key):
    """A project on an agent backend `box` whose mailbox is a folder; (project, mailbox dir)."""
    where = tmp_path / "mailbox"
    project.write_config(config_text(backend_name="box", backend=agent_backend(where, Path(laptop_key.path),
                                                                               agent="gpu1")))
    return project, where


def session(project, **variables) -> Session:
    return Session.open(dict(variables), cwd=str(project.root), files=False)


def backdate(path: Path, seconds: float) -> None:
    """Make `path` look `seconds` old on the mailbox's clock (its mtime)."""
    then = time.time() - seconds
    os.utime(path, (then, then))


def write(path: Path, body: dict, age_s: float = 0.0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(body))
    if age_s:
        backdate(path, age_s)
    return path


def agent_record(where: Path, name: str, age_s: float) -> Path:
    record = mailbox.AgentRecord(name, "ws7", "/usr/bin/python3 (3.11.2)", "v1", ["0: NVIDIA A100, 40000/40960 MB free"],
                                 free_mb=9000, running=["r-1"])
    return write(where / mailbox.agent_record(name), record.as_dict(), age_s)


# ------------------------------------------------------------------ config


@pytest.mark.parametrize("keys, said", [
    ({"mailbox": "s3://bucket/runs"}, "no atomic create"),
    ({"mailbox": "ssh://relay"}, "give an absolute folder"),
    ({"mailbox": "file:///m", "agent": "gpu 1"}, "agent 'gpu 1': use letters"),
    ({"mailbox": "file:///m", "queue_timeout_s": 0}, "queue_timeout_s 0 must be positive"),
    ({}, "mailbox is missing"),
])
def test_config_problems_are_one_line_each(tmp_path, keys, said):
    path = tmp_path / "tether.yaml"
    path.write_text(config_text(backend_name="box", backend=json.dumps(dict(keys, type="agent"))))
    with pytest.raises(ConfigError) as err:
        config_mod.load(str(path), None, False)
    assert said in str(err.value) and "Traceback" not in str(err.value)


# ------------------------------------------------------------------ check


def test_check_lists_the_agents_seen_and_says_how_to_start_one(box):
    project, where = box
    s = session(project)
    report = s.backend.check()
    assert report.ready  # a laptop may push and launch while the agent sleeps
    hint = [i for i in report.items if i["check"] == "agent"]
    assert hint and f"tether agent --mailbox file://{where} --name gpu1" in hint[0]["detail"]
    assert {"python", "writable", "disk", "inodes"} <= {i["check"] for i in report.items}
    assert not {"modules", "environment", "gpu"} & {i["check"] for i in report.items}

    agent_record(where, "gpu1", age_s=12)
    report = s.backend.check()
    line = next(i for i in report.items if i["check"] == "agent gpu1")
    assert line["ok"] and "ws7" in line["detail"] and "NVIDIA A100" in line["detail"]
    assert "r-1" in line["detail"] and re.search(r"last seen 1[234] s ago$", line["detail"])
    assert "agent" not in {i["check"] for i in report.items}  # seen within queue_timeout_s: no hint


# ------------------------------------------------------------------ launch


def test_launch_drops_one_signed_request_with_the_mailbox_hashes(box, laptop_key):
    project, where = box
    done = project.doit("run", "launch", check=True)
    assert ": queued for agent gpu1" in done.stdout
    run_dir = where / "runs" / project.run_ids()[-1]
    requests = list((run_dir / "agent").glob("request-*.json"))
    assert len(requests) == 1
    pub = project.root.parent / "laptop.pub"
    pub.write_text(laptop_key.public + "\n")
    body, _ = signing.verified(json.loads(requests[0].read_text()), signing.trusted(str(pub), "t"), "request")
    request = mailbox.Request.of(body)
    assert request.run_json_sha256 == hashlib.sha256((run_dir / "run.json").read_bytes()).hexdigest()
    assert request.tree_sha256 == hashlib.sha256((run_dir / "tree.json").read_bytes()).hexdigest()
    assert request.agent == "gpu1" and request.run_id == run_dir.name and request.version

    again = project.doit("run", "-a", "launch", check=True)  # even forced: never a second live request
    assert len(list((run_dir / "agent").glob("request-*.json"))) == 1, again.stdout
    status = project.doit("status", check=True).stdout
    assert "pending" in status and "queued for agent gpu1 (never seen)" in status


def test_a_missing_signing_key_is_one_line(box, tmp_path):
    project, where = box
    project.write_config(config_text(backend_name="box", backend=agent_backend(where, tmp_path / "nokey")))
    done = project.doit("run", "launch")
    assert done.returncode != 0 and "ssh-keygen -t ed25519" in done.stderr and "Traceback" not in done.stderr


# ------------------------------------------------------------------ states


@pytest.fixture
def queued(box):
    """A pushed run (its run.json and tree.json in the mailbox, written here) launched in-process."""
    project, where = box
    s = session(project)
    s.backend.install_launcher()  # the laptop makes the mailbox (as up does); then both sides write there
    run = s.paths(RUN_ID)
    for name in ("run.json", "tree.json"):
        write(where / run.remote_file(name), {"run_id": RUN_ID})
    assert s.backend.state(run).status == "pending" and s.backend.state(run).queue is None  # pushed only
    assert s.backend.launch(run).outcome == "started"
    nonce = mailbox.parse_name(str(next((where / "runs" / RUN_ID / "agent").glob("request-*.json"))))[1]
    return s, run, where, nonce


def files(where: Path, kind: str, nonce: str = "") -> Path:
    return where / mailbox.run_file(RUN_ID, kind, nonce)


def test_states_of_a_queued_request(queued):
    s, run, where, nonce = queued
    from tether.pipelines.observe import queue_text

    assert queue_text(s.backend.state(run)) == "queued for agent gpu1 (never seen)"
    agent_record(where, "gpu1", age_s=12)
    assert re.fullmatch(r"queued for agent gpu1 \(last seen 1[234] s ago\)", queue_text(s.backend.state(run)))
    backdate(files(where, "request", nonce), 600 + 2 * mailbox.POLL_S + 1)
    snap = s.backend.state(run)
    assert snap.status == "failed" and snap.final
    assert re.fullmatch(r"no agent gpu1 claimed the run in 60[567] s", snap.state["reason"])
    (where / mailbox.agent_record("gpu1")).unlink()
    assert re.fullmatch(r"no agent gpu1 has been seen for 60[567] s", s.backend.state(run).state["reason"])


def test_any_agent_lists_those_seen(box):
    project, where = box
    project.write_config(config_text(backend_name="box", backend=agent_backend(where, Path("k"))))
    s = session(project)
    s.backend.install_launcher()
    run = s.paths(RUN_ID)
    write(where / run.remote_file("tree.json"), {})
    write(files(where, "request", "0123456789abcdef"), {"body": mailbox.Request(
        RUN_ID, "0123456789abcdef", "", "", "", {}, {}, "v", 600).as_dict()})
    agent_record(where, "a", 3)
    agent_record(where, "b", 40)
    assert re.fullmatch(r"queued for any agent \(2 seen: a [345] s ago, b 4[012] s ago\)",
                        s.backend.state(run).queue["text"])


def test_states_answered_by_the_agent(queued):
    s, run, where, nonce = queued
    claim = mailbox.Claim("gpu1", "ws7", time.time()).as_dict()
    write(files(where, "claim", nonce), claim)
    assert s.backend.state(run).queue == {"text": "claimed by agent gpu1 on ws7; preparing"}
    report = {"status": "running", "alive": True, "state": {"status": "running", "host": "ws7"},
              "heartbeat_age_s": 1.0, "output_age_s": 2.0, "agent": "gpu1", "nonce": "f" * 16}
    write(files(where, "snapshot"), report)  # of another request: not this one's yet
    assert s.backend.state(run).queue == {"text": "claimed by agent gpu1 on ws7; preparing"}
    write(files(where, "snapshot"), dict(report, nonce=nonce), age_s=5)
    snap = s.backend.state(run)
    assert snap.status == "running" and not snap.final and snap.queue_error is None
    assert 6 <= snap.heartbeat_age_s < 7 and 7 <= snap.output_age_s < 8
    with pytest.raises(RunError, match="no heartbeat"):  # a fresh report of a silent launcher ends the watch
        phases._check_health(s, run, dataclasses.replace(snap, heartbeat_age_s=100.0))
    backdate(files(where, "snapshot"), mailbox.STALE_S + 70)
    snap = s.backend.state(run)
    from tether.pipelines.observe import queue_text

    assert snap.status == "running" and re.fullmatch(r"agent gpu1 last reported 10[012] s ago", snap.queue_error)
    assert "job" not in queue_text(snap) and "scheduler" not in queue_text(snap)
    phases._check_health(s, run, snap)  # a stale one decides nothing: the watch waits
    write(files(where, "snapshot"), dict(report, nonce=nonce, status="lost", alive=False))
    assert s.backend.state(run).alive  # not final: the agent restarts it or ends it, never this side's watch
    write(files(where, "snapshot"), dict(report, nonce=nonce, status="completed", final=True, alive=False))
    assert not s.backend.state(run).final  # not sealed: the results are not all in the mailbox yet
    write(files(where, "snapshot"), dict(report, nonce=nonce, status="completed", final=True, sealed=True, alive=False))
    snap = s.backend.state(run)
    assert snap.final and snap.status == "completed" and not snap.alive


def test_refused_withdrawn_and_superseded(queued):
    s, run, where, nonce = queued
    write(files(where, "refused", nonce), {"agent": "gpu1", "reason": "signed by SHA256:x, not trusted"})
    snap = s.backend.state(run)
    assert snap.final and snap.status == "failed"
    assert snap.state["reason"] == "agent gpu1 refused the run: signed by SHA256:x, not trusted"
    backdate(files(where, "request", nonce), 10)  # a second attempt: the newer request speaks
    assert s.backend.launch(run).outcome == "started"
    assert s.backend.state(run).status == "pending"
    assert s.backend.launch(run).outcome == "running"  # one live request, never two
    assert s.backend.stop(run, 1).outcome == "stopped"
    snap = s.backend.state(run)
    assert snap.final and snap.status == "stopped"
    assert s.backend.stop(run, 1).outcome == "was not running"


def test_stop_of_a_claimed_run_asks_the_agent(queued, monkeypatch):
    s, run, where, nonce = queued
    write(files(where, "claim", nonce), mailbox.Claim("gpu1", "ws7", time.time()).as_dict())
    agent_record(where, "gpu1", age_s=50)
    monkeypatch.setattr(agent, "STOP_ANSWER_S", 0.2)  # nobody answers: the wait is short here
    outcome = s.backend.stop(run, 0)
    assert re.fullmatch(r"stop requested: it waits in the mailbox for agent gpu1 \(last seen 5[0-3] s ago\)",
                        outcome.outcome)

    def answer() -> None:  # standing in for the agent: it answers the newest stop request
        poll(lambda: len(list(files(where, "x").parent.glob("stop-*.json"))) == 2, 10, "a second stop request")
        newest = max(files(where, "x").parent.glob("stop-*.json"), key=lambda p: p.stat().st_mtime_ns)
        write(files(where, "stopped", mailbox.parse_name(str(newest))[1]), {"outcome": "stopped", "status": "stopped"})

    helper = threading.Thread(target=answer)
    helper.start()
    monkeypatch.setattr(agent, "STOP_ANSWER_S", 10)
    assert s.backend.stop(run, 0).outcome == "stopped"
    helper.join()


def test_states_of_a_sweep_are_one_peek(queued):
    s, run, where, nonce = queued
    other = s.paths(RUN_ID[:-1] + "1")
    before = s.backend.commands
    found = s.backend.states([run, other])
    assert s.backend.commands == before + 1
    assert found[run.run_id].status == "pending" and found[other.run_id].status == "absent"


# ------------------------------------------------------------------ stop, through doit


def test_stop_of_an_unclaimed_run_withdraws_it(box):
    project, where = box
    project.doit("run", "launch", check=True)
    done = project.doit("stop", check=True)
    assert ": stopped" in done.stdout
    claim = next((where / "runs" / project.run_ids()[-1] / "agent").glob("claim-*.json"))
    assert json.loads(claim.read_text())["agent"] == mailbox.WITHDRAWN
    assert ": stopped (withdrawn before any agent claimed it)" in project.doit("status", check=True).stdout


def test_an_unclaimed_run_ends_once_its_queue_timeout_passes(box, laptop_key):
    project, where = box
    project.write_config(config_text(backend_name="box", backend=agent_backend(
        where, Path(laptop_key.path), agent="gpu1", queue_timeout_s=0.01)))
    done = project.doit("run", "train", timeout=60)
    assert done.returncode != 0 and "no agent gpu1 has been seen for" in done.stderr
    assert "queued for agent gpu1 (never seen)" in done.stderr and "Traceback" not in done.stderr


# ------------------------------------------------------------------ the results' authority


def sealed_results(project, where: Path) -> Path:
    """A completed run in the mailbox, as an agent leaves it: results, PULL_MANIFEST.json, final snapshot."""
    project.doit("run", "launch", check=True)
    run_dir = where / "runs" / project.run_ids()[-1]
    nonce = mailbox.parse_name(str(next((run_dir / "agent").glob("request-*.json"))))[1]
    write(run_dir / "agent" / f"claim-{nonce}.json", mailbox.Claim("gpu1", "ws7", 0).as_dict())
    (run_dir / "artifacts").mkdir()
    for name in ("model.json", "metrics.json"):
        write(run_dir / "artifacts" / name, {"ok": 1})
    write(run_dir / "state.json", {"status": "completed", "exit_code": 0})
    rundir.seal(str(run_dir))
    write(run_dir / "agent" / "snapshot.json", {"status": "completed", "final": True, "sealed": True,
                                                "state": {"status": "completed"}, "nonce": nonce, "agent": "gpu1"})
    return run_dir


def test_agent_key_refuses_results_the_agent_did_not_sign_and_down_tells_the_agent(box, laptop_key, tmp_path):
    project, where = box
    agent_key, _ = signing.own_signer(str(tmp_path / "keys" / "agent"))
    stranger, _ = signing.own_signer(str(tmp_path / "keys" / "stranger"))
    project.write_config(config_text(backend_name="box", backend=agent_backend(
        where, Path(laptop_key.path), agent="gpu1", agent_key=agent_key.path + ".pub")))
    run_dir = sealed_results(project, where)
    signature = run_dir / "agent" / "manifest.sig.json"
    data = (run_dir / "PULL_MANIFEST.json").read_bytes()
    body = {"run_id": run_dir.name, "manifest_sha256": hashlib.sha256(data).hexdigest()}
    for signed, said in ((None, "no manifest.sig.json"), (stranger, "not trusted here")):
        if signed is not None:
            signature.write_text(json.dumps(signed.sign(body)))
        done = project.doit("pull")
        assert done.returncode != 0 and said in done.stderr and "Traceback" not in done.stderr, done.stderr
        assert not (project.local_run() / "files").exists()  # nothing of it was saved here
    signature.write_text(json.dumps(agent_key.sign(dict(body, manifest_sha256="0" * 64))))
    s = session(project)
    with pytest.raises(SignatureError, match="its SHA-256 differs"):
        s.backend.vouch(s.observed(), data)
    signature.write_text(json.dumps(agent_key.sign(body)))
    assert ": pulled" in project.doit("pull", check=True).stdout
    assert (project.local_run() / "files" / "artifacts" / "model.json").exists()

    project.doit("verify", check=True)
    done = project.doit("run", "down", "confirm=yes", check=True)
    assert "agent gpu1 removes its copy when it next polls" in done.stdout and not run_dir.exists()
    signed = json.loads((where / mailbox.down_request("gpu1", run_dir.name)).read_text())
    laptop = [laptop_key.key.convert_to_public()]
    assert signing.verified(signed, laptop, "down")[0]["run_id"] == run_dir.name
    with pytest.raises(SignatureError):  # the signature covers the run id
        signing.verified(dict(signed, body={"run_id": "other", "nonce": "x"}), laptop, "down request")


# ------------------------------------------------------------------ the relay over ssh


def test_check_and_launch_over_a_relay(sshd, project, laptop_key, tmp_path):
    relay = tmp_path / "relay"
    keys = sshd.backend_config(relay)
    backend = {"type": "agent", "mailbox": f"ssh://root@127.0.0.1:{sshd.port}{relay}", "agent": "gpu1",
               "signing_key": laptop_key.path, **{k: keys[k] for k in ("identity_file", "known_hosts", "python",
                                                                     "connect_timeout_s")}}
    project.write_config(config_text(backend_name="box", backend=json.dumps(backend)))
    assert ": queued for agent gpu1" in project.doit("run", "launch", check=True).stdout
    agent_record(relay, "gpu1", age_s=100)
    check = project.doit("check", check=True).stdout
    assert "agent gpu1: ws7" in check and re.search(r"last seen 1[01][0-9] s ago", check)
    requests = list((relay / "runs" / project.run_ids()[-1] / "agent").glob("request-*.json"))
    assert len(requests) == 1 and json.loads(requests[0].read_text())["body"]["agent"] == "gpu1"
