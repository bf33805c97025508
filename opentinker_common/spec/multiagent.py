"""Multi-agent environments (env kind ``multiagent``): PettingZoo parallel environments from an
allow-list, and the hyper-parameters of multi-agent PPO on them (``full_rl``).

Environment ids are ``<package>/<module>``, e.g. ``mpe2/simple_spread_v3`` (the cooperative
"spread" task of the Multi-Agent Particle Environments, Lowe et al. 2017,
https://arxiv.org/abs/1706.02275, now in the ``mpe2`` package). Only ids in
:data:`MULTIAGENT_ENVIRONMENTS` are accepted, and the module imported is the one the allow-list
names, never one spelled by the user: a task spec must not be able to import arbitrary code.

``env_kwargs`` are bounded first, by an explicit per-module table of the keyword arguments each
``parallel_env`` accepts (:data:`ENV_KWARGS`: types and ranges, e.g. ``N`` at most 32): building an
environment costs time and memory that grow with its size (``N: 3200`` took 24 s and 600 MB in the
scheduler), and an unknown key is refused with the accepted ones.
Where the package is importable (trainer installs), ``env_kwargs`` are then checked by building the
environment once, and the seed's ``action_space`` / ``observation_space`` sizes are checked
against every agent's spaces; a scheduler without PettingZoo skips these checks and the trainer
repeats them.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
from dataclasses import dataclass, field
from typing import Any

from opentinker_common.spec._parse import SpecError, did_you_mean, num, short_repr
from opentinker_common.spec.gym import kwargs_key, space_size
from opentinker_common.spec.ppo import PPOConfig
from opentinker_common.spec.registry import register_env_family, register_workload

__all__ = [
    "ENV_KWARGS",
    "MULTIAGENT_ENVIRONMENTS",
    "MultiAgentEnvConfig",
    "MultiAgentPPOConfig",
    "check_env_kwargs",
    "import_parallel_env_module",
]

#: env_id -> the Python module whose ``parallel_env(**env_kwargs)`` makes it. The allow-list.
MULTIAGENT_ENVIRONMENTS: dict[str, str] = {
    f"mpe2/{name}": f"mpe2.{name}"
    for name in (
        "simple_v3",
        "simple_spread_v3",
        "simple_reference_v3",
        "simple_speaker_listener_v4",
        "simple_push_v3",
        "simple_adversary_v3",
        "simple_tag_v3",
        "simple_crypto_v3",
    )
}

# Keyword arguments that would open windows or change what the trainer sees.
_REFUSED_KWARGS = ("render_mode",)


@dataclass(frozen=True)
class Kwarg:
    """One accepted keyword argument of a ``parallel_env``: ``kind`` ``int``, ``float`` or
    ``bool``; numbers within ``[lo, hi]``."""

    kind: str
    lo: float = 0
    hi: float = 0

    def describe(self) -> str:
        if self.kind == "bool":
            return "true or false"
        return f"{'an integer' if self.kind == 'int' else 'a number'} in [{self.lo:g}, {self.hi:g}]"

    def accepts(self, value: Any) -> bool:
        if self.kind == "bool":
            return isinstance(value, bool)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if self.kind == "int" and not (isinstance(value, int) or float(value).is_integer()):
            return False
        return self.lo <= value <= self.hi


#: Agents, landmarks, obstacles: small teams (the build cost and the observation grow with N^2).
MAX_ENTITIES = 32
_COMMON = {
    "max_cycles": Kwarg("int", 1, 100_000),
    "continuous_actions": Kwarg("bool"),
    "dynamic_rescaling": Kwarg("bool"),
}
_TEAM = Kwarg("int", 1, MAX_ENTITIES)
_NEIGHBORS = {"num_agent_neighbors": _TEAM, "num_landmark_neighbors": _TEAM}  # partial observability
_EPISODE = {"curriculum": Kwarg("bool"), "terminate_on_success": Kwarg("bool")}

#: env_id -> the keyword arguments its ``parallel_env`` may be given (read from the mpe2 modules'
#: signatures; ``render_mode`` and ``benchmark_data`` are left out on purpose).
ENV_KWARGS: dict[str, dict[str, Kwarg]] = {
    "mpe2/simple_v3": dict(_COMMON),
    "mpe2/simple_spread_v3": {"N": _TEAM, "local_ratio": Kwarg("float", 0.0, 1.0), **_COMMON, **_EPISODE, **_NEIGHBORS},
    "mpe2/simple_reference_v3": {"local_ratio": Kwarg("float", 0.0, 1.0), **_COMMON},
    "mpe2/simple_speaker_listener_v4": dict(_COMMON),
    "mpe2/simple_push_v3": dict(_COMMON),
    "mpe2/simple_adversary_v3": {"N": _TEAM, **_COMMON, **_NEIGHBORS},
    "mpe2/simple_tag_v3": {
        "num_good": _TEAM,
        "num_adversaries": _TEAM,
        "num_obstacles": Kwarg("int", 0, MAX_ENTITIES),
        **_COMMON,
        **_EPISODE,
        **_NEIGHBORS,
    },
    "mpe2/simple_crypto_v3": dict(_COMMON),
}


def check_env_kwargs(env_id: str, env_kwargs: dict[str, Any], path: str) -> None:
    """Refuse ``env_kwargs`` outside :data:`ENV_KWARGS` for ``env_id`` (``path`` = the
    ``env_kwargs`` field path, e.g. ``spec.env_config.env_kwargs``).

    Raises:
        SpecError: an unknown key (naming the accepted ones) or a value of the wrong type or out
            of range, e.g. ``spec.env_config.env_kwargs.N: expected an integer in [1, 32], got 3200``.
    """
    accepted = ENV_KWARGS.get(env_id, {})
    for key, value in env_kwargs.items():
        rule = accepted.get(key)
        if rule is None:
            names = ", ".join(accepted) or "none"
            # The field stays ``env_kwargs`` (the mapping is what is wrong); the key is named.
            raise SpecError(
                path,
                f"options {env_id} accepts ({names}); {short_repr(key, 60)} is not one of them",
                dict(env_kwargs),
                hint=did_you_mean(key, accepted),
            )
        if not rule.accepts(value):
            raise SpecError(f"{path}.{key}", rule.describe(), value)


def is_multiagent_id(env_id: str) -> bool:
    """True for an id in the allow-list :data:`MULTIAGENT_ENVIRONMENTS`."""
    return env_id in MULTIAGENT_ENVIRONMENTS


def import_parallel_env_module(env_id: str):
    """The allow-listed module of ``env_id`` (has ``parallel_env(**kwargs)``).

    Raises:
        KeyError: ``env_id`` is not in the allow-list.
        ImportError: its package is not installed here.
    """
    module = MULTIAGENT_ENVIRONMENTS[env_id]
    os.environ.setdefault("PYGAME_HIDE_SUPPORT_PROMPT", "1")  # pygame prints a banner on stdout
    return importlib.import_module(module)


@functools.lru_cache(maxsize=64)
def _real_spaces(env_id: str, kwargs_json: str) -> dict[str, tuple[str, str, int | None, int | None]] | str:
    """Per agent (action space, observation space, their sizes) of ``env_id`` made with the keyword
    arguments ``kwargs_json`` (:func:`~opentinker_common.spec.gym.kwargs_key`), an error string,
    or ``""`` when the package is not installed here."""
    try:
        module = import_parallel_env_module(env_id)
    except ImportError:
        return ""
    try:
        env = module.parallel_env(**json.loads(kwargs_json))
    except Exception as exc:  # noqa: BLE001 - bad kwargs raise TypeError, ValueError, AssertionError ...
        return f"options {env_id} accepts ({type(exc).__name__}: {exc})"
    try:
        return {
            a: (
                str(env.action_space(a)),
                str(env.observation_space(a)),
                space_size(env.action_space(a)),
                space_size(env.observation_space(a)),
            )
            for a in env.possible_agents
        }
    finally:
        env.close()


@dataclass(frozen=True)
class MultiAgentEnvConfig:
    """A PettingZoo parallel environment from the allow-list, made with
    ``<module>.parallel_env(**env_kwargs)`` (e.g. ``{"N": 3, "max_cycles": 25}`` for
    ``mpe2/simple_spread_v3``). ``action_space`` / ``observation_space``: the seed's declared
    per-agent sizes; when given, every agent's space must have that size."""

    env_id: str = "mpe2/simple_spread_v3"
    action_space: int | None = num(None, 1, 1_000_000_000)
    observation_space: int | None = num(None, 1, 1_000_000_000)
    seed: int | None = num(None, 0, 2**31 - 1)
    env_kwargs: dict[str, Any] = field(default_factory=dict)

    def check(self, path: str) -> None:
        for key in _REFUSED_KWARGS:
            if key in self.env_kwargs:
                raise SpecError(
                    f"{path}.env_kwargs.{key}", "no render_mode (trainers run headless)", self.env_kwargs[key]
                )
        check_env_kwargs(self.env_id, self.env_kwargs, f"{path}.env_kwargs")
        real = _real_spaces(self.env_id, kwargs_key(self.env_kwargs))
        if real == "":
            return
        if isinstance(real, str):
            raise SpecError(f"{path}.env_kwargs", real, dict(self.env_kwargs))
        for agent, (act, obs, act_n, obs_n) in real.items():
            if self.action_space is not None and self.action_space != act_n:
                raise SpecError(
                    f"{path}.action_space", f"the size of {agent}'s action space {act} ({act_n})", self.action_space
                )
            if self.observation_space is not None and self.observation_space != obs_n:
                raise SpecError(
                    f"{path}.observation_space",
                    f"the size of {agent}'s observation space {obs} ({obs_n})",
                    self.observation_space,
                )


