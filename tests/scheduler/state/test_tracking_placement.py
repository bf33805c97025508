"""A task naming ``spec.tracking`` loggers is placed only on a node that said it can write them
(``Register.tracking_loggers``); while only nodes without them have room it waits, and its
pending reason says why and what to install."""

from __future__ import annotations

from google.protobuf import struct_pb2

from opentinker.common.v1 import common_pb2 as C
from opentinker.node.v1 import node_pb2 as N

from tests.support.scheduler_core import drain, make_core, report, spec


def _register(core, node_id: str, *loggers: str, reported: bool = True):
    node, _ = core.node_register(
        N.Register(node_id=node_id, max_tasks=1, tracking_loggers=list(loggers), tracking_reported=reported)
    )
    return node


def _with_wandb(s: C.TaskSpec) -> C.TaskSpec:
    tracking = struct_pb2.Struct()
    tracking.update({"wandb": {"project": "p", "mode": "offline"}})
    s.tracking.CopyFrom(tracking)
    return s


def test_a_task_naming_a_logger_goes_to_a_node_that_can_write_it(tmp_path) -> None:
    core = make_core(tmp_path)
    wandb = _register(core, "b-wandb", "tensorboard", "wandb")
    busy = core.api.submit(spec(gpus=0), owner="u")
    assert core.schedule() == 1  # b-wandb's one slot is taken
    assert [c.assign_task.task_id for c in drain(wandb)] == [busy.task_id]
    plain = _register(core, "a-plain", "tensorboard")  # room, and first in best-fit order
    task = core.api.submit(_with_wandb(spec(gpus=0)), owner="u")
    assert core.schedule() == 0, "placed on a node that cannot write its logger"
    reason = core.reasons.reason(task.task_id)
    assert "waiting for a node that can write its spec.tracking loggers (wandb)" in reason, reason
    assert "(a-plain; install opentinker[wandb] there)" in reason, reason
    other = core.api.submit(spec(gpus=0), owner="u")  # names no logger: any node
    assert core.schedule() == 1
    assert [c.assign_task.task_id for c in drain(plain)] == [other.task_id]
    report(core, wandb, busy.task_id, 1, state=C.TASK_STATE_RUNNING)
    report(core, wandb, busy.task_id, 1, state=C.TASK_STATE_SUCCEEDED)
    assert core.schedule() == 1
    assert [c.assign_task.task_id for c in drain(wandb)] == [task.task_id]


def test_a_node_that_did_not_say_is_not_left_out(tmp_path) -> None:
    core = make_core(tmp_path)
    old = _register(core, "old-agent", reported=False)  # an agent from before the field
    task = core.api.submit(_with_wandb(spec(gpus=0)), owner="u")
    assert core.schedule() == 1
    assert [c.assign_task.task_id for c in drain(old)] == [task.task_id]
