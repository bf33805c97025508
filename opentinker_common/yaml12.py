"""The YAML loader of every OpenTinker config file (task configs and ``scheduler_config.yaml``)."""

from __future__ import annotations

import re

import yaml

__all__ = ["Yaml12Loader"]


class Yaml12Loader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that also reads YAML 1.2 floats as floats.

    PyYAML follows YAML 1.1, where a float needs a dot and a signed exponent, so ``1e-4``,
    ``5E+3``, ``1e4``, ``-.5`` and ``1.5e3`` come back as strings. This loader adds the YAML 1.2
    core-schema forms (a dot or an exponent is still required: ``1`` stays an int and ``09`` a
    string). Use it wherever PyYAML's ``Loader=`` goes (``yaml.compose``, ``yaml.load``); nodes
    keep their marks, so line numbers work as with ``SafeLoader``. Shared by the task configs
    and the scheduler config.
    """


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
