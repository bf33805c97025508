"""An ``inference`` task serving a full-weight checkpoint (``checkpoint_task_id``,
``checkpoint_step``): the fields it is given with, and the combinations refused at submit."""

from __future__ import annotations

import pytest

from opentinker_common.spec import SpecError, TaskSpecModel


def spec(hp):
    return TaskSpecModel.from_parts(workload_type="inference", model="/models/m", env_config={}, hyperparameters=hp)


def test_a_task_and_a_step_are_accepted() -> None:
    hp = spec({"checkpoint_task_id": "task-1", "checkpoint_step": 4}).hyperparameters
    assert (hp.checkpoint_task_id, hp.checkpoint_step) == ("task-1", 4)
    plain = spec({}).hyperparameters
    assert (plain.checkpoint_task_id, plain.checkpoint_step) == ("", 0)


@pytest.mark.parametrize(
    ("hp", "field", "expected"),
    [
        ({"checkpoint_task_id": "task-1", "policies_only": True}, "policies_only", "false with checkpoint_task_id"),
        ({"checkpoint_step": 3}, "checkpoint_step", "0 without checkpoint_task_id"),
        ({"checkpoint_task_id": "task-1", "checkpoint_step": -1}, "checkpoint_step", ""),
        ({"checkpoint_task_id": 7}, "checkpoint_task_id", "a string"),
    ],
)
def test_contradictions_and_bad_values_are_refused_naming_the_field(hp, field, expected) -> None:
    with pytest.raises(SpecError) as err:
        spec(hp)
    assert err.value.field == f"spec.hyperparameters.{field}"
    assert err.value.expected.startswith(expected)
