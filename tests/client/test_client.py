"""RLClient against an in-process TEST DOUBLE of the scheduler (tests/support/fake_scheduler.py)."""

import math
import threading
import time

import grpc
import pytest

import opentinker_client as ot
from opentinker_client import Environment, RLClient
from opentinker_client._convert import struct_to_dict

from tests.support.fake_scheduler import S, finished_task


@pytest.fixture
def client(fake):
    _, server = fake
    c = RLClient(scheduler_url=server.url, timeout=5.0, api_key="", min_poll_interval=0)
    c.reconnect_backoff = (0.01, 0.05)
    yield c
    c.close()


def test_seed_flow(fake):
    servicer, server = fake
    env = Environment(action_space=4, observation_space=100)
    client = RLClient(scheduler_url=server.url, min_poll_interval=0)
    task_id = client.submit_task(env_config=env.to_dict(), workload_type="lora_finetune", gpu_count=1)
    assert task_id == "task-0001"
    (req,) = servicer.submits
    assert req.spec.workload_type == "lora_finetune"
    assert req.spec.model == ""  # the scheduler fills in its default
    assert req.spec.resources.gpu_count == 1
    assert struct_to_dict(req.spec.env_config) == {"env_id": "arithmetic", "action_space": 4, "observation_space": 100}
    assert len(req.request_id) >= 16  # always idempotent, so gRPC may retry it
    assert not client.is_task_complete(task_id)
    metrics = client.get_metrics(task_id)
    assert math.isnan(metrics["loss"]) and math.isnan(metrics["reward"]) and metrics["step"] == 0
    line = f"Loss: {metrics['loss']:.4f}, Reward: {metrics['reward']:.2f}"
    assert line == "Loss: nan, Reward: nan"
    servicer.add_state(task_id, S.TASK_STATE_RUNNING, reason="STARTED")
    servicer.add_metric(task_id, 1, 0.75, 0.5)
    metrics = client.get_metrics(task_id)
    assert metrics == {"loss": 0.75, "reward": 0.5, "step": 1}
    servicer.add_state(task_id, S.TASK_STATE_SUCCEEDED, reason="COMPLETED")
    assert client.is_task_complete(task_id)
    client.close()


def test_positional_env_and_environment_object(client, fake):
    servicer, _ = fake
    client.submit_task({"env_id": "arithmetic", "max_digits": 2}, workload_type="lora_finetune")
    client.submit_task(
        Environment(max_digits=3),
        workload_type="lora_finetune",
        hyperparameters={"steps": 2},
        priority=9,
        max_runtime=90,
        name="n",
        model="m",
        max_attempts=2,
    )
    first, second = servicer.submits
    assert struct_to_dict(first.spec.env_config) == {"env_id": "arithmetic", "max_digits": 2}
    assert struct_to_dict(second.spec.hyperparameters) == {"steps": 2}
    assert (second.spec.priority, second.spec.name, second.spec.model, second.spec.limits.max_attempts) == (
        9,
        "n",
        "m",
        2,
    )
    assert second.spec.limits.max_runtime.seconds == 90


def test_api_key_metadata(fake):
    servicer, server = fake
    with RLClient(server.url, api_key="s3cret") as c:
        c.list_tasks()
    assert servicer.metadata[-1]["authorization"] == "Bearer s3cret"
    with RLClient(server.url, api_key="") as c:
        c.list_tasks()
    assert "authorization" not in servicer.metadata[-1]


def test_api_key_from_environment(fake, monkeypatch):
    servicer, server = fake
    monkeypatch.setenv("OPENTINKER_API_KEY", "from-env")
    with RLClient(server.url) as c:
        c.list_nodes()
    assert servicer.metadata[-1]["authorization"] == "Bearer from-env"


def test_scheduler_url_from_environment(monkeypatch):
    monkeypatch.setenv("SCHEDULER_URL", "http://example-host:9999")
    with RLClient() as c:
        assert c.target == "example-host:9999"
    monkeypatch.delenv("SCHEDULER_URL")
    with RLClient() as c:
        assert c.target == "localhost:8888"
    with RLClient("https://example-host:9999") as c:  # TLS with the system roots; connects lazily
        assert c.target == "example-host:9999"


