"""An overloaded or stopping scheduler refuses a submit with a status that says so and when to
retry, before it creates anything; it never lets a call end CANCELLED.

A real scheduler on loopback (grpc.aio, SQLite). The load is made deterministic: environment
checks that block until the test releases them (the TEST DOUBLE of tests/scheduler/admission/
test_spec_check.py) hold calls in progress, and a sleep run on the scheduler's own event loop
stands for a loop too busy to take calls up, so they wait inside gRPC.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from opentinker.common.v1 import common_pb2 as C
from opentinker.scheduler.v1 import scheduler_pb2_grpc
from opentinker_common.net.call_budget import budget_metadata
from opentinker_scheduler.errors import ERROR_DOMAIN

from tests.support.env_check import cartpole_request, serving
from tests.support.security import LoopbackScheduler


def request(n: int, **env_kwargs):
    return cartpole_request(f"req-{n}", **env_kwargs)


def details(err: grpc.RpcError) -> dict[str, object]:
    """The refusal's RetryInfo delay (seconds) and ErrorInfo (reason, domain)."""
    out: dict[str, object] = {}
    status = rpc_status.from_call(err)
    for d in status.details if status is not None else ():
        if d.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            info = error_details_pb2.RetryInfo()
            d.Unpack(info)
            out["retry_after"] = info.retry_delay.ToNanoseconds() / 1e9
        elif d.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            d.Unpack(info)
            out["reason"], out["domain"] = info.reason, info.domain
    out["pushback_ms"] = dict(err.trailing_metadata() or ()).get("grpc-retry-pushback-ms")
    return out


def outcomes(futures) -> tuple[list, list[grpc.RpcError]]:
    ok, failed = [], []
    for f in futures:
        try:
            ok.append(f.result(timeout=60).task)
        except grpc.RpcError as err:
            failed.append(err)
    return ok, failed


def stored_tasks(sched: LoopbackScheduler) -> int:
    return sched.do(lambda: sched.core.store.db.execute("SELECT COUNT(*) FROM tasks").fetchone()[0])


def test_submits_over_the_limit_in_progress_are_refused_with_retry_info_and_create_nothing(
    tmp_path, held_env_checks
) -> None:
    with serving(tmp_path, "limits: {max_submits_in_flight: 2, spec_check_timeout: 30}\n") as (sched, _, stub):
        held = [stub.SubmitTask.future(request(i, block=True, k=i), timeout=60) for i in range(2)]
        held_env_checks.wait_entered(2)  # two calls in progress, held in their environment checks
        flood = [stub.SubmitTask.future(request(100 + i, k=i), timeout=60) for i in range(40)]
        ok, refused = outcomes(flood)
        assert ok == [] and len(refused) == 40
        for err in refused:
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
            assert "the limit is 2 (limits.max_submits_in_flight); no task was created; retry in" in err.details()
            info = details(err)
            assert info["reason"] == "OVERLOADED" and info["domain"] == ERROR_DOMAIN
            assert 0.1 <= info["retry_after"] <= 10 and int(info["pushback_ms"]) == int(info["retry_after"] * 1000)
        assert stored_tasks(sched) == 0
        # Refused early: the flood built no environment and took nothing else up.
        assert len(held_env_checks.calls) == 2
        held_env_checks.release.set()
        done, failed = outcomes(held)
        assert failed == [] and len(done) == 2 and stored_tasks(sched) == 2
        # The same request again, now that there is room: accepted (the refusal created nothing to clash with).
        assert stub.SubmitTask(request(100, k=0), timeout=30).task.state == C.TASK_STATE_PENDING
        assert sched.running.submit_gate.refused == {"OVERLOADED": 40}


def test_calls_that_waited_inside_grpc_past_max_submit_wait_are_refused_never_cancelled(tmp_path) -> None:
    with serving(tmp_path, "limits: {max_submit_wait: 1.0}\n") as (sched, _, stub):
        stub.SubmitTask(request(0), timeout=30)  # warm: the first spec check imports gymnasium
        # A loop too busy to take calls up: 2 s of it while 1500 submits arrive. 1500 waiting
        # calls are past gRPC core's default pending limit (1000), where it drops calls at random
        # with CANCELLED; the scheduler raises that limit, so every call reaches it. (Well under
        # 4 s, HOPELESS times the bound, past which a call would be served instead.)
        sched.loop.call_soon_threadsafe(time.sleep, 2.0)
        time.sleep(0.1)
        flood = [stub.SubmitTask.future(request(1 + i), timeout=60, metadata=budget_metadata(60)) for i in range(1500)]
        ok, refused = outcomes(flood)
        codes = {err.code() for err in refused}
        assert codes == {grpc.StatusCode.RESOURCE_EXHAUSTED}, [(e.code(), e.details()) for e in refused[:3]]
        assert all(details(err)["reason"] == "OVERLOADED" for err in refused)
        assert all("(limits.max_submit_wait); no task was created" in err.details() for err in refused)
        assert len(refused) >= 300, (len(ok), len(refused))  # those that waited over 1 s of the stall
        # Exactly the accepted ones were created (request ids 1..1500 are distinct).
        assert stored_tasks(sched) == 1 + len(ok)
        # Calls without a budget are not judged by their wait.
        sched.loop.call_soon_threadsafe(time.sleep, 1.5)
        time.sleep(0.1)
        assert stub.SubmitTask(request(5000), timeout=30).task.state == C.TASK_STATE_PENDING


def test_a_stopping_scheduler_refuses_submits_as_unavailable_and_answers_those_in_progress(
    tmp_path, held_env_checks
) -> None:
    sched = LoopbackScheduler(tmp_path / "state", "limits: {spec_check_timeout: 30}\n")
    channel = grpc.insecure_channel(sched.target)
    stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
    try:
        held = stub.SubmitTask.future(request(1, block=True), timeout=60)
        held_env_checks.wait_entered()
        stopping = asyncio.run_coroutine_threadsafe(sched.running.stop(10), sched.loop)
        deadline = time.monotonic() + 10
        while not sched.running.submit_gate.draining and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(grpc.RpcError) as err:
            stub.SubmitTask(request(2), timeout=30)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert details(err.value)["reason"] == "SHUTTING_DOWN" and details(err.value)["retry_after"] == 1.0
        assert "no task was created" in err.value.details()
        assert not stopping.done()  # waiting for the call in progress
        held_env_checks.release.set()
        # It reached the write while stopping: refused there too, not cancelled, nothing written.
        with pytest.raises(grpc.RpcError) as err:
            held.result(timeout=30)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and details(err.value)["reason"] == "SHUTTING_DOWN"
        stopping.result(30)
    finally:
        channel.close()
        sched.loop.call_soon_threadsafe(sched.loop.stop)
        sched.thread.join(10)
    assert sched.running.submit_gate.refused == {"SHUTTING_DOWN": 2}
