"""Config and validation: unknown keys (file:line, valid keys, did you mean), wrong types, unknown
backends and types, the `validate` task (every problem at once, warnings, strict=1, acknowledgements),
command-line variables, hostile run ids, and paths that do not exist or leave the project.

Everything runs the real `doit` / `tether` processes in a throwaway project (no mocks), except the
unit tests of `tether.config.load` and `tether.paths.check_run_id`, which call them directly.
"""

from __future__ import annotations

import re
import pytest

from conftest import config_text
from tether import config, yamlfile
from tether.backends import BACKEND_TYPES
from tether.errors import ConfigError, RunError
from tether.paths import check_run_id
from tether.pipelines.session import BOOLEANS, VARIABLES, check_variables, flag
from tether.trainers.registry import TRAINER_TYPES

# A clean job in the project the `project` fixture makes (demo/train.py and demo/points.csv exist).
BASE = config_text(epochs=3)

NO_ARTIFACTS = BASE.replace("artifacts: [model.json, metrics.json]\n", "")
NO_ARTIFACTS_WARNING = "no artifacts declared"
JOB_KEYS = ("artifacts, backend, backends, checkpoint, code, data, environment, grace_seconds, heartbeat_timeout_s, "
            "max_wall_seconds, name, notify, restart, stall_timeout_s, sweep, trainer, validation")
TRAINERS = ", ".join(sorted(TRAINER_TYPES))  # the registry is the one source of truth for the list
BACKENDS = ", ".join(sorted(BACKEND_TYPES))


def edit(old: str, new: str, text: str = BASE) -> str:
    """`text` with `old` replaced by `new` (and `old` must be there: a stale edit must not pass silently)."""
    assert old in text, f"{old!r} is not in the config"
    return text.replace(old, new, 1)


def line_of(text: str, needle: str) -> int:
    """1-based number of the first line of `text` containing `needle`."""
    for number, line in enumerate(text.splitlines(), 1):
        if needle in line:
            return number
    raise AssertionError(f"{needle!r} not in the config")


def output(done) -> str:
    return done.stdout + done.stderr


def problem_lines(done) -> list[str]:
    """The lines of a validate run that report a config problem (`...: error: ...` / `...: warning: ...`)."""
    return [line for line in output(done).splitlines() if re.search(r": (error|warning): ", line)
            and not line.startswith("error: ")]


def run(project, runner: str, *args: str):
    """`doit ARGS` or `tether ARGS` (python -m tether.cli) in the project.

    For `tether`, `.tether/` is made first, as any earlier doit or tether command leaves it:
    a fresh folder without it crashes the CLI (see test_tether_cli_in_a_fresh_project), and
    these tests are about what it says of the config, not about that crash.
    """
    if runner == "tether":
        (project.root / ".tether").mkdir(exist_ok=True)
    return getattr(project, runner)(*args)


def assert_no_run(project) -> None:
    assert project.run_ids() == [], project.run_ids()
    assert not (project.root / ".tether" / "runs").exists()
    assert not (project.root / ".tether" / "remote" / "runs").exists()


def load_text(project, text: str, backend: str | None = None) -> config.Job:
    return config.load(str(project.write_config(text)), backend)


def load_problems(project, text: str, backend: str | None = None) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        load_text(project, text, backend)
    assert caught.value.problems, "ConfigError without problems"
    assert str(caught.value) == "\n".join(caught.value.problems)
    return caught.value.problems


# ---------------------------------------------------------------- tether.config.load, directly


def test_load_clean_file(project):
    job = load_text(project, BASE)
    assert job.name == "demo"
    assert job.backend == "local"
    assert job.backend_config.type == "local"
    assert job.trainer.type == "command"
    assert job.artifacts == ("model.json", "metrics.json")
    assert (job.checkpoint.keep, job.checkpoint.every) == (3, 50)
    assert job.grace_seconds == 5.0 and isinstance(job.grace_seconds, float)
    assert job.code.paths == ("demo/train.py",)
    assert job.root == str(project.root)
    assert job.source == str(project.root / "tether.yaml")
    assert job.warnings == ()