def test_local_validation_sends_nothing(client, fake):
    servicer, _ = fake
    with pytest.raises(ot.InvalidArgumentError) as exc:
        client.submit_task(workload_type="lora_finetune", hyperparameters={"lr": 1e-4})
    assert exc.value.field == "spec.hyperparameters.lr"
    with pytest.raises(ot.InvalidArgumentError) as exc:
        client.submit_task(workload_type="lora_finetun")
    assert exc.value.field == "spec.workload_type"
    assert str(exc.value).startswith("INVALID_ARGUMENT: spec.workload_type: expected one of lora_finetune")
    with pytest.raises(ot.InvalidArgumentError):
        client.submit_task(env_config={"max_digits": 99}, workload_type="lora_finetune")
    with pytest.raises(ot.InvalidArgumentError):
        client.submit_task(env_config="arithmetic", workload_type="lora_finetune")  # type: ignore[arg-type]
    assert servicer.submits == []


def test_server_errors_are_typed(client):
    with pytest.raises(ot.FailedPreconditionError) as exc:
        client.submit_task(workload_type="lora_finetune", gpu_count=9)
    assert exc.value.code is grpc.StatusCode.FAILED_PRECONDITION
    assert "largest has 8" in exc.value.details
    with pytest.raises(ot.NotFoundError):
        client.get_task("missing")
    with pytest.raises(ot.NotFoundError):
        client.get_metrics("missing")
    with pytest.raises(ot.NotFoundError):
        client.cancel("missing")
    with pytest.raises(ot.InvalidArgumentError):
        client.get_task("")


def test_rich_status_details(client):
    with pytest.raises(ot.InvalidArgumentError) as exc:
        client.submit_task(workload_type="lora_finetune", name="rich-error")
    assert exc.value.field == "spec.name"
    assert exc.value.status is not None and exc.value.status.message == "spec.name: reserved"
    assert str(exc.value) == "INVALID_ARGUMENT: spec.name: reserved"


def test_idempotent_submit(client, fake):
    a = client.submit_task(workload_type="lora_finetune", request_id="req-1")
    b = client.submit_task(workload_type="lora_finetune", request_id="req-1")
    assert a == b


def test_submit_config(client, fake, tmp_path):
    servicer, _ = fake
    path = tmp_path / "t.yaml"
    path.write_text("workload_type: lora_finetune\nname: from-yaml\nhyperparameters: {steps: 3}\n")
    task_id = client.submit_config(path)
    assert client.get_task(task_id).name == "from-yaml"
    task_id = client.submit_config(ot.load_task_config(path))
    assert servicer.submits[-1].spec.name == "from-yaml"
    path.write_text("workload_type: lora_finetune\nbogus: 1\n")
    with pytest.raises(ot.ConfigError, match="t.yaml:2:1: bogus"):
        client.submit_config(str(path))


def test_get_and_list(client, fake):
    servicer, _ = fake
    servicer.max_page_size = 2
    ids = [
        servicer.add_task(state).task_id
        for state in (
            S.TASK_STATE_PENDING,
            S.TASK_STATE_RUNNING,
            S.TASK_STATE_RUNNING,
            S.TASK_STATE_FAILED,
            S.TASK_STATE_SUCCEEDED,
        )
    ]
    info = client.get_task(ids[0])
    assert isinstance(info, ot.TaskInfo) and info.state == "pending"
    everything = client.list_tasks(limit=None)
    assert [t.task_id for t in everything] == ids[::-1]  # newest first, across 3 pages
    assert len(client.list_tasks(limit=3)) == 3
    running = client.list_tasks(states="running")
    assert {t.task_id for t in running} == set(ids[1:3])
    ended = client.list_tasks(states=["failed", "succeeded"])
    assert {t.state for t in ended} == {"failed", "succeeded"}
    with pytest.raises(ot.InvalidArgumentError, match="unknown task state"):
        client.list_tasks(states=["runing"])
    with pytest.raises(ot.InvalidArgumentError):
        client.list_tasks(limit=0)


