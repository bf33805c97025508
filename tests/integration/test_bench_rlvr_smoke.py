"""`make bench-rlvr` end to end on the tiny test model: the baseline evaluation, the warm start
(sft on worked solutions, reused from its cache the second time), and GRPO from the warm start,
with the built-in verifier and with the client-side reward."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "bench_rlvr.py"


def run_bench(model: Path, cache: Path, *extra: str) -> tuple[dict, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'protos'}"}
    args = [sys.executable, str(SCRIPT), "--model", str(model), "-n", "60", "--eval-prompts", "4", "--steps", "1"]
    args += ["--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "4", "--cache-dir", str(cache)]
    out = subprocess.run(args + list(extra), env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode in (0, 1), out.stderr[-3000:]  # 1: no rise (a tiny random model learns nothing)
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


def test_warm_start_then_grpo_with_both_rewards_reports_the_baseline_comparison(tiny_model_dir, tmp_path) -> None:
    cache = tmp_path / "cache"
    report, err = run_bench(tiny_model_dir, cache, "--warm-start-steps", "1", "--warm-start-examples", "16")
    assert "[warm start] 1 sft steps on 16 worked solutions" in err
    assert [r["mode"] for r in report["results"]] == ["numeric", "client"]
    numeric, client = report["results"]
    assert numeric["eval_prompts"] == client["eval_prompts"] == 4
    assert numeric["baseline"]["of"] == 4
    assert set(numeric["vs_baseline_prompt"]) == {"start", "final"}
    assert "vs_baseline_prompt" not in client  # the baseline is the numeric verifier's judgement
    assert "final_right" not in numeric and "start_right" not in numeric
    assert numeric["reward_per_step"] == client["reward_per_step"]  # the same score, in the trainer or here
    (adapter,) = cache.iterdir()
    assert (adapter / "adapter_config.json").exists()

    again, err = run_bench(tiny_model_dir, cache, "--warm-start-steps", "1", "--warm-start-examples", "16")
    assert f"[warm start] reusing {adapter}" in err
    assert again["results"][0]["accuracy_curve"] == numeric["accuracy_curve"]
