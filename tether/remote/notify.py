"""Notifications the far side sends about a run: a JSON webhook POST and/or a shell command.

Stdlib only, Python >= 3.8 (it ships with the launcher). `Notifier.send` queues and returns at once;
one daemon thread delivers, retrying a webhook with backoff, so no notification can block or fail
the run. Every outcome goes to the private file run_dir/notify.json, never to events.jsonl or
state.json: those are sealed into the run's manifest before the last notifications go out.
"""

from __future__ import annotations

import http.client
import json
import os
import queue
import re
import socket
import stat
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Dict, List, Optional, Tuple

from tether.remote import shell
from tether.remote.rundir import write_private

KINDS = ("completed", "failed", "preempted", "stalled", "restarted", "wall time exceeded", "stopped")
# Not "stopped" by default: whoever stopped the run knows already.
DEFAULT_ON = ("completed", "failed", "preempted", "stalled", "restarted", "wall time exceeded")

NOTIFY_FILE = "notify.json"  # private (rundir.PRIVATE_FILES): never sealed, never pulled
BACKOFF_S = 1.0  # the first wait before a webhook retry, doubling: 1, 2, 4, 8 s ride out a service's restart
TRIES = 5  # one POST and four retries: about 15 s of waiting, well inside a launcher's exit drain
POST_TIMEOUT_S = 10.0  # a chat service answers in well under a second; one taking 10 s is as good as dead
COMMAND_TIMEOUT_S = 60.0  # a hook that sends mail or a message; past a minute it hangs, and is killed
TAIL_BYTES = 64 * 1024  # the end of events.jsonl read for the payload: hundreds of records, one read
KEEP_RECORDS = 200  # notify.json keeps the newest outcomes only: a stalled run must not grow it for ever
MAX_SECRET = 1 << 16  # bytes read from a secret file: a URL or a header value, never more
ERROR_CHARS = 300  # the end of a failed command's stderr kept in its record

SOURCE_KEYS = ("file", "env")
SECRET_PARAM = re.compile(r"token|key|secret|sig|password|passwd|auth|credential", re.I)
SECRET_PATHS = ("hooks.slack.com/", "discord.com/api/webhooks/", "discordapp.com/api/webhooks/")  # path = key
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")  # an HTTP token (RFC 9110)
_WRITE = threading.Lock()  # notify.json is read, extended and replaced: one writer at a time in a process


class NotifyError(Exception):
    """A notification that cannot be sent as configured (a secret's file or variable): its record says why."""


# ---------------------------------------------------------------- rules shared with tether.config


def source_problem(source: Any) -> str:
    """Why `source` is not a secret source, {"file": PATH} or {"env": NAME} ('' when it is one).

    Empty values count as absent, so {"file": PATH, "env": ""} is a file source too.
    """
    if not isinstance(source, dict):
        return "must be {file: PATH} or {env: NAME}"
    unknown = [str(k) for k in source if k not in SOURCE_KEYS]
    if unknown:
        return "has the unknown key %r: a source is {file: PATH} or {env: NAME}" % unknown[0]
    given = [k for k in SOURCE_KEYS if source.get(k) not in (None, "")]
    if len(given) != 1:
        return ("names both a file and an env variable: keep one" if given else
                "names no source: give {file: PATH} (a 0600 file on the far side) or {env: NAME}")
    value = source[given[0]]
    if not isinstance(value, str) or not value.strip():
        return "%s must be a non-empty string" % given[0]
    if given[0] == "env" and not ENV_NAME.match(value):
        return "env %r is not a variable name (letters, digits, _)" % value
    return ""


def is_http(url: str) -> bool:
    """Whether `url` is an http:// or https:// URL with a host."""
    try:
        parts = urllib.parse.urlsplit(url.strip())
        return parts.scheme in ("http", "https") and bool(parts.hostname)
    except ValueError:  # a malformed [IPv6] host
        return False


def url_problem(url: str) -> str:
    """Why a plain-text webhook URL must not be used as is ('' when it may): not http(s), or a visible secret."""
    if not is_http(url):
        return "is not an http:// or https:// URL"
    parts = urllib.parse.urlsplit(url.strip())
    seen = ""
    if "@" in parts.netloc:
        seen = "credentials before the @"
    names = [name for name, _ in urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
             if SECRET_PARAM.search(name)]
    if names:
        seen = "the query parameter %r" % names[0]
    if any(known in (parts.netloc + parts.path + "/").lower() for known in SECRET_PATHS):
        seen = "its path (the path of this service's webhooks is their key)"
    return "carries a secret in plain text (%s)" % seen if seen else ""


