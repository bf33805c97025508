"""Shared by the inference tests: tiny random LoRA adapters and an in-process inference server."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import torch


def make_adapter(
    base_dir: Path, out: Path, *, seed: int, rank: int = 4, targets=("q_proj", "v_proj"), scale: float = 0.5
) -> Path:
    """Save a LoRA adapter for the model at ``base_dir`` whose B matrices are random (not zero),
    so it really changes the model's outputs."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir)
    model = get_peft_model(
        base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(targets), lora_dropout=0.1)
    )
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * scale)
    model.save_pretrained(out)
    return out


def load_tiny(model_dir: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    return tok, model


def greedy_generate(model, ids: torch.Tensor, n_tokens: int, pad_token_id: int) -> torch.Tensor:
    """``model.generate`` without sampling for exactly ``n_tokens`` new tokens (EOS does not stop
    it): the transformers reference for the server's ``temperature=0, ignore_eos=True``.

    Args:
        ids: ``[1, prompt]`` prompt token ids, no padding (the attention mask is all ones).

    Returns:
        ``[1, prompt + n_tokens]`` token ids, the prompt first.
    """
    return model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=n_tokens,
        min_new_tokens=n_tokens,
        pad_token_id=pad_token_id,
    )


class ServerThread:
    """An InferenceService on a loopback port, its event loop in a background thread."""

    def __init__(self, runtime, *, policies=None) -> None:
        """``runtime`` None: no language model (a ``policies_only`` server); ``policies``: a
        :class:`~opentinker_trainer.inference.policies.PolicyRegistry` for ``Act``."""
        from opentinker_trainer.inference.server import start_inference_server

        self.runtime = runtime
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = asyncio.run_coroutine_threadsafe(
            start_inference_server(runtime, host="127.0.0.1", port=0, policies=policies), self.loop
        ).result(30)
        self.address = f"127.0.0.1:{self.server.port}"

    def call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)

    def close(self) -> None:
        self.call(self.server.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        if self.runtime is not None:
            self.runtime.close()


def tiny_runtime(model_dir: Path, adapters: dict[str, Path] | None = None, **kw):
    """A ModelRuntime on the tiny model; adapters resolve from the given name -> folder map;
    ``kw`` are fields of its :class:`~opentinker_trainer.inference.runtime.RuntimeConfig`."""
    from opentinker_trainer.inference.adapters import AdapterNotFound
    from opentinker_trainer.inference.runtime import ModelRuntime, RuntimeConfig

    tok, model = load_tiny(model_dir)
    table = dict(adapters or {})

    def resolve(name: str) -> Path:
        if name not in table:
            raise AdapterNotFound(f"adapter {name!r}: no task with that id")
        return table[name]

    return ModelRuntime(
        model_name=str(model_dir), tokenizer=tok, model=model, stop_token_ids=[tok.eos_token_id], resolve=resolve,
        config=RuntimeConfig(**kw),
    )  # fmt: skip
