"""User-supplied regular expressions, matched in time linear in the text.

A reward pattern comes from a task's owner and runs on every reply the model writes. Python's
``re`` backtracks: ``(.|.)*ZQZQ`` doubles its cost with each character of a reply, and one
such pattern stalls a task at step 0. Patterns here go through RE2 (``google-re2``), which
matches in time linear in the text and never backtracks.

RE2 reads Python's syntax for what it supports: classes, groups, named groups ``(?P<n>...)``,
repetition, inline flags ``(?i)``, ``(?s)``, ``(?m)``. It has no backreferences (``\\1``) and
no lookaround (``(?=...)``, ``(?<!...)``); such a pattern is refused when it is compiled, so a
task that uses one is refused at submit. ``\\d``, ``\\w`` and ``\\s`` match ASCII only.
"""

from __future__ import annotations

import functools

import re2

__all__ = ["MAX_PATTERN_CHARS", "Pattern", "PatternError", "compile_pattern"]

#: The longest pattern accepted, in characters.
MAX_PATTERN_CHARS = 1024
#: Memory RE2 may use for one compiled pattern, in bytes; a pattern that needs more is refused.
MAX_PATTERN_MEMORY = 8 << 20


class PatternError(ValueError):
    """A pattern that is not text, too long, or not one RE2 can match in linear time."""


_OPTIONS = re2.Options()
_OPTIONS.log_errors = False  # a refused pattern is an error for its owner, not a log line
_OPTIONS.max_mem = MAX_PATTERN_MEMORY


class Pattern:
    """A pattern compiled by RE2, matched as ``re.Pattern`` matches: ``search``, ``match``,
    ``fullmatch`` and ``finditer`` on ``str``, giving match objects with ``group`` and ``span``.

    RE2 reads UTF-8, which cannot hold a lone surrogate (``"\\ud800"``, from text decoded with
    ``surrogateescape``); such a character is matched as ``"?"``, so any text can be matched.
    """

    __slots__ = ("_rx", "pattern")

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern
        self._rx = re2.compile(pattern, options=_OPTIONS)

    def search(self, text: str):
        return self._call(self._rx.search, text)

    def match(self, text: str):
        return self._call(self._rx.match, text)

    def fullmatch(self, text: str):
        return self._call(self._rx.fullmatch, text)

    def finditer(self, text: str):
        return self._call(self._rx.finditer, text)

    @staticmethod
    def _call(method, text: str):
        try:
            return method(text)
        except UnicodeEncodeError:
            return method(text.encode("utf-8", "replace").decode("utf-8"))


@functools.lru_cache(maxsize=256)
def _compile(pattern: str) -> Pattern:
    return Pattern(pattern)


def compile_pattern(pattern: object) -> Pattern:
    """``pattern`` compiled by RE2 (:class:`Pattern`). Compiled patterns are cached.

    Raises:
        PatternError: not a non-empty string, longer than :data:`MAX_PATTERN_CHARS`, or not
            valid RE2 syntax (a backreference or lookaround, say); the message says which.
    """
    if not isinstance(pattern, str) or not pattern:
        raise PatternError(f"expected a regular expression, got {pattern!r:.60}")
    if len(pattern) > MAX_PATTERN_CHARS:
        raise PatternError(
            f"expected a regular expression of at most {MAX_PATTERN_CHARS} characters, got {len(pattern)}"
        )
    try:
        return _compile(pattern)
    except re2.error as exc:
        why = exc.args[0].decode("utf-8", "replace") if exc.args and isinstance(exc.args[0], bytes) else str(exc)
        raise PatternError(
            f"expected a regular expression RE2 can match in linear time (no backreferences or lookaround), "
            f"got {pattern!r:.60} ({why})"
        ) from None
