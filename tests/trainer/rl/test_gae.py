"""GAE: termination vs truncation, the NEXT_STEP autoreset mask, and agreement with a direct
sum-of-TD-errors reference; plus the convention checked against a real gymnasium vector env."""

from __future__ import annotations

import gymnasium
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from opentinker_common.spec import GymEnvConfig
from opentinker_trainer.envs.gym import make_vector_env
from opentinker_trainer.rl.gae import autoreset_mask, gae

G, L = 0.9, 0.8


def col(*xs, dtype=torch.float32) -> torch.Tensor:
    """A [T, 1] column."""
    return torch.tensor(xs, dtype=dtype).view(-1, 1)


def b(*xs) -> torch.Tensor:
    return col(*xs, dtype=torch.bool)


def test_terminal_step_does_not_bootstrap() -> None:
    adv, ret = gae(col(1.0), col(0.5), torch.tensor([100.0]), b(True), b(False), gamma=G, gae_lambda=L)
    assert adv.item() == pytest.approx(1.0 - 0.5)
    assert ret.item() == pytest.approx(1.0)


def test_truncated_last_step_bootstraps_from_next_value() -> None:
    adv, _ = gae(col(1.0), col(0.5), torch.tensor([10.0]), b(False), b(True), gamma=G, gae_lambda=L)
    assert adv.item() == pytest.approx(1.0 + G * 10.0 - 0.5)


def test_truncation_mid_rollout_bootstraps_from_final_observation_value_and_reset_step_is_masked() -> None:
    # step 0 truncates; step 1 is the autoreset step, whose obs is the episode's final observation
    # (values[1] = V(final obs) = 10); step 2 starts a new episode.
    rewards, values = col(1.0, 0.0, 5.0), col(0.5, 10.0, 2.0)
    term, trunc = b(False, False, False), b(True, False, False)
    reset = autoreset_mask(term | trunc, torch.tensor([False]))
    assert reset.view(-1).tolist() == [False, True, False]
    adv, ret = gae(rewards, values, torch.tensor([3.0]), term, trunc, reset, gamma=G, gae_lambda=L)
    assert adv[0].item() == pytest.approx(1.0 + G * 10.0 - 0.5)  # bootstrap, and nothing of step 2 leaks in
    assert adv[1].item() == 0.0 and ret[1].item() == pytest.approx(10.0)
    assert adv[2].item() == pytest.approx(5.0 + G * 3.0 - 2.0)


def test_termination_mid_rollout_ignores_the_next_episode() -> None:
    rewards, values = col(1.0, 0.0, 5.0), col(0.5, 10.0, 2.0)
    term, trunc = b(True, False, False), b(False, False, False)
    reset = autoreset_mask(term | trunc, torch.tensor([False]))
    adv, _ = gae(rewards, values, torch.tensor([3.0]), term, trunc, reset, gamma=G, gae_lambda=L)
    assert adv[0].item() == pytest.approx(1.0 - 0.5)


def test_autoreset_mask_carries_the_previous_rollouts_last_done() -> None:
    dones = torch.tensor([[False, True], [True, False], [False, False]])
    mask = autoreset_mask(dones, torch.tensor([True, False]))
    assert mask.tolist() == [[True, False], [False, True], [True, False]]


def test_lambda_one_is_monte_carlo_and_lambda_zero_is_td() -> None:
    rewards, values = col(1.0, 2.0, 3.0), col(0.1, 0.2, 0.3)
    nv = torch.tensor([0.7])
    none = b(False, False, False)
    adv1, ret1 = gae(rewards, values, nv, none, none, gamma=G, gae_lambda=1.0)
    mc = [1 + G * 2 + G**2 * 3 + G**3 * 0.7, 2 + G * 3 + G**2 * 0.7, 3 + G * 0.7]
    assert ret1.view(-1).tolist() == pytest.approx(mc)
    adv0, _ = gae(rewards, values, nv, none, none, gamma=G, gae_lambda=0.0)
    assert adv0.view(-1).tolist() == pytest.approx([1 + G * 0.2 - 0.1, 2 + G * 0.3 - 0.2, 3 + G * 0.7 - 0.3])


def test_shapes_are_checked() -> None:
    with pytest.raises(ValueError, match=r"\[T, N\]"):
        gae(torch.zeros(3), torch.zeros(3), torch.zeros(1), torch.zeros(3).bool(), torch.zeros(3).bool())


