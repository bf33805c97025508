"""Which task's checkpoint an inference server serves as an adapter (``resolve.adapter_checkpoint``,
the decision ``SchedulerResolver`` makes on ``LookupTask``'s answer): finished ``lora_finetune``
and ``sft`` tasks, ended training sessions (``lora_session``: their newest
``SaveWeightsForSampler`` or ``SaveState``) and running ones (their sampler saves only, the newest
or the one at a step, ``<task id>@<step>``), running lora_finetune / sft tasks once they have a
checkpoint (the newest, or the one at a step); anything else is refused naming the accepted workloads."""

from __future__ import annotations

import pytest

from opentinker.common.v1 import common_pb2 as C
from opentinker_trainer.inference.adapters import AdapterNotFound, AdapterRefused
from opentinker_trainer.inference.resolve import (
    ADAPTER_WORKLOADS,
    adapter_checkpoint,
    current_version,
    split_adapter_name,
)

MODEL = "/models/m"


def task(workload: str, state=C.TASK_STATE_SUCCEEDED, *, model: str = MODEL, checkpoint: C.Checkpoint | None = None):
    t = C.Task(task_id="task-1", state=state, spec=C.TaskSpec(workload_type=workload, model=model))
    if checkpoint is not None:
        t.latest_checkpoint.CopyFrom(checkpoint)
    return t


SAMPLER = C.Checkpoint(step=3, path="/ck/sampler_w", format="peft_lora")  # not final: a session writes none


@pytest.mark.parametrize("state", [C.TASK_STATE_SUCCEEDED, C.TASK_STATE_CANCELLED, C.TASK_STATE_FAILED])
def test_an_ended_training_session_serves_its_newest_adapter(state) -> None:
    assert "lora_session" in ADAPTER_WORKLOADS
    got = adapter_checkpoint("task-1", task("lora_session", state, checkpoint=SAMPLER), MODEL)
    assert (got.path, got.step) == ("/ck/sampler_w", 3)


STATE = C.Checkpoint(step=4, path="/ck/state_s", format="peft_lora")  # SaveState: adapter + optimizer
LATER = C.Checkpoint(step=5, path="/ck/sampler_v", format="peft_lora")


def test_a_running_session_serves_its_newest_sampler_save_or_the_one_at_a_step() -> None:
    running = task("lora_session", C.TASK_STATE_RUNNING, checkpoint=STATE)  # a SaveState came last
    assert adapter_checkpoint("task-1", running, MODEL, checkpoints=[SAMPLER, STATE]).path == "/ck/sampler_w"
    assert adapter_checkpoint("task-1", running, MODEL, checkpoints=[SAMPLER, STATE, LATER]).step == 5
    got = adapter_checkpoint("task-1@3", running, MODEL, step=3, checkpoints=[SAMPLER, STATE, LATER])
    assert (got.path, got.step) == ("/ck/sampler_w", 3)


def test_a_running_session_without_a_sampler_save_is_refused_saying_what_to_call() -> None:
    running = task("lora_session", C.TASK_STATE_RUNNING, checkpoint=STATE)
    for checkpoints in ([], [STATE]):  # a SaveState is not a frozen copy for a sampler
        with pytest.raises(AdapterRefused, match="no sampler save yet; call SaveWeightsForSampler first"):
            adapter_checkpoint("task-1", running, MODEL, checkpoints=checkpoints)
    with pytest.raises(AdapterNotFound, match="no sampler save at step 4; steps with one: 3, 5"):
        adapter_checkpoint("task-1@4", running, MODEL, step=4, checkpoints=[SAMPLER, STATE, LATER])


def test_a_running_training_task_serves_its_published_checkpoints_once_it_has_one() -> None:
    for workload in ("lora_finetune", "sft"):
        running = task(workload, C.TASK_STATE_RUNNING, checkpoint=LATER)
        assert adapter_checkpoint("task-1", running, MODEL).path == LATER.path
        got = adapter_checkpoint("task-1@3", running, MODEL, step=3, checkpoints=[SAMPLER, LATER])
        assert (got.path, got.step) == (SAMPLER.path, 3)
        with pytest.raises(AdapterRefused, match=r"task is RUNNING and has no checkpoint yet; .*checkpoint_every"):
            adapter_checkpoint("task-1", task(workload, C.TASK_STATE_RUNNING), MODEL)
        with pytest.raises(AdapterRefused, match=r"task is PENDING and has no checkpoint yet"):
            adapter_checkpoint("task-1", task(workload, C.TASK_STATE_PENDING), MODEL)


def test_a_finished_task_serves_its_checkpoint_at_a_step() -> None:
    ended = task("lora_session", C.TASK_STATE_CANCELLED, checkpoint=LATER)
    assert adapter_checkpoint("task-1@4", ended, MODEL, step=4, checkpoints=[SAMPLER, STATE, LATER]).path == STATE.path
    with pytest.raises(AdapterNotFound, match="no checkpoint at step 9; steps with one: 3, 4, 5"):
        adapter_checkpoint("task-1@9", ended, MODEL, step=9, checkpoints=[SAMPLER, STATE, LATER])


def test_adapter_names_are_a_task_id_with_an_optional_step() -> None:
    assert split_adapter_name("task-1") == ("task-1", 0)
    assert split_adapter_name("task-1@12") == ("task-1", 12)
    for bad in ("task-1@", "task-1@0", "task-1@x", "@3", "task-1@-2"):
        with pytest.raises(AdapterNotFound, match="expected <task id> or <task id>@<step>"):
            split_adapter_name(bad)


def test_other_workloads_are_refused_naming_the_accepted_ones() -> None:
    for workload in ("inference", "full_rl"):
        with pytest.raises(
            AdapterRefused,
            match=f"task is a {workload} task; only lora_finetune, sft and lora_session tasks give adapters",
        ):
            adapter_checkpoint("task-1", task(workload, checkpoint=SAMPLER), MODEL)
    for workload in ("lora_finetune", "sft"):
        assert adapter_checkpoint("task-1", task(workload, checkpoint=SAMPLER), MODEL).path == SAMPLER.path


def test_a_session_without_a_checkpoint_or_on_another_model_is_refused() -> None:
    with pytest.raises(AdapterNotFound, match="task has no checkpoint"):
        adapter_checkpoint("task-1", task("lora_session", C.TASK_STATE_CANCELLED), MODEL)
    with pytest.raises(AdapterRefused, match="was trained on base model '/models/other'"):
        adapter_checkpoint("task-1", task("lora_session", model="/models/other", checkpoint=SAMPLER), MODEL)
    full = C.Checkpoint(step=1, path="/ck/full", format="hf_full")
    with pytest.raises(AdapterRefused, match="not a LoRA adapter"):
        adapter_checkpoint("task-1", task("lora_session", checkpoint=full), MODEL)


def test_a_request_for_a_running_training_task_is_pinned_to_its_newest_checkpoint_on_arrival() -> None:
    for workload in ("lora_finetune", "sft"):
        assert current_version("task-1", task(workload, C.TASK_STATE_RUNNING, checkpoint=LATER)) == "task-1@5"
        assert current_version("task-1", task(workload, C.TASK_STATE_RUNNING)) == "task-1"  # none yet: refused on load
        assert current_version("task-1", task(workload, checkpoint=LATER)) == "task-1"  # finished: never changes
    # A running session keeps its rule: its newest sampler save, resolved when loaded.
    assert current_version("task-1", task("lora_session", C.TASK_STATE_RUNNING, checkpoint=LATER)) == "task-1"
