"""ArtifactService through a real scheduler on loopback with authentication on: task workers'
uploads and downloads of the ``local`` store with their attempt's credential (RemoteArtifactStore),
resumable, hash-checked; writes only under the worker's own attempt while it is current; committed
artifacts immutable for everyone."""

from __future__ import annotations

import hashlib
import os
import threading

import grpc
import pytest

from opentinker.artifact.v1 import artifact_pb2 as A, artifact_pb2_grpc
from opentinker.common.v1 import common_pb2 as C
from opentinker.node.v1 import node_pb2 as N, node_pb2_grpc
from opentinker_client import RLClient
from opentinker_common.artifacts import (
    ArtifactCorrupt,
    ArtifactExists,
    ArtifactNotFound,
    FileEntry,
    Manifest,
    StoreAuthError,
)
from opentinker_common.artifacts.remote import RemoteArtifactStore, manifest_to_proto

from tests.support.raw_node import RawNode
from tests.support.security import AUTH_LOCAL_MODELS, LoopbackScheduler, metadata
from tests.support.waiting import wait_for


@pytest.fixture
def sched(tmp_path):
    with LoopbackScheduler(tmp_path / "state", AUTH_LOCAL_MODELS + "lease: 600\n") as s:
        with RLClient(s.target, api_key=s.admin_key) as root:
            s.node_key = root.keys.create("rack-1", "node")[1]
            s.user_key = root.keys.create("alice", "user")[1]
            s.bob_key = root.keys.create("bob", "user")[1]
        node = RawNode(s.target, s.node_key, "node-a")
        s.worker = {}
        for who, key in (("alice", s.user_key), ("bob", s.bob_key)):
            with RLClient(s.target, api_key=key) as user:
                task_id = user.submit_task(workload_type="lora_finetune", model="/models/m", gpu_count=0)
            s.worker[who] = node.assignment(task_id)
        s.node = node
        yield s
        node.leave()


def _prefix(assign: N.AssignTask) -> str:
    return f"tasks/{assign.task_id}/a{assign.attempt}/"


def _md(assign: N.AssignTask):
    return metadata(assign.worker_credential)


def _folder(path, files):
    path.mkdir()
    for name, data in files.items():
        (path / name).write_bytes(data)
    return path


def test_put_and_get_through_the_scheduler(sched, tmp_path):
    files = {"adapter_model.safetensors": os.urandom(2_500_000), "adapter_config.json": b"{}", "empty": b""}
    with sched.channel() as ch:
        alice = sched.worker["alice"]
        store = RemoteArtifactStore(ch, _md(alice), target=sched.target)
        assert store.describe_store().backend == "local"
        ref = store.put_folder(
            _prefix(alice) + "step_10", _folder(tmp_path / "src", files), meta={"format": "peft_lora"}
        )
        assert store.list(f"tasks/{alice.task_id}/") == [ref.key]
        assert store.manifest(ref.key).meta == {"format": "peft_lora"}
        store.get_folder(ref.key, tmp_path / "out", expect_sha256=ref.manifest_sha256)
        assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == files
        # a put of the same content again sends nothing (the scheduler says it is committed)
        assert store.put_folder(ref.key, tmp_path / "src", meta={"format": "peft_lora"}) == ref
        with pytest.raises(ArtifactNotFound, match="step_99"):
            store.get_folder(_prefix(alice) + "step_99", tmp_path / "none")
        with pytest.raises(ArtifactCorrupt, match="manifest hash"):
            store.manifest(ref.key, expect_sha256="0" * 64)
    # it is on the scheduler's disk, under the state dir
    assert (sched.config.state_dir / "artifacts" / ref.key / ".manifest.json").exists()


