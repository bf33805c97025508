"""Uploads against a real scheduler with auth on: users' uploads hold slots per owner and of a
bound for all owners, trainers' checkpoint uploads slots of a pool of their own; uploads end after
an idle timeout (no payload byte: empty chunks do not count) or an overall deadline, count against an owner's stored
dataset bytes and the free disk, and leave no ``.part`` file behind when refused, timed out or
broken off. A shared (content-addressed) dataset answers each uploader with their own name."""

from __future__ import annotations

import threading
from pathlib import Path

import grpc
import pytest

from opentinker.artifact.v1 import artifact_pb2_grpc
from opentinker.scheduler.v1 import scheduler_pb2 as S
from opentinker.scheduler.v1 import scheduler_pb2_grpc
from opentinker_client import RLClient
from opentinker_common.artifacts.remote import RemoteArtifactStore
from opentinker_scheduler.security.limits import CHECKPOINT_UPLOADS, USER_UPLOADS

from tests.support.raw_node import RawNode
from tests.support.security import AUTH_LOCAL_MODELS, LoopbackScheduler, metadata
from tests.support.waiting import wait_for

LINE = b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n'
DATA = LINE * 4


def _parts(s: LoopbackScheduler) -> list[Path]:
    folder = s.config.state_dir / "datasets"
    return sorted(folder.glob("upload-*")) if folder.exists() else []


def _open_uploads(s: LoopbackScheduler, pool: str = USER_UPLOADS) -> int:
    return s.do(s.security.limits.open_uploads, pool)


class _Upload:
    """One UploadDataset (or UploadChunks) call in a thread: sends ``first`` messages, then
    waits (idle) until released, or sends a chunk of ``trickle`` every ``trickle_s`` seconds."""

    def __init__(
        self, s, key, *, first=(), trickle_s: float | None = None, trickle: bytes = b" ", artifact: bool = False
    ) -> None:
        self.release = threading.Event()
        self.error: grpc.RpcError | None = None
        self.response = None
        self.done = threading.Event()
        self.channel = grpc.insecure_channel(s.target)
        if artifact:
            call = artifact_pb2_grpc.ArtifactServiceStub(self.channel).UploadChunks
        else:
            call = scheduler_pb2_grpc.SchedulerServiceStub(self.channel).UploadDataset

        def requests():
            yield from first
            while not self.release.wait(trickle_s if trickle_s is not None else 60):
                if trickle_s is not None:
                    yield S.UploadDatasetRequest(chunk=trickle)

        def run() -> None:
            try:
                self.response = call(requests(), metadata=metadata(key), timeout=60)
            except grpc.RpcError as err:
                self.error = err
            finally:
                self.done.set()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def finish(self) -> grpc.RpcError | None:
        assert self.done.wait(60), "the upload did not end"
        self.release.set()
        self.thread.join(10)
        self.channel.close()
        return self.error

    def cancel(self) -> None:
        self.release.set()
        self.channel.close()  # the client goes away mid-stream
        self.thread.join(10)


def _users(s: LoopbackScheduler, *owners: str, role: str = "user") -> list[str]:
    with RLClient(s.target, api_key=s.admin_key) as root:
        return [root.keys.create(o, role)[1] for o in owners]


def _upload_all(s: LoopbackScheduler, key: str, name: str, data: bytes) -> S.DatasetInfo:
    with grpc.insecure_channel(s.target) as ch:
        request = S.UploadDatasetRequest(name=name, total_bytes=len(data), chunk=data)
        stub = scheduler_pb2_grpc.SchedulerServiceStub(ch)
        return stub.UploadDataset(iter([request]), metadata=metadata(key), timeout=30).dataset


def _header(total: int, name: str = "d.jsonl") -> S.UploadDatasetRequest:
    return S.UploadDatasetRequest(name=name, total_bytes=total, chunk=b"")


@pytest.fixture(scope="module")
def limited(tmp_path_factory):
    """Two user uploads per owner, three in all, one checkpoint upload; 2000 dataset bytes per owner."""
    config = (
        AUTH_LOCAL_MODELS + "lease: 600\n"  # the raw node of a test sends no heartbeats
        "limits: {max_uploads_per_owner: 2, max_uploads: 3, max_checkpoint_uploads: 1,"
        " max_dataset_bytes_per_owner: 2000, min_free_disk_bytes: 0}\n"
    )
    with LoopbackScheduler(tmp_path_factory.mktemp("limited") / "state", config) as s:
        yield s