@pytest.mark.parametrize(
    "state, done",
    [
        (S.TASK_STATE_PENDING, False),
        (S.TASK_STATE_ASSIGNED, False),
        (S.TASK_STATE_RUNNING, False),
        (S.TASK_STATE_SUCCEEDED, True),
        (S.TASK_STATE_FAILED, True),
        (S.TASK_STATE_CANCELLED, True),
    ],
)
def test_is_task_complete(client, fake, state, done):
    servicer, _ = fake
    assert client.is_task_complete(servicer.add_task(state).task_id) is done


def test_is_task_complete_is_paced(fake):
    servicer, server = fake
    task_id = servicer.add_task(S.TASK_STATE_RUNNING).task_id
    with RLClient(server.url, min_poll_interval=0.2) as c:
        start = time.monotonic()
        for _ in range(3):
            c.is_task_complete(task_id)
        assert time.monotonic() - start >= 0.38
        other = servicer.add_task(S.TASK_STATE_RUNNING).task_id
        start = time.monotonic()
        c.is_task_complete(other)  # a different task is not held back
        assert time.monotonic() - start < 0.15


def test_metric_history_pages(client, fake):
    servicer, _ = fake
    task_id = servicer.add_task(S.TASK_STATE_RUNNING).task_id
    assert client.get_metric_history(task_id) == []
    for step in range(1, 6):
        servicer.add_metric(task_id, step, 1.0 / step, step / 10)
    history = client.get_metric_history(task_id)
    assert [s for s, _ in history] == [1, 2, 3, 4, 5]
    assert history[1] == (2, {"loss": 0.5, "reward": 0.2})
    assert [s for s, _ in client.get_metric_history(task_id, after_step=3)] == [4, 5]


def test_watch_replays_and_ends(client, fake):
    servicer, _ = fake
    task_id = finished_task(servicer)
    events = list(client.watch(task_id))
    assert [e.sequence for e in events] == list(range(1, 8))
    assert [e.kind for e in events] == ["state", "state", "metric", "metric", "metric", "checkpoint", "state"]
    assert events[-1].is_terminal and events[-1].to_state == "succeeded"
    assert events[2].metrics == {"loss": 1.0, "reward": 0.1}
    assert [e.sequence for e in client.watch(task_id, after_sequence=5)] == [6, 7]
    assert list(client.watch(task_id, after_sequence=7)) == []  # already ended: returns at once


def test_watch_resumes_after_unavailable_without_duplicates(client, fake):
    servicer, _ = fake
    task_id = finished_task(servicer)
    servicer.watch_fail_after = [2, 2, 0]  # three dropped connections (the 2nd after a resent duplicate)
    servicer.watch_overlap = True  # and the server resends the last event it sent
    events = list(client.watch(task_id))
    assert [e.sequence for e in events] == list(range(1, 8))
    assert servicer.watch_requests == [0, 2, 3, 3]


def test_watch_survives_a_scheduler_restart(client, fake):
    servicer, server = fake
    task_id = servicer.add_task(S.TASK_STATE_RUNNING).task_id
    servicer.add_metric(task_id, 1, 1.0, 0.1)
    seen = []

    def script():
        time.sleep(0.3)
        server.stop()  # live stream dropped: UNAVAILABLE
        servicer.add_metric(task_id, 2, 0.5, 0.2)  # happens while the scheduler is down
        time.sleep(0.3)
        server.start()  # same port
        time.sleep(0.2)
        servicer.add_metric(task_id, 3, 0.3, 0.3)
        servicer.add_state(task_id, S.TASK_STATE_SUCCEEDED, reason="COMPLETED")

    t = threading.Thread(target=script)
    t.start()
    for event in client.watch(task_id):
        seen.append(event.sequence)
    t.join()
    assert seen == [1, 2, 3, 4]


