"""Spec of lora_session: defaults, and bad settings refused with their field path."""

from __future__ import annotations

import pytest

from opentinker_common.spec import LoraSessionConfig, SpecError, TaskSpecModel


def spec(**hp) -> TaskSpecModel:
    return TaskSpecModel.from_parts(workload_type="lora_session", model="m", env_config={}, hyperparameters=hp)


def test_defaults_and_a_valid_session() -> None:
    cfg = spec().hyperparameters
    assert isinstance(cfg, LoraSessionConfig) and cfg.lora_rank == 16 and cfg.idle_timeout_s == 1800.0
    assert cfg.max_datums_per_call == 1024 and cfg.max_in_flight_calls == 4
    assert spec(lora_rank=4, target_modules=["q_proj"]).hyperparameters.target_modules == ("q_proj",)


@pytest.mark.parametrize(
    ("hp", "field"),
    [
        ({"lora_rank": 0}, "spec.hyperparameters.lora_rank"),
        ({"idle_timeout_s": 0}, "spec.hyperparameters.idle_timeout_s"),
        ({"max_in_flight_calls": 0}, "spec.hyperparameters.max_in_flight_calls"),
        ({"target_modules": []}, "spec.hyperparameters.target_modules"),
        ({"learning_rate": 1e-3}, "spec.hyperparameters.learning_rate"),  # not a session setting: per optim_step
    ],
)
def test_bad_settings_name_their_field(hp, field) -> None:
    with pytest.raises(SpecError) as err:
        spec(**hp)
    assert err.value.field == field
