"""Spec validation at its bounds:

1. Gymnasium ``env_kwargs`` take what the documented bounds accept (lists, small nested values),
   e.g. FrozenLake's ``desc``; over-bound values are refused with the field path.
2. No ``SpecError`` message passes ~1 KB (the echoed value, the user's keys are cut), so a spec
   with many long unknown keys is an INVALID_ARGUMENT through a real scheduler, not a gRPC
   metadata-size failure.
3. File paths are refused in gymnasium ``env_kwargs`` (the env is built on the scheduler).
4. A ``user:password@`` part of an endpoint is never echoed.
"""

from __future__ import annotations

import grpc
import pytest

from opentinker.common.v1 import common_pb2 as C
from opentinker.scheduler.v1 import scheduler_pb2 as S, scheduler_pb2_grpc
from opentinker_client.inference import InferenceClient, parse_endpoint
from opentinker_common.spec import SpecError, validate_env_config
from opentinker_common.spec._parse import name_list, short_repr
from opentinker_common.spec.gym import check_env_kwargs_bounds, kwargs_key

from tests.support.security import LoopbackScheduler

gymnasium = pytest.importorskip("gymnasium")

KW = "spec.env_config.env_kwargs"
LAKE = ["SFFF", "FHFH", "FFFH", "HFFG"]  # gymnasium's default 4x4 map
OTHER_LAKE = ["SFFH", "FFFF", "HFFF", "FFFG"]  # differs from every built-in map
SIX = ["SFFFFF", "FFFFFF", "FFHFFF", "FFFFFF", "FFFFHF", "FFFFFG"]


def _refusal(env: dict) -> SpecError:
    with pytest.raises(SpecError) as err:
        validate_env_config(env)
    return err.value


# ------------------------------------------------------------------ 1. list-valued env_kwargs


@pytest.mark.parametrize("desc", [LAKE, OTHER_LAKE])
def test_frozenlake_with_a_custom_4x4_desc_validates_with_the_right_spaces(desc) -> None:
    cfg = validate_env_config(
        {"env_id": "FrozenLake-v1", "env_kwargs": {"desc": desc}, "action_space": 4, "observation_space": 16}
    )
    assert cfg.env_kwargs == {"desc": desc}
    env = gymnasium.make("FrozenLake-v1", **cfg.env_kwargs)  # what the trainer does with it
    try:
        assert [bytes(row).decode() for row in env.unwrapped.desc] == desc
    finally:
        env.close()


def test_a_6x6_desc_changes_the_observation_space_and_a_wrong_size_is_refused() -> None:
    cfg = validate_env_config(
        {"env_id": "FrozenLake-v1", "env_kwargs": {"desc": SIX, "is_slippery": False}, "observation_space": 36}
    )
    assert cfg.env_kwargs["desc"] == SIX
    err = _refusal({"env_id": "FrozenLake-v1", "env_kwargs": {"desc": SIX}, "observation_space": 16})
    assert err.field == "spec.env_config.observation_space" and "(36)" in err.expected


def test_struct_doubles_in_nested_lists_become_ints_and_lists_stay_lists() -> None:
    # A protobuf Struct carries [1, 2] as [1.0, 2.0]; a per-step schedule list is accepted as-is
    # where the env takes it (CartPole's constructor does not: gymnasium's refusal is named).
    cfg = validate_env_config({"env_id": "FrozenLake-v1", "env_kwargs": {"desc": LAKE, "is_slippery": True}})
    assert cfg.env_kwargs == {"desc": LAKE, "is_slippery": True}
    from opentinker_common.spec._parse import _plain

    assert _plain({"reward_schedule": [1.0, 0.5, 2.0, [3.0]]}, KW, 1, 3) == {"reward_schedule": [1, 0.5, 2, [3]]}
    err = _refusal({"env_id": "CartPole-v1", "env_kwargs": {"reward_schedule": [1.0, 0.5, 0.0]}})
    assert err.field == "spec.env_config.env_id" and "reward_schedule" in err.expected


def test_over_bound_lists_are_refused_with_the_field_path() -> None:
    err = _refusal({"env_id": "FrozenLake-v1", "env_kwargs": {"desc": ["SFFF"] * 300}})
    assert err.field == f"{KW}.desc" and err.expected == "at most 256 items"
    err = _refusal({"env_id": "FrozenLake-v1", "env_kwargs": {"desc": [[[["S"]]]]}})
    assert err.field == f"{KW}.desc[0][0][0]" and err.expected == "lists and mappings nested at most 3 deep"
    err = _refusal({"env_id": "FrozenLake-v1", "env_kwargs": {"desc": ["SFFF", float("inf")]}})
    assert err.field == f"{KW}.desc[1]" and "finite" in err.expected
    err = _refusal({"env_id": "FrozenLake-v1", "env_kwargs": {"desc": ["S" * 300]}})
    assert err.field == f"{KW}.desc[0]" and err.expected == "a string of at most 256 characters"
    err = _refusal({"env_id": "FrozenLake-v1", "env_kwargs": {"opts": {"a": [1e7]}}})
    assert err.field == f"{KW}.opts.a[0]"
    err = _refusal({"env_id": "FrozenLake-v1", "env_kwargs": {"desc": [{1, 2}]}})
    assert err.field == f"{KW}.desc[0]"


