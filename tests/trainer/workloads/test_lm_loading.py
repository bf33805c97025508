"""Loading an LM for training: the worker reports the ``loading model`` phase (so a long first load
is not silence in `opentinker watch`), then ``model loaded`` with the seconds it took; and wrapping
it in a LoRA adapter prints no FutureWarning (PEFT reading a deprecated transformers alias)."""

from __future__ import annotations

import warnings

import torch

from opentinker_trainer.workloads import _lm

from tests.support.workers import reports, worker_ctx

HP = {"steps": 1, "prompts_per_step": 2, "group_size": 2, "max_new_tokens": 4, "lora_rank": 4}


def test_loading_for_training_reports_its_phases_and_warns_of_nothing(tiny_model_dir, tmp_path) -> None:
    from opentinker_common.spec.grpo import GRPOConfig

    ctx = worker_ctx(
        tmp_path,
        "load",
        workload_type="lora_finetune",
        model=tiny_model_dir,
        env_config={"env_id": "arithmetic"},
        hyperparameters=HP,
    )
    cfg = GRPOConfig(**HP)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, model = _lm.load_for_training(ctx, cfg, torch.device("cpu"), torch.float32, full=False)
        checkpoint = _lm.save_checkpoint(tmp_path / "ck", model, {"step": 1})
        _lm.load_adapter(_lm.load_model(str(tiny_model_dir), torch.device("cpu"), torch.float32)[1], checkpoint)
    future = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
    assert future == [], future
    phases = reports(ctx, "phase")
    assert [p["phase"] for p in phases] == ["loading model", "model loaded"]
    assert phases[0]["detail"] == str(tiny_model_dir)
    assert phases[1]["detail"].startswith(f"{tiny_model_dir} in ") and phases[1]["detail"].endswith(" s")


def test_a_model_that_fails_to_load_reports_no_model_loaded(tmp_path) -> None:
    from opentinker_common.spec.grpo import GRPOConfig

    from opentinker_trainer.context import UserError

    missing = tmp_path / "no-such-model"
    ctx = worker_ctx(
        tmp_path,
        "bad",
        workload_type="lora_finetune",
        model=missing,
        env_config={"env_id": "arithmetic"},
        hyperparameters=HP,
    )
    try:
        _lm.load_for_training(ctx, GRPOConfig(**HP), torch.device("cpu"), torch.float32, full=False)
    except UserError:
        pass
    else:
        raise AssertionError("a missing model folder loaded")
    assert [p["phase"] for p in reports(ctx, "phase")] == ["loading model"]
