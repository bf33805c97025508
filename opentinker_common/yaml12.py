"""The YAML loader of every OpenTinker config file (task configs and ``scheduler_config.yaml``)."""

from __future__ import annotations

import re
from typing import Any

import yaml

__all__ = ["Yaml12Loader", "yaml11_bool_hint"]

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
