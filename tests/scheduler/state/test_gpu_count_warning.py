"""A resource_pool node that registers with another number of GPUs than the config declares is
warned of once per node and mismatch, naming both numbers and what to change: not again when its
trainer reconnects or re-registers after a scheduler restart; again when the mismatch changes."""

from __future__ import annotations

from structlog.testing import capture_logs

from opentinker.common.v1 import common_pb2 as C
from opentinker.node.v1 import node_pb2 as N
from opentinker_scheduler.state.node_protocol import gpu_count_mismatch
from opentinker_scheduler.config import PoolNode

from tests.support.scheduler_core import make_core, report, spec

EVENT = "resource_pool gpu_count differs from the GPUs the node reports"
POOL = PoolNode("gpu-node-01", 4, 8)


def _reg(gpus: int, *, simulated: bool = False, running=()) -> N.Register:
    devices = [C.Device(index=i, uuid=f"u{i}", name="g", simulated=simulated) for i in range(gpus)]
    return N.Register(
        node_id="gpu-node-01",
        devices=devices,
        max_tasks=8,
        gpu_note="" if gpus else "NVML not available: libnvidia-ml.so.1 not found",
        running=[N.RunningTask(task_id=t, attempt=a) for t, a in running],
    )


def _warnings(logs) -> list[dict]:
    return [e for e in logs if e["event"] == EVENT]


def _reconnect(core, reg: N.Register):
    node = core.ledger.nodes[reg.node_id]
    core.node_protocol.node_disconnected(node, node.generation, goodbye=False)
    return core.node_register(reg)[0]


def test_a_cpu_trainer_on_a_gpu_pool_entry_is_told_once_what_to_change(tmp_path) -> None:
    core = make_core(tmp_path)
    with capture_logs() as logs:
        _, registered = core.node_register(_reg(0))
        for _ in range(3):  # the trainer reconnects: the same mismatch, said already
            _reconnect(core, _reg(0))
    assert registered.gpu_count == 0
    (warning,) = _warnings(logs)
    assert warning["log_level"] == "warning" and (warning["config_gpu_count"], warning["reported_gpus"]) == (4, 0)
    advice = warning["advice"]
    assert "declares gpu-node-01 with gpu_count 4, but the node reports no GPU (NVML not available" in advice
    assert "takes only CPU tasks" in advice and "set gpu_count: 0 for gpu-node-01" in advice


def test_a_scheduler_restart_warns_once_not_at_recovery_and_again_at_reregistration(tmp_path) -> None:
    core = make_core(tmp_path)
    task = core.api.submit(spec(gpus=0), owner="u")
    node, _ = core.node_register(_reg(0))
    core.schedule()
    report(core, node, task.task_id, 1, C.TASK_STATE_RUNNING)
    core.store.close()
    with capture_logs() as logs:
        restarted = make_core(tmp_path)  # knows the node from the store: no warning yet
        assert not _warnings(logs)
        restarted.node_register(_reg(0, running=[(task.task_id, 1)]))
    assert len(_warnings(logs)) == 1


def test_a_gpu_node_with_fewer_gpus_is_warned_and_again_when_that_changes(tmp_path) -> None:
    core = make_core(tmp_path)
    with capture_logs() as logs:
        core.node_register(_reg(2))
        _reconnect(core, _reg(2))
        _reconnect(core, _reg(3))  # another mismatch: said too
        _reconnect(core, _reg(4))  # agrees now: nothing
        _reconnect(core, _reg(2))  # and the first mismatch is back: said again
    assert [w["reported_gpus"] for w in _warnings(logs)] == [2, 3, 2]
    advice = _warnings(logs)[0]["advice"]
    assert "gpu_count 4, but the node reports 2 GPU(s); using 2" in advice and "set gpu_count: 2" in advice


def test_the_advice_names_both_numbers_and_which_to_change() -> None:
    assert gpu_count_mismatch(_reg(4), POOL, config="c.yaml") is None
    assert gpu_count_mismatch(_reg(0), None, config="c.yaml") is None  # not in resource_pool
    more = gpu_count_mismatch(_reg(8, simulated=True), POOL, config="c.yaml")
    assert more.startswith("c.yaml declares gpu-node-01 with gpu_count 4, but the node reports 8 simulated GPU(s)")
    assert "using 4 (resource_pool is an upper bound)" in more and "set gpu_count: 8 for gpu-node-01 in c.yaml" in more
