#!/usr/bin/env python3
"""Many LoRA GRPO tasks on one model host vs one worker process each, on a real model (CPU).

Runs the trainer's own processes with no scheduler (checkpoints by path): a model host
(``python -m opentinker_trainer.host``) fed N task attempts over its stdin, and N worker processes
(``python -m opentinker_trainer.worker``), all with ``OMP_NUM_THREADS=1``. The tasks are the same
LoRA GRPO arithmetic task with different seeds. Measured in one run, reported as ratios:

* **memory**: the peak over the run of the summed resident set size (RSS, ``/proc/PID/status``
  sampled every 0.2 s) of the host, or of the N workers, for N in ``--tenants`` (default 1, 4, 8);
  the goal is 8 tenants <= 1.3x the memory of 1;
* **aggregate steps/s** while all N tasks train (:func:`steady_rate`: the steps ending between
  the last task's first step and the first task's last step, over that time), against one task at
  a time on the same host (``--sequential`` tasks one after another in one process, the median of
  their rates: one at a time does not depend on how many; goal >= 1.0x), and against N worker
  processes started together; for the largest N both with the tenants' rollouts batched (the
  host's default: one forward per token for every waiting tenant's rows) and not
  (``--no-batch-rollouts``), in ``--pairs`` pairs of runs in alternating order (not batched
  first, then batched first, ...), figures the median over the pairs. On a shared machine whose load changes between
  phases, a load-independent figure of the unbatched host is :func:`busy_fraction`: the share of
  its wall time spent inside its tenants' steps, i.e. host / one-at-a-time throughput under the
  same load (not of the batched host: there a step's ``perf/step_s`` spans its neighbours' turns
  between its rollout and its update);
* **steps per CPU second** of the host process over the same window (:func:`cpu_rate`; user +
  system time from ``/proc``): the model runs on one thread at a time, so this counts the work a
  step costs, which other jobs on a shared machine slow much less than wall time;
* Every host and worker process runs in its own session: this kernel shares CPU per session, so
  each phase's process gets the same share whatever the bench process does.
* **time to first step**: from handing an attempt over to its first metric (and to the start of
  that step: less its own ``perf/step_s``), joining a warm host (base model loaded) vs a cold
  worker process (start, imports, model load): goal >= 5x.

Usage::

    .venv/bin/python scripts/bench_multitenant.py                      # SmolLM2-135M-Instruct, 1/4/8
    .venv/bin/python scripts/bench_multitenant.py --model /tmp/tiny --tenants 1,2 --steps 3   # smoke run
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


def child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPENTINKER_")}
    env.update(
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONPATH=f"{ROOT}:{ROOT / 'protos'}",
        OPENTINKER_LOG_FORMAT="json",
    )
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


def busy_fraction(lines: list[tuple[float, dict]], task_ids) -> float:
    """Of the window :func:`steady_rate` counts, the share spent inside the tenants' steps (the sum
    of their ``perf/step_s``): host / one-at-a-time throughput at the same machine load, since one
    at a time would run exactly those steps back to back. 1.0 = sharing costs nothing."""
    times = [metric_times(lines, tid) for tid in task_ids]
    start, end = max(t[0] for t in times), min(t[-1] for t in times)
    inside = sum(
        m["values"]["perf/step_s"]
        for t, m in lines
        if m["type"] == "metric" and m.get("task_id") in task_ids and start < t <= end
    )
    return inside / (end - start) if end > start else float("nan")


def cpu_rate(lines: "Lines", task_ids) -> float:
    """Steps per CPU second of the host over :func:`steady_rate`'s window: the steps ending in it
    over the CPU time the host process used between its first and last line (one thread runs the
    model at a time, ``OMP_NUM_THREADS=1``), which other jobs on the machine slow less than wall time."""
    metrics = [(t, m) for t, m in lines.lines if m["type"] == "metric" and m.get("task_id") in task_ids]
    by_task = [[t for t, m in metrics if m["task_id"] == tid] for tid in task_ids]
    start, end = max(t[0] for t in by_task), min(t[-1] for t in by_task)
    first = next(m for t, m in metrics if t == start)
    last = next(m for t, m in metrics if t == end)
    steps = sum(1 for t, _ in metrics if start < t <= end)
    used = lines.cpu[id(last)] - lines.cpu[id(first)]
    return steps / used if used > 0 else float("nan")


def start_host(model: str, out_dir: Path, *, batch: bool = True) -> tuple[subprocess.Popen, Lines, float]:
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "opentinker_trainer.host", "--model", model, "--device", "cpu"]
        + ([] if batch else ["--no-batch-rollouts"]),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=open(out_dir / f"host-{t0:.0f}.log", "w"),
        text=True,
        env=child_env(),
        cwd=ROOT,
        start_new_session=True,
    )
    lines = Lines(proc)
    lines.wait(lambda m: m["type"] in ("host_ready", "host_failed"))
    return proc, lines, time.perf_counter() - t0


def add(proc: subprocess.Popen, path: Path, ckpt: Path) -> None:
    proc.stdin.write(json.dumps({"op": "add", "assignment": str(path), "checkpoint_dir": str(ckpt)}) + "\n")
    proc.stdin.flush()


def run_host(model: str, n: int, hp: dict, work: Path, *, one_at_a_time: bool = False, batch: bool = True) -> dict:
    """N tenants on one host, all at once (or one after another); ``batch``: their rollouts
    batched (the host's default) or each alone in its turn (``--no-batch-rollouts``)."""
    proc, lines, load_s = start_host(model, work, batch=batch)
    session = os.getsid(proc.pid)
    peak = Peak(lambda: [proc.pid])
    ids = [f"h{n}{'s' if one_at_a_time else ''}{'' if batch else 'u'}-{i}" for i in range(n)]
    for i, tid in enumerate(ids):
        add(proc, assignment(work, tid, model, {**hp, "seed": 100 + i}), work / "ck" / tid)
        if one_at_a_time:
            lines.wait(lambda m, tid=tid: m["type"] == "released" and m["task_id"] == tid)
    for tid in ids:
        lines.wait(lambda m, tid=tid: m["type"] == "released" and m["task_id"] == tid)
    for tid in ids:
        assert any(m["type"] == "succeeded" and m.get("task_id") == tid for _, m in lines.lines), tid
    times = [metric_times(lines.lines, tid) for tid in ids]
    if one_at_a_time:  # each task alone: its own rate, then their median
        rate = statistics.median(steady_rate([t]) for t in times)
    else:
        rate = steady_rate(times)
    cpu = statistics.median(cpu_rate(lines, [t]) for t in ids) if one_at_a_time else cpu_rate(lines, ids)
    result = {"rss": peak.stop(), "rate": rate, "cpu_rate": cpu, "load_s": load_s, "session": session}
    if not one_at_a_time and n > 1 and not batch:  # batched, a step's perf/step_s spans others' turns
        result["busy"] = busy_fraction(lines.lines, set(ids))
    # Warm join: one more tenant on this host, whose base model is loaded already.
    if not one_at_a_time and batch:
        t0 = time.perf_counter()
        tid = f"warm-{n}"
        add(proc, assignment(work, tid, model, {**hp, "seed": 99}), work / "ck" / tid)
        t1, first = lines.wait(lambda m: m["type"] == "metric" and m.get("task_id") == tid)
        result["warm_first_step_s"] = t1 - t0
        result["warm_to_step_start_s"] = t1 - t0 - first["values"]["perf/step_s"]
        lines.wait(lambda m: m["type"] == "released" and m.get("task_id") == tid)
    proc.stdin.close()
    proc.wait(timeout=120)
    return result


def run_workers(model: str, n: int, hp: dict, work: Path) -> dict:
    procs, readers, starts = [], [], []
    for i in range(n):
        tid = f"w{n}-{i}"
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
            env=child_env(),
            cwd=ROOT,
            start_new_session=True,
        )
        procs.append(p)
        readers.append(Lines(p))
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
    rate = steady_rate([metric_times(r.lines) for r in readers])
    return {"rss": rss, "rate": rate, "cold_first_step_s": min(firsts), "cold_to_step_start_s": min(to_start)}


