"""`scripts/bench_multitenant.py` on the tiny test model: the batched and the unbatched model host
in alternating pairs, each host in a session of its own, the comparison written as its result
file. No timing is asserted: BENCHMARKS.md has the figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_batched_and_unbatched_hosts_alternate_in_sessions_of_their_own(tiny_model_dir, tmp_path) -> None:
    results = tmp_path / "results"
    args = ["--model", str(tiny_model_dir), "--tenants", "1,2", "--steps", "3", "--no-workers", "--pairs", "2"]
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench_multitenant.py"), *args],
        cwd=REPO,
        env={**os.environ, "BENCH_RESULTS_DIR": str(results)},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    kinds = [line.split("rollouts ")[1].split(":")[0] for line in proc.stdout.splitlines() if "tasks, rollouts" in line]
    assert kinds == ["not batched", "batched", "batched", "not batched"]
    record = json.loads((results / "multitenant-batched-rollouts.json").read_text())
    assert [r["label"] for r in record["ratios"]] == [
        "steps per CPU second, batched / not batched",
        "aggregate steps/s, batched / not batched",
    ]
    details = record["details"]
    assert len(details["steps_per_cpu_s_batched"]) == len(details["steps_per_cpu_s_not_batched"]) == 2
    sessions = details["sessions"]
    assert len(set(sessions["hosts"])) == 4 and sessions["bench"] not in sessions["hosts"]
