"""`make bench-rlvr` end to end on the tiny test model: the baseline evaluation, the warm start
(sft on worked solutions, reused from its cache the second time), and GRPO from the warm start,
with the built-in verifier and with the client-side reward; and the warm start's data never holds
a problem of the RL file (so none of the held-out problems is trained on)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path


REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "bench_rlvr.py"


def bench_module():
    spec = importlib.util.spec_from_file_location("bench_rlvr", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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


def test_warm_start_examples_are_other_problems_with_their_worked_solutions(tmp_path) -> None:
    sys.path.insert(0, str(REPO / "scripts"))
    from make_word_problems import write

    bench = bench_module()
    data = write(tmp_path / "wp.jsonl", n=300, seed=0)
    args = argparse.Namespace(warm_start_examples=200, seed=0, system_prompt="Show each step as an equation.")
    rows = bench.warm_start_rows(args, data)
    rl_prompts = {json.loads(line)["prompt"] for line in data.read_text().splitlines()}
    assert len(rows) == 200
    for row in rows:
        system, user, assistant = row["messages"]
        assert system == {"role": "system", "content": "Show each step as an equation."}
        assert user["role"] == "user" and user["content"] not in rl_prompts
        assert assistant["role"] == "assistant" and assistant["content"].endswith(".")
