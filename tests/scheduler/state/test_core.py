"""The scheduler state machine without gRPC: submit, place, report, fencing, node loss, restart."""

from __future__ import annotations

import dataclasses
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from opentinker.common.v1 import common_pb2 as C
from opentinker.node.v1 import node_pb2 as N
from opentinker_scheduler.errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied

from tests.support.scheduler_core import drain, make_core, register, report, spec


def test_submit_validates_with_field_paths(tmp_path) -> None:
    core = make_core(tmp_path)
    with pytest.raises(InvalidArgument, match="spec.workload_type: expected one of lora_finetune, full_rl"):
        core.api.submit(C.TaskSpec(workload_type="nope", model="m"), owner="u")
    with pytest.raises(InvalidArgument, match="spec.resources.gpu_count"):
        core.api.submit(spec(gpus=-1), owner="u")
    with pytest.raises(InvalidArgument, match=r"spec.hyperparameters.lerning_rate: expected one of the known keys"):
        core.api.submit(spec(lerning_rate=0.1), owner="u")
    with pytest.raises(InvalidArgument, match=r"spec.hyperparameters.steps: expected an integer"):
        core.api.submit(spec(steps=1.5), owner="u")
    with pytest.raises(InvalidArgument, match="spec.env_config.env_id"):
        s = spec()
        s.env_config.update({"env_id": "no-such-env"})
        core.api.submit(s, owner="u")
    with pytest.raises(FailedPrecondition, match="5 GPU.*more than 4"):
        core.api.submit(spec(gpus=5), owner="u")
    assert core.store.list_tasks() == [], "a refused submit must leave nothing behind"


def test_request_id_is_idempotent(tmp_path) -> None:
    core = make_core(tmp_path)
    a = core.api.submit(spec(), owner="u", request_id="r1")
    b = core.api.submit(spec(), owner="u", request_id="r1")
    assert a.task_id == b.task_id
    assert len(core.store.list_tasks()) == 1


def test_lifecycle_and_events(tmp_path) -> None:
    core = make_core(tmp_path)
    task = core.api.submit(spec(gpus=2), owner="u")
    assert core.schedule() == 0
    assert "no trainer node is connected" in core.pending_reasons[task.task_id]
    node, registered = register(core)
    assert registered.gpu_count == 4
    assert core.schedule() == 1
    (cmd,) = drain(node)
    assert cmd.assign_task.task_id == task.task_id and list(cmd.assign_task.device_indices) == [0, 1]
    assert core.api.get(task.task_id).state == C.TASK_STATE_ASSIGNED
    assert report(core, node, task.task_id, 1, C.TASK_STATE_RUNNING)
    point = C.MetricPoint(step=1, values={"loss": 0.5, "reward": 0.25})
    assert report(core, node, task.task_id, 1, metrics=[point])
    t = core.api.get(task.task_id)
    assert t.state == C.TASK_STATE_RUNNING and t.latest_metrics == {"loss": 0.5, "reward": 0.25}
    ck = C.Checkpoint(step=1, path="/ck/step_1", final=True)
    assert report(core, node, task.task_id, 1, C.TASK_STATE_SUCCEEDED, checkpoint=ck)
    t = core.api.get(task.task_id)
    assert t.state == C.TASK_STATE_SUCCEEDED and t.latest_checkpoint.path == "/ck/step_1"
    assert node.allocations == {}
    kinds = [e.WhichOneof("event") for e in core.store.events_after(task.task_id, 0)]
    assert kinds == ["state_change", "state_change", "state_change", "metric", "checkpoint", "state_change"]
    seqs = [e.sequence for e in core.store.events_after(task.task_id, 0)]
    assert seqs == list(range(1, 7))
    assert [e.sequence for e in core.store.events_after(task.task_id, 4)] == [5, 6]


