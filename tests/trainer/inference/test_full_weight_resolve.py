"""Which full-weight checkpoint an inference server serves as its base model
(``resolve.full_weight_checkpoint``, the decision ``SchedulerResolver.full_weights`` makes on
``LookupTask``'s answer) and the check that the fetched folder holds its weights
(``resolve.check_weights``); each refusal names the task and the step."""

from __future__ import annotations

from pathlib import Path

import pytest

from opentinker.common.v1 import common_pb2 as C
from opentinker_common.artifacts.deleted import deleted_words
from opentinker_trainer.context import UserError
from opentinker_trainer.inference.resolve import (
    CheckpointNotFound,
    CheckpointRefused,
    check_weights,
    full_weight_checkpoint,
)

STEP_1 = C.Checkpoint(step=1, path="/ck/step_1", format="hf_full")
STEP_2 = C.Checkpoint(step=2, path="/ck/step_2", format="hf_full", final=True)


def task(state=C.TASK_STATE_SUCCEEDED, checkpoint: C.Checkpoint | None = STEP_2, workload: str = "sft") -> C.Task:
    t = C.Task(task_id="task-1", state=state, spec=C.TaskSpec(workload_type=workload, model="/models/m"))
    if checkpoint is not None:
        t.latest_checkpoint.CopyFrom(checkpoint)
    return t


def test_the_newest_checkpoint_or_the_chosen_step_is_served() -> None:
    assert full_weight_checkpoint("task-1", task()) == STEP_2
    assert full_weight_checkpoint("task-1", task(workload="full_rl"), 1, [STEP_1, STEP_2]) == STEP_1
    # a step written twice (a resumed attempt): the newest record
    again = C.Checkpoint(step=1, path="/ck/attempt2/step_1", format="hf_full")
    assert full_weight_checkpoint("task-1", task(), 1, [STEP_1, again, STEP_2]) == again


def test_a_missing_step_is_not_found_listing_the_steps_there_are() -> None:
    with pytest.raises(CheckpointNotFound, match=r"^task task-1: no checkpoint at step 7; steps with one: 1, 2$"):
        full_weight_checkpoint("task-1", task(), 7, [STEP_1, STEP_2])


@pytest.mark.parametrize("state", [C.TASK_STATE_RUNNING, C.TASK_STATE_PENDING])
def test_an_unfinished_task_is_refused(state) -> None:
    name = C.TaskState.Name(state).removeprefix("TASK_STATE_")
    with pytest.raises(CheckpointRefused, match=rf"task task-1: it is {name}; its weights can be served once"):
        full_weight_checkpoint("task-1", task(state))


def test_no_checkpoint_and_deleted_artifacts_are_refused_naming_the_deletion() -> None:
    with pytest.raises(CheckpointRefused, match=r"task task-1: it has no checkpoint; there are no weights"):
        full_weight_checkpoint("task-1", task(checkpoint=None))
    event = C.TaskEvent()
    event.artifacts_deleted.deleted_by = "alice"
    with pytest.raises(CheckpointRefused) as err:
        full_weight_checkpoint("task-1", task(checkpoint=None), deleted=event)
    assert f"task task-1: it has no checkpoint: {deleted_words(event)}" in str(err.value)
    assert "by alice" in str(err.value)


def test_an_adapter_or_policy_checkpoint_is_not_full_weights() -> None:
    lora = C.Checkpoint(step=3, path="/ck/step_3", format="peft_lora")
    with pytest.raises(CheckpointRefused, match=r"task task-1 step 3: its checkpoint is 'peft_lora', not full weights"):
        full_weight_checkpoint("task-1", task(checkpoint=lora))
    ppo = C.Checkpoint(step=5, path="/ck/step_5", format="torch_ppo")
    with pytest.raises(CheckpointRefused, match=r"task task-1 step 5: its checkpoint is 'torch_ppo'"):
        full_weight_checkpoint("task-1", task(workload="full_rl"), 5, [ppo])


def test_the_errors_end_the_inference_task_without_retries() -> None:
    assert issubclass(CheckpointRefused, UserError) and issubclass(CheckpointNotFound, UserError)


def test_a_folder_without_its_weights_file_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "step_2"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "trainer_state.pt").write_bytes(b"x")
    with pytest.raises(
        CheckpointRefused,
        match=r"task task-1 step 2: its checkpoint lacks config.json or a weights file \(model.safetensors, .*\); "
        r"it holds config.json, trainer_state.pt",
    ):
        check_weights(folder, "task-1", 2)
    (folder / "model.safetensors").write_bytes(b"w")
    assert check_weights(folder, "task-1", 2) == folder
    (folder / "config.json").unlink()
    with pytest.raises(CheckpointRefused, match="lacks config.json"):
        check_weights(folder, "task-1", 2)
    with pytest.raises(CheckpointRefused, match="it holds nothing"):
        check_weights(tmp_path / "gone", "task-1", 2)
