"""The client says why a task waits: one logging warning with the pending reason once the task has
been seen PENDING longer than the threshold; again only after a requeue."""

from __future__ import annotations

import logging

import pytest

from opentinker_client import RLClient
from opentinker_client import client_tasks
from opentinker_client.client_tasks import PendingWarner
from opentinker_client.types import TaskInfo


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(client_tasks.time, "monotonic", c)
    return c


def pending(reason: str = "no node has 1 free GPU(s)") -> TaskInfo:
    return TaskInfo(task_id="task-1", state="pending", pending_reason=reason)


def test_one_warning_with_the_reason_once_past_the_threshold(clock, caplog) -> None:
    warner = PendingWarner(30.0)
    with caplog.at_level(logging.WARNING, logger="opentinker_client"):
        warner.observe(pending())
        clock.now += 29
        warner.observe(pending())
        assert not caplog.records
        clock.now += 2
        warner.observe(pending())
        clock.now += 100
        warner.observe(pending("other reason"))
    (record,) = caplog.records
    assert record.levelno == logging.WARNING and record.name == "opentinker_client"
    assert record.getMessage() == (
        "task task-1 has been pending for 31 s: no node has 1 free GPU(s) "
        "(RLClient.pending_reason(task_id), or: opentinker get task-1)"
    )


def test_a_requeue_starts_a_new_spell(clock, caplog) -> None:
    warner = PendingWarner(5.0)
    with caplog.at_level(logging.WARNING, logger="opentinker_client"):
        warner.observe(pending())
        clock.now += 6
        warner.observe(pending())
        warner.observe(TaskInfo(task_id="task-1", state="running"))
        warner.observe(pending())  # back to PENDING (preempted, node lost): the clock restarts
        clock.now += 4
        warner.observe(pending())
        assert len(caplog.records) == 1
        clock.now += 2
        warner.observe(pending())
    assert len(caplog.records) == 2


def test_zero_turns_it_off_and_the_client_checks_the_setting(clock, caplog, monkeypatch) -> None:
    warner = PendingWarner(0)
    warner.observe(pending())
    clock.now += 10_000
    warner.observe(pending())
    assert not caplog.records
    with pytest.raises(ValueError, match="pending_warning_after must be a number of seconds >= 0"):
        RLClient(scheduler_url="127.0.0.1:1", pending_warning_after=-1)
    monkeypatch.setenv("OPENTINKER_PENDING_WARNING_AFTER", "soon")
    with pytest.raises(ValueError, match="OPENTINKER_PENDING_WARNING_AFTER: expected a number of seconds, got 'soon'"):
        RLClient(scheduler_url="127.0.0.1:1")
