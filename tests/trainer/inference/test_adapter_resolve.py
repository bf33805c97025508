"""Which task's checkpoint an inference server serves as an adapter (``resolve.adapter_checkpoint``,
the decision ``SchedulerResolver`` makes on ``LookupTask``'s answer): finished ``lora_finetune``
and ``sft`` tasks, and ended training sessions (``lora_session``: their newest
``SaveWeightsForSampler`` or ``SaveState``); anything else is refused naming the accepted workloads."""

from __future__ import annotations

import pytest

from opentinker.common.v1 import common_pb2 as C
from opentinker_trainer.inference.adapters import AdapterNotFound, AdapterRefused
from opentinker_trainer.inference.resolve import ADAPTER_WORKLOADS, adapter_checkpoint

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


def test_a_running_session_is_refused_until_it_ends() -> None:
    with pytest.raises(AdapterRefused, match=r"task is RUNNING; its adapter can be served once the session has ended"):
        adapter_checkpoint("task-1", task("lora_session", C.TASK_STATE_RUNNING, checkpoint=SAMPLER), MODEL)


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