def test_other_dict_fields_stay_scalar_only() -> None:
    # Multi-agent env_kwargs keep the strict scalar-only conversion (and their per-id table).
    err = _refusal({"env_id": "mpe2/simple_spread_v3", "env_kwargs": {"N": [3, 4]}})
    assert err.field == f"{KW}.N" and "a number, a string" in err.expected


def test_the_spaces_cache_keys_on_canonical_json() -> None:
    assert kwargs_key({"b": [1, 2], "a": {"y": 1, "x": 2}}) == kwargs_key({"a": {"x": 2, "y": 1}, "b": [1, 2]})
    # lists are hashable through the key, and the same kwargs hit the cache
    from opentinker_common.spec import gym as gym_spec

    validate_env_config({"env_id": "FrozenLake-v1", "env_kwargs": {"desc": OTHER_LAKE}})
    hits = gym_spec._real_spaces.cache_info().hits
    validate_env_config({"env_id": "FrozenLake-v1", "env_kwargs": {"desc": OTHER_LAKE}})
    assert gym_spec._real_spaces.cache_info().hits == hits + 1


# ------------------------------------------------------------------ 2. short error messages


def test_short_repr_and_name_list_cap_what_is_echoed() -> None:
    assert short_repr("x" * 5000).endswith("...") and len(short_repr("x" * 5000)) == 100
    assert len(short_repr(list(range(100_000)))) == 100
    assert short_repr(3) == "3"
    assert name_list([f"k{i}" for i in range(25)]) == ", ".join(f"k{i}" for i in range(10)) + " and 15 more"


def test_every_part_of_a_spec_error_is_capped() -> None:
    err = SpecError("spec." + "a" * 5000, "b" * 5000, "c" * 50_000)
    assert len(str(err)) < 1024
    assert len(err.field) <= 200 and len(err.expected) <= 600


@pytest.mark.parametrize(
    "env, field_prefix",
    [
        ({"env_id": "arithmetic", **{f"{'k' * 1000}{i:02d}": 1 for i in range(20)}}, "spec.env_config.kkkk"),
        ({"env_id": "FrozenLake-v1", "env_kwargs": {f"{'k' * 1000}{i:02d}": 1 for i in range(20)}}, KW),
        ({"env_id": "FrozenLake-v1", "env_kwargs": {"desc": "D" * 100_000}}, f"{KW}.desc"),
        ({"env_id": "FrozenLake-v1", "env_kwargs": {"desc": ["D"] * 100_000}}, f"{KW}.desc"),
        ({"env_id": "mpe2/simple_spread_v3", "env_kwargs": {f"{'k' * 1000}{i:02d}": 1 for i in range(20)}}, KW),
    ],
)
def test_huge_specs_give_short_messages(env, field_prefix) -> None:
    err = _refusal(env)
    assert err.field.startswith(field_prefix)
    assert len(str(err)) < 1024, len(str(err))


def test_unknown_keys_are_listed_first_ten_and_a_count() -> None:
    err = _refusal({"env_id": "arithmetic", **{f"zz{i:02d}": 1 for i in range(25)}})
    assert err.field == "spec.env_config.zz00"
    assert "unknown keys: zz00, zz01" in err.expected and "and 15 more" in err.expected


@pytest.fixture(scope="module")
def scheduler(tmp_path_factory):
    s = LoopbackScheduler(tmp_path_factory.mktemp("bounds") / "state", default_model="/models/default")
    ch = grpc.insecure_channel(s.target)
    yield s, scheduler_pb2_grpc.SchedulerServiceStub(ch)
    ch.close()
    s.close()


def _submit(stub, workload: str, env: dict, hp: dict | None = None) -> grpc.RpcError:
    spec = C.TaskSpec(workload_type=workload)
    spec.env_config.update(env)
    spec.hyperparameters.update(hp or {})
    with pytest.raises(grpc.RpcError) as err:
        stub.SubmitTask(S.SubmitTaskRequest(spec=spec), timeout=30)
    return err.value