def test_stale_attempt_report_is_refused(tmp_path) -> None:
    core = make_core(tmp_path, lease_s=0.01)
    task = core.api.submit(spec(), owner="u")
    node, _ = register(core)
    core.schedule()
    drain(node)
    report(core, node, task.task_id, 1, C.TASK_STATE_RUNNING)
    # The node goes silent past its lease: the attempt is lost and requeued as attempt 2.
    node.last_seen -= 1
    core.tick()  # loses the node, requeues, then places nowhere (node disconnected)
    t = core.api.get(task.task_id)
    assert t.state == C.TASK_STATE_PENDING and t.attempt == 2
    # The partitioned trainer comes back with attempt 1 still running: told it is stale.
    node, registered = register(core, running=[(task.task_id, 1)])
    assert [(s.task_id, s.attempt) for s in registered.stale] == [(task.task_id, 1)]
    core.schedule()
    drain(node)
    assert core.api.get(task.task_id).attempt == 2
    # A report from attempt 1 cannot overwrite attempt 2's state.
    assert not report(core, node, task.task_id, 1, C.TASK_STATE_SUCCEEDED)
    assert not report(core, node, task.task_id, 1, metrics=[C.MetricPoint(step=9, values={"loss": 1})])
    t = core.api.get(task.task_id)
    assert t.state == C.TASK_STATE_ASSIGNED and t.attempt == 2 and t.latest_step == 0
    assert report(core, node, task.task_id, 2, C.TASK_STATE_RUNNING)


def _points(*steps: int) -> list:
    return [C.MetricPoint(step=s, values={"loss": 1.0 / s, "reward": float(s)}) for s in steps]


def test_latest_step_is_the_current_attempts_after_a_requeue(tmp_path) -> None:
    core = make_core(tmp_path)
    with_ck, without = core.api.submit(spec(), owner="u"), core.api.submit(spec(), owner="u")
    node, _ = register(core)
    core.schedule()
    drain(node)
    for task in (with_ck, without):
        report(core, node, task.task_id, 1, C.TASK_STATE_RUNNING, metrics=_points(1, 2, 3, 4, 5, 6))
    report(core, node, with_ck.task_id, 1, checkpoint=C.Checkpoint(step=4, path="/ck/step_4"))
    for task in (with_ck, without):
        report(core, node, task.task_id, 1, C.TASK_STATE_CANCELLED, error="node drained", retryable=True)
    # Handed back: the progress shown is where attempt 2 starts, not attempt 1's step 6.
    t = core.api.get(with_ck.task_id)
    assert (t.attempt, t.latest_step, t.latest_metrics) == (2, 4, {})
    t = core.api.get(without.task_id)
    assert (t.attempt, t.latest_step, t.latest_metrics) == (2, 0, {})
    core.schedule()
    drain(node)
    report(core, node, with_ck.task_id, 2, C.TASK_STATE_RUNNING, metrics=_points(5))
    report(core, node, without.task_id, 2, C.TASK_STATE_RUNNING, metrics=_points(1, 2))
    t = core.api.get(with_ck.task_id)
    assert (t.attempt, t.latest_step, t.latest_metrics) == (2, 5, {"loss": 0.2, "reward": 5.0})
    t = core.api.get(without.task_id)
    assert (t.attempt, t.latest_step, t.latest_metrics) == (2, 2, {"loss": 0.5, "reward": 2.0})


def test_a_phase_report_becomes_a_task_event_of_the_current_attempt(tmp_path) -> None:
    core = make_core(tmp_path)
    task = core.api.submit(spec(), owner="u")
    node, _ = register(core)
    core.schedule()
    drain(node)
    report(core, node, task.task_id, 1, C.TASK_STATE_RUNNING)
    phase = C.TaskPhase(phase="loading model", detail="/models/m")
    assert report(core, node, task.task_id, 1, phase=phase)
    (event,) = [e for e in core.store.events_after(task.task_id, 0) if e.HasField("phase")]
    assert (event.phase.attempt, event.phase.phase, event.phase.detail) == (1, "loading model", "/models/m")


def test_failure_retry_then_user_error_not_retried(tmp_path) -> None:
    core = make_core(tmp_path)
    task = core.api.submit(spec(), owner="u")
    node, _ = register(core)
    core.schedule()
    drain(node)
    report(core, node, task.task_id, 1, C.TASK_STATE_FAILED, error="CUDA OOM", retryable=True)
    t = core.api.get(task.task_id)
    assert t.state == C.TASK_STATE_PENDING and t.attempt == 2 and t.not_before > time.time()
    requeued = [e.state_change for e in core.store.events_after(task.task_id, 0) if e.HasField("state_change")][-1]
    assert requeued.reason == "ATTEMPT_FAILED"
    assert requeued.message == (
        "attempt 2 queued; retrying in 2 s (backoff after attempt 1 failed: CUDA OOM); "
        "no checkpoint: starts from scratch"
    )
    assert core.pending_reasons[task.task_id].endswith("before retrying as attempt 2 (backoff after attempt 1 failed)")
    t2 = core.api.submit(spec(), owner="u")
    core.schedule()
    drain(node)
    report(core, node, t2.task_id, 1, C.TASK_STATE_FAILED, error="model '/x' does not exist", retryable=False)
    t = core.api.get(t2.task_id)
    assert t.state == C.TASK_STATE_FAILED and t.attempt == 1 and "does not exist" in t.error


