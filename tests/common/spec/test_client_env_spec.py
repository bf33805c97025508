"""Spec of client-hosted environments and of the LM game; the seed's declared sizes checked
against a gymnasium environment's real spaces, through the client (before anything is sent)."""

from __future__ import annotations

import pytest

from opentinker_client import Environment, InvalidArgumentError, RLClient
from opentinker_client.environment import client_env_config
from opentinker_common.spec import ClientEnvConfig, LMGameGRPOConfig, SpecError, TaskSpecModel, validate_env_config

OK = {"env_id": "client", "endpoint": "127.0.0.1:50123", "action_space": 4, "observation_space": 16}


def test_client_env_config_parses_with_defaults():
    cfg = validate_env_config(OK)
    assert isinstance(cfg, ClientEnvConfig)
    assert (cfg.timeout_s, cfg.grace_s, cfg.observation_type, cfg.action_names) == (30.0, 30.0, "discrete", ())
    assert validate_env_config({**OK, "endpoint": "[::1]:9"}).endpoint == "[::1]:9"
    assert validate_env_config({**OK, "endpoint": "trainer-env.example.org:443"}).endpoint.endswith(":443")


@pytest.mark.parametrize(
    "change, field",
    [
        ({"endpoint": ""}, "spec.env_config.endpoint"),
        ({"endpoint": "localhost"}, "spec.env_config.endpoint"),
        ({"endpoint": "localhost:0"}, "spec.env_config.endpoint"),
        ({"endpoint": "localhost:70000"}, "spec.env_config.endpoint"),
        ({"endpoint": "http://x:1"}, "spec.env_config.endpoint"),
        ({"action_space": 0}, "spec.env_config.action_space"),
        ({"observation_space": -1}, "spec.env_config.observation_space"),
        ({"observation_type": "image"}, "spec.env_config.observation_type"),
        ({"timeout_s": 0}, "spec.env_config.timeout_s"),
        ({"grace_s": -1}, "spec.env_config.grace_s"),
        ({"action_names": ["a", "b"]}, "spec.env_config.action_names"),
        ({"action_names": ["a", "a", "b", "c"]}, "spec.env_config.action_names"),
        ({"code": "import os"}, "spec.env_config.code"),
    ],
)
def test_client_env_config_refusals_name_the_field(change, field):
    with pytest.raises(SpecError) as err:
        validate_env_config({**OK, **change})
    assert err.value.field == field


TOKEN = "AbCdEfGhIjKlMnOpQrStUvWxYz_0123456789-abcd"  # 43 url-safe characters, like token_urlsafe(32)
PEM = "-----BEGIN CERTIFICATE-----\nMIIBszCCAVmgAwIBAgIU\n-----END CERTIFICATE-----\n"


def test_token_and_tls_fields_parse_and_stay_out_of_the_repr():
    cfg = validate_env_config({**OK, "token": TOKEN, "tls": True, "tls_root_certificates": PEM})
    assert (cfg.token, cfg.tls, cfg.tls_root_certificates) == (TOKEN, True, PEM)
    assert TOKEN not in repr(cfg) and "BEGIN CERTIFICATE" not in repr(cfg)
    assert validate_env_config(OK).token == ""  # a server started with require_token=False
    assert validate_env_config({**OK, "tls": True}).tls_root_certificates == ""  # system roots
    spec = TaskSpecModel.from_parts(
        workload_type="full_rl", model="", env_config={**OK, "token": TOKEN}, hyperparameters={}
    )
    assert TOKEN not in repr(spec)


@pytest.mark.parametrize(
    "change, field, expected",
    [
        ({"token": "short"}, "token", "16..256 characters"),
        ({"token": "t" * 257}, "token", "16..256 characters"),
        ({"token": "has space in the token value"}, "token", "url-safe characters only"),
        ({"token": "slashes/and+plus=signs000"}, "token", "url-safe characters only"),
        ({"token": "ünïcödé-characters-in-token"}, "token", "url-safe characters only"),
        ({"token": 12}, "token", "a string"),
        ({"tls": "yes"}, "tls", "true or false"),
        ({"tls_root_certificates": PEM}, "tls_root_certificates", "empty unless tls is true"),
        (
            {"tls": True, "tls_root_certificates": "not a certificate"},
            "tls_root_certificates",
            "PEM text of a CA certificate",
        ),
        (
            {"tls": True, "tls_root_certificates": "-----BEGIN CERTIFICATE-----\nAAAA"},
            "tls_root_certificates",
            "PEM text",
        ),
        ({"tls": True, "tls_root_certificates": PEM * 2000}, "tls_root_certificates", "at most 65536 bytes"),
        (
            {
                "tls": True,
                "tls_root_certificates": PEM + "-----BEGIN PRIVATE KEY-----\nAA\n-----END PRIVATE KEY-----\n",
            },
            "tls_root_certificates",
            "PRIVATE KEY",
        ),
    ],
)
def test_token_and_tls_refusals_name_the_field_and_never_echo_the_token(change, field, expected):
    with pytest.raises(SpecError) as err:
        validate_env_config({**OK, **change})
    assert err.value.field == f"spec.env_config.{field}" and expected in str(err.value)
    if field == "token" and isinstance(change["token"], str):
        assert change["token"] not in str(err.value) and change["token"][:8] not in str(err.value)


