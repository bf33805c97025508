"""Every blocking client call ends within its timeout against a frozen scheduler: connections are
accepted and nothing answers (a SIGSTOPped process). Bounds are generous: timeout + 10 s."""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
import pytest

import opentinker_client as ot
from opentinker.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from opentinker_client import InferenceClient, RLClient
from opentinker_client.client_tasks import TaskCalls
from opentinker_client.connection import SchedulerConnection

from tests.support.fake_scheduler import S
from tests.support.frozen import raises_within, silent_grpc_server, silent_socket
from tests.support.waiting import wait_for

SLACK = 10.0

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(params=["socket", "grpc"])
def frozen_url(request):
    """``http://127.0.0.1:port`` of a frozen scheduler: a socket that never speaks HTTP/2, or a
    gRPC server whose handlers never answer."""
    if request.param == "socket":
        sock = silent_socket()
        try:
            yield f"http://127.0.0.1:{sock.getsockname()[1]}"
        finally:
            sock.close()
    else:
        server, servicer, port = silent_grpc_server()
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            servicer.release()
            server.stop(grace=None)


def test_watch_gives_up_at_reconnect_timeout_against_a_frozen_scheduler(frozen_url):
    # UnavailableError: the scheduler did not answer for reconnect_timeout seconds, which is what
    # reconnect_timeout bounds (the cause says whether the last try timed out or was refused).
    with RLClient(frozen_url, timeout=30, api_key="") as client:
        client.reconnect_backoff = (0.05, 0.2)
        exc = raises_within(lambda: list(client.watch("t", reconnect_timeout=2)), 2 + SLACK)
    assert isinstance(exc, ot.UnavailableError), exc
    assert "could not reconnect" in str(exc)


def test_watch_timeout_bounds_the_whole_watch_against_a_frozen_scheduler(frozen_url):
    with RLClient(frozen_url, timeout=30, api_key="") as client:
        client.reconnect_backoff = (0.05, 0.2)
        exc = raises_within(lambda: list(client.watch("t", reconnect_timeout=None, timeout=2)), 2 + SLACK)
    assert isinstance(exc, ot.DeadlineExceededError), exc


def test_watch_timeout_bounds_a_quiet_live_stream(fake):
    servicer, server = fake
    task_id = servicer.add_task(S.TASK_STATE_RUNNING).task_id
    servicer.add_metric(task_id, 1, 1.0, 0.1)
    with RLClient(server.url, timeout=30, api_key="") as client:
        seen = []
        exc = raises_within(lambda: seen.extend(client.watch(task_id, timeout=1)), 1 + SLACK)
    assert isinstance(exc, ot.DeadlineExceededError), exc
    assert [e.sequence for e in seen] == [1]


def test_watch_keeps_a_quiet_live_stream_past_the_answer_bound(fake):
    # The per-open answer bound (half of reconnect_timeout=2) must not turn a healthy, quiet
    # stream into an outage: the scheduler still answers GetTask. The stream stays quiet for
    # several such bounds; each GetTask has a whole second, enough on a loaded machine.
    servicer, server = fake
    task_id = servicer.add_task(S.TASK_STATE_RUNNING).task_id
    servicer.add_metric(task_id, 1, 1.0, 0.1)
    with RLClient(server.url, timeout=5, api_key="", min_poll_interval=0) as client:
        client.reconnect_backoff = (0.01, 0.05)
        it = client.watch(task_id, after_sequence=1, reconnect_timeout=2)

        def later() -> None:
            time.sleep(5)
            servicer.add_state(task_id, S.TASK_STATE_SUCCEEDED, reason="COMPLETED")

        t = threading.Thread(target=later)
        t.start()
        events = list(it)
        t.join()
    assert [e.to_state for e in events] == ["succeeded"]


def test_get_task_honours_the_client_timeout_against_a_frozen_scheduler(frozen_url):
    # DeadlineExceededError: the call's own deadline (the client's timeout) passed unanswered.
    with RLClient(frozen_url, timeout=1, api_key="") as client:
        exc = raises_within(lambda: client.get_task("t"), 1 + SLACK)
    assert isinstance(exc, ot.DeadlineExceededError), exc


def test_wait_honours_its_timeout_against_a_frozen_scheduler(frozen_url):
    with RLClient(frozen_url, timeout=30, api_key="") as client:
        exc = raises_within(lambda: client.wait("t", timeout=1, poll_interval=0.2), 1 + SLACK)
    assert isinstance(exc, ot.DeadlineExceededError), exc


def test_wait_for_endpoint_honours_its_timeout_against_a_frozen_scheduler(frozen_url):
    with SchedulerConnection(frozen_url, timeout=30, api_key="") as connection:
        exc = raises_within(lambda: TaskCalls(connection).wait_for_endpoint("t", timeout=1), 1 + SLACK)
    assert isinstance(exc, ot.DeadlineExceededError), exc
    assert "did not start serving within 1 s" in str(exc)


def test_generate_stream_honours_the_timeout_against_a_frozen_server():
    sock = silent_socket()
    try:
        with InferenceClient(f"127.0.0.1:{sock.getsockname()[1]}", timeout=1, api_key="") as client:
            exc = raises_within(lambda: list(client.generate_stream("hi")), 1 + SLACK)
    finally:
        sock.close()
    assert isinstance(exc, ot.DeadlineExceededError), exc


class _QuietWithHeaders(scheduler_pb2_grpc.SchedulerServiceServicer):
    """WatchTask sends its headers at once, then nothing until released: alive, just quiet."""

    def __init__(self) -> None:
        self.released = threading.Event()

    def WatchTask(self, request, context):
        context.send_initial_metadata(())
        self.released.wait()
        return
        yield  # pragma: no cover


def test_stream_answer_timeout_spares_a_stream_that_sent_its_headers():
    servicer = _QuietWithHeaders()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    out: list = []
    try:
        with SchedulerConnection(f"127.0.0.1:{port}", timeout=30, api_key="") as connection:
            request = scheduler_pb2.WatchTaskRequest(task_id="t")
            with connection.stream("WatchTask", request, answer_timeout=0.3) as responses:
                t = threading.Thread(target=lambda: out.extend(responses), daemon=True)
                t.start()
                wait_for(lambda: responses.answered, timeout=10, what="the headers counted as an answer")
                servicer.released.set()  # the stream then ends normally: not cancelled by the bound
                t.join(10)
                assert not t.is_alive()
    finally:
        servicer.released.set()
        server.stop(grace=None)
    assert out == []
