"""A submit that fails says whether its task was created (``err.task_created``), and the client
makes it again, with the same ``request_id``, when the scheduler asks for that (overloaded,
stopping) or the call was cut off. Against the real scheduler on loopback for the refusals, and
the in-process TEST DOUBLE (tests/support/fake_scheduler.py) for answers lost on the way back."""

from __future__ import annotations

import threading

import grpc
import pytest

import opentinker_client as ot
from opentinker.common.v1 import common_pb2 as C
from opentinker.scheduler.v1 import scheduler_pb2 as S, scheduler_pb2_grpc
from opentinker_client import RLClient
from opentinker_client.client_tasks import SUBMIT_ATTEMPTS
from opentinker_common.net.call_budget import BUDGET_HEADER

from tests.support.security import LoopbackScheduler

CARTPOLE = {"workload_type": "full_rl", "env_config": {"env_id": "CartPole-v1"}}


@pytest.fixture
def busy(tmp_path, held_env_checks):
    """A real scheduler that takes one submit at a time, with that one held in its environment
    check until ``held_env_checks.release`` is set: ``(sched, held call)``."""
    sched = LoopbackScheduler(tmp_path / "state", "limits: {max_submits_in_flight: 1, spec_check_timeout: 30}\n")
    channel = grpc.insecure_channel(sched.target)
    spec = C.TaskSpec(workload_type="full_rl")
    spec.env_config.update({"env_id": "CartPole-v1", "env_kwargs": {"block": True}})
    held = scheduler_pb2_grpc.SchedulerServiceStub(channel).SubmitTask.future(
        S.SubmitTaskRequest(spec=spec, request_id="held"), timeout=60
    )
    held_env_checks.wait_entered()
    try:
        yield sched, held
    finally:
        held_env_checks.release.set()
        channel.close()
        sched.close()


def test_an_overloaded_scheduler_is_retried_within_the_timeout_then_overloaded_error(busy) -> None:
    sched, _ = busy
    with RLClient(sched.target, api_key="", timeout=5.0) as client:
        with pytest.raises(ot.OverloadedError) as err:
            client.submit_task(**CARTPOLE)
    e = err.value
    assert isinstance(e, ot.ResourceExhaustedError) and e.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert e.reason == "OVERLOADED" and 0.1 <= e.retry_after <= 10
    assert e.task_created is False and e.request_id and "no task was created" in e.details
    assert sched.running.submit_gate.refused["OVERLOADED"] >= 2  # asked again after retry_after
    assert sched.do(lambda: sched.core.store.db.execute("SELECT COUNT(*) FROM tasks").fetchone()[0]) == 0


def test_a_submit_refused_as_overloaded_succeeds_once_there_is_room(busy, held_env_checks) -> None:
    sched, held = busy
    threading.Timer(0.5, held_env_checks.release.set).start()
    with RLClient(sched.target, api_key="", timeout=30) as client:
        task_id = client.submit_task(**CARTPOLE)
        assert client.get_task(task_id).state == "pending"
    assert held.result(timeout=30).task.task_id != task_id
    assert sched.running.submit_gate.refused["OVERLOADED"] >= 1


def test_an_answer_cut_off_is_asked_for_again_with_the_same_request_id(fake) -> None:
    servicer, server = fake
    servicer.submit_faults = [grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE]
    with RLClient(server.url, api_key="", timeout=10) as client:
        task_id = client.submit_task(workload_type="lora_finetune", model="m")
    assert len(servicer.submits) == 3 and len({r.request_id for r in servicer.submits}) == 1
    assert list(servicer.tasks) == [task_id]  # one task, found again by its request id
    budgets = [int(md[BUDGET_HEADER]) for md in servicer.metadata]
    assert all(0 < b <= 10_000 for b in budgets) and budgets == sorted(budgets, reverse=True)  # each attempt's own


def test_when_it_cannot_be_told_the_error_says_so_and_names_the_request_id(fake) -> None:
    servicer, server = fake
    servicer.submit_faults = [grpc.StatusCode.CANCELLED] * SUBMIT_ATTEMPTS
    with RLClient(server.url, api_key="", timeout=30) as client:
        with pytest.raises(ot.OpenTinkerError) as err:
            client.submit_task(workload_type="lora_finetune", model="m", request_id="mine-1")
        e = err.value
        assert e.code == grpc.StatusCode.CANCELLED and e.task_created is None and e.request_id == "mine-1"
        assert "may or may not have been created: submit again with request_id='mine-1'" in str(e)
        assert len(servicer.submits) == SUBMIT_ATTEMPTS
        # As it says: the same request id returns the task the lost answers were about.
        assert client.submit_task(workload_type="lora_finetune", model="m", request_id="mine-1") == "task-0001"


def test_a_refusal_is_not_retried_and_says_no_task_was_created(fake) -> None:
    servicer, server = fake
    with RLClient(server.url, api_key="", timeout=10) as client:
        with pytest.raises(ot.FailedPreconditionError) as err:
            client.submit_task(workload_type="lora_finetune", model="m", gpu_count=9)
    assert err.value.task_created is False and err.value.retry_after is None and len(servicer.submits) == 1