# ---------------------------------------------------------------- secrets, read on the far side


def read_secret(source: Dict[str, Any], what: str) -> str:
    """The secret a source names, stripped; NotifyError naming the fix when it cannot be used."""
    problem = source_problem(source)
    if problem:
        raise NotifyError("%s %s" % (what, problem))
    if source.get("env"):
        name = source["env"]
        if name not in os.environ:
            raise NotifyError("%s: the environment variable %s is not set for the launcher: export it in the "
                              "far side's environment, or use {file: PATH}" % (what, name))
        return os.environ[name].strip()
    return _secret_file(os.path.expanduser(source["file"]), what)


def _secret_file(path: str, what: str) -> str:
    """A secret file's text: a regular file of ours that nobody else may read (mode 0600 or stricter)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO must not hang the delivery thread
    except OSError as err:
        raise NotifyError("%s: secret file %s: %s" % (what, path, err.strerror or err)) from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise NotifyError("%s: secret file %s is not a regular file" % (what, path))
        if info.st_uid != os.getuid():
            raise NotifyError("%s: secret file %s is owned by uid %d, not by this user (uid %d): "
                              "chown it, then chmod 600 %s" % (what, path, info.st_uid, os.getuid(), path))
        if info.st_mode & 0o077:
            raise NotifyError("%s: secret file %s is mode %04o: chmod 600 %s"
                              % (what, path, stat.S_IMODE(info.st_mode), path))
        return f.read(MAX_SECRET).decode("utf-8", "replace").strip()


# ---------------------------------------------------------------- what a notification says


def _tail_records(path: str) -> List[Dict[str, Any]]:
    """The JSON records in the last TAIL_BYTES of events.jsonl, oldest first ([] when it is absent)."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - TAIL_BYTES))
            chunk = f.read(TAIL_BYTES)
    except FileNotFoundError:
        return []
    lines = chunk.split(b"\n")
    if size > TAIL_BYTES:
        lines = lines[1:]  # the first line was cut by the seek
    records = []
    for line in lines:
        try:
            record = json.loads(line.decode("utf-8", "replace"))
        except ValueError:  # an empty line, or one being written
            continue
        records += [record] if isinstance(record, dict) else []
    return records


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def progress(run_dir: str) -> Tuple[Optional[int], Dict[str, Dict[str, Any]]]:
    """(the last step, {"step": numbers of the newest step event, "epoch": numbers of the newest epoch event})."""
    step: Optional[int] = None
    metrics: Dict[str, Dict[str, Any]] = {}
    for record in reversed(_tail_records(os.path.join(run_dir, "events.jsonl"))):
        if step is None and _number(record.get("step")):
            step = int(record["step"])
        kind = record.get("event")
        if kind in ("step", "epoch") and kind not in metrics:
            skip = ("t", "step") if kind == "step" else ("t",)  # a step event's step is `step` itself
            metrics[kind] = {k: v for k, v in record.items() if _number(v) and k not in skip}
        if step is not None and len(metrics) == 2:
            break
    return step, metrics


def run_id_of(run_dir: str) -> str:
    """The run's id from run.json, else its folder's name."""
    try:
        with open(os.path.join(run_dir, "run.json"), "rb") as f:
            found = json.loads(f.read().decode()).get("run_id")
    except (OSError, ValueError, AttributeError):
        found = None
    return found if isinstance(found, str) and found else os.path.basename(os.path.abspath(run_dir))


def payload(run_dir: str, kind: str, state: Dict[str, Any], t: float) -> Dict[str, Any]:
    """The JSON a webhook receives and a command reads on stdin; `id` is the same for a retried delivery."""
    run_id, (step, metrics) = run_id_of(run_dir), progress(run_dir)
    attempt = state.get("attempt")
    return {"id": "%s:%s:%s" % (run_id, kind, attempt), "run_id": run_id, "event": kind,
            "state": state.get("status"), "reason": state.get("reason"), "attempt": attempt, "step": step,
            "metrics": metrics, "where": "%s:%s" % (socket.gethostname(), os.path.abspath(run_dir)), "t": t}


# ---------------------------------------------------------------- the record: run_dir/notify.json


