"""Placement of shared LoRA work by GPU memory: the base model's bytes once per GPU plus each
tenant's, against the memory a node reported; a GPU that already holds the base is preferred."""

from __future__ import annotations

from opentinker_scheduler.policy.placement import (
    FreeNodes,
    MemoryNeed,
    NodeCapacity,
    PendingTask,
    PlacementGroup,
    RoundHooks,
    place_round,
    plan,
)

GIB = 1024**3
NEED = MemoryNeed(base_bytes=6 * GIB, tenant_bytes=1 * GIB)


def node(node_id: str, gpus: int, memory_gib: int, per_gpu: int = 8, **kw) -> NodeCapacity:
    return NodeCapacity(
        node_id,
        gpus,
        max_tasks=16,
        running=kw.pop("running", 0),
        free_gpus=kw.pop("free_gpus", list(range(gpus))),
        max_tasks_per_gpu=per_gpu,
        gpu_memory={d: memory_gib * GIB for d in range(gpus)},
        **kw,
    )


def lora(task_id: str, t: float, need: MemoryNeed | None = NEED, gpus: int = 1) -> PendingTask:
    return PendingTask(task_id, 1, t, gpus, share_key="M", memory=need)


def test_base_counted_once_per_gpu_and_the_rest_refused_with_numbers() -> None:
    tasks = [lora(f"t{i}", float(i)) for i in range(6)]
    placements, reasons = plan(tasks, [node("n1", 1, 10)], now=0.0)
    # 6 GiB base + 4 tenants of 1 GiB fill the 10 GiB GPU; the process count (8 per GPU) is not the limit.
    assert [p.task_id for p in placements] == ["t0", "t1", "t2", "t3"]
    assert {p.device_indices for p in placements} == {(0,)}
    assert set(reasons) == {"t4", "t5"}
    assert reasons["t4"].startswith(
        "not enough GPU memory for a LoRA tenant on M: it needs 1.00 GiB (adapter, gradients, AdamW moments) "
        "on a GPU that holds M, or 7.00 GiB with the base model (6.00 GiB) on one that does not; the most free "
        "is 0.0 MiB of 10.00 GiB on n1 GPU 0 by the scheduler's estimates (queue position 5 of 6)"
    )


def test_tenant_count_still_caps_a_roomy_gpu() -> None:
    tasks = [lora(f"t{i}", float(i)) for i in range(4)]
    placements, reasons = plan(tasks, [node("n1", 1, 80, per_gpu=3)], now=0.0)
    assert len(placements) == 3 and "free or shareable with LoRA tasks on M; the most is 0" in reasons["t3"]


def test_a_gpu_too_small_for_the_base_is_skipped() -> None:
    tasks = [lora("a", 0.0), lora("b", 1.0), lora("c", 2.0)]
    placements, reasons = plan(tasks, [node("small", 1, 4), node("big", 1, 8)], now=0.0)
    # The base (6 GiB) never fits small's 4 GiB; big holds it once plus two tenants.
    assert [(p.task_id, p.node_id) for p in placements] == [("a", "big"), ("b", "big")]
    assert "the most free is 4.00 GiB of 4.00 GiB on small GPU 0" in reasons["c"]


def test_prefers_a_gpu_that_already_holds_the_base() -> None:
    # n1 GPU 0 hosts M (one tenant booked: 7 GiB of 80); GPU 1 is free. n2 is empty with more free GPUs.
    hosting = node("n1", 2, 80, running=1, free_gpus=[1], gpu_share={0: ("M", 1)}, gpu_booked={0: 7 * GIB})
    placements, _ = plan([lora("a", 0.0)], [node("n2", 4, 80), hosting], now=0.0)
    assert [(p.node_id, p.device_indices) for p in placements] == [("n1", (0,))]
    # Where the hosting GPU has no memory left for a tenant, the task loads the base on a free GPU.
    full = node("n1", 2, 8, running=1, free_gpus=[1], gpu_share={0: ("M", 1)}, gpu_booked={0: 7 * GIB + 1})
    placements, _ = plan([lora("a", 0.0)], [full], now=0.0)
    assert [(p.node_id, p.device_indices) for p in placements] == [("n1", (1,))]


def test_unknown_memory_is_counted_in_tasks_only() -> None:
    tasks = [lora(f"t{i}", float(i), need=None) for i in range(3)]
    assert len(plan(tasks, [node("n1", 1, 1)], now=0.0)[0]) == 3
    unknown = NodeCapacity("n1", 1, 16, 0, [0], max_tasks_per_gpu=8)
    assert len(plan([lora(f"t{i}", float(i)) for i in range(3)], [unknown], now=0.0)[0]) == 3


def test_place_round_agrees_with_plan_on_memory() -> None:
    small = MemoryNeed(6 * GIB, GIB // 2)
    tasks = [lora(f"a{i}", float(i)) for i in range(5)] + [lora(f"b{i}", 10.0 + i, need=small) for i in range(20)]
    caps = [node("n1", 1, 10), node("n2", 2, 12), node("n3", 1, 5)]
    expected, _ = plan(tasks, caps, now=0.0)

    ledger = {c.node_id: c.copy() for c in caps}
    free = FreeNodes()
    for c in ledger.values():
        free.update(c)
    by_id = {t.task_id: t for t in tasks}
    groups: dict[PlacementGroup, list] = {}
    for t in sorted(tasks, key=lambda t: (t.create_time, t.task_id)):
        group = PlacementGroup(t.gpu_count, t.share_key, "q", t.memory)
        groups.setdefault(group, []).append((t.create_time, t.task_id))
    got = []

    def take(key, group, node_id) -> None:
        cap = ledger[node_id]
        devices = cap.choose_devices(group.gpu_count, group.share_key, group.memory)
        cap.book(devices, group.share_key, group.memory)
        free.update(cap)
        got.append((by_id[key[1]].task_id, node_id, devices))

    place_round(groups, free, 0.0, RoundHooks(take))
    assert sorted(got) == sorted((p.task_id, p.node_id, p.device_indices) for p in expected)
    assert 0 < len(got) < len(tasks)  # some are left pending
