"""DeleteTaskArtifacts (``opentinker rm``) and checkpoint retention through a real scheduler on
loopback, on both artifact backends (``local`` under the state dir; ``s3`` on a real SeaweedFS):
owner rules as for every call (another owner's task is NOT_FOUND, an admin may), a task that has
not ended or that an unfinished task starts from is refused with FAILED_PRECONDITION, every call
is audited; a deleted task lists no checkpoint, and downloading, starting from (``init_from``) or
serving it (the client's ``serve`` and a server's lookup) are refused naming the deletion;
retention keeps the newest ``keep_checkpoints`` plus the final one."""

from __future__ import annotations

import asyncio
import json
import re
import uuid

import pytest

from opentinker_client import RLClient
from opentinker_client.cli.commands import main as cli_main
from opentinker_client.errors import FailedPreconditionError, NotFoundError
from opentinker_common.artifacts import LocalArtifactStore, S3ArtifactStore, S3Location
from opentinker_scheduler.config.artifacts import ArtifactsConfig
from opentinker_scheduler.data.artifact_store import Artifacts, Retention
from opentinker_trainer.inference.adapters import AdapterNotFound
from opentinker_trainer.inference.resolve import SchedulerResolver

from tests.support.raw_node import RawNode
from tests.support.security import LoopbackScheduler

MODEL = "HuggingFaceTB/SmolLM2-135M"


