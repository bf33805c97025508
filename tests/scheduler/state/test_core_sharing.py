"""GPU sharing: LoRA tasks on the same base model may share a GPU, up to max_tasks_per_gpu (or
the tenants a node's model host takes) and within max_tasks; other tasks, other base models and
tasks being stopped never share."""

from __future__ import annotations

import time

from opentinker.common.v1 import common_pb2 as C
from opentinker.node.v1 import node_pb2 as N
from opentinker_scheduler.policy.preemption import NodeState, RunningAlloc, choose_victims

from tests.support.scheduler_core import drain, make_core, register, report, spec


def _assigned(node) -> dict[str, tuple[int, ...]]:
    return {
        c.assign_task.task_id: tuple(c.assign_task.device_indices)
        for c in drain(node)
        if c.WhichOneof("command") == "assign_task"
    }


def test_same_base_model_lora_tasks_share_a_gpu(tmp_path) -> None:
    core = make_core(tmp_path, max_tasks_per_gpu=2)
    node, _ = register(core, gpus=1)
    a = core.api.submit(spec(gpus=1), owner="u")
    b = core.api.submit(spec(gpus=1), owner="u")
    c = core.api.submit(spec(gpus=1), owner="u")
    other = core.api.submit(spec(gpus=1, model="/models/other"), owner="u")
    assert core.schedule() == 2
    assert _assigned(node) == {a.task_id: (0,), b.task_id: (0,)}
    # The GPU is at max_tasks_per_gpu; a task on another base model never joins it.
    assert "free or shareable with LoRA tasks on /models/m; the most is 0" in core.reasons.reason(c.task_id)
    assert "free or shareable with LoRA tasks on /models/other; the most is 0" in core.reasons.reason(other.task_id)
    report(core, node, a.task_id, 1, C.TASK_STATE_SUCCEEDED)
    assert core.schedule() == 1 and _assigned(node) == {c.task_id: (0,)}
    report(core, node, b.task_id, 1, C.TASK_STATE_SUCCEEDED)
    report(core, node, c.task_id, 1, C.TASK_STATE_SUCCEEDED)
    assert core.schedule() == 1 and _assigned(node) == {other.task_id: (0,)}


def test_sharing_packs_and_keeps_whole_gpus_free_for_gang_tasks(tmp_path) -> None:
    core = make_core(tmp_path, max_tasks_per_gpu=4)
    node, _ = register(core, gpus=4)
    loras = [core.api.submit(spec(gpus=1), owner="u") for _ in range(3)]
    gang = core.api.submit(spec(gpus=3, model="/models/big"), owner="u")
    assert core.schedule() == 4
    placed = _assigned(node)
    assert {placed[t.task_id] for t in loras} == {(0,)}  # all three on one GPU
    assert placed[gang.task_id] == (1, 2, 3)


def test_no_sharing_with_max_tasks_per_gpu_1_or_beyond_max_tasks(tmp_path) -> None:
    core = make_core(tmp_path, max_tasks_per_gpu=1)
    node, _ = register(core, gpus=1)
    a, b = core.api.submit(spec(gpus=1), owner="u"), core.api.submit(spec(gpus=1), owner="u")
    assert core.schedule() == 1 and core.api.get(b.task_id).state == C.TASK_STATE_PENDING
    assert "no node has 1 free GPU(s)" in core.reasons.reason(b.task_id)
    assert a.task_id in _assigned(node)

    core2 = make_core(tmp_path / "two", max_tasks_per_gpu=8)
    core2.node_register(N.Register(node_id="edge-1", devices=[C.Device(index=0, simulated=True)], max_tasks=2))
    ts = [core2.api.submit(spec(gpus=1), owner="u") for _ in range(3)]
    assert core2.schedule() == 2  # max_tasks bounds the node whatever the per-GPU limit
    assert core2.api.get(ts[2].task_id).state == C.TASK_STATE_PENDING


def test_a_task_being_stopped_shares_with_nobody(tmp_path) -> None:
    core = make_core(tmp_path, max_tasks_per_gpu=2)
    node, _ = register(core, gpus=1)
    a = core.api.submit(spec(gpus=1), owner="u")
    core.schedule()
    drain(node)
    core.api.cancel(a.task_id)  # not yet confirmed gone: it keeps the GPU, alone
    b = core.api.submit(spec(gpus=1), owner="u")
    assert core.schedule() == 0
    report(core, node, a.task_id, 1, C.TASK_STATE_CANCELLED)
    assert core.schedule() == 1 and _assigned(node) == {b.task_id: (0,)}


def test_ledger_survives_restart_with_shared_gpus(tmp_path) -> None:
    core = make_core(tmp_path, max_tasks_per_gpu=2)
    node, _ = register(core, gpus=1)
    a, b = core.api.submit(spec(gpus=1), owner="u"), core.api.submit(spec(gpus=1), owner="u")
    assert core.schedule() == 2
    core.store.close()
    core = make_core(tmp_path, max_tasks_per_gpu=2)
    node, _ = register(core, gpus=1, running=[(a.task_id, 1), (b.task_id, 1)])
    assert set(node.allocations) == {a.task_id, b.task_id}
    c = core.api.submit(spec(gpus=1), owner="u")
    assert core.schedule() == 0  # the GPU is full of recovered tenants
    assert core.api.get(c.task_id).state == C.TASK_STATE_PENDING


