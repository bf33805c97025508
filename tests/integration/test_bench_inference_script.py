"""`scripts/bench_inference.py`'s continuous-batching comparison on the tiny test model: ours on the
base model against transformers' continuous batching, each side in processes of its own, each in a
session of its own, in ABBA order, written as its result file with tokens/s, TTFT and peak RSS.
No timing is asserted: BENCHMARKS.md has the figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

from bench_inference import PROMPTS  # noqa: E402


def test_the_cb_comparison_runs_each_side_in_its_own_session_with_a_prompt_per_stream(tiny_model_dir, tmp_path) -> None:
    assert len(set(PROMPTS)) == len(PROMPTS) >= 8  # 8 adapters and the base: a prompt for each
    results = tmp_path / "results"
    args = ["--model", str(tiny_model_dir), "--parts", "cb", "--streams", "1,2", "--cb-repeats", "2"]
    args += ["--requests", "1", "--min-requests", "1", "--conc-tokens", "2"]
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench_inference.py"), *args],
        cwd=REPO,
        env={**os.environ, "BENCH_RESULTS_DIR": str(results), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    order = [line.split(", ")[1] for line in proc.stdout.splitlines() if line.startswith("repeat ")]
    assert [o.split()[0] for o in order] == ["ours", "transformers", "transformers", "ours"]  # ABBA
    record = json.loads((results / "inference-cb.json").read_text())
    labels = [r["label"] for r in record["ratios"]]
    assert labels == [
        "1 stream, tokens/s ours / transformers CB",
        "2 streams, tokens/s ours / transformers CB",
        "peak RSS, ours / transformers CB (lower is better)",
        "TTFT p50 at 1 stream, ours / transformers CB (lower is better)",
    ]
    assert all(r["value"] > 0 for r in record["ratios"])
    details = record["details"]
    assert details["side processes, each in a session of its own"] == 4
    assert len(details["2 streams tok/s ratio per repeat"]) == 2
    assert all(t > 0 for t in details["1 streams TTFT p50 ms ours, cb"])
    assert not (results / "inference-stream-generate.json").exists()  # --parts cb: that part did not run
