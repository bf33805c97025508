"""``opentinker compare``'s table (:func:`compare_rows`) from tasks as the scheduler returns them:
settings compared as resolved (defaults filled in), and each task's usage."""

from __future__ import annotations

from opentinker.common.v1 import common_pb2
from opentinker_client._convert import task_from_proto
from opentinker_client.cli.commands import compare_rows


def _task(task_id: str, hp: dict, *, usage: common_pb2.Usage | None = None):
    spec = common_pb2.TaskSpec(workload_type="lora_finetune", model="org/m", name=task_id)
    spec.hyperparameters.update(hp)
    task = common_pb2.Task(task_id=task_id, spec=spec, state=common_pb2.TASK_STATE_SUCCEEDED, latest_step=4)
    if usage is not None:
        task.usage.CopyFrom(usage)
    return task_from_proto(task)


def test_settings_differ_only_where_the_resolved_values_do() -> None:
    from opentinker_common.spec import spec_from_proto

    default_lr = spec_from_proto(_task("x", {}).proto.spec).hyperparameters.learning_rate
    a = _task("task-a", {"steps": 4})  # learning_rate and lora_rank left at their defaults
    b = _task("task-b", {"steps": 4, "learning_rate": default_lr, "lora_rank": 8})
    _, _, differing = compare_rows([a, b], [[], []], now=0.0)
    # learning_rate is the same once resolved; lora_rank differs, and a's value is its default, not "-"
    assert differing == [("lora_rank", ["16", "8"])]


def test_each_row_has_the_tasks_usage() -> None:
    used = common_pb2.Usage(gpu_seconds=450.4, cpu_task_seconds=0, cost=0.125, attempts=1)
    a, b = _task("task-a", {}, usage=used), _task("task-b", {})
    header, rows, _ = compare_rows([a, b], [[(1, {"reward": 0.5})], []], now=0.0)
    cells = [dict(zip(header, row)) for row in rows]
    assert [(c["GPU-s"], c["CPU-task s"], c["cost"]) for c in cells] == [("450", "0", "0.1250"), ("-", "-", "-")]
    assert (cells[0]["final reward"], cells[1]["final reward"]) == ("0.5", "-")
