"""Report acknowledgements are cumulative, so the acks of one group commit go to a node as one
message (the newest, in the first one's place), held like every node command until the group
is durable; acks of different groups, or of different nodes, are never merged."""

from __future__ import annotations

import asyncio

from opentinker.common.v1 import common_pb2 as C
from opentinker.node.v1 import node_pb2 as N

from tests.support.scheduler_core import drain, make_core, register, report, spec


def _ack(seq: int) -> N.ConnectResponse:
    return N.ConnectResponse(report_ack=N.ReportAck(seq=seq))


def _what(commands) -> list:
    return [
        ("ack", c.report_ack.seq) if c.WhichOneof("command") == "report_ack" else ("assign", c.assign_task.task_id)
        for c in commands
    ]


def test_the_acks_of_one_group_go_as_the_newest_in_the_first_ones_place(tmp_path) -> None:
    async def main() -> None:
        core = make_core(tmp_path)
        core.enable_group_commit()
        node, _ = register(core)
        other, _ = register(core, "gpu-node-02")
        drain(node), drain(other)
        first = core.api.submit(spec(gpus=1), owner="u")
        node.push(_ack(1))  # held: the group is open
        assert core.schedule() == 1  # the AssignTask is held behind it
        node.push(_ack(2))
        node.push(_ack(3))
        other.push(_ack(7))
        assert drain(node) == [] and drain(other) == []  # nothing before the commit
        await core.durable()
        assert _what(drain(node)) == [("ack", 3), ("assign", first.task_id)]
        assert _what(drain(other)) == [("ack", 7)]
        # A new group: its ack is its own, not merged into the sent one.
        report(core, node, first.task_id, 1, C.TASK_STATE_RUNNING)
        node.push(_ack(4))
        await core.durable()
        assert _what(drain(node)) == [("ack", 4)]

    asyncio.run(main())


def test_without_group_commit_every_ack_goes_at_once(tmp_path) -> None:
    core = make_core(tmp_path)
    node, _ = register(core)
    drain(node)
    node.push(_ack(1))
    node.push(_ack(2))
    assert _what(drain(node)) == [("ack", 1), ("ack", 2)]
