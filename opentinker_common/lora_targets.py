"""Tinker's LoRA switches as the ``target_modules`` of a ``lora_session``.

Tinker's ``LoraConfig`` chooses what the adapter wraps with three flags, all true by default:
``train_attn`` (the attention projections), ``train_mlp`` (the MLP projections, the experts' too in
a mixture of experts) and ``train_unembed`` (the output projection, ``lm_head``). A
``lora_session`` takes module names instead (its ``target_modules`` hyper-parameter, matched by
PEFT against the last part of each module's name), so a client of Tinker's API maps the flags
with :func:`tinker_target_modules`. ``lm_head`` is an adapter on the output projection alone: with
tied embeddings the input embedding stays frozen and unchanged.

Pure: no torch, no I/O; the model is described by its ``config.json`` as a dict
(:func:`opentinker_common.lora_memory.read_model_config` reads one).
"""

from __future__ import annotations

from typing import Any, Mapping

__all__ = ["ATTENTION_MODULES", "MLP_MODULES", "UNEMBED_MODULES", "MODEL_TYPES", "tinker_target_modules"]

#: The attention projections of a Llama-style decoder layer.
ATTENTION_MODULES: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
#: The MLP projections of a Llama-style decoder layer (each expert's, in the MoE variants).
MLP_MODULES: tuple[str, ...] = ("gate_proj", "up_proj", "down_proj")
#: The output projection to the vocabulary.
UNEMBED_MODULES: tuple[str, ...] = ("lm_head",)
#: ``model_type`` values whose modules carry the names above.
MODEL_TYPES: frozenset[str] = frozenset(
    {"llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "gemma", "gemma2"}
)


def tinker_target_modules(
    *, train_mlp: bool, train_attn: bool, train_unembed: bool, model_config: Mapping[str, Any]
) -> tuple[str, ...]:
    """The ``target_modules`` that Tinker's three flags select on the model of ``model_config``:
    attention, then MLP, then unembedding modules, for the flags that are true.

    Raises:
        ValueError: every flag false (``train_mlp``, ``train_attn``, ``train_unembed``: at least
            one must be true, as Tinker requires), or a ``model_type`` whose module names are not
            known here (named, with the known ones).
    """
    if not (train_mlp or train_attn or train_unembed):
        raise ValueError("train_mlp, train_attn, train_unembed: at least one must be true, got all false")
    model_type = model_config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ValueError(f"model_type: expected one of {', '.join(sorted(MODEL_TYPES))}, got {model_type!r}")
    return (
        (ATTENTION_MODULES if train_attn else ())
        + (MLP_MODULES if train_mlp else ())
        + (UNEMBED_MODULES if train_unembed else ())
    )
