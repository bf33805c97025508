"""The one submit pipeline: every check a new task passes, in order, then the write.

``SchedulerService.SubmitTask`` translates its request and calls :func:`admit`; nothing else
decides whether a task is accepted. The stages, in the order they run (the first refusal wins,
and a later stage costs nothing when an earlier one refuses):

0. **the scheduler's load** (:class:`~opentinker_scheduler.admission.load.SubmitGate`, passed by
   the servicer's ``rpc`` decorator before the call reaches :func:`admit`): a call that waited in
   the server longer than ``limits.max_submit_wait``, or over ``limits.max_submits_in_flight``
   calls in progress, RESOURCE_EXHAUSTED (reason ``OVERLOADED``, with RetryInfo); while the
   scheduler stops, UNAVAILABLE (``SHUTTING_DOWN``), there and again just before the write.
1. **per-caller limits** (when the scheduler has them): the caller's submit rate
   (``limits.submit_rate``, one token per call, taken even if a later stage refuses), the
   serialized spec's size (``limits.max_spec_bytes``), the owner's PENDING tasks
   (``limits.max_pending_per_owner``; counted only when that limit is set). RESOURCE_EXHAUSTED.
2. **local paths** (``paths:``, :func:`~opentinker_scheduler.admission.paths.check_local_paths`):
   INVALID_ARGUMENT.
3. **references** (:func:`~opentinker_scheduler.admission.refs.check_references`): the uploaded
   dataset (NOT_FOUND), the ``init_from`` task (NOT_FOUND, FAILED_PRECONDITION,
   INVALID_ARGUMENT).
4. **the environment**, built off the event loop under ``limits.spec_check_timeout``
   (:mod:`~opentinker_scheduler.admission.spec_check`): INVALID_ARGUMENT, or RESOURCE_EXHAUSTED
   when no check slot comes free in time.
5. **the core's own checks, then the write**
   (:meth:`~opentinker_scheduler.state.client_api.ClientApi.submit_grouped`): ``request_id``
   length and reuse (INVALID_ARGUMENT, ALREADY_EXISTS; a reuse with the same spec returns the
   task it made), the default model, the whole spec (INVALID_ARGUMENT naming the field path; the
   environment is found cached from stage 4), a GPU count some node could ever offer,
   ``spec.tracking`` loggers some connected node can write
   (:mod:`~opentinker_scheduler.policy.tracking`; FAILED_PRECONDITION). Only then is the PENDING
   row written, with the other submits of its group commit in one statement.

Stages 2 and 3 pass over what the spec check refuses later (a malformed ``dataset_id`` or
``init_from``), so each refusal names its own field.
"""

from __future__ import annotations

from typing import Callable

from opentinker.common.v1 import common_pb2

from opentinker_scheduler.admission.load import SubmitGate
from opentinker_scheduler.admission.refs import check_references
from opentinker_scheduler.admission.spec_check import check_submitted_spec
from opentinker_scheduler.data.datasets import DatasetStore
from opentinker_scheduler.security.keys import Principal
from opentinker_scheduler.security.limits import Limits
from opentinker_scheduler.state.core import SchedulerCore
from opentinker_scheduler.state.store import TaskRow

__all__ = ["admit", "admit_dry_run", "check_limits", "check_submit_rate"]


def check_limits(limits: Limits, spec: common_pb2.TaskSpec, caller: Principal, *, core: SchedulerCore) -> None:
    """Stage 1: the caller's submit rate, the spec's size, the owner's PENDING tasks, in that order.

    Raises:
        ResourceExhausted: a limit is reached; the message names it and its config key.
    """
    queue = core.queues.queue_config(caller.owner)  # its quota queue may set the per-owner limits
    where = f"queues[{queue[0]}].limits" if queue is not None else ""
    check_submit_rate(limits, caller, core=core)
    limits.check_spec_size(spec.ByteSize())
    limits.check_pending(
        caller.owner,
        lambda: (
            core.store.count_tasks(owner=caller.owner, states=(common_pb2.TASK_STATE_PENDING,))
            + core.api.waiting_new_tasks(caller.owner)
        ),
        override=(queue[1].max_pending_per_owner, f"{where}.max_pending_per_owner") if queue is not None else None,
    )


