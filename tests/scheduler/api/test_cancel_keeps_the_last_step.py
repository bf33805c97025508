"""A task cancelled while running: the step its worker finishes on the way out and the checkpoint
it writes then are recorded after the CANCELLED event, so the task's step and its checkpoint's
step agree, a watch shows that checkpoint (the stream stays open until the worker is gone), and
the CLI shows the cancel as a cancel, not an error. A real scheduler on loopback; the node's
reports are applied on the scheduler's loop (no trainer process)."""

from __future__ import annotations

import re

import pytest

from opentinker.common.v1 import common_pb2 as C
from opentinker.node.v1 import node_pb2 as N
from opentinker_client import RLClient
from opentinker_client.cli.commands import main

from tests.support.scheduler_core import drain, register, spec
from tests.support.security import LoopbackScheduler


@pytest.fixture(scope="module")
def sched(tmp_path_factory):
    with LoopbackScheduler(tmp_path_factory.mktemp("cancel") / "state") as s:
        yield s


def _point(step: int) -> C.MetricPoint:
    return C.MetricPoint(step=step, values={"loss": 1.0 / step, "reward": step / 10})


def _ck(step: int) -> C.Checkpoint:
    return C.Checkpoint(step=step, path=f"/ck/step_{step}", format="peft_lora")


def _running_task(s: LoopbackScheduler, node_id: str) -> tuple[object, str]:
    """A CPU task running on ``node_id`` after 8 steps (checkpointed at step 8)."""

    def start():
        node, _ = register(s.core, node_id, gpus=0)
        task = s.core.api.submit(spec(gpus=0), owner="")
        s.core.schedule()
        drain(node)
        s.core.node_report(node, N.TaskReport(task_id=task.task_id, attempt=1, state=C.TASK_STATE_RUNNING))
        points = [_point(n) for n in range(1, 9)]
        s.core.node_report(node, N.TaskReport(task_id=task.task_id, attempt=1, metrics=points, checkpoint=_ck(8)))
        return node, task.task_id

    return s.do(start)


def _report(s: LoopbackScheduler, node, task_id: str, **kw) -> None:
    s.do(s.core.node_report, node, N.TaskReport(task_id=task_id, attempt=1, **kw))


def test_a_watch_shows_the_checkpoint_written_after_the_cancel_and_ends_when_the_worker_is_gone(sched) -> None:
    node, task_id = _running_task(sched, "cpu-watch")
    with RLClient(sched.target) as client:
        events = client.watch(task_id, after_sequence=0)
        client.cancel(task_id, reason="enough")
        seen = []
        for event in events:
            seen.append(event)
            if event.is_terminal:
                break
        assert seen[-1].to_state == "cancelled"
        # The worker finishes step 9 and checkpoints it on SIGTERM, after the CANCELLED event.
        _report(sched, node, task_id, metrics=[_point(9)])
        _report(sched, node, task_id, checkpoint=_ck(9))
        after = [next(events), next(events)]
        assert [(e.kind, e.step) for e in after] == [("metric", 9), ("checkpoint", 9)]
        _report(sched, node, task_id, state=C.TASK_STATE_CANCELLED, error="enough")
        assert list(events) == []  # the stream ends once the node says the worker is gone
        task = client.get_task(task_id)
    assert (task.state, task.latest_step, task.checkpoint_step) == ("cancelled", 9, 9)