def _adapter(folder):
    """A PEFT-shaped LoRA adapter folder (two tiny tensors), as ImportAdapter accepts it."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4}))
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    save_file(
        {f"{prefix}.lora_A.weight": torch.zeros(2, 8), f"{prefix}.lora_B.weight": torch.zeros(8, 2)},
        folder / "adapter_model.safetensors",
    )
    return folder


def _list_checkpoints(target: str, key: str, task_id: str):
    """The raw ListCheckpointsResponse (``artifacts_deleted`` is not in the client's list)."""
    import grpc

    from opentinker.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc

    with grpc.insecure_channel(target) as ch:
        return scheduler_pb2_grpc.SchedulerServiceStub(ch).ListCheckpoints(
            scheduler_pb2.ListCheckpointsRequest(task_id=task_id), metadata=(("authorization", f"Bearer {key}"),)
        )


def _config(backend: str, request, monkeypatch) -> str:
    if backend == "local":
        return "auth: {enabled: true}\n"
    s3 = request.getfixturevalue("seaweedfs")
    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    prefix = f"rm-{uuid.uuid4().hex[:8]}/"
    return (
        "auth: {enabled: true}\n"
        f"artifacts: {{backend: s3, s3: {{endpoint: '{s3.endpoint}', bucket: {s3.bucket}, prefix: '{prefix}'}}}}\n"
    )


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_owners_delete_their_finished_tasks_artifacts(backend, tmp_path, request, monkeypatch, capsys) -> None:
    with LoopbackScheduler(tmp_path / "state", _config(backend, request, monkeypatch)) as s:
        with RLClient(s.target, api_key=s.admin_key) as root:
            alice_key = root.keys.create("alice", "user")[1]
            bob_key = root.keys.create("bob", "user")[1]
            node_key = root.keys.create("node-a", "node")[1]
        store = s.running.artifacts.store
        with RLClient(s.target, api_key=alice_key) as alice, RLClient(s.target, api_key=bob_key) as bob:
            mine = alice.upload_adapter(_adapter(tmp_path / "a1"), model=MODEL).task_id
            theirs = bob.upload_adapter(_adapter(tmp_path / "b1"), model=MODEL).task_id
            assert store.list(f"tasks/{mine}/") == [f"tasks/{mine}/a1/final_0"]
            with pytest.raises(NotFoundError):
                alice.delete_artifacts(theirs)  # another owner's: not confirmed to exist
            assert store.list(f"tasks/{theirs}/")  # untouched
            # an unfinished task that starts from it keeps it
            warm = alice.submit_task(
                workload_type="lora_finetune", model=MODEL, init_from=mine, hyperparameters={"steps": 1}
            )
            with pytest.raises(FailedPreconditionError, match="init_from of unfinished task"):
                alice.delete_artifacts(mine)
            with pytest.raises(FailedPreconditionError, match="has ended"):
                alice.delete_artifacts(warm)  # pending: not ended
            alice.cancel(warm)
            assert [c.step for c in alice.list_checkpoints(mine)] == [0]
            task, keys, size = alice.delete_artifacts(mine)
            assert keys == [f"tasks/{mine}/a1/final_0"] and size > 0 and task.checkpoint_path == ""
            assert store.list(f"tasks/{mine}/") == []
            # listed no more; the deletion itself is on record (ListCheckpoints, the event log)
            assert alice.list_checkpoints(mine) == []
            listed = _list_checkpoints(s.target, alice_key, mine)
            gone = listed.artifacts_deleted.artifacts_deleted
            assert (gone.deleted_keys, gone.deleted_bytes, gone.deleted_by) == (1, size, "alice")
            assert [e.kind for e in alice.watch(mine)][-1] == "artifacts_deleted"
            deleted = r"has no checkpoint.*: its artifacts were deleted at 20\d\d-.* UTC by alice \(DeleteTaskArtifacts"
            with pytest.raises(NotFoundError, match=deleted):
                alice.download_checkpoint(mine, tmp_path / "gone")
            with pytest.raises(FailedPreconditionError, match=rf"spec.init_from: task {mine} \(SUCCEEDED\) {deleted}"):
                alice.submit_task(workload_type="lora_finetune", model=MODEL, init_from=mine)
            with pytest.raises(FailedPreconditionError, match=rf"{deleted}.*there is no adapter to serve"):
                alice.serve(mine)
            # the CLI's download and eval say the same, not "ended SUCCEEDED without a checkpoint"
            capsys.readouterr()
            for argv in (["download", mine, "-o", str(tmp_path / "dl")], ["eval", mine]):
                assert cli_main(["--scheduler-url", s.target, "--api-key", alice_key, *argv]) != 0
                err = capsys.readouterr().err
                assert re.search(deleted, err) and "without a checkpoint" not in err, (argv, err)
            # a running server asked for it (LookupTask, with its attempt's credential) says so too
            node = RawNode(s.target, node_key, "node-a")
            try:
                server = alice.submit_task(workload_type="lora_finetune", model=MODEL, gpu_count=0)
                credential = node.assignment(server).worker_credential
                resolver = SchedulerResolver(s.target, MODEL, env={"OPENTINKER_API_KEY": credential})
                try:
                    with pytest.raises(AdapterNotFound, match=rf"adapter '{mine}': task {deleted}"):
                        resolver(mine)
                finally:
                    resolver.close()
            finally:
                node.leave()
            assert alice.delete_artifacts(mine)[1:] == ([], 0)  # idempotent
            assert [e.kind for e in alice.watch(mine)].count("artifacts_deleted") == 1  # recorded once
        # `opentinker rm`, with an admin key: another owner's task is theirs to delete too
        assert cli_main(["--scheduler-url", s.target, "--api-key", s.admin_key, "rm", theirs]) == 0
        assert f"task {theirs}: deleted 1 artifact(s)" in capsys.readouterr().out
        assert store.list(f"tasks/{theirs}/") == []
        assert cli_main(["--scheduler-url", s.target, "--api-key", alice_key, "rm", warm]) == 0  # nothing left
        with RLClient(s.target, api_key=s.admin_key) as root:
            records = root.keys.audit(action="task.delete_artifacts")
        outcomes = sorted((r.owner, r.task_id == theirs, r.outcome) for r in records)
        assert ("alice", True, "NOT_FOUND") in outcomes and ("alice", False, "FAILED_PRECONDITION") in outcomes
        assert ("alice", False, "OK") in outcomes and any(r.role == "admin" and r.outcome == "OK" for r in records)


def _stores(backend, tmp_path, request, monkeypatch):
    if backend == "local":
        return LocalArtifactStore(tmp_path / "artifacts")
    s3 = request.getfixturevalue("seaweedfs")
    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    return S3ArtifactStore(S3Location(bucket=s3.bucket, endpoint=s3.endpoint, prefix=f"ret-{uuid.uuid4().hex[:8]}"))


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_retention_keeps_the_newest_n_plus_the_final_one(backend, tmp_path, request, monkeypatch) -> None:
    store = _stores(backend, tmp_path, request, monkeypatch)
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "adapter_model.safetensors").write_bytes(b"w" * 100)
    recorded: list[tuple[str, list[str]]] = []
    retention = Retention(
        Artifacts(store, ArtifactsConfig(keep_checkpoints=2)), on_retired=lambda t, keys: recorded.append((t, keys))
    )

    async def report_each() -> None:
        # attempt 2 resumed from step 4 of attempt 1, so its step 5 is newer than attempt 1's step 6
        for key in ("a1/step_2", "a1/step_4", "a1/step_6", "a2/step_5", "a2/step_7", "a2/final_8"):
            store.put_folder(f"tasks/t1/{key}", tmp_path / "ck")
            retention("t1")
            await retention.drain()

    store.put_folder("tasks/t2/a1/step_1", tmp_path / "ck")  # another task's: not this one's retention
    asyncio.run(report_each())
    assert store.list("tasks/") == [
        "tasks/t1/a2/final_8",
        "tasks/t1/a2/step_5",
        "tasks/t1/a2/step_7",
        "tasks/t2/a1/step_1",
    ]
    assert retention.retired == 3
    # each run's deletions are handed on (the core records them: ListCheckpoints leaves them out)
    assert recorded == [("t1", ["tasks/t1/a1/step_2"]), ("t1", ["tasks/t1/a1/step_4"]), ("t1", ["tasks/t1/a1/step_6"])]


