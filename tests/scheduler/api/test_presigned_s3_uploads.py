"""Presigned uploads and downloads of the ``s3`` store, through a real scheduler on loopback with
authentication on and a real SeaweedFS: a task worker's attempt credential gets PUT and GET URLs
only for what BeginUpload and the reads allow, the bytes go between worker and bucket, and the
scheduler commits. The worker side holds no S3 credentials: the AWS variables are gone from this
process once the scheduler has started."""

from __future__ import annotations

import hashlib
import os
import time
import uuid

import grpc
import pytest
import urllib3

from opentinker.artifact.v1 import artifact_pb2 as A, artifact_pb2_grpc
from opentinker_client import RLClient
from opentinker_common.artifacts import ArtifactExists, Manifest
from opentinker_common.artifacts.manifest import scan_folder
from opentinker_common.artifacts.remote import RemoteArtifactStore, manifest_to_proto

from tests.support.raw_node import RawNode
from tests.support.security import AUTH_LOCAL_MODELS, LoopbackScheduler, metadata
from tests.support.waiting import wait_for


def _scheduler(seaweedfs, monkeypatch, tmp_path, *, expires_s: int | None = None, part_bytes: int | None = None):
    """A scheduler on its own prefix of the bucket, with alice's and bob's tasks assigned to one
    node; the AWS credentials are in this process's environment only while it starts."""
    for k, v in seaweedfs.env().items():
        monkeypatch.setenv(k, v)
    prefix = f"presign-{uuid.uuid4().hex[:8]}/"
    s3 = f"endpoint: '{seaweedfs.endpoint}', bucket: {seaweedfs.bucket}, prefix: {prefix}"
    s3 += f", presign_expires_s: {expires_s}" if expires_s else ""
    s3 = f"{{{s3}{f', multipart_part_bytes: {part_bytes}' if part_bytes else ''}}}"
    config = AUTH_LOCAL_MODELS + f"lease: 600\nartifacts:\n  backend: s3\n  s3: {s3}\n"
    s = LoopbackScheduler(tmp_path / "state", config)
    for k in seaweedfs.env():
        monkeypatch.delenv(k)
    s.prefix = prefix
    with RLClient(s.target, api_key=s.admin_key) as root:
        node_key = root.keys.create("rack-1", "node")[1]
        keys = {who: root.keys.create(who, "user")[1] for who in ("alice", "bob")}
    s.node = RawNode(s.target, node_key, "node-a")
    s.worker = {}
    s.user_key = keys["alice"]
    for who, key in keys.items():
        with RLClient(s.target, api_key=key) as user:
            task_id = user.submit_task(workload_type="lora_finetune", model="/models/m", gpu_count=0)
        s.worker[who] = s.node.assignment(task_id)
    return s


@pytest.fixture
def sched(seaweedfs, monkeypatch, tmp_path):
    s = _scheduler(seaweedfs, monkeypatch, tmp_path)
    with s:
        yield s
        s.node.leave()


def _prefix(assign) -> str:
    return f"tasks/{assign.task_id}/a{assign.attempt}/"


def _store(ch, sched, who: str) -> RemoteArtifactStore:
    md = metadata(sched.worker[who].worker_credential)
    desc = RemoteArtifactStore(ch, md, target=sched.target).describe_store()
    return RemoteArtifactStore(ch, md, target=sched.target, s3=desc.s3)


def _manifest(key: str, data: bytes) -> A.ArtifactManifest:
    sha = hashlib.sha256(data).hexdigest()
    return A.ArtifactManifest(key=key, files=[A.ArtifactFile(path="w", size_bytes=len(data), sha256=sha)])


def _begin(stub, key: str, data: bytes, md) -> A.BeginUploadResponse:
    return stub.BeginUpload(A.BeginUploadRequest(manifest=_manifest(key, data)), metadata=md)


def _refused(fn) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        fn()
    return err.value.code(), err.value.details()


def _put(req: A.PresignedRequest, body: bytes) -> urllib3.BaseHTTPResponse:
    return urllib3.request(req.method, req.url, body=body, headers=dict(req.headers), retries=False)


def _objects(seaweedfs, prefix: str) -> list[str]:
    listed = seaweedfs.client().list_objects_v2(Bucket=seaweedfs.bucket, Prefix=prefix)
    return sorted(o["Key"].removeprefix(prefix) for o in listed.get("Contents", ()))