def test_load_backend_argument_wins_over_file(project):
    text = BASE + "  spare: {type: local, remote_dir: /tmp/elsewhere}\n"
    assert load_text(project, text).backend == "local"
    job = load_text(project, text, backend="spare")
    assert job.backend == "spare"
    assert job.backend_config.remote_dir == "/tmp/elsewhere"


def test_load_collects_every_problem(project):
    text = edit("checkpoint: {keep: 3, every: 50}", "checkpoint: {keep: 0, every: 50}")
    text = edit("  local: {type: local}", "  local: {type: local, pyhton: python3}", text)
    text = edit("heartbeat_timeout_s: 60", "heartbeat_timeout_s: never", text)
    problems = load_problems(project, text)
    assert len(problems) == 3, problems
    assert any("keep must be at least 1 (got 0)" in p for p in problems), problems
    assert any("unknown key 'pyhton'" in p for p in problems), problems
    assert any("heartbeat_timeout_s: expected a number, got 'never'" in p for p in problems), problems
    assert all(": error: " in p for p in problems), problems


def test_load_missing_file_names_the_fix(tmp_path):
    with pytest.raises(ConfigError) as caught:
        config.load(str(tmp_path / "absent.yaml"))
    assert caught.value.problems == [f"{tmp_path / 'absent.yaml'}: no such config file: pass config=PATH "
                                     f"or create tether.yaml"]


def test_load_invalid_yaml_gives_line(project):
    text = BASE + "artifacts: [unclosed\n"
    problems = load_problems(project, text)
    assert len(problems) == 1
    assert "not valid YAML" in problems[0]
    assert re.match(r".*tether\.yaml:\d+: error: ", problems[0]), problems


def test_load_not_a_mapping(project):
    problems = load_problems(project, "- name: demo\n- backend: local\n")
    assert len(problems) == 1 and "must be a YAML mapping" in problems[0]


def test_load_missing_name(project):
    problems = load_problems(project, edit("name: demo\n", ""))
    assert any("needs the key 'name'" in p for p in problems), problems


def test_load_bad_name(project):
    problems = load_problems(project, edit("name: demo", "name: 'two words'"))
    assert any("name must be letters, digits" in p and "'two words'" in p for p in problems), problems


@pytest.mark.parametrize("value", ["true", "'5'", "[5]"])
def test_load_number_refuses_non_numbers(project, value):
    problems = load_problems(project, edit("grace_seconds: 5", f"grace_seconds: {value}"))
    assert len(problems) == 1, problems
    assert "grace_seconds: expected a number" in problems[0], problems


# ---------------------------------------------------------------- unknown keys: file:line, valid keys, did you mean


@pytest.mark.parametrize("old, new, needle, message", [
    ("  local: {type: local}", "  local: {type: local, pyhton: python3}", "pyhton",
     "unknown key 'pyhton' in backend 'local' (type local) (did you mean 'python'?); "
     "valid keys: env, gpus, idle_stop, max_artifact_mb, min_free_gpu_mb, min_gpus, num_threads, python, remote_dir, share_gpus, teardown_command, type"),
    ("checkpoint: {keep: 3, every: 50}", "checkpoint: {kep: 3, every: 50}", "kep:",
     "unknown key 'kep' in checkpoint (did you mean 'keep'?); valid keys: every, keep"),
    ("checkpoint: {keep: 3, every: 50}", "checkpoint:\n  every: 50\n  kep: 3", "kep:",
     "unknown key 'kep' in checkpoint (did you mean 'keep'?); valid keys: every, keep"),
    ('  command: "{python} demo/train.py --epochs 3"',
     '  command: "{python} demo/train.py --epochs 3"\n  resume_arg: [--resume]', "resume_arg",
     "unknown key 'resume_arg' in trainer (type command) (did you mean 'resume_args'?); "
     "valid keys: checkpoint, command, env, processes, progress, requires, resume_args, total_steps, type"),
    ("artifacts:", "artifcats:", "artifcats",
     "unknown key 'artifcats' in the job (did you mean 'artifacts'?); valid keys: " + JOB_KEYS),
], ids=["backend-pyhton", "checkpoint-kep-flow", "checkpoint-kep-block", "trainer-resume_arg", "top-artifcats"])
def test_unknown_key_has_line_valid_keys_and_suggestion(project, old, new, needle, message):
    text = edit(old, new)
    line = line_of(text, needle)
    project.write_config(text)
    done = project.doit("validate")
    assert done.returncode == 1, output(done)
    assert f"tether.yaml:{line}: error: {message}" in done.stdout, output(done)


