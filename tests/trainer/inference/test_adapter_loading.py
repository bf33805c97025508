"""Loading an adapter checks what PEFT loaded: every LoRA tensor of the file, and weights for every
module the adapter's config targets. A file PEFT only partly matches (keys without the
``base_model.model.`` prefix, a target module or some layers missing) is refused with the keys,
never served as the base model or as a partial adapter."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from opentinker_trainer.inference.adapters import AdapterRefused, AdapterRegistry

from tests.support.inference import load_tiny, make_adapter

PREFIX = "base_model.model."


@pytest.fixture(scope="module")
def good(tiny_model_dir: Path, tmp_path_factory) -> Path:
    return make_adapter(tiny_model_dir, tmp_path_factory.mktemp("adapters") / "good", seed=1)


def _variant(src: Path, out: Path, change) -> Path:
    """A copy of adapter ``src`` whose tensors are ``change(tensors)``, its config unchanged."""
    out.mkdir()
    (out / "adapter_config.json").write_text((src / "adapter_config.json").read_text())
    save_file(change(load_file(src / "adapter_model.safetensors")), str(out / "adapter_model.safetensors"))
    return out


def _logits(registry: AdapterRegistry, name: str | None, ids: torch.Tensor) -> torch.Tensor:
    registry.activate(name)
    with torch.no_grad():
        return registry.model(input_ids=ids).logits


def _variants(good: Path, root: Path) -> dict[str, tuple[Path, str]]:
    """name -> (adapter folder, a key the refusal must name)."""
    return {
        "no-prefix": (
            _variant(good, root / "no-prefix", lambda t: {k.removeprefix(PREFIX): v for k, v in t.items()}),
            r"model\.layers\.0\.self_attn\.q_proj\.lora_A\.weight",
        ),
        "no-v_proj": (
            _variant(good, root / "no-v_proj", lambda t: {k: v for k, v in t.items() if "v_proj" not in k}),
            r"layers\.0\.self_attn\.v_proj\.lora_A\.weight",
        ),
        "layer-0-only": (
            _variant(good, root / "layer-0-only", lambda t: {k: v for k, v in t.items() if "layers.1." not in k}),
            r"layers\.1\.self_attn\.q_proj\.lora_A\.weight",
        ),
    }


def test_an_adapter_saved_normally_loads_and_changes_the_outputs(tiny_model_dir, good) -> None:
    _, base = load_tiny(tiny_model_dir)
    registry = AdapterRegistry(base)
    ids = torch.tensor([[1, 2, 3, 4]])
    before = _logits(registry, None, ids)
    registry.acquire("good", good)
    assert not torch.allclose(_logits(registry, "good", ids), before, atol=1e-4)
    assert torch.equal(_logits(registry, None, ids), before)


@pytest.mark.parametrize("first", [True, False], ids=["first-adapter", "added-adapter"])
def test_a_partly_matched_adapter_is_refused_naming_the_missing_keys(tiny_model_dir, good, tmp_path, first) -> None:
    ids = torch.tensor([[1, 2, 3, 4]])
    for name, (path, key) in _variants(good, tmp_path).items():
        registry = AdapterRegistry(load_tiny(tiny_model_dir)[1])
        before = _logits(registry, None, ids)
        if not first:
            registry.acquire("good", good)
        with pytest.raises(AdapterRefused, match=rf"(?s)not every LoRA tensor.*{key}"):
            registry.acquire(name, path)
        assert [a.name for a in registry.list()] == ([] if first else ["good"])
        assert name not in getattr(registry.model, "peft_config", {})
        assert torch.equal(_logits(registry, None, ids), before)  # the base model is left as it was
        registry.acquire("good-again", good)  # and still takes a good adapter
        if not first:
            assert torch.equal(_logits(registry, "good-again", ids), _logits(registry, "good", ids))
