"""GRPO hyper-parameters on a causal LM (text and games): the loss aggregation field."""

from __future__ import annotations

import pytest

from opentinker_common.spec import SpecError, TaskSpecModel
from opentinker_common.spec.lm_fields import LOSS_AGGREGATIONS

CASES = [
    ("lora_finetune", {"env_id": "arithmetic"}),
    ("full_rl", {"env_id": "arithmetic"}),
    ("lora_finetune", {"env_id": "FrozenLake-v1"}),
]


def spec(workload, env_config, hp):
    return TaskSpecModel.from_parts(workload_type=workload, model="-", env_config=env_config, hyperparameters=hp)


@pytest.mark.parametrize(("workload", "env"), CASES)
def test_loss_aggregation_defaults_to_token_mean_and_takes_each_name(workload, env):
    assert spec(workload, env, {}).hyperparameters.loss_aggregation == "token_mean"
    for name in LOSS_AGGREGATIONS:
        assert spec(workload, env, {"loss_aggregation": name}).hyperparameters.loss_aggregation == name


@pytest.mark.parametrize(("workload", "env"), CASES)
def test_an_unknown_loss_aggregation_is_refused_with_its_field_path(workload, env):
    with pytest.raises(SpecError) as err:
        spec(workload, env, {"loss_aggregation": "bnpo"})
    assert err.value.field == "spec.hyperparameters.loss_aggregation"
    assert "one of token_mean, seq_mean, dr_grpo" in err.value.expected
