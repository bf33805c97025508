"""One contract, every backend: put/get/list/delete, the manifest written last, hashes checked."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from opentinker_common.artifacts import (
    ArtifactCorrupt,
    ArtifactExists,
    ArtifactNotFound,
    InvalidArtifact,
    LocalArtifactStore,
    Manifest,
    checkpoint_key,
)


def make_folder(root: Path, files: dict[str, bytes]) -> Path:
    root.mkdir(parents=True)
    for rel, data in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    return root


FILES = {
    "adapter_config.json": b'{"r": 4}',
    "adapter_model.safetensors": os.urandom(3 * 1024 * 1024 + 17),  # several chunks
    "sub/trainer_state.pt": b"state",
    "empty.txt": b"",
}


def test_put_then_get_gives_the_same_bytes(store, tmp_path):
    src = make_folder(tmp_path / "src", FILES)
    ref = store.put_folder("tasks/t1/a1/step_10", src, meta={"format": "peft_lora"})
    assert ref.key == "tasks/t1/a1/step_10"
    assert ref.total_bytes == sum(len(v) for v in FILES.values())
    m = store.manifest(ref.key, expect_sha256=ref.manifest_sha256)
    assert [f.path for f in m.files] == sorted(FILES)
    assert m.meta == {"format": "peft_lora"}
    for f in m.files:
        assert f.sha256 == hashlib.sha256(FILES[f.path]).hexdigest()
    out = tmp_path / "out"
    store.get_folder(ref.key, out, expect_sha256=ref.manifest_sha256)
    assert {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()} == FILES


def test_list_sees_committed_keys_only_under_the_prefix(store, tmp_path):
    src = make_folder(tmp_path / "src", {"a": b"1"})
    for key in ("tasks/t1/a1/step_10", "tasks/t1/a2/step_20", "tasks/t2/a1/step_10"):
        store.put_folder(key, src)
    assert store.list("tasks/t1/") == ["tasks/t1/a1/step_10", "tasks/t1/a2/step_20"]
    assert len(store.list()) >= 3


def test_delete_is_idempotent_and_removes_everything(store, tmp_path):
    src = make_folder(tmp_path / "src", {"a": b"1", "b/c": b"2"})
    store.put_folder("tasks/t1/a1/step_10", src)
    assert store.delete("tasks/t1/a1/step_10") is True
    assert store.delete("tasks/t1/a1/step_10") is False
    assert store.list("tasks/t1/") == []
    with pytest.raises(ArtifactNotFound, match="tasks/t1/a1/step_10"):
        store.manifest("tasks/t1/a1/step_10")
    with pytest.raises(ArtifactNotFound):
        store.get_folder("tasks/t1/a1/step_10", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_committed_artifact_is_immutable(store, tmp_path):
    ref = store.put_folder("k/x", make_folder(tmp_path / "one", {"a": b"1", "old": b"o"}))
    with pytest.raises(ArtifactExists, match="k/x is already committed with other content"):
        store.put_folder("k/x", make_folder(tmp_path / "two", {"a": b"22"}))
    store.get_folder("k/x", tmp_path / "out", expect_sha256=ref.manifest_sha256)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["a", "old"]
    assert (tmp_path / "out" / "a").read_bytes() == b"1"


def test_putting_the_same_content_again_succeeds(store, tmp_path):
    ref = store.put_folder("k/x", make_folder(tmp_path / "one", {"a": b"1"}))
    again = store.put_folder("k/x", make_folder(tmp_path / "two", {"a": b"1"}))
    assert again == ref
    assert store.list("k/") == ["k/x"]


def test_a_stale_manifest_hash_is_refused(store, tmp_path):
    old = store.put_folder("k/x", make_folder(tmp_path / "one", {"a": b"1"}))
    store.delete("k/x")
    store.put_folder("k/x", make_folder(tmp_path / "two", {"a": b"2"}))
    with pytest.raises(ArtifactCorrupt, match="manifest hash"):
        store.get_folder("k/x", tmp_path / "out", expect_sha256=old.manifest_sha256)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("key", ["", "/abs", "a//b", "a/../b", "a/.manifest.json", "a/.data", "a b", "x" * 600])
def test_bad_keys_are_refused(store, tmp_path, key):
    src = make_folder(tmp_path / "src", {"a": b"1"})
    with pytest.raises(InvalidArtifact, match="artifact key"):
        store.put_folder(key, src)


def test_a_missing_folder_is_refused(store, tmp_path):
    with pytest.raises(InvalidArtifact, match="not a folder"):
        store.put_folder("k/x", tmp_path / "nope")


def test_checkpoint_keys_keep_attempts_apart():
    assert checkpoint_key("task-1", 2, 30) == "tasks/task-1/a2/step_30"
    assert checkpoint_key("task-1", 2, 30, final=True) == "tasks/task-1/a2/final_30"


# ---------------------------------------------------------------------- corruption, per backend


def test_local_corrupted_file_is_refused_and_leaves_nothing(tmp_path):
    store = LocalArtifactStore(tmp_path / "artifacts")
    store.put_folder("k/x", make_folder(tmp_path / "src", {"a": b"hello", "b": b"world"}))
    (tmp_path / "artifacts" / "k" / "x" / ".data" / "b").write_bytes(b"WORLD")
    with pytest.raises(ArtifactCorrupt, match="file b"):
        store.get_folder("k/x", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == []


def test_s3_corrupted_object_is_refused(s3_store, s3_env, tmp_path):
    ref = s3_store.put_folder("k/x", make_folder(tmp_path / "src", {"a": b"hello", "b": b"world"}))
    s3_env.client().put_object(Bucket=s3_env.bucket, Key=s3_store.location.prefix + "k/x/.data/b", Body=b"WORLD")
    with pytest.raises(ArtifactCorrupt, match="file b"):
        s3_store.get_folder("k/x", tmp_path / "out", expect_sha256=ref.manifest_sha256)
    assert not (tmp_path / "out").exists()


def test_s3_corrupted_manifest_is_refused(s3_store, s3_env, tmp_path):
    ref = s3_store.put_folder("k/x", make_folder(tmp_path / "src", {"a": b"hello"}))
    m = s3_store.manifest("k/x")
    forged = Manifest("k/x", m.files, {"format": "other"})
    key = s3_store.location.prefix + "k/x/.manifest.json"
    s3_env.client().put_object(Bucket=s3_env.bucket, Key=key, Body=forged.to_json())
    with pytest.raises(ArtifactCorrupt, match="manifest hash"):
        s3_store.manifest("k/x", expect_sha256=ref.manifest_sha256)


def test_s3_files_without_manifest_are_invisible(s3_store, s3_env, tmp_path):
    """An upload killed before its manifest: files there, artifact not."""
    s3_env.client().put_object(Bucket=s3_env.bucket, Key=s3_store.location.prefix + "k/half/.data/a", Body=b"1")
    assert s3_store.list("k/") == []
    with pytest.raises(ArtifactNotFound):
        s3_store.manifest("k/half")
