"""oneDNN-packed Linear weights (CPU): they replace the plain weights, so the served model holds
its weights once, and give the plain logits within float rounding, LoRA adapters on top; a layer
whose weight is shared keeps it, run by oneDNN."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from opentinker_trainer.inference.adapters import AdapterRegistry
from opentinker_trainer.inference.packed import PackedLinear, available, pack_linears

from tests.support.inference import load_tiny, make_adapter

pytestmark = pytest.mark.skipif(not available(torch.device("cpu")), reason="torch without the oneDNN operators")


def _ids() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.tensor([[0, 0, 5, 17, 42, 7], [3, 9, 11, 2, 8, 30]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    return ids, mask


def _weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and packed weights, each tensor once."""
    seen = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    for m in model.modules():
        if isinstance(m, PackedLinear):
            seen[id(m.packed)] = m.packed.numel() * m.packed.element_size()  # an opaque oneDNN tensor
    return sum(seen.values())


def test_packed_layers_replace_the_plain_weights_and_give_the_plain_logits(tiny_model_dir: Path) -> None:
    _, model = load_tiny(tiny_model_dir)
    ids, mask = _ids()
    with torch.inference_mode():
        plain = model(input_ids=ids, attention_mask=mask).logits
    before = _weight_bytes(model)
    layers = pack_linears(model)
    assert layers and all(type(m) is PackedLinear and m.weight.numel() == 0 for m in layers)
    assert _weight_bytes(model) <= 1.02 * before, "the packed weights replace the plain ones"
    with torch.inference_mode():
        got = model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(got, plain, rtol=1e-4, atol=1e-4)


def test_a_layer_whose_weight_is_shared_keeps_it_and_runs_on_onednn() -> None:
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8), nn.Linear(8, 10, bias=False))
    model[2].weight = model[0].weight  # an lm_head tied to the embeddings
    x = torch.randn(3, 8)
    with torch.inference_mode():
        plain = model[2](x)
    layers = pack_linears(model)
    assert layers == [model[1]]
    assert model[2].weight is model[0].weight and model[2].weight.shape == (10, 8)  # no second copy
    with torch.inference_mode():
        got = model[2](x)
        assert torch.ops.mkldnn._linear_pointwise.default in _operators_run(lambda: model[2](x))
    torch.testing.assert_close(got, plain, rtol=1e-5, atol=1e-5)


def _operators_run(fn) -> set:
    """The ATen operators ``fn()`` runs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: set = set()

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.add(func)
            return func(*args, **(kwargs or {}))

    with Record():
        fn()
    return seen


def test_grouped_lora_rows_on_packed_layers_match_peft_alone(tiny_model_dir: Path, tmp_path: Path) -> None:
    folders = {
        "a": make_adapter(tiny_model_dir, tmp_path / "a", seed=1),
        "b": make_adapter(tiny_model_dir, tmp_path / "b", seed=2, targets=("q_proj", "k_proj", "v_proj", "o_proj")),
    }
    _, plain_model = load_tiny(tiny_model_dir)
    plain = AdapterRegistry(plain_model, folders.__getitem__)
    _, model = load_tiny(tiny_model_dir)
    pack_linears(model)  # before the adapters: PEFT wraps the packed layers
    packed = AdapterRegistry(model, folders.__getitem__)
    for name in folders:
        plain.acquire(name)
        packed.acquire(name)
    ids, mask = _ids()
    ids, mask = torch.cat([ids, ids]), torch.cat([mask, mask])
    names = ["a", None, "b", "a"]
    with torch.inference_mode():
        alone = []
        for r, name in enumerate(names):
            plain.activate(name)
            alone.append(plain.base(input_ids=ids[r : r + 1], attention_mask=mask[r : r + 1]).logits)
        assert packed.activate_rows(names)
        rows = packed.base(input_ids=ids, attention_mask=mask).logits
    for r in range(len(names)):
        real = mask[r].bool()
        torch.testing.assert_close(rows[r, real], alone[r][0, real], rtol=1e-4, atol=1e-4)


def test_the_runtime_serves_on_packed_layers_the_tokens_of_plain_ones(tiny_model_dir: Path) -> None:
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
            packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
            assert bool(packed) == packed_weights
            assert all(m.weight.numel() == 0 for m in packed)
            client.close()
        finally:
            server.close()
    assert outputs[True] == outputs[False] and len(outputs[True]) == 6
