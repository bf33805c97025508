"""The metric history of a task that resumed: attempt 1 reports steps 1 to 5 and checkpoints step
3; its node drains; attempt 2 resumes from step 3 and reports steps 4 to 6 again. GetMetrics (and
``get_metric_history``, the dashboard's curves) shows each step once, the newest attempt's, and
every point says its attempt; the watch log keeps both reports of steps 4 and 5, each with its
attempt, ``opentinker logs --metrics`` marks the resumed attempt's and the dashboard's attempts
table says which steps of the charts each attempt ran. A real scheduler on
loopback; the node's reports are applied on the scheduler's loop (no trainer process)."""

from __future__ import annotations

import re
import urllib.request

from opentinker.common.v1 import common_pb2 as C
from opentinker.node.v1 import node_pb2 as N
from opentinker.scheduler.v1 import scheduler_pb2 as S
from opentinker.scheduler.v1 import scheduler_pb2_grpc
from opentinker_client import RLClient
from opentinker_client.cli.commands import main

from tests.support.scheduler_core import drain, register, spec
from tests.support.security import LoopbackScheduler


def _point(step: int, attempt: int) -> C.MetricPoint:
    return C.MetricPoint(step=step, values={"loss": 10.0 * attempt + step})


def _resumed_task(s: LoopbackScheduler) -> str:
    def run():
        node, _ = register(s.core, "cpu-a", gpus=0)
        task = s.core.api.submit(spec(gpus=0), owner="")
        s.core.schedule()
        drain(node)
        tid = task.task_id
        s.core.node_report(node, N.TaskReport(task_id=tid, attempt=1, state=C.TASK_STATE_RUNNING))
        s.core.node_report(node, N.TaskReport(task_id=tid, attempt=1, metrics=[_point(n, 1) for n in (1, 2, 3)]))
        ck = C.Checkpoint(step=3, path="/ck/step_3", format="peft_lora")
        s.core.node_report(node, N.TaskReport(task_id=tid, attempt=1, checkpoint=ck))
        s.core.node_report(node, N.TaskReport(task_id=tid, attempt=1, metrics=[_point(n, 1) for n in (4, 5)]))
        node.last_seen -= s.core.config.lease_s + 1  # the node is lost: attempt 2 resumes from step 3
        s.core.tick()
        other, _ = register(s.core, "cpu-b", gpus=0)
        s.core.schedule()
        drain(other)
        assert s.core.api.get(tid).attempt == 2
        s.core.node_report(other, N.TaskReport(task_id=tid, attempt=2, state=C.TASK_STATE_RUNNING))
        s.core.node_report(other, N.TaskReport(task_id=tid, attempt=2, metrics=[_point(n, 2) for n in (4, 5, 6)]))
        return tid

    return s.do(run)


def test_a_resumed_step_is_shown_once_and_every_point_says_its_attempt(tmp_path, capsys) -> None:
    with LoopbackScheduler(tmp_path / "state", "heartbeat_interval: 0.5\n", http_port=0) as sched:
        task_id = _resumed_task(sched)
        with sched.channel() as channel:
            stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
            got = stub.GetMetrics(S.GetMetricsRequest(task_id=task_id, include_history=True))
        assert [(p.step, p.attempt, p.values["loss"]) for p in got.points] == [
            (1, 1, 11.0),
            (2, 1, 12.0),
            (3, 1, 13.0),
            (4, 2, 24.0),
            (5, 2, 25.0),
            (6, 2, 26.0),
        ]
        with RLClient(sched.target) as client:
            assert [(s, v["loss"]) for s, v in client.get_metric_history(task_id)] == [
                (1, 11.0),
                (2, 12.0),
                (3, 13.0),
                (4, 24.0),
                (5, 25.0),
                (6, 26.0),
            ]
            logged = [(e.step, e.attempt) for e in client.watch(task_id, follow=False) if e.kind == "metric"]
        assert logged == [(1, 1), (2, 1), (3, 1), (4, 1), (5, 1), (4, 2), (5, 2), (6, 2)]
        capsys.readouterr()
        assert main(["--scheduler-url", sched.target, "logs", task_id, "--metrics"]) == 0
        lines = [line for line in capsys.readouterr().out.splitlines() if "  step " in line]
        assert [("(attempt 2)" in line) for line in lines] == [False] * 5 + [True] * 3, lines
        # The dashboard's attempts table says which steps of the charts each attempt ran.
        url = f"http://127.0.0.1:{sched.running.http.port}/ui/task/{task_id}"
        with urllib.request.urlopen(url, timeout=30) as resp:
            page = resp.read().decode()
        table = re.search(r'<table id="attempts">.*?</table>', page, re.S).group(0)
        assert "<th>steps charted</th>" in table
        cells = [re.findall(r"<td>([^<]*)</td>", row) for row in re.findall(r"<tr>(<td>.*?)</tr>", table)]
        assert [(c[0], c[-1]) for c in cells] == [("1", "1-3"), ("2", "4-6")], table
