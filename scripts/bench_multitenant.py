#!/usr/bin/env python3
"""N LoRA GRPO tasks on one model host vs one worker process each, on a real model (CPU).

Runs the trainer's own processes with no scheduler (checkpoints by path): a model host
(``python -m opentinker_trainer.host``) fed N task attempts over its stdin, against its real
peer, N worker processes (``python -m opentinker_trainer.worker``) started together, as a node
agent runs them without a host. Every process gets the node agent's CPU settings
(:func:`opentinker_trainer.process_env.process_env`, for a node running N tasks): the host a
torch intra-op thread per core, each worker its share of the cores (one each for N at least the
core count), and OpenMP's passive wait policy. Each process runs in its own session, as the agent
starts them: this kernel shares CPU per session, so on a loaded machine N workers get N shares
and the host one. The tasks are the same
LoRA GRPO arithmetic task with different seeds; the host batches its tenants' rollouts (one
forward per token for every waiting tenant's rows). Measured for the largest N in
``--tenants`` in ``--pairs`` pairs of runs in alternating order (host first, then workers first,
...), figures the median over the pairs; other N once each:

* **aggregate steps/s** while all N tasks train (:func:`steady_rate`: the steps ending between
  the last task's first step and the first task's last step, over that time); goal host >= 1.5x
  the N processes at N = 8;
* **memory**: the peak over the run of the summed resident set size (RSS, ``/proc/PID/status``
  sampled every 0.2 s) of the host, or of the N workers; goal host <= 0.2x at N = 8;
* **CPU seconds per step** over the same window (:func:`cpu_per_step`; user + system time from
  ``/proc``), which other jobs on a shared machine change much less than wall time;
* **time to first step**: from handing an attempt over to its first metric (and to the start of
  that step: less its own ``perf/step_s``), joining a warm host (base model loaded, its N tenants
  done) vs the first of N cold worker processes (start, imports, model load).

Usage::

    .venv/bin/python scripts/bench_multitenant.py                      # SmolLM2-135M-Instruct, 8 tasks
    .venv/bin/python scripts/bench_multitenant.py --model /tmp/tiny --tenants 2 --steps 3 --pairs 1   # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "protos"))
sys.path.insert(0, str(ROOT / "scripts"))
DEFAULT_MODEL = ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct"

from bench_result import write_result  # noqa: E402  (scripts/bench_result.py)


def assignment(folder: Path, task_id: str, model: str, hp: dict) -> Path:
    from opentinker.common.v1 import common_pb2
    from opentinker.node.v1 import node_pb2

    spec = common_pb2.TaskSpec(workload_type="lora_finetune", model=model)
    spec.env_config.update({"env_id": "arithmetic"})
    spec.hyperparameters.update(hp)
    path = folder / f"{task_id}.pb"
    path.write_bytes(node_pb2.AssignTask(task_id=task_id, attempt=1, spec=spec).SerializeToString())
    return path


def child_env(role: str, max_tasks: int) -> dict[str, str]:
    """The environment of a ``role`` process (``host`` or ``worker``) on a node running
    ``max_tasks`` tasks: the node agent's CPU settings (:func:`opentinker_trainer.process_env.process_env`)."""
    from opentinker_trainer.process_env import process_env

    env = {k: v for k, v in os.environ.items() if not k.startswith("OPENTINKER_")}
    env = process_env(env, role=role, max_tasks=max_tasks)
    env.update(PYTHONPATH=f"{ROOT}:{ROOT / 'protos'}", OPENTINKER_LOG_FORMAT="json")
    return env


def rss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds process ``pid`` has used (``/proc/PID/stat`` fields 14 and 15)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


class Peak:
    """The peak of the summed RSS of ``pids()``, sampled every 0.2 s until stopped."""

    def __init__(self, pids) -> None:
        self.pids, self.peak, self._stop = pids, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, sum(rss_bytes(p) for p in self.pids()))
            time.sleep(0.2)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