def test_unknown_top_level_key_near_trainer_suggests_it(project):
    # `trainer` and `backends` are valid top-level keys too: a near miss must be pointed at them.
    text = edit("trainer:", "trainr:")
    problems = load_problems(project, text)
    unknown = [p for p in problems if "unknown key 'trainr'" in p]
    assert len(unknown) == 1, problems
    assert "(did you mean 'trainer'?)" in unknown[0], unknown[0]
    assert "valid keys: " + JOB_KEYS in unknown[0], unknown[0]


@pytest.mark.parametrize("old, new, needle", [
    ("artifacts:", "artifcats:", "artifcats"),
    ("grace_seconds: 5", "grace_seconds: soon", "grace_seconds"),
    ("name: demo", "name: 'two words'", "name:"),
], ids=["unknown-key", "wrong-type", "failed-check"])
def test_top_level_problems_carry_their_line(project, old, new, needle):
    text = edit("name: demo", "# a comment first\n\nname: demo")
    text = edit(old, new, text)
    problems = load_problems(project, text)
    assert len(problems) == 1, problems
    assert f"tether.yaml:{line_of(text, needle)}: error: " in problems[0], problems


# ---------------------------------------------------------------- wrong types name the expected type


@pytest.mark.parametrize("old, new, expected", [
    ("grace_seconds: 5", "grace_seconds: soon", "grace_seconds: expected a number, got 'soon'"),
    ("artifacts: [model.json, metrics.json]", "artifacts: 3", "artifacts: expected a list"),
    ("checkpoint: {keep: 3, every: 50}", "checkpoint: {keep: three, every: 50}",
     "keep: expected an integer, got 'three'"),
    ("checkpoint: {keep: 3, every: 50}", "checkpoint: {keep: 2.5, every: 50}", "keep: expected an integer, got 2.5"),
    ("name: demo", "name: [demo]", "name: expected a string"),
], ids=["number", "list", "integer", "integer-not-float", "string"])
def test_wrong_type_names_expected_type(project, old, new, expected):
    project.write_config(edit(old, new))
    done = project.doit("validate")
    assert done.returncode == 1, output(done)
    assert expected in done.stdout, output(done)


def test_restart_policy_is_checked(project):
    problems = load_problems(project, BASE + "restart: {policy: sometimes}\n")
    assert len(problems) == 1, problems
    assert "policy must be one of never, on-preempt, on-failure (got 'sometimes')" in problems[0], problems


def test_wrong_type_for_a_section_says_mapping(project):
    problems = load_problems(project, edit("checkpoint: {keep: 3, every: 50}", "checkpoint: 3"))
    assert len(problems) == 1, problems
    assert "checkpoint: expected a mapping, got 3" in problems[0], problems
    assert "<class" not in problems[0], problems


# ---------------------------------------------------------------- backends and types


TWO_BACKENDS = BASE + "  spare: {type: local}\n"


def test_unknown_backend_in_file_lists_defined(project):
    text = edit("backend: local", "backend: nope", TWO_BACKENDS)
    project.write_config(text)
    done = project.doit("validate")
    assert done.returncode == 1, output(done)
    assert f"tether.yaml:{line_of(text, 'backend: nope')}: error: unknown backend 'nope'; defined: local, spare" \
        in done.stdout, output(done)


