"""GRPO trainers refuse ``top_p < 1`` at submit: the importance ratio would be wrong.

The trainer's log-probs (the ``pi`` and ``pi_old`` of the ratio, and the KL terms) are under the
full softmax; a nucleus sampler draws from its truncation. Text (``lora_finetune``, ``full_rl``)
and games (``lora_finetune`` on ``gym``) alike; inference keeps ``top_p`` (per request).
"""

from __future__ import annotations

import pytest

from opentinker_common.spec import SpecError, TaskSpecModel

CASES = [
    ("lora_finetune", {"env_id": "arithmetic"}),
    ("full_rl", {"env_id": "arithmetic"}),
    ("lora_finetune", {"env_id": "FrozenLake-v1"}),
]


def spec(workload, env_config, hp):
    return TaskSpecModel.from_parts(workload_type=workload, model="-", env_config=env_config, hyperparameters=hp)


@pytest.mark.parametrize(("workload", "env"), CASES)
@pytest.mark.parametrize("top_p", [0.9, 0.5, 1e-3])
def test_top_p_below_one_is_refused_for_training_with_the_reason(workload, env, top_p):
    with pytest.raises(SpecError) as err:
        spec(workload, env, {"top_p": top_p})
    assert err.value.field == "spec.hyperparameters.top_p"
    assert err.value.expected.startswith("1.0 ")
    assert "importance ratio" in err.value.expected and "full-softmax" in err.value.expected
    assert "top_p is for inference" in err.value.expected


@pytest.mark.parametrize(("workload", "env"), CASES)
def test_top_p_one_spelled_out_still_validates(workload, env):
    assert spec(workload, env, {"top_p": 1.0}).hyperparameters.top_p == 1.0
    assert spec(workload, env, {}).hyperparameters.top_p == 1.0