def notified(run_dir: str) -> List[Dict[str, Any]]:
    """Every recorded delivery outcome of the run, oldest first ([] when nothing was sent)."""
    try:
        with open(os.path.join(run_dir, NOTIFY_FILE), "rb") as f:
            records = json.loads(f.read().decode())
    except FileNotFoundError:
        return []
    except ValueError:  # written atomically, so only a hand edit gets here: the next outcome starts it anew
        return []
    return records if isinstance(records, list) else []


def _record(run_dir: str, record: Dict[str, Any]) -> None:
    """Add one outcome to notify.json (owner-only, atomic and durable: rundir.write_private)."""
    with _WRITE:
        write_private(os.path.join(run_dir, NOTIFY_FILE), (notified(run_dir) + [record])[-KEEP_RECORDS:])


# ---------------------------------------------------------------- delivery


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A redirect is an error: urllib would resend the secret headers to wherever it points."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


def post(url: str, headers: Dict[str, str], body: bytes) -> Tuple[Optional[str], bool]:
    """One JSON POST: (None, _) when delivered, else (why, whether a retry may help). The URL is never in `why`."""
    request = urllib.request.Request(url, data=body, headers=dict(headers, **{"Content-Type": "application/json"}),
                                     method="POST")
    try:
        with urllib.request.build_opener(_NoRedirect()).open(request, timeout=POST_TIMEOUT_S) as response:
            response.read(1 << 16)
        return None, False
    except urllib.error.HTTPError as err:
        err.close()
        return "HTTP %d %s" % (err.code, err.reason), err.code >= 500 or err.code == 429
    except urllib.error.URLError as err:
        return "could not reach the webhook: %s" % (err.reason,), not isinstance(err.reason, ValueError)
    except (OSError, http.client.HTTPException) as err:  # a timeout or a reset while reading the answer
        return "the webhook did not answer: %s" % (str(err) or type(err).__name__), True
    except ValueError:  # http.client quotes the URL in these: never repeat it
        return "the webhook URL is not a valid URL", False


def run_command(command: str, body: bytes, env: Dict[str, str], cwd: str) -> Optional[str]:
    """Run `command` with /bin/sh, `body` on its stdin, in its own session: None when it exits 0, else why."""
    try:
        code, err = shell.run(command, cwd, env, COMMAND_TIMEOUT_S, stdin=body)
    except OSError as error:
        return "could not start /bin/sh: %s" % error
    if code is None:
        return "timed out after %g s: killed" % COMMAND_TIMEOUT_S
    if code == 0:
        return None
    tail = err.decode("utf-8", "replace").strip()[-ERROR_CHARS:]
    how = "killed by signal %d" % -code if code < 0 else "exited %d" % code
    return how + (": " + tail if tail else "")


