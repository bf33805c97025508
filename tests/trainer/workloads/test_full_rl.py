"""The full_rl workload on gymnasium ids, run in-process with small budgets: metrics, torch_ppo
checkpoints, determinism, resume, stop requests and user errors."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from opentinker_common.spec import TaskSpecModel
from opentinker_trainer.context import UserError, WorkerContext
from opentinker_trainer.workloads import run_task
from opentinker_trainer.workloads.ppo_gym import PPOTrainer

SMALL = {
    "total_timesteps": 512,
    "num_envs": 2,
    "num_steps": 64,
    "num_minibatches": 2,
    "update_epochs": 2,
    "hidden_sizes": [16, 16],
}


def make_ctx(tmp: Path, env: dict, hp: dict, *, resume_from: Path | None = None, attempt: int = 1) -> WorkerContext:
    spec = TaskSpecModel.from_parts(workload_type="full_rl", model="-", env_config=env, hyperparameters=hp)
    return WorkerContext("task-x", attempt, spec, "cpu", tmp, resume_from=resume_from, out=io.StringIO())


def reports(ctx: WorkerContext) -> list[dict]:
    return [json.loads(line) for line in ctx.out.getvalue().splitlines()]


def metrics(ctx: WorkerContext) -> list[dict]:
    return [r for r in reports(ctx) if r["type"] == "metric"]


def test_cartpole_run_reports_namespaced_metrics_and_a_final_torch_ppo_checkpoint(tmp_path: Path) -> None:
    ctx = make_ctx(tmp_path, {"env_id": "CartPole-v1"}, SMALL)
    run_task(ctx)
    ms = metrics(ctx)
    assert [m["step"] for m in ms] == [1, 2, 3, 4]
    required = {
        "loss",
        "reward",
        "loss/policy",
        "loss/value",
        "loss/entropy",
        "loss/total",
        "ppo/approx_kl",
        "ppo/clipfrac",
        "ppo/explained_variance",
        "reward/episode_return_mean",
        "perf/env_steps_per_s",
        "env_steps",
        "optim/lr",
    }
    for m in ms:
        assert required <= set(m["values"]), required - set(m["values"])
    assert [m["values"]["env_steps"] for m in ms] == [128, 256, 384, 512]
    assert ms[0]["values"]["optim/lr"] == pytest.approx(2.5e-4) and ms[-1]["values"]["optim/lr"] < 2.5e-4  # annealed
    assert ms[-1]["values"]["loss/entropy"] == pytest.approx(np.log(2), abs=0.05)  # near-uniform over 2 actions
    # reward is the mean return of episodes finished in the update; CartPole pays 1 per step
    assert all(m["values"]["reward"] >= 1.0 for m in ms)
    ckpts = [r for r in reports(ctx) if r["type"] == "checkpoint"]
    assert len(ckpts) == 1 and ckpts[0]["final"] and ckpts[0]["format"] == "torch_ppo" and ckpts[0]["step"] == 4
    folder = Path(ckpts[0]["path"])
    assert folder == tmp_path / "step_4"
    state = torch.load(folder / "policy.pt", weights_only=True)
    assert "actor.0.weight" in state and "critic.0.weight" in state
    meta = json.loads((folder / "policy.json").read_text())
    assert meta["env_id"] == "CartPole-v1" and meta["hidden_sizes"] == [16, 16]
    trainer_state = torch.load(folder / "trainer_state.pt", weights_only=True)
    assert trainer_state["step"] == 4 and trainer_state["env_steps"] == 512
    assert not list(tmp_path.glob("*.tmp"))


def test_linear_clip_schedule_reaches_each_update_and_target_kl_ends_updates_early(tmp_path: Path) -> None:
    hp = {**SMALL, "clip_schedule": "linear", "clip_vloss": False, "target_kl": 1e-6, "learning_rate": 0.01}
    ctx = make_ctx(tmp_path, {"env_id": "CartPole-v1"}, hp)
    run_task(ctx)
    ms = [m["values"] for m in metrics(ctx)]
    assert [m["ppo/clip_coef"] for m in ms] == pytest.approx([0.2, 0.15, 0.1, 0.05])  # 4 updates
    assert [m["optim/lr"] for m in ms] == pytest.approx([0.01 * f for f in (1, 0.75, 0.5, 0.25)])
    # 2 minibatches x 2 epochs: the first minibatch's KL is 0 (the rollout's policy), the second
    # (after one Adam step at lr 0.01; 4e-5 .. 8e-4 seen) over 1e-6
    assert all(m["ppo/minibatches"] == 2 and m["ppo/early_stop"] == 1 and m["ppo/epochs"] == 1 for m in ms)


def test_default_clip_is_constant_and_every_minibatch_is_taken(tmp_path: Path) -> None:
    ctx = make_ctx(tmp_path, {"env_id": "CartPole-v1"}, {**SMALL, "total_timesteps": 256})
    run_task(ctx)
    ms = [m["values"] for m in metrics(ctx)]
    assert [(m["ppo/clip_coef"], m["ppo/minibatches"], m["ppo/early_stop"]) for m in ms] == [(0.2, 4, 0)] * 2


def test_same_seed_same_first_rollout_other_seed_differs(tmp_path: Path) -> None:
    def first_rollout(seed: int):
        trainer = PPOTrainer(make_ctx(tmp_path, {"env_id": "CartPole-v1"}, {**SMALL, "seed": seed}))
        try:
            return trainer.rollout()
        finally:
            trainer.envs.close()

    a, b, c = first_rollout(3), first_rollout(3), first_rollout(4)
    for key in ("obs", "actions", "logprobs", "rewards", "terminated", "truncated"):
        assert torch.equal(a[key], b[key]), key
    assert not torch.equal(a["obs"], c["obs"])


def test_resume_continues_step_count_optimizer_and_rngs_deterministically(tmp_path: Path) -> None:
    hp = {**SMALL, "total_timesteps": 768, "checkpoint_every": 2}
    whole = make_ctx(tmp_path / "whole", {"env_id": "CartPole-v1"}, hp)
    run_task(whole)
    ckpts = [r for r in reports(whole) if r["type"] == "checkpoint"]
    assert [(c["step"], c["final"]) for c in ckpts] == [(2, False), (4, False), (6, True)]
    step2 = Path(ckpts[0]["path"])

    runs = []
    for name in ("r1", "r2"):
        ctx = make_ctx(tmp_path / name, {"env_id": "CartPole-v1"}, hp, resume_from=step2, attempt=2)
        run_task(ctx)
        runs.append(ctx)
    steps = [m["step"] for m in metrics(runs[0])]
    assert steps == [3, 4, 5, 6]
    assert metrics(runs[0])[0]["values"]["env_steps"] == 384
    # the learning rate schedule continues where it was
    assert [m["values"]["optim/lr"] for m in metrics(runs[0])] == [m["values"]["optim/lr"] for m in metrics(whole)[2:]]
    # resuming is deterministic: the same checkpoint gives the same run
    assert [m["values"]["loss"] for m in metrics(runs[0])] == [m["values"]["loss"] for m in metrics(runs[1])]
    final_resumed = torch.load(tmp_path / "r1" / "step_6" / "trainer_state.pt", weights_only=True)
    final_whole = torch.load(tmp_path / "whole" / "step_6" / "trainer_state.pt", weights_only=True)
    # Adam's per-parameter step counter continued from the checkpoint (not restarted at 0)
    adam_steps = lambda s: {float(v["step"]) for v in s["optimizer"]["state"].values()}  # noqa: E731
    assert adam_steps(final_resumed) == adam_steps(final_whole) == {6 * 2 * 2.0}
    assert final_resumed["step"] == 6 and final_resumed["env_steps"] == 768


def test_resume_restores_rng_states(tmp_path: Path) -> None:
    ctx = make_ctx(tmp_path, {"env_id": "CartPole-v1"}, {**SMALL, "total_timesteps": 256, "checkpoint_every": 1})
    run_task(ctx)
    saved = torch.load(tmp_path / "step_1" / "trainer_state.pt", weights_only=True)["rng"]
    torch.manual_seed(12345)
    np.random.seed(12345)
    trainer = PPOTrainer(
        make_ctx(tmp_path / "again", {"env_id": "CartPole-v1"}, SMALL, resume_from=tmp_path / "step_1")
    )
    trainer.envs.close()
    assert torch.equal(torch.get_rng_state(), saved["torch"])
    assert np.array_equal(np.random.get_state()[1], saved["numpy"]["keys"].numpy().astype(np.uint32))
    assert trainer.update == 1 and trainer.env_steps == 128


def test_stop_request_checkpoints_and_returns_early(tmp_path: Path) -> None:
    ctx = make_ctx(tmp_path, {"env_id": "CartPole-v1"}, SMALL)
    emit = ctx.emit_metric

    def emit_then_stop(step, values):  # a drain arriving during update 2
        emit(step, values)
        if step == 2:
            ctx.request_stop()

    ctx.emit_metric = emit_then_stop
    run_task(ctx)
    ckpts = [r for r in reports(ctx) if r["type"] == "checkpoint"]
    assert [(c["step"], c["final"]) for c in ckpts] == [(2, False)]
    assert not ctx.completed


def test_box_actions_and_discrete_observations_train(tmp_path: Path) -> None:
    pend = make_ctx(tmp_path / "p", {"env_id": "Pendulum-v1"}, {**SMALL, "total_timesteps": 256})
    run_task(pend)
    assert len(metrics(pend)) == 2 and "actor_logstd" in torch.load(
        tmp_path / "p" / "step_2" / "policy.pt", weights_only=True
    )
    lake = make_ctx(
        tmp_path / "f", {"env_id": "FrozenLake-v1", "max_episode_steps": 20}, {**SMALL, "total_timesteps": 256}
    )
    run_task(lake)
    ms = metrics(lake)
    assert len(ms) == 2 and all(0.0 <= m["values"]["reward"] <= 1.0 for m in ms)
    assert (
        torch.load(tmp_path / "f" / "step_2" / "policy.pt", weights_only=True)["actor.0.weight"].shape[1] == 16
    )  # one-hot


def test_reward_is_last_known_and_flagged_stale_when_no_episode_ends(tmp_path: Path) -> None:
    # MountainCar: a random policy's episodes all last the 200-step limit; 2 envs x 16 steps per
    # update, so both first episodes end in update 13 (steps 193..208 of each env) and none in 14.
    ctx = make_ctx(tmp_path, {"env_id": "MountainCar-v0"}, {**SMALL, "num_steps": 16, "total_timesteps": 32 * 14})
    run_task(ctx)
    ms = [m["values"] for m in metrics(ctx)]
    assert ms[0]["reward/stale"] == 1.0 and "reward" not in ms[0]  # NaN before any episode: dropped on the wire
    assert ms[12]["reward/stale"] == 0.0 and ms[12]["reward/episodes"] == 2.0 and ms[12]["reward"] == -200.0
    assert ms[13]["reward/stale"] == 1.0 and ms[13]["reward/episodes"] == 0.0 and ms[13]["reward"] == -200.0


def test_unsupported_spaces_and_unmakeable_envs_are_user_errors(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="observation space Tuple"):
        run_task(make_ctx(tmp_path, {"env_id": "Blackjack-v1"}, SMALL))


def test_async_vector_mode_with_spawn_trains(tmp_path: Path) -> None:
    ctx = make_ctx(
        tmp_path,
        {"env_id": "CartPole-v1"},
        {**SMALL, "total_timesteps": 128, "vector_mode": "async", "async_context": "spawn"},
    )
    run_task(ctx)
    assert [m["step"] for m in metrics(ctx)] == [1]
