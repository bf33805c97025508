"""Strict mapping -> frozen dataclass conversion with field paths in every error.

Field metadata understood (set with :func:`num` or ``dataclasses.field(metadata=...)``):
``min``, ``max``, ``min_exclusive`` for numbers; ``choices``, ``max_len`` and ``multiline`` for strings
(every string is refused with control characters in it; ``multiline`` ones may hold newlines and tabs);
``doc`` for people. Lists are tuples of at most 256 items.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import re
import types
import typing
import unicodedata
from dataclasses import field, fields, is_dataclass
from typing import Any, Mapping

__all__ = [
    "SpecError",
    "check_text",
    "control_character_problem",
    "did_you_mean",
    "did_you_mean_each",
    "is_control_character",
    "num",
    "parse_dataclass",
    "jsonable",
    "plain",
    "quoted_value_hint",
    "raise_if_any",
    "short_repr",
    "name_list",
]


class SpecError(ValueError):
    """A spec field is missing, of the wrong type or out of range.

    Attributes:
        field: dotted path of the offending field, e.g. ``spec.hyperparameters.steps``.
        expected: what a valid value looks like, for a person to read.
        hint: a suggestion after it (``"did you mean 'steps'?"``, :func:`did_you_mean`), or ``""``;
            the message ends ``; <hint>``, outside the cap on ``expected`` so a long key list never
            cuts it off.
        detail: this refusal's own message (``field: expected ...``), without the others.
        also: the other refusals found in the same check, in the order found (``()``: none).
            A spec is checked whole: every field of a mapping, and the independent parts of a task
            (resources, limits, ``env_config``, ``hyperparameters``, ``tracking``), so one pass names
            every bad field; checks that combine fields run only once each of them is valid.
            ``str(err)`` is :attr:`detail`, then ``(and N more: <their fields>)`` when there are others.
    """

    also: tuple["SpecError", ...] = ()

    def __init__(self, field: str, expected: str, got: Any = dataclasses.MISSING, *, hint: str = "") -> None:
        # Every part is capped (the path holds user-chosen keys; ``got`` is the user's value), so
        # no message passes ~1 KB: it travels as gRPC status details, and a 20 KB one exceeded
        # the metadata limit (the client saw RESOURCE_EXHAUSTED instead of INVALID_ARGUMENT).
        self.field = _cut(field, MAX_FIELD_CHARS)
        self.expected = _cut(expected, MAX_EXPECTED_CHARS)
        detail = f"{self.field}: expected {self.expected}"
        if got is not dataclasses.MISSING:
            detail += f", got {short_repr(got)}"
            hint = hint or quoted_value_hint(expected, got)
        self.hint = _cut(hint, MAX_HINT_CHARS)
        if self.hint:
            detail += f"; {self.hint}"
        self.detail = detail
        super().__init__(detail)

    @property
    def problems(self) -> tuple["SpecError", ...]:
        """This refusal and :attr:`also`: every refusal of the check, the first first."""
        return (self, *self.also)

    @classmethod
    def combine(cls, errors: "list[SpecError]") -> "SpecError":
        """One error for several (each flattened to its :attr:`problems`): the first, with the
        rest as its :attr:`also` and named after its message (at most :data:`MAX_NAMED_OTHERS`
        field paths, so the message stays under ~1.5 KB). ``errors`` must not be empty."""
        flat: list[SpecError] = []
        for err in errors:
            for problem in err.problems:
                if problem not in flat:
                    flat.append(problem)
        first = flat[0]
        rest = tuple(p.without_others() if p.also else p for p in flat[1:])
        out = first.without_others() if first.also else first
        if rest:
            out = out._clone()
            out.also = rest
            names = ", ".join(_cut(p.field, 80) for p in rest[:MAX_NAMED_OTHERS])
            more = f", ... {len(rest) - MAX_NAMED_OTHERS} more" if len(rest) > MAX_NAMED_OTHERS else ""
            out.args = (f"{out.detail} (and {len(rest)} more: {names}{more})",)
        return out

    def without_others(self) -> "SpecError":
        """A copy of this refusal alone (no :attr:`also`)."""
        out = self._clone()
        out.also = ()
        out.args = (self.detail,)
        return out

    def _clone(self) -> "SpecError":
        # copy.copy would call type(self)(*args), which is not this constructor's signature
        out = type(self).__new__(type(self))
        out.__dict__.update(self.__dict__)
        out.args = self.args
        return out


def raise_if_any(errors: "list[SpecError]") -> None:
    """Raise :meth:`SpecError.combine` of ``errors`` when there are any.

    Raises:
        SpecError: the first of ``errors``, the others as its ``also``.
    """
    if errors:
        raise SpecError.combine(errors) from None


#: Caps on the parts of a :class:`SpecError` message, in characters (together well under 1 KB).
MAX_FIELD_CHARS = 200
MAX_EXPECTED_CHARS = 600
MAX_GOT_CHARS = 100
MAX_HINT_CHARS = 100
#: Most field paths of the other refusals named in a :class:`SpecError`'s message.
MAX_NAMED_OTHERS = 8


_NUMBER = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?")
_BOOLEAN = {"true", "false", "yes", "no", "on", "off"}


def quoted_value_hint(expected: str, got: Any) -> str:
    """``"that is text (a quoted value): write 5, without quotes"`` when a number or true/false
    was expected and ``got`` is a string that spells one (``steps: "5"`` in YAML, or a JSON
    ``"5"``), else ``""``."""
    if not isinstance(got, str):
        return ""
    text = got.strip()
    wants_number = expected.startswith(("an integer", "a number", "a float", "a positive"))
    wants_bool = expected.startswith("true or false")
    if (wants_number and _NUMBER.fullmatch(text)) or (wants_bool and text.lower() in _BOOLEAN):
        return f"that is text (a quoted value): write {_cut(text.lower() if wants_bool else text, 40)}, without quotes"
    return ""


def did_you_mean(word: Any, choices: Any, aliases: Mapping[str, str] | None = None) -> str:
    """``"did you mean 'steps'?"`` for an unknown key ``word`` (``"did you mean 'lr' or 'lora_rank'?"``
    for two or three close ones), or ``""`` when no choice is close.

    Close means :func:`difflib.get_close_matches` at its default cutoff (0.6, a similarity ratio
    in [0, 1]), at most 3, best first; ``choices`` are any names (keys of a mapping, a list).
    ``aliases`` maps other words people write for a choice to it (``{"environment": "env"}``):
    a word close to an alias suggests its choice.
    """
    if not isinstance(word, str) or not word:
        return ""
    aliases = dict(aliases or {})
    names = [str(c) for c in choices]
    close = []
    for match in difflib.get_close_matches(word[:100], names + list(aliases), n=3):
        name = aliases.get(match, match)
        if name not in close:
            close.append(name)
    if not close:
        return ""
    quoted = [repr(_cut(c, 40)) for c in close]
    names = quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"
    return f"did you mean {names}?"


def did_you_mean_each(words: Any, choices: Any) -> str:
    """:func:`did_you_mean` for several unknown keys: for one, its answer; for more, the closest
    choice of each that has one (``"did you mean 'lora_rank' for 'lora_rnk', 'steps' for 'stesp'?"``),
    or ``""``."""
    words = [w for w in words if isinstance(w, str)]
    if len(words) == 1:
        return did_you_mean(words[0], choices)
    names = [str(c) for c in choices]
    pairs = []
    for word in words[:3]:
        close = difflib.get_close_matches(word[:100], names, n=1)
        if close:
            pairs.append(f"{_cut(close[0], 40)!r} for {_cut(word, 40)!r}")
    return f"did you mean {', '.join(pairs)}?" if pairs else ""


def _cut(text: str, limit: int) -> str:
    text = str(text)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def short_repr(value: Any, limit: int = MAX_GOT_CHARS) -> str:
    """``repr(value)`` cut to ``limit`` characters (ending in ``...`` when cut), for messages.

    A huge container is not rendered in full first: lists/tuples/sets/mappings longer than
    ``limit`` items are shortened before ``repr``. A boolean reads ``true``/``false``, as a task
    file, JSON and protobuf spell it (a YAML user never wrote ``True``).
    """
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple, set, frozenset)) and len(value) > limit:
        value = list(value)[:limit]
    elif isinstance(value, Mapping) and len(value) > limit:
        value = dict(list(value.items())[:limit])
    elif isinstance(value, str) and len(value) > limit:
        value = value[:limit]
    return _cut(repr(value), limit)


def name_list(names: Any, limit: int = 10, each: int = 40) -> str:
    """``"a, b, c"``: the first ``limit`` names (each cut to ``each`` characters), then
    ``"and N more"``, for messages naming user-chosen keys."""
    names = [_cut(str(n), each) for n in names]
    text = ", ".join(names[:limit])
    return text if len(names) <= limit else f"{text} and {len(names) - limit} more"


# ---------------------------------------------------------------------------------------------
# Control characters in text.

#: Unicode characters that are not controls (category Cc) but change what a terminal shows:
#: bidirectional embeddings, overrides and isolates (they reorder text), line and paragraph separators.
_INVISIBLE_FORMATTING = frozenset("\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069\u2028\u2029")
_CONTROL_NAMES = {"\x1b": "ESC", "\x07": "BEL", "\x00": "NUL", "\n": "newline", "\r": "carriage return",
                  "\t": "tab", "\x08": "backspace", "\x7f": "DEL"}  # fmt: skip
#: What multi-line text (a system prompt, a PEM) may hold besides printable characters.
_MULTILINE_ALLOWED = frozenset("\n\r\t")
#: Every character :func:`is_control_character` is true for, as one regular expression: category
#: Cc is exactly U+0000..U+001F and U+007F..U+009F (Unicode never changes it), then
#: :data:`_INVISIBLE_FORMATTING`. Searching a string with it is one C call instead of a Python
#: step and a category look-up per character (names and models are checked on every submit);
#: ``tests/common/spec/test_control_characters.py`` checks it against every code point.
_CONTROL_RE = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069\u2028\u2029]")
#: The same without :data:`_MULTILINE_ALLOWED` (tab U+0009, newline U+000A, carriage return U+000D).
_CONTROL_RE_MULTILINE = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069\u2028\u2029]")


def is_control_character(c: str) -> bool:
    """True for one character a terminal acts on rather than shows (see :func:`control_character_problem`)."""
    return c in _INVISIBLE_FORMATTING or unicodedata.category(c) == "Cc"


def control_character_problem(text: str, *, multiline: bool = False) -> str | None:
    """None when ``text`` holds no control characters, else what the first one is and where
    (``"U+001B (ESC) at character 0"``).

    Refused: C0 controls (U+0000..U+001F, newline and tab included unless ``multiline``), DEL,
    C1 controls (U+0080..U+009F) and the bidirectional overrides/isolates and line separators
    (U+202A..U+202E, U+2066..U+2069, U+2028, U+2029): a terminal acts on them (ESC sequences
    retitle windows and recolour text; a newline forges a table row), so names and free text a
    person will read must not carry them.
    """
    found = (_CONTROL_RE_MULTILINE if multiline else _CONTROL_RE).search(text)
    if found is None:
        return None
    i, c = found.start(), found.group()
    name = _CONTROL_NAMES.get(c) or unicodedata.name(c, "a control character")
    return f"U+{ord(c):04X} ({name}) at character {i}"


def check_text(path: str, text: str, *, multiline: bool = False) -> None:
    """Refuse control characters in ``text`` (:func:`control_character_problem`).

    Raises:
        SpecError: ``<path>: expected text without control characters (...), got U+001B (ESC) at character 0``.
    """
    problem = control_character_problem(text, multiline=multiline)
    if problem is not None:
        kind = (
            "text without control characters (newlines and tabs allowed)"
            if multiline
            else ("text on one line without control characters")
        )
        raise SpecError(path, f"{kind}, got {problem}")


# ---------------------------------------------------------------------------------------------
# Generic, strict dict -> frozen dataclass conversion.


def _bounds(f: dataclasses.Field) -> tuple[float | None, float | None, bool]:
    meta = f.metadata
    return meta.get("min"), meta.get("max"), meta.get("min_exclusive", False)


def _check_number(value: Any, f: dataclasses.Field, path: str, kind: type) -> int | float:
    lo, hi, lo_excl = _bounds(f)
    desc = "an integer" if kind is int else "a number"
    if lo is not None and hi is not None:
        desc += f" in {'(' if lo_excl else '['}{lo}, {hi}]"
    elif lo is not None:
        desc += f" {'>' if lo_excl else '>='} {lo}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SpecError(path, desc, value)
    if isinstance(value, float) and not math.isfinite(value):
        raise SpecError(path, desc, value)
    if kind is int:
        if isinstance(value, float):
            if not value.is_integer():
                raise SpecError(path, desc, value)
            value = int(value)  # protobuf Struct carries every number as a double
    else:
        value = float(value)
    if lo is not None and (value < lo or (lo_excl and value == lo)):
        raise SpecError(path, desc, value)
    if hi is not None and value > hi:
        raise SpecError(path, desc, value)
    return value


def _convert(value: Any, tp: Any, f: dataclasses.Field, path: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _convert(value, args[0], f, path)
    if tp is bool:
        if not isinstance(value, bool):
            raise SpecError(path, "true or false", value)
        return value
    if tp is int or tp is float:
        return _check_number(value, f, path, tp)
    if tp is str:
        if not isinstance(value, str):
            raise SpecError(path, "a string", value)
        choices = f.metadata.get("choices")
        if choices is not None and value not in choices:
            raise SpecError(path, f"one of {', '.join(choices)}", value)
        max_len = f.metadata.get("max_len", 4096)
        if len(value) > max_len:
            # Only the length is echoed: a prefix could be a secret (an endpoint's user:password@).
            raise SpecError(path, f"a string of at most {max_len} characters", f"a string of {len(value)} characters")
        check_text(path, value, multiline=f.metadata.get("multiline", False))
        return value
    if origin is tuple:
        (item_tp, _) = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise SpecError(path, "a list", value)
        if len(value) > 256:
            raise SpecError(path, "a list of at most 256 items", f"{len(value)} items")
        return tuple(_convert(v, item_tp, f, f"{path}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        # Keyword options passed through to a library (e.g. gymnasium.make(id, **kwargs)):
        # string keys; scalar values, or (with metadata ``nested_depth`` > 0) JSON-like lists and
        # mappings nested at most that deep, so nothing executable travels.
        if not isinstance(value, Mapping):
            raise SpecError(path, "a mapping of option names to numbers, strings or booleans", value)
        if len(value) > 64:
            raise SpecError(path, "at most 64 options", f"{len(value)} options")
        nested_depth = f.metadata.get("nested_depth", 0)
        out = {}
        for k, v in value.items():
            where = f"{path}.{_cut(k, 60)}"
            if not isinstance(k, str) or not k.isidentifier():
                raise SpecError(where, "an option name (a Python identifier)", k)
            if nested_depth:
                out[k] = _plain(v, where, 1, nested_depth)
                continue
            if isinstance(v, float) and v.is_integer() and not isinstance(v, bool):
                v = int(v)  # protobuf Struct carries every number as a double
            if isinstance(v, float) and not math.isfinite(v):
                raise SpecError(where, "a finite number", v)
            if not isinstance(v, (bool, int, float, str)) or (isinstance(v, str) and len(v) > 1024):
                raise SpecError(where, "a number, a string (at most 1024 characters) or true/false", v)
            if isinstance(v, str):
                check_text(where, v, multiline=True)
            out[k] = v
        return out
    if dataclasses.is_dataclass(tp):
        return parse_dataclass(tp, value, path)
    raise TypeError(f"unsupported field type {tp!r} at {path}")  # a bug in this module


#: Most items in one list or mapping of a nested option value (``nested_depth`` fields).
MAX_NESTED_ITEMS = 256


def _plain(value: Any, path: str, depth: int, max_depth: int) -> Any:
    """A JSON-like option value (None, bool, number, string <= 1024 characters, list, mapping
    with string keys) nested at most ``max_depth`` deep (the option's own value is depth 1);
    integral doubles become ints (protobuf ``Struct`` carries every number as a double); lists
    stay lists."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        if isinstance(value, float):
            if not math.isfinite(value):
                raise SpecError(path, "a finite number", value)
            if value.is_integer():
                return int(value)
        return value
    if isinstance(value, str):
        if len(value) > 1024:
            raise SpecError(path, "a string of at most 1024 characters", f"{value[:20]}... ({len(value)} characters)")
        check_text(path, value, multiline=True)
        return value
    if isinstance(value, (list, tuple, Mapping)):
        if depth > max_depth:
            raise SpecError(path, f"lists and mappings nested at most {max_depth} deep", "a deeper value")
        if len(value) > MAX_NESTED_ITEMS:
            raise SpecError(path, f"at most {MAX_NESTED_ITEMS} items", f"{len(value)} items")
        if isinstance(value, Mapping):
            out = {}
            for k, v in value.items():
                if not isinstance(k, str):
                    raise SpecError(path, "a mapping with string keys", k)
                out[k] = _plain(v, f"{path}.{_cut(k, 60)}", depth + 1, max_depth)
            return out
        return [_plain(v, f"{path}[{i}]", depth + 1, max_depth) for i, v in enumerate(value)]
    raise SpecError(path, "a number, a string, true/false, null, a list or a mapping", value)


@functools.cache
def _dataclass_fields(cls: type) -> tuple[dict[str, Any], dict[str, dataclasses.Field]]:
    """Type hints and init fields of ``cls``, resolved once (``get_type_hints`` compiles every
    string annotation on each call, which made validating a spec cost ~0.4 ms)."""
    return typing.get_type_hints(cls), {f.name: f for f in dataclasses.fields(cls) if f.init}


def parse_dataclass(cls: type, data: Any, path: str):
    """Build frozen dataclass ``cls`` from a mapping, refusing unknown keys and wrong types.

    Every key is checked before anything is raised: unknown keys (one refusal naming them all),
    each field's value, each missing required key; the class's ``check(path)`` (rules that
    combine fields) runs once all of them are valid.

    Raises:
        SpecError: naming ``path.<key>`` and what was expected; the other bad keys as its ``also``.
    """
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise SpecError(path, "a mapping of keys to values", data)
    hints, fields = _dataclass_fields(cls)
    errors: list[SpecError] = []
    unknown = sorted(set(data) - set(fields), key=str)
    if unknown:
        expected = f"one of the known keys ({', '.join(sorted(fields))})"
        if len(unknown) > 1:
            expected += f"; unknown keys: {name_list(unknown)}"
        errors.append(SpecError(f"{path}.{_cut(unknown[0], 60)}", expected, hint=did_you_mean_each(unknown, fields)))
    kwargs = {}
    for name, f in fields.items():
        if name in data:
            try:
                kwargs[name] = _convert(data[name], hints[name], f, f"{path}.{name}")
            except SpecError as err:  # the other fields are still checked: one pass names them all
                errors.append(err)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            errors.append(SpecError(f"{path}.{name}", "a value (this key is required)"))
    raise_if_any(errors)
    obj = cls(**kwargs)
    check = getattr(obj, "check", None)
    if check is not None:
        check(path)
    return obj


def num(default, lo=None, hi=None, min_exclusive=False, doc=""):
    """A numeric dataclass field with bounds: ``[lo, hi]`` (``(lo, hi]`` when ``min_exclusive``)."""
    return field(default=default, metadata={"min": lo, "max": hi, "min_exclusive": min_exclusive, "doc": doc})


def jsonable(value: Any) -> Any:
    """Tuples become lists, recursively (for ``json.dumps`` / protobuf ``Struct``)."""
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


def plain(obj: Any) -> Any:
    """A spec dataclass as plain JSON-able values: dataclasses become dicts (field order kept),
    tuples lists, recursively; what ``jsonable(dataclasses.asdict(obj))`` gives, without its deep
    copy of every leaf (spec values are immutable: numbers, strings, tuples, frozen dataclasses),
    which made it the costliest step of resolving a submitted spec."""
    if is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: plain(getattr(obj, f.name)) for f in fields(obj)}
    if isinstance(obj, dict):
        return {k: plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [plain(v) for v in obj]
    return obj
