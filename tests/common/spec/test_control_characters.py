"""``control_character_problem`` finds the first character a terminal acts on (the set
``is_control_character`` names, by category and list) with one regular expression: the expression
and the per-character definition agree on every code point, with and without ``multiline``."""

from __future__ import annotations

import sys

from opentinker_common.spec import check_text, control_character_problem, is_control_character
from opentinker_common.spec import SpecError
from opentinker_common.spec._parse import _CONTROL_RE, _CONTROL_RE_MULTILINE, _MULTILINE_ALLOWED


def test_the_expressions_match_exactly_the_control_characters() -> None:
    for cp in range(sys.maxunicode + 1):
        c = chr(cp)
        control = is_control_character(c)
        assert (_CONTROL_RE.fullmatch(c) is not None) == control, hex(cp)
        assert (_CONTROL_RE_MULTILINE.fullmatch(c) is not None) == (control and c not in _MULTILINE_ALLOWED), hex(cp)


def test_the_first_refused_character_is_named_with_its_place() -> None:
    assert control_character_problem("plain text, ünïcødé and emoji 🙂") is None
    assert control_character_problem("ab\x1b]0;x\x07") == "U+001B (ESC) at character 2"
    assert control_character_problem("a\tb") == "U+0009 (tab) at character 1"
    assert control_character_problem("line one\nline two\ttab", multiline=True) is None
    assert control_character_problem("ok\nthen \x07", multiline=True) == "U+0007 (BEL) at character 8"
    assert control_character_problem("x\u202ey") == "U+202E (RIGHT-TO-LEFT OVERRIDE) at character 1"
    assert control_character_problem("\x85") == "U+0085 (a control character) at character 0"
    try:
        check_text("spec.name", "bad\x00name")
    except SpecError as exc:
        assert "U+0000 (NUL) at character 3" in str(exc)
    else:
        raise AssertionError("a NUL in a name was accepted")
