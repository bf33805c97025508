"""Hyper-parameters of GRPO on a causal LM (``lora_finetune``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from opentinker_common.spec._parse import num
from opentinker_common.spec import lm_fields
from opentinker_common.spec.registry import register_workload

__all__ = ["FullGRPOConfig", "GRPOConfig", "LORA_FIELDS"]


@dataclass(frozen=True)
class GRPOConfig:
    """Hyper-parameters of ``lora_finetune``: GRPO with a PEFT LoRA adapter.

    Each step samples ``prompts_per_step`` prompts, ``group_size`` completions each, scores them,
    and takes ``ppo_epochs`` clipped policy-gradient updates on group-relative advantages
    (Shao et al. 2024, DeepSeekMath, https://arxiv.org/abs/2402.03300).
    """

    steps: int = num(15, 1, 100_000, doc="optimizer steps (one batch of rollouts each)")
    prompts_per_step: int = num(4, 1, 4096)
    group_size: int = num(8, 2, 1024, doc="completions per prompt; advantages are relative within a group")
    max_new_tokens: int = num(10, 1, 8192)
    temperature: float = num(0.7, 0.0, 10.0, min_exclusive=True)
    top_p: float = lm_fields.rollout_top_p()
    learning_rate: float = num(
        5e-4,
        0.0,
        1.0,
        min_exclusive=True,
        doc="AdamW learning rate of the adapter (5e-4: measured with scripts/measure_grpo.py)",
    )
    weight_decay: float = num(0.0, 0.0, 1.0)
    max_grad_norm: float = num(1.0, 0.0, 1e6, min_exclusive=True)
    ppo_epochs: int = num(1, 1, 64, doc="gradient updates per batch of rollouts")
    micro_batch_size: int = num(
        0,
        0,
        65536,
        doc="sequences per forward/backward pass, rounded down to whole groups (at least one); 0 = the whole batch",
    )
    clip_eps: float = num(0.2, 0.0, 10.0, min_exclusive=True, doc="PPO ratio clip range")
    kl_coef: float = num(0.0, 0.0, 100.0, doc="weight of the k3 KL penalty to the reference model; 0 skips it")
    scale_rewards: bool = True
    loss_aggregation: str = lm_fields.loss_aggregation()
    lora_rank: int = lm_fields.lora_rank()
    lora_alpha: float = lm_fields.lora_alpha()
    lora_dropout: float = lm_fields.lora_dropout()
    target_modules: tuple[str, ...] = lm_fields.target_modules()
    checkpoint_every: int = lm_fields.checkpoint_every()
    seed: int = num(0, 0, 2**31 - 1)
    dtype: str = field(default="auto", metadata={"choices": ("auto", "float32", "bfloat16", "float16")})

    def check(self, path: str) -> None:
        lm_fields.check_target_modules(self.target_modules, path)
        lm_fields.check_rollout_top_p(self.top_p, path)


register_workload("lora_finetune", GRPOConfig, env_kinds=("text",))


# ---------------------------------------------------------------------------------------------
# full_rl on a causal LM: the same GRPO, all weights trained (no LoRA fields).

#: GRPOConfig fields that only make sense with a LoRA adapter.
LORA_FIELDS: tuple[str, ...] = ("lora_rank", "lora_alpha", "lora_dropout", "target_modules")


def _full_grpo_fields() -> list[tuple[str, Any, Any]]:
    import typing

    hints = typing.get_type_hints(GRPOConfig)
    out = []
    for f in dataclasses.fields(GRPOConfig):
        if f.name in LORA_FIELDS:
            continue
        default, meta = f.default, dict(f.metadata)
        if f.name == "learning_rate":
            default, meta["doc"] = 1e-5, "AdamW learning rate of all weights (smaller than LoRA's: every weight moves)"
        out.append((f.name, hints[f.name], field(default=default, metadata=meta)))
    return out


def _check_full(self, path: str) -> None:
    """The checks of :meth:`GRPOConfig.check` on the fields ``full_rl`` keeps (``top_p``)."""
    lm_fields.check_rollout_top_p(self.top_p, path)


FullGRPOConfig = dataclasses.make_dataclass(
    "FullGRPOConfig",
    _full_grpo_fields(),
    frozen=True,
    namespace={
        "__doc__": (
            "Hyper-parameters of ``full_rl`` on a text environment: GRPO updating all weights of the "
            "causal LM (no adapter). The fields of :class:`GRPOConfig` without the LoRA ones "
            f"({', '.join(LORA_FIELDS)}); ``learning_rate`` defaults to 1e-5. With ``kl_coef > 0`` "
            "the reference model is a frozen copy of the starting weights (twice the memory)."
        ),
        "__module__": __name__,
        "check": _check_full,
    },
)

register_workload("full_rl", FullGRPOConfig, env_kinds=("text",))
