"""Far-side notifications (tether.remote.notify) and the `notify:` config section.

Real parts only: a real HTTP server on loopback records every request, hooks run under the real
/bin/sh, secrets sit in real files of real modes, and configs go through the real loader. No mocks
and no sleeps: every wait is `drain`'s own bound or a poll of a condition with a deadline.
"""

from __future__ import annotations

import glob
import http.server
import json
import os
import shlex
import socket
import stat
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

import pytest

from conftest import config_text
from tether import config
from tether.errors import ConfigError
from tether.remote import notify
from tether.remote.notify import DEFAULT_ON, KINDS, Notifier, notified
from tether.remote.rundir import is_private

FAST = 0.01  # backoff_s: the retry schedule of the real thing, a hundred times shorter
DRAIN_S = 10.0  # far above any delivery here; a test that hits it fails on what it finds, not by hanging
EVENTS = [
    {"event": "launch", "attempt": 2, "t": 1.0, "source": "launcher"},
    {"event": "step", "step": 10, "loss": 2.5, "lr": 0.001, "t": 2.0},
    {"event": "epoch", "epoch": 1, "step": 10, "val_loss": 2.25, "t": 3.0},
    {"event": "step", "step": 20, "loss": 1.25, "lr": 0.0005, "phase": "train", "ok": True, "t": 4.0},
    {"event": "checkpoint", "path": "checkpoints/step-20.pt", "t": 5.0},
]
STATE = {"status": "failed", "reason": "exit code 3", "attempt": 2, "exit_code": 3}


class Hook:
    """A webhook on 127.0.0.1: records each request, answers with the queued codes, then 200.

    A 3xx answer points its Location at `location`.
    """

    def __init__(self, answers: tuple[int, ...] = (), during: Optional[Callable[[], None]] = None,
                 location: str = "") -> None:
        self.requests: list[dict[str, Any]] = []
        self.answers, self.during, self.location, self.lock = list(answers), during, location, threading.Lock()
        hook = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if hook.during:
                    hook.during()  # while the notifier waits for this answer
                with hook.lock:
                    code = hook.answers.pop(0) if hook.answers else 200
                    hook.requests.append({"method": self.command, "path": self.path, "headers": dict(self.headers),
                                          "body": body, "code": code})
                self.send_response(code)
                if 300 <= code < 400:
                    self.send_header("Location", hook.location)
                self.send_header("Content-Length", "0")
                self.end_headers()

            do_GET = do_POST  # a followed redirect arrives as a GET

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.02,), daemon=True)  # quick shutdown
        self.thread.start()
        self.url = "http://127.0.0.1:%d/hook" % self.server.server_address[1]

    def bodies(self, code: int = 200) -> list[dict[str, Any]]:
        with self.lock:
            return [json.loads(r["body"]) for r in self.requests if r["code"] == code]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def hook():
    server = Hook()
    yield server
    server.close()


@pytest.fixture
def run_dir(tmp_path: Path) -> str:
    folder = tmp_path / "runs" / "demo-abc"
    folder.mkdir(parents=True)
    (folder / "run.json").write_text(json.dumps({"run_id": "demo-abc"}))
    (folder / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in EVENTS))
    (folder / "state.json").write_text(json.dumps(STATE))
    return str(folder)