def _put_checkpoint(s: LoopbackScheduler, owner: str, folder: Path) -> None:
    """A checkpoint of a task of ``owner``, stored by its worker with its attempt credential."""
    user, node_key = _users(s, owner), _users(s, f"rack-{owner}", role="node")[0]
    node = RawNode(s.target, node_key, f"node-{owner}")
    try:
        with RLClient(s.target, api_key=user[0]) as client:
            task_id = client.submit_task(workload_type="lora_finetune", model="/models/m", gpu_count=0)
        assign = node.assignment(task_id)
        folder.mkdir()
        (folder / "adapter_model.safetensors").write_bytes(DATA)
        key = f"tasks/{task_id}/a{assign.attempt}/step_1"
        with grpc.insecure_channel(s.target) as ch:
            RemoteArtifactStore(ch, metadata(assign.worker_credential), target=s.target).put_folder(key, folder)
    finally:
        node.leave()


def test_an_owner_holding_uploads_leaves_other_owners_and_checkpoints_room(limited, tmp_path) -> None:
    s = limited
    alice, alice_again, bob, carol = _users(s, "alice-slots", "alice-slots", "bob-slots", "carol-slots")
    held = [_Upload(s, alice, first=[_header(len(DATA))]) for _ in range(2)]
    wait_for(lambda: len(_parts(s)) == 2, what="two uploads holding .part files")
    for key in (alice, alice_again):  # a second key of the same owner adds no slot
        err = _Upload(s, key, first=[_header(len(DATA))]).finish()
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "2 open for owner 'alice-slots', the limit is 2 (limits.max_uploads_per_owner)" in err.details()

    # Another owner still uploads; a trainer's checkpoint has a pool of its own, even when users' is full.
    bobs = _Upload(s, bob, first=[_header(len(DATA))])
    wait_for(lambda: _open_uploads(s) == 3, what="three user uploads open")
    _put_checkpoint(s, "frank-slots", tmp_path / "ckpt")
    err = _Upload(s, carol, first=[_header(len(DATA))]).finish()
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "3 open on this scheduler, the limit is 3 (limits.max_uploads)" in err.details()

    # Broken off mid-stream: the slots come back and nothing is left on disk.
    for u in (*held, bobs):
        u.cancel()
    wait_for(lambda: _open_uploads(s) == 0 and not _parts(s), what="slots released and .part files removed")
    assert _upload_all(s, alice, "x.jsonl", DATA).size_bytes == len(DATA)  # a complete upload works again


def _attempts(s: LoopbackScheduler, owner: str, n: int) -> tuple[RawNode, list[str]]:
    """A node of its own running ``n`` tasks of ``owner``, and their attempts' credentials."""
    user, node_key = _users(s, owner), _users(s, f"rack-{owner}", role="node")[0]
    node = RawNode(s.target, node_key, f"node-{owner}")
    with RLClient(s.target, api_key=user[0]) as client:
        tasks = [client.submit_task(workload_type="lora_finetune", model="/models/m", gpu_count=0) for _ in range(n)]
    return node, [node.assignment(t).worker_credential for t in tasks]


def test_checkpoint_uploads_have_their_own_bound(limited) -> None:
    s = limited
    node, (credential,) = _attempts(s, "bound", 1)
    held = _Upload(s, credential, artifact=True)
    try:
        wait_for(lambda: _open_uploads(s, CHECKPOINT_UPLOADS) == 1, what="one checkpoint upload open")
        err = _Upload(s, s.admin_key, artifact=True).finish()
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "1 open on this scheduler, the limit is 1 (limits.max_checkpoint_uploads)" in err.details()
    finally:
        held.cancel()
        node.leave()
    wait_for(lambda: _open_uploads(s, CHECKPOINT_UPLOADS) == 0, what="the checkpoint slot released")


def test_a_node_key_is_refused_before_it_takes_a_checkpoint_slot(limited, tmp_path) -> None:
    s = limited
    (node_key,) = _users(s, "rack-keyonly", role="node")
    err = _Upload(s, node_key, artifact=True).finish()
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED, err
    assert "(role node) may not upload checkpoints" in err.details()
    assert _open_uploads(s, CHECKPOINT_UPLOADS) == 0
    _put_checkpoint(s, "after-node-key", tmp_path / "ckpt")  # the only slot is free for a worker


