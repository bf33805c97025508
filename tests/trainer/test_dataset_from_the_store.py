"""A worker reads an uploaded dataset from the ``s3`` artifact store (a real SeaweedFS on
loopback) by the GET URLs a real scheduler presigns for its attempt credential, through the
node-local cache keyed by hash; a stored object whose bytes are not the dataset's is refused by
hash and nothing of it is cached. The dataset is put there as the scheduler puts every upload
(``DatasetStore.publish``). The worker holds no S3 credentials and is given no scheduler address
for datasets: a worker that asked the scheduler would fail with "does not know the scheduler's
address"."""

from __future__ import annotations

import hashlib
import uuid

import pytest

from opentinker_client import RLClient
from opentinker_common.artifacts import S3ArtifactStore, S3Location
from opentinker_common.artifacts.remote import RemoteArtifactStore
from opentinker_scheduler.data.datasets import DatasetStore
from opentinker_trainer.worker_artifacts import ArtifactCache
from opentinker_trainer.context import UserError
from opentinker_trainer.workloads.sft_data import fetch_dataset

from tests.support.datasets import arithmetic_chat_jsonl
from tests.support.raw_node import RawNode
from tests.support.security import AUTH_LOCAL_MODELS, LoopbackScheduler, metadata


@pytest.fixture
def bucket(seaweedfs, monkeypatch, tmp_path):
    """The worker's store (presigned URLs of a scheduler on its own prefix), the scheduler's own
    store of that prefix (which publishes uploads), an S3 client and the prefix."""
    for k, v in seaweedfs.env().items():  # the operator's credentials, for the scheduler only
        monkeypatch.setenv(k, v)
    prefix = f"dsread-{uuid.uuid4().hex[:8]}/"
    s3 = f"{{endpoint: '{seaweedfs.endpoint}', bucket: {seaweedfs.bucket}, prefix: {prefix}}}"
    config = AUTH_LOCAL_MODELS + f"artifacts:\n  backend: s3\n  s3: {s3}\n"
    with LoopbackScheduler(tmp_path / "state", config) as sched:
        publisher = S3ArtifactStore(S3Location(bucket=seaweedfs.bucket, endpoint=seaweedfs.endpoint, prefix=prefix))
        for k in seaweedfs.env():
            monkeypatch.delenv(k)
        with RLClient(sched.target, api_key=sched.admin_key) as root:
            node_key = root.keys.create("rack-1", "node")[1]
            user_key = root.keys.create("alice", "user")[1]
        with RLClient(sched.target, api_key=user_key) as user:
            task_id = user.submit_task(workload_type="lora_finetune", model="/models/m", gpu_count=0)
        node = RawNode(sched.target, node_key, "node-a")
        md = metadata(node.assignment(task_id).worker_credential)
        with sched.channel() as ch:
            desc = RemoteArtifactStore(ch, md, target=sched.target).describe_store()
            yield RemoteArtifactStore(ch, md, target=sched.target, s3=desc.s3), publisher, seaweedfs.client(), prefix
        node.leave()


def _upload(publisher, tmp_path, data: bytes) -> str:
    """Store ``data`` as the scheduler does on an upload (its folder, then the bucket); its id."""
    datasets = DatasetStore(tmp_path / "scheduler-datasets", mirror=publisher)
    upload = datasets.begin("train.jsonl", len(data))
    upload.write(data)
    info = upload.commit()
    datasets.publish(info.dataset_id)
    return info.dataset_id


def test_a_dataset_comes_from_the_bucket_cached_by_hash(bucket, tmp_path) -> None:
    store, publisher, _, _ = bucket
    data = arithmetic_chat_jsonl(tmp_path / "train.jsonl", n=6).read_bytes()
    dataset_id = _upload(publisher, tmp_path, data)
    cache = ArtifactCache(tmp_path / "node" / "artifact-cache", 10**9)
    got = fetch_dataset(dataset_id, None, tmp_path / "node" / "datasets", store=store, artifact_cache=cache)
    assert got.read_bytes() == data and cache.root in got.parents and cache.downloads == 1
    again = fetch_dataset(dataset_id, None, tmp_path / "node" / "datasets", store=store, artifact_cache=cache)
    assert again == got and cache.downloads == 1  # the second task on this node: from the cache

    # not in the bucket (uploaded before the scheduler used it): asked of the scheduler instead
    other = "sha256:" + hashlib.sha256(b"never uploaded").hexdigest()
    with pytest.raises(UserError, match="does not know the scheduler's address"):
        fetch_dataset(other, None, tmp_path / "node" / "datasets", store=store, artifact_cache=cache)


def test_a_corrupted_dataset_object_is_refused_by_hash(bucket, tmp_path) -> None:
    store, publisher, s3, prefix = bucket
    data = arithmetic_chat_jsonl(tmp_path / "train.jsonl", n=6).read_bytes()
    dataset_id = _upload(publisher, tmp_path, data)
    hex_ = dataset_id.removeprefix("sha256:")
    cache = ArtifactCache(tmp_path / "node" / "artifact-cache", 10**9)

    # the object's bytes changed under its manifest
    bad = data.replace(b"What", b"Whom", 1)
    s3.put_object(Bucket=publisher.location.bucket, Key=f"{prefix}datasets/{hex_}/.data/data.jsonl", Body=bad)
    with pytest.raises(UserError, match=rf"dataset {dataset_id} in the S3 artifact store .* is corrupt: .*SHA-256"):
        fetch_dataset(dataset_id, None, tmp_path / "node" / "datasets", store=store, artifact_cache=cache)
    assert not [p for p in cache.root.iterdir() if not p.name.startswith(".")]  # nothing cached

    # bytes and manifest replaced together: the manifest holds, the dataset id does not
    (tmp_path / "forged").mkdir()
    (tmp_path / "forged" / "data.jsonl").write_bytes(bad)
    publisher.delete(f"datasets/{hex_}")  # committed artifacts are immutable: a forger deletes first
    publisher.put_folder(f"datasets/{hex_}", tmp_path / "forged")
    with pytest.raises(UserError, match=rf"data.jsonl hashes to sha256:[0-9a-f]{{16}}\.\.\., not {dataset_id}"):
        fetch_dataset(dataset_id, None, tmp_path / "node" / "datasets", store=store, artifact_cache=cache)
    assert not [p for p in cache.root.iterdir() if not p.name.startswith(".")] and cache.downloads == 0
