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


# --- typographic characters (what a word processor or the deployment guide puts into YAML) -----

from opentinker_common.yaml12 import every_typography, find_typography, tag_name  # noqa: E402


@pytest.mark.parametrize(
    ("text", "line", "column", "char", "instead"),
    [
        ("resource_pool:\n• node_id: gpu-node-01\n", 2, 1, "•", '"- "'),
        ("resource_pool:\n  - node_id: “gpu-node-01”\n", 2, 14, "“", 'straight "'),
        ("name: ‘x’\n", 1, 7, "‘", "straight '"),
        ("items:\n  – a\n", 2, 3, "–", '"- "'),
        ("lease：3\n", 1, 6, "：", '":"'),
        ("a:\n\u00a0 b: 1\n", 2, 1, "\u00a0", "ordinary space"),
        ("x: it's “y”\n", 1, 9, "“", "straight"),  # an apostrophe inside a plain value opens no string
    ],
)
def test_typographic_characters_are_found_with_line_column_and_what_to_type(text, line, column, char, instead) -> None:
    typo = find_typography(text)
    assert (typo.line, typo.column, typo.char) == (line, column, char)
    assert repr(char) in typo.message and instead in typo.message and f"U+{ord(char):04X}" in typo.message


@pytest.mark.parametrize(
    "text",
    [
        'prompt: "he said “hi”"\n',  # inside ASCII quotes: text the writer chose
        "prompt: 'it''s “fine”'\n",
        "lease: 3  # “quoted” • comment\n",
        "# • a comment line\nlease: 3\n",
        "note: |\n  • a block scalar keeps anything\n  “even this”\nlease: 3\n",
        "name: run – 2\n",  # a dash inside a value is a dash
        "model: 模型\n",
    ],
)
def test_typographic_characters_in_comments_strings_and_blocks_are_text(text) -> None:
    assert find_typography(text) is None


def test_after_a_block_scalar_the_check_resumes() -> None:
    typo = find_typography("note: |\n  • kept\nnext: “x”\n")
    assert (typo.line, typo.column) == (3, 7)


def test_every_typographic_character_of_a_document_is_found_in_one_pass() -> None:
    text = "name: “run”\nitems:\n  • a\n  • b  # • a comment\nlease：3\n"
    found = [(t.line, t.column, t.char) for t in every_typography(text)]
    assert found == [(1, 7, "“"), (3, 3, "•"), (4, 3, "•"), (5, 6, "：")]  # the first on each line
    assert find_typography(text).char == "“"  # the first of them
    assert every_typography("lease: 3\n") == []


def test_tag_names_read_as_written() -> None:
    assert tag_name("tag:yaml.org,2002:python/name:os.system") == "!!python/name:os.system"
    assert tag_name("!local") == "!local"
