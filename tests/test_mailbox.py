"""A mailbox's foundations: the far side's create/append/peek/delete, the URL, the records, the signatures."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from tether import mailbox, signing
from tether.backends.agent import Backend, Config
from tether.errors import BackendError, ConfigError, SignatureError


@pytest.fixture
def box(tmp_path: Path):
    """A file:// mailbox's far side (the serve process on the folder)."""
    backend = Backend("mb", Config(mailbox=f"file://{tmp_path}/mb"), str(tmp_path / "state"))
    yield backend.far
    backend.close()


def test_create_is_exclusive_even_when_two_writers_race(box, tmp_path):
    assert box.create("runs/r/agent/claim-0123456789abcdef.json", b'{"agent": "a"}') is True
    assert box.create("runs/r/agent/claim-0123456789abcdef.json", b'{"agent": "b"}') is False
    assert (tmp_path / "mb/runs/r/agent/claim-0123456789abcdef.json").read_bytes() == b'{"agent": "a"}'
    others = [Backend("mb", Config(mailbox=f"file://{tmp_path}/mb"), str(tmp_path / "state")) for _ in range(4)]
    won: list[bool] = []
    threads = [threading.Thread(target=lambda b=b: won.append(b.far.create("race.json", b"x"))) for b in others]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for b in others:
        b.close()
    assert sorted(won) == [False, False, False, True]
    assert not [p.name for p in (tmp_path / "mb").iterdir() if ".tmp-" in p.name]


def test_append_continues_only_where_the_copy_ends(box, tmp_path):
    assert box.append("runs/r/events.jsonl", 0, b"one\n") == 4
    assert box.append("runs/r/events.jsonl", 0, b"one\n") == 4  # sent twice: written once
    assert box.append("runs/r/events.jsonl", 4, b"two\n") == 8
    assert (tmp_path / "mb/runs/r/events.jsonl").read_bytes() == b"one\ntwo\n"


def test_peek_reads_named_and_matched_files_in_one_request_and_skips_what_is_missing(box):
    box.put("agents/a.json", b'{"name": "a"}')
    box.put("agents/b.json", b'{"name": "b"}')
    before = box.requests
    found = box.peek(["runs/r/tree.json", "agents/a.json"], ["agents/*.json"])
    assert box.requests == before + 1
    assert sorted(found.files) == ["agents/a.json", "agents/b.json"]
    assert found.files["agents/b.json"].text == '{"name": "b"}' and 0 <= found.files["agents/b.json"].age_s < 60
    box.delete(["agents/a.json", "agents/gone.json"])
    assert sorted(box.peek([], ["agents/*.json"]).files) == ["agents/b.json"]


def test_paths_that_leave_the_mailbox_are_refused(box):
    for bad in ("../outside.json", "runs/../../x"):
        with pytest.raises(BackendError, match="leaves"):
            box.create(bad, b"x")
    with pytest.raises(BackendError, match="leaves"):
        box.peek([], ["../*"])


@pytest.mark.parametrize("url, words", [
    ("s3://bucket/prefix", "no atomic create"), ("ftp://h/x", "not a mailbox"), ("file://host/x", "this machine"),
    ("ssh:///x", "no host"), ("ssh://h/a/../b", "without '..'"), ("ssh://h:port/x", "not a number"),
])
def test_a_mailbox_url_that_cannot_work_is_one_line_naming_the_forms_that_do(url, words):
    with pytest.raises(ConfigError, match=words):
        mailbox.address(url)


def test_a_signature_holds_only_for_the_body_it_covers_and_only_with_a_trusted_key(tmp_path):
    mine, made = signing.own_signer(str(tmp_path / "keys/id"))
    assert made and (tmp_path / "keys/id").stat().st_mode & 0o077 == 0
    assert signing.own_signer(str(tmp_path / "keys/id"))[1] is False
    theirs, _ = signing.own_signer(str(tmp_path / "other"))
    (tmp_path / "authorized_keys").write_text(f'no-pty,command="true" {mine.public}\n# a comment\n')
    keys = signing.trusted(str(tmp_path / "authorized_keys"), "--trust")
    body = mailbox.Request("r", mailbox.new_nonce(), "", "a" * 64, "b" * 64, {"env": {}}, {}, "v", 60.0).as_dict()
    signed = mine.sign(body)
    assert signing.verified(signed, keys, "request") == (body, mine.fingerprint)
    with pytest.raises(SignatureError, match="changed after it was signed"):
        signing.verified(dict(signed, body=dict(body, settings={"env": {"LD_PRELOAD": "/x"}})), keys, "request")
    with pytest.raises(SignatureError, match="not trusted here"):
        signing.verified(theirs.sign(body), keys, "request")
    with pytest.raises(SignatureError, match="not signed"):
        signing.verified(body, keys, "request")
    with pytest.raises(SignatureError, match="ssh-keygen -t ed25519"):
        signing.signer(str(tmp_path / "absent"), "signing_key")


def test_a_link_out_of_the_mailbox_or_a_pipe_in_it_is_left_out_of_a_peek_not_fatal(box, tmp_path):
    """Whoever else can write the mailbox must not make every poll fail (a link out) or hang (a pipe)."""
    import os

    secret = tmp_path / "secret.txt"
    secret.write_text("not the mailbox's")
    box.put("runs/r/agent/snapshot.json", b"{}")
    agent = tmp_path / "mb" / "runs" / "r" / "agent"
    (agent / "evil.json").symlink_to(secret)
    os.mkfifo(agent / "pipe.json")
    found = box.peek([], ["runs/*/agent/*.json"])
    assert sorted(found.files) == ["runs/r/agent/snapshot.json"]
    with pytest.raises(BackendError, match="leaves"):
        box.peek(["runs/r/agent/evil.json"])  # named outright, it is refused
