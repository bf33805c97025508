"""What a task spec names besides itself: an uploaded dataset, an earlier task to start from.

Checked at submit (after the spec itself is valid), so a task that could never start is refused
with a reason instead of failing later on a node:

* ``spec.model`` and ``env_config.path`` may name local paths only where the scheduler's
  ``paths:`` policy allows (:func:`opentinker_scheduler.admission.paths.check_local_paths`);
* ``env_config.dataset_id`` must name a dataset stored with ``UploadDataset``, uploaded in the
  format the environment reads (``chat`` for ``chat_jsonl``, ``prompts`` for ``prompts``); for a
  ``prompts`` task the reward must fit the data: the first
  :data:`~opentinker_common.spec.prompts.SAMPLE_LINES` lines are checked with
  :func:`~opentinker_common.spec.prompts.check_sample` (INVALID_ARGUMENT naming the lines);
* an ``inference`` task's ``hyperparameters.checkpoint_task_id`` must name a task of the same
  owner (its server loads that task's full weights with the node's key);
* ``init_from`` must name a finished task of the same owner with a checkpoint of a language model
  (``peft_lora`` or ``hf_full``) on the same ``model``: the final one of a task that SUCCEEDED, or
  the last complete one of a task that was CANCELLED or FAILED (a timeout is a FAILED task; a
  cancelled or timed-out worker checkpoints on its way out). A checkpoint is recorded only once
  every file of it is stored, so the latest recorded one is complete.
  A training session (``lora_session``) writes no final checkpoint: each ``SaveState`` and
  ``SaveWeightsForSampler`` is a complete adapter, so its newest one will do in any ended state
  (one that SUCCEEDED ended idle).
  A ``lora_session`` with ``hyperparameters.init_state`` starts from that ``SaveState`` of the
  ``init_from`` task instead, which may still run (a recorded state is complete and immutable).

At assignment the ``init_from`` task's final checkpoint travels in ``AssignTask.init_checkpoint``
(:func:`opentinker_scheduler.state.core.init_checkpoint`).
"""

from __future__ import annotations

import os

from opentinker.common.v1 import common_pb2
from opentinker_common.artifacts.checkpoint_lists import STATE_PREFIX, named_state
from opentinker_common.artifacts.deleted import deleted_words
from opentinker_common.spec import SpecError, validate_env_config
from opentinker_common.spec.structs import struct_to_dict
from opentinker_common.spec.prompts import SAMPLE_LINES, check_sample
from opentinker_common.spec.session import init_state
from opentinker_common.spec.sft import is_dataset_id

from opentinker_scheduler.data.datasets import DatasetStore
from opentinker_scheduler.errors import FailedPrecondition, InvalidArgument, NotFound
from opentinker_scheduler.admission.paths import PathsConfig, check_local_paths

__all__ = ["INIT_CHECKPOINT_FORMATS", "check_references"]

#: Checkpoint formats a task can start from: a LoRA adapter, or full weights in transformers form.
INIT_CHECKPOINT_FORMATS: tuple[str, ...] = ("peft_lora", "hf_full")
#: States of a task whose last checkpoint another can start from (a timeout ends a task FAILED).
INIT_FROM_STATES: tuple[int, ...] = (
    common_pb2.TASK_STATE_SUCCEEDED,
    common_pb2.TASK_STATE_CANCELLED,
    common_pb2.TASK_STATE_FAILED,
)
#: Workloads whose every checkpoint is complete (no final one is written): the newest will do.
NO_FINAL_CHECKPOINT_WORKLOADS: frozenset[str] = frozenset({"lora_session"})