def test_an_interrupted_upload_resumes_from_the_held_bytes(sched, tmp_path):
    data = os.urandom(3 * 1024 * 1024 + 5)
    src = _folder(tmp_path / "src", {"w.bin": data})
    alice = sched.worker["alice"]
    m = Manifest(_prefix(alice) + "step_5", (FileEntry("w.bin", len(data), hashlib.sha256(data).hexdigest()),))
    with sched.channel() as ch:
        stub = artifact_pb2_grpc.ArtifactServiceStub(ch)
        md = _md(alice)
        begun = stub.BeginUpload(A.BeginUploadRequest(manifest=manifest_to_proto(m)), metadata=md)
        one_mib = 1024 * 1024
        stub.UploadChunks(
            iter([A.UploadChunksRequest(upload_id=begun.upload_id, file_index=0, offset=0, data=data[:one_mib])]),
            metadata=md,
        )
        # a chunk at the wrong offset: FAILED_PRECONDITION saying where to continue
        with pytest.raises(grpc.RpcError) as err:
            stub.UploadChunks(
                iter([A.UploadChunksRequest(upload_id=begun.upload_id, file_index=0, offset=0, data=b"x")]),
                metadata=md,
            )
        assert (
            err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and f"continue at {one_mib}" in err.value.details()
        )
        # commit before the end: FAILED_PRECONDITION, nothing visible
        with pytest.raises(grpc.RpcError) as err:
            stub.CommitUpload(A.CommitUploadRequest(upload_id=begun.upload_id), metadata=md)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "w.bin holds" in err.value.details()
        again = stub.BeginUpload(A.BeginUploadRequest(manifest=manifest_to_proto(m)), metadata=md)
        assert list(again.received_bytes) == [one_mib]
        # the trainer's store continues from there
        store = RemoteArtifactStore(ch, md, target=sched.target)
        assert store.list(f"tasks/{alice.task_id}/") == []
        ref = store.put_folder(m.key, src)
        assert ref.manifest_sha256 == m.sha256
        store.get_folder(m.key, tmp_path / "out")
        assert (tmp_path / "out" / "w.bin").read_bytes() == data


def test_a_chunk_with_the_wrong_bytes_is_refused_at_commit(sched, tmp_path):
    alice = sched.worker["alice"]
    m = Manifest(_prefix(alice) + "step_1", (FileEntry("a", 3, hashlib.sha256(b"abc").hexdigest()),))
    with sched.channel() as ch:
        stub = artifact_pb2_grpc.ArtifactServiceStub(ch)
        md = _md(alice)
        up = stub.BeginUpload(A.BeginUploadRequest(manifest=manifest_to_proto(m)), metadata=md).upload_id
        stub.UploadChunks(iter([A.UploadChunksRequest(upload_id=up, file_index=0, offset=0, data=b"abd")]), metadata=md)
        with pytest.raises(grpc.RpcError) as err:
            stub.CommitUpload(A.CommitUploadRequest(upload_id=up), metadata=md)
        assert err.value.code() == grpc.StatusCode.DATA_LOSS and "dropped it" in err.value.details()
        listed = stub.ListArtifacts(A.ListArtifactsRequest(prefix=f"tasks/{alice.task_id}/"), metadata=md)
        assert list(listed.keys) == []


def test_bad_input_gets_invalid_argument(sched):
    with sched.channel() as ch:
        stub = artifact_pb2_grpc.ArtifactServiceStub(ch)
        md = metadata(sched.admin_key)
        bad = A.ArtifactManifest(key="tasks/../x", files=[A.ArtifactFile(path="a", size_bytes=1, sha256="0" * 64)])
        with pytest.raises(grpc.RpcError) as err:
            stub.BeginUpload(A.BeginUploadRequest(manifest=bad), metadata=md)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "artifact key" in err.value.details()
        bad = A.ArtifactManifest(key="k", files=[A.ArtifactFile(path="../etc/passwd", size_bytes=1, sha256="0" * 64)])
        with pytest.raises(grpc.RpcError) as err:
            stub.BeginUpload(A.BeginUploadRequest(manifest=bad), metadata=md)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "'..'" in err.value.details()


def _refused(fn) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        fn()
    return err.value.code(), err.value.details()


def _begin(stub, key: str, data: bytes, md):
    m = A.ArtifactManifest(key=key, files=[A.ArtifactFile(path="w", size_bytes=len(data), sha256=_sha(data))])
    return stub.BeginUpload(A.BeginUploadRequest(manifest=m), metadata=md)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _upload(stub, key: str, data: bytes, md) -> None:
    """BeginUpload, UploadChunks and CommitUpload of one file ``w`` holding ``data``."""
    up = _begin(stub, key, data, md).upload_id
    stub.UploadChunks(iter([A.UploadChunksRequest(upload_id=up, file_index=0, offset=0, data=data)]), metadata=md)
    stub.CommitUpload(A.CommitUploadRequest(upload_id=up), metadata=md)


