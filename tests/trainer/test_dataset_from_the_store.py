"""A worker reads an uploaded dataset from the ``s3`` artifact store directly (a real SeaweedFS on
loopback), through the node-local cache keyed by hash; a stored object whose bytes are not the
dataset's is refused by hash and nothing of it is cached. The dataset is put there as the
scheduler puts every upload (``DatasetStore.publish``). No scheduler address is given: a worker
that asked the scheduler would fail with "does not know the scheduler's address"."""

from __future__ import annotations

import hashlib
import uuid

import pytest

from opentinker_common.artifacts import S3ArtifactStore, S3Location
from opentinker_scheduler.data.datasets import DatasetStore
from opentinker_trainer.worker_artifacts import ArtifactCache
from opentinker_trainer.context import UserError
from opentinker_trainer.workloads.sft_data import fetch_dataset

from tests.support.datasets import arithmetic_chat_jsonl


@pytest.fixture
def bucket(seaweedfs, monkeypatch):
    for k, v in seaweedfs.env().items():  # the operator's credentials, as a worker gets them
        monkeypatch.setenv(k, v)
    prefix = f"dsread-{uuid.uuid4().hex[:8]}/"
    store = S3ArtifactStore(S3Location(bucket=seaweedfs.bucket, endpoint=seaweedfs.endpoint, prefix=prefix))
    return store, seaweedfs.client(), prefix


def _upload(store, tmp_path, data: bytes) -> str:
    """Store ``data`` as the scheduler does on an upload (its folder, then the bucket); its id."""
    datasets = DatasetStore(tmp_path / "scheduler-datasets", mirror=store)
    upload = datasets.begin("train.jsonl", len(data))
    upload.write(data)
    info = upload.commit()
    datasets.publish(info.dataset_id)
    return info.dataset_id


def test_a_dataset_comes_from_the_bucket_cached_by_hash(bucket, tmp_path) -> None:
    store, _, _ = bucket
    data = arithmetic_chat_jsonl(tmp_path / "train.jsonl", n=6).read_bytes()
    dataset_id = _upload(store, tmp_path, data)
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
    store, s3, prefix = bucket
    data = arithmetic_chat_jsonl(tmp_path / "train.jsonl", n=6).read_bytes()
    dataset_id = _upload(store, tmp_path, data)
    hex_ = dataset_id.removeprefix("sha256:")
    cache = ArtifactCache(tmp_path / "node" / "artifact-cache", 10**9)

    # the object's bytes changed under its manifest
    bad = data.replace(b"What", b"Whom", 1)
    s3.put_object(Bucket=store.location.bucket, Key=f"{prefix}datasets/{hex_}/.data/data.jsonl", Body=bad)
    with pytest.raises(UserError, match=rf"dataset {dataset_id} in the S3 artifact store .* is corrupt: .*SHA-256"):
        fetch_dataset(dataset_id, None, tmp_path / "node" / "datasets", store=store, artifact_cache=cache)
    assert not [p for p in cache.root.iterdir() if not p.name.startswith(".")]  # nothing cached

    # bytes and manifest replaced together: the manifest holds, the dataset id does not
    (tmp_path / "forged").mkdir()
    (tmp_path / "forged" / "data.jsonl").write_bytes(bad)
    store.delete(f"datasets/{hex_}")  # committed artifacts are immutable: a forger deletes first
    store.put_folder(f"datasets/{hex_}", tmp_path / "forged")
    with pytest.raises(UserError, match=rf"data.jsonl hashes to sha256:[0-9a-f]{{16}}\.\.\., not {dataset_id}"):
        fetch_dataset(dataset_id, None, tmp_path / "node" / "datasets", store=store, artifact_cache=cache)
    assert not [p for p in cache.root.iterdir() if not p.name.startswith(".")] and cache.downloads == 0
