"""The node agent keeps every task report until the scheduler acknowledges it, and resends the
rest in ``Register.pending`` after a reconnect, in order, once."""

from __future__ import annotations

import asyncio

import grpc

from opentinker.common.v1 import common_pb2 as C
from opentinker.node.v1 import node_pb2 as N
from opentinker.node.v1 import node_pb2_grpc
from opentinker_trainer.agent import AgentConfig, NodeAgent


class ScriptedNodeService(node_pb2_grpc.NodeServiceServicer):
    """TEST DOUBLE of the scheduler's NodeService: session 1 acknowledges the first
    ``acked_in_first`` reports, reads ``cut_after`` reports in all and ends the stream (a
    scheduler dying with reports in flight); later sessions acknowledge everything."""

    def __init__(self, *, acked_in_first: int, cut_after: int) -> None:
        self.acked_in_first, self.cut_after = acked_in_first, cut_after
        self.registers: list[N.Register] = []
        self.received: list[list[int]] = []  # report seqs read, per session
        self.first_cut = asyncio.Event()
        self.caught_up = asyncio.Event()
        self.expect_last = 0

    async def Connect(self, request_iterator, context):
        it = request_iterator.__aiter__()
        reg = (await it.__anext__()).register
        self.registers.append(reg)
        session = len(self.registers)
        seqs: list[int] = []
        self.received.append(seqs)
        ack = max((r.seq for r in reg.pending), default=0)
        yield N.ConnectResponse(registered=N.Registered(node_id=reg.node_id, report_ack=ack))
        if ack and ack >= self.expect_last:
            self.caught_up.set()
        async for msg in it:
            if msg.WhichOneof("message") != "task_report":
                continue
            seq = msg.task_report.seq
            seqs.append(seq)
            if session == 1:
                if len(seqs) <= self.acked_in_first:
                    yield N.ConnectResponse(report_ack=N.ReportAck(seq=seq))
                if len(seqs) == self.cut_after:
                    self.first_cut.set()
                    return
            else:
                yield N.ConnectResponse(report_ack=N.ReportAck(seq=seq))
                if seq >= self.expect_last:
                    self.caught_up.set()


def _metric(step: int) -> N.TaskReport:
    return N.TaskReport(task_id="t1", attempt=1, metrics=[C.MetricPoint(step=step, values={"loss": 1.0})])