@pytest.mark.parametrize(
    "workload, env, hp",
    [
        ("lora_finetune", {"env_id": "arithmetic"}, {f"{'o' * 1000}{i:02d}": 1 for i in range(20)}),
        ("full_rl", {"env_id": "CartPole-v1", "env_kwargs": {f"{'o' * 1000}{i:02d}": 1 for i in range(20)}}, None),
        ("full_rl", {"env_id": "CartPole-v1", "env_kwargs": {"desc": ["x" * 200] * 250}}, None),
        ("full_rl", {"env_id": "CartPole-v1", "env_kwargs": {"desc": list(range(5000))}}, None),
    ],
)
def test_huge_specs_are_invalid_argument_through_a_real_scheduler(scheduler, workload, env, hp) -> None:
    _, stub = scheduler
    err = _submit(stub, workload, env, hp)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (err.code(), (err.details() or "")[:300])
    assert err.details().startswith("spec.") and len(err.details()) < 1100


# ------------------------------------------------------------------ 3. file paths


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"xml_file": "ant.xml"}, "xml_file"),
        ({"XML_FILE": "ant.xml"}, "XML_FILE"),
        ({"model_path": "m"}, "model_path"),
        ({"data_dir": "d"}, "data_dir"),
        ({"filename": "f"}, "filename"),
        ({"map_name": "/etc/passwd"}, "map_name"),
        ({"map_name": "..\\x"}, "map_name"),
        ({"map_name": "~root"}, "map_name"),
        ({"desc": ["SFFF", "/etc/hosts"]}, "desc[1]"),
        ({"opts": {"asset_file": "x"}}, "opts.asset_file"),
    ],
)
def test_file_paths_are_refused_in_gym_env_kwargs(kwargs, field, monkeypatch) -> None:
    from opentinker_common.spec import gym as gym_spec

    def no_build(*_a):  # TEST DOUBLE: nothing may be built (or opened) for these specs
        raise AssertionError("the environment was built")

    monkeypatch.setattr(gym_spec, "_real_spaces", no_build)
    err = _refusal({"env_id": "Ant-v5", "env_kwargs": kwargs})
    assert err.field == f"{KW}.{field}"
    assert (
        "file paths are not accepted in env_kwargs (environments are built on the scheduler and the trainers)"
        in str(err)
    )


@pytest.mark.parametrize(
    "env_id, kwargs",
    [
        ("FrozenLake-v1", {"map_name": "4x4"}),
        ("FrozenLake-v1", {"map_name": "8x8", "is_slippery": False}),
        ("FrozenLake-v1", {"desc": LAKE, "success_rate": 0.5, "reward_schedule": [1, 0, 0]}),
        ("CartPole-v1", {"sutton_barto_reward": True}),
        ("MountainCar-v0", {"goal_velocity": 0.1}),
        ("Pendulum-v1", {"g": 9.81}),
    ],
)
def test_legit_kwargs_still_validate(env_id, kwargs) -> None:
    sig_ok = True
    try:
        cfg = validate_env_config({"env_id": env_id, "env_kwargs": kwargs})
    except SpecError as err:  # an older gymnasium without the kwarg: not a bounds refusal
        sig_ok = False
        assert err.field == "spec.env_config.env_id", str(err)
    if sig_ok:
        assert cfg.env_kwargs == kwargs
    check_env_kwargs_bounds(kwargs, KW)


# ------------------------------------------------------------------ 4. user:password


@pytest.mark.parametrize(
    "endpoint", ["https://u:PW@host:1", "u:PW@host:1", "https://u:PW://x@host:1", "ftp://u:PW@host:1"]
)
def test_inference_endpoint_errors_do_not_echo_the_password(endpoint) -> None:
    with pytest.raises(ValueError) as err:
        InferenceClient(endpoint)
    assert "PW" not in str(err.value) and "***@host:1" in str(err.value)
    with pytest.raises(ValueError):
        parse_endpoint(endpoint)


TOKEN = "AbCdEfGhIjKlMnOpQrStUvWxYz_0123456789-abcd"


def test_client_env_endpoint_password_is_redacted_in_error_audit_and_log(scheduler) -> None:
    env = {"env_id": "client", "endpoint": "u:PW@host:1", "action_space": 4, "observation_space": 16, "token": TOKEN}
    err = _refusal(env)
    assert err.field == "spec.env_config.endpoint" and "PW" not in str(err) and "***@host:1" in str(err)
    long = {**env, "endpoint": "u:PW@" + "h" * 400 + ":1"}
    assert "PW" not in str(_refusal(long))
    s, stub = scheduler
    rpc = _submit(stub, "full_rl", env)
    assert rpc.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "PW" not in rpc.details() and "***@host:1" in rpc.details()
    recs = s.do(lambda: s.security.audit.list(action="task.submit"))
    assert all("PW" not in str(r.detail) for r in recs)
    refused = {
        k: n for k, n in s.security.audit.refusals.items() if k[0] == "task.submit" and k[2] == "INVALID_ARGUMENT"
    }
    assert refused  # counted, not stored with its message
