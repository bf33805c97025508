"""`make bench` smoke run: the scheduler scale benchmark completes with tiny numbers and prints
its figures. Timings are never asserted here (they depend on the machine); BENCHMARKS.md has them."""

from __future__ import annotations

import json
import os
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
    throughput = phases["throughput"]
    assert throughput["submitted"] + throughput["errors"].get("RESOURCE_EXHAUSTED", 0) == res["args"]["tasks"]
    assert phases["unary"]["cpu_ms_per_call"] > 0 and phases["throughput"]["cpu_ratio_to_unary"] > 0
    assert phases["throughput"]["all_assigned"] and phases["latency"]["all_assigned"]
    assert phases["steady"]["ingested_source"] == "scheduler counter"
    assert phases["flood"]["ingested_per_s"] > 0 and phases["steady"]["cpu_s_per_1000_hb"] >= 0
    scale = phases["scale"]  # the desired-trainers figure rose with the burst and fell back after it
    assert scale["reached"] and scale["fell_back"] and scale["desired_at_burst"] > scale["desired_before"]["rpc"]
    assert scale["rpc_change_from_first_submit_s"] >= 0 and scale["metric_fall_from_drained_s"] >= 0
    # A loaded machine may starve the scheduler past its submit-wait bound: those submits are
    # refused as the gate documents (RESOURCE_EXHAUSTED OVERLOADED, with RetryInfo), never
    # dropped or failed in any other way; every submit the scheduler took finishes.
    fin = res["final"]
    assert set(fin["submit_error_codes"]) <= {"RESOURCE_EXHAUSTED"}, fin["first_submit_errors"]
    assert fin["submit_errors"] == fin["refused_with_retry_info"], fin["first_submit_errors"]
    assert fin["node_errors"] == []
    assert fin["submitted"] > 0 and fin["succeeded"] == fin["submitted"], "every simulated task should finish"


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


def test_bench_quota_ab_switches_quotas_in_one_scheduler(tmp_path) -> None:
    """--ab-blocks: the quota queues are on (the scheduler lists them as limited) in the quotas
    blocks and gone in the others, ABBA, and the report gives pooled and per-pair ratios; the
    row of BENCHMARKS.md goes to $BENCH_RESULTS_DIR."""
    out = tmp_path / "bench.json"
    results = tmp_path / "results"
    args = ["--queues", "2", "--owners", "4", "--nodes", "4", "--tasks", "60", "--rate", "100", "--rate-tasks", "40"]
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench_scheduler.py"), *args, "--ab-blocks", "2", "--json", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "BENCH_RESULTS_DIR": str(results)},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "quotas on/off in one scheduler" in proc.stdout and "<= 1.2x" in proc.stdout
    res = json.loads(out.read_text())
    ab = res["runs"]["ab"]["phases"]["quota_ab"]
    assert [b["limited_queues"] for b in ab["blocks"]["quotas"]] == [2, 2]
    assert [b["limited_queues"] for b in ab["blocks"]["no_quotas"]] == [0, 0]
    assert all(b["all_assigned"] for bs in ab["blocks"].values() for b in bs)
    assert len(res["pair_ratios"]["p99_ms"]) == 2 and res["ratios"]["submits_per_s"] > 0
    assert res["runs"]["ab"]["final"]["succeeded"] == res["runs"]["ab"]["final"]["submitted"]
    row = json.loads((results / "scheduler-quotas.json").read_text())
    assert row["make"] == "make bench-sharing" and "2 quota queues and 4 owners" in row["what"]
    assert [r["value"] for r in row["ratios"]] == [
        round(res["ratios"]["submits_per_s"], 2),
        round(res["ratios"]["p99_ms"], 2),
    ]


def test_bench_backends_mode_runs_b1_on_sqlite_and_on_postgresql(tmp_path) -> None:
    # CI installs PostgreSQL (make test-deps); the script starts its own server on loopback.
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench_scheduler.py"), "--quick", "--backends", "--repeat", "1"]
        + ["--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for label in ("closed-loop submits/s", "submit->assign p99 ms @", "heartbeats/s ingested (flood)"):
        assert label in proc.stdout, f"{label!r} missing from the report:\n{proc.stdout}"
    res = json.loads(out.read_text())
    (lite,), (pg,) = res["blocks"]["sqlite"], res["blocks"]["postgres"]
    assert lite["store"].startswith("sqlite ") and pg["store"].startswith("postgres "), (lite["store"], pg["store"])
    # the latency phase offered half of what the calibration run measured, on both backends
    assert lite["phases"]["latency"]["offered_rate"] == pg["phases"]["latency"]["offered_rate"] == res["rate"] > 0
    for block in (lite, pg):
        assert block["phases"]["throughput"]["all_assigned"] and block["phases"]["latency"]["all_assigned"]
        assert block["final"]["node_errors"] == [] and block["final"]["succeeded"] == block["final"]["submitted"]
    assert set(res["ratios"]) >= {"throughput.submits_per_s", "latency.p99_ms", "flood.ingested_per_s"}