@pytest.mark.parametrize("runner", ["doit", "tether"])
def test_unknown_backend_on_command_line_lists_defined(project, runner):
    project.write_config(TWO_BACKENDS)
    done = run(project, runner, "validate", "backend=nope")
    assert done.returncode == 1, output(done)
    assert "backend=nope: error: unknown backend 'nope'; defined: local, spare" in done.stdout, output(done)


def test_unknown_backend_near_miss_suggests(project):
    problems = load_problems(project, BASE, backend="locl")
    assert problems == ["backend=locl: error: unknown backend 'locl' (did you mean 'local'?); defined: local"]


def test_several_backends_need_a_choice(project):
    problems = load_problems(project, edit("backend: local\n", "", TWO_BACKENDS))
    assert any("several backends are defined" in p for p in problems), problems


def test_unknown_backend_type_lists_available(project):
    text = edit("  local: {type: local}", "  local: {type: kubernetes}")
    problems = load_problems(project, text)
    assert len(problems) == 1, problems
    assert f"tether.yaml:{line_of(text, 'kubernetes')}: error: " in problems[0], problems
    assert f"type 'kubernetes'; available: {BACKENDS}" in problems[0], problems


def test_unknown_trainer_type_lists_available(project):
    text = edit("  type: command", "  type: pytorch")
    project.write_config(text)
    done = project.doit("validate")
    assert done.returncode == 1, output(done)
    assert f"tether.yaml:{line_of(text, 'pytorch')}: error: unknown trainer type 'pytorch'; available: {TRAINERS}" \
        in done.stdout, output(done)


def test_trainer_without_type_says_type_is_missing(project):
    problems = load_problems(project, edit("  type: command\n", ""))
    assert len(problems) == 1, problems
    assert f"available: {TRAINERS}" in problems[0], problems
    assert "'type'" in problems[0], problems  # says the key `type` is what is missing
    assert "None" not in problems[0], problems  # not "unknown trainer type None"


def test_key_of_another_backend_type_is_refused(project):
    # `host` belongs to remote backends, not to the local one.
    text = edit("  local: {type: local}", "  local: {type: local, host: gpu1}")
    problems = load_problems(project, text)
    assert problems == [f"{project.root / 'tether.yaml'}:{line_of(text, 'host:')}: error: unknown key 'host' "
                        f"in backend 'local' (type local); valid keys: env, gpus, idle_stop, max_artifact_mb, "
                        f"min_free_gpu_mb, min_gpus, num_threads, python, remote_dir, share_gpus, teardown_command, type"], problems


# ---------------------------------------------------------------- paths


@pytest.mark.parametrize("path, says", [
    ("../x", "leaves the project folder"),
    ("/etc", "leaves the project folder"),
    ("demo/../../x", "leaves the project folder"),
    ("demo/missing.py", "does not exist"),
])
@pytest.mark.parametrize("section", ["code", "data"])
def test_bad_paths_are_errors(project, section, path, says):
    old = "  paths: [demo/train.py]" if section == "code" else "  paths: [demo/points.csv]"
    project.write_config(edit(old, f"  paths: [{path}]"))
    done = project.doit("validate")
    assert done.returncode == 1, output(done)
    errors = [line for line in problem_lines(done) if ": error: " in line]
    assert len(errors) == 1, output(done)
    assert f"path {path!r} {says}" in errors[0], errors


def test_outside_path_that_exists_is_still_refused(project):
    outside = project.root.parent / "outside.txt"
    outside.write_text("not in the project\n")
    problems = load_problems(project, edit("  paths: [demo/points.csv]", "  paths: [../outside.txt]"))
    assert problems and "leaves the project folder" in problems[0], problems


def test_path_error_points_at_the_paths_line(project):
    text = edit("  paths: [demo/points.csv]", "  paths: [demo/missing.csv]")
    problems = load_problems(project, text)
    assert len(problems) == 1, problems
    assert f"tether.yaml:{line_of(text, 'missing.csv')}: error: " in problems[0], problems


