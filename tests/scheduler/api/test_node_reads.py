"""Task workers read through NodeService (LookupTask, FetchDataset) with their attempt's
credential, their task owner's tasks and datasets only; a node key reads none; an uploaded dataset
belongs to the owners who uploaded it. Through a real scheduler on loopback, auth on."""

from __future__ import annotations

import hashlib
import json

import grpc
import pytest

from opentinker.common.v1 import common_pb2 as C
from opentinker.node.v1 import node_pb2 as N, node_pb2_grpc
from opentinker.scheduler.v1 import scheduler_pb2 as S, scheduler_pb2_grpc
from opentinker_client import NotFoundError, RLClient

from tests.support.raw_node import RawNode
from tests.support.security import AUTH_LOCAL_MODELS, LoopbackScheduler, metadata
from tests.support.waiting import wait_for

LINE = {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}


@pytest.fixture
def sched(tmp_path):
    with LoopbackScheduler(tmp_path / "state", AUTH_LOCAL_MODELS + "lease: 600\n") as s:
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


def _status(fn) -> grpc.StatusCode:
    try:
        fn()
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK


def test_a_node_key_reads_no_task_and_no_dataset(sched, tmp_path) -> None:
    keys = _keys(sched)
    path, dataset_id = _dataset(tmp_path)
    with RLClient(sched.target, api_key=keys["alice"]) as alice:
        assert alice.upload_dataset(path).dataset_id == dataset_id
        task_id = alice.submit_task(workload_type="lora_finetune", model="/models/m")
    node = metadata(keys["node"])
    with sched.channel() as ch:
        nodes = node_pb2_grpc.NodeServiceStub(ch)
        clients = scheduler_pb2_grpc.SchedulerServiceStub(ch)
        # An existing id and a missing one are refused alike: a node key learns nothing of either.
        refusals = [
            _code(lambda: nodes.LookupTask(N.LookupTaskRequest(task_id=task_id), metadata=node)),
            _code(lambda: nodes.LookupTask(N.LookupTaskRequest(task_id="t-missing"), metadata=node)),
            _code(lambda: list(nodes.FetchDataset(N.FetchDatasetRequest(dataset_id=dataset_id), metadata=node))),
            _code(
                lambda: list(nodes.FetchDataset(N.FetchDatasetRequest(dataset_id="sha256:" + "0" * 64), metadata=node))
            ),
            _code(lambda: clients.GetTask(S.GetTaskRequest(task_id=task_id), metadata=node)),
        ]
        for code, details in refusals:
            assert code == grpc.StatusCode.PERMISSION_DENIED, details
            assert "node keys may open their node's stream (NodeService.Connect) only" in details
            assert "attempt credential" in details and task_id not in details and dataset_id not in details
        # A user key may not use the workers' reads either.
        code, _ = _code(
            lambda: nodes.LookupTask(N.LookupTaskRequest(task_id=task_id), metadata=metadata(keys["alice"]))
        )
        assert code == grpc.StatusCode.PERMISSION_DENIED


