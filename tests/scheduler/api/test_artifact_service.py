"""ArtifactService through a real scheduler on loopback: trainers' uploads and downloads of the
``local`` store with a node key (RemoteArtifactStore), resumable, hash-checked, node role only."""

from __future__ import annotations

import hashlib
import os

import grpc
import pytest

from opentinker.artifact.v1 import artifact_pb2 as A, artifact_pb2_grpc
from opentinker_client import RLClient
from opentinker_common.artifacts import ArtifactCorrupt, ArtifactNotFound, FileEntry, Manifest, StoreAuthError
from opentinker_common.artifacts.remote import RemoteArtifactStore, manifest_to_proto

from tests.support.security import LoopbackScheduler, metadata


@pytest.fixture
def sched(tmp_path):
    with LoopbackScheduler(tmp_path / "state", "auth: {enabled: true}\n") as s:
        with RLClient(s.target, api_key=s.admin_key) as root:
            s.node_key = root.keys.create("rack-1", "node")[1]
            s.user_key = root.keys.create("alice", "user")[1]
        yield s


def _folder(path, files):
    path.mkdir()
    for name, data in files.items():
        (path / name).write_bytes(data)
    return path


def test_put_and_get_through_the_scheduler(sched, tmp_path):
    files = {"adapter_model.safetensors": os.urandom(2_500_000), "adapter_config.json": b"{}", "empty": b""}
    with sched.channel() as ch:
        store = RemoteArtifactStore(ch, metadata(sched.node_key), target=sched.target)
        assert store.describe_store().backend == "local"
        ref = store.put_folder("tasks/t1/a1/step_10", _folder(tmp_path / "src", files), meta={"format": "peft_lora"})
        assert store.list("tasks/t1/") == ["tasks/t1/a1/step_10"]
        assert store.manifest(ref.key).meta == {"format": "peft_lora"}
        store.get_folder(ref.key, tmp_path / "out", expect_sha256=ref.manifest_sha256)
        assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == files
        # a put of the same content again sends nothing (the scheduler says it is committed)
        assert store.put_folder(ref.key, tmp_path / "src", meta={"format": "peft_lora"}) == ref
        with pytest.raises(ArtifactNotFound, match="tasks/t1/a1/step_99"):
            store.get_folder("tasks/t1/a1/step_99", tmp_path / "none")
        with pytest.raises(ArtifactCorrupt, match="manifest hash"):
            store.manifest(ref.key, expect_sha256="0" * 64)
    # it is on the scheduler's disk, under the state dir
    assert (sched.config.state_dir / "artifacts" / "tasks" / "t1" / "a1" / "step_10" / ".manifest.json").exists()


def test_an_interrupted_upload_resumes_from_the_held_bytes(sched, tmp_path):
    data = os.urandom(3 * 1024 * 1024 + 5)
    src = _folder(tmp_path / "src", {"w.bin": data})
    m = Manifest("tasks/t2/a1/step_5", (FileEntry("w.bin", len(data), hashlib.sha256(data).hexdigest()),))
    with sched.channel() as ch:
        stub = artifact_pb2_grpc.ArtifactServiceStub(ch)
        md = metadata(sched.node_key)
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
        assert store.list("tasks/t2/") == []
        ref = store.put_folder(m.key, src)
        assert ref.manifest_sha256 == m.sha256
        store.get_folder(m.key, tmp_path / "out")
        assert (tmp_path / "out" / "w.bin").read_bytes() == data


def test_a_chunk_with_the_wrong_bytes_is_refused_at_commit(sched, tmp_path):
    m = Manifest("tasks/t3/a1/step_1", (FileEntry("a", 3, hashlib.sha256(b"abc").hexdigest()),))
    with sched.channel() as ch:
        stub = artifact_pb2_grpc.ArtifactServiceStub(ch)
        md = metadata(sched.node_key)
        up = stub.BeginUpload(A.BeginUploadRequest(manifest=manifest_to_proto(m)), metadata=md).upload_id
        stub.UploadChunks(iter([A.UploadChunksRequest(upload_id=up, file_index=0, offset=0, data=b"abd")]), metadata=md)
        with pytest.raises(grpc.RpcError) as err:
            stub.CommitUpload(A.CommitUploadRequest(upload_id=up), metadata=md)
        assert err.value.code() == grpc.StatusCode.DATA_LOSS and "dropped it" in err.value.details()
        assert list(stub.ListArtifacts(A.ListArtifactsRequest(prefix="tasks/t3/"), metadata=md).keys) == []


def test_bad_input_gets_invalid_argument(sched):
    with sched.channel() as ch:
        stub = artifact_pb2_grpc.ArtifactServiceStub(ch)
        md = metadata(sched.node_key)
        bad = A.ArtifactManifest(key="tasks/../x", files=[A.ArtifactFile(path="a", size_bytes=1, sha256="0" * 64)])
        with pytest.raises(grpc.RpcError) as err:
            stub.BeginUpload(A.BeginUploadRequest(manifest=bad), metadata=md)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "artifact key" in err.value.details()
        bad = A.ArtifactManifest(key="k", files=[A.ArtifactFile(path="../etc/passwd", size_bytes=1, sha256="0" * 64)])
        with pytest.raises(grpc.RpcError) as err:
            stub.BeginUpload(A.BeginUploadRequest(manifest=bad), metadata=md)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "'..'" in err.value.details()


def test_user_keys_may_not_use_the_artifact_service(sched, tmp_path):
    with sched.channel() as ch:
        store = RemoteArtifactStore(ch, metadata(sched.user_key), target=sched.target)
        with pytest.raises(StoreAuthError, match="may not call /opentinker.artifact.v1.ArtifactService"):
            store.list()
        stub = artifact_pb2_grpc.ArtifactServiceStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            stub.DescribeStore(A.DescribeStoreRequest())
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_an_s3_scheduler_describes_the_bucket_and_refuses_uploads(seaweedfs, monkeypatch, tmp_path):
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
            key="k", files=[A.ArtifactFile(path="a", size_bytes=0, sha256=hashlib.sha256().hexdigest())]
        )
        with pytest.raises(grpc.RpcError) as err:
            stub.BeginUpload(A.BeginUploadRequest(manifest=m))
        assert (
            err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            and "trainers write it directly" in err.value.details()
        )
