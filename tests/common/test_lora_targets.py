"""Tinker's train_attn / train_mlp / train_unembed flags as a lora_session's target_modules."""

from __future__ import annotations

import itertools

import pytest

from opentinker_common.lora_targets import tinker_target_modules

LLAMA = {"model_type": "llama", "tie_word_embeddings": True}


def test_each_flag_adds_its_modules_in_a_fixed_order() -> None:
    attn, mlp, unembed = ("q_proj", "k_proj", "v_proj", "o_proj"), ("gate_proj", "up_proj", "down_proj"), ("lm_head",)
    for a, m, u in itertools.product((False, True), repeat=3):
        if not (a or m or u):
            continue
        got = tinker_target_modules(train_attn=a, train_mlp=m, train_unembed=u, model_config=LLAMA)
        assert got == (attn if a else ()) + (mlp if m else ()) + (unembed if u else ())
    # Tinker's defaults (all true) on a mixture of experts: the experts' projections carry the MLP names.
    assert tinker_target_modules(
        train_attn=True, train_mlp=True, train_unembed=True, model_config={"model_type": "qwen3_moe"}
    ) == (*attn, *mlp, *unembed)


def test_no_flag_or_an_unknown_model_type_is_refused() -> None:
    with pytest.raises(ValueError, match="train_mlp, train_attn, train_unembed: at least one must be true"):
        tinker_target_modules(train_attn=False, train_mlp=False, train_unembed=False, model_config=LLAMA)
    with pytest.raises(ValueError, match=r"model_type: expected one of gemma, .*llama.*, got 'gpt2'"):
        tinker_target_modules(train_attn=True, train_mlp=True, train_unembed=False, model_config={"model_type": "gpt2"})
    with pytest.raises(ValueError, match="model_type: .* got None"):
        tinker_target_modules(train_attn=True, train_mlp=False, train_unembed=False, model_config={})
