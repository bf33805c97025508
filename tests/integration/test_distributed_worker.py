"""A worker given two (simulated) devices runs two gloo ranks, and its step equals one rank's.

Each test runs the real worker process (``python -m opentinker_trainer.worker``) as the node agent
of a ``--simulate-gpus`` node starts it, once with one device and once with two, and compares
what they report and the checkpoints they write.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.support.datasets import arithmetic_chat_jsonl
from tests.support.distributed import run_worker, start_worker, task_spec

#: PPO on CartPole for ever (the tests end it) on two ranks.
CARTPOLE_TWO_RANKS = task_spec(
    workload_type="full_rl",
    model="",
    env_config={"env_id": "CartPole-v1"},
    hyperparameters={"total_timesteps": 10_000_000, "num_envs": 2, "num_steps": 8, "hidden_sizes": [8]},
    gpu_count=2,
)


def adapter(checkpoint) -> dict[str, torch.Tensor]:
    return load_file(str(checkpoint / "adapter_model.safetensors"))


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = 1e-6) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=1e-5, msg=lambda m, k=k: f"{k}: {m}")


def test_sft_two_ranks_take_the_step_of_one(tiny_model_dir, tmp_path) -> None:
    data = arithmetic_chat_jsonl(tmp_path / "d.jsonl", n=12)
    spec = task_spec(
        workload_type="sft",
        model=tiny_model_dir,
        env_config={"env_id": "chat_jsonl", "path": str(data), "eval_fraction": 0.25},
        hyperparameters={"steps": 1, "batch_size": 5, "micro_batch_size": 2, "learning_rate": 1e-2, "lora_rank": 4},
        gpu_count=2,
    )
    one = run_worker(tmp_path, "w1", spec, devices=1)
    two = run_worker(tmp_path, "w2", spec, devices=2)
    for run in (one, two):
        assert run.returncode == 0, run.stderr[-3000:]
        assert [r["type"] for r in run.reports][-1] == "succeeded"
    assert "starting ranks" in two.stderr and "starting ranks" not in one.stderr
    (m1,), (m2,) = one.of("metric"), two.of("metric")  # rank 0 alone reports
    for key in ("loss", "reward", "train/tokens", "loss/eval", "eval/token_accuracy", "optim/grad_norm"):
        assert m2["values"][key] == pytest.approx(m1["values"][key], rel=1e-5), key
    (c1,), (c2,) = one.of("checkpoint"), two.of("checkpoint")
    assert c1["format"] == c2["format"] == "peft_lora"
    assert_same_tensors(
        adapter(tmp_path / "node/w1/checkpoints/step_1"), adapter(tmp_path / "node/w2/checkpoints/step_1")
    )
    state = torch.load(tmp_path / "node/w2/checkpoints/step_1/trainer_state.pt", weights_only=True)
    assert state["world_size"] == 2 and len(state["rng_ranks"]) == 2


def test_grpo_on_two_ranks_reports_the_global_batch_and_resumes(tiny_model_dir, tmp_path) -> None:
    hp = {
        "steps": 2,
        "prompts_per_step": 3,
        "group_size": 2,
        "max_new_tokens": 3,
        "lora_rank": 4,
        "checkpoint_every": 1,
    }
    spec = task_spec(
        workload_type="lora_finetune",
        model=tiny_model_dir,
        env_config={"env_id": "arithmetic"},
        hyperparameters=hp,
        gpu_count=2,
    )
    run = run_worker(tmp_path, "g", spec, devices=2)
    assert run.returncode == 0, run.stderr[-3000:]
    metrics = run.of("metric")
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(m["values"]["perf/samples"] == 6 for m in metrics)  # 3 groups of 2, over both ranks
    assert [c["step"] for c in run.of("checkpoint")] == [1, 2]
    step1 = tmp_path / "node/g/checkpoints/step_1"
    assert (step1 / "adapter_model.safetensors").exists() and (step1 / "adapter_config.json").exists()
    # Resumed with the same world size from step 1, step 2 is the same step.
    again = run_worker(tmp_path, "g-resumed", spec, devices=2, attempt=2, resume_from=step1)
    assert again.returncode == 0, again.stderr[-3000:]
    assert [m["step"] for m in again.of("metric")] == [2]
    assert again.of("metric")[0]["values"]["loss"] == pytest.approx(metrics[1]["values"]["loss"], rel=1e-5)
    assert_same_tensors(
        adapter(tmp_path / "node/g/checkpoints/step_2"), adapter(tmp_path / "node/g-resumed/checkpoints/step_2")
    )


def test_ppo_on_two_ranks_splits_the_envs(tmp_path) -> None:
    hp = {
        "total_timesteps": 64,
        "num_envs": 4,
        "num_steps": 8,
        "num_minibatches": 2,
        "update_epochs": 1,
        "hidden_sizes": [8],
    }
    spec = task_spec(
        workload_type="full_rl", model="", env_config={"env_id": "CartPole-v1"}, hyperparameters=hp, gpu_count=2
    )
    run = run_worker(tmp_path, "p", spec, devices=2)
    assert run.returncode == 0, run.stderr[-3000:]
    metrics = run.of("metric")
    assert [m["step"] for m in metrics] == [1, 2]
    assert [m["values"]["env_steps"] for m in metrics] == [32, 64]
    (final,) = [c for c in run.of("checkpoint") if c["final"]]
    state = torch.load(tmp_path / "node/p/checkpoints/step_2/trainer_state.pt", weights_only=True)
    assert final["format"] == "torch_ppo" and state["world_size"] == 2
    odd = task_spec(
        workload_type="full_rl",
        model="",
        env_config={"env_id": "CartPole-v1"},
        hyperparameters={**hp, "num_envs": 3},
        gpu_count=2,
    )
    bad = run_worker(tmp_path, "p-odd", odd, devices=2)
    (failed,) = bad.of("failed")
    assert "hyperparameters.num_envs 3" in failed["error"] and failed["retryable"] is False


def children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as fh:
        return [int(x) for x in fh.read().split()]


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode()
    except FileNotFoundError:
        return ""


def test_kill_9_of_one_rank_ends_the_attempt_retryable(tmp_path) -> None:
    import json
    import os
    import signal

    with open(tmp_path / "k-stderr.log", "w") as err:
        proc = start_worker(tmp_path, "k", CARTPOLE_TWO_RANKS, devices=2, stderr=err)
        try:
            lines = iter(proc.stdout.readline, "")
            next(line for line in lines if json.loads(line)["type"] == "metric")  # both ranks are training
            (rank1,) = [
                c for c in children(proc.pid) if "spawn_main" in cmdline(c) and "resource_tracker" not in cmdline(c)
            ]
            os.kill(rank1, signal.SIGKILL)
            rest = [json.loads(line) for line in lines]
            assert proc.wait() != 0
            (failed,) = [r for r in rest if r["type"] == "failed"]
            assert f"rank 1 (pid {rank1}) killed by signal 9" in failed["error"] and failed["retryable"] is True
            assert not [r for r in rest if r["type"] in ("succeeded", "stopped")]
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    assert not cmdline(rank1)  # gone (reaped)


def test_sigterm_to_the_group_stops_every_rank_after_one_checkpoint(tmp_path) -> None:
    """A drain or cancel: SIGTERM to the worker's process group; the ranks agree on the step to
    stop after, rank 0 writes one checkpoint, the worker reports ``stopped`` and no rank is left."""
    import json
    import os
    import signal

    folder = tmp_path / "node" / "s"
    with open(tmp_path / "s-stderr.log", "w") as err:
        proc = start_worker(tmp_path, "s", CARTPOLE_TWO_RANKS, devices=2, stderr=err)
        try:
            lines = iter(proc.stdout.readline, "")
            next(line for line in lines if json.loads(line)["type"] == "metric")
            ranks = [c for c in children(proc.pid) if "resource_tracker" not in cmdline(c)]
            os.killpg(proc.pid, signal.SIGTERM)
            rest = [json.loads(line) for line in lines]
            assert proc.wait() == 0, (rest, (tmp_path / "s-stderr.log").read_text()[-4000:])
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    kinds = [r["type"] for r in rest]
    assert kinds[-1] == "stopped" and "failed" not in kinds
    (ck,) = [r for r in rest if r["type"] == "checkpoint"]
    assert not ck["final"]
    state = torch.load(folder / "checkpoints" / f"step_{ck['step']}" / "trainer_state.pt", weights_only=True)
    assert state["world_size"] == 2
    assert ranks and not any(cmdline(r) for r in ranks)


def weights(checkpoint) -> dict[str, torch.Tensor]:
    return load_file(str(checkpoint / "model.safetensors"))


def test_full_weight_sft_sharded_with_fsdp_takes_the_step_of_one_rank_and_resumes(tiny_model_dir, tmp_path) -> None:
    data = arithmetic_chat_jsonl(tmp_path / "d.jsonl", n=12)
    hp = {"steps": 2, "batch_size": 5, "micro_batch_size": 2, "learning_rate": 1e-3, "lora": False}
    spec = task_spec(
        workload_type="sft",
        model=tiny_model_dir,
        env_config={"env_id": "chat_jsonl", "path": str(data), "eval_fraction": 0.25},
        hyperparameters={**hp, "checkpoint_every": 1},
        gpu_count=2,
    )
    one = run_worker(tmp_path, "f1", spec, devices=1)
    two = run_worker(tmp_path, "f2", spec, devices=2)
    for run in (one, two):
        assert run.returncode == 0, run.stderr[-3000:]
    for m1, m2 in zip(one.of("metric"), two.of("metric"), strict=True):
        for key in ("loss", "reward", "train/tokens", "optim/grad_norm"):
            assert m2["values"][key] == pytest.approx(m1["values"][key], rel=1e-4), key
    assert [c["format"] for c in two.of("checkpoint")] == ["hf_full", "hf_full"]
    step2 = tmp_path / "node/f2/checkpoints/step_2"
    assert_same_tensors(weights(tmp_path / "node/f1/checkpoints/step_2"), weights(step2), atol=1e-4)
    # Resumed from step 1 at the same world size: step 2 again, the same weights.
    again = run_worker(tmp_path, "f2r", spec, devices=2, attempt=2, resume_from=tmp_path / "node/f2/checkpoints/step_1")
    assert again.returncode == 0, again.stderr[-3000:]
    assert_same_tensors(weights(step2), weights(tmp_path / "node/f2r/checkpoints/step_2"), atol=1e-6)


def test_multi_agent_ppo_on_two_ranks(tmp_path) -> None:
    pytest.importorskip("mpe2")
    hp = {"total_timesteps": 2 * 2 * 25, "num_envs": 2, "num_steps": 25, "hidden_sizes": [8], "num_minibatches": 2}
    env = {"env_id": "mpe2/simple_spread_v3", "env_kwargs": {"N": 3, "max_cycles": 25}}
    spec = task_spec(workload_type="full_rl", model="", env_config=env, hyperparameters=hp, gpu_count=2)
    run = run_worker(tmp_path, "ma", spec, devices=2)
    assert run.returncode == 0, run.stderr[-3000:]
    metrics = run.of("metric")
    assert [m["step"] for m in metrics] == [1, 2]
    assert {"loss/agent/agent_0/policy", "reward/agent/agent_0", "reward"} <= set(metrics[-1]["values"])
    assert [m["values"]["env_steps"] for m in metrics] == [50, 100]  # 2 copies x 25 steps, over both ranks
    state = torch.load(tmp_path / "node/ma/checkpoints/step_2/trainer_state.pt", weights_only=True)
    assert state["world_size"] == 2


def test_full_weight_grpo_sharded_with_fsdp_checkpoints_once_and_resumes(tiny_model_dir, tmp_path) -> None:
    """full_rl GRPO on two ranks, weights and the KL reference sharded with FSDP2: one hf_full
    checkpoint per step written by rank 0 with both ranks' RNG states; a resume at the same
    world size retakes step 2 exactly. (A resume at another world size reads the same format:
    tests/trainer/rl/test_grpo_distributed.py, the optimizer state round trip.)"""
    hp = {
        "steps": 2,
        "prompts_per_step": 3,  # ranks of 2 and 1 groups: unequal micro-batch counts
        "group_size": 2,
        "micro_batch_size": 2,
        "max_new_tokens": 3,
        "kl_coef": 0.05,
        "learning_rate": 1e-3,
        "checkpoint_every": 1,
    }
    spec = task_spec(
        workload_type="full_rl",
        model=tiny_model_dir,
        env_config={"env_id": "arithmetic"},
        hyperparameters=hp,
        gpu_count=2,
    )
    run = run_worker(tmp_path, "fg", spec, devices=2)
    assert run.returncode == 0, run.stderr[-3000:]
    metrics = run.of("metric")
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(m["values"]["perf/samples"] == 6 for m in metrics)
    assert [(c["step"], c["format"]) for c in run.of("checkpoint")] == [(1, "hf_full"), (2, "hf_full")]
    step1, step2 = tmp_path / "node/fg/checkpoints/step_1", tmp_path / "node/fg/checkpoints/step_2"
    state = torch.load(step1 / "trainer_state.pt", weights_only=True)
    assert state["world_size"] == 2 and len(state["rng_ranks"]) == 2
    moved = weights(step2)
    again = run_worker(tmp_path, "fg-r", spec, devices=2, attempt=2, resume_from=step1)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.of("metric")[0]["values"]["loss"] == pytest.approx(metrics[1]["values"]["loss"], rel=1e-5)
    assert_same_tensors(moved, weights(tmp_path / "node/fg-r/checkpoints/step_2"), atol=1e-6)


def test_lm_game_grpo_on_two_ranks_plays_its_share_of_the_groups(tiny_model_dir, tmp_path) -> None:
    """GRPO on an LM game (FrozenLake) with two ranks: each plays whole groups of episodes, the
    metrics are of all ranks' turns, rank 0 checkpoints with both ranks' RNG states; fewer
    groups than ranks is refused naming the field."""
    hp = {
        "steps": 2,
        "groups_per_step": 3,
        "episodes_per_step": 2,
        "max_turns": 2,
        "max_new_tokens": 3,
        "lora_rank": 4,
        "checkpoint_every": 1,
    }
    lake = {"env_id": "FrozenLake-v1", "env_kwargs": {"is_slippery": False}}
    spec = task_spec(
        workload_type="lora_finetune", model=tiny_model_dir, env_config=lake, hyperparameters=hp, gpu_count=2
    )
    run = run_worker(tmp_path, "game", spec, devices=2)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "starting ranks" in run.stderr
    metrics = run.of("metric")
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:  # 6 episodes over both ranks, each 1 or 2 turns
        assert 6 <= m["values"]["perf/turns"] <= 12
        assert m["values"]["episode/turns"] == pytest.approx(m["values"]["perf/turns"] / 6)
    assert [c["step"] for c in run.of("checkpoint")] == [1, 2]
    state = torch.load(tmp_path / "node/game/checkpoints/step_2/trainer_state.pt", weights_only=True)
    assert state["world_size"] == 2 and len(state["rng_ranks"]) == 2
    few = task_spec(
        workload_type="lora_finetune",
        model=tiny_model_dir,
        env_config=lake,
        hyperparameters={**hp, "groups_per_step": 1},
        gpu_count=2,
    )
    (failed,) = run_worker(tmp_path, "game-few", few, devices=2).of("failed")
    assert "hyperparameters.groups_per_step 1: fewer groups than the task's 2 ranks" in failed["error"]
    assert failed["retryable"] is False