def _reference(rewards, values, next_value, term, trunc, gamma, lam):
    """A_t = sum_k (gamma lam)^k delta_{t+k} up to the end of t's episode, summed directly."""
    T, N = rewards.shape
    vnext = np.concatenate([values[1:], next_value[None]], 0)
    delta = rewards + gamma * vnext * (~term) - values
    done = term | trunc
    reset = np.concatenate([np.zeros((1, N), bool), done[:-1]], 0)
    adv = np.zeros((T, N))
    for n in range(N):
        for t in range(T):
            if reset[t, n]:
                continue
            acc, k = 0.0, 0
            while t + k < T:
                acc += (gamma * lam) ** k * delta[t + k, n]
                if done[t + k, n]:
                    break
                k += 1
            adv[t, n] = acc
    return adv, reset


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 12),
    st.integers(1, 3),
    st.integers(0, 2**31 - 1),
    st.floats(0.0, 1.0),
    st.floats(0.0, 1.0),
)
def test_matches_direct_sum_of_td_errors(T, N, seed, gamma, lam) -> None:
    rng = np.random.default_rng(seed)
    rewards, values, nv = rng.normal(size=(T, N)), rng.normal(size=(T, N)), rng.normal(size=N)
    kind = rng.integers(0, 5, size=(T, N))  # 0: terminated, 1: truncated, else running
    term, trunc = kind == 0, kind == 1
    # Gymnasium's NEXT_STEP: a reset step (after a done) never itself ends an episode, reward 0.
    reset = np.concatenate([np.zeros((1, N), bool), (term | trunc)[:-1]], 0)
    term, trunc = term & ~reset, trunc & ~reset
    rewards = np.where(reset, 0.0, rewards)
    expected, ref_reset = _reference(rewards, values, nv, term, trunc, gamma, lam)
    t = lambda x: torch.as_tensor(x)  # noqa: E731
    mask = autoreset_mask(t(term | trunc), torch.zeros(N, dtype=torch.bool))
    assert (mask.numpy() == ref_reset).all()
    adv, ret = gae(t(rewards), t(values), t(nv), t(term), t(trunc), mask, gamma=gamma, gae_lambda=lam)
    np.testing.assert_allclose(adv.numpy(), expected, rtol=1e-4, atol=1e-4)


def test_real_vector_env_follows_the_convention_gae_assumes() -> None:
    """CartPole with a 3-step time limit in a gymnasium vector env: the step that truncates
    returns the true final observation (the one a single env reaches), and the next step is an
    autoreset step (reward 0, no flags, new first observation) that the mask removes."""
    cfg = GymEnvConfig(env_id="CartPole-v1", max_episode_steps=3)
    vec = make_vector_env(cfg, num_envs=1, seed=None)
    single = gymnasium.make("CartPole-v1", max_episode_steps=3)
    obs_v, _ = vec.reset(seed=7)
    obs_s, _ = single.reset(seed=7)
    np.testing.assert_array_equal(obs_v[0], obs_s)
    steps = []
    for t in range(5):
        obs_v, r, te, tr, _ = vec.step(np.array([1]))
        steps.append((obs_v[0].copy(), float(r[0]), bool(te[0]), bool(tr[0])))
        if t < 3:
            obs_s, *_ = single.step(1)
    vec.close()
    final_obs, r2, te2, tr2 = steps[2]
    assert tr2 and not te2 and r2 == 1.0
    np.testing.assert_array_equal(final_obs, obs_s)  # the true final observation, not a reset one
    reset_obs, r3, te3, tr3 = steps[3]
    assert (r3, te3, tr3) == (0.0, False, False) and not np.array_equal(reset_obs, final_obs)

    term = torch.tensor([[s[2]] for s in steps])
    trunc = torch.tensor([[s[3]] for s in steps])
    rewards = torch.tensor([[s[1]] for s in steps])
    mask = autoreset_mask(term | trunc, torch.tensor([False]))
    assert mask.view(-1).tolist() == [False, False, False, True, False]
    # A critic that is a function of the observation; obs[t] is the observation step t acted on.
    obs = [np.zeros(4, np.float32)] + [s[0] for s in steps[:-1]]
    V = lambda o: float(np.sum(o))  # noqa: E731
    values = torch.tensor([[V(o)] for o in obs])
    adv, _ = gae(rewards, values, torch.tensor([V(steps[-1][0])]), term, trunc, mask, gamma=G, gae_lambda=L)
    assert adv[2].item() == pytest.approx(1.0 + G * V(final_obs) - V(obs[2]), rel=1e-5)
    assert adv[3].item() == 0.0
