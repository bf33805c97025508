"""A worker's use of the artifact store: publishing with retries, the bounded LRU cache, resume
falling back past a corrupted checkpoint. Real local stores; the faults are a store whose folder
is gone (replaced by a file) and real corruption of stored bytes."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from opentinker.common.v1 import common_pb2
from opentinker_common.artifacts import LocalArtifactStore, checkpoint_key
from opentinker_trainer.worker_artifacts import ArtifactCache, CheckpointPublisher, CheckpointStoreFailed, StoreSettings
from opentinker_trainer.worker_artifacts import fetch_checkpoint


def _ckpt(folder: Path, data: bytes) -> Path:
    folder.mkdir(parents=True)
    (folder / "adapter_model.safetensors").write_bytes(data)
    (folder / "trainer_state.pt").write_bytes(b"state" + data[:8])
    return folder


def _report(store, ref, step) -> common_pb2.Checkpoint:
    ck = common_pb2.Checkpoint(task_id="t", attempt=1, step=step, format="peft_lora")
    ck.artifact.key, ck.artifact.manifest_sha256, ck.artifact.total_bytes = (
        ref.key,
        ref.manifest_sha256,
        ref.total_bytes,
    )
    return ck


def test_publish_stores_and_caches_so_a_resume_downloads_nothing(tmp_path):
    store = LocalArtifactStore(tmp_path / "store")
    cache = ArtifactCache(tmp_path / "cache", 10**9)
    pub = CheckpointPublisher(store, "t", 1, StoreSettings(), cache, sleep=lambda s: None)
    ref = pub.publish(2, _ckpt(tmp_path / "step_2", b"a" * 1000), final=False, fmt="peft_lora")
    assert ref.key == checkpoint_key("t", 1, 2) and store.list() == [ref.key]
    folder, used = fetch_checkpoint(store, cache, _report(store, ref, 2))
    assert (folder / "adapter_model.safetensors").read_bytes() == b"a" * 1000 and used.step == 2
    assert cache.downloads == 0  # adopted when written


def test_a_sessions_state_and_sampler_save_of_one_step_are_stored_apart(tmp_path):
    """A training session may save a state and a sampler copy at the same step: each is stored
    under its own name, neither replaces the other."""
    store = LocalArtifactStore(tmp_path / "store")
    pub = CheckpointPublisher(store, "t", 2, StoreSettings(), None, sleep=lambda s: None)
    state = pub.publish(5, _ckpt(tmp_path / "state_after5", b"s" * 500), final=False, fmt="peft_lora")
    sampler = pub.publish(5, _ckpt(tmp_path / "sampler_samp5", b"w" * 50), final=False, fmt="peft_lora")
    assert (state.key, sampler.key) == ("tasks/t/a2/state_after5", "tasks/t/a2/sampler_samp5")
    assert sorted(store.list()) == sorted([state.key, sampler.key])
    folder, _ = fetch_checkpoint(store, ArtifactCache(tmp_path / "cache", 10**9), _report(store, state, 5))
    assert (folder / "adapter_model.safetensors").read_bytes() == b"s" * 500  # the state, whole
    assert checkpoint_key("t", 2, 5) == "tasks/t/a2/step_5"  # a trainer's periodic ones: by step


def test_a_store_that_keeps_failing_skips_then_fails_the_task(tmp_path):
    store = LocalArtifactStore(tmp_path / "store")
    sleeps: list[float] = []
    pub = CheckpointPublisher(store, "t", 1, StoreSettings("local", 3, 2), None, sleep=sleeps.append)
    src = _ckpt(tmp_path / "step_2", b"x" * 10)
    assert pub.publish(2, src, final=False, fmt="peft_lora") is not None
    shutil.rmtree(tmp_path / "store")  # the store's disk is gone
    (tmp_path / "store").write_text("not a folder")
    assert pub.publish(4, src, final=False, fmt="peft_lora") is None  # skipped, training goes on
    assert sleeps == [1.0, 2.0]  # retried with backoff
    with pytest.raises(CheckpointStoreFailed, match="2 checkpoints in a row.*last complete checkpoint is step 2"):
        pub.publish(6, src, final=False, fmt="peft_lora")


def test_a_final_checkpoint_that_cannot_be_stored_fails_at_once(tmp_path):
    store = LocalArtifactStore(tmp_path / "store")
    shutil.rmtree(tmp_path / "store")
    (tmp_path / "store").write_text("x")
    pub = CheckpointPublisher(store, "t", 1, StoreSettings("local", 1, 5), None, sleep=lambda s: None)
    with pytest.raises(CheckpointStoreFailed, match="the final checkpoint could not be stored"):
        pub.publish(9, _ckpt(tmp_path / "f", b"1"), final=True, fmt="peft_lora")


def test_a_corrupted_newest_checkpoint_falls_back_to_the_previous_complete_one(tmp_path):
    store = LocalArtifactStore(tmp_path / "store")
    cache = ArtifactCache(tmp_path / "cache", 10**9)
    old = store.put_folder(checkpoint_key("t", 1, 2), _ckpt(tmp_path / "s2", b"old" * 10), meta={"format": "peft_lora"})
    new = store.put_folder(checkpoint_key("t", 1, 4), _ckpt(tmp_path / "s4", b"new" * 10))
    (tmp_path / "store" / new.key / ".data" / "adapter_model.safetensors").write_bytes(b"bad" * 10)
    folder, used = fetch_checkpoint(store, cache, _report(store, new, 4))
    assert used.step == 2 and used.artifact.key == old.key
    assert (folder / "adapter_model.safetensors").read_bytes() == b"old" * 10
    # nothing of the refused one was cached
    assert sorted(p.name for p in cache.root.iterdir() if not p.name.startswith(".")) == [old.manifest_sha256]


def test_the_cache_is_bounded_least_recently_used_out_first(tmp_path):
    store = LocalArtifactStore(tmp_path / "store")
    refs = [store.put_folder(f"k/{i}", _ckpt(tmp_path / f"s{i}", bytes([i]) * 4000)) for i in range(3)]
    cache = ArtifactCache(tmp_path / "cache", max_bytes=9000)  # room for two
    a = cache.fetch(store, refs[0])
    cache.fetch(store, refs[1])
    cache.fetch(store, refs[0])  # a hit: now the most recent
    cache.fetch(store, refs[2])  # evicts refs[1]
    assert cache.downloads == 3 and a.exists()
    assert not (cache.root / refs[1].manifest_sha256).exists()
