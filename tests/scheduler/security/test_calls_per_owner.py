"""One owner's calls in progress are bounded (``limits.max_calls_per_owner``): past the bound
they wait their turn behind that owner's own calls, while another owner's call goes through.

A real scheduler on loopback with auth on, real keys and gRPC clients. Calls are held in
progress deterministically by the environment check TEST DOUBLE (tests/support/env_check.py):
a dry-run submit with ``block: true`` stays in the scheduler until the test releases it.
"""

from __future__ import annotations

import asyncio
import uuid

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from opentinker.scheduler.v1 import scheduler_pb2 as S, scheduler_pb2_grpc
from opentinker_scheduler.security import limits as limits_module
from opentinker_scheduler.security.limits import Limits, LimitsConfig

from tests.support.env_check import cartpole_request
from tests.support.security import LoopbackScheduler, metadata, user_with_task
from tests.support.waiting import wait_for

CONFIG = "auth: {enabled: true}\nlimits: {max_calls_per_owner: 2, spec_check_timeout: 60, rate_wait: 0.1}\n"


CARTPOLE = {"workload_type": "full_rl", "env_config": {"env_id": "CartPole-v1"}}


def held_dry_run(stub, key: str, n: int):
    request = cartpole_request(f"held-{n}", block=True, k=f"{uuid.uuid4()}")  # unique: checks are cached
    request.dry_run = True
    return stub.SubmitTask.future(request, metadata=metadata(key), timeout=60)


@pytest.fixture
def world(tmp_path, held_env_checks):
    """``(sched, stub, (alice's key, her task), (bob's key, his task), held checks)``."""
    with LoopbackScheduler(tmp_path / "state", CONFIG) as sched:
        _, alice, alice_task = user_with_task(sched, "alice", **CARTPOLE)
        _, bob, bob_task = user_with_task(sched, "bob", **CARTPOLE)
        with grpc.insecure_channel(sched.target) as channel:
            yield (
                sched,
                scheduler_pb2_grpc.SchedulerServiceStub(channel),
                (alice, alice_task),
                (bob, bob_task),
                (held_env_checks),
            )


def test_an_owners_call_past_the_bound_waits_its_turn_while_another_owners_call_goes_through(world) -> None:
    sched, stub, (alice, alice_task), (bob, bob_task), checks = world
    limits = sched.security.limits
    held = [held_dry_run(stub, alice, n) for n in range(2)]
    checks.wait_entered(2)
    waiting = stub.GetTask.future(S.GetTaskRequest(task_id=alice_task), metadata=metadata(alice), timeout=60)
    wait_for(lambda: limits.calls_in_progress("alice") == (2, 1), what="alice's third call waiting its turn")

    answer = stub.GetTask(S.GetTaskRequest(task_id=bob_task), metadata=metadata(bob), timeout=30)

    assert answer.task.task_id == bob_task
    assert not waiting.done() and limits.calls_in_progress("alice") == (2, 1)
    checks.release.set()
    assert waiting.result(timeout=30).task.task_id == alice_task
    assert all(f.result(timeout=30).task.task_id == "" for f in held)  # dry runs: nothing stored
    wait_for(lambda: limits.calls_in_progress("alice") == (0, 0), what="alice's turns given back")


def test_an_owners_call_past_the_waiting_bound_is_refused_and_stores_nothing(world, monkeypatch) -> None:
    sched, stub, (alice, alice_task), (bob, bob_task), checks = world
    monkeypatch.setattr(limits_module, "MAX_WAITING_CALLS", 1)
    limits = sched.security.limits
    held = [held_dry_run(stub, alice, n) for n in range(2)]  # kept: a dropped future cancels its call
    checks.wait_entered(2)
    waiting = stub.ListTasks.future(S.ListTasksRequest(), metadata=metadata(alice), timeout=60)
    wait_for(lambda: limits.calls_in_progress("alice") == (2, 1), what="alice's third call waiting its turn")

    with pytest.raises(grpc.RpcError) as refused:
        stub.SubmitTask(cartpole_request("over", k=99), metadata=metadata(alice), timeout=30)

    err = refused.value
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.details() == (
        "too many calls in progress: 2 running and 1 waiting for owner 'alice', the limit is 2 at once "
        "(limits.max_calls_per_owner); retry in 0.1 s"
    )
    status = rpc_status.from_call(err)
    assert any(d.Is(error_details_pb2.RetryInfo.DESCRIPTOR) for d in status.details)
    assert stub.GetTask(S.GetTaskRequest(task_id=bob_task), metadata=metadata(bob), timeout=30).task.task_id
    checks.release.set()
    assert [t.task_id for t in waiting.result(timeout=30).tasks] == [alice_task]  # the refused submit made none
    assert all(f.result(timeout=30).task.task_id == "" for f in held)


def test_turns_pass_in_arrival_order_and_a_cancelled_waiter_gives_its_turn_on() -> None:
    limits = Limits(LimitsConfig(max_calls_per_owner=1))
    order: list[str] = []

    async def call(name: str, gate: asyncio.Event) -> None:
        assert await limits.acquire_turn("alice")
        try:
            order.append(name)
            await gate.wait()
        finally:
            limits.release_turn("alice")

    async def main() -> None:
        gate = asyncio.Event()
        first = asyncio.create_task(call("first", gate))
        await asyncio.sleep(0)
        cancelled = asyncio.create_task(call("cancelled", gate))
        third = asyncio.create_task(call("third", gate))
        await asyncio.sleep(0)
        assert limits.calls_in_progress("alice") == (1, 2)
        assert await limits.acquire_turn("bob")  # another owner: its own turns
        cancelled.cancel()
        gate.set()
        await asyncio.gather(first, third)
        assert cancelled.cancelled() and order == ["first", "third"]
        assert limits.calls_in_progress("alice") == (0, 0)
        limits.release_turn("bob")

    asyncio.run(main())
