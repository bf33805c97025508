"""``plain``: a spec dataclass as JSON-able values, exactly what ``jsonable(asdict(...))`` gives."""

from __future__ import annotations

import dataclasses
import json

import pytest

from opentinker_common.spec import jsonable, plain
from opentinker_common.spec.registry import hyperparameters_class, workload_env_kinds
from opentinker_common.spec.task import TaskSpecModel


@pytest.mark.parametrize("workload_type,env_kind", sorted(workload_env_kinds()))
def test_every_workloads_defaults_match_asdict(workload_type, env_kind):
    cls = hyperparameters_class(workload_type, env_kind)
    hp = cls()
    assert plain(hp) == jsonable(dataclasses.asdict(hp))
    assert list(plain(hp)) == [f.name for f in dataclasses.fields(cls)]  # field order kept
    json.dumps(plain(hp))  # JSON-able as it stands


def test_nested_dataclasses_tuples_and_dicts_become_plain_values():
    @dataclasses.dataclass(frozen=True)
    class Inner:
        rank: int = 8
        targets: tuple[str, ...] = ("q_proj", "v_proj")

    @dataclasses.dataclass(frozen=True)
    class Outer:
        inner: Inner = Inner()
        schedule: tuple[tuple[int, float], ...] = ((0, 0.2), (100, 0.1))
        extra: dict = dataclasses.field(default_factory=lambda: {"a": (1, 2)})

    out = plain(Outer())
    assert out == {
        "inner": {"rank": 8, "targets": ["q_proj", "v_proj"]},
        "schedule": [[0, 0.2], [100, 0.1]],
        "extra": {"a": [1, 2]},
    }
    assert out == jsonable(dataclasses.asdict(Outer()))


def test_a_class_is_not_taken_for_an_instance():
    @dataclasses.dataclass(frozen=True)
    class Hp:
        lr: float = 1e-4

    assert plain(Hp) is Hp


def test_a_whole_task_spec_matches_asdict():
    model = TaskSpecModel.from_parts(
        workload_type="lora_finetune",
        model="HuggingFaceTB/SmolLM2-135M-Instruct",
        env_config={"env_id": "arithmetic"},
        hyperparameters={"steps": 3},
        gpu_count=1,
    )
    assert model.to_dict() == jsonable(dataclasses.asdict(model))
    assert model.to_dict()["hyperparameters"]["steps"] == 3