def test_unacknowledged_reports_are_resent_in_order_after_a_reconnect(tmp_path) -> None:
    async def scenario() -> tuple[ScriptedNodeService, NodeAgent]:
        service = ScriptedNodeService(acked_in_first=2, cut_after=4)
        server = grpc.aio.server()
        node_pb2_grpc.add_NodeServiceServicer_to_server(service, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        agent = NodeAgent(
            AgentConfig(
                target=f"127.0.0.1:{port}", node_id="n1", work_dir=tmp_path, reconnect_initial_s=0.01, max_tasks=1
            )
        )
        run = asyncio.create_task(agent.run())
        try:
            await asyncio.wait_for(agent.connected.wait(), 30)
            for step in range(1, 6):
                agent._send_report(_metric(step))
            await asyncio.wait_for(service.first_cut.wait(), 30)
            service.expect_last = 6
            # Written while the node is cut off: goes out after the resent ones.
            agent._send_report(N.TaskReport(task_id="t1", attempt=1, state=C.TASK_STATE_SUCCEEDED))
            await asyncio.wait_for(service.caught_up.wait(), 30)
            await asyncio.sleep(0.05)  # lets the agent read the last ack
        finally:
            await agent.stop_now()
            run.cancel()
            await asyncio.gather(run, return_exceptions=True)
            await server.stop(0)
        return service, agent

    service, agent = asyncio.run(scenario())
    assert service.received[0] == [1, 2, 3, 4]
    second = service.registers[1]
    resent = [r.seq for r in second.pending]
    assert resent[:3] == [3, 4, 5], "3 and 4 were read but not acknowledged, 5 never left"
    assert [r.metrics[0].step for r in second.pending[:3]] == [3, 4, 5]
    # Everything the second session got, in register or on the stream, is each report once, in order.
    delivered = resent + service.received[1]
    assert delivered == [3, 4, 5, 6]
    if 6 in resent:
        assert [r.seq for r in second.finished] == [6], "the final also goes in finished for older schedulers"
    assert agent.unacked_reports == 0


def test_the_oldest_metric_points_give_way_past_the_limit_never_an_end(tmp_path) -> None:
    agent = NodeAgent(AgentConfig(target="127.0.0.1:1", node_id="n1", work_dir=tmp_path, unacked_limit=3))
    agent._send_report(N.TaskReport(task_id="t1", attempt=1, state=C.TASK_STATE_RUNNING))
    for step in (1, 2, 3):
        agent._send_report(_metric(step))
    assert agent.unacked_reports == 3 and agent.dropped_reports == 1
    assert [r.metrics[0].step for r in list(agent._unacked.values())[1:]] == [2, 3]
    assert next(iter(agent._unacked.values())).state == C.TASK_STATE_RUNNING


class RefusingNodeService(node_pb2_grpc.NodeServiceServicer):
    """TEST DOUBLE of schedulers that are not (yet) the leader: the first ``refusals`` sessions
    read the register and end UNAVAILABLE, as a follower does; later ones register and
    acknowledge every report."""

    def __init__(self, refusals: int) -> None:
        self.refusals = refusals
        self.registers: list[N.Register] = []
        self.steps: list[int] = []  # metric steps delivered, in register.pending or on the stream
        self.got = asyncio.Condition()

    async def Connect(self, request_iterator, context):
        it = request_iterator.__aiter__()
        reg = (await it.__anext__()).register
        self.registers.append(reg)
        if len(self.registers) <= self.refusals:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "this scheduler is a follower")
        async with self.got:
            self.steps.extend(r.metrics[0].step for r in reg.pending)
            self.got.notify_all()
        yield N.ConnectResponse(
            registered=N.Registered(node_id=reg.node_id, report_ack=max((r.seq for r in reg.pending), default=0))
        )
        async for msg in it:
            if msg.WhichOneof("message") == "task_report":
                async with self.got:
                    self.steps.append(msg.task_report.metrics[0].step)
                    self.got.notify_all()
                yield N.ConnectResponse(report_ack=N.ReportAck(seq=msg.task_report.seq))


def test_the_request_streams_of_refused_sessions_take_no_report_from_the_live_one(tmp_path) -> None:
    """A node that went from scheduler to scheduler until one took it (a failover): what it
    writes afterwards reaches the one that took it, every report (none taken by the request
    stream of a refused call, which had lost two metric points in a failover test)."""

    async def scenario() -> RefusingNodeService:
        service = RefusingNodeService(refusals=4)
        server = grpc.aio.server()
        node_pb2_grpc.add_NodeServiceServicer_to_server(service, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        agent = NodeAgent(
            AgentConfig(
                target=f"127.0.0.1:{port}", node_id="n1", work_dir=tmp_path, reconnect_initial_s=0.01, max_tasks=1
            )
        )
        run = asyncio.create_task(agent.run())
        try:
            agent._send_report(_metric(1))  # written before any scheduler took the node: goes in pending
            await asyncio.wait_for(agent.connected.wait(), 30)
            for step in range(2, 8):
                agent._send_report(_metric(step))
            async with service.got:
                # No deadline sized for a quiet machine: each report arrives at once or never.
                await asyncio.wait_for(service.got.wait_for(lambda: len(service.steps) >= 7), 30)
        finally:
            await agent.stop_now()
            run.cancel()
            await asyncio.gather(run, return_exceptions=True)
            await server.stop(0)
        return service

    service = asyncio.run(scenario())
    assert len(service.registers) == 5
    assert service.steps == [1, 2, 3, 4, 5, 6, 7]
