"""The agent's poll loop: say who it is, read the mailbox once, answer what it found, mirror what it holds."""

from __future__ import annotations

import json
import os
from dataclasses import asdict
import signal
import socket
import sys
import time
from typing import Any

from tether import mailbox, signing
from tether.agent import fetch, inbox, mirror
from tether.agent.inbox import Letter
from tether.agent.ledger import Held, Ledger
from tether.agent.options import Options
from tether.backends import agent as agent_backend
from tether.backends import local
from tether.backends.farside import FarSide
from tether.errors import BackendError, ConfigError, RunError, SignatureError, TetherError
from tether.remote.protocol import ERROR, Snapshot

STOP_GRACE_S = 30.0  # a run's grace on the agent's own SIGTERM when its run.json names none


def say(text: str) -> None:
    """One line of the agent's log (stderr)."""
    print(f"agent: {text}", file=sys.stderr, flush=True)


class Agent:
    """One agent: the mailbox's far side, this machine's, its keys and its ledger."""

    def __init__(self, options: Options) -> None:
        self.o, self.name, self.stopping = options, options.name, False
        self.refused_downs: set[str] = set()  # said once each: an untrusted down request stays where it is
        self.signer, made = signing.own_signer(options.key)
        say(f"{'made a key' if made else 'signs results with'} {self.signer.path} ({self.signer.fingerprint})")
        self.keys = signing.trusted(options.trust, "--trust")
        self.local = this_machine(options)
        self.ledger = Ledger(options.folder)
        self.mail = the_mailbox(options)
        self.described = self._describe()

    # ------------------------------------------------------------ the loop

    def run(self) -> int:
        """Poll until SIGTERM/SIGINT (then stop the runs, leaving them resumable), or once a --once run is home."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._stop_soon)
        took = self.recover()
        while not self.stopping:
            try:
                took = self.poll() or took
                failed = False
            except (BackendError, OSError) as err:  # a relay that reboots, a mailbox not mounted yet
                say(f"this poll of {self.o.mailbox} failed ({_line(err)}); trying again in {self.o.poll_s:g} s")
                self.mail.reconnect()
                failed = True
            if self.o.once and not self.ledger.busy():
                if not took:
                    say("the mailbox could not be reached: nothing was done" if failed else
                        "no run is waiting for this agent")
                return 1 if failed and not took else 0
            self._sleep(self.o.poll_s)
        return self.interrupt()

    def _stop_soon(self, signum: int, frame: Any) -> None:
        self.stopping = True

    def _sleep(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not self.stopping and time.monotonic() < deadline:
            time.sleep(min(0.05, seconds))

    def poll(self) -> bool:
        """One look at the mailbox and everything it asks for; whether a run was taken (or taken again)."""
        self.mail.put(mailbox.agent_record(self.name), json.dumps(self._record().as_dict()).encode())
        found = inbox.sort(self.mail.peek(patterns=inbox.patterns(self.name)), self.name)
        for letter in found.stops:
            self.stop(letter)
        for letter in found.downs:
            self.down(letter)
        took = False
        for letter in found.requests:
            if self.ledger.busy():
                break
            took = self.take(letter) or took
        self.mirror_all()
        return took

    # ------------------------------------------------------------ requests

    def take(self, letter: Letter) -> bool:
        """Verify a launch request, claim it, and run it here; refused (never run) when it is not trusted."""
        try:
            request = inbox.verified(letter, self.keys, mailbox.Request)
            if request.nonce in self.ledger.taken:
                raise SignatureError(f"request {request.nonce} of {request.run_id} was run here before: a signed "
                                     f"request runs once (this one was put back in the mailbox)")
            fetch.checked(self.mail, request)
        except (SignatureError, RunError) as err:
            self.refuse(letter, err)
            return False
        claim = mailbox.Claim(self.name, socket.gethostname(), round(time.time(), 3))
        if not self.mail.create(mailbox.run_file(letter.run_id, "claim", letter.nonce), json.dumps(claim.as_dict()).encode()):
            return False  # another agent took it first
        self.ledger.remember(request.nonce)
        say(f"claimed {letter.run_id} (request {letter.nonce}, signed by {inbox.signer_of(letter)})")
        held = self.ledger.runs.get(request.run_id) or Held(request.run_id, request.nonce)
        self.begin(letter, self.ledger.put(held.but(nonce=request.nonce, request=request.as_dict(), launched=False,
                                                    home=False, uploaded={}, stopped=False, interrupted=False)))
        return True

    def begin(self, letter: Letter, held: Held) -> None:
        """A claimed request's run fetched (or its ended attempt reopened) and started; refused if it cannot be.
        A mailbox lost on the way leaves it claimed and not launched: the next poll begins it again."""
        request, run_dir = mailbox.Request.of(held.request), self._run_dir(held.run_id)
        again = os.path.exists(os.path.join(run_dir, "run.json"))
        try:
            settings = fetch.settings(self.local, request)
            if again:
                self.local.far.reopen(run_dir)  # "open" for a run that never ended (it continues as it is)
            else:
                fetch.build(self.mail, self.local, request)
            self.launch(self.ledger.put(held.but(settings=settings)))
        except RunError as err:
            self.refuse(letter, err)
            if again:
                self.ledger.put(held.but(launched=True, home=True))  # its earlier results stay what the mailbox has
            else:
                self.ledger.drop(held.run_id)
            return
        self.ledger.put(self.ledger.runs[held.run_id].but(launched=True))
        # an earlier attempt's results (or the laptop's seal of a run it gave up on) are withdrawn:
        # this attempt's replace them when it ends
        self.mail.delete([f"runs/{held.run_id}/PULL_MANIFEST.json", mailbox.run_file(held.run_id, "manifest.sig")])

    def refuse(self, letter: Letter, err: TetherError) -> None:
        """refused-<nonce>.json, once, and a line naming the signer: nothing of the letter is executed."""
        body = {"agent": self.name, "reason": str(err)}
        if self.mail.create(mailbox.run_file(letter.run_id, "refused", letter.nonce), json.dumps(body).encode()):
            say(f"refused {letter.kind} {letter.nonce} of {letter.run_id} (signer {inbox.signer_of(letter)}): {err}")

    def launch(self, held: Held) -> None:
        """Start the run's launcher here; RunError if it did not start."""
        result = self.local.far.start(self._run_dir(held.run_id), held.settings)
        if result.outcome == ERROR:
            raise RunError(f"{held.run_id}: the launcher did not start here: {result.error}")
        say(f"{held.run_id}: {result.outcome} (attempt {result.attempt})")

    # ------------------------------------------------------------ stops and downs

    def stop(self, letter: Letter) -> None:
        """A stop request for a run held here: SIGTERM it (SIGKILL after its grace), say what it did."""
        held = self.ledger.runs.get(letter.run_id)
        if held is None:
            return  # another agent's run (or one nobody claimed: the laptop withdraws it)
        try:
            asked = inbox.verified(letter, self.keys, mailbox.StopRequest)
        except SignatureError as err:
            self.refuse(letter, err)
            return
        done = self.local.far.stop(self._run_dir(held.run_id), float(asked.grace_s))
        self.ledger.put(held.but(stopped=True, interrupted=False))
        self.mail.create(mailbox.run_file(held.run_id, "stopped", letter.nonce), json.dumps(asdict(done)).encode())
        say(f"{held.run_id}: stop request {letter.nonce}: {done.outcome}")

    def down(self, letter: Letter) -> None:
        """A down request: this copy of a verified run removed (never while it is alive), then the request."""
        try:
            asked = inbox.verified(letter, self.keys, mailbox.DownRequest)
        except SignatureError as err:
            if letter.path not in self.refused_downs:
                self.refused_downs.add(letter.path)
                say(f"refused {letter.path} (signer {inbox.signer_of(letter)}): {err}")
            return
        removal = self.local.far.remove(self._run_dir(asked.run_id))
        if removal.outcome == "alive":
            return  # it is still running: the request waits
        self.ledger.drop(asked.run_id)
        self.mail.delete([letter.path])
        say(f"{asked.run_id}: removed here ({removal.outcome})")

    # ------------------------------------------------------------ mirroring

    def mirror_all(self) -> None:
        """Every held run whose results are not home: logs, results once sealed, then its snapshot."""
        for one in [self.ledger.runs[rid] for rid in self.ledger.busy() if not self.ledger.runs[rid].launched]:
            self.begin(_letter_of(one), one)  # claimed when the mailbox went away mid-fetch
        held = [self.ledger.runs[rid] for rid in self.ledger.busy()]
        snaps = self.local.far.probe([self._run_dir(h.run_id) for h in held])
        for one in held:
            snap = snaps[self._run_dir(one.run_id)]
            if snap.status == "absent":
                say(f"{one.run_id}: its folder here is gone; it is no longer held")
                self.ledger.drop(one.run_id)
            else:
                self.mirror(one, snap)

    def mirror(self, held: Held, snap: Snapshot) -> None:
        """One held run: its logs' new bytes, its results once it is final and sealed, then its snapshot."""
        run_dir = self._run_dir(held.run_id)
        held = self.ledger.put(mirror.logs(self.mail, run_dir, held))
        if snap.final and not held.interrupted:
            if not snap.sealed and not snap.alive:
                self.local.far.seal(run_dir)
                snap.sealed = True
            if snap.sealed:
                held = self.ledger.put(mirror.results(self.mail, run_dir, held, self.signer,
                                                      held.settings.get("max_artifact_mb")))
                say(f"{held.run_id}: {snap.status}; results are in the mailbox")
        mirror.snapshot(self.mail, held, snap, self.name)

    # ------------------------------------------------------------ start and end

    def recover(self) -> bool:
        """On start: runs this agent interrupted, or that died with it (a reboot), start again from their
        checkpoint; whether it holds a run."""
        held = [self.ledger.runs[rid] for rid in self.ledger.busy()]
        snaps = self.local.far.probe([self._run_dir(h.run_id) for h in held])
        for one in held:
            snap = snaps[self._run_dir(one.run_id)]
            if not one.launched or one.stopped or snap.alive or snap.status == "absent" \
                    or not (one.interrupted or not snap.final):
                continue  # stopped on request, still running (mirrored again), or ended for good: left as is
            if snap.final:
                self.local.far.reopen(self._run_dir(one.run_id))
            try:
                self.launch(self.ledger.put(one.but(interrupted=False)))
            except RunError as err:
                say(str(err))
        return bool(held)

    def interrupt(self) -> int:
        """SIGTERM/SIGINT: stop the live runs (resumable), mirror once, exit 0."""
        held = [self.ledger.runs[rid] for rid in self.ledger.busy()]
        snaps = self.local.far.probe([self._run_dir(h.run_id) for h in held])
        for one in held:
            if snaps[self._run_dir(one.run_id)].alive:
                done = self.local.far.stop(self._run_dir(one.run_id), self._grace(one.run_id))
                self.ledger.put(one.but(interrupted=True))
                say(f"{one.run_id}: stopped by the agent's own exit ({done.outcome}); the next agent here resumes it")
        try:
            self.mirror_all()
        except (BackendError, OSError) as err:
            say(f"the mailbox {self.o.mailbox} cannot be reached ({_line(err)}): the next agent mirrors the rest")
        return 0

    def _grace(self, run_id: str) -> float:
        try:
            with open(os.path.join(self._run_dir(run_id), "run.json")) as f:
                return float(json.load(f).get("grace_seconds") or STOP_GRACE_S)
        except (OSError, ValueError, TypeError):
            return STOP_GRACE_S

    def _run_dir(self, run_id: str) -> str:
        return os.path.join(self.o.folder, "runs", run_id)

    def _describe(self) -> mailbox.AgentRecord:
        """What this agent says of itself, from the local preflight (once: GPUs do not come and go)."""
        found = self.local.far.check(dict(self.local.settings(), require=[]))
        return mailbox.AgentRecord(self.name, socket.gethostname(), f"{found.executable} ({found.python})",
                                   self.local.version, _gpu_lines(found.gpus or []), found.free_mb,
                                   key=self.signer.public, pid=os.getpid())

    def _record(self) -> mailbox.AgentRecord:
        """Its record for this poll: free space and the runs it holds, as of now."""
        fs = os.statvfs(self.o.folder)
        return mailbox.AgentRecord(**dict(self.described.as_dict(), free_mb=fs.f_bavail * fs.f_frsize >> 20,
                                          running=self.ledger.busy()))


