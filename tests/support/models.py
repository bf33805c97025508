"""A tiny random Llama for tests and benchmarks that need a real transformers model folder."""

from __future__ import annotations

from pathlib import Path


def save_tiny_llama(out: Path, tokenizer_dir: Path) -> Path:
    """Save a tiny randomly initialised Llama (hidden 64, 2 layers, 4 heads, 2 kv heads, tied
    embeddings; seed 0, so the same weights every time) with the tokenizer of ``tokenizer_dir`` to
    folder ``out`` and return ``out``.

    Its vocabulary is that tokenizer's, so chat templates, EOS and padding behave as in the model
    the tokenizer came from; it loads through the ordinary ``from_pretrained(out)`` in a fraction
    of a second.

    Raises:
        OSError: ``tokenizer_dir`` holds no tokenizer (transformers' error).
    """
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