# ---------------------------------------------------------------- validate: every problem at once, exit codes


THREE_ERRORS = edit("grace_seconds: 5", "grace_seconds: soon",
                    edit("  local: {type: local}", "  local: {type: local, pyhton: python3}",
                         edit("backend: local", "backend: nope", TWO_BACKENDS)))


@pytest.mark.parametrize("how", [("doit", "validate"), ("doit", "run", "validate"), ("tether", "validate")],
                         ids=["doit-validate", "doit-run-validate", "tether-validate"])
def test_validate_reports_every_error(project, how):
    project.write_config(THREE_ERRORS)
    done = run(project, *how)
    assert done.returncode == 1, output(done)
    errors = [line for line in problem_lines(done) if ": error: " in line]
    assert len(errors) == 3, output(done)
    assert any("unknown key 'pyhton'" in e and "did you mean 'python'" in e for e in errors), errors
    assert any("grace_seconds: expected a number, got 'soon'" in e for e in errors), errors
    assert any("unknown backend 'nope'; defined: local, spare" in e for e in errors), errors
    assert "error: validate: 3 error(s) in the config" in done.stderr, output(done)


def test_tether_cli_in_a_fresh_project(project):
    # `tether TASK` is `doit run TASK` without a dodo.py: it must work where no .tether/ exists yet
    # (dodo.py makes that folder itself; the console script must too).
    assert not (project.root / ".tether").exists()
    done = project.tether("validate")
    assert "Traceback" not in output(done), output(done)
    assert done.returncode == 0, output(done)
    assert f"{project.root / 'tether.yaml'}: ok (0 warning(s)); backend local" in done.stdout, output(done)


def test_validate_reports_path_errors_with_the_others(project):
    # A missing path and a typo in one file: both must be reported by one run of validate.
    text = edit("artifacts:", "artifcats:", edit("  paths: [demo/points.csv]", "  paths: [demo/missing.csv]"))
    project.write_config(text)
    done = project.doit("validate")
    assert done.returncode == 1, output(done)
    errors = [line for line in problem_lines(done) if ": error: " in line]
    assert any("unknown key 'artifcats'" in e for e in errors), output(done)
    assert any("path 'demo/missing.csv' does not exist" in e for e in errors), output(done)
    assert len(errors) == 2, output(done)


@pytest.mark.parametrize("how", [("doit", "validate"), ("tether", "validate")], ids=["doit", "tether"])
def test_validate_clean_file_exits_zero(project, how):
    project.write_config(BASE)
    done = run(project, *how)
    assert done.returncode == 0, output(done)
    assert problem_lines(done) == [], output(done)
    assert f"{project.root / 'tether.yaml'}: ok (0 warning(s)); backend local" in done.stdout, output(done)


def test_validate_prints_warnings_and_passes(project):
    project.write_config(NO_ARTIFACTS)
    done = project.doit("validate")
    assert done.returncode == 0, output(done)
    warnings = [line for line in problem_lines(done) if ": warning: " in line]
    assert len(warnings) == 1, output(done)
    assert NO_ARTIFACTS_WARNING in warnings[0]
    assert "ok (1 warning(s))" in done.stdout, output(done)


@pytest.mark.parametrize("how", [("doit", "validate"), ("tether", "validate")], ids=["doit", "tether"])
def test_strict_makes_warnings_fail(project, how):
    project.write_config(NO_ARTIFACTS)
    done = run(project, *how, "strict=1")
    assert done.returncode == 1, output(done)
    assert NO_ARTIFACTS_WARNING in done.stdout, output(done)
    assert "1 warning(s) and strict=1" in done.stderr, output(done)
    assert "ok (" not in done.stdout, output(done)


def test_strict_on_a_clean_file_passes(project):
    project.write_config(BASE)
    done = project.doit("validate", "strict=1")
    assert done.returncode == 0, output(done)


