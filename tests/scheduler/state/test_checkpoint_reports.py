"""What a node's checkpoint reports do to a task: a checkpoint that could not be stored is a task
event and leaves the latest complete checkpoint as it was; a stored one is recorded, then handed
to the checkpoint listeners (retention); a task's artifacts may be deleted only once it has ended
and no unfinished task starts from it, and once deleted its checkpoints are listed no more."""

from __future__ import annotations

import pytest

from opentinker.common.v1 import common_pb2 as C
from opentinker_scheduler.errors import FailedPrecondition, NotFound

from tests.support.scheduler_core import make_core, register, report, spec


def _stored(task_id: str, step: int, *, final: bool = False) -> C.Checkpoint:
    ck = C.Checkpoint(step=step, path=f"/work/ck/step_{step}", format="peft_lora", final=final)
    ck.artifact.key = f"tasks/{task_id}/a1/{'final' if final else 'step'}_{step}"
    ck.artifact.manifest_sha256 = "ab" * 32
    ck.artifact.backend = "s3"
    return ck


def _running(tmp_path):
    core = make_core(tmp_path)
    task = core.api.submit(spec(), owner="alice")
    node, _ = register(core)
    core.schedule()
    report(core, node, task.task_id, 1, C.TASK_STATE_RUNNING)
    heard: list[tuple[str, int]] = []
    core.node_protocol.checkpoint_listeners.append(lambda task_id, ck: heard.append((task_id, ck.step)))
    return core, node, task, heard


def test_a_checkpoint_that_could_not_be_stored_is_an_event_and_keeps_the_last_complete_one(tmp_path) -> None:
    core, node, task, heard = _running(tmp_path)
    report(core, node, task.task_id, 1, checkpoint=_stored(task.task_id, 2))
    assert heard == [(task.task_id, 2)]  # recorded, then retention
    failure = C.CheckpointFailure(step=4, error="S3 endpoint http://s3:8333 unreachable", failures_in_a_row=1)
    report(core, node, task.task_id, 1, checkpoint_failed=failure)
    report(core, node, task.task_id, 1, checkpoint_failed=failure)  # resent after a reconnect: once
    t = core.api.get(task.task_id)
    assert t.state == C.TASK_STATE_RUNNING and t.latest_checkpoint.step == 2
    events = core.store.events_after(task.task_id, 0, limit=100)
    failed = [e.checkpoint_failed for e in events if e.WhichOneof("event") == "checkpoint_failed"]
    assert len(failed) == 1
    assert (failed[0].step, failed[0].attempt, failed[0].node_id, failed[0].fatal) == (4, 1, "gpu-node-01", False)
    assert "unreachable" in failed[0].error
    assert heard == [(task.task_id, 2)]  # nothing new to retain
    # the fatal one arrives with the attempt's FAILED end: both in one write, the task FAILED
    fatal = C.CheckpointFailure(step=6, error="2 checkpoints in a row could not be stored", fatal=True)
    report(
        core,
        node,
        task.task_id,
        1,
        C.TASK_STATE_FAILED,
        checkpoint_failed=fatal,
        error="2 checkpoints in a row could not be stored; the last complete checkpoint is step 2",
        retryable=False,
    )
    t = core.api.get(task.task_id)
    assert t.state == C.TASK_STATE_FAILED and t.latest_checkpoint.step == 2 and "step 2" in t.error
    kinds = [e.WhichOneof("event") for e in core.store.events_after(task.task_id, 0, limit=100)]
    assert kinds.count("checkpoint_failed") == 2 and kinds[-1] == "state_change"


def test_a_checkpoint_without_an_artifact_is_not_handed_to_retention(tmp_path) -> None:
    core, node, task, heard = _running(tmp_path)
    report(core, node, task.task_id, 1, checkpoint=C.Checkpoint(step=3, path="/shared/ck/step_3"))
    assert core.api.get(task.task_id).latest_checkpoint.step == 3 and heard == []


def test_artifacts_are_deletable_only_once_the_task_ended_and_nothing_starts_from_it(tmp_path) -> None:
    core, node, task, _ = _running(tmp_path)
    with pytest.raises(FailedPrecondition, match="RUNNING: its artifacts can be deleted once it has ended"):
        core.api.artifacts_deletable(task.task_id, owner="alice")
    report(core, node, task.task_id, 1, C.TASK_STATE_SUCCEEDED, checkpoint=_stored(task.task_id, 8, final=True))
    with pytest.raises(NotFound):
        core.api.artifacts_deletable(task.task_id, owner="bob")  # another owner's: as if it did not exist
    warm = spec()
    warm.init_from = task.task_id
    follower = core.api.submit(warm, owner="alice")  # a pending task that starts from it
    with pytest.raises(FailedPrecondition, match="init_from of unfinished task"):
        core.api.artifacts_deletable(task.task_id, owner="alice")
    core.api.cancel(follower.task_id, owner="alice")
    assert core.api.artifacts_deletable(task.task_id, owner=None).task_id == task.task_id  # an admin (no owner scope)
    core.table.artifacts_deleting(task.task_id)  # before the store deletes: no latest checkpoint to hand out
    assert core.store.get_task(task.task_id).latest_checkpoint is None
    assert [c.step for c in core.store.checkpoints(task.task_id)] == [8]  # still listed until deleted
    after = core.table.artifacts_deleted(task.task_id, keys=1, size_bytes=422, by="alice")
    assert after.latest_checkpoint is None and core.store.get_task(task.task_id).latest_checkpoint is None
    # the deletion is an event, and the checkpoints recorded before it are listed no more
    gone = core.store.artifacts_deleted(task.task_id)
    assert (gone.artifacts_deleted.deleted_keys, gone.artifacts_deleted.deleted_by) == (1, "alice")
    assert core.store.checkpoints(task.task_id) == []
    core.table.artifacts_deleted(task.task_id)  # a second rm deleted nothing: nothing more recorded
    kinds = [e.WhichOneof("event") for e in core.store.events_after(task.task_id, 0, limit=100)]
    assert kinds.count("artifacts_deleted") == 1 and kinds[-1] == "artifacts_deleted"


