"""What ``opentinker serve`` says it serves, named by what the task's checkpoints hold: a PPO
task's policy, a full-weight task's model, a LoRA task's adapter. The tasks are as the scheduler
returns them (``Task`` protos read by the client)."""

from __future__ import annotations

import pytest

from opentinker.common.v1 import common_pb2
from opentinker_client._convert import task_from_proto
from opentinker_client.cli.commands import _serve_next_lines, _served_line


def _task(workload_type: str, fmt: str):
    spec = common_pb2.TaskSpec(workload_type=workload_type, model="org/m")
    ck = common_pb2.Checkpoint(step=20, path="/ck/step_20", format=fmt, final=True)
    task = common_pb2.Task(
        task_id="task-1", spec=spec, state=common_pb2.TASK_STATE_SUCCEEDED, latest_step=20, latest_checkpoint=ck
    )
    return task_from_proto(task)


@pytest.mark.parametrize(
    ("workload_type", "fmt", "what"),
    [("full_rl", "torch_ppo", "policy"), ("sft", "hf_full", "model"), ("lora_finetune", "peft_lora", "adapter")],
)
def test_serve_names_what_the_task_holds(workload_type, fmt, what) -> None:
    line = _served_line(_task(workload_type, fmt), step=0, server="task-inf", endpoint="127.0.0.1:9000")
    assert line == f"{what} task-1 (final checkpoint, step 20) served by inference task task-inf at 127.0.0.1:9000"


def _server(openai_endpoint: str = ""):
    spec = common_pb2.TaskSpec(workload_type="inference", model="org/m")
    task = common_pb2.Task(
        task_id="task-inf", spec=spec, state=common_pb2.TASK_STATE_RUNNING, openai_endpoint=openai_endpoint
    )
    return task_from_proto(task)


def test_serve_names_the_openai_base_url_the_task_shows_and_a_command_that_asks_it() -> None:
    lines = _serve_next_lines(_server("https://node-7:40517/v1"), model="task-1")
    assert lines[0] == "OpenAI API: https://node-7:40517/v1 (model task-1; api_key: opentinker endpoint-token task-inf)"
    assert lines[1].startswith("try: curl https://node-7:40517/v1/chat/completions -H ")
    assert "$(opentinker endpoint-token task-inf)" in lines[1] and '"model": "task-1"' in lines[1]


def test_serve_without_an_openai_endpoint_says_how_to_get_one_and_what_to_try() -> None:
    (line,) = _serve_next_lines(_server(), model="task-1")
    assert "has no OpenAI API (submit one with openai_port" in line
    assert 'RLClient().serve("task-1").generate(' in line
