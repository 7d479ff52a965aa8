"""Hostile and unlucky input, as data: each case is an input that once lost, leaked or wedged
something, the one-line error (or safe outcome) it now gets, and proof that what it threatened
is intact afterwards.

One section per area; each section's cases are a table of `pytest.param`s.
"""

from __future__ import annotations

import pytest  # noqa: F401


# ================================================================ remote_dir ownership and prune


# (end of section: remote_dir ownership and prune)


# ================================================================ seal, artifacts, launcher failures


# (end of section: seal, artifacts, launcher failures)


# ================================================================ GPUs and SLURM guards


# (end of section: GPUs and SLURM guards)


# ================================================================ config input and command line

import json  # noqa: E402
import shlex  # noqa: E402
import subprocess  # noqa: E402

from conftest import config_text, ssh_config_text  # noqa: E402
from sshd import keygen  # noqa: E402

CLEAN = config_text(epochs=3)
COMMAND = '  command: "{python} demo/train.py --epochs 3"\n'


def _edited(old: str, new: str, text: str = CLEAN) -> str:
    """`text` with `old` replaced by `new` (a stale `old` fails loudly instead of testing nothing)."""
    assert old in text, f"{old!r} is not in the config"
    return text.replace(old, new, 1)


def _line(text: str, needle: str) -> int:
    """1-based number of the first line of `text` that contains `needle`."""
    return next(n for n, line in enumerate(text.splitlines(), 1) if needle in line)


def _with_env(lines: str, text: str = CLEAN) -> str:
    """The clean config whose trainer has `env:` with these (indented) lines."""
    return _edited(COMMAND, COMMAND + "  env:\n" + lines, text)


# Billion laughs: nine levels of ten aliases each reach 10**9 strings from 10 short lines.
LAUGHS = _with_env("    L0: &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
    f"    L{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]\n" for i in range(1, 9)))
# One 200 KB string, aliased 60 times: 12 MB of text from a 200 KB file.
LONG_TEXT = _with_env(f"    A: &a \"{'x' * 200_000}\"\n    B: [{', '.join(['*a'] * 60)}]\n")
UNBALANCED = "{python} demo/train.py --epochs 3 --name 'x"
TRAILING_BACKSLASH = "{python} demo/train.py --epochs 3 \\"
ENV_LIST = _with_env("    A: [1, 2]\n")
ENV_NULL = _with_env("    A:\n")
SSH_ENV = config_text(epochs=3, backend_name="lab", backend="{type: ssh, host: example.org, env: {A: {x: 1}}}")
HUGE_INT = _edited("grace_seconds: 5", "grace_seconds: " + "9" * 5000)

# The config file's bytes -> the one line `doit status` says about it (after `error: status: `).
CONFIG_INPUTS = [
    pytest.param(_edited("name: demo", "name: d\xe9mo").encode("latin-1"),
                 "tether.yaml:1: error: not UTF-8 (byte 0xe9 at offset 7): save the file as UTF-8", id="latin-1"),
    pytest.param(_edited("grace_seconds: 5", "grace_seconds: 5 # \xff").encode("latin-1"),
                 f"tether.yaml:{_line(CLEAN, 'grace_seconds')}: error: not UTF-8 (byte 0xff at offset "
                 f"{CLEAN.index('grace_seconds: 5') + 19}): save the file as UTF-8", id="bad-byte-on-a-later-line"),
    pytest.param(CLEAN.encode("utf-16"), "tether.yaml:1: error: not UTF-8 (byte 0xff at offset 0): "
                 "save the file as UTF-8", id="utf-16"),
    pytest.param(_edited(COMMAND, f'  command: "{UNBALANCED}"\n').encode(),
                 f"tether.yaml:{_line(CLEAN, 'command:')}: error: trainer.command: No closing quotation: "
                 f"{UNBALANCED!r}: balance the quotes, or give the command as a list of words", id="unbalanced-quote"),
    pytest.param(_edited(COMMAND, f"  command: '{TRAILING_BACKSLASH}'\n").encode(),
                 f"tether.yaml:{_line(CLEAN, 'command:')}: error: trainer.command: No escaped character: "
                 f"{TRAILING_BACKSLASH!r}: remove the trailing backslash", id="trailing-backslash"),
    pytest.param(LAUGHS.encode(), f"tether.yaml:{_line(CLEAN, 'trainer:')}: error: the config expands to more "
                 f"than 100000 values (YAML aliases?)", id="billion-laughs-in-env"),
    pytest.param(LONG_TEXT.encode(), f"tether.yaml:{_line(CLEAN, 'trainer:')}: error: the config expands to more "
                 f"than 10 MiB of text (YAML aliases?)", id="aliased-long-text"),
    pytest.param(ENV_LIST.encode(), f"tether.yaml:{_line(ENV_LIST, 'A: [1, 2]')}: error: env 'A' in trainer "
                 f"(type command): expected a string, number or true/false, got a list (environment variables "
                 f"are text)", id="env-value-a-list"),
    pytest.param(ENV_NULL.encode(), f"tether.yaml:{_line(ENV_NULL, '    A:')}: error: env 'A' in trainer "
                 f"(type command): expected a string, number or true/false, got nothing (environment variables "
                 f"are text): give a value", id="env-value-missing"),
    pytest.param(SSH_ENV.encode(), f"tether.yaml:{_line(SSH_ENV, 'env:')}: error: env 'A' in backend 'lab' "
                 f"(type ssh): expected a string, number or true/false, got a mapping", id="backend-env-a-mapping"),
    pytest.param(CLEAN.encode() + b"#" * (1 << 20), "tether.yaml: error: larger than 1024 KiB, far more than a "
                 "config needs", id="over-1-MiB"),
    pytest.param(CLEAN.encode() + b"deep: " + b"[" * 5000 + b"]" * 5000 + b"\n",
                 f"tether.yaml:{CLEAN.count(chr(10)) + 1}: error: not a config: [ and {{ nested more than 64 deep: "
                 f"flatten it", id="deep-flow-nesting"),
    pytest.param(CLEAN.encode() + b"deep:\n" + b"- " * 5000 + b"x\n",
                 "tether.yaml: error: not a config: nested hundreds of levels deep: flatten it",
                 id="deep-block-nesting"),
    pytest.param(_edited("  type: command", "  type: [command]").encode(),
                 f"tether.yaml:{_line(CLEAN, 'type: command')}: error: unknown trainer type ['command']; available: ",
                 id="trainer-type-a-list"),
    pytest.param(_edited("name: demo", "name: de\amo").encode(),
                 "tether.yaml:1: error: not valid YAML: character '\\x07' is not allowed: remove it",
                 id="control-character"),
    pytest.param(HUGE_INT.encode(), "tether.yaml: error: not valid YAML: Exceeds the limit (4300 digits) for "
                 "integer string conversion: value has 5000 digits: shorten that value", id="5000-digit-number"),
]


