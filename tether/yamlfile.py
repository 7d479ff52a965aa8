"""Reading a config file safely: size, encoding, nesting and alias expansion capped, positions kept.

Every way a file can be unfit (a directory, not UTF-8, huge, nested or aliased without end, not
YAML) ends as one ConfigError naming the file, the line where it can, and the fix.
"""

from __future__ import annotations

import os
from typing import Any

from tether.errors import ConfigError

# A config is a few KB. ruamel's round-trip loader needs about 2.5 s and 16 MB per MiB (a 50 MB
# file took 122 s and 790 MB), so a file far above any config is refused before it is parsed.
MAX_CONFIG_BYTES = 1 << 20
# Aliases make a small file big once walked (billion laughs: 30 lines reach 10**9 values), and
# every check below walks it: bound what the document reaches, with aliases counted each time.
MAX_VALUES = 100_000
MAX_TEXT_CHARS = 10 << 20
MAX_FLOW_DEPTH = 64  # a config nests a few levels; ruamel takes seconds on 1000 levels of [, then crashes


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


def parse_yaml(path: str) -> Any:
    """The YAML document in `path`, with line numbers kept."""
    from ruamel.yaml import YAML
    from ruamel.yaml.error import YAMLError
    from ruamel.yaml.reader import ReaderError

    text = read_text(path)
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
