"""The shared YAML loader reads booleans as YAML 1.2's core schema does."""

from __future__ import annotations

import pytest
import yaml

from opentinker_common.yaml12 import Yaml12Loader, yaml11_bool_hint

YAML11_ONLY = ["yes", "Yes", "YES", "no", "No", "NO", "on", "On", "ON", "off", "Off", "OFF", "y", "Y", "n", "N"]


@pytest.mark.parametrize("text", YAML11_ONLY)
def test_yaml11_boolean_words_are_strings(text: str) -> None:
    assert yaml.load(f"x: {text}", Loader=Yaml12Loader)["x"] == text


@pytest.mark.parametrize(
    ("text", "value"), [("true", True), ("True", True), ("TRUE", True), ("false", False), ("False", False)]
)
def test_core_schema_booleans_are_booleans(text: str, value: bool) -> None:
    assert yaml.load(f"x: {text}", Loader=Yaml12Loader)["x"] is value
    assert yaml.load("x: FALSE", Loader=Yaml12Loader)["x"] is False


def test_mixed_case_boolean_is_a_string() -> None:
    assert yaml.load("x: tRUE", Loader=Yaml12Loader)["x"] == "tRUE"


def test_explicit_bool_tag_takes_only_core_schema_forms() -> None:
    assert yaml.load("x: !!bool true", Loader=Yaml12Loader)["x"] is True
    with pytest.raises(yaml.constructor.ConstructorError) as err:
        yaml.load("a: 1\nx: !!bool no\n", Loader=Yaml12Loader)
    assert "expected true or false" in str(err.value)
    assert err.value.problem_mark.line + 1 == 2 and err.value.problem_mark.column + 1 == 4


def test_safe_loader_itself_is_unchanged() -> None:
    assert yaml.safe_load("x: no")["x"] is False


@pytest.mark.parametrize(
    ("value", "hint"),
    [
        ("no", "'no' is a string in YAML 1.2 — write false"),
        ("OFF", "'OFF' is a string in YAML 1.2 — write false"),
        ("Yes", "'Yes' is a string in YAML 1.2 — write true"),
        ("on", "'on' is a string in YAML 1.2 — write true"),
        ("y", "'y' is a string in YAML 1.2 — write true"),
        ("maybe", None),
        ("", None),
        (False, None),
        (0, None),
    ],
)
def test_yaml11_bool_hint(value: object, hint: str | None) -> None:
    assert yaml11_bool_hint(value) == hint
