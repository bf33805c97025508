"""SubmitTask builds environments off the event loop, at most two at once, within
``limits.spec_check_timeout``.

A real scheduler on loopback (grpc.aio, SQLite). The slow environment is a TEST DOUBLE of
``opentinker_common.spec.gym._real_spaces`` (the lru-cached function that builds a gymnasium
environment to read its spaces) that blocks until the test releases it, so nothing depends on
how fast this machine is.
"""

from __future__ import annotations

import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import opentinker_common.spec.gym as gym_spec
from opentinker.common.v1 import common_pb2 as C
from opentinker.scheduler.v1 import scheduler_pb2 as S
from opentinker_scheduler.config import ConfigError, parse_config
from opentinker_scheduler.admission.spec_check import DEFAULT_TIMEOUT_S, checker_for

from tests.support.env_check import cartpole_request as _request, serving as _serving


def test_the_loop_answers_while_an_environment_is_built_and_submit_builds_once(tmp_path, held_env_checks) -> None:
    with _serving(tmp_path) as (sched, channel, stub):
        pending = stub.SubmitTask.future(_request(block=True, tag=1), timeout=60)
        held_env_checks.wait_entered()
        # The build is blocked in its thread; the loop still serves RPCs and health.
        assert stub.ListTasks(S.ListTasksRequest(), timeout=10).tasks == []
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        assert not pending.done()
        held_env_checks.release.set()
        task = pending.result().task
        assert task.state == C.TASK_STATE_PENDING
        # core.api.submit validated the same spec again on the loop and found the build cached.
        assert held_env_checks.calls == ['{"block":true,"tag":1}']
        assert [t.task_id for t in stub.ListTasks(S.ListTasksRequest()).tasks] == [task.task_id]


def test_a_build_past_the_budget_is_invalid_argument_and_nothing_is_stored(tmp_path, held_env_checks) -> None:
    with _serving(tmp_path, "limits: {spec_check_timeout: 0.5}\n") as (sched, channel, stub):
        try:
            with pytest.raises(grpc.RpcError) as err:
                stub.SubmitTask(_request(block=True), timeout=30)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert (
                err.value.details()
                == "spec.env_config: building the environment took longer than 0.5 s; use smaller env_kwargs"
            )
            assert stub.ListTasks(S.ListTasksRequest()).tasks == []
            # The same env_config again: refused at once, without another build.
            with pytest.raises(grpc.RpcError) as err:
                stub.SubmitTask(_request(block=True), timeout=30)
            assert (
                err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "took longer than 0.5 s" in err.value.details()
            )
            assert len(held_env_checks.calls) == 1
            # Another spec is fine (one slot is still held by the blocked build, the other is free).
            assert stub.SubmitTask(_request(fast=1), timeout=30).task.state == C.TASK_STATE_PENDING
        finally:
            held_env_checks.release.set()


def test_at_most_two_builds_at_once_and_a_caller_without_a_slot_is_told_to_retry(tmp_path, held_env_checks) -> None:
    with _serving(tmp_path, "limits: {spec_check_timeout: 1}\n") as (sched, channel, stub):
        calls = [stub.SubmitTask.future(_request(block=True, n=i), timeout=60) for i in range(3)]
        held_env_checks.wait_entered(2)
        codes = []
        for call in calls:
            with pytest.raises(grpc.RpcError) as err:
                call.result()
            codes.append(err.value.code())
            if err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                assert "2 environment checks are already running" in err.value.details()
                assert "limits.spec_check_timeout" in err.value.details()
        assert sorted(c.name for c in codes) == ["INVALID_ARGUMENT", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"]
        assert held_env_checks.max_active == 2 and len(held_env_checks.calls) == 2
        # The slots come back only when the runaway builds really end.
        held_env_checks.release.set()
        checker = checker_for(sched.core)
        deadline = time.monotonic() + 30
        while checker.running and time.monotonic() < deadline:
            time.sleep(0.05)
        assert checker.running == 0
        assert stub.SubmitTask(_request(fast=2), timeout=30).task.state == C.TASK_STATE_PENDING


def test_the_real_builder_runs_once_per_submit(tmp_path) -> None:
    with _serving(tmp_path) as (sched, channel, stub):
        gym_spec._real_spaces.cache_clear()
        spec = C.TaskSpec(workload_type="full_rl")
        spec.env_config.update({"env_id": "FrozenLake-v1", "env_kwargs": {"is_slippery": False}, "action_space": 4})
        assert stub.SubmitTask(S.SubmitTaskRequest(spec=spec), timeout=60).task.state == C.TASK_STATE_PENDING
        info = gym_spec._real_spaces.cache_info()
        assert info.misses == 1 and info.hits >= 1  # built in the thread, found cached by core.api.submit


def test_oversized_env_kwargs_are_refused_quickly_with_the_field_path(tmp_path) -> None:
    with _serving(tmp_path) as (sched, channel, stub):
        spec = C.TaskSpec(workload_type="full_rl")
        spec.env_config.update({"env_id": "mpe2/simple_spread_v3", "env_kwargs": {"N": 3200}})
        with pytest.raises(grpc.RpcError) as err:
            stub.SubmitTask(S.SubmitTaskRequest(spec=spec), timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details() == "spec.env_config.env_kwargs.N: expected an integer in [1, 32], got 3200"
        assert stub.ListTasks(S.ListTasksRequest()).tasks == []


def test_spec_check_timeout_config() -> None:
    assert parse_config("limits: {spec_check_timeout: 2.5}\n", "x.yaml").limits.spec_check_timeout == 2.5
    assert (
        parse_config("limits: {}\n", "x.yaml").limits.resolved(auth_enabled=False).spec_check_timeout
        == DEFAULT_TIMEOUT_S
    )
    for bad in ("0", "-1", "1000", "soon"):
        with pytest.raises(ConfigError, match="limits.spec_check_timeout"):
            parse_config(f"limits: {{spec_check_timeout: {bad}}}\n", "x.yaml")


def test_an_env_config_that_passed_is_not_checked_in_a_thread_again() -> None:
    import asyncio

    from opentinker_scheduler.admission.spec_check import SpecChecker
    from opentinker_scheduler.errors import InvalidArgument
    from opentinker_common.spec import SpecError

    seen: list[dict] = []

    def validate(env: dict):
        seen.append(env)
        if env.get("bad"):
            raise SpecError("spec.env_config.bad", "nothing")
        return env

    async def main() -> None:
        checker = SpecChecker(validate=validate)
        a, b, bad = _request(x=1).spec, _request(x=2).spec, _request(bad=1).spec
        bad.env_config.update({"bad": True})
        for spec in (a, a, b, a, b):
            await checker.check(spec)
        for _ in range(2):  # a refusal is not remembered as a pass
            with pytest.raises(InvalidArgument):
                await checker.check(bad)
        assert checker.running == 0

    asyncio.run(main())
    assert [e["env_kwargs"] for e in seen] == [{"x": 1}, {"x": 2}, {"bad": 1}, {"bad": 1}]
