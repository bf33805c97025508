"""`make bench` smoke run: the scheduler scale benchmark completes with tiny numbers and prints
its figures. Timings are never asserted here (they depend on the machine); BENCHMARKS.md has them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_bench_quick_run_prints_the_figures(tmp_path) -> None:
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench_scheduler.py"), "--quick", "--json", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = proc.stdout
    for label in (
        "submits/s",
        "CPU per submit / empty call",
        "submit->assign p50/p99",
        "heartbeats/s ingested",
        "CPU s per 1000 heartbeats",
        "deep queue:",
        "scale signal:",
    ):
        assert label in text, f"{label!r} missing from the report:\n{text}"
    res = json.loads(out.read_text())
    phases = res["phases"]
    assert phases["throughput"]["submitted"] == res["args"]["tasks"]
    assert phases["unary"]["cpu_ms_per_call"] > 0 and phases["throughput"]["cpu_ratio_to_unary"] > 0
    assert phases["throughput"]["all_assigned"] and phases["latency"]["all_assigned"]
    assert phases["steady"]["ingested_source"] == "scheduler counter"
    assert phases["flood"]["ingested_per_s"] > 0 and phases["steady"]["cpu_s_per_1000_hb"] >= 0
    scale = phases["scale"]  # the desired-trainers figure rose with the burst and fell back after it
    assert scale["reached"] and scale["fell_back"] and scale["desired_at_burst"] > scale["desired_before"]["rpc"]
    assert scale["rpc_change_from_first_submit_s"] >= 0 and scale["metric_fall_from_drained_s"] >= 0
    assert res["final"]["submit_errors"] == 0 and res["final"]["node_errors"] == []
    assert res["final"]["succeeded"] == res["final"]["submitted"], "every simulated task should finish"


def test_bench_splice_phase_compares_the_front_with_grpcs_own_port(tmp_path) -> None:
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench_scheduler.py"), "--quick", "--only", "splice"]
        + ["--json", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    splice = json.loads(out.read_text())["phases"]["splice"]
    assert len(splice["blocks"]["front"]) == len(splice["blocks"]["direct"]) == 1
    assert splice["front_submits_per_s_median"] > 0 and splice["direct_submits_per_s_median"] > 0
    assert splice["submits_per_s_ratio"] > 0
