"""An LM checkpoint's adapter_config.json names the base model as the task's spec does (a hub id
or model name), not the folder on the node the base weights were loaded from."""

from __future__ import annotations

import json

import torch

from opentinker_trainer.workloads import _lm


class _Cfg:
    lora_rank, lora_alpha, lora_dropout, target_modules = 4, 8, 0.0, ("q_proj", "v_proj")


def test_saved_adapter_names_the_base_model_as_given_and_still_loads(tiny_model_dir, tmp_path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    _, base = _lm.load_model(str(tiny_model_dir), torch.device("cpu"), torch.float32)
    model = _lm.attach_lora(base, _Cfg(), None)
    plain = _lm.save_checkpoint(tmp_path / "plain", model, {"step": 1})
    named = _lm.save_checkpoint(tmp_path / "named", model, {"step": 1}, base_model="acme/tiny-llama")
    # Without a name PEFT writes where the weights came from: here a folder of this machine.
    assert json.loads((plain / "adapter_config.json").read_text())["base_model_name_or_path"] == str(tiny_model_dir)
    config = json.loads((named / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "acme/tiny-llama" and config["r"] == 4
    # Only the name changed: the adapter loads onto the same base and gives the same weights.
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), named)
    want = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    got = {k: v for k, v in reloaded.state_dict().items() if "lora_" in k}
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
