"""oneDNN-packed Linear weights (CPU): the same logits as the plain layers within float
rounding, with LoRA adapters on top; plain layers outside ``use()`` or with grad; a changed
weight is packed again; ``close()`` gives the plain modules back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from opentinker_trainer.inference.adapters import AdapterRegistry
from opentinker_trainer.inference.packed import PackedLinear, PackedLinears, available

from tests.support.inference import load_tiny, make_adapter

pytestmark = pytest.mark.skipif(not available(torch.device("cpu")), reason="torch without the oneDNN operators")


def _ids() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.tensor([[0, 0, 5, 17, 42, 7], [3, 9, 11, 2, 8, 30]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    return ids, mask


def test_packed_layers_give_the_plain_logits_and_stay_plain_outside_use(tiny_model_dir: Path) -> None:
    _, model = load_tiny(tiny_model_dir)
    ids, mask = _ids()
    with torch.inference_mode():
        plain = model(input_ids=ids, attention_mask=mask).logits
    packed = PackedLinears(model)
    assert packed.modules and all(type(m) is PackedLinear for m in packed.modules)
    with torch.inference_mode():
        with packed.use():
            got = model(input_ids=ids, attention_mask=mask).logits
        torch.testing.assert_close(got, plain, rtol=1e-4, atol=1e-4)
        assert len(packed._store) == len(packed.modules)  # every layer ran packed
        outside = model(input_ids=ids, attention_mask=mask).logits  # outside use(): MKL, bit for bit
    assert torch.equal(outside, plain)
    with packed.use():  # with grad (training on a shared model): the plain layers, a graph
        out = model(input_ids=ids, attention_mask=mask).logits
    assert out.requires_grad and torch.equal(out.detach(), plain)
    packed.close()
    assert all(type(m) is nn.Linear for m in model.modules() if isinstance(m, nn.Linear))


def test_a_changed_weight_is_packed_again(tiny_model_dir: Path) -> None:
    _, model = load_tiny(tiny_model_dir)
    packed = PackedLinears(model)
    layer = packed.modules[0]
    x = torch.randn(3, layer.in_features)
    with torch.inference_mode(), packed.use():
        before = packed.packed(layer)
        with torch.no_grad():
            layer.weight.mul_(2.0)  # an optimizer step of a full-weight tenant: in place
        assert packed.packed(layer) is not before
        torch.testing.assert_close(layer(x), x @ layer.weight.t(), rtol=1e-4, atol=1e-4)
    layer.weight = nn.Parameter(torch.randn_like(layer.weight))  # a new tensor
    with torch.inference_mode(), packed.use():
        torch.testing.assert_close(layer(x), x @ layer.weight.t(), rtol=1e-4, atol=1e-4)


def test_grouped_lora_rows_on_packed_layers_match_peft_alone(tiny_model_dir: Path, tmp_path: Path) -> None:
    folders = {
        "a": make_adapter(tiny_model_dir, tmp_path / "a", seed=1),
        "b": make_adapter(tiny_model_dir, tmp_path / "b", seed=2, targets=("q_proj", "k_proj", "v_proj", "o_proj")),
    }
    _, model = load_tiny(tiny_model_dir)
    packed = PackedLinears(model)  # before the adapters: PEFT wraps the packed layers
    reg = AdapterRegistry(model, folders.__getitem__)
    for name in folders:
        reg.acquire(name)
    ids, mask = _ids()
    ids, mask = torch.cat([ids, ids]), torch.cat([mask, mask])
    names = ["a", None, "b", "a"]
    with torch.inference_mode():
        alone = []
        for r, name in enumerate(names):
            reg.activate(name)
            alone.append(reg.base(input_ids=ids[r : r + 1], attention_mask=mask[r : r + 1]).logits)
        assert reg.activate_rows(names)
        with packed.use():
            rows = reg.base(input_ids=ids, attention_mask=mask).logits
    for r in range(len(names)):
        real = mask[r].bool()
        torch.testing.assert_close(rows[r, real], alone[r][0, real], rtol=1e-4, atol=1e-4)


def test_the_runtime_serves_on_packed_layers_and_gives_them_back_plain(tiny_model_dir: Path) -> None:
    from opentinker_client.inference import InferenceClient

    from tests.support.inference import ServerThread, tiny_runtime

    outputs = {}
    for packed_weights in (False, True):
        server = ServerThread(tiny_runtime(tiny_model_dir, packed_weights=packed_weights))
        model = server.runtime.registry.base
        try:
            client = InferenceClient(server.address)
            chunks = list(client.generate_stream("Once upon a time", temperature=0.0, max_tokens=6, ignore_eos=True))
            outputs[packed_weights] = [t for c in chunks for t in c.token_ids]
            linear_types = {type(m) for m in model.modules() if isinstance(m, nn.Linear)}
            assert linear_types == ({PackedLinear} if packed_weights else {nn.Linear})
            if packed_weights:  # every layer ran on its packed weight
                assert len(server.runtime._packed._store) == len(server.runtime._packed.modules)
            client.close()
        finally:
            server.close()
        assert all(type(m) is nn.Linear for m in model.modules() if isinstance(m, nn.Linear))
    assert outputs[True] == outputs[False] and len(outputs[True]) == 6