def test_a_worker_reads_its_owners_tasks_and_datasets_only_while_its_attempt_runs(sched, tmp_path) -> None:
    keys = _keys(sched)
    path, dataset_id = _dataset(tmp_path)
    (tmp_path / "bob").mkdir()
    theirs_path, theirs_dataset = _dataset(tmp_path / "bob", json.dumps({**LINE, "id": "bob"}) + "\n")
    env = {"env_id": "client", "endpoint": "127.0.0.1:1", "token": "s" * 43, "action_space": 2, "observation_space": 4}
    with RLClient(sched.target, api_key=keys["alice"]) as alice, RLClient(sched.target, api_key=keys["bob"]) as bob:
        alice.upload_dataset(path)
        bob.upload_dataset(theirs_path)
        served = alice.submit_task(workload_type="full_rl", model="mlp", env_config=env)  # queued: no node fits it
        own = alice.submit_task(workload_type="lora_finetune", model="/models/m", gpu_count=0)
        other = bob.submit_task(workload_type="lora_finetune", model="/models/m", gpu_count=0)
    node = RawNode(sched.target, keys["node"], "node-a")
    try:
        worker = node.assignment(own)
        node.assignment(other)  # on the same node: still another owner's
        as_worker = metadata(worker.worker_credential)
        with sched.channel() as ch:
            nodes = node_pb2_grpc.NodeServiceStub(ch)
            # Its own task, and another of its owner (an inference task serves its adapters), whole.
            assert nodes.LookupTask(N.LookupTaskRequest(task_id=own), metadata=as_worker).task.owner == "alice"
            got = nodes.LookupTask(N.LookupTaskRequest(task_id=served), metadata=as_worker).task
            assert got.spec.env_config.fields["token"].string_value == "s" * 43
            chunks = list(nodes.FetchDataset(N.FetchDatasetRequest(dataset_id=dataset_id), metadata=as_worker))
            assert b"".join(c.chunk for c in chunks) == path.read_bytes()
            # Another owner's task and dataset read word for word as missing ones.
            for kind, lookup, present, missing in (
                (
                    "task",
                    lambda i: nodes.LookupTask(N.LookupTaskRequest(task_id=i), metadata=as_worker),
                    other,
                    "t-missing",
                ),
                (
                    "dataset",
                    lambda i: list(nodes.FetchDataset(N.FetchDatasetRequest(dataset_id=i), metadata=as_worker)),
                    theirs_dataset,
                    "sha256:" + "1" * 64,
                ),
            ):
                theirs, absent = _code(lambda: lookup(present)), _code(lambda: lookup(missing))
                assert theirs[0] == absent[0] == grpc.StatusCode.NOT_FOUND, kind
                assert theirs[1].replace(present, "ID") == absent[1].replace(missing, "ID")
            # Bad input: a clear status naming the field.
            code, details = _code(lambda: nodes.LookupTask(N.LookupTaskRequest(task_id=""), metadata=as_worker))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "task_id" in details
            code, _ = _code(
                lambda: list(nodes.FetchDataset(N.FetchDatasetRequest(dataset_id="nope"), metadata=as_worker))
            )
            assert code == grpc.StatusCode.INVALID_ARGUMENT
            # Once its attempt has ended, the credential reads nothing more.
            node.report(worker, C.TASK_STATE_SUCCEEDED)
            wait_for(
                lambda: (
                    _status(lambda: nodes.LookupTask(N.LookupTaskRequest(task_id=own), metadata=as_worker))
                    == grpc.StatusCode.PERMISSION_DENIED
                ),
                60,
                "the ended attempt's credential refused",
            )
    finally:
        node.leave()


def test_a_model_host_tenant_reads_with_its_attempt_credential_not_the_nodes_key(sched, tmp_path, monkeypatch):
    """A model host's tenants share one process whose environment holds no key (the agent hands
    its node's key to no worker): each resolves adapters and fetches datasets with its own
    attempt's credential (``WorkerContext.scheduler_env``), its owner's only."""
    from opentinker_trainer.context import WorkerContext
    from opentinker_trainer.inference.adapters import AdapterNotFound, AdapterRefused
    from opentinker_trainer.inference.resolve import SchedulerResolver
    from opentinker_trainer.scheduler_link import worker_env
    from opentinker_trainer.workloads.sft_data import task_dataset

    keys = _keys(sched)
    path, dataset_id = _dataset(tmp_path)
    with RLClient(sched.target, api_key=keys["alice"]) as alice, RLClient(sched.target, api_key=keys["bob"]) as bob:
        alice.upload_dataset(path)
        own = alice.submit_task(workload_type="lora_finetune", model="/models/m", gpu_count=0)
        other = bob.submit_task(workload_type="lora_finetune", model="/models/m", gpu_count=0)
    monkeypatch.delenv("OPENTINKER_API_KEY", raising=False)
    for name, value in worker_env(sched.target).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("OPENTINKER_DATASET_CACHE", str(tmp_path / "datasets"))
    node = RawNode(sched.target, keys["node"], "node-a")
    try:
        assign = node.assignment(own)
        ctx = WorkerContext(own, assign.attempt, None, "cpu", tmp_path / "ck", credential=assign.worker_credential)  # type: ignore[arg-type]
        resolver = SchedulerResolver(sched.target, "/models/m", env=ctx.scheduler_env())
        try:
            # Its owner's task is read (and refused for what it is: no checkpoint yet) ...
            with pytest.raises(AdapterRefused):
                resolver(own)
            # ... another owner's is no task at all, as a missing id.
            with pytest.raises(AdapterNotFound, match="no task with that id"):
                resolver(other)
        finally:
            resolver.close()
        assert task_dataset(ctx, dataset_id).read_bytes() == path.read_bytes()
        # The node's key reads neither.
        as_node = SchedulerResolver(
            sched.target, "/models/m", env={**worker_env(sched.target), "OPENTINKER_API_KEY": keys["node"]}
        )
        try:
            with pytest.raises(grpc.RpcError) as err:
                as_node(own)
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        finally:
            as_node.close()
    finally:
        node.leave()


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