def _download(stub, key: str, md) -> bytes:
    return b"".join(r.chunk.data for r in stub.DownloadArtifact(A.DownloadArtifactRequest(key=key), metadata=md))


def test_a_node_key_cannot_overwrite_a_committed_checkpoint(sched):
    final = _prefix(sched.worker["alice"]) + "final_2"
    admin = metadata(sched.admin_key)
    with sched.channel() as ch:
        stub = artifact_pb2_grpc.ArtifactServiceStub(ch)
        _upload(stub, final, b"alice's weights", admin)
        for key in (final, _prefix(sched.worker["alice"]) + "step_3"):
            code, details = _refused(lambda: _upload(stub, key, b"forged", metadata(sched.node_key)))
            assert code == grpc.StatusCode.PERMISSION_DENIED and key in details and "role node" in details
        # Nor read artifacts: its workers read with their own credentials.
        node = metadata(sched.node_key)
        for call in (
            lambda: _download(stub, final, node),
            lambda: stub.StatArtifact(A.StatArtifactRequest(key=final), metadata=node),
            lambda: stub.ListArtifacts(A.ListArtifactsRequest(prefix="tasks/"), metadata=node),
        ):
            code, details = _refused(call)
            assert code == grpc.StatusCode.PERMISSION_DENIED and "(role node) may not read artifacts" in details
        assert _download(stub, final, admin) == b"alice's weights"
        assert list(stub.ListArtifacts(A.ListArtifactsRequest(prefix="tasks/"), metadata=admin).keys) == [final]


def test_a_worker_writes_and_reads_only_its_own_attempt_and_owner(sched):
    alice, bob = sched.worker["alice"], sched.worker["bob"]
    final = _prefix(alice) + "final_2"
    with sched.channel() as ch:
        stub = artifact_pb2_grpc.ArtifactServiceStub(ch)
        _upload(stub, final, b"alice's weights", _md(alice))
        # Bob's worker may neither replace Alice's checkpoint nor add keys to her task's namespace.
        for key in (final, _prefix(alice) + "step_3", f"tasks/{alice.task_id}/a{alice.attempt + 1}/step_1"):
            code, details = _refused(lambda: _upload(stub, key, b"forged", _md(bob)))
            assert code == grpc.StatusCode.PERMISSION_DENIED
            assert key in details and f"attempt {bob.attempt} of task {bob.task_id}" in details
            assert f"may write only keys under {_prefix(bob)}" in details
        # Nor read it: another owner's artifact is as missing as one that never was.
        for call in (
            lambda: _download(stub, final, _md(bob)),
            lambda: stub.StatArtifact(A.StatArtifactRequest(key=final), metadata=_md(bob)),
        ):
            code, details = _refused(call)
            assert code == grpc.StatusCode.NOT_FOUND and details == f"artifact {final} not found"
        for prefix in (f"tasks/{alice.task_id}/", "tasks/", ""):
            assert list(stub.ListArtifacts(A.ListArtifactsRequest(prefix=prefix), metadata=_md(bob)).keys) == []
        assert _download(stub, final, _md(alice)) == b"alice's weights"
        # Nor look up Alice's task.
        nodes = node_pb2_grpc.NodeServiceStub(ch)
        code, _ = _refused(lambda: nodes.LookupTask(N.LookupTaskRequest(task_id=alice.task_id), metadata=_md(bob)))
        assert code == grpc.StatusCode.NOT_FOUND
        assert nodes.LookupTask(N.LookupTaskRequest(task_id=bob.task_id), metadata=_md(bob)).task.owner == "bob"
        # A credential of one attempt may not open a node stream.
        code, details = _refused(
            lambda: next(
                node_pb2_grpc.NodeServiceStub(ch).Connect(
                    iter([N.ConnectRequest(register=N.Register(node_id="node-x", max_tasks=1))]), metadata=_md(bob)
                )
            )
        )
        assert code == grpc.StatusCode.PERMISSION_DENIED and "role worker" in details


