"""full_rl task specs: PPOConfig, multi-agent env configs and their errors (field paths)."""

from __future__ import annotations

import pytest

from opentinker_common.spec import (
    MULTIAGENT_ENVIRONMENTS,
    MultiAgentEnvConfig,
    MultiAgentPPOConfig,
    PPOConfig,
    SpecError,
    TaskSpecModel,
    env_kind,
)


def spec(env_config, hp=None, workload="full_rl"):
    return TaskSpecModel.from_parts(workload_type=workload, model="-", env_config=env_config, hyperparameters=hp or {})


def test_gym_env_gets_ppo_with_cleanrl_defaults() -> None:
    s = spec({"env_id": "CartPole-v1"})
    hp = s.hyperparameters
    assert type(hp) is PPOConfig and env_kind(s.env) == "gym"
    assert (hp.num_envs, hp.num_steps, hp.learning_rate, hp.gamma, hp.gae_lambda) == (4, 128, 2.5e-4, 0.99, 0.95)
    assert (hp.num_minibatches, hp.update_epochs, hp.clip_coef, hp.ent_coef, hp.vf_coef, hp.max_grad_norm) == (
        4,
        4,
        0.2,
        0.01,
        0.5,
        0.5,
    )
    assert hp.anneal_lr and hp.clip_vloss and hp.norm_adv and hp.target_kl is None and hp.hidden_sizes == (64, 64)
    assert hp.clip_schedule == "constant"  # today's curves stay: a constant clip, value loss clipped
    assert hp.batch_size == 512 and hp.num_updates == 500_000 // 512
    assert hp.vector_mode == "sync"


def test_rl_zoo_clip_options_are_accepted_for_single_and_multi_agent_ppo() -> None:
    zoo = {"clip_schedule": "linear", "clip_vloss": False, "target_kl": 0.015}
    for env in ({"env_id": "CartPole-v1"}, {"env_id": "mpe2/simple_spread_v3"}):
        hp = spec(env, zoo).hyperparameters
        assert (hp.clip_schedule, hp.clip_vloss, hp.target_kl) == ("linear", False, 0.015)


def test_numbers_from_protobuf_struct_are_accepted() -> None:
    hp = spec(
        {"env_id": "CartPole-v1"}, {"num_envs": 2.0, "hidden_sizes": [32.0, 16.0], "target_kl": 0.02}
    ).hyperparameters
    assert hp.num_envs == 2 and hp.hidden_sizes == (32, 16) and hp.target_kl == 0.02


@pytest.mark.parametrize(
    ("hp", "field", "expected"),
    [
        ({"learning_rate": 0}, "spec.hyperparameters.learning_rate", "a number in (0.0, 1.0]"),
        ({"num_envs": 0}, "spec.hyperparameters.num_envs", "an integer in [1, 1024]"),
        ({"num_envs": 2.5}, "spec.hyperparameters.num_envs", "an integer"),
        ({"gamma": 1.5}, "spec.hyperparameters.gamma", "[0.0, 1.0]"),
        ({"clip_coef": -0.1}, "spec.hyperparameters.clip_coef", "(0.0, 10.0]"),
        ({"anneal_lr": "yes"}, "spec.hyperparameters.anneal_lr", "true or false"),
        ({"hidden_sizes": [64, 0]}, "spec.hyperparameters.hidden_sizes[1]", "an integer in [1, 4096]"),
        ({"hidden_sizes": []}, "spec.hyperparameters.hidden_sizes", "1 to 8 layer widths"),
        ({"hidden_sizes": 64}, "spec.hyperparameters.hidden_sizes", "a list"),
        ({"vector_mode": "fork"}, "spec.hyperparameters.vector_mode", "one of sync, async"),
        ({"async_context": "fork"}, "spec.hyperparameters.async_context", "one of spawn, forkserver"),
        ({"activation": "gelu"}, "spec.hyperparameters.activation", "one of tanh, relu"),
        ({"total_timesteps": 100}, "spec.hyperparameters.total_timesteps", ">= num_envs * num_steps (512)"),
        (
            {"num_steps": 2, "num_envs": 2, "num_minibatches": 5},
            "spec.hyperparameters.num_minibatches",
            "<= num_envs * num_steps (4)",
        ),
        ({"target_kl": 0}, "spec.hyperparameters.target_kl", "(0.0, 100.0]"),
        ({"target_kl": -0.01}, "spec.hyperparameters.target_kl", "(0.0, 100.0]"),
        ({"target_kl": "0.01"}, "spec.hyperparameters.target_kl", "a number"),
        ({"clip_schedule": "cosine"}, "spec.hyperparameters.clip_schedule", "one of constant, linear"),
        ({"clip_schedule": "lin_0.2"}, "spec.hyperparameters.clip_schedule", "one of constant, linear"),
        ({"clip_schedule": 1}, "spec.hyperparameters.clip_schedule", "a string"),
        ({"clip_vloss": "false"}, "spec.hyperparameters.clip_vloss", "true or false"),
        ({"clip_vloss": 0}, "spec.hyperparameters.clip_vloss", "true or false"),
        ({"lr": 0.1}, "spec.hyperparameters.lr", "one of the known keys"),
        ({"parameter_sharing": True}, "spec.hyperparameters.parameter_sharing", "one of the known keys"),
    ],
)
def test_bad_ppo_hyperparameters_name_the_field(hp, field, expected) -> None:
    with pytest.raises(SpecError) as err:
        spec({"env_id": "CartPole-v1"}, hp)
    assert err.value.field == field
    assert expected in err.value.expected


