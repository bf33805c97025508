"""The built-in verifiers: each contract of opentinker_common.verifiers, rule by rule."""

from __future__ import annotations

import pytest

from opentinker_common.verifiers import (
    VERIFIERS,
    Term,
    VerifierError,
    check_expected,
    choice,
    exact,
    extract_answer,
    format_term,
    json_schema,
    length_term,
    make_reward,
    numeric,
    regex,
)


@pytest.mark.parametrize(
    ("reply", "expected", "opts", "score"),
    [
        ("Paris", "paris", {}, 1.0),
        ("  Paris \n", "Paris", {}, 1.0),
        ("New   York", "new york", {}, 1.0),
        ("Paris", "paris", {"case_sensitive": True}, 0.0),
        ("New   York", "New York", {"normalize_whitespace": False}, 0.0),
        ("Paris.", "Paris", {}, 0.0),
        ("42", 42, {}, 1.0),
        (None, "x", {}, 0.0),
    ],
)
def test_exact(reply, expected, opts, score) -> None:
    assert exact(reply, expected, **opts) == score


def test_exact_refuses_an_expected_value_that_is_not_text() -> None:
    with pytest.raises(VerifierError, match="expected a string answer"):
        exact("x", ["a"])


@pytest.mark.parametrize(
    ("reply", "mode", "value"),
    [
        ("so 3 + 4 = 7", "last", 7),
        ("The answer is \\boxed{12} (not 13)", "auto", 12),
        ("First 5, then\n#### 9\nok 10", "auto", 9),
        ("\\boxed{1} and #### 2", "auto", 1),  # boxed wins over ####
        ("no box, 8", "boxed", None),
        ("no hash, 8", "hash", None),
        ("#### ", "hash", None),
        ("It costs $1,234.50", "last", 1234.5),
        ("-7 degrees", "last", -7),
        ("", "auto", None),
    ],
)
def test_extract_answer(reply, mode, value) -> None:
    got = extract_answer(reply, mode)
    assert (got is None and value is None) or float(got) == value


@pytest.mark.parametrize(
    ("reply", "expected", "opts", "score"),
    [
        ("She has 12 apples.", 12, {}, 1.0),
        ("She has 12 apples.", "12", {}, 1.0),
        ("She has 12 apples.", "1,2", {}, None),  # "1,2" is not a number: refused below
        ("12.0", 12, {}, 1.0),
        ("12.4", 12, {"tolerance": 0.5}, 1.0),
        ("12.6", 12, {"tolerance": 0.5}, 0.0),
        ("\\boxed{3} so 4", 3, {}, 1.0),
        ("\\boxed{3} so 4", 4, {"extract": "last"}, 1.0),
        ("no number", 3, {}, 0.0),
        ("3.0000001", 3, {}, 1.0),
    ],
)
def test_numeric(reply, expected, opts, score) -> None:
    if score is None:
        with pytest.raises(VerifierError, match="expected a number"):
            numeric(reply, expected, **opts)
    else:
        assert numeric(reply, expected, **opts) == score


@pytest.mark.parametrize("bad", ["seven", None, True, float("nan"), [3], ""])
def test_numeric_refuses_expected_values_that_are_not_numbers(bad) -> None:
    with pytest.raises(VerifierError):
        check_expected("numeric", bad, {})


@pytest.mark.parametrize(
    ("reply", "expected", "score"),
    [
        ("The answer is B", "B", 1.0),
        ("answer: b", "B", 1.0),
        ("I think (C) is right", "C", 1.0),
        ("A) no, D) yes... final D", "D", 1.0),
        ("Between A and C, I pick C", "A", 0.0),
        ("I pick E", "A", 0.0),  # E is not one of ABCD
        ("", "A", 0.0),
        ("(b)", "(B)", 1.0),
    ],
)
def test_choice(reply, expected, score) -> None:
    assert choice(reply, expected) == score


def test_choice_refuses_a_letter_outside_the_choices() -> None:
    with pytest.raises(VerifierError, match="letters A, B, C, D"):
        choice("A", "E")
    assert choice("E", "E", choices="ABCDE") == 1.0


def test_regex() -> None:
    assert regex("the code is XY-12", pattern=r"[A-Z]{2}-\d+") == 1.0
    assert regex("XY-12 then more", pattern=r"[A-Z]{2}-\d+", full_match=True) == 0.0
    assert regex("  XY-12 ", pattern=r"[A-Z]{2}-\d+", full_match=True) == 1.0
    assert regex("abc", "b") == 1.0  # the line's expected value as the pattern
    with pytest.raises(VerifierError, match="expected a regular expression RE2 can match"):
        regex("x", pattern="(")


SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


def test_json_schema() -> None:
    assert json_schema('{"name": "Ada"}', schema=SCHEMA) == 1.0
    assert json_schema('Here:\n```json\n{"name": "Ada"}\n```', schema=SCHEMA) == 1.0
    assert json_schema('{"name": 3}', schema=SCHEMA) == 0.0
    assert json_schema("not json", schema=SCHEMA) == 0.0
    assert json_schema('{"name": "x"}', '{"type": "object"}') == 1.0  # the schema from the line, as JSON text
    with pytest.raises(VerifierError, match="valid JSON schema"):
        json_schema("{}", schema={"type": "nonsense"})


def test_shaping_terms_and_weights_combine() -> None:
    assert length_term("x" * 10, max_chars=10) == 0.0
    assert length_term("x" * 15, max_chars=10) == -0.5
    assert length_term("x" * 100, max_chars=10) == -1.0
    assert format_term("#### 4", pattern=r"####\s*\d") == 1.0
    reward = make_reward(
        "numeric",
        {},
        weight=2.0,
        terms=[Term("format", 0.5, {"pattern": "####"}), Term("length", 1.0, {"max_chars": 4})],
    )
    assert reward("#### 4", 4) == 2.0 + 0.5 - 0.5  # right, formatted, 6 chars of 4 allowed
    assert reward("5", 4) == 0.0


def test_an_unknown_verifier_lists_the_known_ones() -> None:
    with pytest.raises(VerifierError, match="exact, numeric, choice, regex, json_schema"):
        make_reward("fuzzy", {})


def test_no_verifier_raises_on_any_reply() -> None:
    good = {"exact": "a", "numeric": 1, "choice": "A", "regex": "a", "json_schema": {"type": "object"}}
    for name, (fn, _, _) in VERIFIERS.items():
        for reply in (None, "", "\\boxed{", "####", "((", "```json\n{", "\x00" * 3, "9" * 500):
            assert 0.0 <= fn(reply, good[name]) <= 1.0, (name, reply)