def _letter_of(held: Held) -> Letter:
    """The request a held run answers, as the letter it came in (for a refusal)."""
    return Letter(inbox.REQUEST, held.run_id, held.nonce, mailbox.run_file(held.run_id, "request", held.nonce), "", 0.0)


def this_machine(options: Options) -> local.Backend:
    """The local far side the runs live in (its workdir claimed now, or refused if tether does not own it)."""
    gpus: Any = int(options.gpus) if options.gpus.isdigit() else options.gpus
    config = local.Config(remote_dir=options.folder, python=options.python, gpus=gpus)
    if config.problems():
        raise ConfigError([p.replace("remote_dir", "--workdir").replace("gpus", "--gpus") for p in config.problems()])
    backend = local.Backend("agent", config, options.folder)
    try:
        backend.far.channel()  # the claim, before the agent writes its own files there
    except BackendError as err:
        raise BackendError(str(err).replace("point remote_dir at", "give --workdir")) from None
    return backend


def the_mailbox(options: Options) -> FarSide:
    """The mailbox's far side, reached as the laptop reaches it (a local serve process, or the relay's)."""
    relay = agent_backend.Config(mailbox=options.mailbox, identity_file=options.identity_file,
                                 known_hosts=options.known_hosts, ssh_config=options.ssh_config,
                                 python=options.relay_python)
    if relay.problems():
        raise ConfigError(relay.problems())
    return agent_backend.Backend(options.name, relay, os.path.join(options.folder, "relay")).far


def _gpu_lines(gpus: list[dict]) -> list[str]:
    """One line per GPU, as check shows them: "0: NVIDIA A100, 40000/40960 MB free"."""
    return [f"{g.get('index')}: {g.get('name')}, {g.get('memory_free_mb')}/{g.get('memory_total_mb')} MB free"
            for g in gpus]


def _line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[-1] if text else type(err).__name__


def main(argv: list[str]) -> int:
    """`tether agent ...`: the exit code; every expected failure one line naming the fix."""
    from tether.agent.options import parse

    try:
        return Agent(parse(argv)).run()
    except TetherError as err:
        for line in str(err).splitlines():
            say(line)
        return 2
