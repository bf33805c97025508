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
        assert {"loss", "reward", "reward_std", "kl", "zero_std_frac", "perf/step_s", "perf/tokens_per_s"} <= set(v)
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