def _one_error_line(done: subprocess.CompletedProcess, task: str) -> str:
    """The single `error: TASK: ...` line that is all of stderr (no traceback, nothing else)."""
    everything = done.stdout + done.stderr
    assert "Traceback" not in everything, everything
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {task}: "), everything
    return lines[0]


@pytest.mark.parametrize("data, message", CONFIG_INPUTS)
def test_hostile_config_is_one_line_at_its_place(project, data, message):
    (project.root / "tether.yaml").write_bytes(data)
    done = project.doit("status", timeout=60)
    assert done.returncode == 1, done.stdout + done.stderr
    assert message in _one_error_line(done, "status")
    assert not (project.root / ".tether" / "runs").exists()


# Command-line words -> the task, and the one line it says (after `error: TASK: `).
COMMAND_LINES = [
    pytest.param("doit", ["status", "config=/etc"], "/etc: error: is a directory: pass config=PATH to a YAML file",
                 id="doit-config-is-a-directory"),
    pytest.param("tether", ["status", "config=/etc"], "/etc: error: is a directory: pass config=PATH to a YAML file",
                 id="tether-config-is-a-directory"),
    pytest.param("doit", ["check", "config=/dev/zero"], "/dev/zero: error: larger than 1024 KiB",
                 id="config-is-endless"),
    pytest.param("doit", ["check", "json=maybe"], "json=maybe: use 1/0, yes/no, true/false or on/off",
                 id="json-maybe"),
    pytest.param("tether", ["down", "confirm=sure"], "confirm=sure: use 1/0, yes/no, true/false or on/off",
                 id="confirm-sure"),
    pytest.param("doit", ["status", "json="], "json=: use 1/0, yes/no, true/false or on/off", id="json-empty"),
]


@pytest.mark.parametrize("runner, words, message", COMMAND_LINES)
def test_hostile_command_line_is_one_line(project, runner, words, message):
    (project.root / ".tether").mkdir(exist_ok=True)  # `tether` in a fresh folder is another item's
    done = getattr(project, runner)(*words, timeout=60)
    assert done.returncode == 1, done.stdout + done.stderr
    assert message in _one_error_line(done, words[0])


@pytest.mark.parametrize("word, is_json", [("0", False), ("off", False), ("No", False), ("false", False),
                                           ("1", True), ("on", True), ("TRUE", True), ("yes", True)])
def test_json_word_is_read_as_yes_or_no(project, word, is_json):
    done = project.doit("check", f"json={word}", timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    report = [line for line in done.stdout.splitlines() if line.startswith(("{", "ok "))]
    assert report, done.stdout
    assert report[0].startswith("{") is is_json, done.stdout
    if is_json:
        assert json.loads(report[0])["backend"] == "local"


@pytest.mark.parametrize("word, fails", [("on", True), ("Yes", True), ("off", False), ("0", False)])
def test_strict_word_is_read_as_yes_or_no(project, word, fails):
    project.write_config(_edited("artifacts: [model.json, metrics.json]\n", ""))  # warns: no artifacts
    done = project.doit("validate", f"strict={word}", timeout=60)
    assert "no artifacts declared" in done.stdout, done.stdout
    assert done.returncode == (1 if fails else 0), done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr


def test_auth_failure_names_the_exact_ssh_command(project, sshd, tmp_path):
    stranger = tmp_path / "stranger"
    keygen(stranger, "not-authorized")
    project.write_config(ssh_config_text(sshd, tmp_path / "far", identity_file=str(stranger), connect_timeout_s=5))
    done = project.doit("check", timeout=60)
    assert done.returncode == 1, done.stdout + done.stderr
    line = _one_error_line(done, "check")
    command = (f"ssh -o BatchMode=yes -o UserKnownHostsFile={sshd.known_hosts} -p {sshd.port} -i {stranger} "
               f"root@127.0.0.1 true")
    assert f"authentication failed: `{command}` must work without a prompt: put {stranger}.pub into" in line, line
    # The hint is the real thing: that command fails as tether did, and works with the authorized key.
    argv = shlex.split(line.split("`")[1])
    refused = subprocess.run(argv, capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
    assert refused.returncode == 255 and "Permission denied" in refused.stderr, refused.stderr
    argv[argv.index(str(stranger))] = str(sshd.client_key)
    assert subprocess.run(argv, capture_output=True, timeout=30, stdin=subprocess.DEVNULL).returncode == 0


# (end of section: config input and command line)


# ================================================================ pull, verify and transfers


# (end of section: pull, verify and transfers)
