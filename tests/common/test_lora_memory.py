"""The GPU memory estimate of LoRA tenants: parameter counts against a real PEFT model on the tiny
Llama (exact), and bytes against a hand calculation for SmolLM2-135M's shape."""

from __future__ import annotations

import json

import pytest

from opentinker_common import lora_memory as lm

#: SmolLM2-135M's config.json, the sizes that count.
SMOLLM2_135M = {
    "hidden_size": 576,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "intermediate_size": 1536,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
}


@pytest.mark.parametrize(
    "rank, modules",
    [
        (4, ("q_proj", "k_proj", "v_proj", "o_proj")),
        (8, ("q_proj", "v_proj", "gate_proj", "up_proj", "down_proj")),
        (
            4,
            ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"),
        ),  # Tinker's default
    ],
)
def test_counts_match_a_real_peft_model(tiny_model_dir, rank, modules) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    shape = lm.ModelShape.from_config(json.loads((tiny_model_dir / "config.json").read_text()))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32)
    assert lm.base_parameters(shape) == sum(p.numel() for p in model.parameters())
    peft = get_peft_model(model, LoraConfig(r=rank, lora_alpha=16, target_modules=list(modules)))
    adapter = sum(p.numel() for p in peft.parameters() if p.requires_grad)
    assert lm.lora_parameters(shape, rank, modules) == adapter
    assert lm.tenant_bytes(shape, rank, modules) == 16 * adapter


def test_smollm2_135m_by_hand() -> None:
    shape = lm.ModelShape.from_config(SMOLLM2_135M)
    assert (shape.head_dim, shape.dtype_bytes) == (64, 2)
    # Per layer: q, o 576*576; k, v 576*192; gate, up, down 576*1536; two norms 576.
    layer = 2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536 + 2 * 576
    assert lm.base_parameters(shape) == 49152 * 576 + 30 * layer + 576 == 134_515_008
    assert lm.base_bytes(shape) == 2 * 134_515_008
    # Rank 16 on q, k, v, o: 16 * ((576+576) + 2*(576+192) + (576+576)) per layer, 30 layers.
    assert lm.lora_parameters(shape, 16, ("q_proj", "k_proj", "v_proj", "o_proj")) == 30 * 16 * 3840 == 1_843_200
    assert lm.tenant_bytes(shape, 16, ("q_proj", "k_proj", "v_proj", "o_proj")) == 16 * 1_843_200
    assert lm.fmt_bytes(lm.base_bytes(shape)) == "256.6 MiB"
    assert lm.fmt_bytes(3 * lm.GIB) == "3.00 GiB"
    # dtype given overrides the config's
    assert lm.base_bytes(lm.ModelShape.from_config(SMOLLM2_135M, "float32")) == 4 * 134_515_008


def test_bad_shapes_name_what_is_wrong() -> None:
    shape = lm.ModelShape.from_config(SMOLLM2_135M)
    with pytest.raises(ValueError, match="target_modules: no size known for 'c_attn'; known: q_proj.*, lm_head"):
        lm.lora_parameters(shape, 8, ("q_proj", "c_attn"))
    with pytest.raises(ValueError, match="lora_rank: expected a positive integer, got 0"):
        lm.lora_parameters(shape, 0, ("q_proj",))
    with pytest.raises(ValueError, match="config.json: expected hidden_size, a positive integer, got None"):
        lm.ModelShape.from_config({k: v for k, v in SMOLLM2_135M.items() if k != "hidden_size"})
    with pytest.raises(ValueError, match="dtype: expected one of .* or auto, got 'int8'"):
        lm.ModelShape.from_config(SMOLLM2_135M, "int8")


def test_reads_config_from_a_folder_or_the_hub_cache(tmp_path, monkeypatch) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(SMOLLM2_135M))
    assert lm.read_model_config(str(folder)) == SMOLLM2_135M
    snap = tmp_path / "hub" / "models--Org--Name" / "snapshots" / "abc"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps(SMOLLM2_135M))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert lm.read_model_config("Org/Name") == SMOLLM2_135M
    assert lm.read_model_config("Org/Other") is None
    (folder / "config.json").write_text("[1, 2]")
    assert lm.read_model_config(str(folder)) is None