def _brief(result: dict) -> str:
    return ", ".join(
        f"{k} {v / 2**20:.0f} MiB" if k == "rss" else f"{k} {v:.3f}"
        for k, v in result.items()
        if v is not None and k != "session"
    )


def _median_run(runs: list[dict]) -> dict:
    """Each figure's median over ``runs`` (a key missing from a run is left out)."""
    keys = {k for r in runs for k in r} - {"session"}
    return {k: statistics.median(r[k] for r in runs if r.get(k) is not None) for k in keys}


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--tenants", default="1,4,8", help="comma-separated tenant counts (default %(default)s)")
    ap.add_argument("--steps", type=int, default=3, help="GRPO steps per task, at least 3 (default %(default)s)")
    ap.add_argument("--max-new-tokens", type=int, default=4)
    ap.add_argument("--prompts-per-step", type=int, default=1)
    ap.add_argument("--group-size", type=int, default=2)
    ap.add_argument(
        "--sequential", type=int, default=2, help="tasks run one after another for the baseline (default %(default)s)"
    )
    ap.add_argument("--no-workers", action="store_true", help="skip the worker-process phases (a quicker run)")
    ap.add_argument(
        "--pairs", type=int, default=2, help="batched / not batched host runs at the largest N (default %(default)s)"
    )
    args = ap.parse_args()
    counts = [int(x) for x in args.tenants.split(",")]
    hp = {
        "steps": args.steps,
        "prompts_per_step": args.prompts_per_step,
        "group_size": args.group_size,
        "max_new_tokens": args.max_new_tokens,
        "lora_rank": 8,
        "checkpoint_every": 0,
    }
    top = max(counts)
    mib = 1024 * 1024
    with tempfile.TemporaryDirectory(prefix="bench-multitenant-") as tmp:
        work = Path(tmp)
        print(f"model {args.model}; tasks: LoRA GRPO arithmetic, {hp}; OMP_NUM_THREADS=1 in every process", flush=True)
        host, workers = {}, {}
        for n in counts:  # each phase's figures as it ends, so a run cut short still says something
            host[n] = run_host(args.model, n, hp, work)
            print(f"host, {n} tasks: {_brief(host[n])}  load average {_load()}", flush=True)
        runs = {True: [], False: []}  # batched or not: the runs of each, in alternating order
        for r in range(args.pairs):
            for batch in (False, True) if r % 2 == 0 else (True, False):
                runs[batch].append(run_host(args.model, top, hp, work, batch=batch))
                kind = "batched" if batch else "not batched"
                print(f"host, {top} tasks, rollouts {kind}: {_brief(runs[batch][-1])}  load {_load()}", flush=True)
        batched, unbatched = _median_run(runs[True]), _median_run(runs[False])
        seq = run_host(args.model, args.sequential, hp, work, one_at_a_time=True)
        print(f"host, {args.sequential} tasks one at a time: {_brief(seq)}  load average {_load()}", flush=True)
        for n in counts if not args.no_workers else []:
            workers[n] = run_workers(args.model, n, hp, work)
            print(f"workers, {n} processes: {_brief(workers[n])}  load average {_load()}", flush=True)
    if workers:
        print("\n| tasks | host RSS MiB | host / 1 tenant | workers RSS MiB | workers / 1 worker | host / workers |")
        print("|---|---|---|---|---|---|")
        for n in counts:
            h, w = host[n]["rss"], workers[n]["rss"]
            print(
                f"| {n} | {h / mib:.0f} | {h / host[counts[0]]['rss']:.2f}x | {w / mib:.0f} | "
                f"{w / workers[counts[0]]['rss']:.2f}x | {h / w:.2f}x |"
            )
    agg_host, agg_unb, agg_seq = batched["rate"], unbatched["rate"], seq["rate"]
    agg_workers = workers[top]["rate"] if workers else float("nan")
    print(
        f"\naggregate steps/s, {top} tasks: host, rollouts batched {agg_host:.3f}; host, not batched {agg_unb:.3f} "
        f"(batched / not {agg_host / agg_unb:.2f}x); one at a time in one process {agg_seq:.3f} "
        f"(batched / sequential {agg_host / agg_seq:.2f}x, not batched / sequential {agg_unb / agg_seq:.2f}x); "
        f"{top} worker processes {agg_workers:.3f} (batched / processes {agg_host / agg_workers:.2f}x)"
    )
    cpu_host, cpu_unb, cpu_seq = batched["cpu_rate"], unbatched["cpu_rate"], seq["cpu_rate"]
    print(
        f"steps per CPU second of the host process (less sensitive to the machine's load), {top} tasks: batched "
        f"{cpu_host:.3f}, not batched {cpu_unb:.3f} (batched / not {cpu_host / cpu_unb:.2f}x), one at a time "
        f"{cpu_seq:.3f} (batched / sequential {cpu_host / cpu_seq:.2f}x)"
    )
    print(
        f"share of the unbatched {top}-tenant host's wall time inside tenant steps (unbatched host / one at a "
        f"time at the same load): {unbatched.get('busy', float('nan')):.3f}"
    )
    write_result(
        "multitenant-batched-rollouts",
        what=f"Model host, {top} LoRA GRPO tenants: steps per CPU second of the host process",
        peer="the same host with rollouts not batched (--no-batch-rollouts), same run",
        ratios=[
            {"label": "steps per CPU second, batched / not batched", "value": round(cpu_host / cpu_unb, 3)},
            {"label": "aggregate steps/s, batched / not batched", "value": round(agg_host / agg_unb, 3)},
        ],
        goal="> 1.0",
        settings={**hp, "tenants": top, "pairs": args.pairs, "model": Path(args.model).name},
        make="make bench-multitenant",
        notes="Each host runs in its own session; batched and not batched alternate, median over the pairs.",
        details={
            "steps_per_cpu_s_batched": [round(x["cpu_rate"], 4) for x in runs[True]],
            "steps_per_cpu_s_not_batched": [round(x["cpu_rate"], 4) for x in runs[False]],
            "sessions": {"bench": os.getsid(0), "hosts": [x["session"] for x in runs[True] + runs[False]]},
        },
    )
    if not workers:
        return 0
    # Both alone on the machine: a tenant joining the idle 1-tenant host, and the lone worker.
    warm = host[counts[0]]["warm_first_step_s"]
    cold = workers[counts[0]]["cold_first_step_s"]
    warm0, cold0 = host[counts[0]]["warm_to_step_start_s"], workers[counts[0]]["cold_to_step_start_s"]
    print(
        f"time to first step's end: warm host {warm:.2f} s, cold worker process {cold:.2f} s "
        f"({cold / warm:.1f}x faster); to its start (less the step's own perf/step_s): warm {warm0:.2f} s, "
        f"cold {cold0:.2f} s ({cold0 / warm0:.1f}x faster); "
        f"host start + base load {statistics.median(h['load_s'] for h in host.values()):.2f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