def test_get_and_logs_of_a_cancelled_task(sched, capsys) -> None:
    node, task_id = _running_task(sched, "cpu-cli")
    assert main(["--scheduler-url", sched.target, "cancel", task_id, "--reason", "enough"]) == 0
    _report(sched, node, task_id, metrics=[_point(9)], checkpoint=_ck(9))
    _report(sched, node, task_id, state=C.TASK_STATE_CANCELLED, error="enough")
    capsys.readouterr()

    assert main(["--scheduler-url", sched.target, "get", task_id]) == 0
    rows = dict(
        (re.split(r"\s{2,}", line.strip(), maxsplit=1) + [""])[:2] for line in capsys.readouterr().out.splitlines()
    )
    assert rows["step"] == "9" and rows["checkpoint"] == "/ck/step_9 (step 9)"
    assert rows["cancelled"] == "by user: enough" and "error" not in rows

    assert main(["--scheduler-url", sched.target, "logs", task_id]) == 0
    lines = capsys.readouterr().out.splitlines()
    at = next(i for i, line in enumerate(lines) if "-> cancelled" in line)
    assert any("checkpoint step 9: /ck/step_9" in line for line in lines[at + 1 :]), lines
    assert lines[-1] == "cancelled by user: enough" and not any(line.startswith("error") for line in lines)


def test_a_worker_killed_before_its_exit_checkpoint_says_so_after_the_cancel(tmp_path, capsys, monkeypatch) -> None:
    # A narrow output (a CI log's $COLUMNS): each event stays on one line of `logs`, whole.
    monkeypatch.setenv("COLUMNS", "60")
    with LoopbackScheduler(tmp_path / "state") as sched:  # its own: no other test's node takes the task
        _killed_after_the_cancel(sched, capsys)


def _killed_after_the_cancel(sched, capsys) -> None:
    node, task_id = _running_task(sched, "cpu-killed")
    with RLClient(sched.target) as client:
        events = client.watch(task_id, after_sequence=0)
        client.cancel(task_id, reason="enough")
        for event in events:
            if event.is_terminal:
                break
        # --kill-grace ended the worker before it checkpointed: the trainer's `killed` phase
        kept = "the newest checkpoint is this attempt's step 8"
        killed = C.TaskPhase(
            attempt=1, phase="killed", detail=f"after --kill-grace (10 s), before its exit checkpoint; {kept}"
        )
        _report(sched, node, task_id, phase=killed)
        after = next(events)
        assert (after.kind, after.phase, after.attempt) == ("phase", "killed", 1)
        assert after.message.endswith("the newest checkpoint is this attempt's step 8")
        _report(sched, node, task_id, state=C.TASK_STATE_CANCELLED, error="enough")
        assert list(events) == []
        task = client.get_task(task_id)
    assert (task.state, task.latest_step, task.checkpoint_step) == ("cancelled", 8, 8)
    capsys.readouterr()
    assert main(["--scheduler-url", sched.target, "logs", task_id]) == 0
    lines = capsys.readouterr().out.splitlines()
    at = next(i for i, line in enumerate(lines) if "-> cancelled" in line)
    assert any(
        "killed after --kill-grace (10 s), before its exit checkpoint; the newest checkpoint is this attempt's step 8 "
        "(attempt 1)" in line
        for line in lines[at + 1 :]
    ), lines


def test_watch_prints_each_line_whole_at_a_narrow_width(tmp_path, capsys, monkeypatch) -> None:
    # The summary's checkpoint path is one line to copy, however narrow the output ($COLUMNS).
    monkeypatch.setenv("COLUMNS", "40")
    with LoopbackScheduler(tmp_path / "state") as sched:  # its own: no other test's node takes the task
        _watch_narrow(sched, capsys)


def _watch_narrow(sched, capsys) -> None:
    node, task_id = _running_task(sched, "cpu-narrow")
    path = "/shared/checkpoints/task-with-a-long-name/attempt-1/step_9"
    _report(sched, node, task_id, metrics=[_point(9)], checkpoint=C.Checkpoint(step=9, path=path, format="peft_lora"))
    _report(sched, node, task_id, state=C.TASK_STATE_SUCCEEDED)
    capsys.readouterr()
    assert main(["--scheduler-url", sched.target, "watch", task_id]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert f"  checkpoint: {path} (step 9)" in lines, lines
    assert f"checkpoint step 9: {path} (peft_lora)" in lines and lines[0].endswith("is succeeded"), lines