class Lines:
    """JSON report lines of one process's stdout, read in a thread, with arrival times."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc, self.lines, self.cond = proc, [], threading.Condition()
        #: The process's CPU seconds (user + system, :func:`cpu_seconds`) as each line arrived.
        self.cpu: dict[int, float] = {}
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for raw in self.proc.stdout:
            try:
                msg = json.loads(raw)
            except ValueError:
                continue
            cpu = cpu_seconds(self.proc.pid)
            with self.cond:
                self.lines.append((time.perf_counter(), msg))
                self.cpu[id(msg)] = cpu
                self.cond.notify_all()
        with self.cond:
            self.lines.append((time.perf_counter(), {"type": "eof"}))
            self.cond.notify_all()

    def wait(self, pred, timeout: float = 1800) -> tuple[float, dict]:
        deadline = time.monotonic() + timeout
        with self.cond:
            seen = 0
            while True:
                for t, msg in self.lines[seen:]:
                    if pred(msg):
                        return t, msg
                    if msg["type"] == "eof":
                        raise RuntimeError(f"process {self.proc.pid} ended: no line matched")
                seen = len(self.lines)
                if not self.cond.wait(timeout=max(0.0, deadline - time.monotonic())):
                    raise TimeoutError("no matching line")


def steady_rate(times_by_task: list[list[float]]) -> float:
    """Aggregate steps/s while every task trains: the steps that end after the last task's first
    step and no later than the first task's last step, over that window's length (the first
    step, warm-up, and the ragged end, when some tasks are done, are left out)."""
    start = max(t[0] for t in times_by_task)
    end = min(t[-1] for t in times_by_task)
    steps = sum(1 for times in times_by_task for t in times if start < t <= end)
    return steps / (end - start) if end > start else float("nan")


def metric_times(lines: list[tuple[float, dict]], task_id: str | None = None) -> list[float]:
    return [t for t, m in lines if m["type"] == "metric" and (task_id is None or m.get("task_id") == task_id)]


def cpu_per_step(readers: list["Lines"], window: tuple[float, float]) -> float:
    """CPU seconds per step over ``window`` (:func:`steady_rate`'s): for each process, the CPU
    time it used between its first and last metric line in the window over the steps ending
    after that first line; summed over the processes (the host is one, the workers N)."""
    used = steps = 0.0
    for r in readers:
        inside = [(t, m) for t, m in r.lines if m["type"] == "metric" and window[0] <= t <= window[1]]
        if len(inside) < 2:
            continue
        used += r.cpu[id(inside[-1][1])] - r.cpu[id(inside[0][1])]
        steps += len(inside) - 1
    return used / steps if steps else float("nan")


def window(times_by_task: list[list[float]]) -> tuple[float, float]:
    """:func:`steady_rate`'s window: the last task's first step to the first task's last step."""
    return max(t[0] for t in times_by_task), min(t[-1] for t in times_by_task)


def start_host(model: str, out_dir: Path, max_tasks: int) -> tuple[subprocess.Popen, Lines, float]:
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "opentinker_trainer.host", "--model", model, "--device", "cpu"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=open(out_dir / f"host-{t0:.0f}.log", "w"),
        text=True,
        env=child_env("host", max_tasks),
        cwd=ROOT,
        start_new_session=True,
    )
    lines = Lines(proc)
    lines.wait(lambda m: m["type"] in ("host_ready", "host_failed"))
    return proc, lines, time.perf_counter() - t0


def add(proc: subprocess.Popen, path: Path, ckpt: Path) -> None:
    proc.stdin.write(json.dumps({"op": "add", "assignment": str(path), "checkpoint_dir": str(ckpt)}) + "\n")
    proc.stdin.flush()


def run_host(model: str, n: int, hp: dict, work: Path, run: str) -> dict:
    """N tenants on one host, all at once; then one more joins the warm host."""
    proc, lines, load_s = start_host(model, work, n)
    session = os.getsid(proc.pid)
    peak = Peak(lambda: [proc.pid])
    ids = [f"h{n}{run}-{i}" for i in range(n)]
    for i, tid in enumerate(ids):
        add(proc, assignment(work, tid, model, {**hp, "seed": 100 + i}), work / "ck" / tid)
    for tid in ids:
        lines.wait(lambda m, tid=tid: m["type"] == "released" and m["task_id"] == tid)
    for tid in ids:
        assert any(m["type"] == "succeeded" and m.get("task_id") == tid for _, m in lines.lines), tid
    times = [metric_times(lines.lines, tid) for tid in ids]
    result = {
        "rss": peak.stop(),
        "rate": steady_rate(times),
        "cpu_per_step": cpu_per_step([lines], window(times)),
        "load_s": load_s,
        "session": session,
    }
    # Warm join: one more tenant on this host, whose base model is loaded already.
    t0 = time.perf_counter()
    tid = f"warm-{n}{run}"
    add(proc, assignment(work, tid, model, {**hp, "seed": 99}), work / "ck" / tid)
    t1, first = lines.wait(lambda m: m["type"] == "metric" and m.get("task_id") == tid)
    result["warm_first_step_s"] = t1 - t0
    result["warm_to_step_start_s"] = t1 - t0 - first["values"]["perf/step_s"]
    lines.wait(lambda m: m["type"] == "released" and m.get("task_id") == tid)
    proc.stdin.close()
    proc.wait(timeout=120)
    return result


