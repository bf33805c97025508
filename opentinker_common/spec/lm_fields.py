"""Hyper-parameter fields that the language-model workloads share, defined once: the LoRA
adapter's (``lora_finetune`` on text and on games, ``sft``), the checkpoint interval and the
GRPO loss aggregation and the rollout sampler's ``top_p`` (text and games).

Each function gives the ``dataclasses.field`` of one field (default, bounds, ``doc``), for a
config class to declare in its own place, so each class keeps its own field order::

    lora_rank: int = lm_fields.lora_rank()
"""

from __future__ import annotations

from dataclasses import field
from typing import Any

from opentinker_common.spec._parse import SpecError, num

__all__ = [
    "DEFAULT_TARGET_MODULES",
    "LOSS_AGGREGATIONS",
    "lora_rank",
    "lora_alpha",
    "lora_dropout",
    "target_modules",
    "checkpoint_every",
    "check_rollout_top_p",
    "check_target_modules",
    "loss_aggregation",
    "rollout_top_p",
]

#: The attention projections of Llama-style models (SmolLM2, Qwen2.5 ...): what a LoRA adapter
#: wraps unless ``target_modules`` says otherwise.
DEFAULT_TARGET_MODULES: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")


def lora_rank() -> Any:
    """``lora_rank``: the rank r of the adapter's low-rank matrices, 1 to 1024 (default 16)."""
    return num(16, 1, 1024)


def lora_alpha() -> Any:
    """``lora_alpha``: the adapter's scale numerator (the update is scaled by alpha / r), > 0
    (default 32.0)."""
    return num(32.0, 0.0, 1e6, min_exclusive=True)


def lora_dropout() -> Any:
    """``lora_dropout``: dropout probability on the adapter's input, 0 to 1 (default 0.0)."""
    return num(0.0, 0.0, 1.0)


def target_modules() -> Any:
    """``target_modules``: names of the modules the adapter wraps (default
    :data:`DEFAULT_TARGET_MODULES`); at least one (:func:`check_target_modules`)."""
    return field(default=DEFAULT_TARGET_MODULES)


def checkpoint_every() -> Any:
    """``checkpoint_every``: optimizer steps between checkpoints, 0 to 1,000,000; 0 (the
    default) writes only the final one."""
    return num(0, 0, 1_000_000, doc="steps between checkpoints; 0 writes only the final one")


#: ``loss_aggregation`` values: how GRPO's per-token losses are reduced to one number
#: (:func:`opentinker_trainer.rl.grpo.aggregate`). ``token_mean``: sum over every counted token /
#: their number (DAPO); ``seq_mean``: mean over sequences of each one's token mean (GRPO,
#: DeepSeekMath eq. 3); ``dr_grpo``: sum over every counted token / (rows * max_new_tokens), a
#: constant (Dr. GRPO, Liu et al. 2025, https://arxiv.org/abs/2503.20783).
LOSS_AGGREGATIONS: tuple[str, ...] = ("token_mean", "seq_mean", "dr_grpo")


def loss_aggregation() -> Any:
    """``loss_aggregation``: one of :data:`LOSS_AGGREGATIONS` (default ``token_mean``), for the
    policy loss and the KL term alike. Dr. GRPO in full is ``scale_rewards: false`` (no std
    division of the advantages) with ``loss_aggregation: dr_grpo``."""
    return field(
        default="token_mean",
        metadata={
            "choices": LOSS_AGGREGATIONS,
            "doc": (
                "how the per-token losses are reduced: token_mean (sum / tokens), seq_mean (mean of per-sequence "
                "means), dr_grpo (sum / (rows * max_new_tokens)); Dr. GRPO = this and scale_rewards false"
            ),
        },
    )


def rollout_top_p() -> Any:
    """``top_p`` of a GRPO trainer's sampler: a number in (0, 1] by type, and 1.0 only
    (:func:`check_rollout_top_p`); kept as a field so that specs that spell out the default
    still validate."""
    return num(1.0, 0.0, 1.0, min_exclusive=True, doc="1.0 only: training samples from the full softmax")


def check_rollout_top_p(top_p: float, path: str) -> None:
    """Raises :class:`SpecError` (``<path>.top_p``) when ``top_p < 1``.

    GRPO's importance ratio ``pi / pi_old`` and its KL terms take the trainer's log-probs of the
    sampled tokens under the *full* softmax (``softmax(logits / temperature)``), while a nucleus
    sampler draws from the renormalised truncation: with ``top_p < 1`` the behaviour policy is not
    the one in the ratio, and the loss would be silently wrong. The trainer samples with
    ``top_k = 0`` always (no field), so that needs no check. Inference keeps ``top_p`` and
    ``top_k`` (sampling parameters of a request, not of a task spec).
    """
    if top_p < 1.0:
        raise SpecError(
            f"{path}.top_p",
            "1.0 (training samples from the full softmax: the importance ratio and KL compare the trainer's "
            "full-softmax probabilities with the sampler's, which top_p < 1 truncates; top_p is for inference)",
            top_p,
        )


def check_target_modules(modules: tuple[str, ...], path: str) -> None:
    """Raises :class:`SpecError` (``<path>.target_modules``) when ``modules`` is empty."""
    if not modules:
        raise SpecError(f"{path}.target_modules", "at least one module name")
