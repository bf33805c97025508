"""User documents, YAML and JSON, read within bounds on size, nesting depth and alias expansion.

A task file, a scheduler config or a request body comes from someone else. Read without
bounds, a YAML "billion laughs" (nine aliases of nine aliases ...) expands to 10**9 values in
whatever walks it, and a document nested 10,000 levels deep ends the reader in a
``RecursionError``. Every user document is read here instead, and each bound is refused with
the line and column where it was passed and the limit by name:

* ``max_bytes``: the document's length in bytes (UTF-8).
* ``max_depth``: mappings and lists inside one another (a scalar at the top is depth 0).
* ``max_nodes``: YAML values counted as a reader sees them, every alias expanded in place.

YAML is read by :class:`~opentinker_common.yaml12.Yaml12Loader`; its nodes keep their marks.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import yaml

from opentinker_common.yaml12 import Yaml12Loader

__all__ = ["DocumentError", "Limits", "compose_yaml", "construct_yaml", "load_json", "load_yaml"]


@dataclass(frozen=True)
class Limits:
    """Bounds on one document; see the module docstring."""

    max_bytes: int = 1 << 20
    max_depth: int = 64
    max_nodes: int = 100_000


#: What a task file, a scheduler config and a request body get unless the caller says more.
DEFAULT_LIMITS = Limits()


class DocumentError(ValueError):
    """A document past one of its :class:`Limits`, or not valid YAML or JSON.

    Attributes:
        problem: what is wrong, without the place (``nested deeper than 64 levels (max_depth)``).
        line, column: 1-based place of the problem; None when the whole document is meant.
    """

    def __init__(self, problem: str, line: int | None = None, column: int | None = None) -> None:
        self.problem = problem
        self.line = line
        self.column = column
        super().__init__(f"{line}:{column}: {problem}" if line is not None else problem)


def _check_size(text: str | bytes, limits: Limits) -> None:
    size = len(text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text)
    if size > limits.max_bytes:
        raise DocumentError(f"expected a document of at most {limits.max_bytes} bytes (max_bytes), got {size}")


def _too_deep(limits: Limits) -> str:
    return f"expected mappings and lists nested at most {limits.max_depth} levels deep (max_depth), got a deeper one"


class _BoundedLoader(Yaml12Loader):
    """Yaml12Loader that refuses nodes nested past ``limits.max_depth`` while it composes them,
    before Python's own recursion limit is near."""

    limits: Limits = DEFAULT_LIMITS
    _depth = 0

    def compose_node(self, parent, index):
        if self._depth >= self.limits.max_depth and not self.check_event(yaml.ScalarEvent, yaml.AliasEvent):
            mark = self.peek_event().start_mark
            raise DocumentError(_too_deep(self.limits), mark.line + 1, mark.column + 1)
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def compose_yaml(text: str, limits: Limits = DEFAULT_LIMITS) -> yaml.Node | None:
    """The node tree of the one YAML document in ``text`` (None when empty), within ``limits``.

    Raises:
        DocumentError: past a limit, or an alias that contains itself.
        yaml.YAMLError: not valid YAML (PyYAML's error, with its marks).
    """
    _check_size(text, limits)
    loader = _BoundedLoader(text)
    loader.limits = limits
    try:
        root = loader.get_single_node()
    finally:
        loader.dispose()
    if root is not None:
        _check_expansion(root, limits)
    return root


def _check_expansion(root: yaml.Node, limits: Limits) -> None:
    """Refuse a tree whose values, aliases expanded, number more than ``limits.max_nodes``; a
    shared node is counted once per place it appears, computed once per node."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()

    def size(node: yaml.Node) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in open_nodes:
            mark = node.start_mark
            problem = "expected aliases to earlier values, got one inside itself"
            raise DocumentError(problem, mark.line + 1, mark.column + 1)
        open_nodes.add(key)
        total = 1
        if isinstance(node, yaml.SequenceNode):
            total += sum(size(item) for item in node.value)
        elif isinstance(node, yaml.MappingNode):
            total += sum(size(k) + size(v) for k, v in node.value)
        open_nodes.discard(key)
        if total > limits.max_nodes:
            mark = node.start_mark
            raise DocumentError(
                f"expected at most {limits.max_nodes} values with aliases expanded (max_nodes), got more",
                mark.line + 1,
                mark.column + 1,
            )
        sizes[key] = total
        return total

    size(root)


def construct_yaml(node: yaml.Node | None) -> Any:
    """The Python value of a node tree from :func:`compose_yaml` (None for None).

    Raises:
        yaml.YAMLError: a tag whose text does not fit it (``!!int abc``).
    """
    if node is None:
        return None
    loader = Yaml12Loader("")
    try:
        return loader.construct_document(node)
    finally:
        loader.dispose()


def load_yaml(text: str, limits: Limits = DEFAULT_LIMITS) -> Any:
    """The value of the one YAML document in ``text``: :func:`compose_yaml`, then
    :func:`construct_yaml`. Raises as they do."""
    return construct_yaml(compose_yaml(text, limits))


# A JSON string (skipped whole) or one bracket. Possessive loops: linear on any input.
_JSON_TOKEN = re.compile(r'"[^"\\]*+(?:\\.[^"\\]*+)*+"|[\[\]{}]', re.S)


def _json_place(text: str, index: int) -> tuple[int, int]:
    line = text.count("\n", 0, index) + 1
    return line, index - (text.rfind("\n", 0, index) + 1) + 1


def load_json(data: str | bytes, limits: Limits = DEFAULT_LIMITS) -> Any:
    """The value of the JSON document ``data``, within ``limits`` (``max_nodes`` is not used:
    JSON has no aliases). ``NaN`` and ``Infinity`` are refused: they are not JSON.

    Raises:
        DocumentError: past a limit, or not valid JSON (with its line and column).
    """
    _check_size(data, limits)
    if isinstance(data, bytes):
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            problem = f"expected UTF-8 text, got a byte that is not ({exc.reason} at byte {exc.start})"
            raise DocumentError(problem) from None
    else:
        text = data
    depth = 0
    for m in _JSON_TOKEN.finditer(text):
        ch = m.group()
        if ch in "[{":
            depth += 1
            if depth > limits.max_depth:
                raise DocumentError(_too_deep(limits), *_json_place(text, m.start()))
        elif ch in "]}":
            depth -= 1
    try:
        return json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as exc:
        raise DocumentError(f"expected JSON: {exc.msg}", exc.lineno, exc.colno) from None
    except ValueError as exc:  # NaN or Infinity (_no_constant)
        raise DocumentError(str(exc)) from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON; expected a finite number")
