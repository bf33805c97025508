"""Learning-curve axes, smoothing and ranges shared by the CLI plots and the dashboard."""

from __future__ import annotations

import pytest

from opentinker_common import curves

POINTS = [
    (2, 110.0, {"reward": 0.5, "env_steps": 128.0, "perf/tokens_per_s": 10.0, "perf/step_s": 2.0}),
    (1, 100.0, {"reward": 0.25, "env_steps": 64.0, "perf/tokens_per_s": 5.0, "perf/step_s": 2.0}),
    (3, 125.0, {"reward": float("nan"), "env_steps": 192.0}),
]


@pytest.mark.parametrize(
    ("x", "xs"),
    [("step", [1.0, 2.0]), ("env_steps", [64.0, 128.0]), ("tokens", [10.0, 30.0]), ("time", [0.0, 10.0])],
)
def test_series_against_each_x_axis_skips_non_finite_values(x, xs) -> None:
    assert curves.series(POINTS, "reward", x) == (xs, [0.25, 0.5])


def test_tokens_prefer_a_reported_running_total() -> None:
    pts = [(1, 0.0, {"loss": 1.0, "train/tokens": 500.0, "perf/tokens_per_s": 1.0, "perf/step_s": 1.0})]
    assert curves.series(pts, "loss", "tokens") == ([500.0], [1.0])


def test_unknown_x_axis_is_refused_naming_the_choices() -> None:
    with pytest.raises(ValueError, match="x: expected one of step, env_steps, tokens, time, got 'epoch'"):
        curves.series(POINTS, "reward", "epoch")


def test_smoothing_is_debiased_ema_and_zero_weight_is_identity() -> None:
    assert curves.smooth([1.0, 3.0], 0.0) == [1.0, 3.0]
    out = curves.smooth([2.0, 2.0, 2.0], 0.9)
    assert out == pytest.approx([2.0, 2.0, 2.0])  # debiased: a constant stays constant
    ema = curves.smooth([0.0, 1.0], 0.5)
    assert ema == pytest.approx([0.0, (0.5 * 0.0 * 0.5 + 0.5) / 0.75])
    with pytest.raises(ValueError, match=r"smooth: expected a weight in \[0, 1\), got 1.0"):
        curves.smooth([1.0], 1.0)


def test_panels_pick_the_first_key_reported_and_ranges_clip_bands() -> None:
    pts = [(1, 0.0, {"ppo/approx_kl": 0.01, "perf/env_steps_per_s": 900.0})]
    assert curves.panel_key(pts, "kl") == "ppo/approx_kl"
    assert curves.panel_key(pts, "throughput") == "perf/env_steps_per_s"
    assert curves.panel_key(pts, "reward") is None
    assert curves.value_range("completion/truncated_frac") == (0.0, 1.0)
    assert curves.value_range("perf/tokens_per_s") == (0.0, None)
    assert curves.value_range("reward") == (None, None)


def test_sfts_token_accuracy_is_drawn_under_its_own_name_not_reward() -> None:
    sft = [(1, 0.0, {"reward": 0.4, "train/token_accuracy": 0.4, "loss": 2.0})]
    assert curves.panel_key(sft, "reward") == "train/token_accuracy"
    assert curves.panel_key([(1, 0.0, {"reward": 0.5})], "reward") == "reward"
    assert curves.value_range("train/token_accuracy") == (0.0, 1.0)


def test_ppo_on_environments_defaults_to_env_steps() -> None:
    assert curves.default_x_axis("full_rl", "gym") == "env_steps"
    assert curves.default_x_axis("full_rl", "multiagent") == "env_steps"
    assert curves.default_x_axis("full_rl", "text") == "step"
    assert curves.default_x_axis("lora_finetune", "text") == "step"