def test_cancel_pending_and_running_is_idempotent(tmp_path) -> None:
    core = make_core(tmp_path)
    a = core.api.submit(spec(), owner="u")
    assert core.api.cancel(a.task_id).state == C.TASK_STATE_CANCELLED
    assert core.api.cancel(a.task_id).state == C.TASK_STATE_CANCELLED
    b = core.api.submit(spec(gpus=4), owner="u")
    node, _ = register(core)
    core.schedule()
    drain(node)
    core.api.cancel(b.task_id)
    (cmd,) = drain(node)
    assert cmd.cancel_task.task_id == b.task_id
    assert core.api.get(b.task_id).state == C.TASK_STATE_CANCELLED
    # GPUs stay held until the node confirms the worker is gone.
    c = core.api.submit(spec(gpus=4), owner="u")
    assert core.schedule() == 0
    report(core, node, b.task_id, 1, C.TASK_STATE_CANCELLED)
    assert core.schedule() == 1
    with pytest.raises(NotFound):
        core.api.cancel("task-nope")
    assert c.task_id


def test_cancelled_running_task_keeps_the_checkpoint_its_worker_writes_on_the_way_out(tmp_path) -> None:
    core = make_core(tmp_path)
    node, _ = register(core)
    task = core.api.submit(spec(gpus=1), owner="u")
    core.schedule()
    drain(node)
    report(core, node, task.task_id, 1, C.TASK_STATE_RUNNING)
    report(core, node, task.task_id, 1, checkpoint=C.Checkpoint(step=2, path="/ck/step_2", format="peft_lora"))
    core.api.cancel(task.task_id, reason="enough")
    (cmd,) = drain(node)
    assert cmd.cancel_task.task_id == task.task_id
    # The worker checkpoints on SIGTERM within its grace period; that report still counts.
    report(core, node, task.task_id, 1, checkpoint=C.Checkpoint(step=3, path="/ck/step_3", format="peft_lora"))
    t = core.api.get(task.task_id)
    assert t.state == C.TASK_STATE_CANCELLED and (t.latest_checkpoint.step, t.latest_checkpoint.path) == (
        3,
        "/ck/step_3",
    )
    assert core.store.get_task(task.task_id).latest_checkpoint.step == 3  # written through
    assert [e.WhichOneof("event") for e in core.store.events_after(task.task_id, 0)][-1] == "checkpoint"
    report(core, node, task.task_id, 1, C.TASK_STATE_CANCELLED, error="enough")
    assert core.table.stopping == {} and node.allocations == {}
    # Once the worker is gone, nothing more is taken for the task.
    report(core, node, task.task_id, 1, checkpoint=C.Checkpoint(step=4, path="/ck/step_4", format="peft_lora"))
    assert core.api.get(task.task_id).latest_checkpoint.step == 3


def test_cancelled_task_error_says_who_and_why(tmp_path) -> None:
    core = make_core(tmp_path)
    a = core.api.submit(spec(), owner="u")
    b = core.api.submit(spec(), owner="u")
    core.api.cancel(a.task_id, reason="enough")
    core.api.cancel(b.task_id)
    for task_id, error in ((a.task_id, "cancelled by user: enough"), (b.task_id, "cancelled by user")):
        assert core.api.get(task_id).error == error
        assert core.store.get_task(task_id).error == error
        ended = [e.state_change for e in core.store.events_after(task_id, 0) if e.HasField("state_change")][-1]
        assert ended.to_state == C.TASK_STATE_CANCELLED and ended.reason == "CANCELLED"
    assert {t.task_id: t.error for t in core.store.list_tasks()} == {
        a.task_id: "cancelled by user: enough",
        b.task_id: "cancelled by user",
    }


def test_task_cancelled_before_a_restart_gets_its_error_from_its_event(tmp_path) -> None:
    core = make_core(tmp_path)
    a = core.api.submit(spec(), owner="u")
    b = core.api.submit(spec(), owner="u")
    core.api.cancel(a.task_id, reason="enough")
    core.api.cancel(b.task_id)
    # Rows written by a scheduler that kept the reason only in the event.
    core.store.db.execute("UPDATE tasks SET error=''")
    core.store.close()
    core2 = make_core(tmp_path)
    assert core2.api.get(a.task_id).error == "cancelled by user: enough"
    assert core2.api.get(b.task_id).error == "cancelled by user"