def check_references(
    spec: common_pb2.TaskSpec,
    *,
    datasets: DatasetStore,
    get_task,
    owner: str,
    default_model: str = "",
    dataset_visible=lambda dataset_id: True,
    paths: PathsConfig = PathsConfig(),
    auth_enabled: bool = False,
    artifacts_deleted=lambda task_id: None,
    dataset_uploaded_at_submit: bool = False,
    checkpoints=lambda task_id: [],
) -> None:
    """Refuse a (validated) spec whose dataset or ``init_from`` task cannot be used.

    Args:
        spec: the submitted spec.
        datasets: where uploaded datasets live.
        get_task: ``get_task(task_id, owner=...)`` returning the task row or raising NotFound.
        owner: the submitter; another owner's task counts as not found.
        default_model: the scheduler's default, used when ``spec.model`` is empty.
        dataset_visible: whether the submitter may use a dataset id (it uploaded those bytes);
            another owner's dataset counts as not found.
        paths, auth_enabled: the ``paths:`` policy and whether auth is on (which local model
            folders and dataset files the spec may name).
        artifacts_deleted: ``task_id -> TaskEvent | None``, the task's ``artifacts_deleted``
            event (``StateStore.artifacts_deleted``), named when the ``init_from`` task has no checkpoint.
        dataset_uploaded_at_submit: a dry run's ``dataset_id`` is the SHA-256 of a file the client
            checked and uploads only at submit (``SubmitTaskRequest.dataset_uploaded_at_submit``):
            checked as for a submit when this scheduler holds it already, else not refused as missing.
        checkpoints: ``task_id -> [Checkpoint]``, oldest first (``StateStore.checkpoints``), where
            ``hyperparameters.init_state`` is looked up.

    Raises:
        NotFound: no such dataset, or no such task (``spec.init_from``, an inference task's
            ``hyperparameters.checkpoint_task_id``), or no state ``hyperparameters.init_state`` of it.
        FailedPrecondition: the ``init_from`` task has not ended, or has no checkpoint a language
            model can start from (a SUCCEEDED one: no final checkpoint).
        InvalidArgument: the ``init_from`` task trained a different model, or ``spec.model`` /
            ``env_config.path`` names a local path the ``paths:`` policy does not allow.
    """
    check_local_paths(spec, paths=paths, auth_enabled=auth_enabled, default_model=default_model)
    if spec.HasField("env_config"):
        value = spec.env_config.fields.get("dataset_id")  # read in place: no dict of the whole env_config
        dataset_id = value.string_value if value is not None and value.WhichOneof("kind") == "string_value" else None
        if is_dataset_id(dataset_id) and dataset_uploaded_at_submit and not datasets.exists(dataset_id):
            dataset_id = None  # not uploaded yet: the client checked its file (a dry run)
        if is_dataset_id(dataset_id) and (
            not datasets.exists(dataset_id) or not dataset_visible(dataset_id)
        ):  # a malformed id is the spec check's
            raise NotFound(
                f"spec.env_config.dataset_id: dataset {dataset_id} not found on this scheduler "
                "(upload it first with UploadDataset)"
            )
        if is_dataset_id(dataset_id):
            _check_dataset_fits(spec, dataset_id, datasets)
    _check_served_checkpoint(spec, get_task, owner)
    state_name = init_state(spec)
    if state_name and not spec.init_from:
        raise InvalidArgument(
            "spec.hyperparameters.init_state: names a state of the spec.init_from task; set spec.init_from"
        )
    if not spec.init_from or _check_init_from_shape(spec.init_from):
        return  # unset, or malformed: the spec check refuses it with INVALID_ARGUMENT
    try:
        source = get_task(spec.init_from, owner=owner)
    except NotFound:
        raise NotFound(f"spec.init_from: task {spec.init_from!r} not found") from None
    state = common_pb2.TaskState.Name(source.state).removeprefix("TASK_STATE_")
    if state_name:
        _check_init_state(spec, source, state_name, checkpoints(source.task_id), default_model)
        return
    if source.state not in INIT_FROM_STATES:
        raise FailedPrecondition(
            f"spec.init_from: task {spec.init_from} is {state}; a task can only start from one that has ended "
            "(SUCCEEDED, or the last checkpoint of one CANCELLED or FAILED)"
        )
    ck = source.latest_checkpoint
    need_final = (
        source.state == common_pb2.TASK_STATE_SUCCEEDED
        and source.spec.workload_type not in NO_FINAL_CHECKPOINT_WORKLOADS
    )
    deleted = artifacts_deleted(source.task_id) if ck is None else None
    if deleted is not None:
        raise FailedPrecondition(
            f"spec.init_from: task {spec.init_from} ({state}) has no checkpoint to start from: {deleted_words(deleted)}"
        )
    if ck is None or (need_final and not ck.final) or ck.format not in INIT_CHECKPOINT_FORMATS:
        got = (
            "no checkpoint"
            if ck is None
            else f"a {'final' if ck.final else 'non-final'} {ck.format or 'unnamed'} checkpoint"
        )
        want = "a final checkpoint" if need_final else "a checkpoint"
        raise FailedPrecondition(
            f"spec.init_from: task {spec.init_from} ({state}) has {got}; "
            f"expected {want} in one of {', '.join(INIT_CHECKPOINT_FORMATS)}"
        )
    model = spec.model or default_model
    if source.spec.model != model:
        raise InvalidArgument(
            f"spec.model: expected {source.spec.model!r}, the model task {spec.init_from} (spec.init_from) trained, "
            f"got {model!r}"
        )


