"""A session on the modules Tinker's LoRA flags select by default (attention, MLP and lm_head),
stepped with Tinker's AdamParams defaults: the output projection's adapter trains, the tied input
embedding stays as it was, and a new attempt resumes the saved state exactly."""

from __future__ import annotations

import json

import torch
from safetensors import safe_open

from opentinker_common.lora_targets import tinker_target_modules
from opentinker_trainer.training.session import AdamParams
from opentinker_trainer.workloads.lora_session import open_session

from tests.support.workers import worker_ctx
from tests.trainer.training.test_training_session import HP, adapter, datums, same

#: Tinker's AdamParams defaults: beta2 0.95, eps 1e-12, grad_clip_norm 0 (no clipping).
TINKER_ADAM = AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-12, max_grad_norm=0.0)


def test_tinkers_default_modules_train_lm_head_and_resume_exactly(tiny_model_dir, tmp_path) -> None:
    config = json.loads((tiny_model_dir / "config.json").read_text())
    modules = tinker_target_modules(train_mlp=True, train_attn=True, train_unembed=True, model_config=config)
    hp = {**HP, "target_modules": list(modules)}

    def ctx(name, **extra):
        return worker_ctx(
            tmp_path, name, workload_type="lora_session", model=tiny_model_dir, env_config={}, hyperparameters=hp,
            **extra,
        )  # fmt: skip

    run = open_session(ctx("run"))[0]
    assert run.info()["lora"]["target_modules"] == list(modules)
    names = list(adapter(run))
    assert any("lm_head" in n for n in names) and any("down_proj" in n for n in names)
    embedding = run.model.get_input_embeddings().weight.detach().clone()
    batch = datums()
    start = adapter(run)
    for _ in range(2):
        run.forward_backward(batch, "importance_sampling")
        run.optim_step(TINKER_ADAM)
    trained = adapter(run)
    assert all(not torch.equal(trained[n], start[n]) for n in names if "lm_head" in n and "lora_B" in n)
    assert torch.equal(run.model.get_input_embeddings().weight, embedding)

    saved = run.save_state("two", next_sequence=4)
    with safe_open(saved.folder / "adapter_model.safetensors", "pt") as f:
        keys = list(f.keys())
    assert any("lm_head.lora_A" in k for k in keys)
    assert all("lora_" in k for k in keys), keys  # no copy of the frozen base embedding
    run.forward_backward(batch, "importance_sampling")
    run.optim_step(TINKER_ADAM)
    uninterrupted = adapter(run)
    resumed, next_sequence = open_session(ctx("resumed", resume_from=saved.folder))
    assert next_sequence == 4 and same(adapter(resumed), trained, atol=0)
    resumed.forward_backward(batch, "importance_sampling")
    resumed.optim_step(TINKER_ADAM)
    assert same(adapter(resumed), uninterrupted, atol=1e-7)
