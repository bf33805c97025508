"""lora_finetune on the real SmolLM2-135M-Instruct for a few steps (slow: run with -m e2e).

Checks the plumbing on a real model and tokenizer — metrics, a PEFT checkpoint that loads and
generates — not that it learns (``scripts/measure_grpo.py`` measures that).
"""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import pytest
import torch

from opentinker_common.spec import TaskSpecModel
from opentinker_trainer.context import WorkerContext
from opentinker_trainer.workloads import grpo_text

pytestmark = pytest.mark.e2e


def test_three_steps_on_the_real_model(real_model_dir, tmp_path):
    spec = TaskSpecModel.from_parts(
        workload_type="lora_finetune",
        model=str(real_model_dir),
        env_config={"env_id": "arithmetic", "seed": 1},
        hyperparameters={
            "steps": 3,
            "prompts_per_step": 2,
            "group_size": 4,
            "max_new_tokens": 8,
            "checkpoint_every": 2,
        },
    )
    ctx = WorkerContext(
        task_id="e2e", attempt=1, spec=spec, device="cpu", checkpoint_dir=tmp_path / "ckpt", out=io.StringIO()
    )
    grpo_text.run(ctx)

    lines = [json.loads(line) for line in ctx.out.getvalue().splitlines()]
    metrics = [r for r in lines if r["type"] == "metric"]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for m in metrics:
        v = m["values"]
        assert {"loss", "reward", "reward_std", "zero_std_frac", "perf/step_s", "perf/tokens_per_s"} <= set(v)
        assert "kl" not in v  # kl_coef 0: no reference forward, no KL to report
        assert all(math.isfinite(x) for x in v.values())
        assert 0.0 <= v["reward"] <= 1.0 and v["perf/samples"] == 8
        assert 0 < v["completion/mean_tokens"] <= 8
    checkpoints = [r for r in lines if r["type"] == "checkpoint"]
    assert [(c["step"], c["final"]) for c in checkpoints] == [(2, False), (3, True)]

    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(real_model_dir)
    base = AutoModelForCausalLM.from_pretrained(real_model_dir)
    model = PeftModel.from_pretrained(base, Path(checkpoints[-1]["path"])).eval()
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}], tokenize=False, add_generation_prompt=True
    )
    inputs = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=5, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert out.shape[1] > inputs["input_ids"].shape[1]


# The first steps of `make demo` (arithmetic, one digit, default hyper-parameters, seed 0) on the
# CPU, recorded before the text trainer's GRPO loop became rl.grpo.grpo_update; the demo's reward
# curve is the same over all its 15 steps (checked when the update was shared).
DEMO_STEPS = [
    {"reward": 0.34375, "loss": 0.04270298779010773, "optim/grad_norm": 0.6508390307426453},
    {"reward": 0.59375, "loss": 0.0032473732717335224, "optim/grad_norm": 0.41479477286338806},
    {"reward": 0.53125, "loss": 0.004751828499138355, "optim/grad_norm": 0.5551425218582153},
]


def test_demo_steps_keep_their_numbers(real_model_dir, tmp_path):
    spec = TaskSpecModel.from_parts(
        workload_type="lora_finetune",
        model=str(real_model_dir),
        env_config={"env_id": "arithmetic", "min_digits": 1, "max_digits": 1},
        hyperparameters={"steps": len(DEMO_STEPS)},
    )
    ctx = WorkerContext(
        task_id="demo", attempt=1, spec=spec, device="cpu", checkpoint_dir=tmp_path / "ckpt", out=io.StringIO()
    )
    grpo_text.run(ctx)
    metrics = [r["values"] for r in map(json.loads, ctx.out.getvalue().splitlines()) if r["type"] == "metric"]
    assert len(metrics) == len(DEMO_STEPS)
    for step, (got, want) in enumerate(zip(metrics, DEMO_STEPS), start=1):
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=1e-4, abs=1e-6), (step, key)
