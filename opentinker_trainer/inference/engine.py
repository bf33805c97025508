"""Sampling settings and the model plumbing a decode loop needs: :class:`SamplingParams`, the
finish reasons, and the key/value-cache argument of a model's ``forward``. The decode loops are
:mod:`.batch` (continuous batching: the inference server and training sessions) and
:mod:`opentinker_trainer.rl.rollout_batch` (rollouts of a model host's tenants).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

__all__ = ["SamplingParams", "FINISH_STOP", "FINISH_LENGTH", "cache_kwarg"]

FINISH_STOP = "stop"  # a stop token (EOS, end of turn) or a stop string
FINISH_LENGTH = "length"  # max_tokens reached


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. ``temperature == 0`` is greedy decoding.

    Attributes:
        max_tokens: most new tokens per sample.
        stop: strings that end a sample (the text is cut before them).
        seed: seeds this request's own ``torch.Generator``; ``None`` draws a random seed.
        n: samples of the prompt, decoded as one batch.
        ignore_eos: keep going past stop tokens (benchmarks: fixed-length outputs).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 64
    stop: tuple[str, ...] = ()
    seed: int | None = None
    n: int = 1
    ignore_eos: bool = False


def cache_kwarg(model) -> str:
    """Name of the KV-cache argument of ``forward``: ``cache`` (transformers 5) or
    ``past_key_values`` (older)."""
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    return "cache" if "cache" in inspect.signature(type(base).forward).parameters else "past_key_values"


def _cache_of(out):
    fields = getattr(type(out), "__dataclass_fields__", {})
    return out.get("cache", None) if "cache" in fields else out.past_key_values
