import pytest

from opentinker_client import Environment, InvalidArgumentError


def test_seed_usage():
    env = Environment(action_space=4, observation_space=100)
    assert env.to_dict() == {"env_id": "arithmetic", "action_space": 4, "observation_space": 100}


def test_defaults_and_options():
    assert Environment().to_dict() == {"env_id": "arithmetic"}
    d = Environment(env_id="arithmetic", min_digits=1, max_digits=2, seed=None).to_dict()
    assert d == {"env_id": "arithmetic", "min_digits": 1, "max_digits": 2}


def test_to_dict_returns_a_fresh_dict():
    env = Environment(max_digits=2)
    env.to_dict()["max_digits"] = 9
    assert env.to_dict()["max_digits"] == 2


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_digits": 20}, "spec.env_config.max_digits"),
        ({"min_digits": "one"}, "spec.env_config.min_digits"),
        ({"min_digits": 3, "max_digits": 2}, "spec.env_config.max_digits"),
        ({"action_space": 0}, "spec.env_config.action_space"),
        ({"colour": "red"}, "spec.env_config.colour"),
        ({"env_id": "CartPole-v99"}, "spec.env_config.env_id"),
        ({"min_digits": True}, "spec.env_config.min_digits"),
    ],
)
def test_bad_values(kwargs, field):
    with pytest.raises(InvalidArgumentError) as exc:
        Environment(**kwargs).to_dict()
    assert exc.value.field == field
    assert field in str(exc.value)
    assert str(exc.value).startswith("INVALID_ARGUMENT: ")


def test_unknown_option_says_so():
    with pytest.raises(InvalidArgumentError, match="unknown key"):
        Environment(colour="red").to_dict()


def test_repr_and_eq():
    a = Environment(action_space=4, max_digits=2)
    assert repr(a) == "Environment(env_id='arithmetic', action_space=4, max_digits=2)"
    assert a == Environment(action_space=4, max_digits=2)
    assert a != Environment(action_space=5, max_digits=2)


def test_a_client_hosted_environment_needs_both_reset_and_step() -> None:
    from opentinker_client import Environment
    from opentinker_client.environment import client_env_config

    class OnlyReset(Environment):
        def reset(self, seed=None):
            return 0

    env = OnlyReset(action_space=2, observation_space=3)
    assert env.is_client_hosted
    with pytest.raises(
        InvalidArgumentError, match=r"defines both reset\(\) and step\(\); OnlyReset does not define step\(\)"
    ):
        client_env_config(env, endpoint="127.0.0.1:5000")


def test_client_only_options_on_a_built_in_environment_say_what_to_do() -> None:
    from opentinker_client import Environment

    with pytest.raises(
        InvalidArgumentError, match=r"only client-hosted environments take action_names: subclass Environment"
    ) as err:
        Environment(action_names=["left", "right"]).to_dict()
    assert err.value.field == "spec.env_config.action_names"
    with pytest.raises(InvalidArgumentError, match="timeout_s"):
        Environment(env_id="CartPole-v1", timeout_s=3).to_dict()
    assert Environment(env_id="CartPole-v1", seed=3).to_dict() == {"env_id": "CartPole-v1", "seed": 3}


def test_an_empty_env_id_is_refused_but_a_missing_one_is_arithmetic() -> None:
    from opentinker_client import Environment
    from opentinker_common.spec import SpecError, validate_env_config

    with pytest.raises(
        InvalidArgumentError,
        match=r"spec.env_config.env_id: expected an environment id.*leave env_id out for arithmetic",
    ) as err:
        Environment(env_id="").to_dict()
    assert err.value.field == "spec.env_config.env_id"
    with pytest.raises(SpecError):
        validate_env_config({"env_id": ""})
    assert validate_env_config({}).env_id == "arithmetic"
    assert validate_env_config({"max_digits": 3}).env_id == "arithmetic"
