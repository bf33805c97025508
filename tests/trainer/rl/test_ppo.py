"""PPO math (rl/ppo.py), the actor-critic (rl/policy.py) and environment construction (envs/gym.py)."""

from __future__ import annotations

import math

import gymnasium
import numpy as np
import pytest
import torch

from opentinker_common.spec import GymEnvConfig
from opentinker_trainer.envs.gym import make_env, make_vector_env
from opentinker_trainer.rl import ppo
from opentinker_trainer.rl.policy import ActorCritic, UnsupportedSpaceError

# --- losses -----------------------------------------------------------------------------------


def test_ratio_one_gives_the_plain_policy_gradient_objective() -> None:
    adv = torch.tensor([1.0, -2.0, 0.5])
    logp = torch.tensor([-1.0, -0.5, -2.0], requires_grad=True)
    logratio, ratio = ppo.log_ratio(logp, logp.detach())
    loss = ppo.pg_loss(adv, ratio, 0.2)
    assert loss.item() == pytest.approx(-adv.mean().item())
    loss.backward()
    assert logp.grad.tolist() == pytest.approx((-adv / 3).tolist())  # d/dlogp of -A r at r = 1


def test_pg_loss_clips_in_the_direction_of_the_advantage_and_zeroes_its_gradient() -> None:
    ratio = torch.tensor([1.5, 0.5, 1.5, 0.5], requires_grad=True)
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0])
    loss = ppo.pg_loss(adv, ratio, 0.2)
    # A>0, r>1+eps: -1.2 (clipped); A<0, r<1-eps: 0.8 (clipped); the other two are unclipped.
    assert loss.item() == pytest.approx((-1.2 + 0.8 + 1.5 - 0.5) / 4)
    loss.backward()
    assert ratio.grad.tolist() == pytest.approx([0.0, 0.0, 0.25, -0.25])
    assert ppo.clip_fraction(ratio.detach(), 0.2).item() == 1.0  # |r - 1| > eps everywhere


def test_pg_loss_mask_drops_samples_even_when_nan() -> None:
    adv = torch.tensor([1.0, float("nan")])
    ratio = torch.tensor([1.0, float("nan")])
    assert ppo.pg_loss(adv, ratio, 0.2, mask=torch.tensor([True, False])).item() == pytest.approx(-1.0)


def test_value_loss_plain_and_clipped() -> None:
    v, ret, old = torch.tensor([2.0]), torch.tensor([0.0]), torch.tensor([1.0])
    assert ppo.value_loss(v, ret).item() == pytest.approx(0.5 * 4.0)
    # clipped value 1.2 is closer to the target than 2.0, so the max keeps the unclipped 4.0
    assert ppo.value_loss(v, ret, old, 0.2).item() == pytest.approx(2.0)
    # moving away from a target the old value was near: clipped error is larger and is kept
    v2, ret2, old2 = torch.tensor([0.0]), torch.tensor([1.0]), torch.tensor([1.0])
    assert ppo.value_loss(v2, ret2, old2, 0.2).item() == pytest.approx(0.5 * 1.0)
    v3, ret3 = torch.tensor([1.0]), torch.tensor([3.0])
    assert ppo.value_loss(v3, ret3, torch.tensor([0.0]), 0.2).item() == pytest.approx(0.5 * max(4.0, (0.2 - 3.0) ** 2))


def test_clip_vloss_off_is_half_the_squared_error_and_on_is_cleanrls_max_form() -> None:
    # CleanRL ppo.py: on: 0.5 * max((v - R)^2, (v_old + clip(v - v_old, -c, c) - R)^2); off: 0.5 * (v - R)^2
    v = torch.tensor([3.0, 0.9, 10.0, -1.0], requires_grad=True)
    old = torch.tensor([1.0, 1.0, 9.0, 0.0])
    ret = torch.tensor([5.0, 0.0, 20.0, -0.5])
    c = 0.2
    off = ppo.value_loss(v, ret)
    on = ppo.value_loss(v, ret, old, c)
    v_clipped = old + (v.detach() - old).clamp(-c, c)
    want_on = 0.5 * torch.maximum((v.detach() - ret) ** 2, (v_clipped - ret) ** 2).mean()
    assert off.item() == pytest.approx(0.5 * ((v.detach() - ret) ** 2).mean().item())
    assert on.item() == pytest.approx(want_on.item())
    assert on.item() > off.item()  # samples 0 and 2 moved more than c towards R: their clipped error counts
    (grad_on,) = torch.autograd.grad(on, v)
    (grad_off,) = torch.autograd.grad(off, v)
    assert grad_off.tolist() == pytest.approx(((v.detach() - ret) / 4).tolist())
    # moved past the clip range towards R (samples 0, 2): gradient 0; inside the range (1) or
    # overshooting R so the unclipped error is the larger (3): the plain gradient
    assert grad_on.tolist() == pytest.approx([0.0, grad_off[1].item(), 0.0, grad_off[3].item()])


