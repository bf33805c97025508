"""The local store's resumable uploads: announce, continue where the held bytes end, check, commit."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from opentinker_common.artifacts import ArtifactCorrupt, ArtifactNotFound, FileEntry, InvalidArtifact, Manifest
from opentinker_common.artifacts.local import LocalArtifactStore, UploadOffsetMismatch

DATA = {"a.bin": os.urandom(5000), "b.txt": b"hello"}


def manifest(key="tasks/t/a1/step_1", data=DATA) -> Manifest:
    return Manifest(key, tuple(FileEntry(p, len(b), hashlib.sha256(b).hexdigest()) for p, b in data.items()))


def test_an_interrupted_upload_continues_where_it_stopped(tmp_path):
    store = LocalArtifactStore(tmp_path / "s")
    m = manifest()
    begun = store.begin_upload(m)
    assert begun.received_bytes == (0, 0) and not begun.committed
    store.write_chunk(begun.upload_id, 0, 0, DATA["a.bin"][:3000])
    # the writer dies here; a new one announces the same artifact and is told where to go on
    again = store.begin_upload(m)
    assert again.upload_id == begun.upload_id and again.received_bytes == (3000, 0)
    with pytest.raises(UploadOffsetMismatch, match="continue at 3000") as err:
        store.write_chunk(again.upload_id, 0, 0, DATA["a.bin"])
    assert err.value.held == 3000
    assert store.list() == []  # nothing visible before the commit
    store.write_chunk(again.upload_id, 0, 3000, DATA["a.bin"][3000:])
    store.write_chunk(again.upload_id, 1, 0, DATA["b.txt"])
    ref = store.commit_upload(again.upload_id)
    assert ref.manifest_sha256 == m.sha256
    assert store.begin_upload(m).committed
    store.get_folder(m.key, tmp_path / "out", expect_sha256=m.sha256)
    assert (tmp_path / "out" / "a.bin").read_bytes() == DATA["a.bin"]
    with pytest.raises(ArtifactNotFound, match="unknown"):
        store.commit_upload(again.upload_id)


def test_a_wrong_hash_is_refused_at_commit_and_that_file_dropped(tmp_path):
    store = LocalArtifactStore(tmp_path / "s")
    m = manifest()
    up = store.begin_upload(m).upload_id
    store.write_chunk(up, 0, 0, DATA["a.bin"])
    store.write_chunk(up, 1, 0, b"HELLO")
    with pytest.raises(ArtifactCorrupt, match="b.txt"):
        store.commit_upload(up)
    assert store.list() == []
    assert store.upload_status(up).received_bytes == (5000, 0)
    store.write_chunk(up, 1, 0, DATA["b.txt"])
    store.commit_upload(up)
    assert store.list() == [m.key]


def test_an_incomplete_upload_is_not_committed(tmp_path):
    store = LocalArtifactStore(tmp_path / "s")
    up = store.begin_upload(manifest()).upload_id
    store.write_chunk(up, 0, 0, DATA["a.bin"][:10])
    with pytest.raises(InvalidArtifact, match="a.bin holds 10 of 5000 bytes"):
        store.commit_upload(up)
    with pytest.raises(InvalidArtifact, match="more than its announced size"):
        store.write_chunk(up, 0, 10, DATA["a.bin"] * 2)
    with pytest.raises(InvalidArtifact, match="file_index"):
        store.write_chunk(up, 7, 0, b"x")
    with pytest.raises(InvalidArtifact, match="upload_id"):
        store.write_chunk("../../etc", 0, 0, b"x")


def test_leftovers_of_a_killed_put_are_cleaned_and_never_listed(tmp_path):
    root = tmp_path / "s"
    store = LocalArtifactStore(root)
    (root / ".staging" / "dead").mkdir()
    (root / "k" / "half" / ".data").mkdir(parents=True)  # files without a manifest
    (root / "k" / "half" / ".data" / "a").write_bytes(b"1")
    LocalArtifactStore(root)
    assert not (root / ".staging" / "dead").exists()
    assert store.list() == []


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare -m")
def test_a_full_disk_is_a_clear_error_and_nothing_is_recorded(tmp_path):
    """A real full disk: a 1 MiB tmpfs in a private mount namespace."""
    script = textwrap.dedent(
        """
        import os, sys
        from pathlib import Path
        from opentinker_common.artifacts import LocalArtifactStore, StoreFull
        root = Path(sys.argv[1])
        store = LocalArtifactStore(root / "store")
        src = Path(sys.argv[2])
        store.put_folder("k/small", src / "small")
        try:
            store.put_folder("k/big", src / "big")
        except StoreFull as exc:
            print("FULL:", exc)
        print("LIST:", store.list())
        print("STAGING:", os.listdir(root / "store" / ".staging"))
        """
    )
    src = tmp_path / "src"
    (src / "small").mkdir(parents=True)
    (src / "small" / "a").write_bytes(b"1" * 1000)
    (src / "big").mkdir()
    (src / "big" / "a").write_bytes(os.urandom(2 * 1024 * 1024))
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    repo = Path(__file__).resolve().parents[3]
    cmd = (
        f"mount -t tmpfs -o size=1m tmpfs {mnt} && "
        f"PYTHONPATH={repo}:{repo}/protos {sys.executable} -c '{script}' {mnt} {src}"
    )
    out = subprocess.run(["unshare", "-m", "sh", "-c", cmd], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "FULL:" in out.stdout and "disk full" in out.stdout and "k/big" in out.stdout
    assert "nothing was recorded" in out.stdout
    assert "LIST: ['k/small']" in out.stdout
    assert "STAGING: []" in out.stdout
