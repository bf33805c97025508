"""Bounds on ``env_config.env_kwargs`` before any environment is built.

Multi-agent ids: an explicit per-module table (types and ranges; unknown keys refused with the
accepted ones). Gymnasium ids: generic bounds on the values and the whole mapping's size. Every
refusal names the field path.
"""

from __future__ import annotations

import importlib
import inspect

import pytest

from opentinker_common.spec import MULTIAGENT_ENVIRONMENTS, SpecError, validate_env_config
from opentinker_common.spec.gym import check_env_kwargs_bounds
from opentinker_common.spec.multiagent import ENV_KWARGS, MAX_ENTITIES, import_parallel_env_module

SPREAD = "mpe2/simple_spread_v3"


def _refusal(env: dict) -> SpecError:
    with pytest.raises(SpecError) as err:
        validate_env_config(env)
    return err.value


# ------------------------------------------------------------------------------ multi-agent


def test_the_reported_spec_is_refused_before_anything_is_built(monkeypatch) -> None:
    import opentinker_common.spec.multiagent as ma

    def no_build(*_a):  # TEST DOUBLE: building must not even be tried
        raise AssertionError("the environment was built")

    monkeypatch.setattr(ma, "_real_spaces", no_build)
    for n in (3200, 6400, 33, 0, -1):
        err = _refusal({"env_id": SPREAD, "env_kwargs": {"N": n}})
        assert str(err) == f"spec.env_config.env_kwargs.N: expected an integer in [1, 32], got {n}"
    assert _refusal({"env_id": SPREAD, "env_kwargs": {"N": 2.5}}).field == "spec.env_config.env_kwargs.N"
    assert _refusal({"env_id": SPREAD, "env_kwargs": {"N": True}}).expected == "an integer in [1, 32]"


@pytest.mark.parametrize(
    ("env_id", "kwargs", "field", "expected"),
    [
        (SPREAD, {"local_ratio": 1.5}, "local_ratio", "a number in [0, 1]"),
        (SPREAD, {"local_ratio": "half"}, "local_ratio", "a number in [0, 1]"),
        (SPREAD, {"max_cycles": 0}, "max_cycles", "an integer in [1, 100000]"),
        (SPREAD, {"max_cycles": 100_001}, "max_cycles", "an integer in [1, 100000]"),
        (SPREAD, {"continuous_actions": 1}, "continuous_actions", "true or false"),
        (SPREAD, {"dynamic_rescaling": "yes"}, "dynamic_rescaling", "true or false"),
        (SPREAD, {"num_agent_neighbors": 64}, "num_agent_neighbors", "an integer in [1, 32]"),
        ("mpe2/simple_tag_v3", {"num_good": 100}, "num_good", "an integer in [1, 32]"),
        ("mpe2/simple_tag_v3", {"num_adversaries": 0}, "num_adversaries", "an integer in [1, 32]"),
        ("mpe2/simple_tag_v3", {"num_obstacles": 33}, "num_obstacles", "an integer in [0, 32]"),
        ("mpe2/simple_adversary_v3", {"N": 1000}, "N", "an integer in [1, 32]"),
        ("mpe2/simple_reference_v3", {"local_ratio": -0.1}, "local_ratio", "a number in [0, 1]"),
    ],
)
def test_out_of_range_values_name_the_key_and_the_range(env_id, kwargs, field, expected) -> None:
    err = _refusal({"env_id": env_id, "env_kwargs": kwargs})
    assert err.field == f"spec.env_config.env_kwargs.{field}"
    assert err.expected == expected


@pytest.mark.parametrize(
    ("env_id", "key"),
    [(SPREAD, "bogus"), ("mpe2/simple_v3", "N"), ("mpe2/simple_push_v3", "local_ratio"), (SPREAD, "benchmark_data")],
)
def test_unknown_keys_are_refused_with_the_accepted_ones(env_id, key) -> None:
    err = _refusal({"env_id": env_id, "env_kwargs": {key: 1}})
    assert err.field == "spec.env_config.env_kwargs"
    assert f"{key!r} is not one of them" in err.expected
    assert f"options {env_id} accepts ({', '.join(ENV_KWARGS[env_id])})" in err.expected
    assert "max_cycles" in err.expected


