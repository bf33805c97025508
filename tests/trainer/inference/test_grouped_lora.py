"""Mixed-adapter rows computed grouped by adapter (Punica/S-LoRA style): the grouping rule, and
the batched logits equal each row's logits run alone through PEFT with its adapter activated."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from opentinker_trainer.inference.adapters import AdapterRegistry
from opentinker_trainer.inference.lora_rows import plan_rows

from tests.support.inference import load_tiny, make_adapter


def test_rows_are_grouped_by_adapter_padded_to_the_largest_group() -> None:
    plan = plan_rows([2, None, 0, 2, None, 2])
    assert plan.adapters.tolist() == [0, 2]  # in stack order; base rows in no group
    assert plan.size == 3
    assert plan.src.tolist() == [2, 2, 2, 0, 3, 5]  # adapter 0's single row repeated as padding
    assert plan.keep.tolist() == [[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]]
    assert plan_rows([None, None]) is None


@pytest.fixture(scope="module")
def registry(tiny_model_dir: Path, tmp_path_factory) -> AdapterRegistry:
    root = tmp_path_factory.mktemp("grouped-lora")
    folders = {
        "r4-qv": make_adapter(tiny_model_dir, root / "a", seed=1),
        "r8-qkvo": make_adapter(
            tiny_model_dir, root / "b", seed=2, rank=8, targets=("q_proj", "k_proj", "v_proj", "o_proj")
        ),
        "r2-v": make_adapter(tiny_model_dir, root / "c", seed=3, rank=2, targets=("v_proj",)),
    }
    _, model = load_tiny(tiny_model_dir)
    reg = AdapterRegistry(model, folders.__getitem__)
    for name in folders:
        reg.acquire(name)
    return reg


ALL_ADAPTERS = ["r8-qkvo", None, "r4-qv", "r2-v", "r8-qkvo", None, "r8-qkvo"]
SOME_ADAPTERS = ["r2-v", None, "r2-v", "r4-qv"]  # one adapter has no rows: its weights are not gathered


@pytest.mark.parametrize("rows", [ALL_ADAPTERS, SOME_ADAPTERS], ids=["all-adapters", "some-adapters"])
@pytest.mark.parametrize("tokens", [7, 1], ids=["prefill", "one-token"])
def test_grouped_logits_equal_each_adapter_alone(registry, tokens, rows) -> None:
    ids = torch.randint(0, 1000, (len(rows), tokens), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        alone = []
        for b, name in enumerate(rows):
            registry.activate(name)
            alone.append(registry.base(input_ids=ids[b : b + 1]).logits[0])
        assert registry.activate_rows(rows)
        grouped = registry.base(input_ids=ids).logits
        registry.activate_mixed()
        peft_mixed = registry.model(input_ids=ids, adapter_names=[n or "__base__" for n in rows]).logits
        registry.activate(None)
        base = registry.base(input_ids=ids).logits
    for b, name in enumerate(rows):
        torch.testing.assert_close(grouped[b], alone[b], rtol=1e-5, atol=1e-5, msg=f"row {b} ({name})")
        torch.testing.assert_close(grouped[b], peft_mixed[b], rtol=1e-5, atol=1e-5)
        if name is None:
            assert torch.equal(grouped[b], base[b])  # base rows get no LoRA at all
        else:
            assert not torch.allclose(grouped[b], base[b], atol=1e-3)  # the adapter really applies
    # After a grouped pass, activating one adapter is PEFT's path again (no grouped hooks left on).
    with torch.inference_mode():
        registry.activate(rows[2])
        again = registry.base(input_ids=ids[2:3]).logits[0]
    torch.testing.assert_close(again, alone[2], rtol=0, atol=0)
