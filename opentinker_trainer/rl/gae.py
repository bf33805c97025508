"""Generalized Advantage Estimation with truncation handled apart from termination, and the
autoreset mask of gymnasium 1.x vector environments.

Shapes: ``T`` rollout steps, ``N`` parallel streams (sub-environments, or sub-environment x agent).

Conventions of a rollout buffer filled from a vector env in ``AutoresetMode.NEXT_STEP`` (the
gymnasium 1.x default, https://farama.org/Vector-Autoreset-Mode):

* ``obs[t]`` is the observation the action ``actions[t]`` was taken on and ``values[t] = V(obs[t])``;
  ``rewards[t]``, ``terminated[t]``, ``truncated[t]`` are what ``step(actions[t])`` returned.
* When step ``t`` ends an episode, the observation it returns — ``obs[t + 1]`` — is the episode's
  true final observation, and step ``t + 1`` is a *reset step*: the env ignores its action, returns
  the first observation of the next episode, reward 0, and neither flag. A reset step is not a
  transition of the MDP, so it gets advantage 0 and must be masked out of every loss
  (:func:`autoreset_mask`).
* Termination (the MDP reached a terminal state) does not bootstrap: the value after it is 0.
  Truncation (a time limit) does: the value after it is ``V(final observation) = values[t + 1]``
  (or ``next_value`` at the end of the buffer) — Pardo et al. 2018, "Time Limits in
  Reinforcement Learning", https://arxiv.org/abs/1712.00378. Either ends the advantage recursion.
"""

from __future__ import annotations

import torch

__all__ = ["autoreset_mask", "gae"]


def autoreset_mask(dones: torch.Tensor, prev_done: torch.Tensor) -> torch.Tensor:
    """Which steps of a rollout are autoreset steps (``NEXT_STEP`` mode).

    Args:
        dones: ``[T, N]`` bool, ``terminated | truncated`` returned by each step.
        prev_done: ``[N]`` bool, ``dones`` of the last step of the previous rollout (all false for
            the first rollout after an explicit ``reset()``).

    Returns:
        ``[T, N]`` bool, true where step ``t`` is a reset step: ``reset[0] = prev_done``,
        ``reset[t] = dones[t - 1]``.
    """
    dones = dones.bool()
    return torch.cat([prev_done.bool().view(1, -1), dones[:-1]], dim=0)


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    next_value: torch.Tensor,
    terminated: torch.Tensor,
    truncated: torch.Tensor,
    reset_mask: torch.Tensor | None = None,
    *,
    gamma: float = 0.99,
    gae_lambda: float = 0.95,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE(gamma, lambda) advantages and lambda-returns.

    ``delta_t = r_t + gamma * (1 - terminated_t) * V(s_{t+1}) - V(s_t)``;
    ``A_t = delta_t + gamma * lambda * (1 - done_t) * A_{t+1}`` with ``done = terminated | truncated``
    — Schulman et al. 2016, https://arxiv.org/abs/1506.02438, eq. 16; returns ``A_t + V(s_t)`` are
    the value targets (CleanRL ``ppo.py``). ``V(s_{t+1})`` is ``values[t + 1]``, or ``next_value``
    for the last step; see the module docstring for why that is the true final observation's
    value after a truncation.

    Args:
        rewards, values: ``[T, N]`` float.
        next_value: ``[N]`` float, ``V`` of the observation returned by the last step.
        terminated, truncated: ``[T, N]`` bool.
        reset_mask: ``[T, N]`` bool from :func:`autoreset_mask`, or None when the rollout has no
            reset steps. Reset steps get advantage 0 and return ``values[t]``.
        gamma: discount; gae_lambda: the GAE lambda (1 = Monte Carlo, 0 = one-step TD).

    Returns:
        ``(advantages [T, N], returns [T, N])``, float32, no grad.
    """
    if rewards.shape != values.shape or rewards.dim() != 2:
        raise ValueError(
            f"rewards and values must both be [T, N], got {tuple(rewards.shape)} and {tuple(values.shape)}"
        )
    with torch.no_grad():
        rewards, values, next_value = rewards.float(), values.float(), next_value.float()
        terminated, truncated = terminated.bool(), truncated.bool()
        not_terminal = (~terminated).float()
        not_done = (~(terminated | truncated)).float()
        steps = rewards.shape[0]
        advantages = torch.zeros_like(rewards)
        last = torch.zeros_like(next_value)
        for t in reversed(range(steps)):
            nxt = next_value if t == steps - 1 else values[t + 1]
            delta = rewards[t] + gamma * not_terminal[t] * nxt - values[t]
            last = delta + gamma * gae_lambda * not_done[t] * last
            if reset_mask is not None:
                last = torch.where(reset_mask[t].bool(), torch.zeros_like(last), last)
            advantages[t] = last
        return advantages, advantages + values
