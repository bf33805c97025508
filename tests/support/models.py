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


def tiny_lora_model(model_dir: Path, adapters):
    """The model of ``model_dir`` (frozen) with one LoRA adapter per ``(name, rank, target
    modules)`` of ``adapters`` (alpha twice the rank, dropout 0.1, each initialised after
    ``torch.manual_seed`` of its index), their B matrices random so that A gets non-zero
    gradients; the first adapter active, eval mode. Returns ``(tokenizer, model)``."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    base = AutoModelForCausalLM.from_pretrained(model_dir).requires_grad_(False).eval()
    model = None
    for i, (name, r, targets) in enumerate(adapters):
        torch.manual_seed(i)
        cfg = LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.1, target_modules=targets)
        if model is None:
            model = get_peft_model(base, cfg, adapter_name=name)
        else:
            model.add_adapter(name, cfg)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    model.set_adapter(adapters[0][0])
    return tok, model.eval()
