"""`opentinker get` and `compare` of a task that ran two attempts: "started" is the task's first
start and the wall time counts from it, over both attempts and the time between them (`get` shows
the current attempt's own time beside it). A real scheduler on loopback; the nodes' reports are
applied on the scheduler's loop (no trainer process). Attempt 1's start is moved 100 s back in the
event log, as a task whose first attempt ran 100 s before its node was lost."""

from __future__ import annotations

import datetime as dt
import re

from opentinker.common.v1 import common_pb2 as C
from opentinker.node.v1 import node_pb2 as N
from opentinker_client.cli.commands import _fmt_time, main

from tests.support.scheduler_core import drain, register, spec
from tests.support.security import LoopbackScheduler

EARLIER_S = 100


def _two_attempts(s: LoopbackScheduler) -> tuple[str, dt.datetime]:
    """A task that ran on a node that was lost, then ran again to the end on another; and when
    its first attempt started (moved ``EARLIER_S`` back)."""

    def run() -> tuple[str, dt.datetime]:
        node, _ = register(s.core, "cpu-a", gpus=0)
        task = s.core.api.submit(spec(gpus=0), owner="")
        s.core.schedule()
        drain(node)
        tid = task.task_id
        s.core.node_report(node, N.TaskReport(task_id=tid, attempt=1, state=C.TASK_STATE_RUNNING))
        node.last_seen -= s.core.config.lease_s + 1  # the node is lost: attempt 2
        s.core.tick()
        other, _ = register(s.core, "cpu-b", gpus=0)
        s.core.schedule()
        drain(other)
        assert s.core.api.get(tid).attempt == 2
        s.core.node_report(other, N.TaskReport(task_id=tid, attempt=2, state=C.TASK_STATE_RUNNING))
        s.core.node_report(other, N.TaskReport(task_id=tid, attempt=2, state=C.TASK_STATE_SUCCEEDED))

        db = s.core.store.db
        for seq, payload in db.execute("SELECT seq, payload FROM events WHERE task_id=? AND kind='state'", (tid,)):
            event = C.TaskEvent.FromString(payload)
            change = event.state_change
            if change.to_state == C.TASK_STATE_RUNNING and change.attempt == 1:
                event.time.seconds -= EARLIER_S
                with s.core.store._tx():
                    db.execute(
                        "UPDATE events SET payload=? WHERE task_id=? AND seq=?", (event.SerializeToString(), tid, seq)
                    )
                return tid, event.time.ToDatetime(tzinfo=dt.timezone.utc)
        raise AssertionError("no RUNNING event of attempt 1")

    return s.do(run)


def test_get_and_compare_count_from_the_first_start_over_every_attempt(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")  # wide enough that compare's table folds no cell
    with LoopbackScheduler(tmp_path / "state", "heartbeat_interval: 0.5\n") as sched:
        task_id, first = _two_attempts(sched)
        capsys.readouterr()
        assert main(["--scheduler-url", sched.target, "get", task_id]) == 0
        rows = {}
        for line in capsys.readouterr().out.splitlines():
            key, _, value = line.strip().partition("  ")
            rows[key] = value.strip()
        assert rows["started"] == _fmt_time(first)
        assert rows["attempt started"].endswith("(attempt 2)") and rows["attempt started"] != rows["started"]
        _assert_both_attempts(rows["wall time"])

        assert main(["--scheduler-url", sched.target, "compare", task_id]) == 0
        row = next(line for line in capsys.readouterr().out.splitlines() if "succeeded" in line)
        cells = [cell.strip() for cell in row.split("│")]
        wall = int(cells[5].removesuffix(" s"))  # task, name, state, steps, wall time
        assert EARLIER_S <= wall < EARLIER_S + 60, row


def _assert_both_attempts(text: str) -> None:
    """``text`` holds a wall time of ``EARLIER_S`` seconds and more, and attempt 2's, shorter."""
    found = re.search(r"(\d+) s \(attempt 2: (\d+) s\)", text)
    assert found, text
    whole, attempt = int(found[1]), int(found[2])
    assert EARLIER_S <= whole < EARLIER_S + 60 and attempt < whole, text