def _check_init_state(spec: common_pb2.TaskSpec, source, name: str, checkpoints, default_model: str) -> None:
    """State ``name`` of ``source`` must be recorded and still stored, on the same model.

    Raises:
        NotFound: no such state. InvalidArgument: ``source`` trained another model.
    """
    if named_state(checkpoints, name) is None:
        known = sorted(
            {
                os.path.basename(os.path.normpath(c.path)).removeprefix(STATE_PREFIX)
                for c in checkpoints
                if os.path.basename(os.path.normpath(c.path)).startswith(STATE_PREFIX)
            }
        )
        raise NotFound(
            f"spec.hyperparameters.init_state: task {spec.init_from} has no state {name!r} "
            f"(states: {', '.join(known) or 'none'})"
        )
    model = spec.model or default_model
    if source.spec.model != model:
        raise InvalidArgument(
            f"spec.model: expected {source.spec.model!r}, the model task {spec.init_from} (spec.init_from) trained, "
            f"got {model!r}"
        )


def _check_served_checkpoint(spec: common_pb2.TaskSpec, get_task, owner: str) -> None:
    """An ``inference`` task's ``hyperparameters.checkpoint_task_id`` (full weights served as its
    base model, which its server loads with the node's key) must name a task of the submitter:
    another owner's counts as not found, so nobody serves someone else's weights. Whether that
    task has a full-weight checkpoint the server (and ``RLClient.serve``, before submitting) says.

    Raises:
        NotFound: no such task of this owner.
    """
    if spec.workload_type != "inference" or not spec.HasField("hyperparameters"):
        return
    value = spec.hyperparameters.fields.get("checkpoint_task_id")
    task_id = value.string_value if value is not None and value.WhichOneof("kind") == "string_value" else ""
    if not task_id:
        return
    try:
        get_task(task_id, owner=owner)
    except NotFound:
        raise NotFound(f"spec.hyperparameters.checkpoint_task_id: task {task_id[:128]!r} not found") from None


def _check_init_from_shape(init_from: str) -> bool:
    """True when ``init_from`` is malformed (left to the spec check)."""
    return len(init_from) > 128 or not init_from.replace("-", "").replace("_", "").isalnum()


#: The dataset format each dataset-reading environment takes.
_FORMAT_OF_ENV = {"chat_jsonl": "chat", "prompts": "prompts"}


def _check_dataset_fits(spec: common_pb2.TaskSpec, dataset_id: str, datasets: DatasetStore) -> None:
    """The stored dataset is of the format the environment reads and, for ``prompts``, the
    reward can score its first lines.

    Raises:
        InvalidArgument: ``spec.env_config.dataset_id`` (uploaded in another format) or
            ``spec.env_config.reward...`` (the reward does not fit, naming the lines).
    """
    env_id = spec.env_config.fields.get("env_id")
    want = _FORMAT_OF_ENV.get(env_id.string_value if env_id is not None else "")
    if want is None:
        return
    formats = datasets.formats(dataset_id)
    if want not in formats:
        how = 'upload_dataset(path, format="prompts")' if want == "prompts" else "upload_dataset(path)"
        raise InvalidArgument(
            f"spec.env_config.dataset_id: expected a dataset uploaded as {want} for env_id "
            f"{env_id.string_value}, got one uploaded as {', '.join(formats)} (upload the file again with {how})"
        )
    if want != "prompts":
        return
    try:
        env = validate_env_config(struct_to_dict(spec.env_config, "spec.env_config"))
    except SpecError:
        return  # the spec check refuses it next, naming its field
    try:
        check_sample(env.reward, datasets.head(dataset_id, SAMPLE_LINES))
    except SpecError as err:
        raise InvalidArgument.from_spec(err) from None