def ack(*entries: str) -> str:
    return NO_ARTIFACTS + "validation:\n  acknowledge:\n" + "".join(f"    - {e!r}\n" for e in entries)


def test_acknowledgement_silences_the_warning(project):
    project.write_config(ack("no artifacts declared: only logs"))
    done = project.doit("validate", "strict=1")
    assert done.returncode == 0, output(done)
    assert problem_lines(done) == [], output(done)
    assert "ok (0 warning(s))" in done.stdout, output(done)
    assert load_text(project, ack("no artifacts declared: only logs")).warnings == ()


def test_acknowledgement_is_case_sensitive(project):
    project.write_config(ack("NO ARTIFACTS DECLARED"))
    done = project.doit("validate", "strict=1")
    assert done.returncode == 1, output(done)
    warnings = [line for line in problem_lines(done) if ": warning: " in line]
    assert any(NO_ARTIFACTS_WARNING in w for w in warnings), warnings  # still there
    assert any("acknowledgement 'NO ARTIFACTS DECLARED' matches no warning" in w for w in warnings), warnings
    assert len(warnings) == 2, warnings


def test_short_acknowledgement_becomes_a_warning(project):
    project.write_config(ack("artifacts"))  # matches the warning, but is under 12 characters
    done = project.doit("validate")
    assert done.returncode == 0, output(done)
    warnings = [line for line in problem_lines(done) if ": warning: " in line]
    assert any(NO_ARTIFACTS_WARNING in w for w in warnings), warnings  # not silenced by a short one
    assert any("acknowledgement 'artifacts' is shorter than 12 characters" in w for w in warnings), warnings
    assert len(warnings) == 2, warnings
    strict = project.doit("validate", "strict=1")
    assert strict.returncode == 1, output(strict)
    assert "2 warning(s) and strict=1" in strict.stderr, output(strict)


def test_twelve_character_acknowledgement_is_enough(project):
    assert len("no artifacts") == 12
    assert load_text(project, ack("no artifacts")).warnings == ()
    assert len("o artifacts") == 11
    warnings = load_text(project, ack("o artifacts")).warnings
    assert len(warnings) == 2 and "shorter than 12 characters" in warnings[1], warnings


def test_unmatched_acknowledgement_fails_strict(project):
    project.write_config(BASE + "validation: {acknowledge: ['a warning that never happens']}\n")
    done = project.doit("validate")
    assert done.returncode == 0, output(done)
    warnings = [line for line in problem_lines(done) if ": warning: " in line]
    assert len(warnings) == 1, output(done)
    assert "acknowledgement 'a warning that never happens' matches no warning: remove it" in warnings[0]
    assert project.doit("validate", "strict=1").returncode == 1


# ---------------------------------------------------------------- command-line variables


def test_check_variables_unit():
    check_variables({name: "1" if name in BOOLEANS else "x" for name in VARIABLES})  # every known one passes
    with pytest.raises(ConfigError) as caught:
        check_variables({"backnd": "local", "run": "a1", "strickt": "1"})
    problems = caught.value.problems
    assert len(problems) == 2, problems
    assert "unknown variable backnd='local' (did you mean 'backend'?)" in problems[0]
    assert "unknown variable strickt='1' (did you mean 'strict'?)" in problems[1]
    assert "config, backend, run, confirm, json, strict" in problems[0]


@pytest.mark.parametrize("how", [("doit", "validate"), ("doit", "status"), ("tether", "validate")],
                         ids=["doit-validate", "doit-status", "tether-validate"])
def test_unknown_variable_refused(project, how):
    done = run(project, *how, "backnd=local")
    assert done.returncode != 0, output(done)
    assert "unknown variable backnd='local' (did you mean 'backend'?)" in output(done), output(done)
    assert_no_run(project)


