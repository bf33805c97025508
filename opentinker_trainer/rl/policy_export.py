"""A trained :class:`~opentinker_trainer.rl.policy.ActorCritic` for use outside the project: a
TorchScript module that acts greedily and says the critic's value.

``ActingPolicy(obs) -> (action, value)``:

* ``obs``: ``[B, *obs_shape]`` raw observations as gymnasium gives them (floats for a ``Box``,
  ``[B]`` integers for a ``Discrete`` space; the one-hot encoding is inside).
* ``action``: what to pass to ``env.step``: ``[B]`` int64 (``Discrete``: the most probable action,
  shifted by the space's ``start``) or ``[B, *action_shape]`` float32 (``Box``: the Gaussian's mean,
  clipped to the space's bounds, as training clips its samples).
* ``value``: ``V(s)``, ``[B]`` float32.

Saved with :func:`torch.jit.trace` (:func:`export_torchscript`): ``torch.jit.load(path)`` runs it
with torch alone (no OpenTinker, no gymnasium), in Python or C++ (libtorch). Every ``torch_ppo``
checkpoint of a single-agent task holds one (:data:`ACTING_FILE`), so ``opentinker eval`` and
``opentinker export --torchscript`` need nothing but the checkpoint.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn

from opentinker_trainer.rl.policy import ActorCritic

__all__ = ["ACTING_FILE", "ActingPolicy", "export_torchscript"]

#: File name of the TorchScript acting policy in a ``torch_ppo`` checkpoint folder.
ACTING_FILE = "policy.torchscript.pt"


class ActingPolicy(nn.Module):
    """Greedy acting and the value of ``policy`` (a copy on the CPU; see the module docstring).

    Raises:
        ValueError: ``policy`` is shared by agents (it needs agent ids as well).
    """

    def __init__(self, policy: ActorCritic) -> None:
        super().__init__()
        if policy.num_agent_ids:
            raise ValueError("a policy shared by agents needs agent ids; only single-agent policies are exported")
        policy = copy.deepcopy(policy).cpu().eval().requires_grad_(False)  # outputs need no graph
        self.encoder, self.actor, self.critic = policy.encoder, policy.actor, policy.critic
        self.discrete = policy.action_kind == "discrete"
        if self.discrete:
            self.action_start = int(policy.action_start)
        else:
            self.action_shape = tuple(policy.action_shape)
            self.register_buffer("action_low", policy.action_low.clone())
            self.register_buffer("action_high", policy.action_high.clone())

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.encoder(obs)
        out = self.actor(x)
        value = self.critic(x).squeeze(-1)
        if self.discrete:
            return out.argmax(-1) + self.action_start, value
        action = torch.clamp(out, self.action_low, self.action_high)
        return action.reshape((obs.shape[0], *self.action_shape)), value


def export_torchscript(policy: ActorCritic, path: Path, example_obs: torch.Tensor) -> Path:
    """Trace :class:`ActingPolicy` of ``policy`` on ``example_obs`` (``[B, *obs_shape]``, any B)
    and save it to ``path`` (written beside it and renamed into place); returns ``path``."""
    acting = ActingPolicy(policy)
    example = example_obs.detach().cpu()
    with torch.no_grad():
        traced = torch.jit.trace(acting, (example,), check_trace=False)
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    torch.jit.save(traced, str(tmp))
    tmp.replace(path)
    return path
