"""WatchTask on schedulers sharing a real PostgreSQL: a database restart ends the stream with
UNAVAILABLE and the client's watch resumes through it to the terminal event; a follower's watch
never ends without the terminal event, even when the leader commits it between the follower's
reads."""

from __future__ import annotations

import logging
import threading

import grpc
import pytest

from opentinker.common.v1 import common_pb2 as C
from opentinker.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from opentinker_client import RLClient
from opentinker_client.errors import OpenTinkerError
from opentinker_scheduler.config import SchedulerConfig
from opentinker_scheduler.config.store import StoreConfig
from opentinker_scheduler.server import start_scheduler

from tests.support.loop_thread import LoopThread
from tests.support.waiting import wait_for

SPEC = C.TaskSpec(workload_type="lora_finetune", model="/models/m")  # no trainer: it stays pending


@pytest.fixture
def schedulers(tmp_path, postgres_server):
    """``start(n)``: n schedulers on one fresh schema, each on its own event loop thread."""
    schema = postgres_server.new_schema()
    started: list[tuple[LoopThread, object]] = []

    def start(n: int) -> list:
        for i in range(n):
            config = SchedulerConfig(
                state_dir=tmp_path / f"s{i}",
                heartbeat_interval_s=0.5,
                lease_s=3,
                store=StoreConfig(
                    kind="postgres", dsn=postgres_server.dsn(), schema=schema, leader_lease_s=3, renew_interval_s=0.5
                ),
            )
            loop = LoopThread()
            started.append(
                (loop, loop.call(start_scheduler(config, host="127.0.0.1", port=0, http_port=0, tick_interval_s=0.1)))
            )
        return [r for _, r in started]

    yield start
    for loop, running in started:
        try:
            loop.call(running.stop(0))
        except Exception:  # noqa: BLE001 - a stop that fails must not hide the test's result
            pass
        loop.close()


def test_a_watch_goes_on_through_a_database_restart_to_the_terminal_event(schedulers, postgres_server, caplog) -> None:
    (sched,) = schedulers(1)
    wait_for(lambda: sched.core.leading, timeout=30, what="the scheduler leads")
    target = f"127.0.0.1:{sched.port}"
    client = RLClient(target)
    task_id = client.submit_task(workload_type="lora_finetune", model="/models/m")

    seen: list = []
    failed: list[BaseException] = []

    def watch() -> None:
        try:
            for event in client.watch(task_id, reconnect_timeout=None):
                seen.append(event)
        except BaseException as exc:  # noqa: BLE001 - the test reports it
            failed.append(exc)

    caplog.set_level(logging.WARNING, logger="opentinker_client")
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    wait_for(lambda: seen, what="the submit event on the watch")

    postgres_server.stop("fast")
    try:
        # The stream ends with UNAVAILABLE (not UNKNOWN): the store's error, mapped.
        with grpc.insecure_channel(target) as channel:
            stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
            with pytest.raises(grpc.RpcError) as info:
                list(stub.WatchTask(scheduler_pb2.WatchTaskRequest(task_id=task_id), timeout=30))
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value
            assert "state store unavailable" in info.value.details()
        wait_for(
            lambda: failed or any("interrupted" in r.getMessage() for r in caplog.records),
            what="the client's watch lost its stream",
        )
    finally:
        postgres_server.start()
    assert not failed, f"the watch raised instead of reconnecting: {failed[0]!r}"

    def cancelled() -> bool:
        try:
            client.cancel(task_id, reason="done watching")
        except OpenTinkerError:
            return False  # the store or the lease is still coming back
        return True

    wait_for(cancelled, what="a cancel once the database is back")
    watcher.join(60)
    assert not watcher.is_alive(), "the watch did not end after the terminal event"
    assert not failed, f"the watch raised: {failed[0]!r}"
    assert [e.sequence for e in seen] == list(range(1, len(seen) + 1))  # none lost, none twice
    assert seen[-1].kind == "state" and seen[-1].to_state == "cancelled"
    client.close()


def test_a_follower_watch_ends_with_the_terminal_event_committed_between_its_reads(schedulers, monkeypatch) -> None:
    running = schedulers(2)
    wait_for(lambda: sorted(r.core.leading for r in running) == [False, True], timeout=30, what="one leader")
    leader, follower = sorted(running, key=lambda r: not r.core.leading)
    with (
        grpc.insecure_channel(f"127.0.0.1:{leader.port}") as lch,
        grpc.insecure_channel(f"127.0.0.1:{follower.port}") as fch,
    ):
        to_leader = scheduler_pb2_grpc.SchedulerServiceStub(lch)
        task = to_leader.SubmitTask(scheduler_pb2.SubmitTaskRequest(spec=SPEC), timeout=30).task

        # The follower's first read that finds no new event waits there until the leader has
        # committed the task's end: the commit lands between that read and the next one.
        between, committed = threading.Event(), threading.Event()
        read = follower.core.store.events_after

        def events_after(task_id, after_seq, **kw):
            events = read(task_id, after_seq, **kw)
            if task_id == task.task_id and not events and not between.is_set():
                between.set()
                assert committed.wait(60), "the leader's cancel did not commit"
            return events

        monkeypatch.setattr(follower.core.store, "events_after", events_after)
        got: list = []
        failed: list[BaseException] = []

        def watch() -> None:
            try:
                request = scheduler_pb2.WatchTaskRequest(task_id=task.task_id)
                got.extend(
                    r.event for r in scheduler_pb2_grpc.SchedulerServiceStub(fch).WatchTask(request, timeout=120)
                )
            except BaseException as exc:  # noqa: BLE001 - the test reports it
                failed.append(exc)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        assert between.wait(60), "the follower's watch never read past the submit event"
        to_leader.CancelTask(scheduler_pb2.CancelTaskRequest(task_id=task.task_id), timeout=30)  # committed
        committed.set()
        watcher.join(60)
        assert not watcher.is_alive() and not failed, failed
        assert [e.sequence for e in got] == list(range(1, len(got) + 1))
        last = got[-1]
        assert last.WhichOneof("event") == "state_change", last
        assert last.state_change.to_state == C.TASK_STATE_CANCELLED, last
