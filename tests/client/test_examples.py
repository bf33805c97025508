"""Every example in examples/ is valid as the client and scheduler read it: the YAML task configs
pass the spec check; the Python examples compile and their reward functions keep the contract."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

from opentinker_client.config import load_task_config

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_yaml_examples_pass_the_spec_check(path: Path) -> None:
    config = load_task_config(path)
    config.check()  # raises ConfigError naming the line on anything the scheduler would refuse


def test_the_prompt_dataset_example_uses_the_numeric_verifier() -> None:
    config = load_task_config(EXAMPLES / "word_problems_numeric.yaml")
    assert config.env["env_id"] == "prompts" and config.env["reward"]["verifier"] == "numeric"
    assert config.dataset.endswith("word_problems.jsonl")


def test_the_client_reward_example_scores_one_number_per_item() -> None:
    spec = importlib.util.spec_from_file_location("client_reward_example", EXAMPLES / "client_reward.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    got = module.reward(["q"] * 3, ["It is 12.", "13", "no idea"], [{"answer": 12}] * 3)
    assert got == [1.0, 0.1, 0.0] and all(math.isfinite(x) for x in got)


def test_the_readme_example_checkpoints_often_enough_to_resume() -> None:
    """The fault story of docs/tasks.md ("Liveness"): a trainer killed mid-run, the task resumes
    from its newest checkpoint. With ``checkpoint_every: 0`` only the final checkpoint is written,
    so it would start over."""
    config = load_task_config(EXAMPLES / "arithmetic_lora.yaml")
    steps, every = config.hyperparameters["steps"], config.hyperparameters.get("checkpoint_every", 0)
    assert 0 < every < steps, f"checkpoint_every {every} with {steps} steps: a killed attempt restarts from scratch"


def test_the_warm_start_recipe_continues_the_sft_adapter_with_its_prompt_and_rank() -> None:
    sft = load_task_config(EXAMPLES / "word_problems_sft.yaml")
    rl = load_task_config(EXAMPLES / "word_problems_grpo_from_sft.yaml")
    assert sft.workload_type == "sft" and rl.workload_type == "lora_finetune"
    assert rl.env["system_prompt"] == "Show each step as an equation."  # what the worked solutions answer
    assert rl.hyperparameters["lora_rank"] == sft.hyperparameters["lora_rank"]  # the adapter it continues
    assert not rl.env["reward"].get("terms")  # the verifier alone: a worked solution is long by design
