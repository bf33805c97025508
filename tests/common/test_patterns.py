"""User-supplied regular expressions match in time linear in the reply (RE2): a pattern that
makes Python's ``re`` backtrack for ever scores a long reply at once, and a pattern RE2 cannot
express is refused with what to change."""

from __future__ import annotations

import pytest

from opentinker_common.patterns import MAX_PATTERN_CHARS, PatternError, compile_pattern
from opentinker_common.verifiers import VerifierError, format_term, json_schema, make_reward, regex

#: Python's ``re`` tries every way ``(.|.)*`` can split a reply: 2**n for n characters.
EXPONENTIAL = "(.|.)*ZQZQ"
#: Far past what backtracking could finish (2**4000 paths), a moment for a linear matcher.
LONG_REPLY = "ab" * 2000


# Each match is linear, so the whole test takes milliseconds; the timeout only turns a
# backtracking matcher's endless run into a failure.
@pytest.mark.timeout(120)
def test_an_exponential_pattern_scores_a_long_reply_at_once() -> None:
    assert regex(LONG_REPLY, pattern=EXPONENTIAL) == 0.0
    assert regex(LONG_REPLY + "ZQZQ", pattern=EXPONENTIAL) == 1.0
    assert regex(LONG_REPLY, pattern=EXPONENTIAL, full_match=True) == 0.0
    assert format_term(LONG_REPLY, pattern=EXPONENTIAL) == 0.0
    reward = make_reward("regex", {"pattern": EXPONENTIAL})
    assert [reward(LONG_REPLY, None) for _ in range(50)] == [0.0] * 50


@pytest.mark.timeout(120)
def test_json_schema_patterns_match_in_linear_time() -> None:
    schema = {
        "type": "object",
        "properties": {"a": {"type": "string", "pattern": EXPONENTIAL}},
        "patternProperties": {EXPONENTIAL: {"type": "integer"}},
        "additionalProperties": False,
    }
    assert json_schema('{"a": "%s"}' % LONG_REPLY, schema=schema) == 0.0
    assert json_schema('{"a": "xZQZQ", "%sZQZQ": 3}' % LONG_REPLY, schema=schema) == 1.0
    assert json_schema('{"a": "xZQZQ", "%sZQZQ": "three"}' % LONG_REPLY, schema=schema) == 0.0
    assert json_schema('{"a": "xZQZQ", "%s": 3}' % LONG_REPLY, schema=schema) == 0.0  # an additional property


@pytest.mark.parametrize(
    ("pattern", "why"),
    [
        (r"(a)\1", r"invalid escape sequence: \1"),
        (r"(?<!x)y", "invalid perl operator: (?<!"),
        (r"x(?=y)", "invalid perl operator: (?="),
        ("(", "missing ): ("),
    ],
)
def test_a_pattern_re2_cannot_match_is_refused_saying_why(pattern, why) -> None:
    with pytest.raises(PatternError) as info:
        compile_pattern(pattern)
    assert str(info.value) == (
        "expected a regular expression RE2 can match in linear time (no backreferences or lookaround), "
        f"got {pattern!r} ({why})"
    )
    with pytest.raises(VerifierError, match="RE2 can match in linear time"):
        regex("x", pattern=pattern)
    if pattern != "(":  # jsonschema's own check refuses that one first
        with pytest.raises(VerifierError, match="RE2 can match in linear time"):
            json_schema("{}", schema={"properties": {"a": {"pattern": pattern}}})


def test_pattern_length_is_bounded() -> None:
    assert compile_pattern("a" * MAX_PATTERN_CHARS).search("a" * MAX_PATTERN_CHARS)
    with pytest.raises(PatternError, match=f"at most {MAX_PATTERN_CHARS} characters, got {MAX_PATTERN_CHARS + 1}"):
        compile_pattern("a" * (MAX_PATTERN_CHARS + 1))


def test_python_syntax_re2_shares_reads_the_same() -> None:
    rx = compile_pattern(r"(?i)answer:\s*(?P<n>-?\d+)")
    assert rx.search("The ANSWER: -42.").group("n") == "-42"
    assert regex("  XY-12 ", pattern=r"[A-Z]{2}-\d+", full_match=True) == 1.0


def test_any_reply_can_be_matched_even_with_a_lone_surrogate() -> None:
    reply = "x\udcffy ZQZQ"  # bytes decoded with surrogateescape; UTF-8, which RE2 reads, cannot hold it
    assert regex(reply, pattern="ZQZQ") == 1.0
    assert regex(reply, pattern=r"x.y ZQZQ", full_match=True) == 1.0
    assert compile_pattern("y").search(reply).span() == (2, 3)
