"""`opentinker download`, `export` and `serve` of a task without a checkpoint, against a real
scheduler (in this process, no trainer): an ended task is said to have ended without one (it never
will have one), not to have "no checkpoint yet"; a waiting one, that it has none yet."""

from __future__ import annotations

import pytest

from opentinker_client import RLClient
from opentinker_client.cli.commands import main
from tests.support.security import LoopbackScheduler


@pytest.fixture(scope="module")
def scheduler(tmp_path_factory):
    with LoopbackScheduler(tmp_path_factory.mktemp("state"), "default_model: /models/m\n") as s:
        yield s


def cli(capsys, scheduler, *args: str) -> tuple[int, str]:
    code = main(["--scheduler-url", scheduler.target, *args])
    return code, capsys.readouterr().err


def test_a_task_that_ended_without_a_checkpoint_is_said_to_have_ended_so(capsys, scheduler, tmp_path) -> None:
    with RLClient(scheduler_url=scheduler.target) as client:
        cancelled = client.submit_task(workload_type="lora_finetune", hyperparameters={"steps": 3})
        waiting = client.submit_task(workload_type="lora_finetune", hyperparameters={"steps": 3})
        client.cancel(cancelled)  # still pending: it ends at once, with no checkpoint
        assert client.get_task(cancelled).state == "cancelled"

    code, err = cli(capsys, scheduler, "download", cancelled, "-o", str(tmp_path / "ck"))
    assert (code, err) == (
        2,
        f"error: task {cancelled} ended CANCELLED without a checkpoint; there is nothing to download "
        "[FAILED_PRECONDITION]\n",
    )
    code, err = cli(capsys, scheduler, "export", cancelled, "--merged", str(tmp_path / "merged"))
    assert code == 2 and f"task {cancelled} ended CANCELLED without a checkpoint; there is nothing to export" in err
    code, err = cli(capsys, scheduler, "serve", cancelled)
    assert code == 2 and f"task {cancelled} ended CANCELLED without a checkpoint; there is no adapter to serve" in err
    code, err = cli(capsys, scheduler, "download", waiting)
    assert code == 2 and f"task {waiting} is PENDING and has no checkpoint yet; there is nothing to download" in err
    assert not (tmp_path / "ck").exists() and not (tmp_path / "merged").exists()
