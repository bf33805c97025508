"""Rollout batching: left-padded prompts, right-padded completions, padding-invariant log-probs."""

from __future__ import annotations

import pytest
import torch

from opentinker_trainer.rl.rollout import (
    completion_mask,
    generate,
    left_pad,
    position_ids_from_mask,
    right_pad,
    sequence_logprobs,
)

PAD = EOS = 2  # as in SmolLM2: pad == eos


@pytest.fixture(scope="module")
def tiny_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model.eval()
    return model


@pytest.fixture(scope="module")
def tiny_lora_model(tiny_model_dir):
    """The tiny model with a non-zero LoRA adapter (so adapter gradients are non-trivial)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    model.eval()
    return model


def test_left_and_right_padding_masks_come_from_lengths():
    # Token 2 (== pad) inside a prompt must stay a real token.
    ids, mask = left_pad([[5, 2, 7], [9]], PAD)
    assert ids.tolist() == [[5, 2, 7], [PAD, PAD, 9]]
    assert mask.tolist() == [[True, True, True], [False, False, True]]
    ids, mask = right_pad([[5, 2], [9, 8, 7]], PAD)
    assert ids.tolist() == [[5, 2, PAD], [9, 8, 7]]
    assert mask.tolist() == [[True, True, False], [True, True, True]]
    assert position_ids_from_mask(torch.tensor([[0, 0, 1, 1, 1, 0]])).tolist() == [[0, 0, 0, 1, 2, 2]]


def test_completion_mask_includes_first_eos_and_nothing_after():
    ids = torch.tensor([[5, 6, EOS, EOS, EOS], [EOS, 7, 8, 9, 9], [5, 6, 7, 8, 9], [5, 99, 6, EOS, 1]])
    mask, lengths = completion_mask(ids, [EOS, 99])
    assert lengths.tolist() == [3, 1, 5, 2]
    assert mask.tolist() == [
        [True, True, True, False, False],
        [True, False, False, False, False],
        [True, True, True, True, True],
        [True, True, False, False, False],
    ]


def _random_batch(seed: int, vocab: int):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (7, 3, 12)]
    prompts[1][1] = EOS  # an EOS inside a prompt (chat templates have them) is a real token
    completions = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 9, 1)]
    completions[0][-1] = EOS
    return prompts, completions


def _alone(model, prompt, completion, temperature=1.0):
    p_ids, p_mask = left_pad([prompt], PAD)
    c_ids, c_mask = right_pad([completion], PAD)
    return sequence_logprobs(model, p_ids, p_mask, c_ids, c_mask, temperature)[0]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_logprobs_of_a_sample_do_not_depend_on_padding(tiny_model_dir, attn):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation=attn).eval()
    prompts, completions = _random_batch(0, model.config.vocab_size)
    p_ids, p_mask = left_pad(prompts, PAD)
    c_ids, c_mask = right_pad(completions, PAD)
    with torch.no_grad():
        batched = sequence_logprobs(model, p_ids, p_mask, c_ids, c_mask, temperature=0.7)
        assert batched.shape == c_ids.shape
        for i, (prompt, completion) in enumerate(zip(prompts, completions)):
            alone = _alone(model, prompt, completion, temperature=0.7)
            torch.testing.assert_close(batched[i, : len(completion)], alone, atol=1e-5, rtol=1e-5)


def test_generate_samples_groups_stops_at_eos_and_is_seeded(tiny_model):
    vocab = tiny_model.config.vocab_size
    prompts, _ = _random_batch(1, vocab)
    p_ids, p_mask = left_pad(prompts, PAD)
    # A random model almost never samples EOS; call half the vocabulary a stop token instead.
    stops = list(range(0, vocab, 2))
    kwargs = dict(max_new_tokens=6, stop_token_ids=stops, pad_token_id=PAD, temperature=1.0, group_size=4)
    a = generate(tiny_model, p_ids, p_mask, seed=123, **kwargs)
    b = generate(tiny_model, p_ids, p_mask, seed=123, **kwargs)
    c = generate(tiny_model, p_ids, p_mask, seed=124, **kwargs)
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert not torch.equal(a.completion_ids, c.completion_ids)
    assert len(a) == 12
    assert torch.equal(a.prompt_ids, p_ids.repeat_interleave(4, dim=0))
    assert 1 <= a.completion_ids.shape[1] <= 6
    for row, mask, n, truncated in zip(a.completion_ids, a.completion_mask, a.completion_lengths, a.truncated):
        n = int(n)
        is_stop = [t in set(stops) for t in row[:n].tolist()]
        assert mask.tolist() == [True] * n + [False] * (len(row) - n)
        assert not any(is_stop[:-1])  # nothing before the last kept token is a stop token
        assert is_stop[-1] == (not truncated)
        assert (row[n:] == PAD).all()


def test_generated_rollout_logprobs_shared_prompt_equal_flat_and_alone(tiny_lora_model):
    model = tiny_lora_model
    vocab = model.config.vocab_size
    prompts, _ = _random_batch(2, vocab)
    p_ids, p_mask = left_pad(prompts, PAD)
    ro = generate(
        model,
        p_ids,
        p_mask,
        max_new_tokens=5,
        stop_token_ids=list(range(0, vocab, 3)),
        pad_token_id=PAD,
        temperature=1.0,
        group_size=3,
        seed=0,
    )
    args = (ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask, 0.7)
    shared = sequence_logprobs(model, *args, group_size=3)
    flat = sequence_logprobs(model, *args, group_size=1)
    m = ro.completion_mask
    torch.testing.assert_close(shared[m], flat[m], atol=1e-5, rtol=1e-5)
    for i, tokens in enumerate(ro.completion_token_lists()):
        alone = _alone(model, prompts[i // 3], tokens, 0.7)
        torch.testing.assert_close(flat[i, : len(tokens)], alone.detach(), atol=1e-5, rtol=1e-5)

    def grads(group_size):
        model.zero_grad(set_to_none=True)
        lp = sequence_logprobs(model, *args, group_size=group_size)
        torch.where(m, lp, torch.zeros(())).sum().backward()
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad])

    g_shared, g_flat = grads(3), grads(1)
    assert g_flat.abs().max() > 0
    torch.testing.assert_close(g_shared, g_flat, atol=1e-4, rtol=1e-4)
    model.zero_grad(set_to_none=True)