def run_workers(model: str, n: int, hp: dict, work: Path, run: str) -> dict:
    procs, readers, starts = [], [], []
    for i in range(n):
        tid = f"w{n}{run}-{i}"
        path = assignment(work, tid, model, {**hp, "seed": 100 + i})
        starts.append(time.perf_counter())
        p = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "opentinker_trainer.worker",
                str(path),
                "--checkpoint-dir",
                str(work / "ck" / tid),
                "--device",
                "cpu",
            ],
            stdout=subprocess.PIPE,
            stderr=open(work / f"{tid}.log", "w"),
            text=True,
            env=child_env("worker", n),
            cwd=ROOT,
            start_new_session=True,
        )
        procs.append(p)
        readers.append(Lines(p))
    sessions = [os.getsid(p.pid) for p in procs]
    peak = Peak(lambda: [p.pid for p in procs if p.poll() is None])
    firsts = [r.wait(lambda m: m["type"] == "metric") for r in readers]
    to_start = [t - s - m["values"]["perf/step_s"] for (t, m), s in zip(firsts, starts)]
    firsts = [t - s for (t, _), s in zip(firsts, starts)]
    for p in procs:
        p.wait(timeout=1800)
    rss = peak.stop()
    for r in readers:
        r.wait(lambda m: m["type"] == "eof")
        assert any(m["type"] == "succeeded" for _, m in r.lines), [m for _, m in r.lines][-3:]
    times = [metric_times(r.lines) for r in readers]
    return {
        "rss": rss,
        "rate": steady_rate(times),
        "cpu_per_step": cpu_per_step(readers, window(times)),
        "cold_first_step_s": min(firsts),
        "cold_to_step_start_s": min(to_start),
        "sessions": sessions,
    }


