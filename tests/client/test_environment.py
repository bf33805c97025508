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
