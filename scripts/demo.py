#!/usr/bin/env python3
"""`make demo`: the main job on localhost, every byte through our gRPC services.

Starts a scheduler and one trainer node as real processes, submits the arithmetic LoRA GRPO
task on SmolLM2-135M-Instruct with the seed's client API, prints the dashboard's URL and the
task's page there, and the TensorBoard and MLflow runs the worker writes as steps happen (where
this Python has those loggers), shows per-step reward and loss as they stream in, prints the
mean reward of the first and last three steps and the checkpoint path, and stops its processes,
also on Ctrl-C, SIGTERM and SIGHUP (a second one kills them at once). The task asks for 1 GPU
when the node has one and runs on the CPU (gpu_count 0) otherwise.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:
    from opentinker_client import RLClient

ROOT = Path(__file__).resolve().parent.parent


def free_port(preferred: int) -> int:
    for port in (preferred, 0):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise OSError("no free port")


class Interrupted(KeyboardInterrupt):
    """Ctrl-C, SIGTERM or SIGHUP: stop the demo's processes and exit with 128 + the signal."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Signals:
    """Turns the stop signals into :class:`Interrupted`, so ``main``'s ``finally`` stops the
    children (they run in their own sessions, so no signal reaches them but ours).

    Inside :meth:`deferred` a signal is held until the block ends, so a child is never started
    without being recorded. During clean-up (:meth:`cleaning_up`) a further signal only sets
    :attr:`hurry`: the remaining children are then killed without waiting for them.
    """

    def __init__(self) -> None:
        self.pending: int | None = None
        self.depth = 0
        self.hurry = False

    def install(self) -> None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._raise)

    def cleaning_up(self) -> None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._hurry)

    def _raise(self, signum: int, frame: object) -> None:
        if self.depth:
            self.pending = self.pending or signum
            return
        raise Interrupted(signum)

    def _hurry(self, signum: int, frame: object) -> None:
        self.hurry = True

    @contextmanager
    def deferred(self) -> Iterator[None]:
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
            if not self.depth and self.pending is not None:
                signum, self.pending = self.pending, None
                raise Interrupted(signum)


SIGNALS = Signals()


def say(message: str) -> None:
    """Print, ignoring a closed terminal (after SIGHUP): clean-up must go on regardless."""
    try:
        print(message, flush=True)
    except (OSError, ValueError):
        pass


def start(
    name: str, args: list[str], log: Path, env: dict[str, str], procs: list[tuple[str, subprocess.Popen]]
) -> subprocess.Popen:
    """Start ``python ARGS`` in its own session; it is in ``procs`` before a signal can interrupt."""
    with SIGNALS.deferred(), open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **env},
            start_new_session=True,
        )
        procs.append((name, proc))
    return proc


def start_scheduler(
    config: Path, port: int, http_port: int, log: Path, env: dict[str, str], procs: list[tuple[str, subprocess.Popen]]
) -> tuple[subprocess.Popen, dict]:
    """Start the scheduler with ``config`` (a YAML file) on 127.0.0.1, gRPC on ``port`` and HTTP on
    ``http_port``, its output to ``log``, and wait until its ``GET /health`` says ok.

    Returns:
        ``(process, the /health body)``.

    Raises:
        SystemExit: it exited, or was not healthy within 60 s (:func:`wait_health`).
    """
    args = ["-m", "opentinker_scheduler", "--config", str(config), "--host", "127.0.0.1"]
    proc = start("scheduler", [*args, "--port", str(port), "--http-port", str(http_port)], log, env, procs)
    return proc, wait_health(http_port, proc, log)


def start_trainer(
    node_id: str,
    work_dir: Path,
    scheduler_url: str,
    log: Path,
    env: dict[str, str],
    procs: list[tuple[str, subprocess.Popen]],
) -> subprocess.Popen:
    """Start a trainer node ``node_id`` (checkpoints and worker files under ``work_dir``) that connects to
    ``scheduler_url``, its output to ``log``; it does not wait for the node to connect."""
    args = ["-m", "opentinker_trainer", "--node-id", node_id, "--work-dir", str(work_dir)]
    return start("trainer", args, log, {**env, "SCHEDULER_URL": scheduler_url}, procs)


