"""A spec is checked whole: one refusal names every bad field it has (``SpecError.also``), so a
person fixes them in one go; checks that combine fields run once those fields are valid."""

from __future__ import annotations


import pytest

from opentinker_common.spec import SpecError, TaskSpecModel, parse_dataclass
from opentinker_common.spec._parse import MAX_NAMED_OTHERS, raise_if_any
from opentinker_common.spec.grpo import GRPOConfig


def _fields(err: SpecError) -> list[str]:
    return [p.field for p in err.problems]


def _task(**overrides):
    parts = dict(
        workload_type="lora_finetune",
        model="/models/m",
        env_config={"env_id": "arithmetic"},
        hyperparameters={},
    )
    parts.update(overrides)
    return TaskSpecModel.from_parts(**parts)


def test_every_bad_key_of_a_mapping_is_named_in_one_refusal() -> None:
    with pytest.raises(SpecError) as err:
        parse_dataclass(GRPOConfig, {"steps": 0, "learning_rate": "fast", "stesp": 3}, "spec.hyperparameters")
    assert _fields(err.value) == [
        "spec.hyperparameters.stesp",  # unknown keys first, then the fields in their order
        "spec.hyperparameters.steps",
        "spec.hyperparameters.learning_rate",
    ]
    first = err.value
    assert first.field == "spec.hyperparameters.stesp" and "did you mean 'steps'?" in first.detail
    assert str(first) == (
        f"{first.detail} (and 2 more: spec.hyperparameters.steps, spec.hyperparameters.learning_rate)"
    )
    assert [p.also for p in first.also] == [(), ()]  # flat: the others carry no others


def test_one_bad_field_reads_as_before() -> None:
    with pytest.raises(SpecError) as err:
        parse_dataclass(GRPOConfig, {"steps": 0}, "spec.hyperparameters")
    assert err.value.also == () and err.value.problems == (err.value,)
    assert str(err.value) == err.value.detail
    assert str(err.value).startswith("spec.hyperparameters.steps: expected an integer in [1, ")


def test_the_independent_parts_of_a_task_are_all_checked() -> None:
    with pytest.raises(SpecError) as err:
        _task(
            gpu_count=-1,
            max_attempts=500,
            priority="high",
            env_config={"env_id": "arithmetic", "max_digits": 99},
            hyperparameters={"steps": 0},
            tracking={"tensorboard": "relative/dir"},
        )
    assert _fields(err.value) == [
        "spec.resources.gpu_count",
        "spec.limits.max_attempts",
        "spec.priority",
        "spec.env_config.max_digits",
        "spec.hyperparameters.steps",
        "spec.tracking.tensorboard",
    ]


def test_hyperparameters_are_checked_for_the_named_environment_when_another_env_key_is_bad() -> None:
    # a gym environment's PPO keys are right for CartPole even though its max_episode_steps is bad
    with pytest.raises(SpecError) as err:
        _task(
            workload_type="full_rl",
            model="",
            env_config={"env_id": "CartPole-v1", "max_episode_steps": -5},
            hyperparameters={"steps": 0, "lora_rank": 8},
        )
    fields = _fields(err.value)
    assert fields[0] == "spec.env_config.max_episode_steps"
    assert "spec.hyperparameters.lora_rank" in fields  # not a PPO key: checked against PPO's class
    assert "spec.model" not in fields  # a gym task needs no model


def test_a_rule_that_combines_fields_waits_for_them_to_be_valid() -> None:
    # nodes > 1 needs gpu_count >= 1; with gpu_count itself bad only that is said
    with pytest.raises(SpecError) as err:
        _task(gpu_count="two", nodes=2)
    assert _fields(err.value) == ["spec.resources.gpu_count"]
    assert "an integer in [0, 1024]" in err.value.detail
    with pytest.raises(SpecError) as err:
        _task(gpu_count=0, nodes=2)
    assert _fields(err.value) == ["spec.resources.gpu_count"] and "at least 1" in err.value.detail


def test_an_unknown_workload_does_not_guess_at_the_rest() -> None:
    with pytest.raises(SpecError) as err:
        _task(workload_type="lora_finetun", model="", hyperparameters={"stesp": 3})
    assert _fields(err.value) == ["spec.workload_type"]  # no model or hyperparameter class to judge by
    assert "did you mean 'lora_finetune'?" in err.value.detail


def test_combine_flattens_and_caps_the_names_in_the_message() -> None:
    errors = [SpecError(f"spec.f{i}", "x") for i in range(MAX_NAMED_OTHERS + 4)]
    inner = SpecError.combine(errors[1:3])
    combined = SpecError.combine([errors[0], inner, *errors[3:]])
    assert _fields(combined) == [e.field for e in errors]
    rest = len(errors) - 1
    assert str(combined).endswith(f", ... {rest - MAX_NAMED_OTHERS} more)")
    assert str(combined).startswith(f"spec.f0: expected x (and {rest} more: spec.f1, spec.f2,")
    assert len(str(combined)) < 1500
    assert errors[0].also == () and str(errors[0]) == "spec.f0: expected x"  # the originals are unchanged
    raise_if_any([])  # nothing to raise
    with pytest.raises(SpecError) as err:
        raise_if_any([errors[5]])
    assert err.value is errors[5]