def check_submit_rate(limits: Limits, caller: Principal, *, core: SchedulerCore) -> None:
    """Take one of the caller's task-creation tokens (``limits.submit_rate``, or its quota queue's):
    SubmitTask and ImportAdapter, which makes a task too, share the owner's bucket.

    Raises:
        ResourceExhausted: the bucket is empty; the message says when to retry and the config key.
    """
    queue = core.queues.queue_config(caller.owner)
    rate = (
        (queue[1].submit_rate, queue[1].submit_burst, f"queues[{queue[0]}].limits.submit_rate")
        if queue is not None
        else None
    )
    limits.take_submit(caller.owner, override=rate)


async def admit(
    spec: common_pb2.TaskSpec,
    caller: Principal,
    *,
    core: SchedulerCore,
    datasets: DatasetStore,
    limits: Limits | None = None,
    dataset_visible: Callable[[str], bool] = lambda dataset_id: True,
    request_id: str = "",
    gate: SubmitGate | None = None,
) -> TaskRow:
    """Check a submitted spec stage by stage (module docstring) and store it as a PENDING task
    (:func:`admit_dry_run` runs the same stages and estimates instead).

    Args:
        spec: the submitted ``TaskSpec``.
        caller: who submits: ``owner`` owns the task and draws on its submit rate.
        core: the scheduler's state (config, store, the write).
        datasets: uploaded datasets (``env_config.dataset_id``).
        limits: the per-caller limits; None skips stage 1 (bare unit tests).
        dataset_visible: whether the caller may use a dataset id (another owner's counts as
            not found).
        request_id: the client's idempotency key (at most 128 characters).
        gate: the scheduler's submit gate; a stopping scheduler writes nothing (stage 0).

    Returns:
        The new PENDING task's row (the core's own: read, don't change), or the task an earlier
        call with the same ``request_id`` and spec made.

    Raises:
        ResourceExhausted, InvalidArgument, NotFound, FailedPrecondition, AlreadyExists,
            Unavailable: the first stage that refuses, as listed in the module docstring.
            Nothing is written.
    """
    await _check(spec, caller, core=core, datasets=datasets, limits=limits, dataset_visible=dataset_visible)
    if gate is not None:
        gate.check_open()
    return await core.api.submit_grouped(spec, owner=caller.owner, request_id=request_id)


async def admit_dry_run(
    spec: common_pb2.TaskSpec,
    caller: Principal,
    *,
    core: SchedulerCore,
    datasets: DatasetStore,
    limits: Limits | None = None,
    dataset_visible: Callable[[str], bool] = lambda dataset_id: True,
    dataset_uploaded_at_submit: bool = False,
) -> tuple[TaskRow, common_pb2.Usage, str]:
    """The stages of :func:`admit` up to the write, then the estimate instead of the write
    (``SubmitTask`` with ``dry_run``): a spec that passes here is one a submit accepts, as the
    cluster is now.

    Args:
        dataset_uploaded_at_submit: ``env_config.dataset_id`` names a local file the client checked
            and uploads at submit (see :func:`~opentinker_scheduler.admission.refs.check_references`).
        Others: as for :func:`admit`.

    Returns:
        :meth:`~opentinker_scheduler.state.client_api.ClientApi.estimate`'s ``(row, usage, basis)``.

    Raises:
        As :func:`admit`; nothing is written.
    """
    await _check(
        spec,
        caller,
        core=core,
        datasets=datasets,
        limits=limits,
        dataset_visible=dataset_visible,
        dataset_uploaded_at_submit=dataset_uploaded_at_submit,
    )
    return core.api.estimate(spec, owner=caller.owner)


async def _check(
    spec: common_pb2.TaskSpec,
    caller: Principal,
    *,
    core: SchedulerCore,
    datasets: DatasetStore,
    limits: Limits | None,
    dataset_visible: Callable[[str], bool],
    dataset_uploaded_at_submit: bool = False,
) -> None:
    """Stages 1 to 4 (the module docstring): everything before the core's own checks and write."""
    if limits is not None:
        check_limits(limits, spec, caller, core=core)
    check_references(  # local paths first (stage 2), then the dataset and init_from (stage 3)
        spec,
        datasets=datasets,
        get_task=core.api.get,
        owner=caller.owner,
        default_model=core.config.default_model,
        dataset_visible=dataset_visible,
        paths=core.config.paths,
        auth_enabled=core.config.auth.enabled,
        artifacts_deleted=core.store.artifacts_deleted,
        dataset_uploaded_at_submit=dataset_uploaded_at_submit,
        checkpoints=core.store.checkpoints,
    )
    await check_submitted_spec(core, spec)
