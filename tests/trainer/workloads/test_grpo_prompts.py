"""lora_finetune on env_id prompts (a user's JSONL) with a tiny random Llama: the held-out eval
metric, skipped lines, prompts too long for the context, and a client-hosted reward (a real
RewardServer on loopback) with its missing-reward policy."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from opentinker_client.hosting.reward import RewardServer
from opentinker_common.prompts import PromptsEnv, load_lines
from opentinker_trainer.context import UserError
from opentinker_trainer.workloads import grpo_text

from tests.support.workers import reports, worker_ctx

SMALL = {"prompts_per_step": 2, "group_size": 2, "max_new_tokens": 3, "lora_rank": 4}
ANYTHING, NOTHING = "(?s).", "^NEVER$"


def write(path: Path, lines: list[dict]) -> Path:
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def make_ctx(model, tmp_path, name, env, **hp):
    return worker_ctx(
        tmp_path,
        name,
        workload_type="lora_finetune",
        model=model,
        env_config={"env_id": "prompts", **env},
        hyperparameters={**SMALL, **hp},
    )


def test_eval_accuracy_is_the_share_of_held_out_prompts_the_verifier_passes(tiny_model_dir, tmp_path) -> None:
    # The regex verifier reads each line's pattern from "answer": half match any reply, half none,
    # so the held-out accuracy is known whatever the random model says.
    lines = [{"prompt": f"Say something {i}.", "answer": ANYTHING if i % 2 else NOTHING} for i in range(12)]
    data = write(tmp_path / "p.jsonl", [*lines, {"prompt": "no answer"}])
    env = {"path": str(data), "reward": {"verifier": "regex"}, "eval_fraction": 0.5, "eval_every": 1}
    ctx = make_ctx(tiny_model_dir, tmp_path, "eval", env, steps=2)
    trainer = grpo_text._Trainer(ctx)  # what grpo_text.run does, keeping the trainer to look at
    trainer.run()

    held_out = PromptsEnv(ctx.spec.env, load_lines(data.read_text().splitlines())).eval_problems
    want = sum(p.expected == ANYTHING for p in held_out) / len(held_out)
    assert 0 < want < 1
    metrics = [m["values"] for m in reports(ctx, "metric")]
    assert [m["eval/accuracy"] for m in metrics] == [want, want]
    assert metrics[0]["eval/accuracy_start"] == want and "eval/accuracy_start" not in metrics[1]
    assert [m["eval/prompts"] for m in metrics] == [6.0, 6.0]
    assert all(m["data/skipped_lines"] == 1.0 for m in metrics)  # the line without an answer
    # The last evaluation's judgements, problem by problem in held-out order (for paired comparisons).
    assert trainer.eval_right == [p.expected == ANYTHING for p in held_out]


def test_eval_runs_every_n_steps_and_after_the_last(tiny_model_dir, tmp_path) -> None:
    data = write(tmp_path / "p.jsonl", [{"prompt": f"q{i}", "answer": i} for i in range(6)])
    env = {"path": str(data), "eval_every": 2, "eval_fraction": 0.34}
    ctx = make_ctx(tiny_model_dir, tmp_path, "every", env, steps=3)
    grpo_text.run(ctx)
    assert [("eval/accuracy" in m["values"]) for m in reports(ctx, "metric")] == [False, True, True]


def test_a_prompt_longer_than_the_context_fails_the_task_naming_its_line(tiny_model_dir, tmp_path) -> None:
    long = " ".join(["word"] * 600)  # the tiny model's context is 512 positions
    data = write(tmp_path / "p.jsonl", [{"prompt": "short", "answer": 1}, {"prompt": long, "answer": 2}])
    ctx = make_ctx(tiny_model_dir, tmp_path, "long", {"path": str(data), "eval_fraction": 0})
    with pytest.raises(UserError, match=r"1 prompt\(s\) do not fit the model's context of 512 tokens .*line 2 \("):
        grpo_text.run(ctx)
    assert not reports(ctx, "metric")


@pytest.fixture
def reward_server():
    servers = []

    def start(fn, **kw):
        servers.append(RewardServer(fn, **kw).start())
        return servers[-1]

    yield start
    for s in servers:
        s.stop(grace=0)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    return write(tmp_path_factory.mktemp("data") / "p.jsonl", [{"prompt": f"q{i}", "answer": i} for i in range(8)])


def test_client_reward_scores_batches_and_leaves_bad_values_out(tiny_model_dir, tmp_path, dataset, reward_server):
    seen = []

    def reward(prompts, completions, metadata):
        seen.append((list(prompts), [m["answer"] for m in metadata]))
        return [float("nan"), "high"] + [float(i % 2) for i in range(len(completions) - 2)]

    server = reward_server(reward)
    env = {"path": str(dataset), "reward": server.reward_config, "eval_fraction": 0.25, "eval_threshold": 0.5}
    ctx = make_ctx(tiny_model_dir, tmp_path, "client", env, steps=2)
    grpo_text.run(ctx)

    metrics = [m["values"] for m in reports(ctx, "metric")]
    # 4 samples a step, the first two of them without a reward; step 1 (before the update) and the
    # last step also score the eval split, whose 2 items both get none: a failed call each time
    # (one in a row, below max_consecutive_failures: the rollouts in between got rewards)
    assert [m["grpo/missing_rewards"] for m in metrics] == [2.0, 2.0]
    assert [m["reward/client_missing"] for m in metrics] == [4.0, 4.0]
    assert [m["reward/client_failures"] for m in metrics] == [1.0, 1.0]
    assert metrics[-1]["eval/accuracy"] == 0.0 and metrics[-1]["eval/prompts"] == 2.0
    assert "eval/reward" not in metrics[-1]  # no eval reward at all
    prompts, answers = seen[0]
    assert all(p == f"q{a}" for p, a in zip(prompts, answers))  # the line's metadata travels with its prompt


def test_a_client_reward_that_keeps_raising_ends_the_task_with_the_reason(
    tiny_model_dir, tmp_path, dataset, reward_server
) -> None:
    def reward(prompts, completions, metadata):
        raise ValueError("judge offline")

    server = reward_server(reward, max_consecutive_failures=2)
    env = {"path": str(dataset), "reward": server.reward_config, "eval_fraction": 0}
    ctx = make_ctx(tiny_model_dir, tmp_path, "raises", env, steps=5)
    with pytest.raises(UserError) as err:
        grpo_text.run(ctx)
    assert "the client reward failed 2 times in a row (reward.max_consecutive_failures=2)" in str(err.value)
    assert "raised ValueError: judge offline" in str(err.value)
    metrics = [m["values"] for m in reports(ctx, "metric")]
    assert len(metrics) == 1 and metrics[0]["reward/client_failures"] == 1.0  # step 1 ran with no rewards
    assert metrics[0]["grpo/missing_rewards"] == 4.0 and metrics[0]["loss"] == 0.0


def test_a_client_reward_that_times_out_counts_as_a_failure(tiny_model_dir, tmp_path, dataset, reward_server):
    calls, release = [], threading.Event()

    def reward(prompts, completions, metadata):
        calls.append(len(completions))
        if len(calls) > 1:  # the first call answers; then the function hangs
            release.wait(30)
        return [1.0] * len(completions)

    server = reward_server(reward, timeout_s=0.3, max_consecutive_failures=1)
    env = {"path": str(dataset), "reward": server.reward_config, "eval_fraction": 0}
    ctx = make_ctx(tiny_model_dir, tmp_path, "slow", env, steps=3)
    t0 = time.monotonic()
    try:
        with pytest.raises(UserError, match="did not answer score within timeout_s=0.3 s"):
            grpo_text.run(ctx)
    finally:
        release.set()
    assert [m["step"] for m in reports(ctx, "metric")] == [1]
    assert time.monotonic() - t0 < 30  # it did not wait for the hung function


def test_full_weight_grpo_runs_on_a_prompt_dataset(tiny_model_dir, tmp_path, dataset) -> None:
    ctx = worker_ctx(
        tmp_path,
        "full",
        workload_type="full_rl",
        model=tiny_model_dir,
        env_config={"env_id": "prompts", "path": str(dataset), "eval_fraction": 0.25},
        hyperparameters={"steps": 1, "prompts_per_step": 2, "group_size": 2, "max_new_tokens": 3},
    )
    grpo_text.run(ctx)
    (m,) = [m["values"] for m in reports(ctx, "metric")]
    assert m["eval/prompts"] == 2.0 and 0.0 <= m["eval/accuracy_start"] <= 1.0 and "eval/accuracy" in m
    assert [c["format"] for c in reports(ctx, "checkpoint")] == ["hf_full"]