def test_checkpoints_retention_deleted_are_listed_no_more(tmp_path) -> None:
    core, node, task, _ = _running(tmp_path)
    for step in (2, 4, 6):
        report(core, node, task.task_id, 1, checkpoint=_stored(task.task_id, step))
    core.checkpoints_retired(task.task_id, [f"tasks/{task.task_id}/a1/step_2"])
    assert [c.step for c in core.store.checkpoints(task.task_id)] == [4, 6]
    assert core.api.get(task.task_id).latest_checkpoint.step == 6  # the newest is untouched
    assert core.store.artifacts_deleted(task.task_id) is None  # retention is no deletion of the task's artifacts
    core.checkpoints_retired(task.task_id, [])  # nothing deleted: nothing recorded
    kinds = [e.WhichOneof("event") for e in core.store.events_after(task.task_id, 0, limit=100)]
    assert kinds.count("artifacts_deleted") == 1


def _session_save(task_id: str, step: int, folder: str) -> C.Checkpoint:
    ck = C.Checkpoint(step=step, path=f"/work/ck/{folder}", format="peft_lora")
    ck.artifact.key = f"tasks/{task_id}/a1/{folder}"
    ck.artifact.manifest_sha256 = "cd" * 32
    return ck


def test_a_session_resumes_from_its_newest_state_not_a_later_sampler_save(tmp_path) -> None:
    """A sampler save holds weights alone: a requeued training session starts from its newest
    ``SaveState`` even when a sampler save (of the same step, or later) was recorded after it."""
    from tests.support.scheduler_core import drain

    core = make_core(tmp_path)
    session = spec()
    session.workload_type = "lora_session"
    task = core.api.submit(session, owner="alice")
    node, _ = register(core)
    core.schedule()
    report(core, node, task.task_id, 1, C.TASK_STATE_RUNNING)
    for step, folder in ((3, "state_early"), (5, "state_after5"), (5, "sampler_samp5"), (6, "sampler_samp6")):
        report(core, node, task.task_id, 1, checkpoint=_session_save(task.task_id, step, folder))
    assert core.api.get(task.task_id).latest_checkpoint.path.endswith("sampler_samp6")  # what serving reads
    drain(node)
    # Handed back (a drain): placed again at once, from the newest state.
    report(core, node, task.task_id, 1, C.TASK_STATE_CANCELLED, error="node drained", retryable=True)
    t = core.api.get(task.task_id)
    assert (t.attempt, t.latest_step) == (2, 5)  # where attempt 2 starts: the state's step
    queued = [
        e.state_change.message
        for e in core.store.events_after(task.task_id, 0, limit=100)
        if e.HasField("state_change")
    ]
    assert queued[-1].endswith("resumes from step 5")
    core.schedule()
    (assign,) = [c.assign_task for c in drain(node) if c.WhichOneof("command") == "assign_task"]
    assert assign.attempt == 2 and assign.resume_from.path.endswith("state_after5") and assign.resume_from.step == 5


def test_a_session_starts_from_a_named_state_of_another_running_session(tmp_path) -> None:
    """``init_from`` with ``hyperparameters.init_state``: the named ``SaveState`` of a session that
    still runs travels as ``AssignTask.init_checkpoint``; a name it never saved is not found."""
    from opentinker_scheduler.admission.refs import check_references
    from opentinker_scheduler.data.datasets import DatasetStore
    from opentinker_scheduler.errors import InvalidArgument
    from tests.support.scheduler_core import drain

    core = make_core(tmp_path)
    source = spec()
    source.workload_type = "lora_session"
    task = core.submit(source, owner="alice")
    node, _ = register(core)
    core.schedule()
    report(core, node, task.task_id, 1, C.TASK_STATE_RUNNING)
    for step, folder in ((2, "state_a-2"), (3, "state_a-3"), (3, "sampler_s3")):
        report(core, node, task.task_id, 1, checkpoint=_session_save(task.task_id, step, folder))
    datasets = DatasetStore(tmp_path / "datasets")

    def check(s: C.TaskSpec, owner: str = "alice") -> None:
        check_references(s, datasets=datasets, get_task=core.get, owner=owner, checkpoints=core.store.checkpoints)

    resumed = spec(init_state="a-2", init_optimizer=True)
    resumed.workload_type = "lora_session"
    resumed.init_from = task.task_id
    check(resumed)
    with pytest.raises(NotFound, match="spec.init_from"):
        check(resumed, owner="bob")
    missing = C.TaskSpec()
    missing.CopyFrom(resumed)
    missing.hyperparameters["init_state"] = "a-9"
    with pytest.raises(NotFound, match=r"init_state: task .* has no state 'a-9' \(states: a-2, a-3\)"):
        check(missing)
    alone = C.TaskSpec()
    alone.CopyFrom(resumed)
    alone.init_from = ""
    with pytest.raises(InvalidArgument, match="init_state: names a state of the spec.init_from task"):
        check(alone)

    started = core.submit(resumed, owner="alice")
    drain(node)
    core.schedule()
    (assign,) = [
        c.assign_task
        for c in drain(node)
        if c.WhichOneof("command") == "assign_task" and c.assign_task.task_id == started.task_id
    ]
    assert assign.init_checkpoint.path.endswith("state_a-2") and assign.init_checkpoint.step == 2
