"""A checkpoint on the user's machine: a LoRA adapter merged into its base (checked against the
unmerged model's logits, fp32 and bf16), a PPO policy's TorchScript playing episodes with mean ±
standard error."""

from __future__ import annotations

import json
import math

import pytest
import torch

from opentinker_client.models import evaluate_policy, load_policy, mean_and_stderr, merge_adapter


@pytest.fixture(scope="module")
def adapter(tiny_model_dir, tmp_path_factory):
    """A LoRA adapter on the tiny model with random (non-zero) lora_B, so merging changes the
    logits; its config names the base as a task would (spec.model)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    out = tmp_path_factory.mktemp("adapter") / "step_3"
    model.save_pretrained(out)
    return out, model.eval()


def _logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens).logits.float()


def test_merged_model_gives_the_unmerged_models_logits(adapter, tiny_model_dir, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    folder, peft_model = adapter
    tokens = torch.tensor([[1, 5, 9, 30, 7, 2, 11, 4]])
    want = _logits(peft_model, tokens)
    base_logits = _logits(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32), tokens)
    assert (want - base_logits).abs().max() > 1e-2  # the adapter matters, so a merge that drops it fails

    fp32 = merge_adapter(folder, tmp_path / "fp32", dtype="float32")  # base from adapter_config.json
    assert not (fp32 / "adapter_config.json").exists() and (fp32 / "tokenizer_config.json").exists()
    merged = AutoModelForCausalLM.from_pretrained(fp32)  # plain transformers, no PEFT
    assert next(merged.parameters()).dtype == torch.float32
    assert torch.allclose(_logits(merged, tokens), want, atol=1e-4)

    bf16 = merge_adapter(folder, tmp_path / "bf16", base=str(tiny_model_dir))
    merged16 = AutoModelForCausalLM.from_pretrained(bf16, dtype="auto")
    assert next(merged16.parameters()).dtype == torch.bfloat16
    assert json.loads((bf16 / "config.json").read_text()).get("dtype", "bfloat16") == "bfloat16"
    got = _logits(merged16, tokens)
    scale = want.abs().max()
    assert (got - want).abs().max() <= 0.03 * scale  # bf16 keeps ~3 significant digits
    assert (got - want).abs().max() < (base_logits - want).abs().max()  # closer to merged than to the base


def test_merge_refusals_leave_nothing(adapter, tmp_path) -> None:
    folder, _ = adapter
    with pytest.raises(ValueError, match="dtype: expected one of bfloat16, float32, got 'float16'"):
        merge_adapter(folder, tmp_path / "x", dtype="float16")
    with pytest.raises(ValueError, match="expected a PEFT LoRA adapter folder"):
        merge_adapter(tmp_path, tmp_path / "x")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "f").write_text("keep")
    with pytest.raises(FileExistsError, match="not an empty folder"):
        merge_adapter(folder, tmp_path / "taken")
    with pytest.raises(OSError):
        merge_adapter(folder, tmp_path / "y", base=str(tmp_path / "no-such-model"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]  # nothing half-written


def test_a_merge_that_loses_the_adapter_is_refused_before_anything_is_written(adapter, tmp_path, monkeypatch) -> None:
    """merge_adapter checks the merged logits itself: a merge that drops the adapter (as a PEFT
    version that merged nothing would) is refused, and no folder is left."""
    from peft.tuners.tuners_utils import BaseTuner

    folder, _ = adapter
    monkeypatch.setattr(BaseTuner, "merge_and_unload", lambda self: self.unload())  # the base, unmerged
    with pytest.raises(ValueError, match="the merged model's logits differ from the adapter's by up to"):
        merge_adapter(folder, tmp_path / "out", dtype="float32")
    assert list(tmp_path.iterdir()) == []


def test_mean_and_stderr() -> None:
    assert mean_and_stderr([3.0]) == (3.0, 0.0)
    mean, se = mean_and_stderr([1.0, 2.0, 3.0, 4.0])
    assert mean == 2.5 and math.isclose(se, math.sqrt((1.5**2 * 2 + 0.5**2 * 2) / 3 / 4))


def test_policy_checkpoint_plays_episodes(tmp_path) -> None:
    import gymnasium
    import numpy as np

    from opentinker_trainer.rl.policy import ActorCritic
    from opentinker_trainer.rl.policy_export import ACTING_FILE, export_torchscript

    env = gymnasium.make("CartPole-v1")
    torch.manual_seed(0)
    policy = ActorCritic(env.observation_space, env.action_space, (8,))
    export_torchscript(policy, tmp_path / ACTING_FILE, torch.zeros(1, 4))
    loaded = load_policy(tmp_path)
    r = evaluate_policy(loaded, "CartPole-v1", episodes=3, seed=5)
    # The same episodes played here with the policy's own greedy action give the same returns.
    returns = []
    for i in range(3):
        obs, _ = env.reset(seed=5 + i)
        total, done = 0.0, False
        while not done:
            with torch.no_grad():
                logits = policy.actor(policy.features(torch.as_tensor(obs)[None]))
            obs, reward, terminated, truncated, _ = env.step(int(logits.argmax(-1)[0]))
            total, done = total + reward, terminated or truncated
        returns.append(total)
    assert r.returns == tuple(returns) and r.lengths == tuple(int(x) for x in returns)
    assert (r.mean_return, r.stderr) == mean_and_stderr(returns) and r.episodes == 3
    with pytest.raises(FileNotFoundError, match="expected a torch_ppo checkpoint"):
        load_policy(tmp_path / "nope")
    with pytest.raises(ValueError, match="episodes: expected 1..10000"):
        evaluate_policy(loaded, "CartPole-v1", episodes=0)
    with pytest.raises(ValueError, match="gymnasium cannot make it"):
        evaluate_policy(loaded, "NoSuchEnv-v9", episodes=1)
    assert np.isfinite(r.mean_return)
