"""Bounded reading of user documents: each limit refused with its place and name, aliases
within the bounds still read, and a JSONL dataset line nested 10,000 deep refused by line and
column instead of a RecursionError."""

from __future__ import annotations

import pytest

from opentinker_common.documents import DocumentError, Limits, load_json, load_yaml
from opentinker_common.spec.sft import DatasetError, json_object_line

DEEP = "[" * 10_000 + "]" * 10_000


def test_yaml_within_the_bounds_reads_as_yaml_12() -> None:
    assert load_yaml("a: &x {b: 1e-4}\nc: *x\nd: [yes, true]\n") == {
        "a": {"b": 1e-4},
        "c": {"b": 1e-4},
        "d": ["yes", True],
    }


@pytest.mark.parametrize(
    ("text", "limits", "message"),
    [
        ("x: " + DEEP, Limits(), "1:67: expected mappings and lists nested at most 64 levels deep (max_depth)"),
        ("a: &a [1, 2, 3]\nb: &b [*a, *a, *a]\nc: [*b, *b]\n", Limits(max_nodes=20), "3:4: expected at most 20 values"),
        ("a: &a [*a]\n", Limits(), "1:4: expected aliases to earlier values, got one inside itself"),
        ("a: " + "x" * 100, Limits(max_bytes=100), "expected a document of at most 100 bytes (max_bytes), got 103"),
    ],
)
def test_yaml_past_a_bound_is_refused_naming_it(text, limits, message) -> None:
    with pytest.raises(DocumentError) as info:
        load_yaml(text, limits)
    assert str(info.value).startswith(message)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (DEEP, "1:65: expected mappings and lists nested at most 64 levels deep (max_depth), got a deeper one"),
        ('{"a": "[[[[", "b": [1]}', None),  # brackets inside strings do not count
        ('{"a": NaN}', "NaN is not JSON; expected a finite number"),
        ('{"a": -Infinity}', "-Infinity is not JSON; expected a finite number"),
        ('{"a": 1', "1:8: expected JSON: Expecting ',' delimiter"),
        ('"' + "\\\\" * 1000, "1:1: expected JSON: Unterminated string starting at"),
        (b"\xff", "expected UTF-8 text, got a byte that is not (invalid start byte at byte 0)"),
    ],
)
def test_json_is_read_within_its_bounds(text, message) -> None:
    if message is None:
        assert load_json(text) == {"a": "[[[[", "b": [1]}
        return
    with pytest.raises(DocumentError) as info:
        load_json(text)
    assert str(info.value) == message


def test_a_dataset_line_nested_10000_deep_is_refused_by_line_and_column() -> None:
    line = '{"messages": ' + DEEP + "}"
    with pytest.raises(DatasetError) as info:
        json_object_line(line.encode(), 7, example='{"messages": [...]}', wanted='a "messages" list')
    assert info.value.at("d.jsonl") == (
        'd.jsonl:7:77: expected a JSON object such as {"messages": [...]} (JSON error at column 77: expected mappings '
        "and lists nested at most 64 levels deep (max_depth), got a deeper one)"
    )


def test_a_json_schema_verifier_reads_schemas_and_replies_within_the_bounds() -> None:
    from opentinker_common.verifiers import VerifierError, json_schema

    with pytest.raises(VerifierError, match=r"expected mappings and lists nested at most 64 levels deep"):
        json_schema('{"a": 1}', DEEP)  # a schema from a dataset line, as JSON text
    assert json_schema(DEEP, schema={"type": "array"}) == 0.0
    assert json_schema('{"a": NaN}', schema={"type": "object"}) == 0.0
    assert json_schema("```json\n[[1]]\n```", schema={"type": "array"}) == 1.0
