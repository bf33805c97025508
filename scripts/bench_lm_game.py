#!/usr/bin/env python3
"""Learning curve of an LM playing FrozenLake (``lora_finetune`` on a ``gym``-kind environment).

Runs the real trainer code in this process (the same ``run(ctx)`` a worker calls) on
SmolLM2-135M-Instruct with a LoRA adapter, FrozenLake-v1 4x4 with ``is_slippery: false``, and
prints one line per GRPO step: mean episode return (``reward``), success rate (episodes that
reached G), invalid-reply fraction, turns per episode and seconds per step. At the end it prints
the mean of the first and last ``--window`` steps and their difference (a ratio within the run,
no absolute timing claims).

    .venv/bin/python scripts/bench_lm_game.py                  # defaults used in docs/environments.md
    .venv/bin/python scripts/bench_lm_game.py --steps 5 --episodes 4 --max-turns 6
    .venv/bin/python scripts/bench_lm_game.py --client         # the same game as a client-hosted env

With ``--client`` the environment is a FrozenLake wrapped in an ``Environment`` subclass served
from this process by ``EnvironmentServer``; the trainer reaches it over gRPC on loopback. It is
rendered generically (``Observation: 5``, actions by name) and not shaped.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
DEFAULT_MODEL = ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct"


class _Printer:
    """A WorkerContext ``out`` that prints each metric report as a table row."""

    def __init__(self) -> None:
        self.rows: list[dict] = []
        print(
            f"{'step':>4} {'reward':>7} {'success':>7} {'invalid':>7} "
            f"{'turns':>5} {'step_s':>6} {'gen_s':>6} {'train_s':>7}",
            flush=True,
        )

    def write(self, line: str) -> None:
        for part in line.splitlines():
            if not part.strip():
                continue
            r = json.loads(part)
            if r["type"] != "metric":
                continue
            v = r["values"]
            self.rows.append({"step": r["step"], **v})
            print(
                f"{r['step']:>4} {v['reward']:>7.3f} {v['episode/success_rate']:>7.3f} "
                f"{v['episode/invalid_action_frac']:>7.3f} {v['episode/turns']:>5.2f} {v['perf/step_s']:>6.1f} "
                f"{v['perf/generate_s']:>6.1f} {v['perf/train_s']:>7.1f}",
                flush=True,
            )

    def flush(self) -> None:
        pass


def _client_frozen_lake():
    import gymnasium

    from opentinker_client import Environment

    class FrozenLake(Environment):
        """FrozenLake-v1 (4x4, not slippery) hosted by the client; observation = square index."""

        def __init__(self) -> None:
            super().__init__(action_space=4, observation_space=16, action_names=["left", "down", "right", "up"])
            self.env = gymnasium.make("FrozenLake-v1", is_slippery=False)

        def reset(self, seed=None):
            return self.env.reset(seed=seed)

        def step(self, action):
            return self.env.step(action)

    return FrozenLake()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(DEFAULT_MODEL))
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--episodes", type=int, default=8, help="episodes per step (one GRPO group)")
    p.add_argument("--max-turns", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument(
        "--shaping",
        default=None,
        choices=("none", "distance"),
        help="default: distance; none with --client (a client env has no known grid)",
    )
    p.add_argument("--invalid-reward", type=float, default=-0.1)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--window", type=int, default=3, help="steps averaged at the start and the end")
    p.add_argument("--client", action="store_true", help="play a client-hosted FrozenLake over EnvironmentService")
    args = p.parse_args(argv)
    if args.shaping is None:
        args.shaping = "none" if args.client else "distance"

    from opentinker_common.logs import configure_logging

    configure_logging()
    import logging

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))

    from opentinker_common.spec import TaskSpecModel
    from opentinker_trainer.context import WorkerContext
    from opentinker_trainer.workloads import run_task

    hp = {
        "steps": args.steps, "episodes_per_step": args.episodes, "max_turns": args.max_turns,
        "max_new_tokens": args.max_new_tokens, "learning_rate": args.lr, "reward_shaping": args.shaping,
        "invalid_action_reward": args.invalid_reward, "temperature": args.temperature, "seed": args.seed,
        "lora_rank": 16, "micro_batch_size": 16,
    }  # fmt: skip
    server = None
    if args.client:
        from opentinker_client.hosting.server import EnvironmentServer

        server = EnvironmentServer(_client_frozen_lake()).start()
        env_config = server.env_config
    else:
        env_config = {"env_id": "FrozenLake-v1", "env_kwargs": {"is_slippery": False}}
    spec = TaskSpecModel.from_parts(
        workload_type="lora_finetune", model=args.model, env_config=env_config, hyperparameters=hp
    )
    print(
        f"model={args.model}\n"
        f"env={json.dumps({k: ('<redacted>' if k == 'token' else v) for k, v in env_config.items()})}\n"
        f"hyperparameters={json.dumps(hp)}",
        flush=True,
    )
    printer = _Printer()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        ctx = WorkerContext(task_id="bench", attempt=1, spec=spec, device="cpu", checkpoint_dir=Path(tmp), out=printer)  # type: ignore[arg-type]
        try:
            run_task(ctx)
        finally:
            if server is not None:
                server.stop()
    wall = time.perf_counter() - t0
    rows = printer.rows
    w = max(1, min(args.window, len(rows) // 2))

    def mean(key: str, part: list[dict]) -> float:
        return sum(r[key] for r in part) / len(part)

    first, last = rows[:w], rows[-w:]
    for key, label in (
        ("reward", "reward"),
        ("episode/success_rate", "success"),
        ("episode/invalid_action_frac", "invalid"),
    ):
        a, b = mean(key, first), mean(key, last)
        print(f"{label}: first {w} steps {a:.3f} -> last {w} steps {b:.3f} (change {b - a:+.3f})")
    print(f"wall time {wall:.0f} s for {len(rows)} steps ({wall / max(1, len(rows)):.1f} s/step)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
