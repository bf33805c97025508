"""``google.protobuf.Struct`` to plain values and back, for the fields of a ``TaskSpec`` that are
Structs (``env_config``, ``hyperparameters``, ``tracking``).

:func:`struct_to_dict` gives what ``json_format.MessageToDict`` gives for a Struct, and
:func:`update_struct` does what ``Struct.update(plain(value))`` does, each without the generic
machinery of protobuf's pure-Python helpers (descriptor look-ups per value, an ``isinstance``
chain per value, a dict built only to be copied again): they ran on every submit, several times,
and were among the costliest steps of one. Nothing here imports protobuf; the messages are used
through their own methods.
"""

from __future__ import annotations

import math
from dataclasses import fields, is_dataclass
from typing import Any, Mapping

from opentinker_common.spec._parse import SpecError

__all__ = ["struct_to_dict", "struct_value", "update_struct"]


def struct_to_dict(struct, field: str = "value") -> dict[str, Any]:
    """``struct`` (a ``google.protobuf.Struct``) as ``json_format.MessageToDict`` returns it:
    numbers as floats, ``null`` (and an unset value) as None, lists and nested structs as lists
    and dicts.

    Args:
        field: the struct's path in errors (``spec.hyperparameters``).

    Raises:
        SpecError: a number is infinite or NaN, naming its path
            (``spec.hyperparameters.learning_rate: expected a finite number, got nan``).
    """
    return {key: struct_value(value, f"{field}.{key}") for key, value in struct.fields.items()}


def struct_value(value, field: str = "value") -> Any:
    """One ``google.protobuf.Value`` as ``json_format.MessageToDict`` converts it (see
    :func:`struct_to_dict`; ``field`` is its path in errors)."""
    kind = value.WhichOneof("kind")
    if kind == "string_value":
        return value.string_value
    if kind == "number_value":
        number = value.number_value
        if not math.isfinite(number):
            raise SpecError(field, "a finite number", number)
        return number
    if kind == "bool_value":
        return value.bool_value
    if kind == "struct_value":
        return struct_to_dict(value.struct_value, field)
    if kind == "list_value":
        return [struct_value(v, f"{field}[{i}]") for i, v in enumerate(value.list_value.values)]
    return None  # null_value, or no value set


def update_struct(struct, values: Mapping[str, Any] | Any) -> None:
    """Set ``struct``'s fields from ``values``, a mapping or a (spec) dataclass instance: the same
    as ``struct.update(plain(values))`` (:func:`~opentinker_common.spec.plain`: dataclasses become
    structs in field order, tuples lists), in one pass.

    Raises:
        ValueError: a value that is none of None, bool, str, int, float, a dict, a list or
            tuple, or a dataclass instance (``Unexpected type``, as ``Struct.update`` says).
    """
    target = struct.fields
    if is_dataclass(values) and not isinstance(values, type):
        for f in fields(values):
            _set(target[f.name], getattr(values, f.name))
    else:
        for key, value in values.items():
            _set(target[key], value)


def _set(target, value) -> None:
    """``Struct``'s ``_SetStructValue`` of ``plain(value)``: the common types by their exact type
    first, then the checks in its order (a subclass of ``bool``, ``str``, ``int``...)."""
    kind = type(value)
    if kind is str:
        target.string_value = value
    elif kind is float or kind is int:
        target.number_value = value
    elif kind is bool:
        target.bool_value = value
    elif value is None:
        target.null_value = 0
    elif kind is tuple or kind is list:
        _set_list(target, value)
    elif kind is dict:
        target.struct_value.Clear()
        update_struct(target.struct_value, value)
    elif isinstance(value, bool):
        target.bool_value = value
    elif isinstance(value, str):
        target.string_value = value
    elif isinstance(value, (int, float)):
        target.number_value = value
    elif isinstance(value, dict) or (is_dataclass(value) and not isinstance(value, type)):
        target.struct_value.Clear()
        update_struct(target.struct_value, value)
    elif isinstance(value, (list, tuple)):
        _set_list(target, value)
    else:
        raise ValueError("Unexpected type")


def _set_list(target, items) -> None:
    target.list_value.Clear()
    values = target.list_value.values
    for item in items:
        _set(values.add(), item)