def test_a_committed_checkpoint_is_immutable_and_a_retried_commit_succeeds(sched, tmp_path):
    alice = sched.worker["alice"]
    final = _prefix(alice) + "final_2"
    with sched.channel() as ch:
        stub = artifact_pb2_grpc.ArtifactServiceStub(ch)
        _upload(stub, final, b"alice's weights", _md(alice))
        held = stub.StatArtifact(A.StatArtifactRequest(key=final), metadata=_md(alice)).manifest
        # other content under the key: refused at begin, for the admin too, before any byte is sent
        for md in (_md(alice), metadata(sched.admin_key)):
            code, details = _refused(lambda: _begin(stub, final, b"other weights", md))
            assert code == grpc.StatusCode.ALREADY_EXISTS
            assert details.startswith(f"artifact {final} is already committed with other content")
        # the same manifest again: a success that sends nothing
        assert _begin(stub, final, b"alice's weights", _md(alice)).committed
        # an upload begun before the key was committed cannot replace it at commit either
        later = _prefix(alice) + "step_4"
        up = _begin(stub, later, b"first", _md(alice)).upload_id
        stub.UploadChunks(
            iter([A.UploadChunksRequest(upload_id=up, file_index=0, offset=0, data=b"first")]), metadata=_md(alice)
        )
        _upload(stub, later, b"second", _md(alice))
        code, details = _refused(lambda: stub.CommitUpload(A.CommitUploadRequest(upload_id=up), metadata=_md(alice)))
        assert code == grpc.StatusCode.ALREADY_EXISTS and later in details
        assert _download(stub, later, _md(alice)) == b"second"
        assert stub.StatArtifact(A.StatArtifactRequest(key=final), metadata=_md(alice)).manifest == held
        assert _download(stub, final, _md(alice)) == b"alice's weights"
        # the trainer's store: a retried put is a success, other content is ArtifactExists
        store = RemoteArtifactStore(ch, _md(alice), target=sched.target)
        with pytest.raises(ArtifactExists, match="already committed"):
            store.put_folder(final, _folder(tmp_path / "other", {"w": b"other weights"}))
        same = store.put_folder(final, _folder(tmp_path / "same", {"w": b"alice's weights"}))
        assert same == store.manifest(final).ref()


def test_a_fenced_attempt_can_neither_begin_nor_commit(sched):
    alice = sched.worker["alice"]
    key = _prefix(alice) + "step_5"
    with sched.channel() as ch, RLClient(sched.target, api_key=sched.user_key) as owner:
        stub = artifact_pb2_grpc.ArtifactServiceStub(ch)
        up = _begin(stub, key, b"late!", _md(alice)).upload_id
        # An upload stream open across the fencing: its first chunk lands, the next one is refused.
        fenced = threading.Event()

        def chunks():
            yield A.UploadChunksRequest(upload_id=up, file_index=0, offset=0, data=b"lat")
            fenced.wait(120)
            yield A.UploadChunksRequest(upload_id=up, file_index=0, offset=3, data=b"e!")

        stream = stub.UploadChunks.future(chunks(), metadata=_md(alice))
        wait_for(lambda: list(_begin(stub, key, b"late!", _md(alice)).received_bytes) == [3], 60, "the first chunk")
        # The node leaves: the scheduler requeues the task as attempt 2; attempt 1 is fenced.
        sched.node.leave()
        wait_for(lambda: owner.get_task(alice.task_id).attempt > alice.attempt, 60, "the task requeued")
        fenced.set()
        code, details = _refused(stream.result)
        assert code == grpc.StatusCode.PERMISSION_DENIED and "was superseded by attempt 2" in details
        for call in (
            lambda: stub.CommitUpload(A.CommitUploadRequest(upload_id=up), metadata=_md(alice)),
            lambda: _begin(stub, key, b"late!", _md(alice)),
        ):
            code, details = _refused(call)
            assert code == grpc.StatusCode.PERMISSION_DENIED
            assert f"attempt {alice.attempt} of task {alice.task_id} on node node-a was superseded" in details
        admin = metadata(sched.admin_key)
        assert list(stub.ListArtifacts(A.ListArtifactsRequest(prefix="tasks/"), metadata=admin).keys) == []
        # Its credential reads nothing more either.
        nodes = node_pb2_grpc.NodeServiceStub(ch)
        for call in (
            lambda: stub.ListArtifacts(A.ListArtifactsRequest(prefix=_prefix(alice)), metadata=_md(alice)),
            lambda: nodes.LookupTask(N.LookupTaskRequest(task_id=alice.task_id), metadata=_md(alice)),
        ):
            code, details = _refused(call)
            assert code == grpc.StatusCode.PERMISSION_DENIED and "its credential reads nothing more" in details


