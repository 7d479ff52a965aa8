"""Reading a config file safely: size, encoding, nesting and alias expansion capped, positions kept.

Every way a file can be unfit (a directory, not UTF-8, huge, nested or aliased without end, not
YAML) ends as one ConfigError naming the file, the line where it can, and the fix. A parse can be
kept (`cache_parses`): the same text is then read back from JSON, positions included, without ruamel.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Optional

from tether.errors import ConfigError

# A config is a few KB. ruamel's round-trip loader needs about 2.5 s and 16 MB per MiB (a 50 MB
# file took 122 s and 790 MB), so a file far above any config is refused before it is parsed.
MAX_CONFIG_BYTES = 1 << 20
# Aliases make a small file big once walked (billion laughs: 30 lines reach 10**9 values), and
# every check below walks it: bound what the document reaches, with aliases counted each time.
MAX_VALUES = 100_000
MAX_TEXT_CHARS = 10 << 20
MAX_FLOW_DEPTH = 64  # a config nests a few levels; ruamel takes seconds on 1000 levels of [, then crashes
# Importing ruamel and its round-trip load take about 20 ms, a fifth of what tether adds to a no-op
# `doit run train`; a kept parse reads back in well under 1 ms. A few configs per project (one per
# file and edit in use); texts above a config's usual few KB are parsed each time.
CACHE_ENTRIES = 8
CACHE_MAX_CHARS = 64 << 10
CACHE_FORMAT = 1

_cache_file: Optional[str] = None


def cache_parses(path: Optional[str]) -> None:
    """Keep parsed documents in the JSON file `path` from now on (None: parse every time, the default)."""
    global _cache_file
    _cache_file = path


def read_text(path: str) -> str:
    """The config file's text: a readable, not too big, UTF-8 file, else one ConfigError naming the fix."""
    if os.path.isdir(path):
        raise ConfigError("%s: error: is a directory: pass config=PATH to a YAML file" % path)
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)  # read no more than the cap: config=/dev/zero ends too
    except FileNotFoundError:
        raise ConfigError("%s: no such config file: pass config=PATH or create tether.yaml" % path)
    except OSError as err:
        raise ConfigError("%s: error: cannot read the config (%s): pass config=PATH to a file you can read"
                          % (path, err.strerror or err))
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError("%s: error: larger than %d KiB, far more than a config needs: is config= the "
                          "right file? (list data files under data: paths:, do not paste them)"
                          % (path, MAX_CONFIG_BYTES >> 10))
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise ConfigError("%s:%d: error: not UTF-8 (byte 0x%02x at offset %d): save the file as UTF-8"
                          % (path, line, data[err.start], err.start))


def parse_yaml(path: str, cached: bool = True) -> Any:
    """The YAML document in `path`, with line numbers kept; from the kept parses when `cached` and
    one of this exact text is there (mappings and lists are then CachedMap and CachedList)."""
    text = read_text(path)
    key = hashlib.sha256(text.encode()).hexdigest()
    if not (cached and _cache_file and len(text) <= CACHE_MAX_CHARS):
        return _parse(text, path)
    kept = _read_cache(_cache_file)
    if key in kept["documents"]:
        try:
            return _rebuilt(kept["documents"][key])
        except (KeyError, TypeError, ValueError, AttributeError):
            pass  # a damaged entry: parse again, and keep the new parse instead
    document = _parse(text, path)
    _keep(_cache_file, kept, key, document)
    return document


