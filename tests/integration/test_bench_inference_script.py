"""`scripts/bench_inference.py`'s continuous-batching comparison on the tiny test model: ours with
every stream on the base model against transformers' continuous batching, stream i sending prompt
i on both sides, written as its result file. No timing is asserted: BENCHMARKS.md has the figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

from bench_inference import PROMPTS  # noqa: E402


def test_the_cb_comparison_is_base_against_base_with_a_prompt_per_stream(tiny_model_dir, tmp_path) -> None:
    assert len(set(PROMPTS)) == len(PROMPTS) >= 8  # 8 adapters and the base: a prompt for each
    results = tmp_path / "results"
    args = ["--model", str(tiny_model_dir), "--no-single", "--engines", "base,cb", "--streams", "1,2"]
    args += ["--requests", "1", "--conc-tokens", "2", "--probes", "0", "--rank", "2"]
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench_inference.py"), *args],
        cwd=REPO,
        env={**os.environ, "BENCH_RESULTS_DIR": str(results), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    record = json.loads((results / "inference-cb.json").read_text())
    labels = [r["label"] for r in record["ratios"]]
    assert labels == ["1 stream, ours / transformers CB", "2 streams, ours / transformers CB"]
    assert all(r["value"] > 0 for r in record["ratios"])
    assert set(record["details"]) == {f"{e} {c} streams tok/s" for e in ("base", "cb") for c in (1, 2)}
    assert not (results / "inference-stream-generate.json").exists()  # --no-single: that part did not run
