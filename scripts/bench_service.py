#!/usr/bin/env python3
"""What the service costs: one ``lora_finetune`` GRPO workload through scheduler and trainer
against the same workload called in-process, in one run, interleaved (these machines are noisy).

Both runs use the same model (SmolLM2-135M-Instruct), hyper-parameters, batch and seed, on the
CPU. Step time is the interval between consecutive training steps as observed by the caller:
for the in-process run, between the workload's metric reports; through the service, between the
metric events ``RLClient.watch`` delivers (worker -> agent -> NodeService stream -> scheduler ->
SQLite -> WatchTask stream). The first step is left out (warm-up). Also printed: the fixed cost
of a task (submit to first metric, against call to first metric in-process: scheduling, worker
process start, model load).

Each side runs in its own session: the in-process run is this script started again with
``--in-process-once``, and the scheduler and trainer are started as ``make demo`` starts them.
This kernel shares CPU per session, so an in-process run sharing the bench's session would get
a smaller share than the service's worker. The order alternates by round: in-process first in
odd rounds, the service first in even ones.

    .venv/bin/python scripts/bench_service.py               # 2 rounds x 5 steps
    .venv/bin/python scripts/bench_service.py --rounds 3 --steps 6
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import demo  # noqa: E402  (process launching helpers of `make demo`)
from bench_result import write_result  # noqa: E402  (scripts/bench_result.py)

HP = {"prompts_per_step": 4, "group_size": 8, "max_new_tokens": 10, "seed": 0, "checkpoint_every": 0}


class _Clock(io.TextIOBase):
    """The in-process worker's report stream: notes when each metric line arrives."""

    def __init__(self) -> None:
        self.metric_times: list[float] = []

    def write(self, s: str) -> int:
        for line in s.splitlines():
            if line.strip() and json.loads(line)["type"] == "metric":
                self.metric_times.append(time.perf_counter())
        return len(s)


def run_in_process(model: Path, steps: int) -> tuple[float, list[float]]:
    """(call -> first metric seconds, step intervals in seconds)."""
    from opentinker_common.spec import TaskSpecModel
    from opentinker_trainer.context import WorkerContext
    from opentinker_trainer.workloads import grpo_text

    spec = TaskSpecModel.from_parts(
        workload_type="lora_finetune",
        model=str(model),
        env_config={"env_id": "arithmetic"},
        hyperparameters={**HP, "steps": steps},
    )
    clock = _Clock()
    with tempfile.TemporaryDirectory() as tmp:
        ctx = WorkerContext(
            task_id="bench-inproc", attempt=1, spec=spec, device="cpu", checkpoint_dir=Path(tmp), out=clock
        )
        t0 = time.perf_counter()
        grpo_text.run(ctx)
    times = clock.metric_times
    return times[0] - t0, [b - a for a, b in zip(times[1:], times[2:])] if len(times) > 2 else []