@pytest.fixture(scope="module")
def checkpoint_pool(tmp_path_factory):
    """Three checkpoint uploads in all, two per node, one per attempt."""
    config = (
        AUTH_LOCAL_MODELS + "lease: 600\n"
        "limits: {max_checkpoint_uploads: 3, max_checkpoint_uploads_per_node: 2,"
        " max_checkpoint_uploads_per_attempt: 1, min_free_disk_bytes: 0}\n"
    )
    with LoopbackScheduler(tmp_path_factory.mktemp("checkpoint-pool") / "state", config) as s:
        yield s


def test_a_node_holding_its_most_checkpoint_uploads_leaves_another_node_room(checkpoint_pool, tmp_path) -> None:
    s = checkpoint_pool
    node, (first, second, third, _) = _attempts(s, "greedy", 4)  # the node is full: the next task goes elsewhere
    held = [_Upload(s, first, artifact=True), _Upload(s, second, artifact=True)]
    try:
        wait_for(lambda: _open_uploads(s, CHECKPOINT_UPLOADS) == 2, what="the node's two checkpoint uploads open")
        err = _Upload(s, first, artifact=True).finish()
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "1 open for attempt 1 of task" in err.details()
        assert "the limit is 1 (limits.max_checkpoint_uploads_per_attempt)" in err.details()
        err = _Upload(s, third, artifact=True).finish()
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "2 open for node 'node-greedy', the limit is 2 (limits.max_checkpoint_uploads_per_node)" in err.details()
        _put_checkpoint(s, "other", tmp_path / "ckpt")  # another node's attempt commits its checkpoint
    finally:
        for upload in held:
            upload.cancel()
        node.leave()
    wait_for(lambda: _open_uploads(s, CHECKPOINT_UPLOADS) == 0, what="the checkpoint slots released")


def test_an_owner_may_store_at_most_its_dataset_bytes(limited) -> None:
    s = limited
    (carol,) = _users(s, "carol-quota")
    assert _upload_all(s, carol, "a.jsonl", DATA).size_bytes == len(DATA)
    stub = scheduler_pb2_grpc.SchedulerServiceStub(grpc.insecure_channel(s.target))
    with pytest.raises(grpc.RpcError) as info:
        stub.UploadDataset(iter([_header(1700)]), metadata=metadata(carol), timeout=30)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert info.value.details() == (
        f"total_bytes: owner 'carol-quota' stores {len(DATA)} bytes of datasets; 1700 more would pass the limit "
        "of 2000 bytes per owner (limits.max_dataset_bytes_per_owner)"
    )
    assert not _parts(s)  # refused before anything was written


def test_a_shared_upload_answers_each_owner_with_their_own_name(limited) -> None:
    s = limited
    dave, erin = _users(s, "dave-names", "erin-names")
    data = LINE * 3
    mine = _upload_all(s, dave, "alice.jsonl", data)
    theirs = _upload_all(s, erin, "guess.jsonl", data)
    assert theirs.dataset_id == mine.dataset_id  # identical bytes: one stored copy, and that is all erin learns
    assert (mine.name, theirs.name) == ("alice.jsonl", "guess.jsonl")
    stub = scheduler_pb2_grpc.SchedulerServiceStub(grpc.insecure_channel(s.target))
    for key, name in ((dave, "alice.jsonl"), (erin, "guess.jsonl")):
        first = next(iter(stub.DownloadDataset(S.DownloadDatasetRequest(dataset_id=mine.dataset_id),
                                               metadata=metadata(key), timeout=30)))  # fmt: skip
        assert first.dataset.name == name


@pytest.fixture(scope="module")
def timed(tmp_path_factory):
    config = "auth: {enabled: true}\nlimits: {upload_idle_timeout: 0.5, upload_deadline: 1}\n"
    with LoopbackScheduler(tmp_path_factory.mktemp("timed") / "state", config) as s:
        yield s


def test_an_idle_upload_ends_and_leaves_nothing(timed) -> None:
    s = timed
    (key,) = _users(s, "idle")
    err = _Upload(s, key, first=[S.UploadDatasetRequest(name="d.jsonl", total_bytes=200 * 2**20, chunk=LINE)]).finish()
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert err.details() == (
        "upload: no payload byte for 0.5 s (limits.upload_idle_timeout); the partial upload was dropped, send it again"
    )
    wait_for(lambda: not _parts(s) and _open_uploads(s) == 0, what=".part removed, slot released")