def test_a_cancelled_attempt_writes_until_its_worker_stops_and_then_nothing(sched):
    bob = sched.worker["bob"]
    with sched.channel() as ch, RLClient(sched.target, api_key=sched.bob_key) as owner:
        stub = artifact_pb2_grpc.ArtifactServiceStub(ch)
        owner.cancel(bob.task_id)
        # The worker checkpoints on its way out: that last checkpoint is still stored.
        _upload(stub, _prefix(bob) + "final_3", b"last", _md(bob))
        up = _begin(stub, _prefix(bob) + "step_4", b"late", _md(bob)).upload_id
        sched.node.report(bob, C.TASK_STATE_CANCELLED)  # the worker is gone
        wait_for(lambda: bob.task_id not in sched.core.table.stopping, 60, "the stop confirmed")
        code, details = _refused(lambda: stub.CommitUpload(A.CommitUploadRequest(upload_id=up), metadata=_md(bob)))
        assert code == grpc.StatusCode.PERMISSION_DENIED
        assert f"attempt {bob.attempt} of task {bob.task_id} on node node-a has ended" in details
        admin = metadata(sched.admin_key)
        stored = stub.ListArtifacts(A.ListArtifactsRequest(prefix=f"tasks/{bob.task_id}/"), metadata=admin)
        assert list(stored.keys) == [_prefix(bob) + "final_3"]


def test_user_keys_may_not_use_the_artifact_service(sched, tmp_path):
    with sched.channel() as ch:
        store = RemoteArtifactStore(ch, metadata(sched.user_key), target=sched.target)
        with pytest.raises(StoreAuthError, match="may not call /opentinker.artifact.v1.ArtifactService"):
            store.list()
        stub = artifact_pb2_grpc.ArtifactServiceStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            stub.DescribeStore(A.DescribeStoreRequest())
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_an_s3_scheduler_describes_the_bucket_and_takes_no_upload_stream(seaweedfs, monkeypatch, tmp_path):
    for k, v in seaweedfs.env().items():
        monkeypatch.setenv(k, v)
    s3 = f"{{endpoint: '{seaweedfs.endpoint}', bucket: {seaweedfs.bucket}, prefix: svc/}}"
    config = f"artifacts:\n  backend: s3\n  s3: {s3}\n"
    with LoopbackScheduler(tmp_path / "state", config) as s, s.channel() as ch:
        stub = artifact_pb2_grpc.ArtifactServiceStub(ch)
        desc = stub.DescribeStore(A.DescribeStoreRequest())
        assert desc.backend == "s3" and desc.s3.bucket == seaweedfs.bucket and desc.s3.prefix == "svc/"
        assert desc.s3.endpoint == seaweedfs.endpoint and desc.checkpoint_retries == 3
        m = A.ArtifactManifest(
            key="k", files=[A.ArtifactFile(path="a", size_bytes=1, sha256=hashlib.sha256(b"a").hexdigest())]
        )
        begun = stub.BeginUpload(A.BeginUploadRequest(manifest=m))
        assert [p.method for p in begun.puts] == ["PUT"]  # the bytes go to the bucket, not here
        chunk = A.UploadChunksRequest(upload_id=begun.upload_id, file_index=0, offset=0, data=b"a")
        with pytest.raises(grpc.RpcError) as err:
            stub.UploadChunks(iter([chunk]))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "BeginUpload presigns" in err.value.details()
