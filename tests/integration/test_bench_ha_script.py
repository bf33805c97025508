"""`make bench-ha` smoke run: the HA benchmark completes with tiny numbers (5 nodes, one round)
and prints its figures. Timings are never asserted (BENCHMARKS.md has them)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_bench_ha_quick_run_prints_the_figures(tmp_path, postgres_server) -> None:
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench_ha.py"), "--quick", "--json", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    labels = ("failover (5 nodes", "all nodes re-registered", "first leader call after kill -9")
    for label in (*labels, "submits/s: sqlite", "x sqlite", "lease renewal:"):
        assert label in proc.stdout, (label, proc.stdout[-2000:])
    figures = json.loads(out.read_text())
    assert len(figures["failover"]["new_leader_s"]) == 1
    assert len(figures["failover"]["first_call_s"]["urls"]) == 1
    assert set(figures["submits"]["median_submits_per_s"]) == {
        "sqlite",
        "postgres-sync-on",
        "postgres-sync-off",
    }