def _restarted_while_running(tmp_path, gpus: int = 0, **config):
    """Submit a ``gpus``-GPU task, run it on the one node, then stop the core without a word to
    the node and open a new one on the same state directory (both with ``config``):
    ``(task, restarted_core)``; the node has not reconnected."""
    core = make_core(tmp_path, **config)
    task = core.api.submit(spec(gpus=gpus), owner="u")
    node, _ = register(core)
    core.schedule()
    report(core, node, task.task_id, 1, C.TASK_STATE_RUNNING)
    core.store.close()
    return task, make_core(tmp_path, **config)


def test_scheduler_restart_keeps_running_work(tmp_path) -> None:
    # "kill -9": a new core on the same state directory.
    task, core2 = _restarted_while_running(tmp_path, gpus=1)
    t = core2.api.get(task.task_id)
    assert t.state == C.TASK_STATE_RUNNING and t.attempt == 1
    node2, registered = register(core2, running=[(task.task_id, 1)])
    assert list(registered.stale) == []
    assert report(core2, node2, task.task_id, 1, C.TASK_STATE_SUCCEEDED)
    assert core2.api.get(task.task_id).state == C.TASK_STATE_SUCCEEDED


def test_restarted_scheduler_knows_a_node_by_its_last_registration(tmp_path) -> None:
    task, core2 = _restarted_while_running(tmp_path, gpus=2)
    n = core2.ledger.nodes["gpu-node-01"]
    # Before the node reconnects: its size is known (not 0/0), it is not connected, takes no work.
    assert (n.gpu_count, n.max_tasks, n.connected) == (4, 8, False)
    assert len(n.capacity().free_gpus) == 2 and not n.capacity().accepting
    assert any("reconnect" in note for note in n.notes)
    other = core2.api.submit(spec(gpus=1), owner="u")
    core2.schedule()
    assert core2.api.get(other.task_id).state == C.TASK_STATE_PENDING
    node2, _ = register(core2, running=[(task.task_id, 1)])
    assert node2.connected and not any("reconnect" in note for note in node2.notes)


def test_node_reconnecting_without_its_task_requeues_it(tmp_path) -> None:
    core = make_core(tmp_path)
    task = core.api.submit(spec(), owner="u")
    node, _ = register(core)
    core.schedule()
    report(core, node, task.task_id, 1, C.TASK_STATE_RUNNING)
    core.node_disconnected(node, node.generation, goodbye=False)
    register(core)  # the trainer restarted: no running tasks announced
    t = core.api.get(task.task_id)
    assert t.state == C.TASK_STATE_PENDING and t.attempt == 2


def test_second_node_with_same_id_is_refused(tmp_path) -> None:
    from opentinker_scheduler.errors import AlreadyExists

    core = make_core(tmp_path)
    node, _ = register(core)
    with pytest.raises(AlreadyExists, match="already connected"):
        register(core)
    node.last_seen -= 60  # the old stream went silent past its lease: the new stream may take over
    register(core)


def test_request_id_reused_for_another_spec_is_refused(tmp_path) -> None:
    from opentinker_scheduler.errors import AlreadyExists

    core = make_core(tmp_path)
    core.api.submit(spec(), owner="u", request_id="r1")
    with pytest.raises(AlreadyExists, match="different spec"):
        core.api.submit(spec(gpus=2), owner="u", request_id="r1")


def test_attempt_that_ended_while_cut_off_is_applied_on_reconnect(tmp_path) -> None:
    task, core2 = _restarted_while_running(tmp_path)  # meanwhile the worker finished
    done = N.TaskReport(
        task_id=task.task_id,
        attempt=1,
        state=C.TASK_STATE_SUCCEEDED,
        checkpoint=C.Checkpoint(step=3, path="/ck/step_3", final=True),
    )
    devices = [C.Device(index=i, simulated=True) for i in range(4)]
    core2.node_register(N.Register(node_id="gpu-node-01", devices=devices, max_tasks=8, finished=[done]))
    t = core2.api.get(task.task_id)
    assert t.state == C.TASK_STATE_SUCCEEDED and t.attempt == 1 and t.latest_checkpoint.path == "/ck/step_3"