@pytest.fixture(scope="module")
def dead_url():
    """A loopback port bound but never listening (connections are refused), held so nobody else gets it."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    yield "http://127.0.0.1:%d/hook" % sock.getsockname()[1]
    sock.close()


def secret_file(folder: Path, text: str, mode: int = 0o600) -> str:
    path = folder / ("secret-%d" % sum(1 for p in folder.iterdir() if p.name.startswith("secret-")))
    path.write_text(text)
    path.chmod(mode)
    return str(path)


def on_any_command_line(needle: str) -> list[str]:
    """The /proc/PID/cmdline of every process that carries `needle` (empty: it is on no command line)."""
    found = []
    for path in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            with open(path, "rb") as f:
                line = f.read()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        found += [path + ": " + line.decode(errors="replace")] if needle.encode() in line else []
    return found


def records(run_dir: str) -> list[dict[str, Any]]:
    return notified(run_dir)


# ---------------------------------------------------------------- delivery


def test_each_kind_is_delivered_once_with_the_run_in_its_payload(hook, run_dir):
    sealed = {name: Path(run_dir, name).read_bytes() for name in ("events.jsonl", "state.json")}
    notifier = Notifier(run_dir, {"webhook": hook.url, "on": list(KINDS), "backoff_s": FAST})
    for kind, status in (("completed", "completed"), ("failed", "failed"), ("preempted", "preempted")):
        state = dict(STATE, status=status)
        notifier.send(kind, state)
        state["status"] = "changed after send"  # what was sent is what the state was
    notifier.drain(DRAIN_S)

    bodies = hook.bodies()
    assert [b["event"] for b in bodies] == ["completed", "failed", "preempted"], hook.requests
    assert len(hook.requests) == 3
    first = bodies[0]
    assert first["id"] == "demo-abc:completed:2"
    assert (first["run_id"], first["state"], first["reason"], first["attempt"]) == \
        ("demo-abc", "completed", "exit code 3", 2)
    assert first["step"] == 20
    assert first["metrics"] == {"step": {"loss": 1.25, "lr": 0.0005}, "epoch": {"epoch": 1, "step": 10, "val_loss": 2.25}}
    assert first["where"] == "%s:%s" % (socket.gethostname(), run_dir)
    assert abs(first["t"] - time.time()) < 60
    assert all(r["path"] == "/hook" and r["headers"]["Content-Type"] == "application/json" for r in hook.requests)

    outcomes = records(run_dir)
    assert [(r["event"], r["ok"], r["tries"], r["error"], r["to"]) for r in outcomes] == \
        [(kind, True, 1, None, "webhook") for kind in ("completed", "failed", "preempted")]
    assert stat.S_IMODE(os.stat(Path(run_dir, "notify.json")).st_mode) == 0o600
    assert is_private("notify.json") and is_private("notify.json.tmp-123")
    assert {name: Path(run_dir, name).read_bytes() for name in sealed} == sealed  # the sealed files untouched
    assert sorted(os.listdir(run_dir)) == ["events.jsonl", "notify.json", "run.json", "state.json"]  # no tmp left


def test_run_id_falls_back_to_the_folder_name_and_missing_events_give_no_step(hook, tmp_path):
    folder = tmp_path / "other-run"
    folder.mkdir()
    notifier = Notifier(str(folder), {"webhook": hook.url, "backoff_s": FAST})
    notifier.send("stalled", {"status": "running", "reason": "no heartbeat for 120 s"})
    notifier.drain(DRAIN_S)
    [body] = hook.bodies()
    assert (body["run_id"], body["id"], body["step"], body["metrics"]) == \
        ("other-run", "other-run:stalled:None", None, {})
    assert (body["state"], body["reason"]) == ("running", "no heartbeat for 120 s")


def test_only_the_tail_of_a_long_event_log_is_read(hook, run_dir):
    padding = json.dumps({"event": "step", "step": 1, "loss": 9.0, "note": "x" * 200}) + "\n"
    with open(Path(run_dir, "events.jsonl"), "a") as f:
        f.write(padding * (3 * notify.TAIL_BYTES // len(padding)))
        f.write(json.dumps({"event": "step", "step": 99, "loss": 0.5}) + "\n")
    step, metrics = notify.progress(run_dir)
    assert step == 99 and metrics == {"step": {"loss": 0.5}}  # the epoch event is beyond the tail


def test_authorization_from_a_0600_file_never_reaches_a_command_line(run_dir, tmp_path):
    token = "s3cr3t-%d-%d" % (os.getpid(), time.time_ns())
    seen_during: list[list[str]] = []
    server = Hook(during=lambda: seen_during.append(on_any_command_line(token)))
    try:
        header = secret_file(tmp_path, "Bearer %s\n" % token)
        url = secret_file(tmp_path, "  %s?token=%s-url\n" % (server.url, token))
        out = tmp_path / "hook-stdin.json"
        notifier = Notifier(run_dir, {"webhook": {"file": url}, "headers": {"Authorization": {"file": header}},
                                      "command": "cat > %s" % shlex.quote(str(out)), "backoff_s": FAST})
        notifier.send("completed", dict(STATE, status="completed"))
        notifier.drain(DRAIN_S)
        assert len(server.requests) == 1, server.requests
        request = server.requests[0]
    finally:
        server.close()
    assert request["headers"]["Authorization"] == "Bearer " + token  # stripped of its newline
    assert request["path"] == "/hook?token=%s-url" % token
    assert seen_during == [[]], seen_during  # looked while the POST was in flight
    assert on_any_command_line(token) == []
    assert token not in Path(run_dir, "notify.json").read_text()
    assert token not in out.read_text()  # the payload names no secret
    assert [(r["to"], r["ok"]) for r in records(run_dir)] == [("command", True), ("webhook", True)]  # the command first


@pytest.mark.parametrize("where", ["webhook", "header"])
def test_a_secret_file_others_can_read_is_refused(hook, run_dir, tmp_path, where):
    loose = secret_file(tmp_path, hook.url if where == "webhook" else "Bearer abc", mode=0o644)
    tight = secret_file(tmp_path, hook.url)
    settings = ({"webhook": {"file": loose}} if where == "webhook" else
                {"webhook": {"file": tight}, "headers": {"Authorization": {"file": loose}}})
    notifier = Notifier(run_dir, dict(settings, backoff_s=FAST))
    notifier.send("failed", STATE)
    notifier.drain(DRAIN_S)
    assert hook.requests == []
    [outcome] = records(run_dir)
    assert (outcome["ok"], outcome["tries"], outcome["to"]) == (False, 0, "webhook")
    assert "secret file %s is mode 0644: chmod 600 %s" % (loose, loose) in outcome["error"], outcome


def test_a_header_of_two_lines_is_refused_without_quoting_it(hook, run_dir, tmp_path):
    header = secret_file(tmp_path, "Bearer SEKRIT\nX-Injected: 1\n")
    notifier = Notifier(run_dir, {"webhook": hook.url, "headers": {"Authorization": {"file": header}}})
    notifier.send("failed", STATE)
    notifier.drain(DRAIN_S)
    assert hook.requests == []
    [outcome] = records(run_dir)
    assert outcome["error"] == "header Authorization: its value has a line break: keep it on one line", outcome


def test_a_missing_secret_file_is_named(hook, run_dir, tmp_path):
    notifier = Notifier(run_dir, {"webhook": {"file": str(tmp_path / "absent")}, "backoff_s": FAST})
    notifier.send("failed", STATE)
    notifier.drain(DRAIN_S)
    assert hook.requests == []
    assert "secret file %s: No such file or directory" % (tmp_path / "absent") in records(run_dir)[0]["error"]


def test_a_secret_file_path_expands_the_home_folder(hook, run_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    name = os.path.basename(secret_file(tmp_path, hook.url))
    notifier = Notifier(run_dir, {"webhook": {"file": "~/" + name}, "backoff_s": FAST})
    notifier.send("completed", STATE)
    notifier.drain(DRAIN_S)
    assert len(hook.bodies()) == 1, records(run_dir)


def test_secrets_from_the_launchers_environment(hook, run_dir, monkeypatch):
    monkeypatch.setenv("TETHER_TEST_HOOK_URL", hook.url + "\n")
    monkeypatch.setenv("TETHER_TEST_HOOK_TOKEN", "  tok-123 \n")
    notifier = Notifier(run_dir, {"webhook": {"env": "TETHER_TEST_HOOK_URL"}, "backoff_s": FAST,
                                  "headers": {"X-Token": {"env": "TETHER_TEST_HOOK_TOKEN"}}})
    notifier.send("completed", STATE)
    notifier.drain(DRAIN_S)
    assert [r["headers"]["X-Token"] for r in hook.requests] == ["tok-123"]

    monkeypatch.delenv("TETHER_TEST_HOOK_TOKEN")
    notifier.send("failed", STATE)
    notifier.drain(DRAIN_S)
    assert len(hook.requests) == 1
    last = records(run_dir)[-1]
    assert (last["event"], last["ok"]) == ("failed", False)
    assert "environment variable TETHER_TEST_HOOK_TOKEN is not set" in last["error"]


def test_a_dead_webhook_never_blocks_nor_raises(run_dir, dead_url):
    notifier = Notifier(run_dir, {"webhook": dead_url, "backoff_s": FAST})
    started = time.monotonic()
    notifier.send("failed", STATE)
    assert time.monotonic() - started < 0.5  # queued, not delivered, on the caller's time
    notifier.drain(DRAIN_S)
    assert time.monotonic() - started < DRAIN_S
    [outcome] = records(run_dir)
    assert (outcome["ok"], outcome["tries"], outcome["to"]) == (False, notify.TRIES, "webhook")
    assert "could not reach the webhook" in outcome["error"] and "refused" in outcome["error"], outcome
    assert dead_url.split("//")[1] not in outcome["error"]  # the URL (it may be a secret) is never recorded


def test_drain_keeps_its_bound_and_records_what_was_not_delivered(run_dir, dead_url):
    notifier = Notifier(run_dir, {"webhook": dead_url})  # the real backoff: 1 + 2 + 4 + 8 s of retries
    notifier.send("preempted", STATE)
    started = time.monotonic()
    notifier.drain(0.3)
    waited = time.monotonic() - started
    assert 0.3 <= waited < 3, waited
    [outcome] = records(run_dir)
    assert (outcome["event"], outcome["ok"]) == ("preempted", False)
    assert "still being delivered when the launcher exited (it waited 0.3 s)" in outcome["error"]


@pytest.mark.parametrize("code", [302, 307])
def test_a_redirect_is_not_followed_with_the_secret_header(run_dir, tmp_path, hook, code):
    header = secret_file(tmp_path, "Bearer abc")
    server = Hook((code,), location=hook.url + "/elsewhere")
    try:
        notifier = Notifier(run_dir, {"webhook": server.url, "headers": {"Authorization": {"file": header}},
                                      "backoff_s": FAST})
        notifier.send("completed", STATE)
        notifier.drain(DRAIN_S)
        assert [r["code"] for r in server.requests] == [code]
    finally:
        server.close()
    assert hook.requests == []
    [outcome] = records(run_dir)
    assert (outcome["ok"], outcome["tries"]) == (False, 1) and outcome["error"].startswith("HTTP %d" % code)


@pytest.mark.parametrize("answers, tries, ok", [((500,), 2, True), ((429, 503), 3, True), ((404,), 1, False),
                                                ((500,) * notify.TRIES, notify.TRIES, False)])
def test_retries_on_5xx_and_429_only(run_dir, answers, tries, ok):
    server = Hook(answers)
    try:
        notifier = Notifier(run_dir, {"webhook": server.url, "backoff_s": FAST})
        notifier.send("completed", STATE)
        notifier.drain(DRAIN_S)
        codes = [r["code"] for r in server.requests]
        delivered = server.bodies()
    finally:
        server.close()
    assert codes == list(answers) + ([200] if ok else [])
    assert len(delivered) == (1 if ok else 0)
    assert len({json.dumps(b) for b in delivered}) == len(delivered)
    [outcome] = records(run_dir)
    assert (outcome["ok"], outcome["tries"]) == (ok, tries)
    assert outcome["error"] is None if ok else outcome["error"].startswith("HTTP %d" % answers[-1])


def test_on_picks_the_kinds_sent(hook, run_dir):
    only_failed = Notifier(run_dir, {"webhook": hook.url, "on": ["failed"], "backoff_s": FAST})
    for kind in ("completed", "stalled", "failed", "no such kind"):
        only_failed.send(kind, STATE)
    only_failed.drain(DRAIN_S)
    assert [b["event"] for b in hook.bodies()] == ["failed"]

    default = Notifier(run_dir, {"webhook": hook.url, "backoff_s": FAST})  # no "on": DEFAULT_ON
    default.send("stopped", STATE)
    default.send("wall time exceeded", STATE)
    default.drain(DRAIN_S)
    assert "stopped" not in DEFAULT_ON
    assert [b["event"] for b in hook.bodies()] == ["failed", "wall time exceeded"]


@pytest.mark.parametrize("settings", [None, {}, config.asdict(config.Notify())])
def test_nothing_configured_sends_nothing(run_dir, settings):
    notifier = Notifier(run_dir, settings)
    notifier.send("failed", STATE)
    started = time.monotonic()
    notifier.drain(DRAIN_S)
    assert time.monotonic() - started < 1
    assert notified(run_dir) == [] and not Path(run_dir, "notify.json").exists()


def test_the_command_reads_the_payload_with_its_environment_in_its_own_session(run_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    command = ("cat > {o}/payload.json; printf '%s\\n' \"$TETHER_NOTIFY_EVENT\" \"$TETHER_RUN_ID\" "
               "\"$TETHER_RUN_DIR\" > {o}/env.txt; echo $$ > {o}/pid; cut -d' ' -f6 /proc/$$/stat > {o}/sid"
               ).format(o=shlex.quote(str(out)))
    notifier = Notifier(run_dir, {"command": command})
    notifier.send("wall time exceeded", dict(STATE, status="stopped", reason="max_wall_seconds 3600 reached"))
    notifier.drain(DRAIN_S)
    body = json.loads((out / "payload.json").read_text())
    assert (body["event"], body["state"], body["reason"], body["step"], body["id"]) == \
        ("wall time exceeded", "stopped", "max_wall_seconds 3600 reached", 20, "demo-abc:wall time exceeded:2")
    assert (out / "env.txt").read_text().splitlines() == ["wall time exceeded", "demo-abc", run_dir]
    assert (out / "sid").read_text().strip() == (out / "pid").read_text().strip()  # a session leader
    assert [(r["to"], r["ok"], r["tries"], r["error"]) for r in records(run_dir)] == [("command", True, 1, None)]


def test_a_failing_command_is_recorded_never_raised(run_dir):
    notifier = Notifier(run_dir, {"command": "echo boom >&2; exit 3"})
    notifier.send("failed", STATE)
    notifier.drain(DRAIN_S)
    [outcome] = records(run_dir)
    assert (outcome["ok"], outcome["error"], outcome["to"]) == (False, "exited 3: boom", "command")


# ---------------------------------------------------------------- the notify: section


def load_notify(project, section: str) -> config.Job:
    path = project.write_config(config_text() + "notify:\n" + section)
    return config.load(str(path))


def notify_errors(project, section: str) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        load_notify(project, section)
    return caught.value.problems


def test_a_job_without_notify_sends_nothing(project):
    job = config.load(str(project.write_config(config_text())))
    assert job.notify == config.Notify()
    assert config.asdict(job.notify) == {"webhook": None, "headers": {}, "command": None, "on": list(DEFAULT_ON)}


def test_a_valid_section_round_trips_to_a_working_notifier(project, hook, run_dir, tmp_path, monkeypatch):
    url = secret_file(tmp_path, hook.url)
    monkeypatch.setenv("TETHER_TEST_AUTH", "Bearer xyz")
    out = tmp_path / "hook.json"
    job = load_notify(project, "  webhook: {file: %s}\n  headers: {Authorization: {env: TETHER_TEST_AUTH}}\n"
                               "  command: cat > %s\n  on: [completed, stalled]\n" % (url, out))
    assert job.notify.on == ("completed", "stalled")
    settings = json.loads(json.dumps(config.asdict(job.notify)))  # what travels to the far side
    assert settings == {"webhook": {"file": url}, "headers": {"Authorization": {"env": "TETHER_TEST_AUTH"}},
                        "command": "cat > %s" % out, "on": ["completed", "stalled"]}
    notifier = Notifier(run_dir, dict(settings, backoff_s=FAST))
    notifier.send("failed", STATE)
    notifier.send("stalled", STATE)
    notifier.drain(DRAIN_S)
    assert [(r["headers"]["Authorization"], json.loads(r["body"])["event"]) for r in hook.requests] == \
        [("Bearer xyz", "stalled")]
    assert json.loads(out.read_text())["event"] == "stalled"


def test_a_plain_url_without_a_secret_is_fine(project):
    job = load_notify(project, "  webhook: https://hooks.example.com/tether\n  on: failed\n")
    assert (job.notify.webhook, job.notify.on) == ("https://hooks.example.com/tether", ("failed",))


@pytest.mark.parametrize("section, says", [
    ("  on: [completed, stalld]\n", "notify.on: unknown kind 'stalld' (did you mean 'stalled'?); kinds: completed"),
    ("  webhook: ftp://example.com/hook\n", "notify.webhook is not an http:// or https:// URL: give https://"),
    ("  webhook: [https://example.com]\n", "webhook: expected a string or a mapping, got"),
    ("  webhook: {file: ~/a, env: HOOK}\n", "notify.webhook names both a file and an env variable: keep one"),
    ("  webhook: {}\n", "notify.webhook names no source: give {file: PATH}"),
    ("  webhook: {fil: ~/a}\n", "notify.webhook has the unknown key 'fil'"),
    ("  webhook: {env: 'not a name'}\n", "notify.webhook env 'not a name' is not a variable name"),
    ("  webhook: {env: HOOK}\n  headers: {X-Key: {env: K, file: ~/k}}\n", "notify.headers.X-Key names both"),
    ("  headers: {X-Key: {env: K}}\n", "notify.headers without a webhook"),
    ("  webhook: {env: HOOK}\n  headers: {'X Key': {env: K}}\n", "notify.headers: 'X Key' is not a header name"),
    ("  command: '  '\n", "command must be a shell command: give one or remove it"),
    ("  webhok: https://example.com\n", "unknown key 'webhok' in notify (did you mean 'webhook'?)"),
])
def test_section_errors_name_the_fix(project, section, says):
    problems = notify_errors(project, section)
    assert len(problems) == 1 and says in problems[0], problems


@pytest.mark.parametrize("url, seen", [
    ("https://hooks.example.com/h?token=SEKRIT", "the query parameter 'token'"),
    ("https://hooks.example.com/h?a=1&X-Amz-Signature=SEKRIT", "the query parameter 'X-Amz-Signature'"),
    ("https://hooks.example.com/h?api_key=SEKRIT", "the query parameter 'api_key'"),
    ("https://bot:SEKRIT@hooks.example.com/h", "credentials before the @"),
    ("https://hooks.slack.com/services/T0/B0/SEKRIT", "its path"),
])
def test_a_url_with_a_visible_secret_is_refused_without_repeating_it(project, url, seen):
    text = config_text() + "notify:\n  webhook: '%s'\n" % url
    problems = notify_errors(project, "  webhook: '%s'\n" % url)
    line = [n for n, ln in enumerate(text.splitlines(), 1) if "webhook:" in ln][0]
    assert len(problems) == 1, problems
    assert problems[0].startswith("%s:%d: error: notify.webhook carries a secret in plain text (%s"
                                  % (project.root / "tether.yaml", line, seen)), problems
    assert "0600 file on the far side (webhook: {file: ~/.config/hook-url})" in problems[0]
    assert "{env: NAME}" in problems[0] and "SEKRIT" not in problems[0]


def test_a_literal_header_is_refused_without_repeating_it(project):
    problems = notify_errors(project, "  webhook: {env: HOOK}\n  headers:\n    Authorization: Bearer SEKRIT\n")
    assert len(problems) == 1, problems
    assert ":%d: error: notify.headers.Authorization is written in the file" % (
        len(config_text().splitlines()) + 4) in problems[0], problems
    assert "Authorization: {file: ~/.config/hook-auth}" in problems[0] and "SEKRIT" not in problems[0]


def test_notify_is_not_part_of_the_run_identity(project):
    from tether.pipelines.identity import identify

    plain = config.load(str(project.write_config(config_text())))
    told = load_notify(project, "  webhook: https://hooks.example.com/tether\n  on: [failed]\n")
    assert identify(plain, ()).job_hash == identify(told, ()).job_hash
