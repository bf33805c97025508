"""One PPO optimisation (workloads/_ppo_common.py ppo_update) and the per-update schedules:
target_kl early stop per minibatch, clip_vloss on/off, the clip coefficient each update uses."""

from __future__ import annotations

from dataclasses import replace

import gymnasium
import pytest
import torch

from opentinker_common.spec import PPOConfig
from opentinker_trainer.rl import ppo as ppo_math
from opentinker_trainer.rl.policy import ActorCritic
from opentinker_trainer.workloads import _ppo_common as common

B = 32


def setup(seed: int = 0, **hp):
    torch.manual_seed(seed)
    policy = ActorCritic(gymnasium.spaces.Box(-1, 1, (4,)), gymnasium.spaces.Discrete(2), (16, 16))
    obs = torch.randn(B, 4)
    with torch.no_grad():
        actions, logprobs, _, values = policy.get_action_and_value(obs)
    batch = common.Batch(
        obs=obs,
        actions=actions,
        logprobs=logprobs,
        advantages=torch.randn(B),
        returns=values + 5.0 * torch.randn(B),
        values=values,
    )
    cfg = replace(PPOConfig(), **{"num_minibatches": 4, "update_epochs": 4, **hp})
    optimizer = torch.optim.Adam(policy.parameters(), lr=cfg.learning_rate, eps=1e-5)
    return policy, optimizer, batch, cfg


def scripted_kl(monkeypatch, values: list[float]) -> list[float]:
    """Make ``approx_kl`` return ``values`` in turn (then 0); returns the list of values handed out."""
    handed: list[float] = []
    it = iter(values)

    def fake(logratio, ratio, mask=None):
        v = next(it, 0.0)
        handed.append(v)
        return torch.tensor(v)

    monkeypatch.setattr(ppo_math, "approx_kl", fake)
    return handed


def count_steps(monkeypatch, optimizer) -> list[int]:
    steps = [0]
    real = optimizer.step

    def step(*a, **k):
        steps[0] += 1
        return real(*a, **k)

    monkeypatch.setattr(optimizer, "step", step)
    return steps


def test_without_target_kl_every_minibatch_of_every_epoch_is_taken(monkeypatch) -> None:
    policy, opt, batch, cfg = setup()
    scripted_kl(monkeypatch, [10.0] * 16)
    steps = count_steps(monkeypatch, opt)
    out = common.ppo_update(policy, opt, batch, cfg)
    assert steps[0] == 16 and out["ppo/minibatches"] == 16 and out["ppo/epochs"] == 4 and out["ppo/early_stop"] == 0


def test_target_kl_stops_after_the_first_minibatch_over_it(monkeypatch) -> None:
    # The third minibatch's KL exceeds target_kl: its step is taken (CleanRL), then nothing more.
    policy, opt, batch, cfg = setup(target_kl=0.02)
    handed = scripted_kl(monkeypatch, [0.0, 0.01, 0.03, 0.0, 0.0])
    steps = count_steps(monkeypatch, opt)
    out = common.ppo_update(policy, opt, batch, cfg)
    assert handed == [0.0, 0.01, 0.03]
    assert steps[0] == 3 and out["ppo/minibatches"] == 3 and out["ppo/epochs"] == 1 and out["ppo/early_stop"] == 1
    assert out["ppo/approx_kl"] == pytest.approx((0.0 + 0.01 + 0.03) / 3)  # a mean over the steps taken


def test_target_kl_is_checked_per_minibatch_not_on_the_epoch_mean(monkeypatch) -> None:
    # Epoch 1's mean KL (0.0125) is under target_kl, but its second minibatch (0.05) is over it.
    policy, opt, batch, cfg = setup(target_kl=0.02)
    scripted_kl(monkeypatch, [0.0, 0.05, 0.0, 0.0])
    out = common.ppo_update(policy, opt, batch, cfg)
    assert out["ppo/minibatches"] == 2 and out["ppo/epochs"] == 1


