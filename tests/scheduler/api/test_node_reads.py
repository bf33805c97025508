"""Task workers read through NodeService (LookupTask, FetchDataset) with their node's key, and an
uploaded dataset belongs to the owners who uploaded it; through a real scheduler on loopback."""

from __future__ import annotations

import hashlib
import json

import grpc
import pytest

from opentinker.node.v1 import node_pb2 as N, node_pb2_grpc
from opentinker.scheduler.v1 import scheduler_pb2 as S, scheduler_pb2_grpc
from opentinker_client import NotFoundError, RLClient

from tests.support.security import AUTH_LOCAL_MODELS, LoopbackScheduler, metadata

LINE = {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}


@pytest.fixture
def sched(tmp_path):
    with LoopbackScheduler(tmp_path / "state", AUTH_LOCAL_MODELS) as s:
        yield s


def _keys(s: LoopbackScheduler) -> dict[str, str]:
    admin = s.admin_key
    with RLClient(s.target, api_key=admin) as root:
        out = {"admin": admin}
        for name, role in (("node", "node"), ("alice", "user"), ("bob", "user")):
            out[name] = root.keys.create(name if role == "user" else "rack-1", role)[1]
    return out


def _dataset(tmp_path, text: str = "") -> tuple:
    path = tmp_path / "data.jsonl"
    path.write_text(text or json.dumps(LINE) + "\n")
    return path, "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()


def _code(fn) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        fn()
    return err.value.code(), err.value.details()


def test_node_key_reads_through_node_service_only(sched, tmp_path) -> None:
    keys = _keys(sched)
    path, dataset_id = _dataset(tmp_path)
    with RLClient(sched.target, api_key=keys["alice"]) as alice:
        assert alice.upload_dataset(path).dataset_id == dataset_id
        task_id = alice.submit_task(workload_type="lora_finetune", model="/models/m")
    with sched.channel() as ch:
        nodes = node_pb2_grpc.NodeServiceStub(ch)
        clients = scheduler_pb2_grpc.SchedulerServiceStub(ch)
        # The node role reads any owner's task and dataset through NodeService ...
        got = nodes.LookupTask(N.LookupTaskRequest(task_id=task_id), metadata=metadata(keys["node"])).task
        assert got.task_id == task_id and got.owner == "alice"
        # checkpoints are listed only when asked for (a new task has none)
        asked = nodes.LookupTask(
            N.LookupTaskRequest(task_id=task_id, include_checkpoints=True), metadata=metadata(keys["node"])
        )
        assert asked.task.task_id == task_id and list(asked.checkpoints) == []
        chunks = list(nodes.FetchDataset(N.FetchDatasetRequest(dataset_id=dataset_id), metadata=metadata(keys["node"])))
        assert b"".join(c.chunk for c in chunks) == path.read_bytes() and chunks[0].size_bytes == path.stat().st_size
        # ... and may not call SchedulerService at all (not even its reads).
        for call in (
            lambda: clients.GetTask(S.GetTaskRequest(task_id=task_id), metadata=metadata(keys["node"])),
            lambda: list(
                clients.DownloadDataset(
                    S.DownloadDatasetRequest(dataset_id=dataset_id), metadata=metadata(keys["node"])
                )
            ),
        ):
            code, details = _code(call)
            assert code == grpc.StatusCode.PERMISSION_DENIED and "node keys may call NodeService only" in details
        # A user key may not use the node reads.
        code, _ = _code(
            lambda: nodes.LookupTask(N.LookupTaskRequest(task_id=task_id), metadata=metadata(keys["alice"]))
        )
        assert code == grpc.StatusCode.PERMISSION_DENIED
        # Bad input: clear status, nothing else.
        code, details = _code(
            lambda: nodes.LookupTask(N.LookupTaskRequest(task_id=""), metadata=metadata(keys["node"]))
        )
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "task_id" in details
        code, _ = _code(
            lambda: nodes.LookupTask(N.LookupTaskRequest(task_id="t-missing"), metadata=metadata(keys["node"]))
        )
        assert code == grpc.StatusCode.NOT_FOUND
        code, _ = _code(
            lambda: list(
                nodes.FetchDataset(
                    N.FetchDatasetRequest(dataset_id="sha256:" + "0" * 64), metadata=metadata(keys["node"])
                )
            )
        )
        assert code == grpc.StatusCode.NOT_FOUND
        code, _ = _code(
            lambda: list(nodes.FetchDataset(N.FetchDatasetRequest(dataset_id="nope"), metadata=metadata(keys["node"])))
        )
        assert code == grpc.StatusCode.INVALID_ARGUMENT


