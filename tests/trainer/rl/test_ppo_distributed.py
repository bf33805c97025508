"""Data-parallel PPO: one update of two gloo ranks, each on its share of the samples (13 samples:
7 and 6), equals the update of one rank on all of them (policy parameters and metrics within
float tolerance), with advantage normalisation, the clipped value loss, gradient clipping and
per-group losses (multi-agent)."""

from __future__ import annotations

from types import SimpleNamespace

import gymnasium
import pytest
import torch

from opentinker_trainer.rl.policy import ActorCritic
from opentinker_trainer.workloads._ppo_common import Batch, ppo_update

from tests.support.distributed import run_ranks

B = 13
CFG = SimpleNamespace(
    update_epochs=2,
    num_minibatches=1,
    norm_adv=True,
    clip_vloss=True,
    clip_coef=0.2,
    ent_coef=0.01,
    vf_coef=0.5,
    max_grad_norm=0.1,
    target_kl=None,
)


def global_batch() -> Batch:
    g = torch.Generator().manual_seed(3)
    return Batch(
        obs=torch.randn(B, 4, generator=g),
        actions=torch.randint(0, 2, (B,), generator=g),
        logprobs=torch.log(torch.full((B,), 0.5)) + 0.1 * torch.randn(B, generator=g),
        advantages=torch.randn(B, generator=g),
        returns=torch.randn(B, generator=g),
        values=torch.randn(B, generator=g),
    )


def update(rows: range, dp=None) -> dict:
    torch.manual_seed(0)
    space = gymnasium.spaces.Box(-1, 1, (4,))
    policy = ActorCritic(space, gymnasium.spaces.Discrete(2), (16, 16), "tanh")
    opt = torch.optim.Adam(policy.parameters(), lr=1e-2, eps=1e-5)
    full = global_batch()
    sl = slice(rows.start, rows.stop)
    batch = Batch(
        **{k: getattr(full, k)[sl] for k in ("obs", "actions", "logprobs", "advantages", "returns", "values")}
    )
    even = torch.arange(B)[sl] % 2 == 0  # two "agents" reported apart (loss/agent/<name>/...)
    batch.groups = {"even": even, "odd": ~even}
    metrics = ppo_update(policy, opt, batch, CFG, dp=dp)
    return {"metrics": metrics, "params": {k: v.detach().clone() for k, v in policy.named_parameters()}}


def ranked_update(dp) -> dict:
    torch.set_num_threads(1)
    return update(dp.shard(B), dp)


def test_two_ranks_take_the_update_of_one(tmp_path) -> None:
    one = update(range(B))
    for got in run_ranks(ranked_update, 2, tmp_path):
        for k, v in one["params"].items():
            torch.testing.assert_close(got["params"][k], v, atol=1e-6, rtol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
        for k, v in one["metrics"].items():
            assert got["metrics"][k] == pytest.approx(v, rel=1e-5, abs=1e-7), k
    torch.manual_seed(0)
    start = ActorCritic(gymnasium.spaces.Box(-1, 1, (4,)), gymnasium.spaces.Discrete(2), (16, 16), "tanh")
    assert any(not torch.equal(p, one["params"][k]) for k, p in start.named_parameters())
