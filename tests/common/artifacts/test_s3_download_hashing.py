"""A get from the ``s3`` store hashes each file in file order, in its own thread, while boto3
writes the file's ranges in whatever order they arrive: the hash is the file's, the bytes are
where they belong, a range that never came leaves the hash short and a range written again is
hashed as it is left (the manifest check then refuses a file of other bytes). The last tests
read files in ranges from a real SeaweedFS."""

from __future__ import annotations

import hashlib
import os
import random
import threading
from concurrent.futures import Future

import pytest

from opentinker_common.artifacts import ArtifactCorrupt
from opentinker_common.artifacts import s3 as s3_module
from opentinker_common.artifacts.s3 import _RangeFile


def _hash_while(f: _RangeFile, write, failure: BaseException | None = None) -> tuple[int, str]:
    """Run ``write()`` in a thread, as boto3's I/O thread writes, then end the transfer, with
    ``failure`` if given; this thread hashes meanwhile. Returns what
    :meth:`_RangeFile.hash_as_written` returns."""
    done: Future = Future()

    def transfer() -> None:
        write()
        if failure is None:
            done.set_result(None)
        else:
            done.set_exception(failure)
        f.on_done(done)

    writer = threading.Thread(target=transfer)
    writer.start()
    got = f.hash_as_written(done)
    writer.join()
    return got


def _download(f: _RangeFile, data: bytes, ranges: list[tuple[int, int]]) -> tuple[int, str]:
    """Write ``ranges`` of ``data`` in a thread, as boto3's I/O thread does, while this one hashes."""

    def write() -> None:
        for start, end in ranges:
            f.seek(start)
            f.write(data[start:end])

    return _hash_while(f, write)


def test_ranges_in_any_order_hash_to_the_files_sha256(tmp_path):
    data = os.urandom(3 * 1024 * 1024 + 17)
    step = 256 * 1024
    ranges = [(i, min(i + step, len(data))) for i in range(0, len(data), step)]
    random.Random(7).shuffle(ranges)
    ranges.append(ranges[3])  # a range sent twice (a retried GET)
    f = _RangeFile(tmp_path / "sub" / "w", len(data), threading.Condition())
    assert _download(f, data, ranges) == (len(data), hashlib.sha256(data).hexdigest())
    assert (tmp_path / "sub" / "w").read_bytes() == data


def test_a_missing_range_leaves_the_hash_short(tmp_path):
    data = os.urandom(1024 * 1024)
    f = _RangeFile(tmp_path / "w", len(data), threading.Condition())
    size, _ = _download(f, data, [(0, 1000), (2000, len(data))])
    f.close()
    assert size == 1000


def test_overlapping_ranges_in_any_order_hash_to_the_files_sha256(tmp_path):
    data = os.urandom(2 * 1024 * 1024 + 5)
    rng = random.Random(11)
    step = 64 * 1024
    ranges = [(i, min(i + step, len(data))) for i in range(0, len(data), step)]
    for _ in range(40):  # retried ranges that start and end elsewhere than the first ones
        start = rng.randrange(len(data))
        ranges.append((start, min(len(data), start + rng.randrange(1, 3 * step))))
    rng.shuffle(ranges)
    f = _RangeFile(tmp_path / "w", len(data), threading.Condition())
    assert _download(f, data, ranges) == (len(data), hashlib.sha256(data).hexdigest())
    assert (tmp_path / "w").read_bytes() == data


def test_a_failed_transfer_reads_its_partial_file_once(tmp_path, monkeypatch):
    # Ranges past a gap were written, then the transfer failed: the bytes before the gap are
    # hashed as they came and not read again before the error goes up.
    data = os.urandom(1024 * 1024)
    read = []
    hash_mapped = s3_module._hash_mapped

    def counted(digest, fd, start, end):
        read.append(end - start)
        hash_mapped(digest, fd, start, end)

    monkeypatch.setattr(s3_module, "_hash_mapped", counted)
    f = _RangeFile(tmp_path / "w", len(data), threading.Condition())

    def write() -> None:
        for start, end in ((0, 512 * 1024), (600 * 1024, len(data))):
            f.seek(start)
            f.write(data[start:end])

    got = _hash_while(f, write, ConnectionError("the stream broke"))
    f.close()
    assert got == (512 * 1024, hashlib.sha256(data[: 512 * 1024]).hexdigest())
    assert sum(read) == 512 * 1024


