"""MLP actor-critic for PPO: a Categorical policy for ``Discrete`` actions, a diagonal Gaussian
for ``Box`` actions; separate actor and critic networks, as CleanRL's ``ppo.py`` /
``ppo_continuous_action.py`` (https://docs.cleanrl.dev/rl-algorithms/ppo/).

Initialisation (CleanRL, from OpenAI baselines): orthogonal weights with gain ``sqrt(2)`` on
hidden layers, ``0.01`` on the policy head (near-uniform first policy) and ``1`` on the value
head; zero biases; the Gaussian's state-independent ``log_std`` starts at 0 (std 1).

Observations go through :class:`ObsEncoder`: a ``Box`` is flattened to float32; a
``Discrete(n)`` observation (FrozenLake, CliffWalking ...) is one-hot encoded to ``n`` floats —
done here, inside the policy, so the environment keeps gymnasium's raw observations.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.distributions import Categorical, Normal

__all__ = ["ActorCritic", "ObsEncoder", "UnsupportedSpaceError"]


class UnsupportedSpaceError(ValueError):
    """The observation or action space is not one this policy handles (only ``Box`` and ``Discrete``)."""


def _space_kind(space: Any) -> str:
    import gymnasium

    if isinstance(space, gymnasium.spaces.Discrete):
        return "discrete"
    if isinstance(space, gymnasium.spaces.Box):
        return "box"
    return type(space).__name__


class ObsEncoder(nn.Module):
    """Raw observations ``[B, *obs_shape]`` (``Box``) or ``[B]`` ints (``Discrete``) to float
    features ``[B, dim]``.

    Raises:
        UnsupportedSpaceError: the space is neither ``Box`` nor ``Discrete``.
    """

    def __init__(self, space: Any) -> None:
        super().__init__()
        self.kind = _space_kind(space)
        if self.kind == "discrete":
            self.n, self.start = int(space.n), int(space.start)
            self.dim = self.n
        elif self.kind == "box":
            self.dim = int(math.prod(space.shape))
        else:
            raise UnsupportedSpaceError(f"observation space {space} is not supported (only Box and Discrete)")

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        if self.kind == "discrete":
            return nn.functional.one_hot(obs.long().view(-1) - self.start, self.n).float()
        return obs.float().reshape(obs.shape[0], -1)


def _layer(n_in: int, n_out: int, gain: float) -> nn.Linear:
    layer = nn.Linear(n_in, n_out)
    nn.init.orthogonal_(layer.weight, gain)
    nn.init.zeros_(layer.bias)
    return layer


def _mlp(n_in: int, hidden: tuple[int, ...], n_out: int, out_gain: float, activation: str) -> nn.Sequential:
    act = {"tanh": nn.Tanh, "relu": nn.ReLU}[activation]
    layers: list[nn.Module] = []
    for width in hidden:
        layers += [_layer(n_in, width, math.sqrt(2)), act()]
        n_in = width
    layers.append(_layer(n_in, n_out, out_gain))
    return nn.Sequential(*layers)


class ActorCritic(nn.Module):
    """Actor ``pi(a | s)`` and critic ``V(s)``, two MLPs over the encoded observation.

    Args:
        obs_space, action_space: gymnasium spaces of one agent (``Box`` or ``Discrete`` each).
        hidden_sizes: hidden layer widths of each network, e.g. ``(64, 64)``.
        activation: ``"tanh"`` (CleanRL's default) or ``"relu"``.
        num_agent_ids: when > 0, a one-hot agent index of this many entries is appended to the
            features (parameter sharing across agents); pass ``agent_ids`` to the methods then.

    Raises:
        UnsupportedSpaceError: a space that is neither ``Box`` nor ``Discrete``.
    """

    def __init__(
        self,
        obs_space: Any,
        action_space: Any,
        hidden_sizes: tuple[int, ...] = (64, 64),
        activation: str = "tanh",
        num_agent_ids: int = 0,
    ) -> None:
        super().__init__()
        self.encoder = ObsEncoder(obs_space)
        self.num_agent_ids = int(num_agent_ids)
        n_in = self.encoder.dim + self.num_agent_ids
        self.action_kind = _space_kind(action_space)
        if self.action_kind == "discrete":
            self.n_actions, self.action_start = int(action_space.n), int(action_space.start)
            n_out = self.n_actions
        elif self.action_kind == "box":
            self.action_shape = tuple(action_space.shape)
            n_out = int(math.prod(self.action_shape))
            low, high = (
                np.broadcast_to(action_space.low, self.action_shape),
                np.broadcast_to(action_space.high, self.action_shape),
            )
            self.register_buffer(
                "action_low", torch.tensor(low.reshape(-1).copy(), dtype=torch.float32), persistent=False
            )
            self.register_buffer(
                "action_high", torch.tensor(high.reshape(-1).copy(), dtype=torch.float32), persistent=False
            )
            self.actor_logstd = nn.Parameter(torch.zeros(1, n_out))
        else:
            raise UnsupportedSpaceError(f"action space {action_space} is not supported (only Box and Discrete)")
        self.critic = _mlp(n_in, tuple(hidden_sizes), 1, 1.0, activation)
        self.actor = _mlp(n_in, tuple(hidden_sizes), n_out, 0.01, activation)

    def features(self, obs: torch.Tensor, agent_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``[B, dim]`` float input of both networks."""
        x = self.encoder(obs)
        if self.num_agent_ids:
            if agent_ids is None:
                raise ValueError("this policy is shared by agents: pass agent_ids [B]")
            x = torch.cat([x, nn.functional.one_hot(agent_ids.long(), self.num_agent_ids).float()], dim=-1)
        return x

    def get_value(self, obs: torch.Tensor, agent_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``V(s)``, ``[B]``."""
        return self.critic(self.features(obs, agent_ids)).squeeze(-1)

    def distribution(self, x: torch.Tensor) -> Categorical | Normal:
        """The action distribution over features ``x`` ``[B, dim]`` (a Normal is per action dim)."""
        out = self.actor(x)
        if self.action_kind == "discrete":
            return Categorical(logits=out, validate_args=False)
        return Normal(out, self.actor_logstd.expand_as(out).exp(), validate_args=False)

    def get_action_and_value(
        self, obs: torch.Tensor, action: torch.Tensor | None = None, agent_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Sample an action (or score ``action``) and evaluate the critic.

        Args:
            obs: ``[B, *obs_shape]`` (``[B]`` for a Discrete observation).
            action: None to sample with torch's global RNG; else ``[B]`` ints (Discrete, 0-based
                policy indices) or ``[B, act_dim]`` floats (Box, unclipped samples).
            agent_ids: ``[B]`` agent indices when the policy is shared.

        Returns:
            ``(action, logprob [B], entropy [B], value [B])``; a Box action's log-prob and entropy
            are summed over its dimensions (diagonal Gaussian).
        """
        x = self.features(obs, agent_ids)
        dist = self.distribution(x)
        if action is None:
            action = dist.sample()
        logprob, entropy = dist.log_prob(action), dist.entropy()
        if self.action_kind == "box":
            logprob, entropy = logprob.sum(-1), entropy.sum(-1)
        return action, logprob, entropy, self.critic(x).squeeze(-1)

    def env_action(self, action: torch.Tensor) -> np.ndarray:
        """What to pass to ``env.step``: Discrete indices shifted by the space's ``start``; Box
        samples clipped to the space's bounds (as gymnasium's ``ClipAction``; the unclipped sample
        is what training scores) and reshaped to ``[B, *action_shape]``."""
        if self.action_kind == "discrete":
            return (action.cpu().numpy() + self.action_start).astype(np.int64)
        clipped = torch.clamp(action, self.action_low, self.action_high)
        return clipped.cpu().numpy().reshape((action.shape[0], *self.action_shape))