def _parse(text: str, path: str) -> Any:
    """ruamel's round-trip document of `text`, after and before the checks that bound its cost."""
    from ruamel.yaml import YAML
    from ruamel.yaml.error import YAMLError
    from ruamel.yaml.reader import ReaderError

    _check_flow_depth(text, path)
    try:
        document = YAML(typ="rt").load(text)
    except ReaderError as err:  # a control character: its position is a character offset into `text`
        line = text.count("\n", 0, err.position) + 1
        raise ConfigError("%s:%d: error: not valid YAML: character %r is not allowed: remove it"
                          % (path, line, chr(err.character) if isinstance(err.character, int) else err.character))
    except YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        line = ":%d" % (mark.line + 1) if mark else ""
        raise ConfigError("%s%s: error: not valid YAML: %s" % (path, line, getattr(err, "problem", err)))
    except RecursionError:  # ruamel's composer recurses once per level (here: indented blocks)
        raise ConfigError("%s: error: not a config: nested hundreds of levels deep: flatten it" % path)
    except ValueError as err:  # e.g. an integer of more than 4300 digits
        raise ConfigError("%s: error: not valid YAML: %s: shorten that value" % (path, str(err).split(";")[0]))
    if not isinstance(document, dict):
        raise ConfigError("%s: error: the file must be a YAML mapping (name:, trainer:, backends:, ...)" % path)
    _check_expansion(document, path)
    return document


def _check_flow_depth(text: str, path: str) -> None:
    """Refuse [ and { nested more than MAX_FLOW_DEPTH deep, before ruamel sees them: its scanner
    rechecks every open level at every token (1000 levels on one line: 6 s), then recurses."""
    if text.count("[") + text.count("{") <= MAX_FLOW_DEPTH:
        return  # every real config: nothing to scan
    depth, structural, index = 0, True, 0
    while index < len(text):
        char = text[index]
        if char in "[{" and structural:  # a collection starts only where a value may start
            depth += 1
            if depth > MAX_FLOW_DEPTH:
                raise ConfigError("%s:%d: error: not a config: [ and { nested more than %d deep: flatten it"
                                  % (path, text.count("\n", 0, index) + 1, MAX_FLOW_DEPTH))
        elif char in "]}":
            depth, structural = max(depth - 1, 0), False
        elif char in "&!" and structural:  # an anchor or tag before a collection: skip its name
            while index + 1 < len(text) and not text[index + 1].isspace() and text[index + 1] not in "[{":
                index += 1
        elif char in "\n:,-?":
            structural = True
        elif not char.isspace():
            structural = False  # inside a scalar ('a[0]', "[[["), a [ is text
        index += 1


def _check_expansion(document: dict, path: str) -> None:
    """Refuse a document that reaches more than MAX_VALUES values or MAX_TEXT_CHARS characters."""
    values = chars = 0
    for key in document:
        stack = [key, document[key]]
        while stack:
            node = stack.pop()
            values += 1
            if isinstance(node, dict):
                stack.extend(node.keys())
                stack.extend(node.values())
            elif isinstance(node, list):
                stack.extend(node)
            elif isinstance(node, str):
                chars += len(node)
            if values > MAX_VALUES or chars > MAX_TEXT_CHARS:
                what = "%d values" % MAX_VALUES if values > MAX_VALUES else "%d MiB of text" % (MAX_TEXT_CHARS >> 20)
                raise ConfigError("%s: error: the config expands to more than %s (YAML aliases?): an alias "
                                  "(*name) repeats all its anchor (&name) holds; alias less, or write "
                                  "the values out" % (_key_at(document, key, path), what))


def _key_at(document: Any, key: Any, path: str) -> str:
    """`path:line` of a top-level key (ruamel keeps positions), else the path."""
    try:
        return "%s:%d" % (path, document.lc.key(key)[0] + 1)
    except (AttributeError, KeyError, TypeError):
        return path


# ------------------------------------------------------------------ kept parses


class Lines:
    """ruamel's positions of one mapping or list (its `lc`), as ruamel's LineCol answers them."""

    def __init__(self, line: Optional[int], col: Optional[int], data: Optional[list]) -> None:
        self.line, self.col = line, col
        self.data = None if data is None else {key: where for key, where in data}

    def key(self, key: Any) -> Any:
        return self._kv(key, 0, 1)

    def value(self, key: Any) -> Any:
        return self._kv(key, 2, 3)

    def item(self, index: Any) -> Any:
        return self._kv(index, 0, 1)

    def _kv(self, key: Any, first: int, second: int) -> Any:
        if self.data is None:
            return None
        where = self.data[key]
        return where[first], where[second]