def stop(proc: subprocess.Popen | None, name: str, timeout: float = 20) -> None:
    """SIGTERM the process group, SIGKILL it after ``timeout`` s or at once on another signal."""
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + timeout
    while not SIGNALS.hurry and time.monotonic() < deadline:
        try:
            proc.wait(timeout=0.1)
            return
        except subprocess.TimeoutExpired:
            pass
    say(f"{name} did not stop in {timeout:.0f} s; killing it" if not SIGNALS.hurry else f"killing {name}")
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def wait_health(http_port: int, proc: subprocess.Popen, log: Path, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"scheduler exited early; see {log}:\n{log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/health", timeout=2) as r:
                body = json.loads(r.read())
                if body.get("status") == "ok":
                    return body
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"scheduler not healthy after {timeout:.0f} s; see {log}")


def wait_node(client: RLClient, trainer: subprocess.Popen, log: Path, timeout: float = 60):
    """The first connected node, once the trainer ``trainer`` (writing ``log``) has joined.

    Raises:
        SystemExit: the trainer exited or did not connect within ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while True:
        nodes = [n for n in client.list_nodes() if n.connected]
        if nodes:
            return nodes[0]
        if trainer.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"trainer did not connect; see {log}:\n{log.read_text()[-2000:]}")
        time.sleep(0.2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=ROOT / ".cache/models/SmolLM2-135M-Instruct")
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--port", type=int, default=8888, help="gRPC port (another free one if taken)")
    parser.add_argument("--work-dir", type=Path, default=ROOT / ".cache" / "demo")
    parser.add_argument(
        "--stay",
        action="store_true",
        help="after the task ends, keep the scheduler (and its dashboard) running until Ctrl-C",
    )
    args = parser.parse_args()

    from opentinker_client import Environment, RLClient

    model = args.model.resolve()
    if not (model / "config.json").exists():
        raise SystemExit(f"{model} is not a model folder; run `make install` (scripts/prepare_model.py)")
    run_dir = args.work_dir / time.strftime("%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=True)
    port = free_port(args.port)
    http_port = free_port(port + 1)
    config = run_dir / "scheduler_config.yaml"
    config.write_text(
        "resource_pool:\n"
        "  - node_id: demo-node\n"
        "    gpu_count: 1\n"
        "    max_tasks: 2\n"
        "workload_types:\n"
        "  - type: lora_finetune\n"
        "    priority: 1\n"
        "  - type: full_rl\n"
        "    priority: 2\n"
        f"state_dir: {run_dir / 'state'}\n"
        f"default_model: {model}\n"
        "heartbeat_interval: 2\n"
        "lease: 10\n"
    )
    sched_log, trainer_log = run_dir / "scheduler.log", run_dir / "trainer.log"
    procs: list[tuple[str, subprocess.Popen]] = []  # (name, process) started so far, in order
    client = None
    print(f"OpenTinker demo — logs and checkpoints in {run_dir}", flush=True)
    SIGNALS.install()
    try:
        env = {"OPENTINKER_LOG_FORMAT": "json"}
        _, health = start_scheduler(config, port, http_port, sched_log, env, procs)
        print(
            f"scheduler  grpc localhost:{port}   GET http://localhost:{http_port}/health -> {json.dumps(health)}",
            flush=True,
        )
        print(f"dashboard  http://localhost:{http_port}/  (cluster, queue, tasks, compare)", flush=True)
        scheduler_url = f"http://localhost:{port}"
        trainer = start_trainer("demo-node", run_dir / "runs", scheduler_url, trainer_log, env, procs)

        client = RLClient(scheduler_url=scheduler_url)
        node = wait_node(client, trainer, trainer_log)
        gpu_count = 1 if node.gpu_count >= 1 else 0
        where = f"{node.gpu_count} GPU(s)" if node.gpu_count else "CPU only (" + "; ".join(node.notes) + ")"
        print(f"trainer    {node.node_id}: {where}", flush=True)

        # The seed's client API, as written in the deployment guide.
        env_spec = Environment(action_space=4, observation_space=100, env_id="arithmetic", min_digits=1, max_digits=1)
        # Live experiment tracking where this Python has the loggers (make install's dev extra does).
        tracking: dict = {}
        if importlib.util.find_spec("tensorboardX"):
            tracking["tensorboard"] = str(run_dir / "tensorboard")
        if importlib.util.find_spec("mlflow"):
            tracking["mlflow"] = {"uri": f"file://{run_dir / 'mlruns'}", "experiment": "demo"}
        task_id = client.submit_task(
            env_config=env_spec.to_dict(),
            workload_type="lora_finetune",
            gpu_count=gpu_count,
            name="demo-arithmetic-lora",
            hyperparameters={"steps": args.steps},
            tracking=tracking or None,
        )
        print(
            f"submitted  {task_id}: LoRA GRPO on {model.name}, arithmetic "
            f"(a + b, one digit), {args.steps} steps, gpu_count={gpu_count}",
            flush=True,
        )
        print(f"live       http://localhost:{http_port}/ui/task/{task_id}  (curves update as steps arrive)")
        # Written by the worker as steps happen: open them while the task runs.
        if "tensorboard" in tracking:
            print(f"tensorboard: tensorboard --logdir {tracking['tensorboard']}")
        if "mlflow" in tracking:
            print(
                f"mlflow:      MLFLOW_ALLOW_FILE_STORE=true mlflow ui --backend-store-uri {tracking['mlflow']['uri']}"
            )
        print(flush=True)
        print(
            f"{'step':>4}  {'reward':>6}  {'±std':>5}  {'loss':>8}  "
            f"{'grad norm':>9}  {'zero-std':>8}  {'tok/s':>6}  {'step s':>6}"
        )
        rewards: dict[int, float] = {}
        checkpoint = ""
        for ev in client.watch(task_id):
            if ev.kind == "state":
                print(f"  [{ev.to_state.upper()}] {ev.message}")
            elif ev.kind == "metric":
                m = ev.metrics
                rewards[ev.step] = m.get("reward", math.nan)
                print(
                    f"{ev.step:>4}  {m.get('reward', math.nan):>6.3f}  {m.get('reward_std', math.nan):>5.2f}  "
                    f"{m.get('loss', math.nan):>8.4f}  {m.get('optim/grad_norm', math.nan):>9.4f} "
                    f" {m.get('zero_std_frac', math.nan):>8.2f}  "
                    f"{m.get('perf/tokens_per_s', math.nan):>6.0f}  {m.get('perf/step_s', math.nan):>6.1f}"
                )
            elif ev.kind == "checkpoint":
                checkpoint = ev.checkpoint_path
        task = client.get_task(task_id)
        print()
        steps = sorted(rewards)
        if len(steps) >= 6:
            first = sum(rewards[s] for s in steps[:3]) / 3
            last = sum(rewards[s] for s in steps[-3:]) / 3
            print(f"mean reward, first 3 steps: {first:.3f}")
            print(f"mean reward, last 3 steps:  {last:.3f}   ({'+' if last >= first else ''}{last - first:.3f})")
        print(f"final state: {task.state.upper()}" + (f" — {task.error}" if task.error else ""))
        print(f"checkpoint (PEFT LoRA adapter): {checkpoint or task.checkpoint_path or 'none'}")
        started = [json.loads(line) for line in trainer_log.read_text().splitlines() if '"Task started"' in line]
        if started:
            s = started[0]
            print(
                f'trainer log: "Task started" task_id={s.get("task_id")} attempt={s.get("attempt")} pid={s.get("pid")}'
            )
        if args.stay:
            print(f"\ndashboard stays up at http://localhost:{http_port}/ui/task/{task_id}; Ctrl-C to stop", flush=True)
            while True:
                time.sleep(3600)
        return 0 if task.state == "succeeded" else 1
    except KeyboardInterrupt as exc:  # Ctrl-C, SIGTERM, SIGHUP
        SIGNALS.cleaning_up()
        signum = exc.signum if isinstance(exc, Interrupted) else signal.SIGINT
        say(f"\n{signal.Signals(signum).name}: stopping the demo's processes (again to kill them at once)")
        return 128 + signum
    finally:
        SIGNALS.cleaning_up()
        if client is not None:
            try:
                client.close()
            except Exception:  # noqa: BLE001 - the processes must be stopped regardless
                pass
        for name, proc in reversed(procs):  # the trainer first, then the scheduler
            stop(proc, name)


if __name__ == "__main__":
    sys.exit(main())
