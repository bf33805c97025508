"""Adapter name -> checkpoint folder, by asking the scheduler (``NodeService.LookupTask``, with the
serving attempt's credential) about the task of that id.

An adapter is named by the id of a finished ``lora_finetune``, ``sft`` or ``lora_session`` task;
it is served from that task's newest checkpoint (its final one when it succeeded; for a training
session the newest ``SaveWeightsForSampler`` or ``SaveState``, whichever came last), fetched from
the artifact store by its key (``fetch``: through the node-local cache); only a checkpoint without
an ``artifact`` (an old trainer's) is read at its ``path``.

A ``lora_finetune`` or ``sft`` task that is still running (say, training on the same model
host as the server) serves its published checkpoints: a request naming ``<task id>`` is pinned
when it arrives to ``<task id>@<step>`` of the task's newest checkpoint then
(:meth:`SchedulerResolver.current`), and keeps that version to its last token; a request after
the next checkpoint gets that one. It never sees a half-applied optimizer step: a checkpoint is
written between steps and is in the artifact store before the scheduler lists it. (A server
that is a tenant of the model host the task trains on serves its live adapter instead, copied
between two steps: ``workloads/serving.py`` ``_live_copy``.)

A ``lora_session`` that is still running serves its sampler saves (``SaveWeightsForSampler``;
a ``SaveState`` is not a frozen copy for a sampler): ``<task id>`` is its newest one,
``<task id>@<step>`` the one at that step (what ``SaveWeightsForSamplerResponse.adapter``
names). A server resolves a name once, when it loads it, and keeps serving that version while it
is resident; a later save is a new version, asked for by its own ``<task id>@<step>`` name
(:func:`split_adapter_name`). ``@<step>`` also names a finished adapter task's checkpoint at a
step.

A full-weight checkpoint (``hf_full``: a finished ``sft`` with ``lora: false`` or a ``full_rl``
GRPO task on text) is served as the base model of an inference task
(``InferenceConfig.checkpoint_task_id``): :func:`full_weight_checkpoint` picks it,
:meth:`SchedulerResolver.full_weights` fetches it the same way and :func:`check_weights` checks
the folder holds its weights.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

import grpc

from opentinker.common.v1 import common_pb2
from opentinker.node.v1 import node_pb2, node_pb2_grpc
from opentinker_common.artifacts.checkpoint_lists import SAMPLER_PREFIX, at_step, sampler_saves, steps_text
from opentinker_common.artifacts.deleted import deleted_words
from opentinker_common.artifacts.errors import ArtifactCorrupt, ArtifactNotFound
from opentinker_common.artifacts.full_weights import FULL_FORMAT, WEIGHT_FILES, weights_problem

from opentinker_trainer.context import UserError
from opentinker_trainer.scheduler_link import scheduler_channel
from opentinker_trainer.inference.adapters import AdapterNotFound, AdapterRefused

__all__ = [
    "SchedulerResolver",
    "ADAPTER_WORKLOADS",
    "adapter_checkpoint",
    "current_version",
    "split_adapter_name",
    "SAMPLER_PREFIX",
    "same_model",
    "adapter_not_found",
    "policy_not_found",
    "FULL_FORMAT",
    "WEIGHT_FILES",
    "CheckpointNotFound",
    "CheckpointRefused",
    "full_weight_checkpoint",
    "check_weights",
]


class CheckpointNotFound(UserError, LookupError):
    """NOT_FOUND: no such task, or it has no checkpoint at the step asked for. The inference
    task serving it ends FAILED with this message (a :class:`UserError`: not retried)."""


class CheckpointRefused(UserError, ValueError):
    """FAILED_PRECONDITION: the task has not finished, its checkpoint is not full weights, it has
    none (its artifacts were deleted, say), or the checkpoint folder lacks its weights file."""


#: Workloads whose checkpoints are LoRA adapters that can be served (a ``lora_session``'s
#: ``SaveWeightsForSampler`` and ``SaveState`` checkpoints are PEFT adapters too).
ADAPTER_WORKLOADS = ("lora_finetune", "sft", "lora_session")
#: Adapter workloads whose running tasks serve their newest published checkpoint
#: (:meth:`SchedulerResolver.current`); a running ``lora_session`` serves its sampler saves.
TRAINING_WORKLOADS = ("lora_finetune", "sft")
#: ``ADAPTER_WORKLOADS`` as messages list them.
ADAPTER_WORKLOADS_TEXT = "lora_finetune, sft and lora_session"
_TERMINAL = (common_pb2.TASK_STATE_SUCCEEDED, common_pb2.TASK_STATE_FAILED, common_pb2.TASK_STATE_CANCELLED)


def adapter_not_found(name: str) -> AdapterNotFound:
    """The error for an adapter name that names no task the caller may use: the same words whether
    the task does not exist or belongs to someone else (its existence is never confirmed)."""
    return AdapterNotFound(
        f"adapter {name!r}: no task with that id "
        "(adapters are named by a finished lora_finetune, sft or lora_session task's id)"
    )


def policy_not_found(name: str) -> str:
    """The words for a policy name that names no task the caller may use (as for adapters)."""
    return f"policy {name!r}: no task with that id (policies are named by a finished full_rl task's id)"


def split_adapter_name(name: str) -> tuple[str, int]:
    """``(task id, step)`` of adapter name ``name``: ``<task id>`` gives step 0 (the newest
    checkpoint; a running session's newest sampler save), ``<task id>@<step>`` (``step`` >= 1)
    the checkpoint at that step. The task id is what owner and API-key checks are made on.

    Raises:
        AdapterNotFound: ``@`` not followed by a whole number >= 1 (no task has such a checkpoint).
    """
    task_id, at, step = name.partition("@")
    if not at:
        return name, 0
    if not step.isdigit() or int(step) < 1 or not task_id:
        raise AdapterNotFound(
            f"adapter {name!r}: expected <task id> or <task id>@<step> with a step >= 1 (a checkpoint's step)"
        )
    return task_id, int(step)


def same_model(a: str, b: str) -> bool:
    """Whether two model names (hub ids or folders) name the same model."""
    if a == b:
        return True
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    return pa.exists() and pb.exists() and os.path.realpath(pa) == os.path.realpath(pb)


def adapter_checkpoint(
    name: str,
    task: common_pb2.Task,
    served_model: str,
    deleted: common_pb2.TaskEvent | None = None,
    *,
    step: int = 0,
    checkpoints=(),
) -> common_pb2.Checkpoint:
    """The checkpoint adapter ``name`` (task ``task``, as ``LookupTask`` gives it, with its
    ``checkpoints``, oldest first) is served from, on a server of base model ``served_model``: a
    finished task's newest checkpoint (``step`` 0) or the one at ``step``; a running
    ``lora_session``'s newest sampler save (``SaveWeightsForSampler``), or the one at ``step``.
    ``deleted``: the task's ``artifacts_deleted`` event (``LookupTaskResponse``), named when it
    has no checkpoint.

    Raises:
        AdapterRefused: the task is not of a workload in :data:`ADAPTER_WORKLOADS`, has not
            finished (a running training session: serves its sampler saves only, and has none
            yet), its checkpoint is not ``peft_lora``, or it trained another base model.
        AdapterNotFound: the task has no checkpoint (its artifacts were deleted, say), or none at
            ``step`` (a running session: no sampler save at ``step``; the message lists them).
    """
    workload = task.spec.workload_type
    if workload not in ADAPTER_WORKLOADS:
        raise AdapterRefused(
            f"adapter {name!r}: task is a {workload} task; only {ADAPTER_WORKLOADS_TEXT} tasks give adapters"
        )
    running_session = task.state not in _TERMINAL and workload == "lora_session"
    if task.state not in _TERMINAL and not running_session and not task.latest_checkpoint.path:
        # A training task still running serves its published checkpoints (see SchedulerResolver.current).
        state = common_pb2.TaskState.Name(task.state).removeprefix("TASK_STATE_")
        raise AdapterRefused(
            f"adapter {name!r}: task is {state} and has no checkpoint yet; its adapter can be served once it "
            "has written one (hyperparameters.checkpoint_every) or has finished"
        )
    if running_session:
        saves = sampler_saves(checkpoints)
        if not saves:
            raise AdapterRefused(
                f"adapter {name!r}: the training session is running and has no sampler save yet; "
                "call SaveWeightsForSampler first (a running session serves its sampler saves)"
            )
        ckpt = saves[-1] if not step else at_step(saves, step)
        if ckpt is None:
            raise AdapterNotFound(
                f"adapter {name!r}: the running session has no sampler save at step {step}; "
                f"steps with one: {steps_text(saves)}"
            )
    elif step:
        ckpt = at_step(checkpoints, step)
        if ckpt is None:
            raise AdapterNotFound(
                f"adapter {name!r}: task has no checkpoint at step {step}; steps with one: {steps_text(checkpoints)}"
            )
    elif not task.HasField("latest_checkpoint") or not task.latest_checkpoint.path:
        raise AdapterNotFound(f"adapter {name!r}: task has no checkpoint{_deleted(deleted)}")
    else:
        ckpt = task.latest_checkpoint
    if ckpt.format and ckpt.format != "peft_lora":
        raise AdapterRefused(f"adapter {name!r}: its checkpoint is {ckpt.format!r}, not a LoRA adapter (peft_lora)")
    if not same_model(task.spec.model, served_model):
        raise AdapterRefused(
            f"adapter {name!r} was trained on base model {task.spec.model!r}; this server serves {served_model!r}"
        )
    return ckpt


def current_version(name: str, task: common_pb2.Task) -> str:
    """The version of adapter ``name`` (a plain ``<task id>``) a request arriving now is served,
    given its task as ``LookupTask`` gives it: ``<task id>@<step>`` of a running ``lora_finetune``
    / ``sft`` task's newest checkpoint (:data:`TRAINING_WORKLOADS`), else ``name`` (a finished
    task; a running session; a running task without a checkpoint, refused when it is loaded)."""
    running = task.state not in _TERMINAL
    if running and task.spec.workload_type in TRAINING_WORKLOADS and task.latest_checkpoint.path:
        return f"{split_adapter_name(name)[0]}@{task.latest_checkpoint.step}"
    return name


def full_weight_checkpoint(
    name: str,
    task: common_pb2.Task,
    step: int = 0,
    checkpoints=(),
    deleted: common_pb2.TaskEvent | None = None,
) -> common_pb2.Checkpoint:
    """The full-weight checkpoint of task ``name`` (``task``, as ``LookupTask`` gives it) to
    serve: at ``step`` (one of ``checkpoints``, ``LookupTaskResponse.checkpoints``), or with
    ``step`` 0 the task's newest (its final one when it succeeded). ``deleted``: the task's
    ``artifacts_deleted`` event, named when it has no checkpoint.

    Raises:
        CheckpointRefused: the task has not finished, has no checkpoint, or the chosen one is not
            ``hf_full`` (a LoRA adapter is served as an adapter, a PPO policy for ``Act``).
        CheckpointNotFound: no checkpoint at ``step`` (the message lists the steps there are).
    """
    if task.state not in _TERMINAL:
        state = common_pb2.TaskState.Name(task.state).removeprefix("TASK_STATE_")
        raise CheckpointRefused(f"task {name}: it is {state}; its weights can be served once it has finished")
    if step > 0:
        ckpt = at_step(checkpoints, step)
        if ckpt is None:
            raise CheckpointNotFound(
                f"task {name}: no checkpoint at step {step}; steps with one: {steps_text(checkpoints)}"
            )
    elif task.HasField("latest_checkpoint") and task.latest_checkpoint.path:
        ckpt = task.latest_checkpoint
    else:
        raise CheckpointRefused(f"task {name}: it has no checkpoint{_deleted(deleted)}; there are no weights to serve")
    if ckpt.format != FULL_FORMAT:
        raise CheckpointRefused(
            f"task {name} step {ckpt.step}: its checkpoint is {ckpt.format or 'of no format'!r}, not full weights "
            f"({FULL_FORMAT}); serve a LoRA adapter as an adapter and a PPO policy with Act"
        )
    return ckpt


def check_weights(folder: Path, name: str, step: int) -> Path:
    """``folder`` when it holds a full-weight checkpoint's weights (one of :data:`WEIGHT_FILES`)
    and ``config.json``.

    Raises:
        CheckpointRefused: either is missing (the message names the task, the step and the files).
    """
    folder = Path(folder)
    present = [p.name for p in folder.iterdir() if p.is_file()] if folder.is_dir() else []
    problem = weights_problem(name, step, present)
    if problem is not None:
        raise CheckpointRefused(problem)
    return folder


def _deleted(event: common_pb2.TaskEvent | None) -> str:
    return f": {deleted_words(event)}" if event is not None else ""


class SchedulerResolver:
    """Callable ``name -> Path`` for :class:`~.adapters.AdapterRegistry`.

    Args:
        target: the scheduler's ``host:port``.
        served_model: the base model this server serves; an adapter trained on another is refused.
        timeout: seconds per LookupTask call.
        fetch: ``Checkpoint -> local folder`` for a checkpoint in the artifact store (through the
            node-local cache); without it (or for a checkpoint with no ``artifact``) its ``path``.
        env: where the scheduler link's key and TLS settings are read (default ``os.environ``):
            the serving attempt's (``WorkerContext.scheduler_env``). Its credential reads the tasks
            of the inference task's owner only; a node key reads none.
    """

    def __init__(
        self, target: str, served_model: str, *, timeout: float = 10.0, fetch=None, env: Mapping[str, str] | None = None
    ) -> None:
        # The caller's right to this adapter was checked before (access.AccessChecker, with the
        # caller's endpoint token); the attempt's credential bounds what loading may read.
        self.channel, self.metadata = scheduler_channel(target, env)
        self.stub = node_pb2_grpc.NodeServiceStub(self.channel)
        self.served_model = served_model
        self.timeout = timeout
        self.fetch = fetch
        self._settled: set[str] = set()  # task ids seen finished: current() asks no more

    def close(self) -> None:
        self.channel.close()

    def __call__(self, name: str) -> Path:
        """The folder of adapter ``name``'s checkpoint, fetched. Raises as :meth:`check`."""
        ckpt = self.check(name)
        if ckpt.artifact.key and self.fetch is not None:
            return Path(self.fetch(ckpt))
        return Path(ckpt.path)

    def check(self, name: str) -> common_pb2.Checkpoint:
        """The checkpoint adapter ``name`` is served from, as the scheduler lists it; not fetched.

        Raises AdapterNotFound (no such task, no checkpoint, none at the step named),
        AdapterRefused (not finished, a running session without a sampler save, not a LoRA
        checkpoint, another base model); grpc.RpcError when the scheduler is unreachable.
        ``name``: see :func:`split_adapter_name`."""
        task_id, step = split_adapter_name(name)
        try:
            found = self.stub.LookupTask(
                node_pb2.LookupTaskRequest(task_id=task_id, include_checkpoints=True),
                timeout=self.timeout,
                metadata=self.metadata,
            )
        except grpc.RpcError as err:
            if err.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT):
                raise adapter_not_found(name) from None
            raise
        deleted = found.artifacts_deleted if found.HasField("artifacts_deleted") else None
        return adapter_checkpoint(
            name, found.task, self.served_model, deleted, step=step, checkpoints=found.checkpoints
        )

    def current(self, name: str) -> str:
        """The adapter version a request naming ``name`` is served, fixed when it arrives:
        ``<task id>@<step>`` of a running training task's newest checkpoint (``lora_finetune``,
        ``sft``: what it has published so far; a later checkpoint is a new version for later
        requests), else ``name`` itself (a name with a step, a finished task: its version never
        changes; a running session: its newest sampler save at load, as before). Errors are left
        to loading (:meth:`__call__`), which raises them with their words.

        Raises:
            grpc.RpcError: the scheduler cannot be reached.
        """
        task_id, step = split_adapter_name(name)
        if step or task_id in self._settled:
            return name
        try:
            found = self.stub.LookupTask(
                node_pb2.LookupTaskRequest(task_id=task_id), timeout=self.timeout, metadata=self.metadata
            )
        except grpc.RpcError as err:
            if err.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT):
                return name
            raise
        if found.task.state in _TERMINAL:
            self._settled.add(task_id)  # a finished task's newest checkpoint is its last
        return current_version(name, found.task)

    def full_weights(self, name: str, step: int = 0) -> tuple[Path, common_pb2.Checkpoint]:
        """``(checkpoint folder, checkpoint)`` of task ``name``'s full weights at ``step`` (0: the
        newest), fetched from the artifact store (through the node-local cache, hash-checked).

        Raises:
            CheckpointNotFound: no such task, or no checkpoint at ``step``.
            CheckpointRefused: see :func:`full_weight_checkpoint`; or the folder lacks its weights.
            CheckpointRefused also when the stored checkpoint is corrupt or gone (hash check).
            ArtifactError: the store cannot be reached.
            grpc.RpcError: the scheduler cannot be reached.
        """
        try:
            found = self.stub.LookupTask(
                node_pb2.LookupTaskRequest(task_id=name, include_checkpoints=step > 0),
                timeout=self.timeout,
                metadata=self.metadata,
            )
        except grpc.RpcError as err:
            if err.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT):
                raise CheckpointNotFound(f"task {name}: no task with that id; there are no weights to serve") from None
            raise
        deleted = found.artifacts_deleted if found.HasField("artifacts_deleted") else None
        ckpt = full_weight_checkpoint(name, found.task, step, found.checkpoints, deleted)
        try:
            folder = Path(self.fetch(ckpt)) if ckpt.artifact.key and self.fetch is not None else Path(ckpt.path)
        except (ArtifactNotFound, ArtifactCorrupt) as exc:
            raise CheckpointRefused(f"task {name} step {ckpt.step}: its checkpoint cannot be read: {exc}") from exc
        return check_weights(folder, name, int(ckpt.step)), ckpt

    def policy(self, name: str) -> tuple[Path, int]:
        """``(checkpoint folder, step)`` of the PPO policy of task ``name`` (``InferenceService.Act``).

        Raises:
            PolicyNotFound: no such task (or not the caller's: checked before this is called).
            PolicyRefused: not a full_rl task, not finished, no checkpoint, not a ``torch_ppo`` one.
            grpc.RpcError: the scheduler cannot be reached.
        """
        from opentinker_trainer.inference.policies import PolicyNotFound, PolicyRefused

        try:
            found = self.stub.LookupTask(
                node_pb2.LookupTaskRequest(task_id=name), timeout=self.timeout, metadata=self.metadata
            )
        except grpc.RpcError as err:
            if err.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT):
                raise PolicyNotFound(policy_not_found(name)) from None
            raise
        task = found.task
        deleted = found.artifacts_deleted if found.HasField("artifacts_deleted") else None
        if task.spec.workload_type != "full_rl":
            raise PolicyRefused(
                f"policy {name!r}: task is a {task.spec.workload_type} task; policies are full_rl tasks"
            )
        if task.state not in _TERMINAL:
            state = common_pb2.TaskState.Name(task.state).removeprefix("TASK_STATE_")
            raise PolicyRefused(f"policy {name!r}: task is {state}; its policy can be served once it has finished")
        ckpt = task.latest_checkpoint
        if not task.HasField("latest_checkpoint") or not ckpt.path:
            raise PolicyRefused(f"policy {name!r}: task has no checkpoint{_deleted(deleted)}")
        if ckpt.format != "torch_ppo":
            raise PolicyRefused(f"policy {name!r}: its checkpoint is {ckpt.format!r}, not a PPO policy (torch_ppo)")
        folder = Path(self.fetch(ckpt)) if ckpt.artifact.key and self.fetch is not None else Path(ckpt.path)
        return folder, int(ckpt.step)