class CachedMap(dict):
    """A mapping read back from a kept parse, with its positions as `lc`."""

    lc: Lines


class CachedList(list):
    """A list read back from a kept parse, with its positions as `lc`."""

    lc: Lines


class _NotPlain(Exception):
    """The document holds something JSON would not give back as the same value."""


def _plain(node: Any) -> Any:
    """`node` as JSON data, positions included; _NotPlain at anything else than untagged mappings and
    lists, and strings, plain integers, floats, booleans and nulls (a date, a hex or anchored number,
    a block string: such a file is parsed each time)."""
    from ruamel.yaml.comments import CommentedMap, CommentedSeq
    from ruamel.yaml.scalarfloat import ScalarFloat

    def scalar(value: Any) -> Any:
        if type(value) in (str, int, bool, float, type(None)):
            return value
        if type(value) is ScalarFloat:  # a float that remembers its formatting: the same value
            return float(value)
        raise _NotPlain(type(value).__name__)

    def walk(value: Any) -> Any:
        if type(value) not in (CommentedMap, CommentedSeq):
            return scalar(value)
        if getattr(getattr(value, "tag", None), "value", None) is not None:
            raise _NotPlain("tagged")
        lc = value.lc
        data = None if lc.data is None else [[scalar(k), list(where)] for k, where in lc.data.items()]
        lines = [lc.line, lc.col, data]
        if type(value) is CommentedMap:
            return {"map": [[scalar(k), walk(v)] for k, v in value.items()], "lc": lines}
        return {"list": [walk(v) for v in value], "lc": lines}

    return walk(node)


def _rebuilt(data: Any) -> Any:
    """A kept document back as CachedMap, CachedList and scalars."""
    if not isinstance(data, dict):
        return data
    if "map" in data:
        node: Any = CachedMap((key, _rebuilt(value)) for key, value in data["map"])
    else:
        node = CachedList(_rebuilt(value) for value in data["list"])
    node.lc = Lines(*data["lc"])
    return node


def _parser_stamp() -> list:
    """Size and mtime of this module and of ruamel's: a new parser (or new checks) starts a new cache."""
    import importlib.util

    spec = importlib.util.find_spec("ruamel.yaml")
    files = [os.path.abspath(__file__), spec.origin if spec and spec.origin else ""]
    return [CACHE_FORMAT] + [[f, st.st_size, st.st_mtime_ns] for f in files for st in [os.stat(f)]]


def _read_cache(path: str) -> dict:
    """The kept parses in `path` made by this parser, else none (a missing, damaged or older file)."""
    try:
        stamp = _parser_stamp()
    except (ImportError, OSError, ValueError):
        return {"stamp": None, "documents": {}}
    try:
        with open(path, "rb") as f:
            kept = json.loads(f.read())
        if kept["stamp"] == stamp and isinstance(kept["documents"], list):
            return {"stamp": stamp, "documents": dict(kept["documents"])}
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return {"stamp": stamp, "documents": {}}


def _keep(path: str, kept: dict, key: str, document: Any) -> None:
    """Add `document` to the kept parses (the oldest leave past CACHE_ENTRIES); never fails a load."""
    from tether.remote.fileio import atomic_write_bytes

    if kept["stamp"] is None:
        return
    try:
        kept["documents"].pop(key, None)  # a damaged entry, parsed again: now the newest
        kept["documents"][key] = _plain(document)
    except _NotPlain:
        return
    documents = list(kept["documents"].items())[-CACHE_ENTRIES:]
    try:
        atomic_write_bytes(path, json.dumps({"stamp": kept["stamp"], "documents": documents},
                                            separators=(",", ":")).encode())
    except OSError:
        pass  # a read-only folder: every load parses
