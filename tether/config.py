"""The job's YAML file (ruamel) as frozen dataclasses: unknown keys, line numbers, "did you mean".

Each section has one source of truth: the dataclass below, or the one a backend or trainer
type registers. `load()` collects every problem before it raises, so one run of `validate`
shows them all.
"""

from __future__ import annotations

import dataclasses
import os
import re
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

from tether.environment import Environment
from tether.errors import ConfigError
from tether.remote.notify import DEFAULT_ON, KINDS
from tether.yamlfile import parse_yaml

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,37}$")
DEFAULT_EXCLUDES = (".git", ".tether", "__pycache__", "*.pyc", ".venv", "*.egg-info")
MIN_ACK_CHARS = 12


def _check(test: Callable[[Any], bool], message: str) -> dict:
    """Field metadata: a value failing `test` is an error saying `message`."""
    return {"check": (test, message)}


@dataclass(frozen=True)
class Paths:
    """Files to push: paths relative to the config file's folder, minus the exclude patterns."""

    paths: tuple[str, ...] = ()
    exclude: tuple[str, ...] = DEFAULT_EXCLUDES


@dataclass(frozen=True)
class Checkpoint:
    """How many checkpoints the runtime keeps, and how often a trainer is asked to save."""

    keep: int = field(default=3, metadata=_check(lambda v: v >= 1, "must be at least 1"))
    every: int = field(default=0, metadata=_check(lambda v: v >= 0, "must be 0 (trainer decides) or more"))


RESTART_POLICIES = ("never", "on-preempt", "on-failure")


@dataclass(frozen=True)
class Restart:
    """When the far side relaunches a run from its latest checkpoint, how often at most, and how
    long it waits first (backoff_s, doubled after each restart).

    on-preempt: after a signal-driven checkpoint-and-exit or a stall; on-failure: also after a crash.
    """

    policy: str = field(default="on-preempt", metadata=_check(lambda v: v in RESTART_POLICIES,
                                                              "must be one of " + ", ".join(RESTART_POLICIES)))
    max_restarts: int = field(default=3, metadata=_check(lambda v: v >= 0, "must be 0 or more"))
    backoff_s: float = field(default=10.0, metadata=_check(lambda v: v >= 0, "must be 0 or more"))  # doubles per restart


@dataclass(frozen=True)
class Validation:
    """Warnings the user has read and accepts: case-sensitive substrings of their text."""

    acknowledge: tuple[str, ...] = ()


@dataclass(frozen=True)
class Notify:
    """What the far side tells you about a run, and how: a webhook POST and/or a command (tether.remote.notify).

    A secret (a webhook URL with its key, a header's value) is never in this file: it comes from
    the far side, {file: PATH} (a file of mode 0600 there) or {env: NAME} (the launcher's environment).
    """

    webhook: Union[str, dict, None] = None  # "https://..." without a secret in it, or {file: PATH} / {env: NAME}
    headers: dict = field(default_factory=dict)  # NAME -> {file: PATH} / {env: NAME}
    command: Optional[str] = field(default=None, metadata=_check(lambda v: bool(v.strip()),
                                                                 "must be a shell command: give one or remove it"))
    on: tuple[str, ...] = DEFAULT_ON


@dataclass(frozen=True)
class Job:
    """Everything one YAML file says: the job, and the backends it may run on."""

    name: str = field(metadata=_check(NAME_RE.fullmatch, "must be letters, digits, '._-', start alphanumeric, at most 38 characters"))
    trainer: Any = None  # a trainer type's own dataclass, chosen by its `type:`
    backends: dict = field(default_factory=dict)  # NAME -> a backend type's own dataclass
    backend: str = ""
    code: Paths = Paths()
    data: Paths = Paths(exclude=())
    artifacts: tuple[str, ...] = ()
    checkpoint: Checkpoint = Checkpoint()
    restart: Restart = Restart()
    max_wall_seconds: float = field(default=7 * 24 * 3600.0, metadata=_check(lambda v: v > 0, "must be positive"))
    heartbeat_timeout_s: float = field(default=60.0, metadata=_check(lambda v: v > 0, "must be positive"))
    stall_timeout_s: Optional[float] = field(default=None, metadata=_check(lambda v: v is None or v > 0,
                                                                           "must be positive, or null (never)"))
    grace_seconds: float = field(default=30.0, metadata=_check(lambda v: v >= 0, "must be 0 or more"))
    notify: Notify = Notify()
    environment: Environment = Environment()  # the far side's venv and setup lines (tether.environment)
    validation: Validation = Validation()
    sweep: dict = field(default_factory=dict)  # setting -> list of values (tether.sweep)
    source: str = ""  # the YAML file this came from
    root: str = ""  # its folder: relative paths in the file start here
    warnings: tuple[str, ...] = ()

    @property
    def backend_config(self) -> Any:
        return self.backends[self.backend]


