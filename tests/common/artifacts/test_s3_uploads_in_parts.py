"""Presigned uploads in parts, on a real SeaweedFS: a file over ``multipart_part_bytes`` gets
one presigned PUT per part (a multipart upload the store starts), a resumed upload signs only
the parts missing, the commit assembles the parts and copies the file in parts (CopyObject
stops at 5 GiB), and an upload that fails or is abandoned leaves no parts in the bucket.

The part size here is S3's smallest, 5 MiB, so a file of 12 MiB takes three parts as a file
over 5 GiB does with the default."""

from __future__ import annotations

import hashlib
import os
import uuid

import pytest
import urllib3

from opentinker_common.artifacts import ArtifactExists, FileEntry, Manifest, S3ArtifactStore, S3Location
from opentinker_common.artifacts.local import UploadIncomplete
from opentinker_common.artifacts.s3 import MIN_PART_BYTES

PART = MIN_PART_BYTES


@pytest.fixture
def store(s3_env) -> S3ArtifactStore:
    location = S3Location(bucket=s3_env.bucket, endpoint=s3_env.endpoint, prefix=f"parts-{uuid.uuid4().hex[:8]}")
    return S3ArtifactStore(location, multipart_part_bytes=PART)


def _manifest(key: str, files: dict[str, bytes]) -> Manifest:
    entries = [FileEntry(name, len(data), hashlib.sha256(data).hexdigest()) for name, data in files.items()]
    return Manifest(key, tuple(entries))


def _send(put, data: bytes) -> None:
    length = int(put.headers["Content-Length"])
    body = data[put.offset : put.offset + length]
    resp = urllib3.request(put.method, put.url, body=body, headers=put.headers, retries=False)
    assert resp.status == 200, resp.data


def _uploads(store: S3ArtifactStore) -> list[str]:
    listed = store._client.list_multipart_uploads(Bucket=store.location.bucket, Prefix=store.location.prefix)
    return [u["Key"] for u in listed.get("Uploads", ())]


def test_a_file_over_the_part_size_is_sent_in_presigned_parts_and_committed(store, s3_env, tmp_path):
    big = os.urandom(2 * PART + 12345)
    files = {"model.safetensors": big, "config.json": b"{}"}
    m = _manifest("tasks/t1/a1/step_1", files)
    begun = store.begin_upload(m, expires_s=60)
    index = [f.path for f in m.files].index("model.safetensors")
    parts = [p for p in begun.puts if p.file_index == index]
    assert [(p.offset, p.headers["Content-Length"]) for p in parts] == [
        (0, str(PART)),
        (PART, str(PART)),
        (2 * PART, "12345"),
    ]
    (small,) = [p for p in begun.puts if p.file_index != index]
    assert small.headers["x-amz-checksum-sha256"]  # a small file still goes in one checked PUT
    _send(small, b"{}")
    _send(parts[0], big)
    with pytest.raises(UploadIncomplete, match=f"holds {PART} of {len(big)} bytes \\(1 of 3 parts\\)"):
        store.commit_upload(begun.upload_id)

    # begun again (a trainer resuming): the same upload, URLs for the parts still missing only
    again = store.begin_upload(m, expires_s=60)
    assert again.upload_id == begun.upload_id
    assert again.received_bytes[index] == PART
    assert [p.offset for p in again.puts] == [PART, 2 * PART]
    for put in again.puts:
        _send(put, big)
    ref = store.commit_upload(begun.upload_id)
    assert ref.manifest_sha256 == m.sha256
    out = store.get_folder(m.key, tmp_path / "out")
    assert out.sha256 == m.sha256 and (tmp_path / "out" / "model.safetensors").read_bytes() == big
    # copied under the key in parts, the staged upload and its parts gone
    head = s3_env.client().head_object(Bucket=s3_env.bucket, Key=store._obj(m.key, ".data", "model.safetensors"))
    assert head["ETag"].strip('"').endswith("-3"), head["ETag"]
    assert _uploads(store) == []
    listed = s3_env.client().list_objects_v2(Bucket=s3_env.bucket, Prefix=store.location.prefix + ".uploads/")
    assert listed.get("KeyCount", 0) == 0


def test_an_upload_in_parts_whose_key_was_taken_meanwhile_is_aborted(store, tmp_path):
    key = "tasks/t1/a1/step_2"
    big = os.urandom(PART + 1)
    begun = store.begin_upload(_manifest(key, {"w": big}), expires_s=60)
    _send(begun.puts[0], big)
    assert len(_uploads(store)) == 1
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "w").write_bytes(b"committed first")
    store.put_folder(key, tmp_path / "other")
    with pytest.raises(ArtifactExists):
        store.commit_upload(begun.upload_id)
    assert _uploads(store) == [], "the failed commit left its parts in the bucket"


def test_an_abandoned_upload_in_parts_is_aborted(store):
    big = os.urandom(PART + 1)
    m = _manifest("tasks/t1/a1/step_4", {"w": big})
    begun = store.begin_upload(m, expires_s=60)
    _send(begun.puts[0], big)
    assert len(_uploads(store)) == 1
    assert store.abort_abandoned_uploads(idle_s=3600) == []  # still live: kept
    assert len(_uploads(store)) == 1
    assert store.abort_abandoned_uploads(idle_s=-1) == [begun.upload_id]
    assert _uploads(store) == []
