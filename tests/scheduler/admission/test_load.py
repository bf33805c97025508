"""admission/load.py SubmitGate on its own: the calls in progress, the wait before a call is taken
up, the retry advice, and a stopping scheduler. (Through a real server: tests/scheduler/api/test_overload.py.)"""

from __future__ import annotations

import asyncio

import pytest

from opentinker_common.net.call_budget import BUDGET_HEADER, budget_metadata, waited_s
from opentinker_scheduler.admission.load import HOPELESS, MAX_RETRY_S, MIN_RETRY_S, SHUTDOWN_RETRY_S, SubmitGate
from opentinker_scheduler.errors import ResourceExhausted, Unavailable


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class Context:
    """TEST DOUBLE of a grpc.aio ServicerContext: metadata and the time remaining."""

    def __init__(self, metadata=(), remaining: float | None = None) -> None:
        self.metadata, self.remaining = tuple(metadata), remaining

    def invocation_metadata(self):
        return self.metadata

    def time_remaining(self):
        return self.remaining


def test_the_wait_is_the_budget_minus_the_time_remaining() -> None:
    assert budget_metadata(60) == ((BUDGET_HEADER, "60000"),) and budget_metadata(None) == ()
    assert waited_s(Context(budget_metadata(60), remaining=58.75)) == pytest.approx(1.25)
    assert waited_s(Context(budget_metadata(60), remaining=60.2)) == 0.0  # never negative
    assert waited_s(Context((), remaining=10)) is None  # no budget sent
    assert waited_s(Context(budget_metadata(60), remaining=None)) is None  # no deadline
    assert waited_s(Context(((BUDGET_HEADER, "soon"),), remaining=1)) is None


def test_over_the_limit_a_call_is_refused_as_overloaded_with_retry_advice() -> None:
    clock = Clock()
    gate = SubmitGate(2, max_wait_s=0, clock=clock)
    first, second = gate.enter(), gate.enter()
    with pytest.raises(ResourceExhausted) as err:
        gate.enter()
    assert err.value.reason == "OVERLOADED" and err.value.retry_after == MIN_RETRY_S
    assert "2 SubmitTask calls in progress, the limit is 2 (limits.max_submits_in_flight)" in str(err.value)
    assert "no task was created; retry in 0.1 s" in str(err.value)
    assert gate.in_flight == 2 and gate.refused == {"OVERLOADED": 1}
    # Slow calls raise the advice towards their duration (a moving mean), within the bounds.
    for _ in range(200):
        clock.t += 3.0
        gate.leave(first)
        first = gate.enter()
    assert 2.5 < gate.retry_after <= 3.0
    for _ in range(200):
        clock.t += 60.0
        gate.leave(first)
        first = gate.enter()
    assert gate.retry_after == MAX_RETRY_S
    gate.leave(first)
    gate.leave(second)
    assert gate.in_flight == 0
    unlimited = SubmitGate(0, max_wait_s=0)
    for _ in range(1000):
        unlimited.enter()
    assert unlimited.in_flight == 1000


def test_a_call_that_waited_too_long_is_refused_and_told_to_wait_as_long() -> None:
    gate = SubmitGate(0, max_wait_s=0.5)
    assert gate.enter(Context(budget_metadata(30), remaining=29.8))  # waited 0.2 s: taken
    with pytest.raises(ResourceExhausted) as err:
        gate.enter(Context(budget_metadata(30), remaining=28.8))
    assert err.value.reason == "OVERLOADED" and err.value.retry_after == pytest.approx(1.2)
    assert "waited 1.20 s in the server" in str(err.value) and "(limits.max_submit_wait)" in str(err.value)
    assert gate.enter(Context((), remaining=1.0))  # no budget: the wait is unknown, not refused
    # Waited more than HOPELESS times the bound: refusing is not draining the queue; served.
    assert gate.enter(Context(budget_metadata(30), remaining=30 - HOPELESS * 0.5 - 0.01))
    assert SubmitGate(0, max_wait_s=0).enter(Context(budget_metadata(30), remaining=1.0))  # 0: no bound


def test_a_draining_gate_refuses_new_calls_and_writes_as_unavailable() -> None:
    async def main() -> None:
        gate = SubmitGate(8)
        started = gate.enter()
        gate.drain()
        for refuse in (gate.enter, gate.check_open):
            with pytest.raises(Unavailable) as err:
                refuse()
            assert err.value.reason == "SHUTTING_DOWN" and err.value.retry_after == SHUTDOWN_RETRY_S
            assert "no task was created" in str(err.value)
        assert not await gate.wait_idle(0.05)
        asyncio.get_running_loop().call_later(0.05, gate.leave, started)
        assert await gate.wait_idle(5)
        assert gate.refused == {"SHUTTING_DOWN": 2}

    asyncio.run(main())
