"""Running each distinct prompt once gives the same log-probs and gradients as the flat path."""

from __future__ import annotations

import torch

from opentinker_trainer.rl.rollout import left_pad, right_pad, sequence_logprobs
from opentinker_trainer.rl.shared_prompts import dedupe, shared_prompt_logprobs


def test_dedupe_keeps_first_seen_order():
    assert dedupe([[1, 2], [3], [1, 2], [4], [3]]) == ([[1, 2], [3], [4]], [0, 1, 0, 2, 1])


def test_matches_sequence_logprobs_values_and_gradients(tiny_model_dir):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir),
        LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
    )
    prompts = [[5, 6, 7, 8], [9, 10], [5, 6, 7, 8], [9, 10], [11, 12, 13]]
    completions = [[1, 2, 3], [4], [7, 7], [2, 3, 4], [5, 5]]
    pi, pm = left_pad(prompts, 0)
    ci, cm = right_pad(completions, 0)

    flat = sequence_logprobs(model, pi, pm, ci, cm, temperature=0.7)
    flat[cm].sum().backward()
    want = [p.grad.clone() for p in model.parameters() if p.requires_grad]
    model.zero_grad()
    shared = shared_prompt_logprobs(model, prompts, ci, cm, pad_token_id=0, temperature=0.7)
    shared[cm].sum().backward()
    got = [p.grad.clone() for p in model.parameters() if p.requires_grad]

    assert shared.shape == flat.shape == (5, 3)
    assert torch.allclose(shared[cm], flat[cm], atol=1e-5)
    assert all(torch.allclose(a, b, atol=1e-4, rtol=1e-3) for a, b in zip(want, got))
    one = shared_prompt_logprobs(model, prompts[:1], ci[:1, :1], cm[:1, :1], pad_token_id=0)
    assert one.shape == (1, 1)