def test_unknown_variable_refused_by_train_before_any_run(project):
    done = project.doit("run", "train", "backnd=local")
    assert done.returncode != 0, output(done)
    assert "unknown variable backnd='local' (did you mean 'backend'?)" in done.stderr, output(done)
    assert_no_run(project)


# ---------------------------------------------------------------- run ids


@pytest.mark.parametrize("good", ["a", "demo-20240101T000000Z-0123abcd", "A.b_c-9", "x" * 64])
def test_check_run_id_accepts(good):
    assert check_run_id(good) == good


@pytest.mark.parametrize("bad", ["", "-rf", "--help", "../escape", "a/b", "..", "a..b", ".hidden", "x;rm -rf ~",
                                 "$(id)", "`id`", "a b", "a\nb", "x" * 65, "é"])
def test_check_run_id_refuses(bad):
    with pytest.raises(RunError) as caught:
        check_run_id(bad)
    assert "invalid run id" in str(caught.value)
    assert "at most 64 characters" in str(caught.value)


def test_check_run_id_refuses_non_strings():
    with pytest.raises(RunError):
        check_run_id(None)  # type: ignore[arg-type]


HOSTILE = {
    "semicolon": "x;touch {marker}",
    "substitution": "$(touch {marker})",
    "backticks": "`touch {marker}`",
    "dollar-id": "$(id)",
    "dotdot": "../escape",
    "dash": "-rf",
    "empty": "",
    "65-chars": "x" * 65,
}


@pytest.mark.parametrize("runner", ["doit", "tether"])
@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_run_id_on_command_line(project, tmp_path, runner, name):
    marker = tmp_path / f"pwned-{name}"
    run_id = HOSTILE[name].format(marker=marker)
    done = run(project, runner, "status", f"run={run_id}")
    assert done.returncode != 0, output(done)
    errors = [line for line in done.stderr.splitlines() if line.strip()]
    assert errors == [f"error: status: invalid run id {run_id!r}: use letters, digits and '._-', start with a "
                      f"letter or digit, at most 64 characters (`ls .tether/runs` lists the runs known here)"], \
        output(done)
    assert not marker.exists()
    assert not (project.root.parent / "escape").exists()
    assert not (project.root / ".tether" / "escape").exists()
    assert_no_run(project)
    assert not (project.root / ".tether" / "remote").exists()  # the far side was not even touched


def test_hostile_run_id_refused_by_train(project, tmp_path):
    marker = tmp_path / "pwned-train"
    done = project.doit("run", "train", f"run=x;touch {marker}")
    assert done.returncode != 0, output(done)
    assert "invalid run id" in done.stderr, output(done)
    assert not marker.exists()
    assert_no_run(project)


def test_64_character_run_id_is_valid_but_unknown(project):
    done = project.doit("status", "run=" + "x" * 64)
    assert done.returncode != 0, output(done)
    assert "invalid run id" not in done.stderr, output(done)
    assert "is unknown here and on backend local" in done.stderr, output(done)
    assert_no_run(project)


# ---------------------------------------------------------------- config errors stop `train` before any run


@pytest.mark.parametrize("text, message", [
    (edit("grace_seconds: 5", "grace_seconds: soon"), "grace_seconds: expected a number, got 'soon'"),
    (edit("  local: {type: local}", "  local: {type: local, pyhton: python3}"), "did you mean 'python'"),
    (edit("backend: local", "backend: nope"), "unknown backend 'nope'; defined: local"),
    (edit("  paths: [demo/train.py]", "  paths: [../x]"), "path '../x' leaves the project folder"),
], ids=["type", "unknown-key", "backend", "path"])
def test_train_with_config_error_fails_and_creates_no_run(project, text, message):
    project.write_config(text)
    done = project.doit("run", "train")
    assert done.returncode != 0, output(done)
    assert message in done.stderr, output(done)
    assert "Traceback" not in output(done), output(done)
    assert_no_run(project)


def test_train_with_unknown_backend_on_command_line_creates_no_run(project):
    done = project.doit("run", "train", "backend=nope")
    assert done.returncode != 0, output(done)
    assert "backend=nope: error: unknown backend 'nope'; defined: local" in done.stderr, output(done)
    assert_no_run(project)


