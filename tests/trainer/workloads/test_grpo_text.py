"""lora_finetune end to end on a tiny random Llama: metrics, checkpoints, resume, stop, errors."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest
import torch

from opentinker_trainer.context import UserError, WorkerContext
from opentinker_common.arithmetic import ArithmeticEnv
from opentinker_trainer.workloads import grpo_text

from tests.support.workers import reports, worker_ctx

REQUIRED_KEYS = {
    "loss",
    "reward",
    "reward_std",
    "kl",
    "zero_std_frac",
    "loss/policy",
    "loss/kl",
    "reward/mean",
    "reward/std",
    "grpo/zero_std_frac",
    "grpo/clipfrac",
    "grpo/approx_kl",
    "perf/tokens_per_s",
    "perf/step_s",
    "perf/generate_s",
    "perf/samples",
}

SMALL = {"prompts_per_step": 2, "group_size": 3, "max_new_tokens": 4, "lora_rank": 4, "learning_rate": 1e-2}


def make_ctx(model: str | Path, tmp_path: Path, name: str, resume_from: Path | None = None, **hp) -> WorkerContext:
    return worker_ctx(
        tmp_path,
        name,
        workload_type="lora_finetune",
        model=model,
        env_config={"env_id": "arithmetic"},
        hyperparameters={**SMALL, **hp},
        resume_from=resume_from,
    )


@pytest.fixture
def varied_rewards(monkeypatch):
    """A random model never gets a sum right: score replies 1, 0, 1, 0 ... in the order they are
    scored, so every group of 3 has mixed rewards and the policy gradient is not zero. The
    pattern restarts every step (6 replies a step), so a resumed run scores as a straight one."""
    calls = itertools.count()
    monkeypatch.setattr(ArithmeticEnv, "score", lambda self, reply, problem: float(next(calls) % 2 == 0))


def test_run_emits_metrics_and_peft_checkpoints(tiny_model_dir, tmp_path, varied_rewards):
    ctx = make_ctx(tiny_model_dir, tmp_path, "run", steps=3, checkpoint_every=2, kl_coef=0.05)
    grpo_text.run(ctx)

    metrics = reports(ctx, "metric")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for m in metrics:
        assert REQUIRED_KEYS <= set(m["values"]), REQUIRED_KEYS - set(m["values"])
        assert all(math.isfinite(v) for v in m["values"].values())
        assert m["values"]["perf/samples"] == 6
        assert 0.0 <= m["values"]["reward"] <= 1.0
        assert m["values"]["reward"] == m["values"]["reward/mean"]
    assert [m["values"]["samples"] for m in metrics] == [6, 12, 18]

    checkpoints = reports(ctx, "checkpoint")
    assert [(c["step"], c["final"], c["format"]) for c in checkpoints] == [
        (2, False, "peft_lora"),
        (3, True, "peft_lora"),
    ]
    final = Path(checkpoints[-1]["path"])
    assert final == ctx.checkpoint_dir / "step_3"
    assert {"adapter_config.json", "adapter_model.safetensors", "trainer_state.pt"} <= {p.name for p in final.iterdir()}
    assert not list(ctx.checkpoint_dir.glob("*.tmp"))

    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model = PeftModel.from_pretrained(base, final)
    saved = load_file(final / "adapter_model.safetensors")
    lora_b = [v for k, v in saved.items() if "lora_B" in k]
    assert lora_b and any(v.abs().max() > 0 for v in lora_b), "training moved the adapter off its zero init"
    state = {k: v for k, v in model.state_dict().items() if "lora_B" in k}
    assert len(state) == len(lora_b)
    config = json.loads((final / "adapter_config.json").read_text())
    assert config["r"] == 4 and set(config["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj"}


def test_resume_continues_step_count_optimizer_and_rng(tiny_model_dir, tmp_path, varied_rewards):
    straight = make_ctx(tiny_model_dir, tmp_path, "straight", steps=4, kl_coef=0.1)
    grpo_text.run(straight)

    first = make_ctx(tiny_model_dir, tmp_path, "first", steps=4, kl_coef=0.1)
    first.emit_metric = _stop_after(first, step=2)
    grpo_text.run(first)
    assert [m["step"] for m in reports(first, "metric")] == [1, 2]
    (ckpt,) = reports(first, "checkpoint")
    assert ckpt["step"] == 2 and ckpt["final"] is False

    second = make_ctx(tiny_model_dir, tmp_path, "second", resume_from=Path(ckpt["path"]), steps=4, kl_coef=0.1)
    grpo_text.run(second)
    resumed = reports(second, "metric")
    assert [m["step"] for m in resumed] == [3, 4]
    assert reports(second, "checkpoint")[-1]["step"] == 4 and reports(second, "checkpoint")[-1]["final"]

    # Same optimizer moments and RNG streams: the resumed steps are the uninterrupted ones.
    expected = {m["step"]: m["values"] for m in reports(straight, "metric")}
    for m in resumed:
        for key in ("reward", "loss", "kl", "loss/policy", "completion/mean_tokens"):
            assert m["values"][key] == pytest.approx(expected[m["step"]][key], rel=1e-4, abs=1e-6), key
    state = torch.load(Path(reports(second, "checkpoint")[-1]["path"]) / "trainer_state.pt", weights_only=True)
    assert state["step"] == 4 and state["optimizer"]["state"]


def _stop_after(ctx: WorkerContext, step: int):
    emit = ctx.emit_metric

    def emit_and_maybe_stop(s, values):
        emit(s, values)
        if s >= step:
            ctx.request_stop()

    return emit_and_maybe_stop


def test_stop_before_the_first_step_writes_nothing(tiny_model_dir, tmp_path):
    ctx = make_ctx(tiny_model_dir, tmp_path, "stopped", steps=3)
    ctx.request_stop()
    grpo_text.run(ctx)
    assert reports(ctx, "metric") == [] and reports(ctx, "checkpoint") == []


def test_missing_model_path_is_a_user_error(tmp_path):
    missing = tmp_path / "no-such-model"
    ctx = make_ctx(missing, tmp_path, "missing", steps=1)
    with pytest.raises(UserError, match="no-such-model"):
        grpo_text.run(ctx)


def test_folder_without_a_model_is_a_user_error(tmp_path):
    empty = tmp_path / "empty-model"
    empty.mkdir()
    ctx = make_ctx(empty, tmp_path, "empty", steps=1)
    with pytest.raises(UserError, match="empty-model"):
        grpo_text.run(ctx)


def test_unknown_target_module_is_a_user_error(tiny_model_dir, tmp_path):
    ctx = make_ctx(tiny_model_dir, tmp_path, "targets", steps=1, target_modules=["no_such_proj"])
    with pytest.raises(UserError, match="target_modules"):
        grpo_text.run(ctx)


def test_at_kl_coef_zero_no_reference_forward_runs_and_no_kl_is_reported(tiny_model_dir, tmp_path, varied_rewards):
    ctx = make_ctx(tiny_model_dir, tmp_path, "nokl", steps=1, kl_coef=0.0)
    grpo_text.run(ctx)
    (m,) = reports(ctx, "metric")
    assert {"kl", "grpo/kl_ref"}.isdisjoint(m["values"]) and m["values"]["loss/kl"] == 0.0
    assert REQUIRED_KEYS - {"kl", "grpo/kl_ref"} <= set(m["values"])


def test_micro_batches_and_ppo_epochs(tiny_model_dir, tmp_path, varied_rewards):
    ctx = make_ctx(tiny_model_dir, tmp_path, "micro", steps=1, micro_batch_size=3, ppo_epochs=2, kl_coef=0.05)
    grpo_text.run(ctx)
    (m,) = reports(ctx, "metric")
    assert REQUIRED_KEYS <= set(m["values"])
    # The second epoch sees a moved policy: its ratio is no longer exactly 1.
    assert m["values"]["grpo/approx_kl"] > 0


# Per-step numbers of the text trainer before its GRPO loop became rl.grpo.grpo_update, on this
# tiny model (torch CPU, float32): the shared update must keep them (demo reward curves too).
PINNED = {
    "lora_finetune": [
        {
            "loss": -0.04651693603955165,
            "kl": 0.0,
            "grpo/approx_kl": 0.014274639543145895,
            "optim/grad_norm": 1.608174443244934,
        },
        {
            "loss": -0.044734848570078166,
            "kl": 0.019685566425323486,
            "grpo/approx_kl": 0.00932894367724657,
            "optim/grad_norm": 1.1187500953674316,
        },
        {
            "loss": -0.02760242065414742,
            "kl": 0.032575707882642746,
            "grpo/approx_kl": 0.0026878577191382647,
            "optim/grad_norm": 1.065363883972168,
        },
    ],
    "full_rl": [
        {
            "loss": -0.06350654779622893,
            "kl": 0.0,
            "grpo/approx_kl": 0.02410009503364563,
            "optim/grad_norm": 1.271511197090149,
        },
        {
            "loss": -0.053306762889647884,
            "kl": 0.009411071427166462,
            "grpo/approx_kl": 0.006670672446489334,
            "optim/grad_norm": 1.8130360841751099,
        },
        {
            "loss": -0.053308309769878194,
            "kl": 0.015977924689650536,
            "grpo/approx_kl": 0.005573532078415155,
            "optim/grad_norm": 2.310978651046753,
        },
    ],
}


@pytest.mark.parametrize("workload", ["lora_finetune", "full_rl"])
def test_step_numbers_are_those_of_the_loop_before_the_shared_update(
    tiny_model_dir, tmp_path, varied_rewards, workload
):
    hp = {**SMALL, "steps": 3, "kl_coef": 0.1, "ppo_epochs": 2}
    if workload == "full_rl":
        hp = {k: v for k, v in hp.items() if k != "lora_rank"} | {"learning_rate": 1e-3}
    else:
        hp["micro_batch_size"] = 3
    ctx = worker_ctx(
        tmp_path,
        "pinned",
        workload_type=workload,
        model=tiny_model_dir,
        env_config={"env_id": "arithmetic"},
        hyperparameters=hp,
    )
    grpo_text.run(ctx)
    metrics = [m["values"] for m in reports(ctx, "metric")]
    assert len(metrics) == 3
    for step, (got, want) in enumerate(zip(metrics, PINNED[workload]), start=1):
        assert got["reward"] == 0.5
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=1e-4, abs=1e-6), (step, key)