def test_the_table_covers_the_allow_list_and_matches_the_real_signatures() -> None:
    assert set(ENV_KWARGS) == set(MULTIAGENT_ENVIRONMENTS)
    for env_id, accepted in ENV_KWARGS.items():
        try:
            module = import_parallel_env_module(env_id)
        except ImportError:
            pytest.skip("mpe2 is not installed here")
        raw = importlib.import_module(module.raw_env.__module__).raw_env
        params = set(inspect.signature(raw.__init__).parameters) - {"self"}
        assert set(accepted) <= params, (env_id, set(accepted) - params)
        assert "render_mode" not in accepted


def test_the_largest_accepted_environments_build_and_are_accepted() -> None:
    try:
        import_parallel_env_module(SPREAD)
    except ImportError:
        pytest.skip("mpe2 is not installed here")
    top = {
        SPREAD: {
            "N": MAX_ENTITIES,
            "local_ratio": 1,
            "max_cycles": 100_000,
            "num_agent_neighbors": 32,
            "num_landmark_neighbors": 32,
            "curriculum": True,
        },
        "mpe2/simple_tag_v3": {
            "num_good": 32,
            "num_adversaries": 32,
            "num_obstacles": 32,
            "terminate_on_success": True,
        },
        "mpe2/simple_adversary_v3": {"N": 32, "continuous_actions": True, "dynamic_rescaling": False},
        "mpe2/simple_crypto_v3": {"max_cycles": 1},
    }
    for env_id, kwargs in top.items():
        cfg = validate_env_config({"env_id": env_id, "env_kwargs": kwargs})
        assert cfg.env_kwargs == kwargs
    # Struct numbers arrive as doubles: 3.0 is the integer 3.
    assert validate_env_config({"env_id": SPREAD, "env_kwargs": {"N": 3.0}}).env_kwargs == {"N": 3}


# ---------------------------------------------------------------------------------- gymnasium


def test_gym_kwargs_values_are_bounded_by_field_path() -> None:
    err = _refusal({"env_id": "FrozenLake-v1", "env_kwargs": {"size": 10_000_000}})
    assert str(err) == "spec.env_config.env_kwargs.size: expected a finite number with |x| <= 1e6, got 10000000"
    assert _refusal({"env_id": "FrozenLake-v1", "env_kwargs": {"x": -2e6}}).field == "spec.env_config.env_kwargs.x"
    err = _refusal({"env_id": "FrozenLake-v1", "env_kwargs": {"map_name": "8" * 257}})
    assert err.field == "spec.env_config.env_kwargs.map_name" and err.expected == "a string of at most 256 characters"
    # The whole mapping: 64 strings of 256 characters is more than 16 KiB of JSON.
    err = _refusal({"env_id": "FrozenLake-v1", "env_kwargs": {f"k{i}": "x" * 256 for i in range(64)}})
    assert err.field == "spec.env_config.env_kwargs" and err.expected == "at most 16384 bytes as JSON"
    # Within the bounds, gymnasium decides (and a good one passes).
    assert (
        validate_env_config(
            {"env_id": "FrozenLake-v1", "env_kwargs": {"is_slippery": False, "map_name": "4x4"}}
        ).env_kwargs["map_name"]
        == "4x4"
    )


def test_generic_bounds_on_nested_values() -> None:
    path = "spec.env_config.env_kwargs"
    check_env_kwargs_bounds({"desc": ["SFFF", "FHFH"], "opts": {"a": [1, 2.5, None, True]}, "three": [[[1]]]}, path)
    with pytest.raises(SpecError) as err:
        check_env_kwargs_bounds({"opts": {"a": [float("inf")]}}, path)
    assert err.value.field == "spec.env_config.env_kwargs.opts.a[0]" and "finite" in err.value.expected
    with pytest.raises(SpecError) as err:
        check_env_kwargs_bounds({"deep": [[[[1]]]]}, path)
    assert (
        err.value.field == "spec.env_config.env_kwargs.deep[0][0][0]"
        and err.value.expected == "lists and mappings nested at most 3 deep"
    )
    with pytest.raises(SpecError) as err:
        check_env_kwargs_bounds({"many": list(range(257))}, path)
    assert err.value.field == "spec.env_config.env_kwargs.many" and err.value.expected == "at most 256 items"
    with pytest.raises(SpecError) as err:
        check_env_kwargs_bounds({"obj": object()}, path)
    assert err.value.field == "spec.env_config.env_kwargs.obj"
