"""A model host's mode and adapter switches (``host.Switches``) reuse one list of the model's
modules: their effect is that of ``Module.train`` and PEFT's ``set_adapter`` (every module's
mode, every parameter's ``requires_grad``, every layer's active adapter), including after an
adapter was added or deleted, and a switch to the mode the model is in walks no module."""

from __future__ import annotations

from pathlib import Path

import pytest
from peft import LoraConfig
from peft.tuners.tuners_utils import BaseTunerLayer

from opentinker_trainer.host import Switches
from tests.support.models import tiny_lora_model

ADAPTERS = (("t1", 4, ["q_proj", "v_proj"]), ("t2", 8, ["q_proj", "v_proj"]), ("t3", 4, ["q_proj", "o_proj"]))


def _state(model) -> tuple:
    """Everything a switch sets: modes, ``requires_grad`` flags and the active adapters."""
    return (
        [(n, m.training) for n, m in model.named_modules()],
        [(n, p.requires_grad) for n, p in model.named_parameters()],
        [(n, list(m.active_adapters)) for n, m in model.named_modules() if isinstance(m, BaseTunerLayer)],
        model.active_adapter,
        model.base_model.active_adapter,
    )


def test_switches_leave_the_model_as_torch_and_peft_do(tiny_model_dir: Path) -> None:
    _, ours = tiny_lora_model(tiny_model_dir, ADAPTERS)
    _, peft = tiny_lora_model(tiny_model_dir, ADAPTERS)
    Switches.install(ours)
    assert _state(ours) == _state(peft)

    def both(step) -> None:
        step(ours)
        step(peft)
        assert _state(ours) == _state(peft)

    both(lambda m: m.set_adapter("t2"))
    both(lambda m: m.train())
    both(lambda m: m.set_adapter("t3"))
    both(lambda m: m.eval())
    both(lambda m: m.eval())
    # A new adapter's modules start in training mode: the next eval() reaches them.
    both(lambda m: m.add_adapter("t4", LoraConfig(r=2, lora_alpha=4, lora_dropout=0.1, target_modules=["k_proj"])))
    both(lambda m: m.eval())
    both(lambda m: m.set_adapter("t4"))
    both(lambda m: m.train(True))
    both(lambda m: m.base_model.disable_adapter_layers())
    both(lambda m: m.base_model.enable_adapter_layers())
    both(lambda m: m.delete_adapter("t2"))
    both(lambda m: m.set_adapter("t1"))
    both(lambda m: m.train(False))
    both(lambda m: m.set_adapter("t3", inference_mode=True))
    with pytest.raises(ValueError, match="Adapter t2 not found"):
        ours.set_adapter("t2")


def test_a_switch_to_the_mode_the_model_is_in_walks_no_module(tiny_model_dir: Path) -> None:
    _, model = tiny_lora_model(tiny_model_dir, ADAPTERS)
    Switches.install(model)
    leaf = next(m for m in model.modules() if isinstance(m, BaseTunerLayer))
    walked = []
    own = leaf.train
    leaf.train = lambda mode=True: walked.append(mode) or own(mode)
    model.eval()
    model.eval()
    model.train(False)
    assert walked == [False]  # the first switch walks: the model's modes were never set through it
    model.train()
    model.train()
    assert walked == [False, True]
    assert model.eval() is model
