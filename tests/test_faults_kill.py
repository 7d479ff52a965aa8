"""The controller killed anywhere, fast subset: SIGKILL doit/tether at chosen moments of every phase, rerun, check the invariants (the soak is bench/faults_kill.py)."""

from __future__ import annotations

import os
import random

import pytest

import kill_points as kp

SEED = int(os.environ.get("TETHER_FAULT_SEED", "15"))

# (command, regex of the traced event to die at): one or more per phase, each far-side command and file write
LOCAL = [
    ("train", r"^write .*/\.run\.json\.tmp"),                 # a run minted, its run.json not yet written
    ("train", r"^rename .*/\.run\.json\.tmp"),                # ... written, not yet renamed into place
    ("train", r"^far push"),                                   # push: the far side unpacking the snapshot
    ("train", r"^far start"),                                  # launch: the far side starting the launcher
    ("train", r"^rename .*launch\.json"),                      # launch's stamp, before its rename
    ("train", r"^write .*watch\.json"),                        # watch's stamp, before its bytes
    ("train", r"^rename .*PULL_MANIFEST\.json"),               # pull: the manifest, before its rename
    ("train", r"^write .*artifacts/model\.json\.part"),        # pull: a file's partial download
    ("train", r"^rename .*PULL_VERIFIED\.json"),               # verify: the proof, before its rename
    ("pull", r"^far send"),                                    # the far side streaming the files
    ("verify", r"^write .*PULL_VERIFIED\.json"),
    ("down", r"^far remove"),                                  # the far side deleting the run dir
    ("down", r"^write .*down\.json"),                          # removed, its stamp not yet written
    ("repro", r"^write .*/\.run\.json\.tmp"),                 # the reproduction's run being created
    ("repro", r"^far start"),                                  # the reproduction's launch
]
SSH = [("train", r"^far start"), ("pull", r"^far send")]


def _ids(cases):
    return [f"{command}:{match.lstrip('^').replace(chr(92), '')}" for command, match in cases]


@pytest.fixture(scope="session")
def expected(tmp_path_factory) -> dict[str, str]:
    """The artifacts' and checkpoints' SHA-256 of one uninterrupted run (the demo trainer is deterministic)."""
    return kp.reference(tmp_path_factory.mktemp("reference"), kp.Site("local"))


def check(outcome: kp.Outcome, backend: str) -> None:
    assert outcome.landed.startswith("at "), f"the kill did not land where asked: {outcome.landed}"
    assert not outcome.failures, (f"killed {outcome.landed}; reproduce: {outcome.moment.replay(SEED, backend)}\n"
                                  + "\n".join(outcome.failures))


@pytest.mark.parametrize("command,match", LOCAL, ids=_ids(LOCAL))
def test_killed_at_a_moment_the_rerun_finishes_and_loses_nothing(tmp_path, expected, command, match):
    moment = kp.Moment(command, "match", 0, match)
    check(kp.run_moment(tmp_path, kp.Site("local"), moment, expected, early_down=match == r"^far start"), "local")


def test_killed_after_a_seeded_delay_the_rerun_finishes_and_loses_nothing(tmp_path, expected):
    """One kill from outside at a seeded time within a typical run's first seconds (printed for replay)."""
    delay = round(random.Random(SEED).uniform(0.3, 2.5), 3)
    moment = kp.Moment("train", "delay", delay)
    outcome = kp.run_moment(tmp_path, kp.Site("local"), moment, expected, early_down=True)
    assert not outcome.failures, (f"seed {SEED}, delay {delay} s, landed {outcome.landed}; reproduce: "
                                  f"{moment.replay(SEED, 'local')}\n" + "\n".join(outcome.failures))


@pytest.mark.parametrize("command,match", SSH, ids=_ids(SSH))
def test_killed_over_ssh_the_rerun_finishes_and_loses_nothing(tmp_path, sshd, expected, command, match):
    moment = kp.Moment(command, "match", 0, match)
    check(kp.run_moment(tmp_path, kp.Site("ssh", sshd), moment, expected), "ssh")


def test_down_killed_before_its_teardown_command_runs_it_on_the_rerun(tmp_path):
    """A rented box: `down` killed after removing the run dir, before its teardown_command: the rerun runs it."""
    root = kp.new_project(tmp_path, kp.Site("local"))
    marker = tmp_path / "terminated"
    config = root / "tether.yaml"
    config.write_text(config.read_text().replace("local: {type: local}",
                                                 f'local: {{type: local, teardown_command: "echo ran >> {marker}"}}'))
    kp.must(kp.doit(root, "run", "train"), "doit run train")
    proc = kp.start_armed(root, kp.argv("down", root), tmp_path / "trace.jsonl", -1, r"^spawn sh -c")
    proc.wait(timeout=120)
    landed = kp.read_trace(tmp_path / "trace.jsonl")[-1]
    assert landed["killed"] and not marker.exists(), landed
    assert not (kp.local_runs(root)[0] / "down.json").exists()
    done = kp.doit(root, *kp.DOWN)
    assert done.returncode == 0, done.stderr
    assert marker.read_text() == "ran\n" and (kp.local_runs(root)[0] / "down.json").is_file()
    assert kp.down_gate(root, kp.Site("local")) == []


def test_the_schedule_is_seeded_and_covers_every_distinct_event():
    events = [{"n": i + 1, "kind": k, "what": w} for i, (k, w) in
              enumerate([("far", "push"), ("write", "a"), ("far", "probe"), ("far", "probe"), ("rename", "a -> b")])]
    timeline = kp.Timeline("train", events, 2.0)
    first, again = kp.schedule(7, timeline, 8), kp.schedule(7, timeline, 8)
    assert first == again and len(set(first)) == 8
    assert [m.label for m in first if m.kind == "match"] == ["^far\\ push$", "^write\\ a$", "^far\\ probe$",
                                                            "^rename\\ a\\ \\->\\ b$"]
    assert all(0 < m.at <= 2.0 for m in first if m.kind == "delay")