class _CaughtUp(threading.Condition):
    """The hashing thread's condition: ``caught_up`` is set when that thread waits while every
    byte of the file is written, which it does only once it has hashed them all."""

    def __init__(self) -> None:
        super().__init__()
        self.file: _RangeFile | None = None
        self.caught_up = threading.Event()

    def wait(self, timeout: float | None = None) -> bool:
        if self.file is not None and self.file.written >= self.file.size_bytes:
            self.caught_up.set()
        return super().wait(timeout)


def test_a_range_written_again_with_other_bytes_after_it_was_hashed_is_hashed_as_left(tmp_path):
    # A broken stream makes boto3 fetch its range again and write it over; when the object's
    # bytes differ by then, the hash must be that of the bytes left in the file, not the first.
    data = os.urandom(1024 * 1024)
    other = os.urandom(4096)
    changed = _CaughtUp()
    f = _RangeFile(tmp_path / "w", len(data), changed)
    changed.file = f

    def write() -> None:
        f.seek(0)
        f.write(data)
        assert changed.caught_up.wait(60), "the hashing thread did not hash the written file"
        f.seek(8192)
        f.write(other)

    got = _hash_while(f, write)
    left = (tmp_path / "w").read_bytes()
    assert left == data[:8192] + other + data[8192 + len(other) :]
    assert got == (len(data), hashlib.sha256(left).hexdigest())
    assert got[1] != hashlib.sha256(data).hexdigest()


#: More than one range of boto3's transfer manager (8 MiB each), plus an odd tail.
RANGED_BYTES = 20 * 1024 * 1024 + 3


def _ranged_checkpoint(root, monkeypatch):
    """A folder with a file of several ranges and a small one, both read by the transfer manager
    (every file over 1 byte is, here; none by one GET)."""
    monkeypatch.setattr(s3_module, "ONE_GET_BYTES", 1)

    def one_get(*args):
        raise AssertionError("a file was read by one GET, not by the transfer manager")

    monkeypatch.setattr(s3_module.S3ArtifactStore, "_fetch_file", one_get)
    root.mkdir()
    data = os.urandom(RANGED_BYTES)
    (root / "model.safetensors").write_bytes(data)
    (root / "config.json").write_bytes(b"{}")
    return data


def test_a_file_read_in_ranges_from_the_store_comes_back_whole(s3_store, tmp_path, monkeypatch):
    data = _ranged_checkpoint(tmp_path / "src", monkeypatch)
    ref = s3_store.put_folder("k/ranged", tmp_path / "src")
    s3_store.get_folder("k/ranged", tmp_path / "out", expect_sha256=ref.manifest_sha256)
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == data
    assert (tmp_path / "out" / "config.json").read_bytes() == b"{}"


def test_a_file_read_in_ranges_with_other_bytes_is_refused_and_leaves_nothing(s3_store, s3_env, tmp_path, monkeypatch):
    data = _ranged_checkpoint(tmp_path / "src", monkeypatch)
    s3_store.put_folder("k/ranged", tmp_path / "src")
    flipped = bytearray(data)
    flipped[RANGED_BYTES - 10] ^= 1  # in the last range: the hash has passed every other byte
    name = s3_store.location.prefix + "k/ranged/.data/model.safetensors"
    s3_env.client().put_object(Bucket=s3_env.bucket, Key=name, Body=bytes(flipped))
    with pytest.raises(ArtifactCorrupt, match="file model.safetensors"):
        s3_store.get_folder("k/ranged", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == []
