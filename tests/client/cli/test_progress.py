"""What `watch` estimates and prints per step: an ETA from the step times seen (slow steps too),
env steps of total for PPO, throughputs with their significant digits."""

from __future__ import annotations

import datetime as dt

import pytest

from opentinker_client.cli.commands import _Eta, _fmt_duration, _fmt_rate, _metric_line, _Units, _units
from opentinker_client.types import TaskEvent, TaskInfo

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)


def metric(step: int, at_s: float, **values) -> TaskEvent:
    return TaskEvent(
        task_id="t", sequence=step, time=T0 + dt.timedelta(seconds=at_s), kind="metric", step=step, metrics=values
    )


def test_eta_from_slow_steps_seen() -> None:
    eta = _Eta(_Units(10, "steps"))
    assert eta.finish_time() is None
    eta.add(metric(1, 0))
    assert eta.finish_time() is None  # one step, no perf/step_s: nothing tells yet
    eta.add(metric(2, 300))  # 5 minutes a step: rich's 30 s speed window never sees two
    assert eta.finish_time() == pytest.approx(T0.timestamp() + 300 + 8 * 300)


def test_eta_from_one_step_with_its_own_timing() -> None:
    eta = _Eta(_Units(10, "steps"))
    eta.add(metric(1, 0, **{"perf/step_s": 60.0}))
    assert eta.finish_time() == pytest.approx(T0.timestamp() + 9 * 60)


def test_eta_restarts_after_a_resume_reports_steps_again() -> None:
    eta = _Eta(_Units(10, "steps"))
    eta.add(metric(4, 0))
    eta.add(metric(5, 10))
    eta.add(metric(3, 1000))  # attempt 2 resumed from the step-2 checkpoint
    eta.add(metric(4, 1020))
    assert eta.finish_time() == pytest.approx(T0.timestamp() + 1020 + 6 * 20)


def test_ppo_counts_env_steps_of_total_timesteps() -> None:
    task = TaskInfo(task_id="t", state="running", workload_type="full_rl", hyperparameters={"total_timesteps": 4096})
    units = _units(task)
    assert units == _Units(4096, "env steps")
    eta = _Eta(units)
    eta.add(metric(1, 0, env_steps=512.0, **{"perf/env_steps_per_s": 256.0}))
    assert eta.finish_time() == pytest.approx(T0.timestamp() + (4096 - 512) / 256)
    line = _metric_line(
        metric(1, 0, env_steps=512.0, reward=1.0, loss=0.5, **{"perf/env_steps_per_s": 256.4}), None, units
    )
    assert line.startswith("step 1  env steps 512/4096  reward 1.000  loss 0.5000") and "env steps/s 256" in line


def test_lm_tasks_count_steps() -> None:
    task = TaskInfo(task_id="t", state="running", workload_type="lora_finetune", hyperparameters={"steps": 15})
    assert _units(task) == _Units(15, "steps")


@pytest.mark.parametrize(
    ("value", "text"), [(0.19, "0.19"), (0.004123, "0.00412"), (12.34, "12.3"), (1234.5, "1234"), (0.0, "0")]
)
def test_throughputs_keep_their_significant_digits(value, text) -> None:
    assert _fmt_rate(value) == text
    line = _metric_line(metric(1, 0, reward=0.0, loss=0.0, **{"perf/tokens_per_s": value}), 10)
    assert f"tok/s {text}" in line


def test_durations() -> None:
    assert _fmt_duration(3723.4) == "1:02:03" and _fmt_duration(None) == "-:--:--" and _fmt_duration(-5) == "0:00:00"


def test_sft_steps_show_token_accuracy_not_a_reward() -> None:
    line = _metric_line(metric(3, 0, reward=0.61, loss=1.25, **{"train/token_accuracy": 0.61}), 10)
    assert "token accuracy 0.610  loss 1.2500" in line and "reward" not in line


def test_grpo_steps_show_the_gradient_norm_where_the_first_epochs_loss_is_zero() -> None:
    values = {"reward": 0.5, "loss": 0.0, "optim/grad_norm": 0.4125, "grpo/zero_std_frac": 0.25}
    line = _metric_line(metric(2, 0, **values), 10)
    assert "reward 0.500  grad norm 0.4125" in line and "loss" not in line
