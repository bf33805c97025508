"""Victim choice for preemption: strictly lower priority, fewest victims, youngest first."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from opentinker_scheduler.policy.preemption import NodeState, RunningAlloc, choose_victims


def test_lower_priority_youngest_first() -> None:
    node = NodeState("n", 4, 8, 0, (RunningAlloc("old", 1, 2, 10.0), RunningAlloc("young", 1, 2, 20.0)))
    assert choose_victims(2, 2, [node]).victims == ("young",)
    assert choose_victims(2, 4, [node]).victims == ("young", "old")


def test_equal_or_higher_priority_never_preempted() -> None:
    node = NodeState("n", 2, 8, 0, (RunningAlloc("peer", 2, 2, 1.0),))
    assert choose_victims(2, 1, [node]) is None
    assert choose_victims(1, 1, [node]) is None


def test_fewest_victims_across_nodes_and_slots() -> None:
    a = NodeState("a", 4, 8, 0, (RunningAlloc("a1", 0, 2, 1.0), RunningAlloc("a2", 0, 2, 2.0)))
    b = NodeState("b", 4, 8, 2, (RunningAlloc("b1", 0, 2, 1.0),))
    assert choose_victims(5, 4, [a, b]) == choose_victims(5, 4, [b, a])
    assert choose_victims(5, 4, [a, b]).node_id == "b"
    full = NodeState("c", 0, 1, 0, (RunningAlloc("cpu", 0, 0, 1.0),))  # CPU task slots
    assert choose_victims(1, 0, [full]).victims == ("cpu",)
    assert choose_victims(1, 8, [a, b]) is None


def test_a_gang_is_one_victim_that_stops_every_node_it_spans() -> None:
    gang = RunningAlloc("gang", 0, 2, 20.0, nodes=2)  # a member of a 2-node gang: 2 GPUs here
    solo = RunningAlloc("solo", 0, 2, 10.0)  # older, otherwise the youngest would go first
    node = NodeState("a", 4, 8, 0, (gang, solo))
    assert choose_victims(5, 2, [node]).victims == ("solo",)  # one node stopped, not two
    assert choose_victims(5, 4, [node]).victims == ("solo", "gang")  # the gang last
    # Across nodes: a node where one ordinary task makes room wins over one where the gang must go.
    b = NodeState("b", 2, 8, 0, (RunningAlloc("b1", 0, 2, 1.0),))
    only_gang = NodeState("c", 2, 8, 0, (RunningAlloc("gang", 0, 2, 20.0, nodes=2),))
    assert choose_victims(5, 2, [only_gang, b]).node_id == "b"
    assert choose_victims(5, 2, [only_gang]).victims == ("gang",)  # still a victim when it is the only one


@given(
    st.integers(-2, 3),
    st.integers(0, 4),
    st.lists(st.tuples(st.integers(-2, 3), st.integers(0, 2)), max_size=6),
    st.integers(0, 4),
)
def test_victims_always_make_room_and_are_lower(priority, gpus, running, free) -> None:
    allocs = tuple(RunningAlloc(f"t{i}", p, g, float(i)) for i, (p, g) in enumerate(running))
    node = NodeState("n", free + sum(g for _, g in running), len(allocs) + 1, free, allocs)
    choice = choose_victims(priority, gpus, [node])
    if choice is None:
        return
    by_id = {a.task_id: a for a in allocs}
    assert all(by_id[v].priority < priority for v in choice.victims)
    assert free + sum(by_id[v].gpu_count for v in choice.victims) >= gpus


def _tenant(task_id: str, start: float, device: int = 0, key: str = "base", memory=None) -> RunningAlloc:
    return RunningAlloc(task_id, 0, 1, start, (device,), share_key=key, memory=memory)


def test_a_shareable_task_stops_one_tenant_of_a_full_host_not_the_whole_gpu() -> None:
    # A model host holding two LoRA tenants on its one GPU, at its two tenants per GPU.
    host = NodeState("host", 1, 8, 0, (_tenant("old", 1.0), _tenant("young", 2.0)), max_tasks_per_gpu=2)
    # An inference task on the same base model needs one tenant place: the youngest tenant goes.
    assert choose_victims(10, 1, [host], share_key="base").victims == ("young",)
    # A task on another base model, or one that needs its GPU alone, still needs the GPU emptied.
    assert set(choose_victims(10, 1, [host], share_key="other").victims) == {"old", "young"}
    assert set(choose_victims(10, 1, [host]).victims) == {"old", "young"}


def test_a_shareable_task_stops_as_many_tenants_as_its_memory_needs() -> None:
    from opentinker_scheduler.policy.placement import MemoryNeed

    gib = 1 << 30
    tenant = MemoryNeed(base_bytes=4 * gib, tenant_bytes=2 * gib)
    running = (_tenant("a", 1.0, memory=tenant), _tenant("b", 2.0, memory=tenant), _tenant("c", 3.0, memory=tenant))
    # 4 GiB of base + 3 tenants of 2 GiB = 10 of 11 GiB booked; room for 8 tenants by count.
    host = NodeState("host", 1, 8, 0, running, max_tasks_per_gpu=8, gpu_memory={0: 11 * gib})
    big = MemoryNeed(base_bytes=4 * gib, tenant_bytes=3 * gib)
    assert choose_victims(10, 1, [host], share_key="base", memory=big).victims == ("c",)  # 1 + 2 free: enough
    bigger = MemoryNeed(base_bytes=4 * gib, tenant_bytes=5 * gib)
    assert choose_victims(10, 1, [host], share_key="base", memory=bigger).victims == ("c", "b")
    # A free GPU whose memory cannot hold the task's base and tenant is no room either.
    two = NodeState(
        "two", 2, 8, 1, running, max_tasks_per_gpu=8, gpu_memory={0: 11 * gib, 1: 4 * gib}, free_devices=(1,)
    )
    assert choose_victims(10, 1, [two], share_key="base", memory=big).victims == ("c",)


def _open_gpu(gpus: int, per_gpu: int, left: list[RunningAlloc], key: str) -> bool:
    """Whether a task with share key ``key`` has a GPU: one nobody holds, or one whose tasks all
    share ``key`` with a tenant place left (counted here, apart from the policy's ledger)."""
    for device in range(gpus):
        on = [r for r in left if device in r.devices]
        if not on or (all(r.share_key == key for r in on) and len(on) < per_gpu):
            return True
    return False


@given(
    st.integers(1, 2),
    st.integers(1, 3),
    st.lists(st.tuples(st.integers(0, 3), st.integers(0, 1), st.sampled_from(["base", "other"])), max_size=6),
)
def test_on_a_model_host_the_victims_are_the_fewest_tenants_that_open_a_place(gpus, per_gpu, tenants) -> None:
    running: list[RunningAlloc] = []
    for i, (priority, device, key) in enumerate(tenants):
        on = [r for r in running if r.devices == (device % gpus,)]
        if len(on) < per_gpu and all(r.share_key == key for r in on):  # a host's GPU holds one base
            running.append(RunningAlloc(f"t{i}", priority, 1, float(i), (device % gpus,), share_key=key))
    held = {d for r in running for d in r.devices}
    free = tuple(d for d in range(gpus) if d not in held)
    node = NodeState("host", gpus, 16, len(free), tuple(running), max_tasks_per_gpu=per_gpu, free_devices=free)
    choice = choose_victims(3, 1, [node], share_key="base")
    if _open_gpu(gpus, per_gpu, running, "base"):
        assert choice is None  # room already: nobody is stopped
        return
    if choice is None:  # no set of lower-priority tenants opens a place
        lower = [r for r in running if r.priority < 3]
        assert not _open_gpu(gpus, per_gpu, [r for r in running if r not in lower], "base")
        return
    by_id = {r.task_id: r for r in running}
    assert all(by_id[v].priority < 3 for v in choice.victims)
    left = [r for r in running if r.task_id not in choice.victims]
    assert _open_gpu(gpus, per_gpu, left, "base")
    for v in choice.victims:  # every victim is needed: one tenant, not the whole GPU
        assert not _open_gpu(gpus, per_gpu, [*left, by_id[v]], "base")