def test_client_env_config_requires_both_sizes():
    for missing in ("action_space", "observation_space"):
        data = {k: v for k, v in OK.items() if k != missing}
        with pytest.raises(SpecError) as err:
            validate_env_config(data)
        assert err.value.field == f"spec.env_config.{missing}" and "required" in str(err.value)


def test_lora_finetune_on_a_gym_env_takes_lm_game_hyperparameters():
    spec = TaskSpecModel.from_parts(
        workload_type="lora_finetune",
        model="m",
        env_config={"env_id": "FrozenLake-v1"},
        hyperparameters={"max_turns": 6, "invalid_action_reward": -0.5},
    )
    assert isinstance(spec.hyperparameters, LMGameGRPOConfig)
    assert spec.hyperparameters.max_turns == 6 and spec.hyperparameters.reward_shaping == "none"
    for bad, field in (
        ({"episodes_per_step": 1}, "episodes_per_step"),
        ({"reward_shaping": "magic"}, "reward_shaping"),
        ({"prompts_per_step": 4}, "prompts_per_step"),
    ):
        with pytest.raises(SpecError) as err:
            TaskSpecModel.from_parts(workload_type="lora_finetune", model="m", env_config=OK, hyperparameters=bad)
        assert err.value.field == f"spec.hyperparameters.{field}"


class Declared(Environment):
    def __init__(self, **kw):
        super().__init__(action_space=kw.pop("action_space", 2), observation_space=kw.pop("observation_space", 3), **kw)

    def reset(self, seed=None):
        return 0

    def step(self, action):
        return 0, 0.0, True, False, {}


def test_hosted_environment_config_and_refusals():
    env = Declared(timeout_s=5, action_names=["left", "right"])
    assert env.is_client_hosted and not Environment().is_client_hosted
    cfg = client_env_config(env, endpoint="127.0.0.1:1")
    assert (cfg.action_space, cfg.observation_space, cfg.timeout_s, cfg.action_names) == (2, 3, 5.0, ("left", "right"))
    with pytest.raises(InvalidArgumentError) as err:
        client_env_config(Declared(action_space=None), endpoint="127.0.0.1:1")
    assert err.value.field == "spec.env_config.action_space"
    with pytest.raises(InvalidArgumentError) as err:
        client_env_config(Declared(max_digits=3), endpoint="127.0.0.1:1")
    assert err.value.field == "spec.env_config.max_digits"
    with pytest.raises(InvalidArgumentError) as err:
        env.to_dict()  # a hosted env has no endpoint until it is served
    assert "serve_environment" in str(err.value)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"action_space": 5, "observation_space": 16}, "spec.env_config.action_space"),
        ({"action_space": 4, "observation_space": 100}, "spec.env_config.observation_space"),
    ],
)
def test_seed_sizes_checked_against_the_real_gym_spaces_through_the_client(kwargs, field):
    """Environment(action_space=..., observation_space=...) on FrozenLake-v1 (Discrete(4), Discrete(16)):
    a disagreement is refused by RLClient.submit_task before anything is sent (no scheduler runs here)."""
    env = Environment(env_id="FrozenLake-v1", **kwargs)
    with RLClient(scheduler_url="127.0.0.1:1", timeout=1) as client:
        with pytest.raises(InvalidArgumentError) as err:
            client.submit_task(env_config=env, workload_type="lora_finetune", model="m")
    assert err.value.field == field
    assert "FrozenLake-v1" in str(err.value) and "Discrete" in str(err.value)
    assert Environment(env_id="FrozenLake-v1", action_space=4, observation_space=16).to_dict()["action_space"] == 4