def test_a_node_key_reads_a_task_without_its_environments_access_token(sched) -> None:
    keys = _keys(sched)
    env = {"env_id": "client", "endpoint": "127.0.0.1:1", "token": "s" * 43, "action_space": 2, "observation_space": 4}
    with RLClient(sched.target, api_key=keys["alice"]) as alice:
        task_id = alice.submit_task(workload_type="full_rl", model="mlp", env_config=env)
    with sched.channel() as ch:
        nodes = node_pb2_grpc.NodeServiceStub(ch)
        got = nodes.LookupTask(N.LookupTaskRequest(task_id=task_id), metadata=metadata(keys["node"])).task
        assert "token" not in got.spec.env_config.fields and got.spec.env_config.fields["endpoint"].string_value
        admin = nodes.LookupTask(N.LookupTaskRequest(task_id=task_id), metadata=metadata(keys["admin"])).task
        assert admin.spec.env_config.fields["token"].string_value == "s" * 43  # the admin's read is whole


def test_a_dataset_belongs_to_the_owners_who_uploaded_it(sched, tmp_path) -> None:
    keys = _keys(sched)
    path, dataset_id = _dataset(tmp_path)
    missing = "sha256:" + "1" * 64
    sft = dict(workload_type="sft", model="/models/m")
    with RLClient(sched.target, api_key=keys["alice"]) as alice, RLClient(sched.target, api_key=keys["bob"]) as bob:
        alice.upload_dataset(path)
        assert alice.submit_task(env_config={"env_id": "chat_jsonl", "dataset_id": dataset_id}, **sft)
        with sched.channel() as ch:
            stub = scheduler_pb2_grpc.SchedulerServiceStub(ch)
            # Bob cannot download Alice's dataset: the answer is word for word a missing one's.
            theirs = _code(
                lambda: list(
                    stub.DownloadDataset(
                        S.DownloadDatasetRequest(dataset_id=dataset_id), metadata=metadata(keys["bob"])
                    )
                )
            )
            absent = _code(
                lambda: list(
                    stub.DownloadDataset(S.DownloadDatasetRequest(dataset_id=missing), metadata=metadata(keys["bob"]))
                )
            )
            assert theirs[0] == absent[0] == grpc.StatusCode.NOT_FOUND
            assert theirs[1].replace(dataset_id, "ID") == absent[1].replace(missing, "ID")
            # Admins see every dataset.
            data = list(
                stub.DownloadDataset(S.DownloadDatasetRequest(dataset_id=dataset_id), metadata=metadata(keys["admin"]))
            )
            assert b"".join(c.chunk for c in data) == path.read_bytes()
        # Nor train on it ...
        with pytest.raises(NotFoundError, match="spec.env_config.dataset_id: dataset .* not found"):
            bob.submit_task(env_config={"env_id": "chat_jsonl", "dataset_id": dataset_id}, **sft)
        # ... until Bob uploads the same bytes himself (content-addressed: stored once, now his too).
        assert bob.upload_dataset(path).dataset_id == dataset_id
        assert bob.submit_task(env_config={"env_id": "chat_jsonl", "dataset_id": dataset_id}, **sft)
