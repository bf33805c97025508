"""An unknown key is refused with the known ones and, when one is close (difflib), a "did you
mean": in spec dataclasses (hyper-parameters), ``spec.tracking``, multi-agent ``env_kwargs`` and
the scheduler's config file, with the field path (and file, line, column) kept."""

from __future__ import annotations

import pytest

from opentinker_common.spec import SpecError, did_you_mean, parse_dataclass
from opentinker_common.spec.grpo import GRPOConfig
from opentinker_common.spec.multiagent import check_env_kwargs
from opentinker_common.spec.tracking import parse_tracking


def test_did_you_mean_names_the_close_keys_best_first_or_nothing() -> None:
    assert did_you_mean("stesp", ["steps", "seed", "top_p"]) == "did you mean 'steps'?"
    assert did_you_mean("lora_rnk", ["lora_rank", "lora_alpha", "steps"]).startswith("did you mean 'lora_rank'")
    assert did_you_mean("zzzz", ["steps", "seed"]) == ""
    assert did_you_mean(3, ["steps"]) == ""  # a YAML key that is not text


def test_a_typod_hyperparameter_keeps_its_path_and_gets_a_suggestion() -> None:
    with pytest.raises(SpecError) as err:
        parse_dataclass(GRPOConfig, {"stesp": 3}, "spec.hyperparameters")
    assert err.value.field == "spec.hyperparameters.stesp"
    assert err.value.expected.startswith("one of the known keys (") and "steps" in err.value.expected
    assert str(err.value).endswith("; did you mean 'steps'?")


def test_several_typos_each_get_their_own_suggestion() -> None:
    with pytest.raises(SpecError) as err:
        parse_dataclass(GRPOConfig, {"stesp": 3, "lora_rnk": 4, "zzzz": 1}, "spec.hyperparameters")
    assert str(err.value).endswith("did you mean 'lora_rank' for 'lora_rnk', 'steps' for 'stesp'?")


def test_no_close_key_no_suggestion() -> None:
    with pytest.raises(SpecError) as err:
        parse_dataclass(GRPOConfig, {"qqqqqqqq": 3}, "spec.hyperparameters")
    assert "did you mean" not in str(err.value)


def test_tracking_and_multiagent_options_suggest_too() -> None:
    with pytest.raises(SpecError, match=r"spec\.tracking\.wandbb: .*did you mean 'wandb'\?$"):
        parse_tracking({"wandbb": {"project": "p"}})
    with pytest.raises(SpecError, match=r"did you mean 'local_ratio'\?$"):
        check_env_kwargs("mpe2/simple_spread_v3", {"local_ration": 0.5}, "spec.env_config.env_kwargs")


def test_the_scheduler_config_suggests_with_file_and_line() -> None:
    from opentinker_scheduler.config import ConfigError, parse_config

    with pytest.raises(ConfigError) as err:
        parse_config("resource_pol:\n  - node_id: a\n", "sched.yaml")
    assert str(err.value).startswith("sched.yaml:1:1: resource_pol: expected one of the known keys (")
    assert str(err.value).endswith("unknown key; did you mean 'resource_pool'?")


def test_a_typod_workload_type_or_env_id_gets_a_suggestion() -> None:
    from opentinker_common.spec import TaskSpecModel

    with pytest.raises(SpecError) as err:
        TaskSpecModel.from_parts(workload_type="lora_finetun", model="m", env_config={}, hyperparameters={})
    assert err.value.field == "spec.workload_type" and str(err.value).endswith("; did you mean 'lora_finetune'?")
    with pytest.raises(SpecError) as err:
        TaskSpecModel.from_parts(
            workload_type="lora_finetune", model="m", env_config={"env_id": "arithmetc"}, hyperparameters={}
        )
    assert err.value.field == "spec.env_config.env_id" and str(err.value).endswith("; did you mean 'arithmetic'?")
    with pytest.raises(SpecError) as err:  # nothing close: no suggestion
        TaskSpecModel.from_parts(
            workload_type="lora_finetune", model="m", env_config={"env_id": "zzzz"}, hyperparameters={}
        )
    assert "did you mean" not in str(err.value)
