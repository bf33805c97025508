"""Multi-agent PPO on PettingZoo MPE (mpe2) through the full_rl workload, in-process, small budgets."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch

from opentinker_common.spec import TaskSpecModel
from opentinker_trainer.context import UserError, WorkerContext
from opentinker_trainer.workloads import run_task
from opentinker_trainer.workloads.ppo_multiagent import MultiAgentPPOTrainer

SPREAD = {"env_id": "mpe2/simple_spread_v3", "env_kwargs": {"N": 2, "max_cycles": 5}}
SMALL = {
    "total_timesteps": 96,
    "num_envs": 2,
    "num_steps": 12,
    "num_minibatches": 2,
    "update_epochs": 2,
    "hidden_sizes": [16],
}


def make_ctx(tmp: Path, env: dict, hp: dict, *, resume_from: Path | None = None) -> WorkerContext:
    spec = TaskSpecModel.from_parts(workload_type="full_rl", model="-", env_config=env, hyperparameters=hp)
    return WorkerContext("task-m", 1, spec, "cpu", tmp, resume_from=resume_from, out=io.StringIO())


def reports(ctx: WorkerContext, kind: str) -> list[dict]:
    return [r for r in (json.loads(line) for line in ctx.out.getvalue().splitlines()) if r["type"] == kind]


@pytest.mark.parametrize("sharing", [True, False])
def test_spread_reports_per_agent_reward_and_loss(tmp_path: Path, sharing: bool) -> None:
    ctx = make_ctx(tmp_path, SPREAD, {**SMALL, "parameter_sharing": sharing})
    run_task(ctx)
    ms = [m["values"] for m in reports(ctx, "metric")]
    assert len(ms) == 4
    for m in ms:
        for agent in ("agent_0", "agent_1"):
            assert {
                f"reward/agent/{agent}",
                f"loss/agent/{agent}/policy",
                f"loss/agent/{agent}/value",
                f"loss/agent/{agent}/entropy",
            } <= set(m)
        assert {"loss", "reward", "loss/policy", "ppo/approx_kl", "reward/team_return_mean"} <= set(m)
        # simple_spread: negative distances and collisions; 5-step episodes end every update
        assert m["reward"] < 0 and m["reward/stale"] == 0.0
        assert m["reward/team_return_mean"] == pytest.approx(m["reward/agent/agent_0"] + m["reward/agent/agent_1"])
    ckpt = reports(ctx, "checkpoint")[-1]
    assert ckpt["final"] and ckpt["format"] == "torch_ppo"
    state = torch.load(Path(ckpt["path"]) / "policy.pt", weights_only=True)
    prefixes = {k.split(".")[0] for k in state}
    assert prefixes == ({"shared"} if sharing else {"agent_0", "agent_1"})
    if sharing:  # observation (12 floats for N=2) plus a one-hot agent index
        assert state["shared.actor.0.weight"].shape[1] == 12 + 2


def test_episode_ends_are_autoreset_steps_masked_out(tmp_path: Path) -> None:
    trainer = MultiAgentPPOTrainer(make_ctx(tmp_path, SPREAD, {**SMALL, "parameter_sharing": True}))
    ro = trainer.rollout()["shared"]
    # 5-step episodes, every copy in step: steps 0-4 play (step 4 truncates), step 5 resets, ...
    valid = ro["valid"][:, 0].tolist()
    assert valid == [True] * 5 + [False] + [True] * 5 + [False]
    assert ro["truncated"][:, 0].tolist() == [False] * 4 + [True] + [False] * 5 + [True] + [False]
    assert not ro["terminated"].any()
    # the reset step's observation is the final one of the episode (its value bootstraps step 4)
    assert not torch.equal(ro["obs"][5], ro["obs"][6])


def test_parameter_sharing_needs_equal_spaces(tmp_path: Path) -> None:
    env = {"env_id": "mpe2/simple_speaker_listener_v4", "env_kwargs": {"max_cycles": 5}}
    with pytest.raises(
        UserError, match="parameter_sharing: the agents of mpe2/simple_speaker_listener_v4 have different spaces"
    ):
        run_task(make_ctx(tmp_path, env, {**SMALL, "parameter_sharing": True}))
    ctx = make_ctx(tmp_path / "ind", env, {**SMALL, "total_timesteps": 24, "parameter_sharing": False})
    run_task(ctx)
    assert {"reward/agent/speaker_0", "reward/agent/listener_0"} <= set(reports(ctx, "metric")[0]["values"])


def test_resume_continues_steps_optimizers_and_last_rewards(tmp_path: Path) -> None:
    hp = {**SMALL, "parameter_sharing": False, "checkpoint_every": 2}
    whole = make_ctx(tmp_path / "whole", SPREAD, hp)
    run_task(whole)
    step2 = tmp_path / "whole" / "step_2"
    assert [c["step"] for c in reports(whole, "checkpoint")] == [2, 4]
    runs = []
    for name in ("a", "b"):
        ctx = make_ctx(tmp_path / name, SPREAD, hp, resume_from=step2)
        run_task(ctx)
        runs.append([m for m in reports(ctx, "metric")])
    assert [m["step"] for m in runs[0]] == [3, 4]
    assert runs[0][0]["values"]["env_steps"] == 72
    assert [m["values"]["loss"] for m in runs[0]] == [m["values"]["loss"] for m in runs[1]]
    state = torch.load(tmp_path / "a" / "step_4" / "trainer_state.pt", weights_only=True)
    assert set(state["optimizer"]) == {"agent_0", "agent_1"}
    assert {float(v["step"]) for v in state["optimizer"]["agent_0"]["state"].values()} == {4 * 2 * 2.0}
