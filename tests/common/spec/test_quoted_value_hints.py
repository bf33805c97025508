"""A number or true/false written in quotes (``steps: "5"``) is text, and the error says so."""

from __future__ import annotations

import pytest

from opentinker_common.spec import SpecError, parse_dataclass
from opentinker_common.spec._parse import quoted_value_hint
from opentinker_common.spec.grpo import GRPOConfig


@pytest.mark.parametrize("text", ["5", " 12 ", "-3", "1e-4", "0.5", ".5"])
def test_a_quoted_number_where_a_number_is_expected_gets_the_hint(text) -> None:
    assert quoted_value_hint("an integer in [1, 100000]", text) == (
        f"that is text (a quoted value): write {text.strip()}, without quotes"
    )


@pytest.mark.parametrize("text", ["true", "False", "yes"])
def test_a_quoted_boolean_where_true_or_false_is_expected_gets_the_hint(text) -> None:
    assert quoted_value_hint("true or false", text).endswith(f"write {text.lower()}, without quotes")


@pytest.mark.parametrize(
    "expected, got",
    [
        ("an integer in [1, 100000]", "five"),  # not a number: no such hint
        ("an integer in [1, 100000]", 5.5),  # not text
        ("one of lora_finetune, sft", "5"),  # a number is not what is wanted
        ("true or false", "maybe"),
    ],
)
def test_no_hint_where_the_quotes_are_not_the_problem(expected, got) -> None:
    assert quoted_value_hint(expected, got) == ""


def test_a_quoted_step_count_in_hyperparameters_names_the_field_and_the_quotes() -> None:
    with pytest.raises(SpecError) as err:
        parse_dataclass(GRPOConfig, {"steps": "5"}, "spec.hyperparameters")
    assert err.value.field == "spec.hyperparameters.steps"
    assert str(err.value).endswith("got '5'; that is text (a quoted value): write 5, without quotes")


def test_a_hint_given_by_the_caller_is_kept() -> None:
    err = SpecError("spec.x", "an integer", "5", hint="did you mean 'y'?")
    assert str(err).endswith("; did you mean 'y'?")
