"""lora_finetune on a Discrete environment (the LM game) with a tiny random Llama: episodes,
reply parsing and the invalid-action penalty, shaping, metrics, checkpoints, resume, refusals."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from opentinker_client.hosting.server import EnvironmentServer
from opentinker_common.spec import LMGameGRPOConfig
from opentinker_trainer.context import UserError, WorkerContext
from opentinker_trainer.envs.remote import close_all_sessions
from opentinker_trainer.workloads import grpo_game, run_task

from tests.support.environments import Corridor
from tests.support.workers import reports, worker_ctx

LAKE = {"env_id": "FrozenLake-v1", "env_kwargs": {"is_slippery": False}}
SMALL = {"episodes_per_step": 3, "max_turns": 4, "max_new_tokens": 3, "lora_rank": 4, "learning_rate": 1e-2}
KEYS = {
    "loss",
    "reward",
    "reward_std",
    "zero_std_frac",
    "loss/policy",
    "reward/mean",
    "episode/env_return",
    "episode/success_rate",
    "episode/turns",
    "episode/invalid_action_frac",
    "grpo/clipfrac",
    "grpo/approx_kl",
    "optim/grad_norm",
    "perf/step_s",
    "perf/generate_s",
    "perf/turns",
}


def make_ctx(model, tmp_path: Path, name: str, env=LAKE, resume_from=None, **hp) -> WorkerContext:
    return worker_ctx(
        tmp_path,
        name,
        workload_type="lora_finetune",
        model=model,
        env_config=env,
        hyperparameters={**SMALL, **hp},
        resume_from=resume_from,
    )


@pytest.fixture
def scripted(monkeypatch):
    """Replace reply parsing by a script: ``scripted(fn)`` makes the action ``fn(reply, names)``."""

    def install(fn):
        monkeypatch.setattr(grpo_game, "parse_action", fn)

    return install


def by_reply(reply, names):
    """A deterministic function of the sampled reply: right, down, or invalid (None)."""
    return (2, 1, None)[sum(map(ord, reply)) % 3]


def test_random_model_replies_are_invalid_actions_with_the_documented_penalty(tiny_model_dir, tmp_path):
    ctx = make_ctx(tiny_model_dir, tmp_path, "invalid", steps=1, invalid_action_reward=-0.25)
    run_task(ctx)  # dispatches to the LM game: FrozenLake is a gym-kind environment
    (m,) = reports(ctx, "metric")
    v = m["values"]
    assert KEYS <= set(v), KEYS - set(v)
    # The random model never names an action: every turn is invalid, the lake is never stepped.
    assert v["episode/invalid_action_frac"] == 1.0 and v["episode/turns"] == 4
    assert v["reward"] == pytest.approx(4 * -0.25) and v["episode/env_return"] == 0.0
    assert v["zero_std_frac"] == 1.0 and v["loss"] == 0.0  # equal returns: no signal, policy loss 0
    (c,) = reports(ctx, "checkpoint")
    assert c["final"] and c["format"] == "peft_lora"
    assert {"adapter_config.json", "adapter_model.safetensors", "trainer_state.pt"} <= {
        p.name for p in Path(c["path"]).iterdir()
    }


def test_episode_returns_follow_the_game(tiny_model_dir, tmp_path, scripted):
    ctx = make_ctx(tiny_model_dir, tmp_path, "goal", steps=1, episodes_per_step=2, max_turns=8)
    trainer = grpo_game.GameTrainer(ctx)
    prompt = trainer.tokenizer.decode(trainer.encode(0))
    assert "P F F F\nF H F H" in prompt and prompt.endswith("<|im_start|>assistant\nMove:")
    always = {"right": 2, "down": 1}
    for name, action in always.items():
        scripted(lambda reply, names, a=action: a)
        ep, _, _ = trainer.play()
        if name == "right":  # 0 -> 1 -> 2 -> 3, then against the wall: never terminates
            assert ep.returns == [0.0, 0.0] and ep.turns == [8, 8] and ep.terminated == [False, False]
        else:  # 0 -> 4 -> 8 -> 12, a hole: terminated after 3 turns
            assert ep.returns == [0.0, 0.0] and ep.turns == [3, 3] and ep.terminated == [True, True]
    it = iter([1, 1, 2, 1, 2, 2])
    scripted(lambda reply, names: next(it))
    trainer.n_envs = 1
    trainer.envs = trainer.envs[:1]
    trainer.cfg = dataclasses.replace(trainer.cfg, episodes_per_step=1)
    ep, _, _ = trainer.play()
    assert ep.returns == [1.0] and ep.env_returns == [1.0] and ep.turns == [6] and ep.terminated == [True]


def test_distance_shaping_adds_the_potential_difference(tiny_model_dir, tmp_path, scripted):
    scripted(lambda reply, names: 2)  # always right: from (1,1) to (1,4), 3 of the 6 squares to G
    ctx = make_ctx(tiny_model_dir, tmp_path, "shaping", steps=1, reward_shaping="distance", max_turns=5)
    trainer = grpo_game.GameTrainer(ctx)
    ep, _, _ = trainer.play()
    assert ep.returns == pytest.approx([0.5] * 3) and ep.env_returns == [0.0] * 3


def test_mixed_returns_train_the_adapter(tiny_model_dir, tmp_path, scripted):
    scripted(by_reply)
    ctx = make_ctx(
        tiny_model_dir,
        tmp_path,
        "train",
        steps=2,
        invalid_action_reward=-1.0,
        reward_shaping="distance",
        micro_batch_size=5,
    )
    trainer = grpo_game.GameTrainer(ctx)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.run()
    metrics = [r["values"] for r in reports(ctx, "metric")]
    assert len(metrics) == 2 and any(m["zero_std_frac"] == 0.0 for m in metrics)
    assert all(math.isfinite(x) for m in metrics for x in m.values())
    changed = any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters() if p.requires_grad)
    assert changed


def test_resume_continues_exactly(tiny_model_dir, tmp_path, scripted):
    scripted(by_reply)
    hp = {"steps": 3, "checkpoint_every": 1, "reward_shaping": "distance", "invalid_action_reward": -1.0}
    straight = make_ctx(tiny_model_dir, tmp_path, "straight", **hp)
    run_task(straight)
    first = make_ctx(tiny_model_dir, tmp_path, "first", **{**hp, "steps": 2})
    run_task(first)
    resumed = make_ctx(tiny_model_dir, tmp_path, "resumed", resume_from=tmp_path / "first" / "step_2", **hp)
    run_task(resumed)
    (m3,) = reports(resumed, "metric")
    want = reports(straight, "metric")[2]
    assert m3["step"] == 3
    for key in ("reward", "loss", "episode/turns", "episode/invalid_action_frac"):
        assert m3["values"][key] == pytest.approx(want["values"][key], abs=1e-6), key
    from safetensors.torch import load_file

    a = load_file(tmp_path / "straight" / "step_3" / "adapter_model.safetensors")
    b = load_file(tmp_path / "resumed" / "step_3" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


def test_trainer_refuses_envs_it_cannot_play(tiny_model_dir, tmp_path):
    ctx = make_ctx(tiny_model_dir, tmp_path, "mismatch", steps=1)
    # Submit-time validation refuses a size mismatch; the trainer checks again on its own.
    ctx.spec = dataclasses.replace(ctx.spec, env=dataclasses.replace(ctx.spec.env, action_space=5))
    with pytest.raises(
        UserError, match=r"env_config.action_space: declared 5, but FrozenLake-v1's action_space is Discrete\(4\)"
    ):
        run_task(ctx)
    with pytest.raises(UserError, match="Discrete actions"):
        run_task(make_ctx(tiny_model_dir, tmp_path, "box", env={"env_id": "MountainCarContinuous-v0"}, steps=1))
    with pytest.raises(UserError, match="reward_shaping"):
        run_task(
            make_ctx(
                tiny_model_dir, tmp_path, "cliff", env={"env_id": "CliffWalking-v1"}, steps=1, reward_shaping="distance"
            )
        )


def test_lm_game_on_a_client_hosted_environment(tiny_model_dir, tmp_path, scripted):
    seen = []

    def parse(reply, names):
        seen.append(names)
        return 1

    scripted(parse)
    with EnvironmentServer(Corridor(length=4)) as server:
        ctx = make_ctx(tiny_model_dir, tmp_path, "client", env=server.env_config, steps=1)
        try:
            run_task(ctx)
        finally:
            close_all_sessions()
    (m,) = reports(ctx, "metric")
    assert m["values"]["episode/success_rate"] == 1.0 and m["values"]["episode/turns"] == 3
    assert seen[0] == ("left", "right")  # the client's action names reach the LM's prompt
    assert isinstance(ctx.spec.hyperparameters, LMGameGRPOConfig)


def test_a_step_without_signal_still_steps_and_reports_the_kl_to_the_base_model(tiny_model_dir, tmp_path):
    """The rules of rl.grpo.grpo_update, as in the text trainer: equal returns take the
    optimizer step all the same, and ``kl`` is the KL to the base model (0 on a fresh adapter)."""
    ctx = make_ctx(tiny_model_dir, tmp_path, "nosignal", steps=1, kl_coef=0.1)
    run_task(ctx)
    (m,) = reports(ctx, "metric")
    v = m["values"]
    assert v["zero_std_frac"] == 1.0 and v["grpo/no_signal"] == 1.0 and v["grpo/missing_rewards"] == 0.0
    assert v["kl"] == v["grpo/kl_ref"] == pytest.approx(0.0, abs=1e-6)
    (c,) = reports(ctx, "checkpoint")
    state = torch.load(Path(c["path"]) / "trainer_state.pt", weights_only=True)
    steps = {int(s["step"]) for s in state["optimizer"]["state"].values()}
    assert steps == {1}
    assert set(state["rng"]) >= {"torch", "numpy", "python", "env"}