class Problems:
    """Errors and warnings, each prefixed with `file:line:`."""

    def __init__(self, source: str) -> None:
        self.source, self.errors, self.warnings = source, [], []

    def at(self, node: Any, key: Any = None) -> str:
        line = _line(node, key)
        return "%s:%s" % (self.source, line) if line else self.source

    def error(self, where: str, message: str) -> None:
        self.errors.append("%s: error: %s" % (where, message))

    def warn(self, where: str, message: str) -> None:
        self.warnings.append("%s: warning: %s" % (where, message))


def _line(node: Any, key: Any = None) -> Optional[int]:
    lc = getattr(node, "lc", None)
    if lc is None:
        return None
    try:
        if key is None:
            return lc.line + 1
        return (lc.item(key) if isinstance(key, int) else lc.key(key))[0] + 1
    except (KeyError, IndexError, TypeError, AttributeError):
        return lc.line + 1


def suggest(word: str, choices: typing.Iterable[str]) -> str:
    """' (did you mean X?)' for a near miss, else ''."""
    import difflib  # only a mistake needs it

    near = difflib.get_close_matches(str(word), list(choices), n=1, cutoff=0.6)
    return " (did you mean %r?)" % near[0] if near else ""


def _type_name(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if dataclasses.is_dataclass(hint):
        return "a mapping"
    if origin is tuple:
        return "a list of %ss" % _type_name(typing.get_args(hint)[0]).replace("a ", "", 1).replace("an ", "", 1)
    if origin is Union:
        return " or ".join(_type_name(a) for a in typing.get_args(hint) if a is not type(None))
    if origin is dict or hint is dict:
        return "a mapping"
    return {str: "a string", int: "an integer", float: "a number", bool: "true or false"}.get(hint, str(hint))


def _coerce(value: Any, hint: Any, where: str, problems: Problems, key: str) -> Any:
    """`value` as `hint` (str, int, float, bool, Optional, Union, tuple[...], dict, dataclass)."""
    origin = typing.get_origin(hint)
    if origin is Union:
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if dataclasses.is_dataclass(arg) and isinstance(value, dict):  # Optional[section]: its own errors
                return build(arg, value, problems, key)
            trial = Problems(problems.source)
            result = _coerce(value, arg, where, trial, key)
            if not trial.errors:
                return result
    elif dataclasses.is_dataclass(hint):
        if isinstance(value, dict):
            return build(hint, value, problems, key)
    elif origin is tuple:
        if isinstance(value, str):
            value = [value]
        if isinstance(value, list):
            item = typing.get_args(hint)[0]
            return tuple(_coerce(v, item, where, problems, key) for v in value)
    elif origin is dict or hint is dict:
        if isinstance(value, dict):
            return {str(k): v for k, v in value.items()}
    elif hint is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    elif hint is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    elif hint in (str, bool) and isinstance(value, hint):
        return value
    elif hint is Any:
        return value
    problems.error(where, "%s: expected %s, got %s" % (key, _type_name(hint), _shown(value)))
    return None


def _shown(value: Any) -> str:
    """repr of `value`, cut to one short line: an error must not quote a whole list back."""
    text = repr(value)
    return text if len(text) <= 100 else text[:80] + " ... " + text[-15:]


def build(cls: type, node: Any, problems: Problems, where: str, skip: tuple[str, ...] = ()) -> Any:
    """An instance of dataclass `cls` from the mapping `node`; every problem goes to `problems`."""
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init and f.name not in skip}
    hints = typing.get_type_hints(cls)
    values = {}
    public = sorted(n for n in list(fields) + list(skip) if n not in ("source", "root", "warnings"))
    for key, value in node.items():
        if key in skip:
            continue  # valid, and read by the caller
        if key not in public:
            problems.error(problems.at(node, key), "unknown key %r in %s%s; valid keys: %s"
                           % (key, where, suggest(key, public), ", ".join(public)))
            continue
        at = problems.at(node, key)
        before = len(problems.errors)
        coerced = _coerce(value, hints[key], at, problems, key)
        if len(problems.errors) > before:
            continue
        test = fields[key].metadata.get("check")
        if test and coerced is not None and not test[0](coerced):
            problems.error(at, "%s %s (got %r)" % (key, test[1], coerced))
            continue
        if key in SCALAR_MAPPINGS and not _scalars_only(value, key, where, problems):
            continue
        values[key] = coerced
    missing = [n for n, f in fields.items() if n not in values and n in public and n not in skip
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    for name in missing:
        if not any(name in e for e in problems.errors):
            problems.error(problems.at(node), "%s needs the key %r" % (where, name))
    if missing:
        return None
    return cls(**values)


SCALAR_MAPPINGS = ("env",)  # environment variables are text: a trainer's or a backend's env: holds scalars


def _scalars_only(node: dict, key: str, where: str, problems: Problems) -> bool:
    """Whether every value of the mapping `node` is a string, number or true/false (errors at each line)."""
    ok = True
    for name, value in node.items():
        if isinstance(value, (str, int, float)):  # bool is an int
            continue
        ok = False
        kind = ("nothing" if value is None else "a list" if isinstance(value, list)
                else "a mapping" if isinstance(value, dict) else "a tagged value")
        fix = "give a value (\"\" for empty) or remove it" if value is None else "give one string, e.g. \"a b\""
        problems.error(problems.at(node, name), "%s %r in %s: expected a string, number or true/false, got %s "
                       "(environment variables are text): %s" % (key, str(name), where, kind, fix))
    return ok


def _typed_section(node: Any, registry: dict, what: str, problems: Problems, where: str) -> Any:
    """A section whose `type:` picks its dataclass from `registry` (lazy 'module:Class')."""
    if not isinstance(node, dict):
        problems.error(where, "%s must be a mapping with a 'type' key" % what)
        return None
    kind = node.get("type")
    if "type" not in node:
        problems.error(problems.at(node), "%s needs a 'type' key; available: %s" % (what, ", ".join(sorted(registry))))
        return None
    if not isinstance(kind, str) or kind not in registry:  # a list or mapping is no type (nor hashable)
        problems.error(problems.at(node, "type") if "type" in node else problems.at(node),
                       "unknown %s type %s%s; available: %s"
                       % (what, _shown(kind), suggest(kind if isinstance(kind, str) else "", registry),
                          ", ".join(sorted(registry))))
        return None
    cls = load_class(registry[kind] + ":Config")
    section = build(cls, node, problems, "%s (type %s)" % (what, kind))
    for message in section.problems() if section is not None else ():
        problems.error(_key_at(problems, node, message), message)
    for message in getattr(section, "warnings", lambda: [])() if section is not None else ():
        problems.warn(problems.at(node), f"{what}: {message}")
    return section


def _key_at(problems: Problems, node: Any, message: str) -> str:
    """file:line of the key a section's problem starts with ('trainer.command ...', 'host ...'), else the section's."""
    word = message.split(" ", 1)[0].rstrip(":").removeprefix("trainer.")
    return problems.at(node, word) if word in node else problems.at(node)


def load_class(location: str) -> Any:
    """Import 'module:Class' (registries are lazy: an unused backend costs no import)."""
    import importlib

    module, name = location.split(":")
    return getattr(importlib.import_module(module), name)


def load(path: str, backend: Optional[str] = None, files: bool = True) -> Job:
    """Read, check and freeze the job in `path`; `backend` (from the command line) wins over the file's.

    `files=False` skips the checks of the code and data files (`repro` brings its own, by hash).
    """
    document = parse_yaml(path)
    problems = Problems(path)
    trainer, backends = _sections(document, problems)
    job = build(Job, document, problems, "the job", skip=("trainer", "backends"))
    if job is not None and isinstance(document.get("notify"), dict):
        _check_notify(job.notify, document["notify"], problems)
    if job is not None and isinstance(document.get("environment"), dict):
        for message in job.environment.problems(os.path.dirname(os.path.abspath(path))):
            problems.error(_key_at(problems, document["environment"], message.split(".", 1)[-1]), message)
    chosen = backend or (job.backend if job else "") or (next(iter(backends)) if len(backends) == 1 else "")
    if chosen not in backends and backends:
        source = "backend=%s" % chosen if backend else problems.at(document, "backend")
        problems.error(source, "unknown backend %r%s; defined: %s"
                       % (chosen, suggest(chosen, backends), ", ".join(sorted(backends)))
                       if chosen else "several backends are defined: name one with backend: or backend=NAME")
    root = os.path.dirname(os.path.abspath(path))
    if job is not None and files:
        _check_paths(job, root, document, problems)
        if trainer is not None and hasattr(trainer, "check_files"):
            for message in trainer.check_files(root, job.data.paths):
                problems.error(problems.at(document, "trainer"), message)
    if job is None or problems.errors or any(v is None for v in backends.values()) or trainer is None:
        raise ConfigError(problems.errors or ["%s: error: the config is incomplete" % path])
    job = dataclasses.replace(job, trainer=trainer, backends=backends, backend=chosen,
                              source=os.path.abspath(path), root=root)
    _check_sweep(job, document, problems)
    if problems.errors:
        raise ConfigError(problems.errors)
    _warn(job, document, problems)
    return dataclasses.replace(job, warnings=tuple(acknowledged(problems.warnings, job.validation.acknowledge, path)))


def _sections(document: Any, problems: Problems) -> tuple[Any, dict]:
    """The `trainer:` and `backends:` sections, each typed by its own `type:`."""
    from tether.backends import BACKEND_TYPES
    from tether.trainers.registry import TRAINER_TYPES

    where = problems.at(document, "trainer") if "trainer" in document else problems.at(document)
    trainer = _typed_section(document.get("trainer"), TRAINER_TYPES, "trainer", problems, where)
    backends = {}
    raw = document.get("backends") or {}
    if not isinstance(raw, dict) or not raw:
        problems.error(problems.at(document, "backends") if "backends" in document else problems.source,
                       "backends must map a name to a backend, e.g. backends: {local: {type: local}}")
        raw = {}
    for name, node in raw.items():
        backends[str(name)] = _typed_section(node, BACKEND_TYPES, "backend %r" % name, problems,
                                             problems.at(raw, name))
    return trainer, backends


def _check_paths(job: Job, root: str, document: Any, problems: Problems) -> None:
    """Every code and data path exists and stays inside the project folder (errors at their line)."""
    for section in ("code", "data"):
        node = (document.get(section) or {}).get("paths") if isinstance(document.get(section), dict) else None
        for index, path in enumerate(getattr(job, section).paths):
            at = problems.at(node, index) if node is not None else problems.at(document, section)
            if os.path.isabs(path) or ".." in path.replace("\\", "/").split("/"):
                problems.error(at, "path %r leaves the project folder %s: move the config file up, "
                               "or the files in" % (path, root))
            elif not os.path.exists(os.path.join(root, path)):
                problems.error(at, "path %r does not exist (paths are relative to %s)" % (path, root))
    _check_artifacts(job, document, problems)


def _check_artifacts(job: Job, document: Any, problems: Problems) -> None:
    """Every artifact pattern stays in the run dir and names no tether file (the seal's own rule)."""
    from tether.remote.rundir import artifact_problem

    node = document.get("artifacts")
    for index, pattern in enumerate(job.artifacts):
        problem = artifact_problem(pattern)
        if problem:
            at = problems.at(node, index) if hasattr(node, "lc") else problems.at(document, "artifacts")
            problems.error(at, problem)


def _check_notify(notify: Notify, node: Any, problems: Problems) -> None:
    """Kinds exist, the webhook is http(s), and no secret is written in the file (errors at their line)."""
    from tether.remote.notify import HEADER_NAME, source_problem, url_problem

    far = ("put it in a 0600 file on the far side (webhook: {file: ~/.config/hook-url}) "
           "or in a far-side environment variable (webhook: {env: NAME})")
    for index, kind in enumerate(notify.on):
        if kind not in KINDS:
            at = problems.at(node["on"], index) if hasattr(node["on"], "lc") else problems.at(node, "on")
            problems.error(at, "notify.on: unknown kind %r%s; kinds: %s"
                           % (kind, suggest(kind, KINDS), ", ".join(KINDS)))
    if isinstance(notify.webhook, str):
        problem = url_problem(notify.webhook)  # never quoted back: it may be the secret
        fix = far if "secret" in problem else "give https://..., {file: PATH} or {env: NAME}"
        if problem:
            problems.error(problems.at(node, "webhook"), "notify.webhook %s: %s" % (problem, fix))
    elif notify.webhook is not None and source_problem(notify.webhook):
        problems.error(problems.at(node, "webhook"), "notify.webhook %s" % source_problem(notify.webhook))
    for name, source in notify.headers.items():
        at = problems.at(node["headers"], name)
        if not HEADER_NAME.match(name):
            problems.error(at, "notify.headers: %r is not a header name (letters, digits, -)" % name)
        elif not isinstance(source, dict):
            problems.error(at, "notify.headers.%s is written in the file: a header carries a secret, so it comes from "
                               "the far side: %s: {file: ~/.config/hook-auth} (mode 0600, holding the whole value, "
                               "e.g. Bearer ...) or {env: NAME}" % (name, name))
        elif source_problem(source):
            problems.error(at, "notify.headers.%s %s" % (name, source_problem(source)))
    if notify.headers and notify.webhook is None:
        problems.error(problems.at(node, "headers"), "notify.headers without a webhook: add webhook: or remove headers:")


def _check_sweep(job: Job, document: Any, problems: Problems) -> None:
    """The grid's keys suit the trainer, and every point is a valid trainer configuration."""
    from tether import sweep

    if "sweep" not in document:
        return
    at = problems.at(document, "sweep")
    found = sweep.problems(job.sweep, job.trainer) if job.sweep else ["sweep: is empty; give a mapping of "
                                                                      "setting -> list of values, or remove it"]
    for message in found:
        problems.error(at, message)
    seen: dict[str, str] = {}
    for point in sweep.points(job.sweep) if not found else ():
        try:
            trainer = sweep.job_for(job, point).trainer
        except ConfigError as err:
            for message in err.problems:
                problems.error(at, f"point {point.label}: {message}")
            return
        for message in trainer.problems():
            problems.error(at, f"point {point.label}: {message}")
        same = seen.setdefault(repr(trainer), point.label)
        if same != point.label:
            problems.error(at, f"points {same} and {point.label} are the same trainer settings (e.g. 1 and 1.0): "
                               f"list each value once")


def replace_checked(section: Any, values: dict, where: str) -> Any:
    """`section` with `values` replacing its fields, each checked as if the file had said it."""
    problems = Problems(where)
    merged = dict(asdict(section), **values)
    rebuilt = build(type(section), merged, problems, where)
    if problems.errors:
        raise ConfigError([e.split(": error: ", 1)[-1] for e in problems.errors])
    return rebuilt


def _warn(job: Job, document: Any, problems: Problems) -> None:
    """Things that are allowed but usually a mistake."""
    if not job.artifacts:
        problems.warn(problems.at(document), "no artifacts declared: only logs and the latest "
                      "checkpoint come home; list result files under artifacts:")
    if job.heartbeat_timeout_s < 10:
        problems.warn(problems.at(document, "heartbeat_timeout_s"), "heartbeat_timeout_s below 10 s "
                      "can fail healthy runs on a slow far side (the launcher beats every 2 s)")
    if job.stall_timeout_s is not None and job.stall_timeout_s < 10:
        problems.warn(problems.at(document, "stall_timeout_s"), "stall_timeout_s below 10 s declares a "
                      "healthy trainer stalled while it loads data or saves a checkpoint without printing")


def acknowledged(warnings: list[str], acks: tuple[str, ...], source: str) -> list[str]:
    """The warnings no acknowledgement matches, plus a warning for each unusable acknowledgement."""
    left = list(warnings)
    for ack in acks:
        if len(ack) < MIN_ACK_CHARS:
            left.append("%s: warning: acknowledgement %r is shorter than %d characters: quote more "
                        "of the warning" % (source, ack, MIN_ACK_CHARS))
            continue
        matched = [w for w in left if ack in w]
        if not matched:
            left.append("%s: warning: acknowledgement %r matches no warning: remove it" % (source, ack))
        left = [w for w in left if w not in matched]
    return left


def default_path(cwd: str = ".") -> str:
    """tether.yaml in `cwd` if present, else configs/local.yaml."""
    own = os.path.join(cwd, "tether.yaml")
    return own if os.path.exists(own) else os.path.join(cwd, "configs", "local.yaml")


def changed_fields(obj: Any) -> dict:
    """A section's fields that differ from their defaults, as plain data: what makes a run's identity,
    so a key that a later tether adds (at its default) never gives finished runs new ids."""
    changed = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if required or f.name == "type" or value != default:  # a section's type: always who it is
            changed[f.name] = asdict(value)
    return changed


def asdict(obj: Any) -> Any:
    """A dataclass (nested, with tuples) as plain JSON-able data."""
    if dataclasses.is_dataclass(obj):
        return {f.name: asdict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [asdict(v) for v in obj]
    if isinstance(obj, dict):
        return {str(k): asdict(v) for k, v in obj.items()}
    return obj
