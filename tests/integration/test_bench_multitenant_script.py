"""`scripts/bench_multitenant.py` on the tiny test model: the model host and its peer, one worker
process per task, in alternating runs, each process in a session of its own, the comparison
written as its result file. No timing is asserted: BENCHMARKS.md has the figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_host_and_worker_processes_alternate_in_sessions_of_their_own(tiny_model_dir, tmp_path) -> None:
    results = tmp_path / "results"
    args = ["--model", str(tiny_model_dir), "--tenants", "2", "--steps", "3", "--pairs", "2"]
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench_multitenant.py"), *args],
        cwd=REPO,
        env={**os.environ, "BENCH_RESULTS_DIR": str(results)},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    sides = [line.split(",")[0] for line in proc.stdout.splitlines() if ", 2 tasks, run " in line]
    assert sides == ["host", "workers", "workers", "host"]
    record = json.loads((results / "multitenant-host.json").read_text())
    assert [r["label"] for r in record["ratios"]] == [
        "aggregate steps/s, host / processes",
        "peak RSS, host / processes (lower is better)",
        "CPU seconds per step, processes / host",
    ]
    details = record["details"]
    assert len(details["steps_per_s_host"]) == len(details["steps_per_s_workers"]) == 2
    sessions = details["sessions"]
    every = sessions["hosts"] + [s for run in sessions["workers"] for s in run]
    assert len(set(every)) == 2 + 2 * 2 and sessions["bench"] not in every