def test_hand_back_does_not_use_up_attempts(tmp_path) -> None:
    core = make_core(tmp_path, default_max_attempts=1)
    task = core.api.submit(spec(), owner="u")
    node, _ = register(core)
    for attempt in (1, 2, 3):
        core.schedule()
        report(core, node, task.task_id, attempt, C.TASK_STATE_RUNNING)
        report(core, node, task.task_id, attempt, C.TASK_STATE_CANCELLED, error="drained")
        t = core.api.get(task.task_id)
        assert t.state == C.TASK_STATE_PENDING and t.attempt == attempt + 1


def test_unknown_nodes_switch_and_gpu_disagreement(tmp_path) -> None:
    core = make_core(tmp_path, allow_unknown_nodes=False)
    with pytest.raises(PermissionDenied, match="not in resource_pool"):
        register(core, node_id="stranger")
    node, registered = register(core, gpus=2)  # config says 4, NVML finds 2: the smaller wins
    assert registered.gpu_count == 2
    assert any("config gpu_count 4 but node found 2" in n for n in node.notes)


def test_a_lost_node_hands_the_attempt_back_and_max_node_losses_ends_the_task(tmp_path) -> None:
    core = make_core(tmp_path, lease_s=0.01, default_max_attempts=2, max_node_losses=3)
    task = core.api.submit(spec(), owner="u")
    for lost in (1, 2, 3):
        node, _ = register(core)
        core.schedule()
        report(core, node, task.task_id, core.api.get(task.task_id).attempt, C.TASK_STATE_RUNNING)
        node.last_seen -= 1
        core.tick()
        t = core.api.get(task.task_id)
        if lost < 3:  # handed back: max_attempts (2) is not used up by a node that died
            assert (t.state, t.attempt, t.handed_back) == (C.TASK_STATE_PENDING, lost + 1, lost)
    assert t.state == C.TASK_STATE_FAILED
    assert "its attempts lost their node 3 times, max_node_losses (3) reached" in t.error, t.error


# --- ledger property test ------------------------------------------------------------------

ops = st.lists(
    st.tuples(
        st.sampled_from(
            ["submit", "schedule", "finish", "fail", "cancel", "lose", "reconnect", "restart", "urgent", "confirm"]
        ),
        st.integers(0, 4),
    ),
    max_size=40,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops)
def test_ledger_never_negative_or_leaking(tmp_path_factory, sequence) -> None:
    tmp = tmp_path_factory.mktemp("ledger")
    core = make_core(tmp, lease_s=0.01, default_max_attempts=3)
    register(core)
    for op, k in sequence:
        node = core.ledger.nodes["gpu-node-01"]
        active = [t for t in core.store.tasks_in_states([C.TASK_STATE_ASSIGNED, C.TASK_STATE_RUNNING])]
        if op == "submit":  # LoRA tasks on two base models: same-model ones may share GPUs
            core.api.submit(spec(gpus=k % 3, model=f"/models/m{k % 2}"), owner="u")
        elif op == "schedule":
            core.schedule()
        elif op in ("finish", "fail") and active:
            t = active[k % len(active)]
            state = C.TASK_STATE_SUCCEEDED if op == "finish" else C.TASK_STATE_FAILED
            report(core, node, t.task_id, t.attempt, state, retryable=True)
        elif op == "cancel" and active:
            t = active[k % len(active)]
            core.api.cancel(t.task_id)
            report(core, node, t.task_id, t.attempt, C.TASK_STATE_CANCELLED)
        elif op == "urgent":  # a higher-priority task, then a preemption step
            core.schedule()
            for t in core.store.tasks_in_states([C.TASK_STATE_ASSIGNED]):  # preemption picks RUNNING tasks
                report(core, node, t.task_id, t.attempt, C.TASK_STATE_RUNNING)
            s = spec(gpus=k % 4 + 1)
            s.priority = k + 2  # above lora_finetune's own priority
            core.api.submit(s, owner="u")
            core.preempt()
        elif op == "confirm":  # victims' nodes confirm they stopped
            for tid, (attempt, _, _) in list(core.preemptions.victims.items()):
                report(core, node, tid, attempt, C.TASK_STATE_CANCELLED, error="PREEMPTED")
        elif op == "lose":
            node.last_seen -= 1
            core.tick()
        elif op == "reconnect":
            running = [(t.task_id, t.attempt) for t in active if t.node_id == "gpu-node-01"]
            core.node_disconnected(node, node.generation, goodbye=False)
            register(core, running=running[: k % (len(running) + 1)])
        elif op == "restart":
            core.store.close()
            core = make_core(tmp, lease_s=0.01, default_max_attempts=3)
            running = [
                (t.task_id, t.attempt)
                for t in core.store.tasks_in_states([C.TASK_STATE_ASSIGNED, C.TASK_STATE_RUNNING])
            ]
            register(core, running=running)
        # Invariants: the ledger matches the store; a GPU is held by one task, or by at most
        # max_tasks_per_gpu LoRA tasks on the same base model; none beyond the node.
        node = core.ledger.nodes["gpu-node-01"]
        tenants: dict[int, list[str]] = {}
        for tid, (_, devs) in node.allocations.items():
            assert len(devs) == len(set(devs))
            for d in devs:
                tenants.setdefault(d, []).append(tid)
        for d, tids in tenants.items():
            assert 0 <= d < node.gpu_count
            assert len(tids) <= core.config.max_tasks_per_gpu
            if len(tids) > 1:
                models = {core.api.get(t).spec.model for t in tids}
                assert len(models) == 1, f"GPU {d} shared across base models {models}"
        assert len(node.allocations) <= node.max_tasks
        active_ids = {
            (t.task_id, t.attempt) for t in core.store.tasks_in_states([C.TASK_STATE_ASSIGNED, C.TASK_STATE_RUNNING])
        }
        held = {(tid, a) for tid, (a, _) in node.allocations.items()}
        assert active_ids <= held, "an active task without GPUs in the ledger"
        cancelled_only = held - active_ids
        for tid, (a, _, _) in core.preemptions.victims.items():
            assert node.allocations.get(tid, (None,))[0] == a, (
                "a preemption victim lost its GPUs before the node confirmed"
            )
        for tid, a in cancelled_only:
            assert core.api.get(tid).terminal, "ledger holds GPUs for a task that is not active"
    core.store.close()


