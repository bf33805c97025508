"""A get from the ``s3`` store hashes each file in file order while boto3 writes its ranges in
whatever order they arrive: the hash is the file's, the bytes are where they belong, and a range
that never came leaves the hash short (the manifest check then refuses the file)."""

from __future__ import annotations

import hashlib
import os
import random

from opentinker_common.artifacts.s3 import _HashingSink


def _write(sink: _HashingSink, data: bytes, ranges: list[tuple[int, int]]) -> None:
    for start, end in ranges:
        sink.seek(start)
        sink.write(data[start:end])


def test_ranges_in_any_order_hash_to_the_files_sha256(tmp_path):
    data = os.urandom(3 * 1024 * 1024 + 17)
    step = 256 * 1024
    ranges = [(i, min(i + step, len(data))) for i in range(0, len(data), step)]
    random.Random(7).shuffle(ranges)
    ranges.append(ranges[3])  # a range sent twice (a retried GET)
    sink = _HashingSink(tmp_path / "sub" / "w", len(data))
    _write(sink, data, ranges)
    sink.close()
    assert sink.size == len(data) and sink.digest.hexdigest() == hashlib.sha256(data).hexdigest()
    assert (tmp_path / "sub" / "w").read_bytes() == data


def test_a_missing_range_leaves_the_hash_short(tmp_path):
    data = os.urandom(1024 * 1024)
    sink = _HashingSink(tmp_path / "w", len(data))
    _write(sink, data, [(0, 1000), (2000, len(data))])
    sink.close()
    assert sink.size == 1000


def test_an_empty_file_is_created_at_close(tmp_path):
    sink = _HashingSink(tmp_path / "d" / "empty", 0)
    sink.close()
    assert (tmp_path / "d" / "empty").read_bytes() == b"" and sink.digest.hexdigest() == hashlib.sha256().hexdigest()
