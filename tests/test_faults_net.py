"""Fault suite part B over ssh: sshd killed mid-push, mid-watch and mid-pull; a link that goes silent."""

from __future__ import annotations

import os

import pytest

from faults_net import kill_each_phase, link_frozen, make_project, expected_artifacts
from helpers import stop_leftover_runs
from sshd import SSHServer

SEED = int(os.environ.get("TETHER_FAULT_SEED", "1515"))


@pytest.fixture
def lab(tmp_path):
    """An sshd of the test's own (it is killed and frozen), the far folder, a project; all stopped after."""
    server = SSHServer(tmp_path / "sshd").start()
    far = tmp_path / "far"
    yield server, far
    server.thaw(server.sessions() + ([server.process.pid] if server.process else []))
    server.stop()
    stop_leftover_runs(far)


def test_sshd_killed_mid_push_watch_and_pull_the_run_is_unaffected(lab, tmp_path):
    server, far = lab
    root = make_project(tmp_path / "proj", server, far, SEED, steps=40)
    expected = expected_artifacts(root, steps=40)
    results = kill_each_phase(root, server, far, SEED, expected)
    failed = [(r.phase, r.moment, r.failures, r.notes) for r in results if r.failures]
    assert not failed, f"seed {SEED} (TETHER_FAULT_SEED={SEED} replays it): {failed}"


def test_a_silent_link_mid_watch_is_named_within_the_keepalive_bound(lab, tmp_path):
    """sshd SIGSTOPped (nothing closes, nothing answers): with alive_timeout_s 4 watch names the host and
    says it retries within 4 + 2 (connect_timeout_s) + slack seconds, and completes once sshd continues."""
    server, far = lab
    root = make_project(tmp_path / "proj", server, far, SEED, steps=40, alive_timeout_s=4, connect_timeout_s=2)
    expected = expected_artifacts(root, steps=40)
    result = link_frozen(root, server, far, "watch", SEED, expected, alive_s=4, connect_s=2)
    assert not result.failures, f"seed {SEED} at {result.moment}: {result.failures} {result.notes}"


@pytest.mark.parametrize("value", [2, 0, -1, 7200])
def test_an_alive_timeout_outside_its_range_is_one_line_naming_the_fix(tmp_path, value):
    from tether import config
    from tether.errors import ConfigError

    root = make_project(tmp_path / "proj", SSHServer(tmp_path / "sshd"), tmp_path / "far", SEED,
                        alive_timeout_s=value)
    with pytest.raises(ConfigError) as caught:
        config.load(str(root / "tether.yaml"))
    problems = [p for p in caught.value.problems if "alive_timeout_s" in p]
    assert len(problems) == 1 and "\n" not in problems[0], caught.value.problems
    assert f"alive_timeout_s {value:g} is outside 4-3600" in problems[0] and "60 by default" in problems[0], problems


def test_a_chunk_writer_whose_channel_dropped_raises_the_drop_again_not_a_buffer_error():
    """The fault the soak found (sshd killed mid-push): tarfile's close after a dropped channel wrote into a
    buffer a failed send still had a view of: BufferError, a traceback, instead of the channel's own error."""
    from tether.remote.protocol import MAX_CHUNK, ChunkWriter

    class Dropped:
        def write(self, data) -> int:
            raise ConnectionResetError("the channel dropped")

    writer = ChunkWriter(Dropped())  # type: ignore[arg-type]
    try:
        writer.write(b"x" * MAX_CHUNK)
    except ConnectionResetError:  # still handling it, as tarfile's __exit__ is when it closes the stream
        with pytest.raises(ConnectionResetError):  # was: BufferError: Existing exports of data
            writer.write(b"y" * MAX_CHUNK)
    else:
        raise AssertionError("the dropped channel's error did not surface")
