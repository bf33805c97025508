"""The YAML loader of every OpenTinker config file (task configs and ``scheduler_config.yaml``)."""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass
from typing import Any, Iterator

import yaml

__all__ = ["Typography", "Yaml12Loader", "every_typography", "find_typography", "tag_name", "yaml11_bool_hint"]

_BOOL_TAG = "tag:yaml.org,2002:bool"
#: The booleans of the YAML 1.2 core schema, and the words YAML 1.1 also read as booleans.
_CORE_BOOLS = {"true": True, "True": True, "TRUE": True, "false": False, "False": False, "FALSE": False}
_YAML11_BOOLS = {"yes": True, "y": True, "on": True, "no": False, "n": False, "off": False}


class Yaml12Loader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that reads floats and booleans as YAML 1.2's core schema does.

    PyYAML follows YAML 1.1, where a float needs a dot and a signed exponent, so ``1e-4``,
    ``5E+3``, ``1e4``, ``-.5`` and ``1.5e3`` come back as strings. This loader adds the YAML 1.2
    core-schema forms (a dot or an exponent is still required: ``1`` stays an int and ``09`` a
    string).

    Booleans are only ``true``/``True``/``TRUE`` and ``false``/``False``/``FALSE``: YAML 1.1's
    ``yes``/``no``/``on``/``off`` (any case) stay strings, and an explicit ``!!bool`` tag takes
    only the core forms (anything else is a ``yaml.constructor.ConstructorError`` at the
    value's mark). Where a config key wants a bool, :func:`yaml11_bool_hint` words the refusal
    of such a string.

    Use it wherever PyYAML's ``Loader=`` goes (``yaml.compose``, ``yaml.load``); nodes keep their
    marks, so line and column numbers work as with ``SafeLoader``. Shared by the task configs and
    the scheduler config. ``yaml.SafeLoader`` itself is not changed.
    """

    def construct_yaml_bool(self, node: yaml.ScalarNode) -> bool:
        value = self.construct_scalar(node)
        if value not in _CORE_BOOLS:
            raise yaml.constructor.ConstructorError(
                None, None, f"expected true or false for !!bool, got {value!r}", node.start_mark
            )
        return _CORE_BOOLS[value]


def yaml11_bool_hint(value: Any) -> str | None:
    """The hint for a string that YAML 1.1 would have read as a boolean, else ``None``.

    Args:
        value: a loaded value (any type).

    Returns:
        e.g. ``"'no' is a string in YAML 1.2 — write false"`` for ``yes``/``no``/``on``/``off``/
        ``y``/``n`` in any case; ``None`` for anything else (other strings, booleans, numbers).
    """
    if not isinstance(value, str) or value.lower() not in _YAML11_BOOLS:
        return None
    return f"{value!r} is a string in YAML 1.2 — write {'true' if _YAML11_BOOLS[value.lower()] else 'false'}"


# PyYAML's (YAML 1.1) bool resolver is left out; the subclass gets its own copy of the table.
Yaml12Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != _BOOL_TAG]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
Yaml12Loader.add_implicit_resolver(_BOOL_TAG, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
Yaml12Loader.add_constructor(_BOOL_TAG, Yaml12Loader.construct_yaml_bool)
Yaml12Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^[-+]?(?:[0-9]+(?:\.[0-9]*)?[eE][-+]?[0-9]+
               |\.[0-9]+(?:[eE][-+]?[0-9]+)?
               |[0-9]+\.[0-9]*)$""",
        re.X,
    ),
    list("-+0123456789."),
)


# ------------------------------------------------------------------------------------------------
# Characters a word processor or a web page puts where YAML wants plain ASCII (the deployment
# guide's own config has them): typographic quotes, bullets for list items, full-width colons
# and commas, non-breaking and ideographic spaces. YAML either reads them as text silently
# (``node_id: “gpu-node-01”`` is the id with the quotes) or fails far from them
# (``mapping values are not allowed here``), naming neither character.