@pytest.mark.parametrize(
    ("env", "field", "expected"),
    [
        ({"env_id": "NoSuchEnv-v0"}, "spec.env_config.env_id", "a registered gymnasium id"),
        ({"env_id": "os:system-v0"}, "spec.env_config.env_id", "one of"),
        ({"env_id": "CartPole-v1", "action_space": 3}, "spec.env_config.action_space", "Discrete(2)"),
        ({"env_id": "CartPole-v1", "observation_space": 5}, "spec.env_config.observation_space", "(4,)"),
        ({"env_id": "FrozenLake-v1", "env_kwargs": {"map_name": "9x9"}}, "spec.env_config.env_id", "env_kwargs"),
    ],
)
def test_bad_gym_env_configs_name_the_field(env, field, expected) -> None:
    with pytest.raises(SpecError) as err:
        spec(env)
    assert err.value.field == field
    assert expected in err.value.expected


def test_multiagent_env_gets_multiagent_ppo() -> None:
    s = spec(
        {"env_id": "mpe2/simple_spread_v3", "env_kwargs": {"N": 2}, "action_space": 5}, {"parameter_sharing": False}
    )
    assert type(s.env) is MultiAgentEnvConfig and env_kind(s.env) == "multiagent"
    assert type(s.hyperparameters) is MultiAgentPPOConfig and s.hyperparameters.parameter_sharing is False
    assert s.hyperparameters.num_envs == 8  # its own defaults


@pytest.mark.parametrize(
    ("env", "field", "expected"),
    [
        ({"env_id": "mpe2/simple_nope_v3"}, "spec.env_config.env_id", "PettingZoo parallel environment"),
        ({"env_id": "pettingzoo.butterfly.pistonball_v6"}, "spec.env_config.env_id", "mpe2/simple_spread_v3"),
        ({"env_id": "mpe2/os"}, "spec.env_config.env_id", "one of"),
        (
            {"env_id": "mpe2/simple_spread_v3", "env_kwargs": {"bogus": 1}},
            "spec.env_config.env_kwargs",
            "options mpe2/simple_spread_v3 accepts",
        ),
        (
            {"env_id": "mpe2/simple_spread_v3", "env_kwargs": {"render_mode": "human"}},
            "spec.env_config.env_kwargs.render_mode",
            "no render_mode",
        ),
        ({"env_id": "mpe2/simple_spread_v3", "action_space": 4}, "spec.env_config.action_space", "Discrete(5)"),
        (
            {"env_id": "mpe2/simple_spread_v3", "env_kwargs": {"N": 2}, "observation_space": 18},
            "spec.env_config.observation_space",
            "(12,)",
        ),
        (
            {"env_id": "mpe2/simple_spread_v3", "env_kwargs": {"N": [3]}},
            "spec.env_config.env_kwargs.N",
            "a number, a string",
        ),
    ],
)
def test_bad_multiagent_env_configs_name_the_field(env, field, expected) -> None:
    with pytest.raises(SpecError) as err:
        spec(env)
    assert err.value.field == field
    assert expected in err.value.expected


def test_multiagent_hyperparameters_are_checked_too() -> None:
    with pytest.raises(SpecError) as err:
        spec({"env_id": "mpe2/simple_spread_v3"}, {"parameter_sharing": "no"})
    assert err.value.field == "spec.hyperparameters.parameter_sharing"


def test_allow_list_only_names_modules_of_the_mpe2_package() -> None:
    assert MULTIAGENT_ENVIRONMENTS and all(m.startswith("mpe2.simple") for m in MULTIAGENT_ENVIRONMENTS.values())


def test_lora_finetune_does_not_run_on_multiagent_envs() -> None:
    with pytest.raises(SpecError) as err:
        spec({"env_id": "mpe2/simple_spread_v3"}, workload="lora_finetune")
    assert err.value.field == "spec.env_config.env_id"


def test_ppo_task_needs_no_model_but_lm_tasks_do() -> None:
    from opentinker_common.spec import SpecError, TaskSpecModel, task_uses_model

    spec = TaskSpecModel.from_parts(
        workload_type="full_rl", model="", env_config={"env_id": "CartPole-v1"}, hyperparameters={}
    )
    assert spec.model == "" and not task_uses_model("full_rl", {"env_id": "CartPole-v1"})
    assert task_uses_model("full_rl", {"env_id": "arithmetic"}) and task_uses_model("lora_finetune", {})
    with pytest.raises(SpecError, match="spec.model"):
        TaskSpecModel.from_parts(
            workload_type="full_rl", model="", env_config={"env_id": "arithmetic"}, hyperparameters={}
        )


def test_render_mode_refused_for_gym_ids() -> None:
    from opentinker_common.spec import SpecError, validate_env_config

    with pytest.raises(SpecError, match=r"spec.env_config.env_kwargs.render_mode: expected no render_mode"):
        validate_env_config({"env_id": "CartPole-v1", "env_kwargs": {"render_mode": "human"}})