def test_victims_on_a_shared_gpu_all_go_and_unneeded_ones_stay() -> None:
    # GPU 0 is shared by two LoRA tasks; GPU 1 has one. A 1-GPU task needs one of them emptied.
    node = NodeState(
        "n",
        gpu_count=2,
        max_tasks=8,
        free_gpus=0,
        running=(
            RunningAlloc("shared-old", 0, 1, 1.0, (0,)),
            RunningAlloc("shared-new", 0, 1, 5.0, (0,)),
            RunningAlloc("alone", 1, 1, 2.0, (1,)),
        ),
    )
    choice = choose_victims(10, 1, [node])
    # Youngest lowest-priority first is "shared-new", which frees nothing alone; "shared-old"
    # then empties GPU 0. "alone" (priority 1) is never needed.
    assert choice is not None and set(choice.victims) == {"shared-new", "shared-old"}
    # When the cheaper way is one victim on its own GPU, the shared pair is left alone.
    node2 = NodeState(
        "n",
        2,
        8,
        0,
        (RunningAlloc("a", 0, 1, 1.0, (0,)), RunningAlloc("b", 0, 1, 5.0, (0,)), RunningAlloc("c", 0, 1, 9.0, (1,))),
    )
    choice = choose_victims(10, 1, [node2])
    assert choice is not None and choice.victims == ("c",)


def test_unconfirmed_preemption_times_out_and_is_chosen_again(tmp_path) -> None:
    core = make_core(tmp_path, max_tasks_per_gpu=1, preemption_timeout_s=60)
    node, _ = register(core, gpus=1)
    low = core.api.submit(spec(gpus=1), owner="u")
    core.schedule()
    drain(node)
    report(core, node, low.task_id, 1, C.TASK_STATE_RUNNING)
    s = spec(gpus=1)
    s.priority = 50
    high = core.api.submit(s, owner="u")
    core.tick()
    first = [c.cancel_task for c in drain(node) if c.WhichOneof("command") == "cancel_task"]
    assert [c.task_id for c in first] == [low.task_id]
    core.tick()
    assert drain(node) == []  # in flight: no second stop
    core.preemptions.deadlines[low.task_id] = time.monotonic() - 1  # the node never confirmed
    core.tick()
    again = [c.cancel_task for c in drain(node) if c.WhichOneof("command") == "cancel_task"]
    assert [(c.task_id, c.reason) for c in again] == [(low.task_id, "PREEMPTED")]
    assert f"preempting {low.task_id}" in core.reasons.reason(high.task_id)


def test_a_node_with_model_hosts_shares_a_gpu_among_as_many_tenants(tmp_path) -> None:
    core = make_core(tmp_path, max_tasks_per_gpu=2)
    hosts = N.Register(node_id="host-node", devices=[C.Device(index=0)], max_tasks=8, tenants_per_host=5)
    node, _ = core.node_register(hosts)
    ts = [core.api.submit(spec(gpus=1), owner=f"u{i % 3}") for i in range(6)]
    assert core.schedule() == 5  # the node's tenants per host, not the config's 2
    assert set(_assigned(node).values()) == {(0,)}
    assert "free or shareable with LoRA tasks on /models/m" in core.reasons.reason(ts[5].task_id)


def test_an_inference_task_preempts_one_tenant_of_a_full_model_host(tmp_path) -> None:
    core = make_core(tmp_path, max_tasks_per_gpu=1)
    hosts = N.Register(node_id="host-node", devices=[C.Device(index=0)], max_tasks=8, tenants_per_host=2)
    node, _ = core.node_register(hosts)
    old, young = core.api.submit(spec(gpus=1), owner="u"), core.api.submit(spec(gpus=1), owner="u")
    assert core.schedule() == 2 and set(_assigned(node).values()) == {(0,)}
    report(core, node, old.task_id, 1, C.TASK_STATE_RUNNING)
    time.sleep(0.01)  # start times differ: the younger tenant is the cheaper victim
    report(core, node, young.task_id, 1, C.TASK_STATE_RUNNING)
    serving = C.TaskSpec(workload_type="inference", model="/models/m", resources=C.Resources(gpu_count=1), priority=10)
    inf = core.api.submit(serving, owner="u")
    core.tick()
    stops = [c.cancel_task for c in drain(node) if c.WhichOneof("command") == "cancel_task"]
    assert [(c.task_id, c.reason) for c in stops] == [(young.task_id, "PREEMPTED")]  # one place, one victim
    assert core.api.get(old.task_id).state == C.TASK_STATE_RUNNING
    report(core, node, young.task_id, 1, C.TASK_STATE_CANCELLED, error="PREEMPTED")
    assert core.schedule() == 1
    assert _assigned(node) == {inf.task_id: (0,)}  # beside the tenant that kept running
    assert set(node.allocations) == {old.task_id, inf.task_id}