#: Typographic quote -> the ASCII quote to type instead.
_QUOTES = {
    "\u201c": '"', "\u201d": '"', "\u201e": '"', "\u201f": '"', "\u2033": '"', "\u00ab": '"', "\u00bb": '"',
    "\uff02": '"', "\u2018": "'", "\u2019": "'", "\u201a": "'", "\u201b": "'", "\u2032": "'", "\uff07": "'",
}  # fmt: skip
#: Bullets, refused anywhere outside quotes and comments.
_BULLETS = set("\u2022\u2023\u25e6\u2043\u2219\u25cf\u25aa\u25a0\u30fb")
#: Dashes and dots that are bullets only where a line's content starts.
_LEADING_BULLETS = set("\u00b7\u2013\u2014\u2212")
#: Other look-alikes -> what to type instead.
_LOOKALIKES = {
    "\uff1a": ('":" (an ASCII colon, then a space)', "full-width colon"),
    "\uff0c": ('"," (an ASCII comma)', "full-width comma"),
    "\u00a0": ("an ordinary space", "no-break space"),
    "\u3000": ("an ordinary space", "ideographic space"),
}
_BLOCK_SCALAR = re.compile(r"(?:^|[\s:\-?])[|>][0-9+\-]*\s*$")


@dataclass(frozen=True)
class Typography:
    """A typographic character where YAML wants ASCII: 1-based ``line`` and ``column``, the
    character, and ``message`` (what it is and what to type instead)."""

    line: int
    column: int
    char: str
    message: str


def _describe(ch: str) -> str:
    return f"{ch!r} (U+{ord(ch):04X} {unicodedata.name(ch, 'character').lower()})"


def find_typography(text: str) -> Typography | None:
    """The first of :func:`every_typography` in ``text``, else ``None``."""
    return next(_typography(text), None)


def every_typography(text: str) -> list[Typography]:
    """The typographic quotes, bullets and look-alike characters in YAML ``text`` outside
    comments, block scalars and ASCII-quoted strings (where it is text the writer chose): the
    first on each line, in order (a pair of curly quotes is one problem), so a document pasted
    from a word processor is mended in one go.

    Refused (with what to type instead): typographic quotes (``“ ” ‘ ’ „ « »`` ...: a straight
    ``"`` or ``'``, or no quotes), bullets (``• ◦ ▪ ●`` ... anywhere; ``· – —`` where a line's
    content starts: ``- `` for a list item), full-width ``：`` and ``，``, and no-break or
    ideographic spaces.
    """
    out: list[Typography] = []
    for typo in _typography(text):
        if not out or out[-1].line != typo.line:
            out.append(typo)
    return out


def _typography(text: str) -> Iterator[Typography]:
    lines = text.splitlines()
    quote = ""  # the open ASCII quote, if any (strings may span lines)
    block_indent = -1  # >= 0: inside a block scalar opened on a line with this indentation
    for n, line in enumerate(lines, start=1):
        stripped = line.lstrip(" ")
        indent = len(line) - len(stripped)
        if block_indent >= 0:
            if not stripped.strip() or indent > block_indent:
                continue
            block_indent = -1
        i, content_start, before = 0, True, ""  # before: the last non-space character outside quotes
        code_end = len(line)
        while i < len(line):
            ch = line[i]
            if quote:
                if quote == '"' and ch == "\\":
                    i += 2
                    continue
                if ch == quote:
                    if quote == "'" and line[i + 1 : i + 2] == "'":
                        i += 2
                        continue
                    quote = ""
                    before = ch
                i += 1
                continue
            if ch == "#" and (i == 0 or line[i - 1] in " \t"):
                code_end = i
                break
            if ch in "\"'" and before in ("", ":", "-", "[", "{", ",", "?"):
                quote = ch
                i += 1
                continue
            problem = None
            if ch in _QUOTES:
                problem = (
                    f"{_describe(ch)} is a typographic quote, which YAML keeps as part of the value; "
                    f"expected a straight {_QUOTES[ch]} or no quotes"
                )
            elif ch in _BULLETS or (ch in _LEADING_BULLETS and content_start):
                problem = f'{_describe(ch)} is not a YAML list marker; expected "- " (a hyphen, then a space)'
            elif ch in _LOOKALIKES:
                instead, what = _LOOKALIKES[ch]
                problem = f"{_describe(ch)} is a {what}, which YAML does not read as one; expected {instead}"
            if problem:
                yield Typography(n, i + 1, ch, problem)
            if ch not in " \t":
                # "- " opens a list item: what follows starts content again
                content_start = ch == "-" and content_start and line[i + 1 : i + 2] in ("", " ")
                before = ch
            i += 1
        if not quote and _BLOCK_SCALAR.search(line[:code_end].rstrip()):
            block_indent = indent


def tag_name(tag: str) -> str:
    """A YAML tag as it is written: ``tag:yaml.org,2002:int`` -> ``!!int``; others unchanged."""
    return "!!" + tag.removeprefix("tag:yaml.org,2002:") if tag.startswith("tag:yaml.org,2002:") else tag
