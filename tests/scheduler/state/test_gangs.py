"""Gang tasks in the scheduler core: all members at once or none, their rank ranges and
rendezvous, the attempt ending everywhere when one member fails or is lost, refusal at submit of
a gang larger than the cluster, and a ledger property test over gangs and ordinary tasks."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from opentinker.common.v1 import common_pb2 as C
from opentinker_scheduler.config import PoolNode, SchedulerConfig
from opentinker_scheduler.errors import FailedPrecondition
from opentinker_scheduler.state.core import SchedulerCore
from opentinker_scheduler.state.store import SqliteStore

from tests.support.scheduler_core import drain, register, report, spec

NODES = ("node-a", "node-b", "node-c")


def make(tmp, n: int = 2, gpus: int = 2, **kw) -> SchedulerCore:
    pool = tuple(PoolNode(NODES[i], gpus, 8) for i in range(n))
    return SchedulerCore(SchedulerConfig(resource_pool=pool, state_dir=tmp, **kw), SqliteStore(tmp))


def gang_spec(nodes: int = 2, gpus: int = 2):
    s = spec(gpus=gpus)
    s.resources.nodes = nodes
    return s


def assigns(node) -> list:
    return [m.assign_task for m in drain(node) if m.WhichOneof("command") == "assign_task"]


def cancels(node) -> list:
    return [m.cancel_task for m in drain(node) if m.WhichOneof("command") == "cancel_task"]


def test_a_gang_gets_every_member_at_once_with_its_ranks_and_rendezvous(tmp_path) -> None:
    core = make(tmp_path)
    a, _ = register(core, "node-a", gpus=2)
    b, _ = register(core, "node-b", gpus=2)
    blocker = core.api.submit(spec(gpus=1), owner="u")
    core.schedule()
    assert core.api.get(blocker.task_id).node_id in NODES
    busy = core.ledger.nodes[core.api.get(blocker.task_id).node_id]
    gang = core.api.submit(gang_spec(), owner="u")
    assert core.schedule() == 0  # one node has 1 free GPU: the gang does not half-place
    assert all(gang.task_id not in n.allocations for n in (a, b))
    assert "gang of 2 nodes x 2 GPU(s): 1 node(s) have 2 free GPU(s)" in core.reasons.reason(gang.task_id)
    drain(a), drain(b)
    report(core, busy, blocker.task_id, 1, C.TASK_STATE_SUCCEEDED)
    assert core.schedule() == 1
    t = core.api.get(gang.task_id)
    assert (
        t.state == C.TASK_STATE_ASSIGNED
        and "placed as gang" in core.store.events_after(gang.task_id, 0)[-1].state_change.message
    )
    (first,), (second,) = assigns(core.ledger.nodes[t.node_id]), assigns(b if t.node_id == "node-a" else a)
    assert [first.gang.member_index, second.gang.member_index] == [0, 1]
    assert (first.gang.world_size, first.gang.rank_offset, second.gang.rank_offset) == (4, 0, 2)
    assert first.gang.local_world_size == 2 and list(first.device_indices) == [0, 1]
    assert first.gang.rendezvous_port == second.gang.rendezvous_port == 29500
    assert first.attempt == second.attempt == 1 and first.gang.members == 2


def test_a_gang_larger_than_the_cluster_is_refused_with_the_numbers(tmp_path) -> None:
    core = make(tmp_path, n=2, gpus=2)
    with pytest.raises(
        FailedPrecondition, match=r"spec.resources.nodes: 3 nodes with 2 GPU\(s\) each asked \(6 GPUs\)"
    ):
        core.api.submit(gang_spec(nodes=3), owner="u")
    with pytest.raises(FailedPrecondition, match=r"spec.resources.gpu_count: 3 GPU\(s\) asked"):
        core.api.submit(gang_spec(nodes=2, gpus=3), owner="u")  # per node: no node has 3
    assert core.api.submit(gang_spec(nodes=2), owner="u").state == C.TASK_STATE_PENDING


def placed(core, gang_id):
    core.schedule()
    t = core.api.get(gang_id)
    nodes = {n: core.ledger.nodes[n] for n in NODES if n in core.ledger.nodes}
    members = [n for n, s in nodes.items() if s.allocations.get(gang_id, (None,))[0] == t.attempt]
    return t, members


def test_a_failed_member_ends_the_attempt_everywhere_and_requeues_it(tmp_path) -> None:
    core = make(tmp_path)
    a, _ = register(core, "node-a", gpus=2)
    b, _ = register(core, "node-b", gpus=2)
    gang = core.api.submit(gang_spec(), owner="u")
    t, members = placed(core, gang.task_id)
    primary, other = core.ledger.nodes[t.node_id], core.ledger.nodes[[m for m in members if m != t.node_id][0]]
    drain(primary), drain(other)
    report(core, primary, gang.task_id, 1, C.TASK_STATE_RUNNING)
    report(core, other, gang.task_id, 1, C.TASK_STATE_RUNNING)  # a member's start: no change
    ck = C.Checkpoint(step=3, path="/ck/step_3")
    report(core, primary, gang.task_id, 1, checkpoint=ck)
    report(core, other, gang.task_id, 1, C.TASK_STATE_FAILED, error="rank 2 killed by signal 9", retryable=True)
    t = core.api.get(gang.task_id)
    assert t.state == C.TASK_STATE_PENDING and t.attempt == 2 and t.latest_checkpoint.step == 3
    assert gang.task_id not in other.allocations  # the failed member's GPUs are free
    (cancel,) = cancels(primary)  # member 0 is told to stop its ranks
    assert (cancel.task_id, cancel.attempt) == (gang.task_id, 1)
    report(core, primary, gang.task_id, 1, C.TASK_STATE_CANCELLED)  # its worker is gone
    assert gang.task_id not in primary.allocations
    t, members = placed(core, gang.task_id)  # after the backoff
    assert t.state == C.TASK_STATE_PENDING and not members  # retry backoff: nothing placed yet
    t.not_before = 0
    t, members = placed(core, gang.task_id)
    assert t.state == C.TASK_STATE_ASSIGNED and t.attempt == 2 and len(members) == 2
    (again,) = assigns(core.ledger.nodes[t.node_id])
    assert again.resume_from.step == 3 and again.gang.world_size == 4


def test_a_lost_member_node_ends_the_attempt_and_the_other_members_are_stopped(tmp_path) -> None:
    core = make(tmp_path, lease_s=5)
    a, _ = register(core, "node-a", gpus=2)
    b, _ = register(core, "node-b", gpus=2)
    gang = core.api.submit(gang_spec(), owner="u")
    t, _ = placed(core, gang.task_id)
    drain(a), drain(b)
    lost = b if t.node_id == "node-a" else a
    lost.last_seen -= 10  # silent past the lease
    core.tick()
    t = core.api.get(gang.task_id)
    assert t.state == C.TASK_STATE_PENDING and t.attempt == 2
    survivor = a if lost is b else b
    assert [(c.task_id, c.attempt) for c in cancels(survivor)] == [(gang.task_id, 1)]


def test_a_success_is_member_0s_and_the_other_members_just_end(tmp_path) -> None:
    core = make(tmp_path)
    a, _ = register(core, "node-a", gpus=2)
    b, _ = register(core, "node-b", gpus=2)
    gang = core.api.submit(gang_spec(), owner="u")
    t, _ = placed(core, gang.task_id)
    primary, other = (a, b) if t.node_id == "node-a" else (b, a)
    report(core, other, gang.task_id, 1, C.TASK_STATE_SUCCEEDED)
    assert core.api.get(gang.task_id).state == C.TASK_STATE_ASSIGNED and gang.task_id not in other.allocations
    drain(other)
    report(core, primary, gang.task_id, 1, C.TASK_STATE_SUCCEEDED)
    assert core.api.get(gang.task_id).state == C.TASK_STATE_SUCCEEDED and not cancels(other)
    assert gang.task_id not in primary.allocations


def test_a_blocked_gang_reserves_its_nodes_against_tasks_behind_it(tmp_path) -> None:
    core = make(tmp_path, n=2, gpus=2)
    a, _ = register(core, "node-a", gpus=2)
    b, _ = register(core, "node-b", gpus=2)
    first = core.api.submit(spec(gpus=1), owner="u")
    core.schedule()
    gang = core.api.submit(gang_spec(), owner="u")
    small = core.api.submit(spec(gpus=1), owner="u")  # behind the gang: would fit now
    core.schedule()
    assert core.api.get(small.task_id).state == C.TASK_STATE_PENDING
    assert core.api.get(gang.task_id).state == C.TASK_STATE_PENDING
    holder = core.ledger.nodes[core.api.get(first.task_id).node_id]
    report(core, holder, first.task_id, 1, C.TASK_STATE_SUCCEEDED)
    core.schedule()
    assert core.api.get(gang.task_id).state == C.TASK_STATE_ASSIGNED


# --- ledger property test over gangs ------------------------------------------------------------

ops = st.lists(
    st.tuples(
        st.sampled_from(["single", "gang", "schedule", "finish", "fail", "member", "lose", "back"]), st.integers(0, 5)
    ),
    max_size=40,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops)
def test_ledger_with_gangs_never_half_places_or_overbooks(tmp_path_factory, sequence) -> None:
    tmp = tmp_path_factory.mktemp("gang-ledger")
    core = make(tmp, n=3, gpus=2, lease_s=5, default_max_attempts=3, max_tasks_per_gpu=1)  # no sharing
    for n in NODES:
        register(core, n, gpus=2)
    for op, k in sequence:
        active = core.store.tasks_in_states([C.TASK_STATE_ASSIGNED, C.TASK_STATE_RUNNING])
        if op == "single":
            core.api.submit(spec(gpus=k % 3), owner="u")
        elif op == "gang":
            core.api.submit(gang_spec(nodes=2 + k % 2, gpus=1 + k % 2), owner="u")
        elif op == "schedule":
            for t in core.queue:
                t.not_before = 0
            core.schedule()
        elif op in ("finish", "fail") and active:
            t = active[k % len(active)]
            state = C.TASK_STATE_SUCCEEDED if op == "finish" else C.TASK_STATE_FAILED
            report(core, core.ledger.nodes[t.node_id], t.task_id, t.attempt, state, retryable=True)
        elif op == "member" and core.gangs.live:  # a member other than 0 fails
            g = list(core.gangs.live.values())[k % len(core.gangs.live)]
            node_id = g.members[1 + k % (len(g.members) - 1)][0]
            report(core, core.ledger.nodes[node_id], g.task_id, g.attempt, C.TASK_STATE_FAILED, retryable=True)
        elif op == "lose":
            node = core.ledger.nodes[NODES[k % 3]]
            node.last_seen -= 10
            core.tick()
        elif op == "back":  # a lost node comes back, without tasks
            node = core.ledger.nodes[NODES[k % 3]]
            if not node.connected:
                register(core, node.node_id, gpus=2)
            for n in core.ledger.nodes.values():
                n.last_seen = core.clock()
        # Invariants: no GPU held twice, none beyond a node; every active gang holds its
        # current attempt on exactly `nodes` distinct nodes, a pending one on none.
        for node in core.ledger.nodes.values():
            seen: list[int] = []
            for tid, (_, devs) in node.allocations.items():
                seen += devs
            assert len(seen) == len(set(seen)) and all(0 <= d < 2 for d in seen)
        for t in [*core.queue, *core.active.values()]:
            if t.spec.resources.nodes <= 1:
                continue
            holders = [n for n in core.ledger.nodes.values() if n.allocations.get(t.task_id, (None,))[0] == t.attempt]
            if t.state in (C.TASK_STATE_ASSIGNED, C.TASK_STATE_RUNNING):
                assert len(holders) == t.spec.resources.nodes, "a gang half-placed"
                assert all(len(n.allocations[t.task_id][1]) == t.gpu_count for n in holders)
            else:
                assert not holders, "a pending gang holds GPUs of its current attempt"
    core.store.close()


def make_on_backend(tmp, **kw) -> SchedulerCore:
    """:func:`make` on the current store backend (SQLite or PostgreSQL): the same data again
    for the same folder, as a restarted scheduler opens it."""
    from tests.support.stores import make_store

    pool = tuple(PoolNode(n, 2, 8) for n in NODES[:2])
    return SchedulerCore(SchedulerConfig(resource_pool=pool, state_dir=tmp, **kw), make_store(tmp))


def running_gang(tmp_path, **kw):
    """A 2-node gang running on node-a and node-b: ``(core, task id, primary id, other id)``."""
    core = make_on_backend(tmp_path, **kw)
    register(core, "node-a", gpus=2), register(core, "node-b", gpus=2)
    gang = core.api.submit(gang_spec(), owner="u")
    t, members = placed(core, gang.task_id)
    other = [m for m in members if m != t.node_id][0]
    for n in members:
        drain(core.ledger.nodes[n])
        report(core, core.ledger.nodes[n], gang.task_id, 1, C.TASK_STATE_RUNNING)
    return core, gang.task_id, t.node_id, other


def test_a_scheduler_restart_keeps_every_gang_member_running(tmp_path) -> None:
    core, task_id, primary, other = running_gang(tmp_path)
    assert [(r[0], r[1]) for r in core.store.gangs()] == [(task_id, 1)]  # committed with the assignment
    core.store.close()  # kill -9: a new core on the same store
    core2 = make_on_backend(tmp_path)
    # Before the members reconnect: both hold their GPUs (nothing else is placed on them).
    assert all(core2.ledger.nodes[n].allocations[task_id] == (1, (0, 1)) for n in (primary, other))
    assert core2.gangs.live[task_id].members == ((primary, (0, 1)), (other, (0, 1)))
    for n in (other, primary):
        node, registered = register(core2, n, gpus=2, running=[(task_id, 1)])
        assert list(registered.stale) == [] and not cancels(node)
    t = core2.api.get(task_id)
    assert t.state == C.TASK_STATE_RUNNING and t.attempt == 1
    report(core2, core2.ledger.nodes[other], task_id, 1, C.TASK_STATE_SUCCEEDED)
    assert task_id not in core2.ledger.nodes[other].allocations and core2.api.get(task_id).state == C.TASK_STATE_RUNNING
    report(core2, core2.ledger.nodes[primary], task_id, 1, C.TASK_STATE_SUCCEEDED)
    assert core2.api.get(task_id).state == C.TASK_STATE_SUCCEEDED and core2.store.gangs() == []
    assert not any(task_id in core2.ledger.nodes[n].allocations for n in (primary, other))


def test_a_member_missing_after_a_restart_ends_the_attempt_everywhere(tmp_path) -> None:
    core, task_id, primary, other = running_gang(tmp_path, lease_s=5, restart_grace_s=10)
    report(core, core.ledger.nodes[primary], task_id, 1, checkpoint=C.Checkpoint(step=2, path="/ck/step_2"))
    core.store.close()
    core2 = make_on_backend(tmp_path, lease_s=5, restart_grace_s=10)
    node, registered = register(core2, primary, gpus=2, running=[(task_id, 1)])  # member 0 is back
    assert list(registered.stale) == []
    core2.tick()
    assert core2.api.get(task_id).state == C.TASK_STATE_RUNNING  # the other member still has its grace
    core2.ledger.nodes[other].last_seen -= 60  # past the grace: lost
    core2.tick()
    t = core2.api.get(task_id)
    assert t.state == C.TASK_STATE_PENDING and t.attempt == 2 and t.latest_checkpoint.step == 2
    assert [(c.task_id, c.attempt) for c in cancels(node)] == [(task_id, 1)]  # member 0 told to stop
    assert task_id not in core2.ledger.nodes[other].allocations and core2.store.gangs() == []


def test_each_gang_member_gets_a_credential_of_its_own_node_and_only_members_may_write(tmp_path) -> None:
    from opentinker_scheduler.state.worker_credentials import AttemptScope, WorkerCredentials

    core = make(tmp_path, n=3)
    core.worker_credentials = WorkerCredentials.open(core.store)
    nodes = [register(core, n, gpus=2)[0] for n in NODES]
    gang = core.api.submit(gang_spec(), owner="u")
    assert core.schedule() == 1
    scopes = {n.node_id: core.worker_credentials.verify(a.worker_credential) for n in nodes for a in assigns(n)}
    assert len(scopes) == 2 and all(s == AttemptScope(gang.task_id, 1, n, "u") for n, s in scopes.items())
    assert all(core.api.attempt_refusal(s) is None for s in scopes.values())
    (outsider,) = set(NODES) - set(scopes)
    refusal = core.api.attempt_refusal(AttemptScope(gang.task_id, 1, outsider, "u"))
    assert refusal == f"attempt 1 of task {gang.task_id} on node {outsider} is not assigned to that node"