def test_restart_grace_covers_slow_reconnects(tmp_path) -> None:
    task, core2 = _restarted_while_running(tmp_path, lease_s=0.01, restart_grace_s=30)
    core2.tick()  # well past the lease, within the restart grace: the task keeps running
    assert core2.api.get(task.task_id).state == C.TASK_STATE_RUNNING
    core2.ledger.nodes["gpu-node-01"].last_seen -= 31  # the node never came back
    core2.tick()
    t = core2.api.get(task.task_id)
    assert t.state == C.TASK_STATE_PENDING and t.attempt == 2


def test_not_found_cuts_long_ids(tmp_path) -> None:
    core = make_core(tmp_path)
    with pytest.raises(NotFound) as err:
        core.api.get("x" * 100_000)
    assert len(str(err.value)) < 200


def test_pool_max_tasks_is_an_upper_bound_on_what_the_node_offers(tmp_path) -> None:
    core = make_core(tmp_path)  # pool: gpu-node-01 with 4 GPUs, max_tasks 8
    devices = [C.Device(index=i, uuid=f"u{i}", name="g", simulated=True) for i in range(4)]
    node, registered = core.node_register(N.Register(node_id="gpu-node-01", devices=devices, max_tasks=2))
    assert (node.max_tasks, registered.max_tasks) == (2, 2)
    assert any("config max_tasks 8 but the node runs at most 2" in n for n in node.notes)
    for _ in range(3):
        core.api.submit(spec(gpus=0), owner="u")
    core.schedule()
    assert len(node.allocations) == 2


def test_the_stored_spec_is_resolved_at_submit(tmp_path) -> None:
    """Every hyper-parameter the task runs with is written down (defaults included), and
    max_attempts is the config's default when the spec gave none; a retry of the same request
    still finds its task."""
    from google.protobuf import json_format

    from opentinker_common.spec import GRPOConfig

    core = make_core(tmp_path)
    task = core.api.submit(spec(steps=7), owner="alice", request_id="r1")
    stored = core.store.get_task(task.task_id).spec
    hp = json_format.MessageToDict(stored.hyperparameters)
    assert hp["steps"] == 7 and hp["learning_rate"] == GRPOConfig().learning_rate
    assert set(hp) == {f.name for f in dataclasses.fields(GRPOConfig)}
    assert stored.limits.max_attempts == 3
    assert core.api.submit(spec(steps=7), owner="alice", request_id="r1").task_id == task.task_id