def test_empty_chunks_do_not_keep_an_upload_alive(timed) -> None:
    s = timed
    (key,) = _users(s, "empty-chunks")
    header = S.UploadDatasetRequest(name="d.jsonl", total_bytes=10 * 2**20, chunk=LINE)
    # A message every 0.1 s, well within the idle timeout, but none carries a byte.
    err = _Upload(s, key, first=[header], trickle_s=0.1, trickle=b"").finish()
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "no payload byte for 0.5 s (limits.upload_idle_timeout)" in err.details()
    wait_for(lambda: not _parts(s) and _open_uploads(s) == 0, what=".part removed, slot released")


def test_a_trickling_upload_ends_at_its_deadline(timed) -> None:
    s = timed
    (key,) = _users(s, "trickle")
    header = S.UploadDatasetRequest(name="d.jsonl", total_bytes=10 * 2**20, chunk=LINE)
    err = _Upload(s, key, first=[header], trickle_s=0.1).finish()  # a message well within the idle timeout
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "still open after 1 s (limits.upload_deadline)" in err.details()
    wait_for(lambda: not _parts(s) and _open_uploads(s) == 0, what=".part removed, slot released")


def test_an_upload_the_disk_cannot_hold_is_refused_before_it_starts(tmp_path) -> None:
    config = f"auth: {{enabled: true}}\nlimits: {{min_free_disk_bytes: {2**62}}}\n"
    with LoopbackScheduler(tmp_path / "state", config) as s:
        (key,) = _users(s, "frank")
        stub = scheduler_pb2_grpc.SchedulerServiceStub(grpc.insecure_channel(s.target))
        with pytest.raises(grpc.RpcError) as info:
            stub.UploadDataset(iter([_header(len(DATA))]), metadata=metadata(key), timeout=30)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        msg = info.value.details()
        assert msg.startswith(f"total_bytes: {len(DATA)} bytes would leave less than {2**62} bytes free on the")
        assert msg.endswith("promised to uploads in progress) (limits.min_free_disk_bytes)")
        assert not _parts(s)

        # A trainer's checkpoint upload (ArtifactService.BeginUpload) is refused the same way,
        # before a byte is sent, saying how many bytes it needs and how many are free.
        import hashlib

        from opentinker.artifact.v1 import artifact_pb2 as A
        from opentinker_common.artifacts import FileEntry, Manifest
        from opentinker_common.artifacts.remote import manifest_to_proto

        node = s.admin_key  # node keys write no artifacts; the disk check is the same for every writer
        m = Manifest("tasks/t1/a1/step_1", (FileEntry("w.bin", len(DATA), hashlib.sha256(DATA).hexdigest()),))
        artifacts = artifact_pb2_grpc.ArtifactServiceStub(grpc.insecure_channel(s.target))
        with pytest.raises(grpc.RpcError) as info:
            artifacts.BeginUpload(A.BeginUploadRequest(manifest=manifest_to_proto(m)), metadata=metadata(node))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        msg = info.value.details()
        assert msg.startswith(f"manifest: {len(DATA)} bytes still to upload would leave less than {2**62} bytes free")
        assert " bytes free) (limits.min_free_disk_bytes); tasks/t1/a1/step_1 was not stored" in msg


def test_upload_limit_config_defaults_and_ranges() -> None:
    from opentinker_scheduler.config import ConfigError, parse_config

    on = parse_config("auth: {enabled: true}\n").limits.resolved(auth_enabled=True)
    assert (on.max_uploads, on.upload_idle_timeout, on.upload_deadline) == (64, 60.0, 3600.0)
    assert (on.max_uploads_per_owner, on.max_checkpoint_uploads) == (4, 64)
    assert (on.max_dataset_bytes_per_owner, on.min_free_disk_bytes) == (10 * 2**30, 2**30)
    off = parse_config("").limits.resolved(auth_enabled=False)
    assert off.max_dataset_bytes_per_owner == 0 and off.upload_idle_timeout == 60.0  # timeouts hold in both modes
    assert (off.max_uploads_per_owner, off.max_checkpoint_uploads) == (0, 64)  # the pools hold in both modes
    with pytest.raises(ConfigError, match=r"limits\.upload_idle_timeout: expected a number in \[0\.1, 86400\]"):
        parse_config("limits: {upload_idle_timeout: 0}\n", "x.yaml")