class Notifier:
    """Sends a run's notifications from one daemon thread; `settings` is tether.config.asdict(job.notify):

        {"webhook": "https://..." (a URL with no secret in it) | {"file": PATH} | {"env": NAME} | None,
         "headers": {NAME: {"file": PATH} | {"env": NAME}},
         "command": "shell text" | None,      # /bin/sh -c, the payload on stdin
         "on": [kind, ...],                   # of KINDS; absent: DEFAULT_ON
         "backoff_s": 1.0}                    # optional: the first retry wait (tests make it small)

    A {"file": PATH} holds the secret itself (the whole URL, or a header's whole value such as
    "Bearer abc"), ~ expanded, in a file of this user's of mode 0600; {"env": NAME} reads the
    launcher's environment. None or {} sends nothing.
    """

    def __init__(self, run_dir: str, settings: Optional[Dict[str, Any]]) -> None:
        self.run_dir = run_dir
        self.settings = dict(settings or {})
        on = self.settings.get("on")
        self.on = tuple(DEFAULT_ON if on is None else on)
        try:
            self.backoff_s = max(0.0, float(self.settings.get("backoff_s", BACKOFF_S)))
        except (TypeError, ValueError):
            self.backoff_s = BACKOFF_S
        self.targets = tuple(t for t in ("webhook", "command") if self.settings.get(t))
        self._queue: queue.Queue = queue.Queue()
        self._busy = threading.Condition()  # guards _pending, each job's "left" and the records
        self._pending: List[Dict[str, Any]] = []
        self._thread: Optional[threading.Thread] = None

    def send(self, kind: str, state: Dict[str, Any]) -> None:
        """Queue notification `kind` about a run in `state` (state.json's content); returns at once, never raises."""
        try:
            if kind not in self.on or not self.targets:
                return
            job = {"kind": kind, "state": dict(state or {}), "t": round(time.time(), 3),
                   "left": list(self.targets), "tries": {"webhook": 0, "command": 0}}
            with self._busy:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._work, name="tether-notify", daemon=True)
                    self._thread.start()
                self._pending.append(job)
            self._queue.put(job)
        except Exception:  # a thread that cannot start, a state that cannot be copied: the run goes on
            pass

    def drain(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for queued deliveries; any still under way is recorded as not delivered."""
        try:
            deadline = time.monotonic() + max(0.0, timeout_s)
            with self._busy:
                left = deadline - time.monotonic()
                while self._pending and left > 0:
                    self._busy.wait(left)
                    left = deadline - time.monotonic()
                late = [(job, to) for job in self._pending for to in job["left"]]
                for job, to in late:
                    self._outcome(job, to, False, "still being delivered when the launcher exited "
                                                  "(it waited %g s)" % timeout_s)
        except Exception:
            pass

    def _work(self) -> None:
        """The delivery thread: one notification at a time, in the order sent."""
        while True:
            job = self._queue.get()
            try:
                self._deliver(job)
            except Exception as err:  # a bug must cost one notification, never the thread
                with self._busy:
                    for to in list(job["left"]):
                        self._outcome(job, to, False, "internal error: %s: %s" % (type(err).__name__, err))
            finally:
                with self._busy:
                    self._pending.remove(job)
                    self._busy.notify_all()

    def _deliver(self, job: Dict[str, Any]) -> None:
        body = payload(self.run_dir, job["kind"], job["state"], job["t"])
        job["id"] = body["id"]
        data = json.dumps(body, sort_keys=True).encode()
        if "command" in self.targets:  # first: on this machine, it never waits behind a webhook's retries
            env = dict(os.environ, TETHER_NOTIFY_EVENT=job["kind"], TETHER_RUN_ID=body["run_id"],
                       TETHER_RUN_DIR=os.path.abspath(self.run_dir))
            job["tries"]["command"] = 1
            error = run_command(self.settings["command"], data, env, self.run_dir)
            with self._busy:
                self._outcome(job, "command", error is None, error)
        if "webhook" in self.targets:
            error = self._webhook(job, data)
            with self._busy:
                self._outcome(job, "webhook", error is None, error)

    def _webhook(self, job: Dict[str, Any], data: bytes) -> Optional[str]:
        """POST with retries (backoff doubling from backoff_s); None when delivered, else the last error."""
        try:
            url, headers = self._destination()
        except NotifyError as err:
            return str(err)
        delay = self.backoff_s
        while True:
            job["tries"]["webhook"] += 1
            error, again = post(url, headers, data)
            if error is None or not again or job["tries"]["webhook"] >= TRIES:
                return error
            time.sleep(delay)
            delay *= 2

    def _destination(self) -> Tuple[str, Dict[str, str]]:
        """The webhook URL and headers, secrets read now (a fixed file is picked up without a relaunch)."""
        webhook = self.settings["webhook"]
        url = webhook.strip() if isinstance(webhook, str) else read_secret(webhook, "webhook")
        if not is_http(url):  # never quoted: it may be a secret
            where = "webhook" if isinstance(webhook, str) else "the webhook in %s %s" % next(
                (k, v) for k, v in sorted(webhook.items()) if v)
            raise NotifyError("%s is not an http:// or https:// URL" % where)
        headers = {}
        for name, source in sorted((self.settings.get("headers") or {}).items()):
            if not HEADER_NAME.match(str(name)):
                raise NotifyError("header %r is not a valid header name" % name)
            value = read_secret(source, "header %s" % name)
            if "\n" in value or "\r" in value:  # http.client refuses it, quoting the value: say it here
                raise NotifyError("header %s: its value has a line break: keep it on one line" % name)
            headers[str(name)] = value
        return url, headers

    def _outcome(self, job: Dict[str, Any], to: str, ok: bool, error: Optional[str]) -> None:
        """Record one target's outcome, once: a drain that gave up has said it already (the caller holds _busy)."""
        if to not in job["left"]:
            return
        job["left"].remove(to)
        try:
            _record(self.run_dir, {"event": job["kind"], "id": job.get("id"), "at": round(time.time(), 3),
                                   "ok": ok, "tries": job["tries"][to], "error": error, "to": to})
        except OSError:  # a full disk: the notification itself may still have gone out
            pass