def test_a_worker_without_s3_credentials_puts_and_gets_through_presigned_urls(sched, seaweedfs, tmp_path):
    assert not any(k in os.environ for k in seaweedfs.env())
    files = {"adapter_model.safetensors": os.urandom(1_500_000), "adapter_config.json": b"{}", "empty": b""}
    src = tmp_path / "src"
    src.mkdir()
    for name, data in files.items():
        (src / name).write_bytes(data)
    alice = sched.worker["alice"]
    with sched.channel() as ch:
        store = _store(ch, sched, "alice")
        assert store.backend == "s3" and "presigned by the scheduler" in store.describe()
        ref = store.put_folder(_prefix(alice) + "step_2", src, meta={"format": "peft_lora"})
        assert store.list(f"tasks/{alice.task_id}/") == [ref.key]
        store.get_folder(ref.key, tmp_path / "out", expect_sha256=ref.manifest_sha256)
        assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == files
        # the same content again: committed already, no URL handed out
        stub = artifact_pb2_grpc.ArtifactServiceStub(ch)
        held = manifest_to_proto(store.manifest(ref.key))
        again = stub.BeginUpload(A.BeginUploadRequest(manifest=held), metadata=metadata(alice.worker_credential))
        assert again.committed and not again.puts
    # the scheduler wrote the manifest and the data; the staged upload is gone
    names = _objects(seaweedfs, sched.prefix)
    assert names == sorted(f"{ref.key}/{n}" for n in [".manifest.json", *(f".data/{f}" for f in files)]), names


def test_urls_only_for_the_attempts_own_uncommitted_keys_and_the_bytes_announced(sched, tmp_path):
    alice, bob = sched.worker["alice"], sched.worker["bob"]
    md = metadata(alice.worker_credential)
    with sched.channel() as ch:
        stub = artifact_pb2_grpc.ArtifactServiceStub(ch)
        # another task's key: PERMISSION_DENIED, no URL
        code, details = _refused(lambda: _begin(stub, _prefix(bob) + "step_1", b"x", md))
        assert code == grpc.StatusCode.PERMISSION_DENIED and f"may write only keys under {_prefix(alice)}" in details
        # a PUT of other bytes than announced, or to another object, is refused by the bucket
        key = _prefix(alice) + "step_1"
        begun = _begin(stub, key, b"alice's weights", md)
        (put,) = begun.puts
        assert put.method == "PUT" and put.file_index == 0
        assert _put(put, b"forged weights!").status == 400  # same length, other SHA-256
        other = A.PresignedRequest()
        other.CopyFrom(put)
        other.url = put.url.replace(begun.upload_id, "0" * 32)
        assert _put(other, b"alice's weights").status == 403
        commit = A.CommitUploadRequest(upload_id=begun.upload_id)
        code, details = _refused(lambda: stub.CommitUpload(commit, metadata=md))
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "file w holds 0 of 15 bytes" in details
        assert _put(put, b"alice's weights").status == 200
        assert stub.CommitUpload(commit, metadata=md).manifest.key == key
        # a committed key: other content gets no URL
        code, details = _refused(lambda: _begin(stub, key, b"other weights!!", md))
        assert code == grpc.StatusCode.ALREADY_EXISTS and "already committed" in details
        (tmp_path / "other").mkdir()
        (tmp_path / "other" / "w").write_bytes(b"other")
        with pytest.raises(ArtifactExists):
            _store(ch, sched, "alice").put_folder(key, tmp_path / "other")
        # reads: its own owner's checkpoints only; bob's is NOT_FOUND, as a missing one
        got = stub.PresignDownload(A.PresignDownloadRequest(key=key), metadata=md)
        assert urllib3.request("GET", got.gets[0].url).data == b"alice's weights"
        bob_md = metadata(bob.worker_credential)
        code, _ = _refused(lambda: stub.PresignDownload(A.PresignDownloadRequest(key=key), metadata=bob_md))
        assert code == grpc.StatusCode.NOT_FOUND


def test_a_stale_attempt_gets_no_url_and_commits_nothing(sched, seaweedfs):
    alice = sched.worker["alice"]
    md = metadata(alice.worker_credential)
    key = _prefix(alice) + "step_3"
    with sched.channel() as ch, RLClient(sched.target, api_key=sched.user_key) as owner:
        stub = artifact_pb2_grpc.ArtifactServiceStub(ch)
        begun = _begin(stub, key, b"late!", md)
        # the node leaves: the task is requeued as attempt 2, attempt 1 is fenced
        sched.node.leave()
        wait_for(lambda: owner.get_task(alice.task_id).attempt > alice.attempt, 60, "the task requeued")
        assert _put(begun.puts[0], b"late!").status == 200  # a URL signed before: only staged bytes
        for call in (
            lambda: _begin(stub, key, b"late!", md),
            lambda: stub.CommitUpload(A.CommitUploadRequest(upload_id=begun.upload_id), metadata=md),
            lambda: stub.PresignDownload(A.PresignDownloadRequest(key=key), metadata=md),
        ):
            code, details = _refused(call)
            assert code == grpc.StatusCode.PERMISSION_DENIED, details
            assert f"attempt {alice.attempt} of task {alice.task_id} on node node-a was superseded" in details
    assert not [n for n in _objects(seaweedfs, sched.prefix) if n.startswith("tasks/")]


