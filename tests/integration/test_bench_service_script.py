"""`scripts/bench_service.py` on the tiny test model: one round, the in-process side in a session
of its own (not the bench's), and the comparison written as its result file. No timing is
asserted: BENCHMARKS.md has the figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_one_round_runs_each_side_in_its_own_session_and_writes_the_result(tiny_model_dir, tmp_path) -> None:
    results = tmp_path / "results"
    args = ["--model", str(tiny_model_dir), "--steps", "3", "--rounds", "1"]
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench_service.py"), *args],
        cwd=REPO,
        env={**os.environ, "BENCH_RESULTS_DIR": str(results), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
        start_new_session=True,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "round 1 in-process:" in proc.stdout and "round 1 service:" in proc.stdout
    record = json.loads((results / "service-grpo-step.json").read_text())
    assert record["make"] == "make bench-service"
    assert record["ratios"][0]["label"].startswith("median step time, service / in-process")
    sessions = record["details"]["sessions"]
    assert len(sessions["in_process"]) == 1 and sessions["in_process"][0] != sessions["bench"]
