#!/usr/bin/env python3
"""Cost of writing your own loop: training primitives (``TrainingService``) vs the built-in GRPO.

In one process, on the same model, the same batch shape (``--prompts`` problems x ``--group``
samples, ``--max-tokens`` new tokens, temperature 1, LoRA r=16 on q/k/v/o) and seed:

* **built-in GRPO**: the ``lora_finetune`` trainer (``workloads/grpo_text.py``) run in-process as
  a worker runs it; per-step seconds from its ``perf/step_s`` metric;
* **client-side GRPO**: ``examples/own_loop_rl.py``'s ``train`` against a ``lora_session`` server
  (the real servicer, grpc.aio on loopback, the real client with futures); per-step wall seconds
  as the client sees them (sample + reward + forward_backward + optim_step);
* **empty ForwardBackward round trip**: a one-token datum through gRPC (median of ``--calls``),
  against the same call on the session directly (no gRPC) and an empty ``GetInfo`` round trip.

The first step of each loop is left out (warm-up). Prints the figures and the ratio
client-side / built-in (goal <= 1.15). Also prints the mean reward of the first and last 3 steps
of each loop (``--steps`` >= 6 for that to mean anything).

    .venv/bin/python scripts/bench_primitives.py                       # SmolLM2-135M-Instruct
    .venv/bin/python scripts/bench_primitives.py --model /path/tiny --steps 2 --calls 5   # smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import io
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
DEFAULT_MODEL = ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct"


def _ctx(workload: str, model: str, hp: dict, folder: Path, env: dict | None = None):
    from opentinker_common.spec import TaskSpecModel
    from opentinker_trainer.context import WorkerContext

    spec = TaskSpecModel.from_parts(workload_type=workload, model=model, env_config=env or {}, hyperparameters=hp)
    return WorkerContext(
        task_id=f"bench-{workload}", attempt=1, spec=spec, device="cpu", checkpoint_dir=folder, out=io.StringIO()
    )


def builtin_grpo(args, folder: Path) -> tuple[list[float], list[float]]:
    from opentinker_trainer.workloads import grpo_text

    hp = {
        "steps": args.steps,
        "prompts_per_step": args.prompts,
        "group_size": args.group,
        "max_new_tokens": args.max_tokens,
        "temperature": 1.0,
        "learning_rate": args.lr,
        "lora_rank": 16,
        "seed": args.seed,
        "checkpoint_every": 0,
    }
    ctx = _ctx("lora_finetune", args.model, hp, folder / "builtin", env={"env_id": "arithmetic"})
    grpo_text.run(ctx)
    lines = [json.loads(x) for x in ctx.out.getvalue().splitlines() if x.strip()]
    metrics = [x["values"] for x in lines if x["type"] == "metric"]
    return [m["perf/step_s"] for m in metrics], [m["reward"] for m in metrics]


class Served:
    def __init__(self, session) -> None:
        from opentinker_trainer.training.sequencing import Sequencer
        from opentinker_trainer.training.server import TrainingServicer, start_training_server

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        servicer = TrainingServicer(session, sequencer=Sequencer(0))
        self.running = asyncio.run_coroutine_threadsafe(
            start_training_server(servicer, host="127.0.0.1"), self.loop
        ).result(60)
        self.address = f"127.0.0.1:{self.running.port}"

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.running.stop(0), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def client_side(args, folder: Path):
    from opentinker_client.training import Datum, TrainingSession
    from opentinker_trainer.workloads.lora_session import open_session

    spec = importlib.util.spec_from_file_location("own_loop_rl", ROOT / "examples" / "own_loop_rl.py")
    own_loop = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(own_loop)
    hp = {"lora_rank": 16, "lora_alpha": 32.0, "seed": args.seed}
    session, _ = open_session(_ctx("lora_session", args.model, hp, folder / "session"))
    served = Served(session)
    try:
        client = TrainingSession(served.address, api_key="")
        stamps = [time.perf_counter()]

        def log(line: str) -> None:
            stamps.append(time.perf_counter())
            print("  client-side", line, flush=True)

        rewards = own_loop.train(
            client,
            steps=args.steps,
            problems_per_step=args.prompts,
            group_size=args.group,
            max_tokens=args.max_tokens,
            learning_rate=args.lr,
            seed=args.seed,
            log=log,
        )
        step_s = [b - a for a, b in zip(stamps, stamps[1:])]
        one = Datum([5], [6], advantages=[0.0], sampling_logprobs=[0.0])
        rtt, info, direct = [], [], []
        for _ in range(args.calls):
            t = time.perf_counter()
            client.forward_backward([one], "importance_sampling").result()
            rtt.append(time.perf_counter() - t)
            t = time.perf_counter()
            client.get_info()
            info.append(time.perf_counter() - t)
        from opentinker_trainer.training.datums import Datum as ServerDatum

        for _ in range(args.calls):
            t = time.perf_counter()
            session.forward_backward([ServerDatum([5], [6], (), [0.0], [0.0])], "importance_sampling")
            direct.append(time.perf_counter() - t)
        client.close()
    finally:
        served.close()
    return step_s, rewards, rtt, info, direct


def _mean(xs):
    return statistics.fmean(xs) if xs else float("nan")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(DEFAULT_MODEL))
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=10)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--calls", type=int, default=30)
    args = p.parse_args()
    if not Path(args.model).exists():
        print(f"{args.model} does not exist (make install prepares SmolLM2-135M-Instruct)", file=sys.stderr)
        return 2
    import torch

    print(
        f"model {args.model}; {args.prompts} x {args.group} samples, {args.max_tokens} tokens, "
        f"{args.steps} steps, torch threads {torch.get_num_threads()}",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="bench-primitives-") as tmp:
        folder = Path(tmp)
        b_steps, b_rewards = builtin_grpo(args, folder)
        print("built-in step_s", [round(x, 2) for x in b_steps], flush=True)
        c_steps, c_rewards, rtt, info, direct = client_side(args, folder)
    b, c = _mean(b_steps[1:]), _mean(c_steps[1:])
    print(f"per step (first left out): built-in GRPO {b:.2f} s, client-side GRPO {c:.2f} s, ratio {c / b:.2f}x")
    print(
        f"reward first-3 / last-3: built-in {_mean(b_rewards[:3]):.3f} / {_mean(b_rewards[-3:]):.3f}; "
        f"client-side {_mean(c_rewards[:3]):.3f} / {_mean(c_rewards[-3:]):.3f}"
    )
    print(
        f"one-token ForwardBackward: gRPC round trip p50 {statistics.median(rtt) * 1e3:.1f} ms, "
        f"in-process {statistics.median(direct) * 1e3:.1f} ms, empty GetInfo round trip "
        f"{statistics.median(info) * 1e3:.1f} ms ({args.calls} calls each)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
