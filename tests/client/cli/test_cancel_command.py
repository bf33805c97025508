"""`opentinker cancel` with several task ids, against a real scheduler in this process: each is
cancelled in order with a line of its own; one that cannot be (an unknown id, a malformed one) gets
an `error:` line naming it, the others are still cancelled, and the exit code says one failed."""

from __future__ import annotations

import pytest

from opentinker_client import RLClient
from opentinker_client.cli.commands import main
from tests.support.security import LoopbackScheduler


@pytest.fixture(scope="module")
def scheduler(tmp_path_factory):
    with LoopbackScheduler(tmp_path_factory.mktemp("state"), "default_model: /models/m\n") as s:
        yield s


def test_cancel_takes_several_ids_and_goes_on_past_one_that_fails(capsys, scheduler) -> None:
    with RLClient(scheduler_url=scheduler.target) as client:
        a, b = (client.submit_task(workload_type="lora_finetune", hyperparameters={"steps": 3}) for _ in range(2))
        code = main(["--scheduler-url", scheduler.target, "cancel", a, "task-nosuch", b, "--reason", "enough"])
        out, err = capsys.readouterr()
        assert code == 2
        lines = [line for line in out.splitlines() if line.startswith("task ")]  # not the scheduler's logs
        assert lines == [f"task {a} is cancelled", f"task {b} is cancelled"]
        assert err.startswith("error: task-nosuch: ") and "[NOT_FOUND]" in err and err.count("\n") == 1
        assert [client.get_task(t).state for t in (a, b)] == ["cancelled", "cancelled"]


def test_cancel_of_one_id_reports_its_error_as_before(capsys, scheduler) -> None:
    code = main(["--scheduler-url", scheduler.target, "cancel", "task-nosuch"])
    _, err = capsys.readouterr()
    assert (
        code == 2 and err.startswith("error: ") and "task-nosuch" in err and not err.startswith("error: task-nosuch: ")
    )


def test_cancel_of_a_task_that_already_failed_says_so_and_exits_2(capsys, scheduler) -> None:
    with RLClient(scheduler_url=scheduler.target) as client:
        t = client.submit_task(workload_type="lora_finetune", hyperparameters={"steps": 3})
        core = scheduler.core
        scheduler.do(lambda: core.table.fail_or_retry(core.api.get(t), "WORKER_ERROR", "boom", retryable=False))
        assert client.get_task(t).state == "failed"
        code = main(["--scheduler-url", scheduler.target, "cancel", t])
        out, err = capsys.readouterr()
        assert code == 2 and err == f"error: {t} had already failed: nothing to cancel [FAILED_PRECONDITION]\n"
        assert client.get_task(t).state == "failed"  # unchanged


def test_cancel_of_a_task_already_cancelled_is_fine(capsys, scheduler) -> None:
    with RLClient(scheduler_url=scheduler.target) as client:
        t = client.submit_task(workload_type="lora_finetune", hyperparameters={"steps": 3})
        assert main(["--scheduler-url", scheduler.target, "cancel", t]) == 0
        assert main(["--scheduler-url", scheduler.target, "cancel", t]) == 0
        out, _ = capsys.readouterr()
        assert [line for line in out.splitlines() if line.startswith("task ")] == [f"task {t} is cancelled"] * 2
