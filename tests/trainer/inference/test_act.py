"""InferenceService.Act through the real gRPC service and InferenceClient: batched observations
in, the trained policy's own greedy actions and values out; bad input refused with the field and
both shapes; a policies-only server refuses Generate."""

from __future__ import annotations

import json
from pathlib import Path

import gymnasium
import numpy as np
import pytest
import torch

from opentinker_client import FailedPreconditionError, InvalidArgumentError, NotFoundError
from opentinker_client.inference import InferenceClient
from opentinker_trainer.inference.policies import PolicyNotFound, PolicyRegistry
from opentinker_trainer.rl.policy import ActorCritic
from opentinker_trainer.rl.policy_export import ACTING_FILE, export_torchscript

from tests.support.inference import ServerThread


def _checkpoint(folder: Path, obs_space, act_space, seed: int) -> ActorCritic:
    """A torch_ppo-like folder as ppo_gym writes it: the TorchScript policy and policy.json."""
    torch.manual_seed(seed)
    policy = ActorCritic(obs_space, act_space, (16,))
    with torch.no_grad():
        for p in policy.actor[-1].parameters():
            p.mul_(100.0)  # far from uniform, so the greedy action depends on the observation
    folder.mkdir(parents=True)
    obs_space.seed(seed)
    export_torchscript(policy, folder / ACTING_FILE, torch.as_tensor(np.asarray(obs_space.sample()))[None])
    meta = {"observation_space": str(obs_space), "observation_shape": list(obs_space.shape or ())}
    (folder / "policy.json").write_text(json.dumps(meta))
    return policy


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("policies")
    cart = gymnasium.spaces.Box(-4.0, 4.0, (4,), np.float32), gymnasium.spaces.Discrete(2)
    lake = gymnasium.spaces.Discrete(16), gymnasium.spaces.Discrete(4)
    pend = gymnasium.spaces.Box(-8.0, 8.0, (3,), np.float32), gymnasium.spaces.Box(-2.0, 2.0, (1,), np.float32)
    policies = {
        "task-cart": (_checkpoint(root / "cart", *cart, seed=1), cart[0]),
        "task-lake": (_checkpoint(root / "lake", *lake, seed=2), lake[0]),
        "task-pend": (_checkpoint(root / "pend", *pend, seed=3), pend[0]),
    }
    (root / "multi").mkdir()  # a checkpoint without an exported policy (a multi-agent task's)
    folders = {"task-cart": root / "cart", "task-lake": root / "lake", "task-pend": root / "pend"}
    folders["task-multi"] = root / "multi"

    def resolve(name: str) -> tuple[Path, int]:
        if name not in folders:
            raise PolicyNotFound(f"policy {name!r}: no task with that id")
        return folders[name], 7

    server = ServerThread(None, policies=PolicyRegistry(resolve, max_resident=2))
    yield server, policies
    server.close()


def test_act_gives_the_policys_own_greedy_actions_and_values(served) -> None:
    server, policies = served
    client = InferenceClient(server.address)
    for name, (policy, obs_space) in policies.items():
        obs_space.seed(0)
        obs = np.stack([np.asarray(obs_space.sample()) for _ in range(5)])
        got = client.act(obs, policy=name)
        with torch.no_grad():
            t = torch.as_tensor(obs)
            dist = policy.distribution(policy.features(t))
            greedy = dist.logits.argmax(-1) if policy.action_kind == "discrete" else dist.mean
            want_actions = policy.env_action(greedy)
            want_values = policy.get_value(t).numpy()
        assert (got.policy, got.step) == (name, 7)
        assert np.allclose(np.asarray(got.actions, dtype=np.float64), want_actions, atol=1e-5), name
        assert np.allclose(got.values, want_values, atol=1e-5), name
        if policy.action_kind == "discrete":
            assert all(isinstance(a, int) for a in got.actions)
    # One observation, as nested lists, with the client's default policy.
    one = InferenceClient(server.address, policy="task-cart").act([[0.1, 0.0, -0.2, 0.3]])
    assert len(one.actions) == 1 and len(one.values) == 1


def test_bad_act_requests_are_refused_with_the_field_and_both_shapes(served) -> None:
    server, _ = served
    client = InferenceClient(server.address)
    with pytest.raises(InvalidArgumentError, match=r"observations.shape: expected \[B, 4\].*got \[2, 3\]"):
        client.act([[0.0, 0.0, 0.0]] * 2, policy="task-cart")
    with pytest.raises(InvalidArgumentError, match="observations.values: expected integers"):
        client.act([0.5], policy="task-lake")
    with pytest.raises(InvalidArgumentError, match="rectangular"):
        client.act([[0.0, 1.0], [0.0]], policy="task-cart")
    with pytest.raises(InvalidArgumentError, match=r"observations.shape\[0\]: expected 1..4096"):
        client.act([[0.0] * 4] * 4097, policy="task-cart")
    with pytest.raises(InvalidArgumentError, match="policy: expected the id"):
        client.act([[0.0] * 4])
    with pytest.raises(NotFoundError, match="task-nope"):
        client.act([[0.0] * 4], policy="task-nope")
    with pytest.raises(FailedPreconditionError, match="no exported policy"):
        client.act([[0.0] * 4], policy="task-multi")
    with pytest.raises(FailedPreconditionError, match="serves PPO policies only"):
        client.generate("hello", max_tokens=2)
    assert client.list_adapters() == []