def _brief(result: dict) -> str:
    return ", ".join(
        f"{k} {v / 2**20:.0f} MiB" if k == "rss" else f"{k} {v:.3f}"
        for k, v in result.items()
        if isinstance(v, float | int) and k != "session"
    )


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--tenants", default="8", help="comma-separated task counts (default %(default)s)")
    ap.add_argument("--steps", type=int, default=6, help="GRPO steps per task, at least 3 (default %(default)s)")
    ap.add_argument("--max-new-tokens", type=int, default=4)
    ap.add_argument("--prompts-per-step", type=int, default=1)
    ap.add_argument("--group-size", type=int, default=2)
    ap.add_argument(
        "--pairs",
        type=int,
        default=2,
        help="host / workers runs at the largest count, in turn (default %(default)s)",
    )
    args = ap.parse_args()
    counts = sorted(int(x) for x in args.tenants.split(","))
    hp = {
        "steps": args.steps,
        "prompts_per_step": args.prompts_per_step,
        "group_size": args.group_size,
        "max_new_tokens": args.max_new_tokens,
        "lora_rank": 8,
        "checkpoint_every": 0,
    }
    top = counts[-1]
    mib = 1024 * 1024
    host: dict[int, list[dict]] = {n: [] for n in counts}
    workers: dict[int, list[dict]] = {n: [] for n in counts}
    with tempfile.TemporaryDirectory(prefix="bench-multitenant-") as tmp:
        work = Path(tmp)
        threads = {role: child_env(role, top)["OMP_NUM_THREADS"] for role in ("host", "worker")}
        print(f"model {args.model}; tasks: LoRA GRPO arithmetic, {hp}; intra-op threads {threads}", flush=True)
        for n in counts:  # each phase's figures as it ends, so a run cut short still says something
            for r in range(args.pairs if n == top else 1):
                for side in ("host", "workers") if r % 2 == 0 else ("workers", "host"):
                    if side == "host":
                        host[n].append(run_host(args.model, n, hp, work, f"r{r}"))
                    else:
                        workers[n].append(run_workers(args.model, n, hp, work, f"r{r}"))
                    got = (host if side == "host" else workers)[n][-1]
                    print(f"{side}, {n} tasks, run {r}: {_brief(got)}  load average {_load()}", flush=True)
    print("\n| tasks | host steps/s | workers steps/s | ratio | host RSS MiB | workers RSS MiB | ratio |")
    print("|---|---|---|---|---|---|---|")
    figures = {}
    for n in counts:
        speed = statistics.median(h["rate"] / w["rate"] for h, w in zip(host[n], workers[n]))
        memory = statistics.median(h["rss"] / w["rss"] for h, w in zip(host[n], workers[n]))
        cpu = statistics.median(w["cpu_per_step"] / h["cpu_per_step"] for h, w in zip(host[n], workers[n]))
        figures[n] = speed, memory, cpu
        h_rate = statistics.median(h["rate"] for h in host[n])
        w_rate = statistics.median(w["rate"] for w in workers[n])
        h_rss = statistics.median(h["rss"] for h in host[n]) / mib
        w_rss = statistics.median(w["rss"] for w in workers[n]) / mib
        print(f"| {n} | {h_rate:.3f} | {w_rate:.3f} | {speed:.2f}x | {h_rss:.0f} | {w_rss:.0f} | {memory:.2f}x |")
    speed, memory, cpu = figures[top]
    print(f"\nCPU seconds per step, workers / host, {top} tasks: {cpu:.2f}x")
    warm = statistics.median(h["warm_first_step_s"] for h in host[top])
    cold = statistics.median(w["cold_first_step_s"] for w in workers[top])
    warm0 = statistics.median(h["warm_to_step_start_s"] for h in host[top])
    cold0 = statistics.median(w["cold_to_step_start_s"] for w in workers[top])
    print(
        f"time to first step's end: warm host {warm:.2f} s, cold worker process {cold:.2f} s "
        f"({cold / warm:.1f}x faster); to its start (less the step's own perf/step_s): warm {warm0:.2f} s, "
        f"cold {cold0:.2f} s ({cold0 / warm0:.1f}x faster)"
    )
    write_result(
        "multitenant-host",
        what=f"{top} LoRA GRPO tasks on one model host (rollouts batched): aggregate steps/s and peak RSS",
        peer=f"{top} worker processes, one per task, started together; same run, alternating",
        ratios=[
            {"label": "aggregate steps/s, host / processes", "value": round(speed, 3)},
            {"label": "peak RSS, host / processes (lower is better)", "value": round(memory, 3)},
            {"label": "CPU seconds per step, processes / host", "value": round(cpu, 3)},
        ],
        goal=f">= 1.5x steps/s of {top} processes; memory <= 0.2x",
        settings={**hp, "tenants": top, "pairs": args.pairs, "model": Path(args.model).name, "threads": threads},
        make="make bench-multitenant",
        notes=(
            "Every process in its own session with the node agent's CPU settings (threads), as the agent starts "
            "them (the host one session, the workers one each). Host and workers alternate, median of the per-pair "
            "ratios."
        ),
        details={
            "steps_per_s_host": [round(h["rate"], 4) for h in host[top]],
            "steps_per_s_workers": [round(w["rate"], 4) for w in workers[top]],
            "cpu_s_per_step_host": [round(h["cpu_per_step"], 3) for h in host[top]],
            "cpu_s_per_step_workers": [round(w["cpu_per_step"], 3) for w in workers[top]],
            "rss_mib_host": [round(h["rss"] / mib) for h in host[top]],
            "rss_mib_workers": [round(w["rss"] / mib) for w in workers[top]],
            "first_step_s": {"warm_host": round(warm, 2), "cold_worker": round(cold, 2)},
            "sessions": {
                "bench": os.getsid(0),
                "hosts": [h["session"] for h in host[top]],
                "workers": [w["sessions"] for w in workers[top]],
            },
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
