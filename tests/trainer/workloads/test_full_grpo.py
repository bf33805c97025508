"""GRPO updating all weights (``full_rl`` on a text environment) and starting points from an
earlier task (``init_from``): a LoRA or full-weight SFT checkpoint, on a tiny random Llama."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from opentinker_trainer.context import UserError, WorkerContext
from opentinker_common.arithmetic import ArithmeticEnv
from opentinker_trainer.workloads import grpo_text, sft

from tests.support.datasets import arithmetic_chat_jsonl
from tests.support.workers import reports, worker_ctx

SMALL = {"prompts_per_step": 2, "group_size": 3, "max_new_tokens": 4}


@pytest.fixture
def varied_rewards(monkeypatch):
    """Rewards 1, 0, 1, 0 ... per step (a random model never gets a sum right), so every group
    has a policy gradient; restarts each step so a resumed run scores as a straight one."""
    calls = itertools.count()
    monkeypatch.setattr(ArithmeticEnv, "score", lambda self, reply, problem: float(next(calls) % 2 == 0))


def make_ctx(
    model, tmp_path: Path, name: str, *, workload="full_rl", resume_from=None, init=None, **hp
) -> WorkerContext:
    defaults = (
        {**SMALL, "learning_rate": 1e-3} if workload == "full_rl" else {**SMALL, "lora_rank": 4, "learning_rate": 1e-2}
    )
    return worker_ctx(
        tmp_path,
        name,
        workload_type=workload,
        model=model,
        env_config={"env_id": "arithmetic"},
        hyperparameters={**defaults, **hp},
        resume_from=resume_from,
        init=init,
    )


def weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(path / "model.safetensors")


def test_full_rl_trains_every_weight_and_saves_a_transformers_folder(tiny_model_dir, tmp_path, varied_rewards) -> None:
    ctx = make_ctx(tiny_model_dir, tmp_path, "full", steps=2)
    grpo_text.run(ctx)
    metrics = reports(ctx, "metric")
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert {"loss", "reward", "loss/policy", "grpo/clipfrac", "perf/tokens_per_s"} <= set(m["values"])
        assert "kl" not in m["values"]  # kl_coef 0: no reference model is kept, so no KL to report
    (ck,) = reports(ctx, "checkpoint")
    assert ck["format"] == "hf_full" and ck["final"] and ck["step"] == 2
    path = Path(ck["path"])
    assert {"config.json", "model.safetensors", "tokenizer.json", "trainer_state.pt"} <= {
        p.name for p in path.iterdir()
    }
    assert not (path / "adapter_config.json").exists()

    from transformers import AutoModelForCausalLM

    trained = AutoModelForCausalLM.from_pretrained(path)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    changed = [
        n for (n, p), (_, q) in zip(trained.named_parameters(), base.named_parameters()) if not torch.equal(p, q)
    ]
    assert len(changed) == len(list(base.parameters()))


def test_full_rl_with_kl_resumes_exactly_against_its_starting_weights(tiny_model_dir, tmp_path, varied_rewards) -> None:
    straight = make_ctx(tiny_model_dir, tmp_path, "straight", steps=3, kl_coef=0.1)
    grpo_text.run(straight)
    first = make_ctx(tiny_model_dir, tmp_path, "first", steps=3, kl_coef=0.1)
    emit = first.emit_metric

    def emit_and_stop(step, values):
        emit(step, values)
        first.request_stop()

    first.emit_metric = emit_and_stop
    grpo_text.run(first)
    (ck,) = reports(first, "checkpoint")
    assert ck["step"] == 1 and not ck["final"] and ck["format"] == "hf_full"
    second = make_ctx(tiny_model_dir, tmp_path, "second", steps=3, kl_coef=0.1, resume_from=Path(ck["path"]))
    grpo_text.run(second)
    expected = {m["step"]: m["values"] for m in reports(straight, "metric")}
    resumed = reports(second, "metric")
    assert [m["step"] for m in resumed] == [2, 3]
    for m in resumed:
        for key in ("reward", "loss", "kl", "loss/kl", "loss/policy"):
            assert m["values"][key] == pytest.approx(expected[m["step"]][key], rel=1e-4, abs=1e-6), key
    assert resumed[-1]["values"]["kl"] > 0  # the reference stayed at the starting weights


# ------------------------------------------------------------------------------ init_from


@pytest.fixture(scope="module")
def sft_checkpoints(tiny_model_dir, tmp_path_factory) -> dict[str, Path]:
    """One-step SFT runs: a LoRA adapter and a full-weight folder."""
    tmp = tmp_path_factory.mktemp("sft")
    data = arithmetic_chat_jsonl(tmp / "d.jsonl", n=8)
    out = {}
    for kind, hp in (
        ("lora", {"lora": True, "lora_rank": 2, "learning_rate": 5e-2}),
        ("full", {"lora": False, "learning_rate": 1e-2}),
    ):
        ctx = worker_ctx(
            tmp,
            kind,
            task_id=f"sft-{kind}",
            workload_type="sft",
            model=tiny_model_dir,
            env_config={"env_id": "chat_jsonl", "path": str(data)},
            hyperparameters={"steps": 1, "batch_size": 4, **hp},
        )
        sft.run(ctx)
        out[kind] = Path(reports(ctx, "checkpoint")[-1]["path"])
    return out


def test_lora_rl_continues_the_sft_adapter(tiny_model_dir, tmp_path, sft_checkpoints) -> None:
    from safetensors.torch import load_file

    ctx = make_ctx(
        tiny_model_dir,
        tmp_path,
        "rl",
        workload="lora_finetune",
        steps=1,
        lora_rank=8,
        init=(sft_checkpoints["lora"], "peft_lora"),
    )
    trainer = grpo_text._Trainer(ctx)
    saved = load_file(sft_checkpoints["lora"] / "adapter_model.safetensors")
    state = {k: v for k, v in trainer.model.state_dict().items() if "lora_" in k}
    assert len(state) == len(saved)
    for key, value in saved.items():
        match = [v for k, v in state.items() if k.replace(".default", "") == key]
        assert match and torch.equal(match[0], value), key  # the SFT adapter, rank 2 (its own), not a fresh rank-8 one
    assert any(p.requires_grad for n, p in trainer.model.named_parameters() if "lora_" in n)
    assert not any(p.requires_grad for n, p in trainer.model.named_parameters() if "lora_" not in n)


def test_lora_rl_on_full_sft_weights_uses_them_as_the_base(tiny_model_dir, tmp_path, sft_checkpoints) -> None:
    ctx = make_ctx(
        tiny_model_dir, tmp_path, "rl", workload="lora_finetune", steps=1, init=(sft_checkpoints["full"], "hf_full")
    )
    trainer = grpo_text._Trainer(ctx)
    sft_weights = weights(sft_checkpoints["full"])
    base = {
        k.replace("base_model.model.", "").replace(".base_layer", ""): v
        for k, v in trainer.model.state_dict().items()
        if "lora_" not in k
    }
    assert all(torch.equal(base[k], v) for k, v in sft_weights.items() if k in base)
    assert sum(k in base for k in sft_weights) >= len(sft_weights) - 1  # (a tied lm_head may be left out)


def test_full_rl_from_a_lora_sft_merges_the_adapter(tiny_model_dir, tmp_path, sft_checkpoints) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ctx = make_ctx(tiny_model_dir, tmp_path, "rl", steps=1, init=(sft_checkpoints["lora"], "peft_lora"))
    trainer = grpo_text._Trainer(ctx)
    merged = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir), sft_checkpoints["lora"]
    ).merge_and_unload()
    got = trainer.model.state_dict()
    assert all(torch.allclose(got[k], v) for k, v in merged.state_dict().items())
    assert all(p.requires_grad for p in trainer.model.parameters())


def test_an_init_checkpoint_that_is_not_on_this_node_is_a_user_error(tiny_model_dir, tmp_path) -> None:
    ctx = make_ctx(
        tiny_model_dir,
        tmp_path,
        "rl",
        workload="lora_finetune",
        steps=1,
        init=(tmp_path / "elsewhere" / "step_3", "peft_lora"),
    )
    with pytest.raises(UserError, match="init_from: checkpoint .*elsewhere/step_3 is not on this trainer node"):
        grpo_text.run(ctx)


def _adapter_variant(src: Path, out: Path, change) -> Path:
    """A copy of adapter folder ``src`` whose tensors are ``change(tensors)``, its config unchanged."""
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True)
    (out / "adapter_config.json").write_text((src / "adapter_config.json").read_text())
    save_file(change(load_file(src / "adapter_model.safetensors")), str(out / "adapter_model.safetensors"))
    return out


BAD_ADAPTERS = {
    # PEFT matches none of these keys: it would warn and continue with lora_B at 0 (the base model).
    "no-prefix": (lambda t: {k.removeprefix("base_model.model."): v for k, v in t.items()}, r"layers\.0\."),
    "no-v_proj": (lambda t: {k: v for k, v in t.items() if "v_proj" not in k}, r"layers\.0\.self_attn\.v_proj"),
    "layer-0-only": (lambda t: {k: v for k, v in t.items() if "layers.1." not in k}, r"layers\.1\.self_attn"),
}


@pytest.mark.parametrize("workload", ["lora_finetune", "full_rl"], ids=["continued", "merged"])
@pytest.mark.parametrize("bad", list(BAD_ADAPTERS))
def test_an_init_adapter_peft_loads_only_partly_fails_the_task_naming_the_keys(
    tiny_model_dir, tmp_path, sft_checkpoints, bad, workload
) -> None:
    change, key = BAD_ADAPTERS[bad]
    folder = _adapter_variant(sft_checkpoints["lora"], tmp_path / bad / "step_1", change)
    ctx = make_ctx(tiny_model_dir, tmp_path, "rl", workload=workload, steps=1, init=(folder, "peft_lora"))
    with pytest.raises(UserError, match=rf"(?s)init_from.*{folder}.*not every LoRA tensor was loaded.*{key}"):
        grpo_text.run(ctx)
    assert reports(ctx, "metric") == [] and reports(ctx, "checkpoint") == []  # no step trained from a wrong start