def test_target_kl_stop_in_a_later_epoch_ends_the_update(monkeypatch) -> None:
    policy, opt, batch, cfg = setup(target_kl=0.02, num_minibatches=2)
    scripted_kl(monkeypatch, [0.0, 0.01, 0.01, 0.5, 0.0, 0.0])
    out = common.ppo_update(policy, opt, batch, cfg)
    assert out["ppo/minibatches"] == 4 and out["ppo/epochs"] == 2 and out["ppo/early_stop"] == 1


def test_target_kl_with_the_real_kl_stops_a_large_step_early() -> None:
    policy, opt, batch, cfg = setup(target_kl=1e-4, learning_rate=0.05)
    out = common.ppo_update(policy, opt, batch, cfg)
    assert out["ppo/early_stop"] == 1 and 2 <= out["ppo/minibatches"] < 16
    assert out["ppo/approx_kl"] > 0.0


@pytest.mark.parametrize("clip_vloss", [True, False])
def test_clip_vloss_chooses_the_value_loss_and_the_update_clip_coef_serves_ratio_and_value(
    monkeypatch, clip_vloss: bool
) -> None:
    policy, opt, batch, cfg = setup(clip_vloss=clip_vloss)
    seen = {"pg": [], "v": []}
    real_pg, real_v = ppo_math.pg_loss, ppo_math.value_loss

    def pg(adv, ratio, clip_coef, mask=None):
        seen["pg"].append(clip_coef)
        return real_pg(adv, ratio, clip_coef, mask)

    def v(new, ret, old=None, clip_coef=None, mask=None):
        seen["v"].append((old is None, clip_coef))
        return real_v(new, ret, old, clip_coef, mask)

    monkeypatch.setattr(ppo_math, "pg_loss", pg)
    monkeypatch.setattr(ppo_math, "value_loss", v)
    out = common.ppo_update(policy, opt, batch, cfg, clip_coef=0.07)
    assert out["ppo/clip_coef"] == 0.07 and set(seen["pg"]) == {0.07}
    assert set(seen["v"]) == ({(False, 0.07)} if clip_vloss else {(True, None)})


def test_clip_vloss_on_keeps_the_clipped_error_once_values_moved_off_is_the_plain_loss() -> None:
    # One minibatch per epoch. Epoch 1 runs at the rollout's weights (V = V_old): both forms give
    # 0.5 * mean((V - R)^2) and the same step. In epoch 2 the values have moved by more than the
    # tiny clip towards R, so the clipped form keeps the larger error.
    def value_loss(clip_vloss: bool, epochs: int) -> float:
        policy, opt, batch, cfg = setup(clip_vloss=clip_vloss, num_minibatches=1, update_epochs=epochs)
        return common.ppo_update(policy, opt, batch, cfg, clip_coef=1e-3)["loss/value"]

    _, _, batch, _ = setup()
    plain = 0.5 * ((batch.values - batch.returns) ** 2).mean().item()
    assert value_loss(True, 1) == pytest.approx(plain, rel=1e-5)
    assert value_loss(False, 1) == pytest.approx(plain, rel=1e-5)
    assert value_loss(True, 2) > value_loss(False, 2)


def test_clip_coef_schedule_per_update() -> None:
    cfg = replace(PPOConfig(), total_timesteps=4 * 512)  # 4 updates of 512 steps
    assert cfg.num_updates == 4
    assert [common.clip_coef_at(cfg, u) for u in (1, 2, 3, 4)] == [0.2] * 4
    lin = replace(cfg, clip_schedule="linear")
    assert [common.clip_coef_at(lin, u) for u in (1, 2, 3, 4)] == pytest.approx([0.2, 0.15, 0.1, 0.05])
    # the learning rate follows the same rule when annealed, and stays put when not
    assert [common.annealed_lr(cfg, u) for u in (1, 4)] == pytest.approx([2.5e-4, 2.5e-4 / 4])
    assert common.annealed_lr(replace(cfg, anneal_lr=False), 4) == 2.5e-4
