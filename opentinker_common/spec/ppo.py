"""Hyper-parameters of ``full_rl`` with PPO on gymnasium environments (env kind ``gym``).

PPO with a clipped surrogate, GAE, a (optionally clipped) value loss and an entropy bonus —
Schulman et al. 2017, https://arxiv.org/abs/1707.06347; GAE, Schulman et al. 2016,
https://arxiv.org/abs/1506.02438. Defaults are CleanRL's ``ppo.py`` for CartPole
(https://docs.cleanrl.dev/rl-algorithms/ppo/#ppopy), so one update collects
``num_envs * num_steps`` environment steps and takes ``update_epochs * num_minibatches``
optimizer steps on them.
"""

from __future__ import annotations

from typing import ClassVar
from dataclasses import dataclass, field

from opentinker_common.spec._parse import SpecError, num
from opentinker_common.spec.registry import register_workload

__all__ = ["CLIP_SCHEDULES", "PPOConfig"]

#: Values of ``PPOConfig.clip_schedule``.
CLIP_SCHEDULES = ("constant", "linear")

_HIDDEN = field(
    default=(64, 64), metadata={"min": 1, "max": 4096, "doc": "widths of the MLP hidden layers (actor and critic each)"}
)


@dataclass(frozen=True)
class PPOConfig:
    """Hyper-parameters of PPO with an MLP actor-critic (``full_rl`` on a gymnasium id).

    ``checkpoint_every`` counts *updates* (one rollout of ``num_envs * num_steps`` environment
    steps plus its optimisation); the metric ``step`` is the update number too.

    Schedules, for update ``u`` (1-based) of ``num_updates``: the learning rate when ``anneal_lr``
    and the clip coefficient when ``clip_schedule`` is ``linear`` are ``x * (1 - (u - 1) / num_updates)``
    (CleanRL's learning-rate annealing; SB3's ``lin_x`` schedules, which rl-baselines3-zoo uses for
    CartPole). The value clip (``clip_vloss``) uses the same coefficient as the ratio clip of that
    update, as OpenAI baselines' PPO2, whose one ``cliprange`` serves both. ``target_kl`` is checked
    after every minibatch (CleanRL ``ppo.py`` computes ``approx_kl`` per minibatch; SB3 checks each
    minibatch too, against ``1.5 * target_kl`` and before the step).
    """

    #: PPO builds its own MLP policy (``hidden_sizes``): ``spec.model`` is not used and may be empty.
    USES_MODEL: ClassVar[bool] = False

    total_timesteps: int = num(500_000, 1, 10_000_000_000, doc="environment steps to train for (summed over envs)")
    num_envs: int = num(4, 1, 1024, doc="parallel sub-environments of the vector env")
    num_steps: int = num(128, 1, 100_000, doc="steps per sub-environment per rollout")
    learning_rate: float = num(2.5e-4, 0.0, 1.0, min_exclusive=True, doc="Adam learning rate")
    anneal_lr: bool = True
    gamma: float = num(0.99, 0.0, 1.0, doc="discount")
    gae_lambda: float = num(0.95, 0.0, 1.0, doc="GAE lambda")
    num_minibatches: int = num(4, 1, 100_000)
    update_epochs: int = num(4, 1, 1000)
    norm_adv: bool = True
    clip_coef: float = num(
        0.2, 0.0, 10.0, min_exclusive=True, doc="PPO ratio clip range (the first update's when clip_schedule is linear)"
    )
    clip_schedule: str = field(
        default="constant",
        metadata={
            "choices": CLIP_SCHEDULES,
            "doc": (
                "constant: clip_coef every update; linear: clip_coef * (1 - (update - 1) / num_updates), "
                "annealed towards 0 like the learning rate (SB3 / rl-zoo clip_range: lin_0.2)"
            ),
        },
    )
    clip_vloss: bool = field(
        default=True,
        metadata={
            "doc": (
                "clip the value loss around the rollout's values with the update's clip coefficient "
                "(OpenAI baselines PPO2, CleanRL --clip-vloss); false: plain 0.5 * (V - R)^2 (SB3's default)"
            )
        },
    )
    ent_coef: float = num(0.01, 0.0, 100.0)
    vf_coef: float = num(0.5, 0.0, 100.0)
    max_grad_norm: float = num(0.5, 0.0, 1e6, min_exclusive=True)
    target_kl: float | None = num(
        None,
        0.0,
        100.0,
        min_exclusive=True,
        doc=(
            "end the update after the first minibatch whose approx_kl (measured before its step) exceeds it: "
            "no further minibatch or epoch (checked per minibatch; null: never)"
        ),
    )
    hidden_sizes: tuple[int, ...] = _HIDDEN
    activation: str = field(default="tanh", metadata={"choices": ("tanh", "relu")})
    seed: int = num(1, 0, 2**31 - 1)
    checkpoint_every: int = num(0, 0, 1_000_000, doc="updates between checkpoints; 0 writes only the final one")
    vector_mode: str = field(default="sync", metadata={"choices": ("sync", "async")})
    async_context: str = field(default="spawn", metadata={"choices": ("spawn", "forkserver")})

    @property
    def batch_size(self) -> int:
        """Environment steps per update: ``num_envs * num_steps``."""
        return self.num_envs * self.num_steps

    @property
    def num_updates(self) -> int:
        """Updates of the whole run: ``total_timesteps // batch_size``."""
        return self.total_timesteps // self.batch_size

    def check(self, path: str) -> None:
        if self.total_timesteps < self.batch_size:
            raise SpecError(
                f"{path}.total_timesteps",
                f"at least one update: >= num_envs * num_steps ({self.batch_size})",
                self.total_timesteps,
            )
        if self.num_minibatches > self.batch_size:
            raise SpecError(
                f"{path}.num_minibatches",
                f"an integer <= num_envs * num_steps ({self.batch_size})",
                self.num_minibatches,
            )
        if not 1 <= len(self.hidden_sizes) <= 8:
            raise SpecError(f"{path}.hidden_sizes", "a list of 1 to 8 layer widths", list(self.hidden_sizes))


register_workload("full_rl", PPOConfig, env_kinds=("gym",))
