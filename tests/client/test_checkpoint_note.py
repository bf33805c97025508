"""TaskInfo.checkpoint_note: which checkpoint download, export, serve, eval and init_from use."""


def test_checkpoint_note_says_which_checkpoint_and_why() -> None:
    from opentinker.common.v1 import common_pb2

    from opentinker_client.types import TaskInfo

    def info(state: str, *, final: bool, error: str = "", step: int = 12) -> TaskInfo:
        proto = common_pb2.Task(latest_checkpoint=common_pb2.Checkpoint(step=step, final=final, path="/ck"))
        return TaskInfo(
            task_id="t",
            state=state,
            attempt=1,
            name="",
            workload_type="lora_finetune",
            model="m",
            gpu_count=0,
            error=error,
            checkpoint_path="/ck",
            checkpoint_step=step,
            proto=proto,
        )

    assert info("succeeded", final=True).checkpoint_note == "final checkpoint, step 12"
    assert info("cancelled", final=False).checkpoint_note == (
        "last complete checkpoint, step 12 (the task ended CANCELLED)"
    )
    timed_out = info("failed", final=False, error="max_runtime of 60 s exceeded")
    assert (
        timed_out.checkpoint_note == "last complete checkpoint, step 12 (the task ended FAILED by TIMEOUT, max_runtime)"
    )
    assert info("running", final=False).checkpoint_note.endswith("(the task is RUNNING)")


def test_without_a_checkpoint_an_ended_task_is_said_to_have_ended_so() -> None:
    from opentinker_client.types import TaskInfo

    def info(state: str, error: str = "") -> TaskInfo:
        return TaskInfo(
            task_id="t", state=state, attempt=1, name="", workload_type="lora_finetune", model="m", gpu_count=0,
            error=error,
        )  # fmt: skip

    assert info("cancelled").without_checkpoint("x") == "task t ended CANCELLED without a checkpoint; x"
    assert info("failed", "max_runtime of 60 s exceeded").without_checkpoint("x") == (
        "task t ended FAILED by TIMEOUT, max_runtime without a checkpoint; x"
    )
    assert info("running").without_checkpoint("x") == "task t is RUNNING and has no checkpoint yet; x"