def run_in_process_session(model: Path, steps: int, sessions: list[int]) -> tuple[float, list[float]]:
    """:func:`run_in_process` in a process of its own session; appends that session's id to ``sessions``."""
    argv = [sys.executable, str(Path(__file__).resolve()), "--model", str(model), "--steps", str(steps)]
    proc = subprocess.run(
        [*argv, "--in-process-once"], capture_output=True, text=True, check=False, start_new_session=True
    )
    if proc.returncode != 0:
        raise SystemExit(f"in-process run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    sessions.append(out["session"])
    return out["first"], out["steps"]


def run_service(client, model: Path, steps: int) -> tuple[float, list[float]]:
    t0 = time.perf_counter()
    task_id = client.submit_task(
        workload_type="lora_finetune",
        model=str(model),
        env_config={"env_id": "arithmetic"},
        gpu_count=0,
        hyperparameters={**HP, "steps": steps},
    )
    times = []
    for ev in client.watch(task_id):
        if ev.kind == "metric":
            times.append(time.perf_counter())
    task = client.get_task(task_id)
    if task.state != "succeeded":
        raise SystemExit(f"service run ended {task.state}: {task.error}")
    return times[0] - t0, [b - a for a, b in zip(times[1:], times[2:])] if len(times) > 2 else []


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=ROOT / ".cache/models/SmolLM2-135M-Instruct")
    parser.add_argument("--steps", type=int, default=5, help="steps per run (the first is warm-up)")
    parser.add_argument("--rounds", type=int, default=2, help="in-process/service pairs, interleaved")
    parser.add_argument("--in-process-once", action="store_true", help=argparse.SUPPRESS)  # one run, as JSON
    args = parser.parse_args()
    if args.steps < 3:
        parser.error("--steps must be at least 3")
    model = args.model.resolve()
    if not (model / "config.json").exists():
        raise SystemExit(f"{model} is not a model folder; run `make install`")
    if args.in_process_once:
        first, steps = run_in_process(model, args.steps)
        print(json.dumps({"first": first, "steps": steps, "session": os.getsid(0)}))
        return 0

    from opentinker_client import RLClient

    work = Path(tempfile.mkdtemp(prefix="bench-service-"))
    port = demo.free_port(0)
    http_port = demo.free_port(0)
    config = work / "scheduler_config.yaml"
    config.write_text(
        "resource_pool:\n  - node_id: bench-node\n    gpu_count: 0\n    max_tasks: 1\n"
        "workload_types:\n  - type: lora_finetune\n    priority: 1\n"
        f"state_dir: {work / 'state'}\n"
    )
    procs: list = []
    demo.SIGNALS.install()
    client = None
    try:
        env = {"OPENTINKER_LOG_FORMAT": "json"}
        demo.start_scheduler(config, port, http_port, work / "scheduler.log", env, procs)
        url = f"127.0.0.1:{port}"
        trainer = demo.start_trainer("bench-node", work / "runs", url, work / "trainer.log", env, procs)
        client = RLClient(scheduler_url=url, min_poll_interval=0)
        demo.wait_node(client, trainer, work / "trainer.log")

        inproc_steps: list[float] = []
        service_steps: list[float] = []
        inproc_first: list[float] = []
        service_first: list[float] = []
        sessions: list[int] = []  # of the in-process runs
        for r in range(args.rounds):
            for side in ("in-process", "service") if r % 2 == 0 else ("service", "in-process"):
                if side == "in-process":
                    f, s = run_in_process_session(model, args.steps, sessions)
                    inproc_first.append(f)
                    inproc_steps += s
                else:
                    f, s = run_service(client, model, args.steps)
                    service_first.append(f)
                    service_steps += s
                print(
                    f"round {r + 1} {side + ':':<11} first metric after {f:.1f} s; "
                    f"steps {', '.join(f'{x:.2f}' for x in s)} s",
                    flush=True,
                )

        mi, ms = statistics.median(inproc_steps), statistics.median(service_steps)
        print()
        print(f"step time, median of {len(inproc_steps)}: in-process {mi:.3f} s, through the service {ms:.3f} s")
        print(
            f"ratio service / in-process: {ms / mi:.3f}  (service "
            f"adds {100 * (ms / mi - 1):+.1f} % per step; goal < 5 %)"
        )
        fi, fs = statistics.median(inproc_first), statistics.median(service_first)
        print(
            f"fixed cost to the first step, median: in-process {fi:.1f} s, service {fs:.1f} "
            f"s (+{fs - fi:.1f} s: placement, worker start, model load in a fresh process)"
        )
        write_result(
            "service-grpo-step",
            what="GRPO step time through scheduler and trainer (SmolLM2-135M, CPU)",
            peer="the same workload called in-process, same seed and batch, in its own session",
            ratios=[{"label": "median step time, service / in-process (lower is better)", "value": round(ms / mi, 3)}],
            goal="< 1.05x",
            settings={**HP, "steps": args.steps, "rounds": args.rounds},
            make="make bench-service",
            details={
                "in_process_step_s": round(mi, 3),
                "service_step_s": round(ms, 3),
                "first_metric_s_in_process_service": [round(fi, 1), round(fs, 1)],
                "sessions": {"bench": os.getsid(0), "in_process": sessions},
            },
        )
        return 0
    finally:
        demo.SIGNALS.cleaning_up()
        if client is not None:
            client.close()
        for name, proc in reversed(procs):
            demo.stop(proc, name)


if __name__ == "__main__":
    sys.exit(main())
