"""Hyper-parameters of ``lora_finetune`` on a discrete gymnasium-kind environment: an LM plays a game.

The language model (with a PEFT LoRA adapter) reads each observation rendered as text, answers
with an action, and is trained with GRPO over whole episodes (see
:mod:`opentinker_trainer.workloads.grpo_game`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from opentinker_common.spec._parse import num
from opentinker_common.spec import lm_fields
from opentinker_common.spec.registry import register_workload

__all__ = ["LMGameGRPOConfig", "REWARD_SHAPING"]

#: ``reward_shaping`` values: ``none``, or ``distance`` (potential-based, Ng et al. 1999,
#: Φ(s) = -grid distance to the goal / the largest such distance; FrozenLake only).
REWARD_SHAPING: tuple[str, ...] = ("none", "distance")


@dataclass(frozen=True)
class LMGameGRPOConfig:
    """GRPO over episodes of a discrete environment played by a causal LM with LoRA.

    Each step plays ``groups_per_step`` groups of ``episodes_per_step`` episodes; the episodes of
    a group start from the same seed, so their returns are comparable and the group-relative
    advantage (Shao et al. 2024, https://arxiv.org/abs/2402.03300) credits the LM's choices, not
    the luck of the start. Every token the LM wrote in an episode gets that episode's advantage.

    A reply that names no action is an invalid action: the environment is not stepped, the turn
    is used up and ``invalid_action_reward`` is added to the episode's return.
    """

    steps: int = num(20, 1, 100_000, doc="optimizer steps (one batch of episodes each)")
    episodes_per_step: int = num(8, 2, 1024, doc="episodes per group, all from the same start seed")
    groups_per_step: int = num(1, 1, 256, doc="groups (start seeds) per step")
    max_turns: int = num(8, 1, 1000, doc="LM replies per episode at most; an episode still running is truncated")
    max_new_tokens: int = num(6, 1, 512)
    temperature: float = num(1.0, 0.0, 10.0, min_exclusive=True)
    top_p: float = lm_fields.rollout_top_p()
    invalid_action_reward: float = num(-0.1, -1e6, 1e6, doc="added to the return for each reply that names no action")
    reward_shaping: str = field(default="none", metadata={"choices": REWARD_SHAPING})
    system_prompt: str | None = field(default=None, metadata={"max_len": 4096, "multiline": True})
    reply_prefix: str | None = field(
        default=None,
        metadata={
            "max_len": 256,
            "multiline": True,
            "doc": (
                "text the reply starts with (the model continues it); None = the renderer's, e.g. 'I move'; '' = none"
            ),
        },
    )
    learning_rate: float = num(5e-4, 0.0, 1.0, min_exclusive=True)
    weight_decay: float = num(0.0, 0.0, 1.0)
    max_grad_norm: float = num(1.0, 0.0, 1e6, min_exclusive=True)
    ppo_epochs: int = num(1, 1, 64)
    micro_batch_size: int = num(
        16, 0, 65536, doc="turns per forward/backward pass (bounds memory); 0 = all of a step's turns at once"
    )
    clip_eps: float = num(0.2, 0.0, 10.0, min_exclusive=True)
    kl_coef: float = num(0.0, 0.0, 100.0)
    scale_rewards: bool = True
    loss_aggregation: str = lm_fields.loss_aggregation()
    lora_rank: int = lm_fields.lora_rank()
    lora_alpha: float = lm_fields.lora_alpha()
    lora_dropout: float = lm_fields.lora_dropout()
    target_modules: tuple[str, ...] = lm_fields.target_modules()
    checkpoint_every: int = num(0, 0, 1_000_000)
    seed: int = num(0, 0, 2**31 - 1)
    dtype: str = field(default="auto", metadata={"choices": ("auto", "float32", "bfloat16", "float16")})

    def check(self, path: str) -> None:
        lm_fields.check_target_modules(self.target_modules, path)
        lm_fields.check_rollout_top_p(self.top_p, path)


register_workload("lora_finetune", LMGameGRPOConfig, env_kinds=("gym",))
