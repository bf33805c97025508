"""Learning curves of ``full_rl`` PPO: steps to a return threshold and wall time.

Runs the real workload (``opentinker_trainer.workloads.run_task``) in this process, on the CPU,
for each case below, and prints per case: the random-policy baseline measured in the same run
(mean return of the episodes of the first update, when the policy is still near uniform), the
environment steps and wall time until the mean return of the last 20 finished episodes first
reached the threshold, the final 20-episode mean, the ratio of final improvement, and env steps
per second. A learning curve (env steps, 20-episode mean) is printed at 8 points per case
(``--curve-every N``: every N updates).

    .venv/bin/python scripts/bench_ppo.py                 # all cases (about 6-9 min on 2 cores)
    .venv/bin/python scripts/bench_ppo.py --only cartpole # one case; see --help

Cases:
* ``cartpole``: CartPole-v1, 200,000 steps, the rl-baselines3-zoo PPO settings for CartPole
  (8 envs x 32 steps, 20 epochs of one minibatch, gamma 0.98, lambda 0.8, lr 1e-3 annealed,
  no entropy bonus); threshold 475 (gymnasium's reward_threshold).
* ``cartpole-cleanrl``: the same with PPOConfig's defaults (CleanRL ``ppo.py``), 200,000 steps.
* ``acrobot``: Acrobot-v1, 200,000 steps, CleanRL defaults; threshold -100 (reward_threshold).
* ``spread-shared`` / ``spread-independent``: mpe2/simple_spread_v3 (N=3, 25-step episodes),
  150,000 env steps, parameter-shared vs independent PPO; no threshold, improvement over random.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

from opentinker_common.spec import TaskSpecModel

CASES = {
    "cartpole": dict(
        env={"env_id": "CartPole-v1"}, threshold=475.0,
        hp={"total_timesteps": 200_000, "num_envs": 8, "num_steps": 32, "num_minibatches": 1, "update_epochs": 20,
            "gamma": 0.98, "gae_lambda": 0.8, "ent_coef": 0.0, "learning_rate": 1e-3},
    ),
    "cartpole-cleanrl": dict(env={"env_id": "CartPole-v1"}, threshold=475.0, hp={"total_timesteps": 200_000}),
    "acrobot": dict(env={"env_id": "Acrobot-v1"}, threshold=-100.0, hp={"total_timesteps": 200_000}),
    "spread-shared": dict(
        env={"env_id": "mpe2/simple_spread_v3", "env_kwargs": {"N": 3, "max_cycles": 25}}, threshold=None,
        hp={"total_timesteps": 150_000, "parameter_sharing": True},
    ),
    "spread-independent": dict(
        env={"env_id": "mpe2/simple_spread_v3", "env_kwargs": {"N": 3, "max_cycles": 25}}, threshold=None,
        hp={"total_timesteps": 150_000, "parameter_sharing": False},
    ),
}  # fmt: skip


class _Lines(io.TextIOBase):
    """The worker's report channel, parsed as it is written."""

    def __init__(self, on_metric) -> None:
        self.on_metric = on_metric

    def write(self, s: str) -> int:
        for line in s.splitlines():
            msg = json.loads(line)
            if msg["type"] == "metric":
                self.on_metric(msg["step"], msg["values"])
        return len(s)


def run_case(name: str, case: dict, seed: int, window: int, curve_every: int) -> dict:
    from opentinker_trainer.context import WorkerContext
    from opentinker_trainer.workloads import run_task

    hp = {**case["hp"], "seed": seed}
    spec = TaskSpecModel.from_parts(workload_type="full_rl", model="-", env_config=case["env"], hyperparameters=hp)
    recent: deque[float] = deque(maxlen=window)
    state = {"baseline": math.nan, "hit": None, "curve": [], "steps_per_s": []}
    curve_every = curve_every or max(1, spec.hyperparameters.num_updates // 8)
    started = time.perf_counter()

    def on_metric(step: int, v: dict) -> None:
        n = int(v.get("reward/episodes", 0))
        if n:
            # Each finished episode counted at its update's mean: exact for the window's sum when
            # whole updates fall in the window, a close approximation at its edge.
            recent.extend([v["reward/episode_return_mean"]] * min(n, window))
            if math.isnan(state["baseline"]):
                state["baseline"] = v["reward/episode_return_mean"]
        mean = sum(recent) / len(recent) if recent else math.nan
        state["steps_per_s"].append(v["perf/env_steps_per_s"])
        thr = case["threshold"]
        if thr is not None and state["hit"] is None and len(recent) == window and mean >= thr:
            state["hit"] = (int(v["env_steps"]), time.perf_counter() - started)
        if step % curve_every == 0:
            state["curve"].append((int(v["env_steps"]), mean))
        state["final"] = mean

    with tempfile.TemporaryDirectory() as tmp:
        ctx = WorkerContext("bench", 1, spec, "cpu", Path(tmp), out=_Lines(on_metric))
        run_task(ctx)
    wall = time.perf_counter() - started
    return {
        "name": name,
        "wall_s": wall,
        "total": spec.hyperparameters.num_updates * spec.hyperparameters.batch_size,
        **state,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=sorted(CASES), action="append", help="run only this case (repeatable)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--window", type=int, default=20, help="episodes in the running mean")
    parser.add_argument(
        "--curve-every", type=int, default=0, help="print the curve every N updates (0: 8 points per case)"
    )
    args = parser.parse_args(argv)
    rows = []
    for name in args.only or list(CASES):
        case = CASES[name]
        print(f"== {name}: {json.dumps(case['env'])} {json.dumps(case['hp'])} seed={args.seed}", flush=True)
        r = run_case(name, case, args.seed, args.window, args.curve_every)
        for steps, mean in r["curve"]:
            print(f"   {steps:>8d} env steps   mean return (last {args.window}) {mean:9.2f}", flush=True)
        rows.append(r)
    print()
    print(
        f"{'case':<20} {'random':>9} {'final':>9} {'threshold':>10} {'steps to thr':>13} "
        f"{'time to thr':>12} {'wall s':>8} {'steps/s':>8} {'gain':>7}"
    )
    for r in rows:
        thr = CASES[r["name"]]["threshold"]
        hit_steps, hit_s = r["hit"] if r["hit"] else (None, None)
        sps = r["total"] / r["wall_s"]
        base, final = r["baseline"], r["final"]
        gain = (final - base) / abs(base) if base else math.nan  # improvement relative to random
        print(
            f"{r['name']:<20} {base:9.2f} {final:9.2f} {thr if thr is not None else '-':>10} "
            f"{hit_steps if hit_steps is not None else ('not reached' if thr is not None else '-'):>13} "
            f"{f'{hit_s:.1f} s' if hit_s is not None else '-':>12} {r['wall_s']:8.1f} {sps:8.0f} {gain:+7.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
