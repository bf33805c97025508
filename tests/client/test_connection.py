"""SchedulerConnection (the channel, key and error mapping every part of RLClient calls through)
against the in-process TEST DOUBLE of the scheduler (tests/support/fake_scheduler.py)."""

import grpc
import pytest

from opentinker.scheduler.v1 import scheduler_pb2
from opentinker_client.client_tasks import PollPacer, TaskCalls, check_task_id
from opentinker_client.connection import SchedulerConnection, resolve_api_key
from opentinker_client.errors import (
    SCHEDULER_PLAINTEXT_HINT,
    InvalidArgumentError,
    NotFoundError,
    OpenTinkerError,
    UnavailableError,
)
from opentinker_client.inference import InferenceClient

from tests.support.fake_scheduler import S


def test_unary_calls_carry_the_key_and_map_errors(fake) -> None:
    servicer, server = fake
    servicer.add_task(S.TASK_STATE_RUNNING, task_id="t-1")
    connection = SchedulerConnection(server.url, timeout=5, api_key=" k3y\n")
    assert connection.api_key == "k3y" and connection.metadata == (("authorization", "Bearer k3y"),)
    assert "k3y" not in repr(connection)
    response = connection.unary("GetTask", scheduler_pb2.GetTaskRequest(task_id="t-1"))
    assert response.task.task_id == "t-1"
    assert servicer.metadata[-1]["authorization"] == "Bearer k3y"
    with pytest.raises(NotFoundError) as err:
        connection.unary("GetTask", scheduler_pb2.GetTaskRequest(task_id="nope"))
    assert err.value.code is grpc.StatusCode.NOT_FOUND and isinstance(err.value.__cause__, grpc.RpcError)
    connection.close()
    connection.close()  # idempotent
    with pytest.raises(OpenTinkerError, match="this RLClient is closed"):
        connection.unary("GetTask", scheduler_pb2.GetTaskRequest(task_id="t-1"))
    with pytest.raises(OpenTinkerError, match="this RLClient is closed"):
        with connection.stream("WatchTask", scheduler_pb2.WatchTaskRequest(task_id="t-1")):
            pass


def test_a_stream_yields_responses_and_maps_the_error_it_ends_with(fake) -> None:
    servicer, server = fake
    servicer.add_task(task_id="t-2")
    servicer.add_state("t-2", S.TASK_STATE_RUNNING, reason="STARTED")
    servicer.add_state("t-2", S.TASK_STATE_SUCCEEDED, reason="COMPLETED")
    with SchedulerConnection(server.url, timeout=5, api_key="") as connection:
        request = scheduler_pb2.WatchTaskRequest(task_id="t-2", history_only=True)
        with connection.stream("WatchTask", request) as responses:
            assert [r.event.sequence for r in responses] == [1, 2]
        with pytest.raises(NotFoundError):
            with connection.stream("WatchTask", scheduler_pb2.WatchTaskRequest(task_id="nope")) as responses:
                list(responses)
    assert "authorization" not in servicer.metadata[-1]


def test_an_unreachable_scheduler_is_unavailable_with_the_plaintext_hint_only_where_it_applies() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with SchedulerConnection(f"127.0.0.1:{port}", timeout=15, api_key="") as connection:
        with pytest.raises(UnavailableError) as err:
            connection.unary("GetTask", scheduler_pb2.GetTaskRequest(task_id="t"))
    # Refused, not closed by a TLS port: no hint.
    assert SCHEDULER_PLAINTEXT_HINT not in err.value.details


def test_bad_arguments_are_refused_before_anything_is_sent(monkeypatch) -> None:
    with pytest.raises(ValueError, match="api_key"):
        SchedulerConnection("127.0.0.1:1", timeout=1, api_key="two words")
    with pytest.raises(ValueError):
        SchedulerConnection("ftp://h:1", timeout=1, api_key="")
    monkeypatch.setenv("OPENTINKER_API_KEY", "from-env\n")
    assert resolve_api_key(None) == "from-env" and resolve_api_key("") == ""
    for bad in ("", "  ", None, 7):
        with pytest.raises(InvalidArgumentError) as err:
            check_task_id(bad)
        assert err.value.field == "task_id"
    assert check_task_id("task-1") == "task-1"


def test_task_calls_wait_for_an_inference_endpoint(fake) -> None:
    servicer, server = fake
    servicer.add_task(S.TASK_STATE_RUNNING, task_id="inf-1", endpoint="127.0.0.1:9")
    servicer.add_task(S.TASK_STATE_FAILED, task_id="inf-2", error="boom")
    with SchedulerConnection(server.url, timeout=5, api_key="") as connection:
        tasks = TaskCalls(connection)
        assert tasks.wait_for_endpoint("inf-1", timeout=1) == "127.0.0.1:9"
        with pytest.raises(OpenTinkerError, match="boom"):
            tasks.wait_for_endpoint("inf-2", timeout=1)
        with pytest.raises(InvalidArgumentError):
            tasks.wait_for_endpoint(" ", timeout=1)
    # InferenceClient looks the endpoint up the same way, over a connection of its own.
    with InferenceClient(scheduler_url=server.url, task_id="inf-1", api_key="") as llm:
        assert (llm.target, llm.tls, llm.task_id) == ("127.0.0.1:9", False, "inf-1")


def test_the_poll_pacer_keeps_calls_for_one_key_apart(monkeypatch) -> None:
    import opentinker_client.client_tasks as client_tasks

    now = [100.0]
    slept: list[float] = []
    monkeypatch.setattr(client_tasks.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(client_tasks.time, "sleep", lambda s: slept.append(round(s, 6)))
    pacer = PollPacer()
    pacer.pace("a", 1.0)
    now[0] += 0.25
    pacer.pace("a", 1.0)  # 0.75 s early
    pacer.pace("b", 1.0)  # another key: at once
    pacer.pace("a", 0)  # off
    assert slept == [0.75]


_FAKE_SCHEDULER_PROCESS = """
import time
from tests.support.fake_scheduler import FakeScheduler, Server, S
servicer = FakeScheduler()
servicer.add_task(S.TASK_STATE_RUNNING, task_id="t-1")
servicer.add_state("t-1", S.TASK_STATE_RUNNING, reason="STARTED")
server = Server(servicer)
server.start()
print(server.url, flush=True)
time.sleep(600)
"""


def test_a_scheduler_killed_mid_stream_gets_no_tls_hint() -> None:
    import os
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", _FAKE_SCHEDULER_PROCESS], stdout=subprocess.PIPE, text=True)
    try:
        url = proc.stdout.readline().strip()
        with SchedulerConnection(url, timeout=60, api_key="") as connection:
            with pytest.raises(UnavailableError) as err:
                with connection.stream("WatchTask", scheduler_pb2.WatchTaskRequest(task_id="t-1")) as responses:
                    for _ in responses:
                        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    # The stream had run: a plaintext client never gets that far with a TLS port.
    assert "Stream removed" in err.value.details and SCHEDULER_PLAINTEXT_HINT not in err.value.details
