"""scan_folder: every file's size and SHA-256, sorted by path, the same whether the large files
are hashed side by side (in threads) or one after another."""

from __future__ import annotations

import hashlib
import os

from opentinker_common.artifacts import manifest


def test_large_files_hashed_in_parallel_give_the_same_entries(tmp_path, monkeypatch) -> None:
    files = {"model.safetensors": os.urandom(300_000), "sub/optimizer.pt": os.urandom(200_000), "config.json": b"{}"}
    files["trainer_state.pt"] = os.urandom(150_000)
    for name, data in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(data)
    want = [(name, len(data), hashlib.sha256(data).hexdigest()) for name, data in sorted(files.items())]
    monkeypatch.setattr(manifest, "PARALLEL_HASH_BYTES", 100_000)  # three "large" files here
    got = [(e.path, e.size_bytes, e.sha256) for _, e in manifest.scan_folder(tmp_path)]
    monkeypatch.setattr(manifest, "PARALLEL_HASH_BYTES", 1 << 60)  # none: one after another
    one_by_one = [(e.path, e.size_bytes, e.sha256) for _, e in manifest.scan_folder(tmp_path)]
    assert got == one_by_one == want
