"""Fuzzing the public surface with hypothesis.

* Task specs through the real ``SubmitTask`` on a loopback scheduler: every answer is a valid
  task (PENDING with a reason, and cancellable: never stuck) or a clear refusal with the right
  code (INVALID_ARGUMENT; FAILED_PRECONDITION only for GPUs no node has; NOT_FOUND only for a
  referenced dataset/task that does not exist), never a crash; the server keeps serving.
* Scheduler config YAML through ``parse_config``: a config or ``ConfigError``, nothing else.
"""

from __future__ import annotations

import math

import grpc
import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings, strategies as st
from grpc_health.v1 import health_pb2, health_pb2_grpc

from opentinker.common.v1 import common_pb2 as C
from opentinker.scheduler.v1 import scheduler_pb2 as S, scheduler_pb2_grpc
from opentinker_common.spec import WORKLOAD_TYPES
from opentinker_scheduler.config import ConfigError, SchedulerConfig, parse_config

from tests.support.security import LoopbackScheduler

# JSON values as a protobuf Struct carries them (numbers are doubles; no NaN/inf in JSON).
_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**40), 2**40),
    st.floats(allow_nan=False, allow_infinity=False, width=64),
    st.text(max_size=30),
)
_json = st.recursive(
    _scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=12), inner, max_size=4)),
    max_leaves=12,
)

_ENV_KEYS = [
    "env_id",
    "action_space",
    "observation_space",
    "min_digits",
    "max_digits",
    "seed",
    "system_prompt",
    "dataset_id",
    "endpoint",
    "render",
    "max_episode_steps",
]
_HP_KEYS = [
    "steps",
    "learning_rate",
    "group_size",
    "prompts_per_step",
    "max_new_tokens",
    "lora_rank",
    "lora_alpha",
    "temperature",
    "checkpoint_every",
    "kl_coef",
    "clip_eps",
    "batch_size",
    "epochs",
    "gamma",
    "gae_lambda",
    "seed",
]
_ENV_IDS = ["arithmetic", "CartPole-v1", "FrozenLake-v1", "Blackjack-v1", "nope-v0", "", "remote", "dataset"]


def _mapping(keys: list[str], special: dict) -> st.SearchStrategy:
    key = st.one_of(st.sampled_from(keys), st.text(max_size=10))
    return st.dictionaries(key, _json, max_size=5).flatmap(
        lambda d: st.fixed_dictionaries({k: v for k, v in special.items()}).map(
            lambda s: {**d, **{k: v for k, v in s.items() if v is not None}}
        )
    )


_env = _mapping(
    _ENV_KEYS,
    {
        "env_id": st.one_of(st.none(), st.sampled_from(_ENV_IDS)),
        "action_space": st.one_of(st.none(), st.integers(-2, 300)),
    },
)
_hp = _mapping(
    _HP_KEYS,
    {"steps": st.one_of(st.none(), st.integers(-2, 200_000), st.floats(allow_nan=False, allow_infinity=False))},
)


_NEAR_VALID_HP = st.dictionaries(
    st.sampled_from(
        ["steps", "group_size", "prompts_per_step", "max_new_tokens", "lora_rank", "checkpoint_every", "seed"]
    ),
    st.integers(-1, 70),
    max_size=4,
)


@st.composite
def near_valid_specs(draw) -> C.TaskSpec:
    """Mostly valid ``lora_finetune`` specs on arithmetic, with small numbers that may be out of range."""
    spec = C.TaskSpec(
        workload_type="lora_finetune", model=draw(st.sampled_from(["", "/models/m"])), name=draw(st.text(max_size=20))
    )
    spec.env_config.update(
        {
            "env_id": "arithmetic",
            **draw(
                st.dictionaries(st.sampled_from(["min_digits", "max_digits", "seed"]), st.integers(-1, 12), max_size=2)
            ),
        }
    )
    spec.hyperparameters.update(draw(_NEAR_VALID_HP))
    spec.resources.gpu_count = draw(st.sampled_from([0, 0, 0, 1]))
    return spec


@st.composite
def wild_specs(draw) -> C.TaskSpec:
    spec = C.TaskSpec(
        workload_type=draw(st.one_of(st.sampled_from(WORKLOAD_TYPES), st.text(max_size=20))),
        model=draw(st.one_of(st.just(""), st.just("/models/m"), st.text(max_size=40))),
        name=draw(st.text(max_size=300)),
        init_from=draw(st.sampled_from(["", "", "", "", "task-0192f3c4d5e6f7a8b9c", "bad id!"])),
    )
    spec.resources.gpu_count = draw(st.integers(-2, 9))
    if draw(st.booleans()):
        spec.env_config.update(draw(_env))
    if draw(st.booleans()):
        spec.hyperparameters.update(draw(_hp))
    if draw(st.booleans()):
        spec.limits.max_attempts = draw(st.integers(-3, 1000))
    if draw(st.booleans()):
        spec.limits.max_runtime.FromNanoseconds(draw(st.integers(-(10**12), 10**15)))
    if draw(st.booleans()):
        spec.priority = draw(st.integers(-(2**31), 2**31 - 1))
    return spec


