"""The TorchScript acting policy gives the trained policy's own greedy action and value, for any
batch size, loaded with torch alone."""

from __future__ import annotations

import gymnasium
import numpy as np
import pytest
import torch

from opentinker_trainer.rl.policy import ActorCritic
from opentinker_trainer.rl.policy_export import ActingPolicy, export_torchscript

SPACES = {
    "box obs, discrete actions (CartPole)": (
        gymnasium.spaces.Box(-4.0, 4.0, (4,), np.float32),
        gymnasium.spaces.Discrete(2),
    ),
    "discrete obs with a start, discrete actions": (
        gymnasium.spaces.Discrete(16),
        gymnasium.spaces.Discrete(3, start=-1),
    ),
    "box obs, box actions (Pendulum)": (
        gymnasium.spaces.Box(-8.0, 8.0, (3,), np.float32),
        gymnasium.spaces.Box(-2.0, 2.0, (1,), np.float32),
    ),
    "image-shaped obs, 2-d box actions": (
        gymnasium.spaces.Box(0.0, 1.0, (2, 3), np.float32),
        gymnasium.spaces.Box(np.array([[-1.0, 0.0]]), np.array([[1.0, 0.5]]), (1, 2), np.float32),
    ),
}


def _obs(space, n: int) -> torch.Tensor:
    space.seed(0)
    return torch.as_tensor(np.stack([np.asarray(space.sample()) for _ in range(n)]))


@pytest.mark.parametrize("name", list(SPACES))
def test_exported_policy_matches_the_policy(name: str, tmp_path) -> None:
    obs_space, act_space = SPACES[name]
    torch.manual_seed(1)
    policy = ActorCritic(obs_space, act_space, (16, 16))
    with torch.no_grad():  # make the heads' outputs far from flat, so argmax and clipping matter
        for p in policy.actor[-1].parameters():
            p.mul_(300.0)
    path = export_torchscript(policy, tmp_path / "acting.pt", _obs(obs_space, 1))
    loaded = torch.jit.load(str(path))
    for batch in (1, 7):
        obs = _obs(obs_space, batch)
        action, value = loaded(obs)
        with torch.no_grad():
            x = policy.features(obs)
            dist = policy.distribution(x)
            want_value = policy.get_value(obs)
            greedy = dist.logits.argmax(-1) if policy.action_kind == "discrete" else dist.mean
        assert torch.allclose(value, want_value, atol=1e-6)
        want_action = policy.env_action(greedy)  # what env.step gets from the policy itself
        assert action.shape == want_action.shape
        assert np.allclose(action.numpy(), want_action, atol=1e-6)
        assert all(act_space.contains(a) for a in np.asarray(action.numpy(), dtype=act_space.dtype))


def test_a_policy_shared_by_agents_is_refused() -> None:
    space = gymnasium.spaces.Box(-1.0, 1.0, (2,), np.float32)
    with pytest.raises(ValueError, match="needs agent ids"):
        ActingPolicy(ActorCritic(space, gymnasium.spaces.Discrete(2), (8,), num_agent_ids=2))