def test_watch_gives_up_after_reconnect_timeout(client, fake):
    servicer, server = fake
    task_id = servicer.add_task(S.TASK_STATE_RUNNING).task_id
    servicer.add_metric(task_id, 1, 1.0, 0.1)
    it = client.watch(task_id, reconnect_timeout=0.3)
    assert next(it).sequence == 1
    server.stop()
    start = time.monotonic()
    with pytest.raises(ot.UnavailableError, match="could not reconnect"):
        next(it)
    assert time.monotonic() - start < 10


def test_watch_errors_and_close(client, fake):
    servicer, _ = fake
    with pytest.raises(ot.NotFoundError):
        list(client.watch("missing"))
    task_id = servicer.add_task(S.TASK_STATE_RUNNING).task_id
    servicer.add_metric(task_id, 1, 1.0, 0.1)
    for event in client.watch(task_id):  # breaking out cancels the stream
        break
    assert event.sequence == 1


def test_wait(client, fake):
    servicer, _ = fake
    ok = finished_task(servicer)
    info = client.wait(ok, poll_interval=0.01)
    assert info.state == "succeeded" and info.checkpoint_path == "/ckpt/final"
    bad = finished_task(servicer, final=S.TASK_STATE_FAILED)
    with pytest.raises(ot.TaskFailedError) as exc:
        client.wait(bad, poll_interval=0.01)
    assert exc.value.task.state == "failed" and exc.value.task.error == "boom"
    running = servicer.add_task(S.TASK_STATE_RUNNING).task_id
    start = time.monotonic()
    with pytest.raises(ot.DeadlineExceededError, match="did not end within 0.2 s"):
        client.wait(running, timeout=0.2, poll_interval=0.05)
    assert time.monotonic() - start < 2
    with pytest.raises(TimeoutError):
        client.wait(running, timeout=0.05, poll_interval=0.01)


def test_wait_sees_a_task_end_later(client, fake):
    servicer, _ = fake
    task_id = servicer.add_task(S.TASK_STATE_RUNNING).task_id
    threading.Timer(0.2, servicer.add_state, (task_id, S.TASK_STATE_CANCELLED)).start()
    with pytest.raises(ot.TaskFailedError, match="CANCELLED"):
        client.wait(task_id, poll_interval=0.02, timeout=5)


def test_cancel(client, fake):
    servicer, _ = fake
    task_id = servicer.add_task(S.TASK_STATE_RUNNING).task_id
    info = client.cancel(task_id, reason="enough")
    assert info.state == "cancelled" and "enough" in info.error
    assert client.cancel(task_id).state == "cancelled"  # idempotent


def test_list_nodes(client, fake):
    from opentinker.common.v1 import common_pb2
    from opentinker.scheduler.v1 import scheduler_pb2

    servicer, _ = fake
    servicer.nodes = [
        scheduler_pb2.Node(node_id="n1", connected=True, gpu_count=1, devices=[common_pb2.Device(index=0, name="GPU")])
    ]
    (node,) = client.list_nodes()
    assert isinstance(node, ot.NodeInfo) and node.node_id == "n1" and node.devices[0].name == "GPU"


def test_unreachable_scheduler_is_unavailable():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with RLClient(f"127.0.0.1:{port}", timeout=15) as c:
        with pytest.raises(ot.UnavailableError) as exc:
            c.get_task("t")
    assert exc.value.code is grpc.StatusCode.UNAVAILABLE


def test_closed_client(fake):
    _, server = fake
    c = RLClient(server.url)
    c.close()
    c.close()
    with pytest.raises(ot.OpenTinkerError, match="closed"):
        c.get_task("t")


def test_upload_dataset_refuses_a_folder_before_any_call(tmp_path) -> None:
    with RLClient("127.0.0.1:1", min_poll_interval=0) as client:  # refused before any call
        with pytest.raises(IsADirectoryError, match="is a folder"):
            client.upload_dataset(tmp_path)


@pytest.mark.parametrize("step", [-1, 1.5, True, "2"])
def test_serve_refuses_a_bad_step_before_any_call(client, fake, step):
    servicer, _ = fake
    with pytest.raises(ot.InvalidArgumentError) as exc:
        client.serve("task-0001", step=step)
    assert exc.value.field == "step" and "expected 0 (the newest) or a step >= 1" in str(exc.value)
    assert servicer.submits == []