def test_linear_decay_starts_at_the_value_and_loses_one_share_per_update() -> None:
    assert [ppo.linear_decay(0.2, u, 4) for u in (1, 2, 3, 4)] == pytest.approx([0.2, 0.15, 0.1, 0.05])
    assert ppo.linear_decay(1e-3, 1, 390) == 1e-3 and ppo.linear_decay(1e-3, 390, 390) == pytest.approx(1e-3 / 390)


def test_kl_exceeded_only_above_a_set_target() -> None:
    assert not ppo.kl_exceeded(torch.tensor(5.0), None)
    assert not ppo.kl_exceeded(torch.tensor(0.02), 0.02)  # strictly above, as CleanRL
    assert ppo.kl_exceeded(torch.tensor(0.0201), 0.02) and ppo.kl_exceeded(0.5, 0.02)


def test_approx_kl_is_zero_at_ratio_one_and_positive_otherwise() -> None:
    logratio = torch.tensor([0.0, 0.0])
    assert ppo.approx_kl(logratio, logratio.exp()).item() == 0.0
    logratio = torch.tensor([0.3, -0.3])
    assert ppo.approx_kl(logratio, logratio.exp()).item() > 0.0


def test_normalize_advantages_over_counted_samples() -> None:
    adv = torch.tensor([1.0, 2.0, 3.0, 1000.0])
    mask = torch.tensor([True, True, True, False])
    out = ppo.normalize_advantages(adv, mask)
    assert out[:3].mean().item() == pytest.approx(0.0, abs=1e-6)
    assert out[:3].std().item() == pytest.approx(1.0, rel=1e-4)
    assert out[3].item() == 0.0
    assert ppo.normalize_advantages(torch.tensor([5.0])).item() == 0.0


def test_explained_variance() -> None:
    ret = torch.tensor([1.0, 2.0, 3.0])
    assert ppo.explained_variance(ret, ret) == pytest.approx(1.0)
    assert ppo.explained_variance(torch.full((3,), 2.0), ret) == pytest.approx(0.0)
    assert math.isnan(ppo.explained_variance(ret, torch.ones(3)))


# --- policy -----------------------------------------------------------------------------------


def test_discrete_policy_starts_near_uniform_with_orthogonal_init() -> None:
    torch.manual_seed(0)
    pol = ActorCritic(gymnasium.spaces.Box(-1, 1, (4,)), gymnasium.spaces.Discrete(3))
    w = pol.actor[0].weight  # [64, 4]: orthogonal columns scaled by the gain sqrt(2)
    torch.testing.assert_close(w.T @ w, 2.0 * torch.eye(4), atol=1e-4, rtol=0)
    assert pol.actor[0].bias.abs().sum().item() == 0.0
    probs = pol.distribution(pol.features(torch.randn(8, 4))).probs
    assert torch.allclose(probs, torch.full_like(probs, 1 / 3), atol=0.02)
    action, logp, ent, value = pol.get_action_and_value(torch.randn(8, 4))
    assert action.shape == (8,) and logp.shape == (8,) and ent.shape == (8,) and value.shape == (8,)


def test_discrete_observation_is_one_hot_and_discrete_action_start_is_applied() -> None:
    pol = ActorCritic(gymnasium.spaces.Discrete(16), gymnasium.spaces.Discrete(4, start=1))
    feats = pol.features(torch.tensor([0, 15]))
    assert feats.shape == (2, 16) and feats.sum().item() == 2.0 and feats[1, 15] == 1.0
    assert pol.env_action(torch.tensor([0, 3])).tolist() == [1, 4]


def test_box_action_is_a_diagonal_gaussian_clipped_only_for_the_env() -> None:
    space = gymnasium.spaces.Box(-2.0, 2.0, (1,))
    pol = ActorCritic(gymnasium.spaces.Box(-np.inf, np.inf, (3,)), space)
    obs = torch.randn(5, 3)
    action = torch.tensor([[10.0], [-10.0], [0.0], [1.0], [-1.0]])
    _, logp, ent, _ = pol.get_action_and_value(obs, action)
    mean = pol.actor(pol.features(obs))
    expected = torch.distributions.Normal(mean, 1.0).log_prob(action).sum(-1)
    torch.testing.assert_close(logp, expected)
    assert ent[0].item() == pytest.approx(0.5 * math.log(2 * math.pi * math.e))  # std 1 at init
    assert pol.env_action(action).tolist() == [[2.0], [-2.0], [0.0], [1.0], [-1.0]]


