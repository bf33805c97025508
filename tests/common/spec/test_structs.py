"""``struct_to_dict`` and ``update_struct`` give what protobuf's own helpers give
(``json_format.MessageToDict`` of a Struct, ``Struct.update(plain(...))``), for every kind of
value a spec holds, nested, and refuse what they refuse."""

from __future__ import annotations

import dataclasses
import math

import pytest
from google.protobuf import json_format, struct_pb2

from opentinker.common.v1 import common_pb2
from opentinker_common.spec import plain, spec_from_proto
from opentinker_common.spec.structs import struct_to_dict, struct_value, update_struct

VALUES = {
    "s": "text",
    "empty": "",
    "i": 3,
    "f": 0.25,
    "neg": -1e300,
    "t": True,
    "no": False,
    "none": None,
    "list": [1, "a", None, [2.5, {"x": True}], {}],
    "tuple": (1, 2),
    "nested": {"a": {"b": {"c": [1, 2, 3]}}, "d": []},
}


def _struct(values) -> struct_pb2.Struct:
    out = struct_pb2.Struct()
    out.update(values)
    return out


def test_struct_to_dict_is_message_to_dict() -> None:
    s = _struct(VALUES)
    s.fields["unset"].SetInParent()  # a Value with no kind: None, as MessageToDict says
    got, want = struct_to_dict(s), json_format.MessageToDict(s)
    assert got == want and list(got) == list(want)
    assert type(got["i"]) is type(want["i"]) is float
    assert struct_to_dict(struct_pb2.Struct()) == {}


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_struct_to_dict_refuses_what_message_to_dict_refuses(bad: float) -> None:
    s = _struct({"deep": [{"x": bad}]})
    with pytest.raises(ValueError):
        json_format.MessageToDict(s)
    with pytest.raises(ValueError):
        struct_to_dict(s)
    with pytest.raises(ValueError):
        struct_value(s.fields["deep"])


@dataclasses.dataclass(frozen=True)
class _Inner:
    rank: int = 8
    names: tuple[str, ...] = ("q", "v")


@dataclasses.dataclass(frozen=True)
class _Outer:
    lr: float = 1e-4
    steps: int = 10
    flag: bool = True
    name: str | None = None
    inner: _Inner = _Inner()
    table: dict = dataclasses.field(default_factory=lambda: {"a": (1, 2), "b": {"c": None}})


@pytest.mark.parametrize("value", [VALUES, _Outer(), {"obj": _Outer(), "list": [_Inner()]}])
def test_update_struct_is_update_of_plain(value) -> None:
    want, got = struct_pb2.Struct(), struct_pb2.Struct()
    want.update(plain(value))
    got.fields["stale"].string_value = "kept, as update keeps it"
    want.fields["stale"].string_value = "kept, as update keeps it"
    update_struct(got, value)
    assert got == want
    assert got.SerializeToString(deterministic=True) == want.SerializeToString(deterministic=True)


def test_update_struct_replaces_nested_values_as_update_does() -> None:
    want, got = _struct({"a": {"old": 1}, "b": [1, 2, 3]}), _struct({"a": {"old": 1}, "b": [1, 2, 3]})
    want.update({"a": {"new": 2}, "b": [4]})
    update_struct(got, {"a": {"new": 2}, "b": [4]})
    assert got == want and struct_to_dict(got) == {"a": {"new": 2.0}, "b": [4.0]}


def test_update_struct_refuses_what_update_refuses() -> None:
    for bad in ({"x": object()}, {"x": {1, 2}}, {"x": [b"bytes"]}):
        with pytest.raises(ValueError):
            struct_pb2.Struct().update(plain(bad))
        with pytest.raises(ValueError):
            update_struct(struct_pb2.Struct(), bad)


def test_a_resolved_spec_is_stored_as_before() -> None:
    """The hyperparameters the scheduler stores for a submit (every default filled in)."""
    spec = common_pb2.TaskSpec(workload_type="lora_finetune", model="m")
    spec.env_config.update({"env_id": "arithmetic"})
    spec.hyperparameters.update({"learning_rate": 0.001, "target_modules": ["q_proj"]})
    model = spec_from_proto(spec)
    want, got = struct_pb2.Struct(), struct_pb2.Struct()
    want.update(plain(model.hyperparameters))
    update_struct(got, model.hyperparameters)
    assert got == want and len(got.fields) > 10