task_specs = st.one_of(near_valid_specs(), wild_specs())


@pytest.fixture(scope="module")
def loopback(tmp_path_factory):
    s = LoopbackScheduler(tmp_path_factory.mktemp("fuzz") / "state", default_model="/models/default")
    ch = grpc.insecure_channel(s.target)
    yield s, scheduler_pb2_grpc.SchedulerServiceStub(ch), health_pb2_grpc.HealthStub(ch)
    ch.close()
    s.close()


@settings(
    max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(spec=task_specs)
def test_submitted_specs_give_a_valid_task_or_a_clear_refusal(loopback, spec: C.TaskSpec) -> None:
    s, stub, health = loopback
    try:
        resp = stub.SubmitTask(S.SubmitTaskRequest(spec=spec), timeout=30)
    except grpc.RpcError as err:
        code, details = err.code(), err.details() or ""
        event(code.name)
        assert code in (
            grpc.StatusCode.INVALID_ARGUMENT,
            grpc.StatusCode.FAILED_PRECONDITION,
            grpc.StatusCode.NOT_FOUND,
        ), (code, details)
        assert details and len(details) < 4000, details
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            assert details.startswith(("spec", "env_config", "hyperparameters")), details  # names the field path
        elif code == grpc.StatusCode.FAILED_PRECONDITION:
            assert spec.resources.gpu_count > 0 or spec.init_from, details
        else:
            assert "spec.env_config.dataset_id" in details or "spec.init_from" in details, details
    else:
        task = resp.task
        event("OK")
        assert task.task_id and task.state == C.TASK_STATE_PENDING and task.pending_reason
        # Never stuck: it can be read back and cancelled, and then it is finished.
        assert stub.GetTask(S.GetTaskRequest(task_id=task.task_id)).task.state == C.TASK_STATE_PENDING
        done = stub.CancelTask(S.CancelTaskRequest(task_id=task.task_id)).task
        assert done.state == C.TASK_STATE_CANCELLED
    assert health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING


# ------------------------------------------------------------------------------------ configs

_CONFIG_KEYS = [
    "resource_pool",
    "workload_types",
    "state_dir",
    "allow_unknown_nodes",
    "unknown_node_max_tasks",
    "heartbeat_interval",
    "lease",
    "default_model",
    "default_max_attempts",
    "restart_grace",
    "max_tasks_per_gpu",
    "preemption_timeout",
    "auth",
    "tls",
    "limits",
]
_yaml_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**6), 10**12),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
)
_yaml_values = st.recursive(
    _yaml_scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=10), inner, max_size=3)),
    max_leaves=10,
)
_sections = {
    "resource_pool": st.lists(
        st.dictionaries(st.sampled_from(["node_id", "gpu_count", "max_tasks", "x"]), _yaml_scalars, max_size=3),
        max_size=3,
    ),
    "workload_types": st.lists(
        st.dictionaries(
            st.sampled_from(["type", "priority"]), st.one_of(st.sampled_from(WORKLOAD_TYPES), _yaml_scalars), max_size=2
        ),
        max_size=3,
    ),
    "auth": st.dictionaries(st.sampled_from(["enabled", "bootstrap_admin_key_file", "x"]), _yaml_scalars, max_size=2),
    "tls": st.dictionaries(
        st.sampled_from(["cert", "key", "client_ca", "client_auth", "node_port"]), _yaml_scalars, max_size=4
    ),
    "limits": st.dictionaries(
        st.sampled_from(
            [
                "max_message_bytes",
                "max_spec_bytes",
                "max_pending_per_owner",
                "submit_rate",
                "submit_burst",
                "max_streams_per_owner",
                "x",
            ]
        ),
        _yaml_scalars,
        max_size=4,
    ),
}


@st.composite
def config_docs(draw) -> str:
    doc = {}
    for key in draw(st.lists(st.one_of(st.sampled_from(_CONFIG_KEYS), st.text(max_size=8)), max_size=6, unique=True)):
        doc[key] = draw(_sections[key]) if key in _sections and draw(st.booleans()) else draw(_yaml_values)
    return yaml.safe_dump(doc, allow_unicode=True)


def _check(text: str) -> None:
    try:
        cfg = parse_config(text, "fuzz.yaml")
    except ConfigError as exc:
        event("ConfigError")
        assert str(exc).startswith("fuzz.yaml"), exc  # names the file (and line and key when there is one)
    else:
        event("config")
        assert isinstance(cfg, SchedulerConfig)
        assert math.isfinite(cfg.lease_s) and cfg.lease_s > cfg.heartbeat_interval_s


@settings(max_examples=400, deadline=None)
@given(text=config_docs())
def test_structured_yaml_configs_parse_or_raise_config_error(text: str) -> None:
    _check(text)


@settings(max_examples=300, deadline=None)
@given(text=st.text(max_size=200))
def test_arbitrary_text_configs_parse_or_raise_config_error(text: str) -> None:
    _check(text)