def test_a_presigned_url_expires(seaweedfs, monkeypatch, tmp_path):
    with _scheduler(seaweedfs, monkeypatch, tmp_path, expires_s=1) as sched, sched.channel() as ch:
        alice = sched.worker["alice"]
        stub = artifact_pb2_grpc.ArtifactServiceStub(ch)
        md = metadata(alice.worker_credential)
        (put,) = _begin(stub, _prefix(alice) + "step_1", b"slow", md).puts
        wait_for(lambda: time.time() > put.expires_unix_s + 1, 30, "the URL's expiry passed")
        resp = _put(put, b"slow")
        assert resp.status == 403 and b"expired" in resp.data, resp.data
        sched.node.leave()


def test_a_worker_gets_urls_for_its_owners_datasets_only(sched, tmp_path):
    data = b"".join(b'{"prompt": "What is %d + 1?", "answer": %d}\n' % (i, i + 1) for i in range(3))
    (tmp_path / "prompts.jsonl").write_bytes(data)
    with RLClient(sched.target, api_key=sched.user_key) as alice_client:
        dataset = alice_client.upload_dataset(tmp_path / "prompts.jsonl", format="prompts")
    key = f"datasets/{dataset.dataset_id.removeprefix('sha256:')}"
    with sched.channel() as ch:
        stub = artifact_pb2_grpc.ArtifactServiceStub(ch)
        got = stub.PresignDownload(
            A.PresignDownloadRequest(key=key), metadata=metadata(sched.worker["alice"].worker_credential)
        )
        files = {f.path: g.url for f, g in zip(got.manifest.files, got.gets)}
        assert urllib3.request("GET", files["data.jsonl"]).data == data
        bob_md = metadata(sched.worker["bob"].worker_credential)
        code, details = _refused(lambda: stub.PresignDownload(A.PresignDownloadRequest(key=key), metadata=bob_md))
        assert code == grpc.StatusCode.NOT_FOUND and key in details


def _uploads_in_parts(seaweedfs, prefix: str) -> list[str]:
    listed = seaweedfs.client().list_multipart_uploads(Bucket=seaweedfs.bucket, Prefix=prefix)
    return [u["Key"] for u in listed.get("Uploads", ())]


def test_a_worker_puts_a_file_over_the_part_size_in_presigned_parts(seaweedfs, monkeypatch, tmp_path):
    part = 5 * 1024 * 1024  # S3's smallest part: a file of 11 MiB goes in three, as one over 5 GiB does
    big = os.urandom(2 * part + 1000)
    src = tmp_path / "src"
    src.mkdir()
    (src / "model.safetensors").write_bytes(big)
    (src / "config.json").write_bytes(b"{}")
    with _scheduler(seaweedfs, monkeypatch, tmp_path, part_bytes=part) as sched, sched.channel() as ch:
        alice = sched.worker["alice"]
        stub = artifact_pb2_grpc.ArtifactServiceStub(ch)
        m = manifest_to_proto(Manifest(_prefix(alice) + "step_1", tuple(e for _, e in scan_folder(src))))
        begun = stub.BeginUpload(A.BeginUploadRequest(manifest=m), metadata=metadata(alice.worker_credential))
        sent = sorted((p.file_index, p.offset, p.headers["Content-Length"]) for p in begun.puts)
        assert sent == [(0, 0, "2"), (1, 0, str(part)), (1, part, str(part)), (1, 2 * part, "1000")]
        ref = _store(ch, sched, "alice").put_folder(_prefix(alice) + "step_1", src)
        _store(ch, sched, "alice").get_folder(ref.key, tmp_path / "out", expect_sha256=ref.manifest_sha256)
        assert (tmp_path / "out" / "model.safetensors").read_bytes() == big
        assert _uploads_in_parts(seaweedfs, sched.prefix) == []
        sched.node.leave()


def test_an_abandoned_upload_in_parts_is_aborted_by_the_scheduler(seaweedfs, monkeypatch, tmp_path):
    part = 5 * 1024 * 1024
    big = os.urandom(part + 1)
    with _scheduler(seaweedfs, monkeypatch, tmp_path, expires_s=1, part_bytes=part) as sched, sched.channel() as ch:
        alice = sched.worker["alice"]
        stub = artifact_pb2_grpc.ArtifactServiceStub(ch)
        begun = _begin(stub, _prefix(alice) + "step_1", big, metadata(alice.worker_credential))
        first = begun.puts[0]
        assert _put(first, big[: int(first.headers["Content-Length"])]).status == 200
        assert len(_uploads_in_parts(seaweedfs, sched.prefix)) == 1
        # the worker never commits: once its URLs have long expired the scheduler aborts the parts
        wait_for(lambda: not _uploads_in_parts(seaweedfs, sched.prefix), 60, "the abandoned upload aborted")
        assert _objects(seaweedfs, sched.prefix + ".uploads/") == []
        sched.node.leave()