@dataclass(frozen=True)
class MultiAgentPPOConfig(PPOConfig):
    """PPO for every agent of a parallel multi-agent environment (``full_rl`` on kind
    ``multiagent``). Same fields as :class:`~opentinker_common.spec.ppo.PPOConfig`, with defaults
    for MPE ``simple_spread`` (25-step episodes), plus:

    * ``parameter_sharing``: true = one actor-critic for all agents, its input the agent's
      observation plus a one-hot agent index (agents need equal spaces); false = an independent
      actor-critic and optimizer per agent (independent PPO, de Witt et al. 2020,
      https://arxiv.org/abs/2011.09533).

    ``num_envs`` copies of the environment run side by side; ``batch_size`` counts
    *environment* steps (each yields one sample per agent).
    """

    total_timesteps: int = num(200_000, 1, 10_000_000_000, doc="environment steps to train for (summed over envs)")
    num_envs: int = num(8, 1, 1024)
    num_steps: int = num(128, 1, 100_000)
    learning_rate: float = num(7e-4, 0.0, 1.0, min_exclusive=True)
    ent_coef: float = num(0.01, 0.0, 100.0)
    parameter_sharing: bool = True


register_env_family(
    f"a PettingZoo parallel environment ({', '.join(MULTIAGENT_ENVIRONMENTS)})",
    is_multiagent_id,
    MultiAgentEnvConfig,
    kind="multiagent",
    description="a PettingZoo parallel environment from the allow-list",
)
register_workload("full_rl", MultiAgentPPOConfig, env_kinds=("multiagent",))
