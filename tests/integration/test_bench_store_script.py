"""`scripts/bench_store.py` compares the s3 artifact store with boto3's own upload and download of
the same files to the same S3 server (a real SeaweedFS), and writes that comparison as its result
file. No timing is asserted: BENCHMARKS.md has the figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.seaweedfs import weed_binary

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(weed_binary() is None, reason="SeaweedFS (weed) is not installed")


def test_the_s3_store_is_compared_with_boto3_on_the_same_server_and_the_result_written(tmp_path: Path) -> None:
    results = tmp_path / "results"
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench_store.py"), "--sizes-mb", "2", "--repeat", "2"],
        cwd=REPO,
        env={**os.environ, "BENCH_RESULTS_DIR": str(results)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "x boto3" in proc.stdout and "plain copy" not in proc.stdout
    record = json.loads((results / "store-boto3.json").read_text())
    labels = [r["label"] for r in record["ratios"]]
    assert labels == ["2 MB write MB/s, s3 store / boto3", "2 MB read MB/s, s3 store / boto3"]
    assert all(r["value"] > 0 for r in record["ratios"])
    assert {"2 MB s3 (SeaweedFS)", "2 MB boto3 (SeaweedFS)", "2 MB local (gRPC)"} <= set(record["details"])
    assert record["make"] == "make bench-store" and record["goal"] == ">= 0.8x"
    for path in ("2 MB s3 (SeaweedFS)", "2 MB boto3 (SeaweedFS)"):
        assert record["details"][path]["write_cpu_s"] > 0 and record["details"][path]["read_cpu_s"] > 0