def test_shared_policy_needs_agent_ids_and_unsupported_spaces_are_refused() -> None:
    pol = ActorCritic(gymnasium.spaces.Box(-1, 1, (2,)), gymnasium.spaces.Discrete(2), num_agent_ids=3)
    assert pol.features(torch.zeros(1, 2), torch.tensor([2])).tolist() == [[0.0, 0.0, 0.0, 0.0, 1.0]]
    with pytest.raises(ValueError, match="agent_ids"):
        pol.features(torch.zeros(1, 2))
    with pytest.raises(UnsupportedSpaceError, match="observation space Tuple"):
        ActorCritic(gymnasium.spaces.Tuple((gymnasium.spaces.Discrete(2),)), gymnasium.spaces.Discrete(2))
    with pytest.raises(UnsupportedSpaceError, match="action space MultiDiscrete"):
        ActorCritic(gymnasium.spaces.Discrete(2), gymnasium.spaces.MultiDiscrete([2, 2]))


# --- environments -----------------------------------------------------------------------------


def test_make_env_applies_max_episode_steps_kwargs_and_seed() -> None:
    cfg = GymEnvConfig(env_id="FrozenLake-v1", max_episode_steps=7, env_kwargs={"is_slippery": False})
    env = make_env(cfg, seed=3)
    assert env.spec.max_episode_steps == 7 and env.spec.kwargs["is_slippery"] is False
    a = [env.reset()[0]] + [env.action_space.sample() for _ in range(5)]
    env2 = make_env(cfg, seed=3)
    b = [env2.reset()[0]] + [env2.action_space.sample() for _ in range(5)]
    assert a == b


def test_make_env_same_seed_same_observations_other_seed_differs() -> None:
    cfg = GymEnvConfig(env_id="CartPole-v1")
    first = [make_env(cfg, seed=s).reset()[0] for s in (5, 5, 6)]
    np.testing.assert_array_equal(first[0], first[1])
    assert not np.array_equal(first[0], first[2])


def test_make_env_client_id_delegates_to_the_remote_module(monkeypatch) -> None:
    import opentinker_trainer.envs.remote as remote

    seen = {}

    def stand_in(config, *, seed):  # stands in for a client's EnvironmentService (not reachable here)
        seen["args"] = (config, seed)
        return gymnasium.make("CartPole-v1")

    monkeypatch.setattr(remote, "make_client_env", stand_in)
    cfg = type("Cfg", (), {"env_id": "client"})()
    env = make_env(cfg, seed=9)
    assert seen["args"] == (cfg, 9) and env.spec.id == "CartPole-v1"


def test_make_vector_env_seeds_sub_envs_and_refuses_fork() -> None:
    cfg = GymEnvConfig(env_id="CartPole-v1")
    vec = make_vector_env(cfg, num_envs=2, seed=11)
    obs, _ = vec.reset(seed=11)
    single0, _ = gymnasium.make("CartPole-v1").reset(seed=11)
    single1, _ = gymnasium.make("CartPole-v1").reset(seed=12)
    np.testing.assert_array_equal(obs, np.stack([single0, single1]))
    assert vec.metadata["autoreset_mode"] == gymnasium.vector.AutoresetMode.NEXT_STEP
    vec.close()
    with pytest.raises(ValueError, match="never fork"):
        make_vector_env(cfg, num_envs=2, seed=1, mode="async", context="fork")
    with pytest.raises(ValueError, match="mode"):
        make_vector_env(cfg, num_envs=2, seed=1, mode="threads")
    with pytest.raises(ValueError, match="num_envs"):
        make_vector_env(cfg, num_envs=0, seed=1)


def test_async_vector_env_with_spawn_steps_like_the_sync_one() -> None:
    cfg = GymEnvConfig(env_id="CartPole-v1")
    sync = make_vector_env(cfg, num_envs=2, seed=4)
    asyn = make_vector_env(cfg, num_envs=2, seed=4, mode="async", context="spawn")
    try:
        assert isinstance(asyn, gymnasium.vector.AsyncVectorEnv)
        for _ in range(3):
            a = np.array([0, 1])
            np.testing.assert_array_equal(sync.step(a)[0], asyn.step(a)[0])
    finally:
        sync.close()
        asyn.close()