def test_config_argument_selects_another_file(project):
    other = project.root / "other.yaml"
    other.write_text(edit("grace_seconds: 5", "grace_seconds: soon"))
    done = project.doit("validate", f"config={other}")
    assert done.returncode == 1, output(done)
    assert f"{other}:" in done.stdout and "grace_seconds: expected a number" in done.stdout, output(done)
    assert project.doit("validate").returncode == 0  # tether.yaml itself is fine
    missing = project.doit("validate", f"config={project.root / 'nope.yaml'}")
    assert missing.returncode == 1
    assert "no such config file" in missing.stdout, output(missing)


def test_validate_does_not_create_runs(project):
    project.write_config(NO_ARTIFACTS)
    assert project.doit("validate").returncode == 0
    assert_no_run(project)


# ------------------------------------------------------------------ limits a real config stays far below


def test_size_cap_lets_a_file_of_exactly_the_cap_through(project):
    data = BASE.encode()
    (project.root / "tether.yaml").write_bytes(data + b"#" * (yamlfile.MAX_CONFIG_BYTES - len(data)))
    assert config.load(str(project.root / "tether.yaml")).name == "demo"
    (project.root / "tether.yaml").write_bytes(data + b"#" * (yamlfile.MAX_CONFIG_BYTES - len(data) + 1))
    with pytest.raises(ConfigError) as caught:
        config.load(str(project.root / "tether.yaml"))
    assert "larger than 1024 KiB" in caught.value.problems[0]


def test_aliases_within_the_caps_still_work(project):
    # An anchored env shared by two backends, and a sweep nested a few levels: what aliases are for.
    lab = "{type: ssh, host: lab-a, env: &shared {OMP_PLACES: cores, SEED: 7, FAST: true}}"
    text = edit("  local: {type: local}\n", f"  a: {lab}\n  b: {{type: ssh, host: lab-b, env: *shared}}\n",
                edit("backend: local", "backend: a"))
    job = load_text(project, text)
    assert job.backends["a"].env == job.backends["b"].env == {"OMP_PLACES": "cores", "SEED": 7, "FAST": True}


@pytest.mark.parametrize("word, value", [("1", True), ("yes", True), ("TRUE", True), ("On", True),
                                         ("0", False), ("no", False), ("False", False), ("OFF", False)])
def test_flag_reads_the_usual_boolean_words(word, value):
    assert flag({"strict": word}, "strict") is value
    check_variables({"strict": word})


@pytest.mark.parametrize("word", ["maybe", "", "2", "y", "enabled"])
def test_flag_refuses_any_other_word(word):
    assert flag({}, "json") is False  # absent is no
    with pytest.raises(ConfigError) as caught:
        flag({"json": word}, "json")
    assert caught.value.problems == [f"json={word}: use 1/0, yes/no, true/false or on/off"]
    with pytest.raises(ConfigError):
        check_variables({"json": word})


def test_a_key_added_at_its_default_keeps_the_run_id(project):
    """A trainer type that gains a setting in a later tether keeps its finished runs' ids (the
    identity holds only the settings that differ from their defaults); a changed value still counts."""
    import dataclasses

    from tether.pipelines.session import Session
    from tether.trainers.command import Config as Command

    before = Session.open({}, cwd=str(project.root))
    Later = dataclasses.make_dataclass("Later", [("added_later", int, dataclasses.field(default=3))], bases=(Command,),
                                       frozen=True)
    later = dataclasses.replace(before.job, trainer=Later(**dataclasses.asdict(before.job.trainer)))
    same = Session(later, before.backend, before.state_dir, {})
    assert same.job_hash == before.job_hash
    changed = Session(dataclasses.replace(later, trainer=dataclasses.replace(later.trainer, added_later=4)),
                      before.backend, before.state_dir, {})
    assert changed.job_hash != before.job_hash