def test_owners_delete_one_checkpoint(tmp_path) -> None:
    import grpc

    from opentinker.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc

    with LoopbackScheduler(tmp_path / "state", "auth: {enabled: true}\n") as s:
        with RLClient(s.target, api_key=s.admin_key) as root:
            alice_key = root.keys.create("alice", "user")[1]
            bob_key = root.keys.create("bob", "user")[1]
        store = s.running.artifacts.store
        with RLClient(s.target, api_key=alice_key) as alice:
            mine = alice.upload_adapter(_adapter(tmp_path / "a1"), model=MODEL).task_id
        key = f"tasks/{mine}/a1/final_0"
        with grpc.insecure_channel(s.target) as ch:
            stub = scheduler_pb2_grpc.SchedulerServiceStub(ch)

            def delete(api_key: str, artifact_key: str):
                request = scheduler_pb2.DeleteCheckpointRequest(task_id=mine, artifact_key=artifact_key)
                return stub.DeleteCheckpoint(request, metadata=(("authorization", f"Bearer {api_key}"),))

            with pytest.raises(grpc.RpcError) as refused:
                delete(bob_key, key)  # another owner's: not confirmed to exist
            assert refused.value.code() == grpc.StatusCode.NOT_FOUND and store.list(f"tasks/{mine}/") == [key]
            with pytest.raises(grpc.RpcError) as refused:
                delete(alice_key, "")
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "artifact_key" in refused.value.details()
            assert delete(alice_key, key).deleted_bytes > 0
            assert store.list(f"tasks/{mine}/") == []
            listed = _list_checkpoints(s.target, alice_key, mine)
            assert (list(listed.checkpoints), list(listed.deleted_keys)) == ([], [key])
            assert not listed.HasField("artifacts_deleted")  # the task's other artifacts were not all deleted
            with RLClient(s.target, api_key=alice_key) as alice:
                assert alice.get_task(mine).checkpoint_path == ""  # it was the latest: none is left
            with pytest.raises(grpc.RpcError) as refused:
                delete(alice_key, key)  # a second time: no such checkpoint
            assert (
                refused.value.code() == grpc.StatusCode.NOT_FOUND
                and "deleted, or never saved" in refused.value.details()
            )
        with RLClient(s.target, api_key=s.admin_key) as root:
            outcomes = sorted((r.owner, r.outcome) for r in root.keys.audit(action="checkpoint.delete"))
        assert outcomes == [
            ("alice", "INVALID_ARGUMENT"),
            ("alice", "NOT_FOUND"),
            ("alice", "OK"),
            ("bob", "NOT_FOUND"),
        ]


def test_an_expired_checkpoint_is_deleted(tmp_path) -> None:
    import grpc

    from opentinker.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
    from tests.support.waiting import wait_for

    with LoopbackScheduler(tmp_path / "state", "auth: {enabled: true}\n") as s:
        with RLClient(s.target, api_key=s.admin_key) as root:
            alice_key = root.keys.create("alice", "user")[1]
            bob_key = root.keys.create("bob", "user")[1]
        store = s.running.artifacts.store
        with RLClient(s.target, api_key=alice_key) as alice:
            mine = alice.upload_adapter(_adapter(tmp_path / "a1"), model=MODEL).task_id
        key = f"tasks/{mine}/a1/final_0"
        with grpc.insecure_channel(s.target) as ch:
            stub = scheduler_pb2_grpc.SchedulerServiceStub(ch)

            def set_ttl(api_key: str, seconds: float | None):
                request = scheduler_pb2.SetCheckpointTtlRequest(task_id=mine, artifact_key=key)
                if seconds is not None:
                    request.ttl.FromNanoseconds(int(seconds * 1e9))
                return stub.SetCheckpointTtl(request, metadata=(("authorization", f"Bearer {api_key}"),))

            for who, seconds, code in ((bob_key, 1, "NOT_FOUND"), (alice_key, 0.5, "INVALID_ARGUMENT")):
                with pytest.raises(grpc.RpcError) as refused:
                    set_ttl(who, seconds)
                assert refused.value.code().name == code
            expire = set_ttl(alice_key, 3600).expire_time
            [listed] = _list_checkpoints(s.target, alice_key, mine).checkpoints
            assert listed.expire_time == expire
            assert not set_ttl(alice_key, None).HasField("expire_time")  # cleared: never expires
            assert not _list_checkpoints(s.target, alice_key, mine).checkpoints[0].HasField("expire_time")
            set_ttl(alice_key, 1)
            wait_for(lambda: store.list(f"tasks/{mine}/") == [], what="the checkpoint deleted once its TTL passed")
            listed = _list_checkpoints(s.target, alice_key, mine)
            assert (list(listed.checkpoints), list(listed.deleted_keys)) == ([], [key])
            with RLClient(s.target, api_key=alice_key) as alice:
                kinds = [(e.kind, e.message) for e in alice.watch(mine)]
            assert [k for k, _ in kinds][-2:] == ["checkpoint_expiry", "artifacts_deleted"]
            assert kinds[-1][1].endswith(f"by ttl: {key}")
