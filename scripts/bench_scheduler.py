#!/usr/bin/env python
"""Scheduler scale benchmark on loopback (``make bench-scheduler``).

Starts the real scheduler as its own process (``python -m opentinker_scheduler``), then
simulates N trainer nodes, each holding a real ``NodeService.Connect`` stream: it registers
with simulated GPUs, heartbeats with simulated telemetry, and answers every ``AssignTask`` at
once with a RUNNING and a SUCCEEDED ``TaskReport`` (so capacity frees up). The nodes live in
``--workers`` spawned processes; tasks are submitted from this process. Phases:

  1. heartbeats   no submits. Idle (nodes silent, for the scheduler's baseline CPU), steady
                  (one heartbeat per node per second), then a flood (``--flood-rate`` offered
                  in all) to measure how many heartbeats per second the scheduler ingests.
                  Ingested = the scheduler's own counter (``opentinker_node_messages_total``).
  2. throughput   first the yardstick: ``--unary-calls`` empty unary calls (``grpc.health.v1``
                  ``Health/Check``) in the same closed loop, for the scheduler's CPU per call
                  (run again after the submits; the two are averaged);
                  then ``--tasks`` SubmitTask calls, closed loop with ``--concurrency`` in flight:
                  submits/s, submit-to-assign latency under that saturation, and the scheduler's
                  CPU per submit (the task's whole life: the call, placement, the AssignTask and
                  two reports) as a multiple of the empty call's. Absolute rates differ from one
                  machine to the next (432 vs ~800 submits/s on two 2-core machines); the ratio
                  is the figure to compare. Both CPU figures are net of the scheduler's CPU at
                  rest (heartbeats only), measured just before.
  3. latency      ``--rate-tasks`` submits paced open-loop at ``--rate`` per second (the goal
                  rate): submit-to-assign p50/p99 at that load.
  4. deep queue   every slot busy (nodes hold their tasks), ``--backlog`` more tasks submitted
                  so the queue grows that deep (submits/s at depth), then the nodes let go and
                  the queue drains (assignments/s).
  5. scale        how fast the scale signal follows a burst: with the nodes holding their
                  tasks, ``--scale-burst`` one-GPU tasks (default: twice the cluster's task slots) are
                  submitted at once; the time from the burst's first submit (and from its last
                  answer) until ``AdminService.GetDesiredTrainers`` (polled every 50 ms) and
                  ``opentinker_desired_trainers{node_class}`` on /metrics (every 100 ms) first
                  change and until they reach the burst's figure; then the nodes let go, and
                  the time from the burst's last assignment until both fall back to where they
                  were before the burst.

Sharing mode (``--queues Q --owners O``): API keys on, O owners (one user key each) submit in
turn, and the throughput (closed loop), latency (open loop at ``--rate``) and scale phases run twice in
one invocation, each on a fresh scheduler: without quota queues (each owner is a queue of its own
with no quota: fair share still orders them) and with Q queues (owners spread over them, nominal
quotas splitting the cluster, borrowing unlimited). The report gives both and their ratios
(goals: submits/s at least 0.9x, submit-to-assign p99 at most 1.2x).

Submit-to-assign latency is the time from the SubmitTask call in this process to the node
process receiving the ``AssignTask`` for that task (both read CLOCK_MONOTONIC, which is one
clock for all processes on Linux). Scheduler CPU comes from ``/proc/<pid>/stat`` (utime + stime,
all threads). Every SubmitTask carries a request id, as ``RLClient`` sends; a call that fails
is counted by status code (and whether its refusal carried a ``google.rpc.RetryInfo``).
Figures are printed, never asserted; ``--json`` writes them as well. The machine's
total CPU use is shown per phase, because other work on a shared machine shifts these numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import math
import multiprocessing as mp
import os
import platform
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from opentinker.common.v1 import common_pb2 as C

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_result import write_result  # noqa: E402  (scripts/bench_result.py)
from opentinker.node.v1 import node_pb2 as N
from opentinker.node.v1 import node_pb2_grpc
from opentinker.scheduler.v1 import scheduler_pb2 as S
from opentinker.scheduler.v1 import scheduler_pb2_grpc
from opentinker_common.net.call_budget import budget_metadata

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.support.procs import free_port, scheduler_args  # noqa: E402

GOALS = {"p99_ms": 50.0, "submits_per_s": 500.0, "heartbeats_per_s": 2000.0, "cpu_ratio": 4.0}
CLK_TCK = os.sysconf("SC_CLK_TCK")
SUBMIT_METADATA = budget_metadata(60)


# ---------------------------------------------------------------------------------------------
# CPU accounting


def proc_cpu_s(pid: int) -> float:
    """utime + stime of a process (all its threads), in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # fields 14 and 15 of proc(5)


def self_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def machine_cpu() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, all cores."""
    with open("/proc/stat") as f:
        vals = [int(v) for v in f.readline().split()[1:]]
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
    total = sum(vals[:8])
    return (total - idle) / CLK_TCK, total / CLK_TCK


def first_per_code(errors: list[str]) -> list[str]:
    """The first ``CODE: details`` message of each status code, in order of appearance."""
    seen: dict[str, str] = {}
    for e in errors:
        seen.setdefault(e.split(":", 1)[0], e)
    return list(seen.values())


def pct(sorted_vals: list[float], q: float) -> float:
    if not sorted_vals:
        return math.nan
    k = min(len(sorted_vals) - 1, max(0, math.ceil(q / 100 * len(sorted_vals)) - 1))
    return sorted_vals[k]


# ---------------------------------------------------------------------------------------------
# Simulated nodes (run in spawned worker processes)


class SimNode:
    def __init__(self, worker: "SimWorker", node_id: str, index: int) -> None:
        self.w = worker
        self.node_id = node_id
        self.offset = (index * 0.618034) % 1.0  # spreads heartbeats evenly over the interval
        self.out: asyncio.Queue = asyncio.Queue()
        self.registered = asyncio.Event()
        self.failed: str | None = None
        gpus = worker.opts["gpus_per_node"]
        self.hb = N.ConnectRequest(
            heartbeat=N.Heartbeat(
                devices=[
                    C.DeviceTelemetry(
                        index=i,
                        utilization_percent=50.0,
                        memory_used_bytes=20 << 30,
                        memory_total_bytes=80 << 30,
                        temperature_c=55.0,
                        power_w=300.0,
                        sm_clock_mhz=1980,
                        ecc_errors=0,
                        simulated=True,
                    )
                    for i in range(gpus)
                ]
            )
        )
        self.register = N.ConnectRequest(
            register=N.Register(
                node_id=node_id,
                version="bench",
                devices=[
                    C.Device(
                        index=i,
                        uuid=f"SIM-{node_id}-{i}",
                        name="Simulated GPU",
                        memory_total_bytes=80 << 30,
                        simulated=True,
                    )
                    for i in range(gpus)
                ],
                max_tasks=worker.opts["max_tasks"],
                hostname="bench",
                cpu_count=8,
            )
        )

    async def requests(self):
        yield self.register
        while True:
            msg = await self.out.get()
            if msg is None:
                return
            yield msg

    async def run(self, channel: grpc.aio.Channel) -> None:
        stub = node_pb2_grpc.NodeServiceStub(channel)
        try:
            key = self.w.opts.get("api_key")
            call = stub.Connect(self.requests(), metadata=(("authorization", f"Bearer {key}"),) if key else None)
            async for resp in call:
                kind = resp.WhichOneof("command")
                if kind == "assign_task":
                    self.w.on_assign(self, resp.assign_task)
                elif kind == "registered":
                    self.registered.set()
                elif kind == "cancel_task":
                    c = resp.cancel_task
                    self.out.put_nowait(
                        N.ConnectRequest(
                            task_report=N.TaskReport(task_id=c.task_id, attempt=c.attempt, state=C.TASK_STATE_CANCELLED)
                        )
                    )
        except grpc.aio.AioRpcError as exc:
            if not self.w.stopping:
                self.failed = f"{exc.code().name}: {exc.details()}"
                self.w.errors.append(f"{self.node_id}: {self.failed}")
        finally:
            self.registered.set()

    async def heartbeats(self) -> None:
        gen = -1
        next_t = 0.0
        tel = self.hb.heartbeat.devices
        while not self.w.stopping:
            iv = self.w.hb_interval
            now = time.monotonic()
            if gen != self.w.hb_gen:
                gen = self.w.hb_gen
                next_t = now + self.offset * (iv or 1.0)
            if not iv:
                await asyncio.sleep(0.05)
                continue
            if next_t > now:
                await asyncio.sleep(min(next_t - now, 0.2))
                continue
            self.w.hb_count += 1
            for t in tel:
                t.utilization_percent = float(self.w.hb_count % 100)
            self.hb.heartbeat.time.FromNanoseconds(time.time_ns())
            self.out.put_nowait(self.hb)
            next_t += iv
            if next_t < now - iv:
                next_t = now  # fell behind: no burst to catch up; hb_count shows what was offered


class SimWorker:
    def __init__(self, conn, target: str, node_ids: list[str], opts: dict) -> None:
        self.conn = conn
        self.target = target
        self.opts = opts
        self.nodes = [SimNode(self, nid, i) for i, nid in enumerate(node_ids)]
        self.hb_interval: float | None = None
        self.hb_gen = 0
        self.hb_count = 0
        self.assigns = 0
        self.reassigns = 0
        self.assign_t: dict[str, float] = {}
        self.hold = False
        self.held: list[tuple[SimNode, str, int]] = []
        self.errors: list[str] = []
        self.stopping = False
        self.done = asyncio.Event()

    def on_assign(self, node: SimNode, a) -> None:
        now = time.monotonic()
        self.assigns += 1
        if a.task_id in self.assign_t:
            self.reassigns += 1
        else:
            self.assign_t[a.task_id] = now
        node.out.put_nowait(
            N.ConnectRequest(task_report=N.TaskReport(task_id=a.task_id, attempt=a.attempt, state=C.TASK_STATE_RUNNING))
        )
        if self.hold:
            self.held.append((node, a.task_id, a.attempt))
        else:
            node.out.put_nowait(
                N.ConnectRequest(
                    task_report=N.TaskReport(task_id=a.task_id, attempt=a.attempt, state=C.TASK_STATE_SUCCEEDED)
                )
            )

    def stats(self) -> dict:
        return {
            "hb_sent": self.hb_count,
            "assigns": self.assigns,
            "reassigns": self.reassigns,
            "held": len(self.held),
            "cpu_s": self_cpu_s(),
            "registered": sum(1 for n in self.nodes if n.registered.is_set() and not n.failed),
            "failed": sum(1 for n in self.nodes if n.failed),
            "errors": self.errors[:5],
        }

    def on_command(self) -> None:
        while self.conn.poll():
            cmd, arg = self.conn.recv()
            reply: object = None
            if cmd == "hb":
                self.hb_interval = arg
                self.hb_gen += 1
            elif cmd == "hold":
                self.hold = bool(arg)
            elif cmd == "release":
                self.hold = False
                for node, task_id, attempt in self.held:
                    node.out.put_nowait(
                        N.ConnectRequest(
                            task_report=N.TaskReport(task_id=task_id, attempt=attempt, state=C.TASK_STATE_SUCCEEDED)
                        )
                    )
                self.held.clear()
            elif cmd == "collect":
                reply, self.assign_t = self.assign_t, {}
            elif cmd == "stop":
                self.stopping = True
                for n in self.nodes:
                    n.out.put_nowait(N.ConnectRequest(goodbye=N.Goodbye(reason="benchmark over")))
                    n.out.put_nowait(None)
                self.done.set()
            if cmd != "stats":
                self.conn.send(reply)
            else:
                self.conn.send(self.stats())

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        loop.add_reader(self.conn.fileno(), self.on_command)
        channels = [
            grpc.aio.insecure_channel(self.target, options=[("grpc.use_local_subchannel_pool", 1)]) for _ in self.nodes
        ]  # one connection per node, as real trainers have
        streams = [asyncio.create_task(n.run(ch)) for n, ch in zip(self.nodes, channels)]
        beats = [asyncio.create_task(n.heartbeats()) for n in self.nodes]
        await self.done.wait()
        await asyncio.wait(streams, timeout=5)
        for t in beats + streams:
            t.cancel()
        for ch in channels:
            await ch.close(grace=None)
        loop.remove_reader(self.conn.fileno())


def worker_main(conn, target: str, node_ids: list[str], opts: dict) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the driver stops us
    asyncio.run(SimWorker(conn, target, node_ids, opts).run())


# ---------------------------------------------------------------------------------------------
# The scheduler process


class SchedulerProc:
    def __init__(
        self,
        workdir: Path,
        *,
        lease_s: float,
        max_tasks: int,
        scheduler_path: str | None,
        profile: Path | None = None,
        http_on_grpc_port: bool = True,
        extra_config: str = "",
    ) -> None:
        self.workdir = workdir
        self.port, self.http_port = free_port(), free_port()
        cfg = workdir / "scheduler_config.yaml"
        cfg.write_text(
            "# written by scripts/bench_scheduler.py\n"
            "resource_pool: []\n"
            "workload_types:\n  - type: lora_finetune\n    priority: 1\n"
            "allow_unknown_nodes: true\n"
            f"unknown_node_max_tasks: {max_tasks}\n"
            "heartbeat_interval: 1\n"
            f"lease: {lease_s}\n"
            + ("" if http_on_grpc_port else "http_on_grpc_port: false\n")
            # the HTTP/1.1 front on the gRPC port (splicing gRPC to a private port); off: gRPC owns it
            + extra_config
        )
        self.log_path = workdir / "scheduler.log"
        env = {**os.environ, "OPENTINKER_LOG_FORMAT": "json"}
        if scheduler_path:  # `python -m` puts its working directory first on sys.path
            env["PYTHONPATH"] = os.pathsep.join([scheduler_path, env.get("PYTHONPATH", "")])
        self._log = open(self.log_path, "wb")
        self.popen = subprocess.Popen(
            [
                sys.executable,
                *(["-m", "cProfile", "-o", str(profile)] if profile else []),
                *scheduler_args(
                    cfg, port=self.port, http_port=self.http_port, state_dir=workdir / "state", host="127.0.0.1"
                ),
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=scheduler_path or str(REPO),
        )
        self.pid = self.popen.pid

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def store(self, timeout: float = 30.0) -> str:
        """The state store the scheduler says it opened (its "scheduler listening" log line:
        ``sqlite PATH`` or ``postgres host=... schema=...``). /health answers before that line
        is written, so this waits for it, up to ``timeout`` seconds; ``"?"`` if it never comes."""
        deadline = time.monotonic() + timeout
        while True:
            for line in self.log_path.read_text(errors="replace").splitlines():
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if isinstance(rec, dict) and rec.get("event") == "scheduler listening":
                    return str(rec.get("store", "?"))
            if time.monotonic() > deadline or self.popen.poll() is not None:
                return "?"
            time.sleep(0.05)

    def wait_healthy(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(f"scheduler exited with {self.popen.returncode}; see {self.log_path}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/health", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"scheduler not healthy after {timeout:.0f} s; see {self.log_path}")

    def metrics(self) -> dict[str, float]:
        """Prometheus text from /metrics as {'name{labels}': value}."""
        out = {}
        with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/metrics", timeout=10) as r:
            for line in r.read().decode().splitlines():
                if line and not line.startswith("#"):
                    key, _, val = line.rpartition(" ")
                    try:
                        out[key] = float(val)
                    except ValueError:
                        pass
        return out

    def private_port(self) -> int | None:
        """The loopback port gRPC listens on behind the front (its log says), or None."""
        for line in self.log_path.read_text(errors="replace").splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if event.get("event") == "scheduler listening":
                return event.get("grpc_private_port")
        return None

    def cpu_s(self) -> float:
        return proc_cpu_s(self.pid)

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=10)
        self._log.close()


HB_KEY = 'opentinker_node_messages_total{kind="heartbeat"}'


# ---------------------------------------------------------------------------------------------
# The driver


@dataclass
class Meter:
    """CPU and wall time of one phase, for every process involved and the whole machine."""

    bench: "Bench"
    t0: float = 0.0
    sched0: float = 0.0
    main0: float = 0.0
    workers0: list[float] = field(default_factory=list)
    machine0: tuple[float, float] = (0.0, 0.0)
    result: dict = field(default_factory=dict)

    async def __aenter__(self) -> "Meter":
        self.workers0 = [s["cpu_s"] for s in await self.bench.worker_stats()]
        self.t0 = time.monotonic()
        self.sched0, self.main0, self.machine0 = self.bench.sched.cpu_s(), self_cpu_s(), machine_cpu()
        return self

    async def __aexit__(self, *exc) -> None:
        wall = time.monotonic() - self.t0
        sched, main, machine = self.bench.sched.cpu_s(), self_cpu_s(), machine_cpu()
        workers = [s["cpu_s"] for s in await self.bench.worker_stats()]
        wcpu = [b - a for a, b in zip(self.workers0, workers)]
        busy, total = machine[0] - self.machine0[0], machine[1] - self.machine0[1]
        ncpu = os.cpu_count() or 1
        self.result = {
            "wall_s": wall,
            "scheduler_cpu_s": sched - self.sched0,
            "scheduler_cpu_frac": (sched - self.sched0) / wall,
            "driver_cpu_frac": (main - self.main0) / wall,
            "worker_cpu_frac": [c / wall for c in wcpu],
            "machine_busy_cores": busy / total * ncpu if total else math.nan,
            "others_cores": max(0.0, (busy - (sched - self.sched0) - (main - self.main0) - sum(wcpu)) / total * ncpu)
            if total
            else math.nan,
        }


def sharing_config(args: argparse.Namespace, queues: int) -> str:
    """Config of the sharing mode: keys on, per-caller limits off, ``queues`` quota queues over
    ``args.owners`` owners (0: none)."""
    text = (
        "auth: {enabled: true}\n"
        "limits: {submit_rate: 0, max_pending_per_owner: 0, max_streams_per_owner: 0, max_keys_per_owner: 0}\n"
    )
    if queues:
        gpus = max(1, args.nodes * args.gpus_per_node // queues)
        cpus = max(1, args.nodes * args.max_tasks // queues)
        text += "queues:\n"
        for q in range(queues):
            owners = ", ".join(f"owner-{o:03d}" for o in range(q, args.owners, queues))
            text += f"  - {{name: queue-{q:02d}, gpus: {gpus}, cpu_tasks: {cpus}, owners: [{owners}]}}\n"
    return text


class Bench:
    def __init__(self, args: argparse.Namespace, *, queues: int = 0, store_config: str = "") -> None:
        self.args = args
        #: The scheduler config's ``store:`` section of this run ("": the SQLite default).
        self.store_config = store_config
        #: Quota queues of this run (sharing mode); owners' keys once made.
        self.queues = queues
        self.owner_metadata: list[tuple] = []
        #: Metadata of AdminService calls (sharing mode: the admin key).
        self.admin_metadata: tuple = ()
        self._owner_turn = iter(range(1 << 62))
        self.results: dict = {"phases": {}}
        self.sched: SchedulerProc
        self.conns: list = []
        self.procs: list = []
        self.submits: list[tuple[str, float, float]] = []
        self.submit_errors: list[str] = []
        #: Status code name -> how many SubmitTask calls ended with it (OK not counted).
        self.submit_codes: Counter = Counter()
        #: Refusals (RESOURCE_EXHAUSTED, UNAVAILABLE) that carried a google.rpc.RetryInfo.
        self.refused_with_retry_info = 0
        self.total_submitted = 0
        self._request_ids = iter(range(1 << 62))

    # --- workers ----------------------------------------------------------------------------
    async def _ask(self, conn, cmd, arg=None):
        conn.send((cmd, arg))
        return await asyncio.get_running_loop().run_in_executor(None, conn.recv)

    async def broadcast(self, cmd, arg=None) -> list:
        return await asyncio.gather(*(self._ask(c, cmd, arg) for c in self.conns))

    async def worker_stats(self) -> list[dict]:
        return await self.broadcast("stats")

    async def total_assigns(self) -> int:
        """Tasks assigned so far, each counted once (a requeued task may be assigned again)."""
        return sum(s["assigns"] - s["reassigns"] for s in await self.worker_stats())

    async def wait_assigns(self, target: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if await self.total_assigns() >= target:
                return True
            await asyncio.sleep(0.05)
        return False

    async def collect_assign_times(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for part in await self.broadcast("collect"):
            out.update(part)
        return out

    def hb_ingested(self) -> float | None:
        return self.sched.metrics().get(HB_KEY)

    # --- submits ----------------------------------------------------------------------------
    def spec(self, i: int) -> C.TaskSpec:
        spec = C.TaskSpec(
            workload_type="lora_finetune",
            model="bench/dummy-model",
            name=f"bench-{i}",
            resources=C.Resources(gpu_count=i % 2 if self.args.gpus_per_node else 0),
        )
        spec.env_config.update({"env_id": "arithmetic"})
        return spec

    async def submit_one(self, stub, spec: C.TaskSpec) -> None:
        # A request id and the call's budget, as RLClient sends them (a retry is safe; the
        # scheduler sees how long the call waited before it was taken up).
        req = S.SubmitTaskRequest(spec=spec, request_id=f"bench-{next(self._request_ids)}")
        t0 = time.monotonic()
        metadata = SUBMIT_METADATA
        if self.owner_metadata:  # sharing mode: the owners submit in turn
            metadata = SUBMIT_METADATA + self.owner_metadata[next(self._owner_turn) % len(self.owner_metadata)]
        try:
            resp = await stub.SubmitTask(req, timeout=60, metadata=metadata)
        except grpc.aio.AioRpcError as exc:
            code = exc.code().name
            self.submit_codes[code] += 1
            status = rpc_status.from_call(exc)
            if status is not None and any(d.Is(error_details_pb2.RetryInfo.DESCRIPTOR) for d in status.details):
                self.refused_with_retry_info += 1
            if len(self.submit_errors) < 100 or code not in {e.split(":")[0] for e in self.submit_errors}:
                self.submit_errors.append(f"{code}: {exc.details()}")
            return
        self.submits.append((resp.task.task_id, t0, time.monotonic()))
        self.total_submitted += 1

    async def closed_loop(self, stub, n: int, concurrency: int, gpu: bool = True) -> None:
        reqs = [self.spec(i if gpu else 0) for i in range(2)]
        counter = iter(range(n))

        async def lane() -> None:
            for i in counter:
                await self.submit_one(stub, reqs[i % 2])

        await asyncio.gather(*(lane() for _ in range(concurrency)))

    async def paced(self, stub, n: int, rate: float) -> float:
        """Open loop: one submit every 1/rate s regardless of replies. Returns the worst dispatch lag."""
        reqs = [self.spec(i) for i in range(2)]
        start = time.monotonic()
        inflight = set()
        worst_lag = 0.0
        for i in range(n):
            due = start + i / rate
            now = time.monotonic()
            if due > now:
                await asyncio.sleep(due - now)
            worst_lag = max(worst_lag, time.monotonic() - due)
            t = asyncio.create_task(self.submit_one(stub, reqs[i % 2]))
            inflight.add(t)
            t.add_done_callback(inflight.discard)
        if inflight:
            await asyncio.wait(inflight)
        return worst_lag

    def latencies(self, submits, assigned: dict[str, float]) -> dict:
        lat = sorted((assigned[tid] - t0) * 1000 for tid, t0, _ in submits if tid in assigned)
        rpc = sorted((t1 - t0) * 1000 for _, t0, t1 in submits)
        return {
            "assigned": len(lat),
            "p50_ms": pct(lat, 50),
            "p90_ms": pct(lat, 90),
            "p99_ms": pct(lat, 99),
            "max_ms": lat[-1] if lat else math.nan,
            "rpc_p50_ms": pct(rpc, 50),
            "rpc_p99_ms": pct(rpc, 99),
        }

    # --- phases -----------------------------------------------------------------------------
    async def phase_heartbeats(self) -> None:
        a = self.args
        await self.broadcast("hb", None)
        await asyncio.sleep(0.3)
        async with Meter(self) as idle:
            await asyncio.sleep(a.idle_seconds)
        base_cpu_per_s = idle.result["scheduler_cpu_s"] / idle.result["wall_s"]
        self.results["phases"]["idle"] = idle.result

        for name, interval, seconds in (
            ("steady", 1.0, a.hb_seconds),
            ("flood", a.nodes / a.flood_rate, a.flood_seconds),
        ):
            await self.broadcast("hb", interval)
            await asyncio.sleep(0.3 if a.quick else min(1.0, interval) + 0.5)  # let the new rhythm settle
            sent0 = sum(s["hb_sent"] for s in await self.worker_stats())
            ing0 = self.hb_ingested()
            async with Meter(self) as m:
                await asyncio.sleep(seconds)
            ing1 = self.hb_ingested()
            sent = sum(s["hb_sent"] for s in await self.worker_stats()) - sent0
            wall = m.result["wall_s"]
            counted = ing1 is not None and ing0 is not None
            ingested = (ing1 - ing0) if counted else sent
            cpu = m.result["scheduler_cpu_s"]
            self.results["phases"][name] = {
                **m.result,
                "offered_per_s": sent / wall,
                "ingested_per_s": ingested / wall,
                "ingested_source": "scheduler counter" if counted else "client-side count (scheduler has no counter)",
                "cpu_s_per_1000_hb": cpu / (ingested / 1000) if ingested else math.nan,
                "cpu_s_per_1000_hb_net": (cpu - base_cpu_per_s * wall) / (ingested / 1000) if ingested else math.nan,
            }
            self.progress(
                f"{name}: {ingested / wall:.0f} heartbeats/s ingested "
                f"({sent / wall:.0f} offered), scheduler CPU {cpu / wall:.0%}"
            )
        await self.broadcast("hb", 1.0)
        await asyncio.sleep(0.2 if a.quick else 1.0)

    async def measured_submits(self, submit, tasks: int):
        """Run ``submit()`` (which appends to ``self.submits``) under a :class:`Meter`, wait until
        every submitted task is assigned; ``(meter result, latencies, all assigned, submit()'s result)``."""
        self.submits = []
        before = await self.total_assigns()
        codes0 = Counter(self.submit_codes)
        async with Meter(self) as m:
            out = await submit()
        ok = await self.wait_assigns(before + len(self.submits), timeout=60 + tasks / 20)
        lat = self.latencies(self.submits, await self.collect_assign_times())
        lat["errors"] = dict(self.submit_codes - codes0)
        return m.result, lat, ok, out

    async def phase_unary(self, channel, *, name: str = "unary") -> None:
        """The yardstick for the CPU a submit costs: the scheduler's CPU per empty unary call
        (``grpc.health.v1.Health/Check``, through the same auth interceptor as every call), in
        the same closed loop as the throughput phase, net of the scheduler's CPU with nothing
        but the steady heartbeats (measured just before). Run before and after the throughput
        phase (``unary``, ``unary_after``); the ratio uses the mean of the two."""
        a = self.args
        async with Meter(self) as base:
            await asyncio.sleep(0.5 if a.quick else 2.0)
        base_rate = base.result["scheduler_cpu_s"] / base.result["wall_s"]
        stub = health_pb2_grpc.HealthStub(channel)
        req = health_pb2.HealthCheckRequest()
        counter = iter(range(a.unary_calls))

        async def lane() -> None:
            for _ in counter:
                await stub.Check(req, timeout=60)

        async with Meter(self) as m:
            await asyncio.gather(*(lane() for _ in range(a.concurrency)))
        cpu_net = m.result["scheduler_cpu_s"] - base_rate * m.result["wall_s"]
        self.baseline_cpu_rate = base_rate
        self.results["phases"][name] = {
            **m.result,
            "calls": a.unary_calls,
            "calls_per_s": a.unary_calls / m.result["wall_s"],
            "baseline_cpu_frac": base_rate,
            "cpu_ms_per_call": cpu_net / a.unary_calls * 1000,
        }
        self.progress(
            f"empty unary calls ({name}): {a.unary_calls / m.result['wall_s']:.0f}/s, scheduler CPU "
            f"{cpu_net / a.unary_calls * 1000:.3f} ms per call (net of {base_rate:.1%} of a core at rest)"
        )

    async def phase_throughput(self, stub) -> None:
        a = self.args
        meter, lat, ok, _ = await self.measured_submits(lambda: self.closed_loop(stub, a.tasks, a.concurrency), a.tasks)
        submit_wall = meter["wall_s"]
        base_rate = getattr(self, "baseline_cpu_rate", 0.0)
        cpu_ms = (meter["scheduler_cpu_s"] - base_rate * submit_wall) / max(1, len(self.submits)) * 1000
        self.results["phases"]["throughput"] = {
            **meter,
            **lat,
            "cpu_ms_per_submit": cpu_ms,
            "tasks": a.tasks,
            "submitted": len(self.submits),
            "concurrency": a.concurrency,
            "submits_per_s": len(self.submits) / submit_wall,
            "all_assigned": ok,
        }
        self.progress(
            f"throughput: {len(self.submits) / submit_wall:.0f} submits/s, submit->assign p99 {lat['p99_ms']:.1f} ms, "
            f"scheduler CPU {cpu_ms:.3f} ms per submit"
        )

    def cpu_ratio(self) -> None:
        """Scheduler CPU per submit over per empty call (the mean of the runs before and after)."""
        P = self.results["phases"]
        unary_ms = (P["unary"]["cpu_ms_per_call"] + P["unary_after"]["cpu_ms_per_call"]) / 2
        P["throughput"]["cpu_ms_per_unary"] = unary_ms
        P["throughput"]["cpu_ratio_to_unary"] = ratio = P["throughput"]["cpu_ms_per_submit"] / unary_ms
        self.progress(f"scheduler CPU per submit = {ratio:.2f}x an empty unary call ({unary_ms:.3f} ms)")

    async def phase_latency(self, stub) -> None:
        a = self.args
        meter, lat, ok, worst_lag = await self.measured_submits(
            lambda: self.paced(stub, a.rate_tasks, a.rate), a.rate_tasks
        )
        self.results["phases"]["latency"] = {
            **meter,
            **lat,
            "tasks": a.rate_tasks,
            "submitted": len(self.submits),
            "offered_rate": a.rate,
            "achieved_rate": len(self.submits) / meter["wall_s"],
            "worst_dispatch_lag_ms": worst_lag * 1000,
            "all_assigned": ok,
        }
        self.progress(
            f"latency @ {a.rate:.0f}/s: submit->assign p50 {lat['p50_ms']:.1f} ms, p99 {lat['p99_ms']:.1f} ms"
        )

    async def quota_mode(self, on: bool) -> None:
        """Sharing mode, one scheduler: put ``--queues`` quota queues over the owners (as
        :func:`sharing_config` would configure them) by ``AdminService.SetQueueQuota``, or take
        them away again (``ResetQueueQuota``: each owner back in a queue of its own)."""
        from opentinker.scheduler.v1 import admin_pb2, admin_pb2_grpc

        a = self.args
        if on == getattr(self, "_quotas_on", False):
            self.limited_queues = getattr(self, "limited_queues", 0)
            return
        self._quotas_on = on
        gpus = max(1, a.nodes * a.gpus_per_node // a.queues)
        cpus = max(1, a.nodes * a.max_tasks // a.queues)
        async with grpc.aio.insecure_channel(self.sched.target) as channel:
            admin = admin_pb2_grpc.AdminServiceStub(channel)
            for q in range(a.queues):
                name = f"queue-{q:02d}"
                if on:
                    owners = [f"owner-{o:03d}" for o in range(q, a.owners, a.queues)]
                    queue = admin_pb2.Queue(name=name, gpu_quota=gpus, cpu_task_quota=cpus, owners=owners)
                    req = admin_pb2.SetQueueQuotaRequest(queue=queue)
                    await admin.SetQueueQuota(req, metadata=self.admin_metadata, timeout=30)
                else:
                    req = admin_pb2.ResetQueueQuotaRequest(name=name)
                    await admin.ResetQueueQuota(req, metadata=self.admin_metadata, timeout=30)
            listed = await admin.ListQueues(admin_pb2.ListQueuesRequest(), metadata=self.admin_metadata, timeout=30)
            #: Queues with a quota the scheduler reports now (the switch took effect).
            self.limited_queues = sum(1 for q in listed.queues if q.limited)

    async def phase_quota_ab(self, stub) -> None:
        """Quotas on against off in one scheduler at the same time (``--ab-blocks``): blocks of
        the throughput load (closed loop) and the latency load (paced at ``--rate``), the quota
        queues switched on and off between blocks (ABBA), so that other work on a shared machine
        weighs on both alike. Per mode: submits/s and p50/p99 over all its blocks' submits pooled,
        and per pair of adjacent blocks the ratio (on / off)."""
        a = self.args
        n_closed, n_paced = max(1, a.tasks // a.ab_blocks), max(1, a.rate_tasks // a.ab_blocks)
        blocks: dict[str, list[dict]] = {"no_quotas": [], "quotas": []}
        pooled: dict[str, dict[str, list]] = {k: {"closed": [], "paced": []} for k in blocks}
        walls: dict[str, float] = dict.fromkeys(blocks, 0.0)

        async def block(submit, n: int) -> tuple[dict, list[float], bool, int]:
            self.submits = []
            before = await self.total_assigns()
            async with Meter(self) as m:
                await submit()
            ok = await self.wait_assigns(before + len(self.submits), timeout=60 + n / 20)
            assigned = await self.collect_assign_times()
            lat = sorted((assigned[t] - t0) * 1000 for t, t0, _ in self.submits if t in assigned)
            return m.result, lat, ok, len(self.submits)

        await block(lambda: self.closed_loop(stub, 200, a.concurrency), 200)  # warm up
        for i in range(2 * a.ab_blocks):
            mode = ("no_quotas", "quotas")[i % 2] if (i // 2) % 2 == 0 else ("quotas", "no_quotas")[i % 2]
            await self.quota_mode(mode == "quotas")
            meter, closed, ok, n = await block(lambda: self.closed_loop(stub, n_closed, a.concurrency), n_closed)
            _, paced, pok, _ = await block(lambda: self.paced(stub, n_paced, a.rate), n_paced)
            wall = meter["wall_s"]
            pooled[mode]["closed"] += closed
            pooled[mode]["paced"] += paced
            walls[mode] += wall
            blocks[mode].append(
                {
                    "submits_per_s": n / wall,
                    "closed_p99_ms": pct(closed, 99),
                    "p50_ms": pct(paced, 50),
                    "p99_ms": pct(paced, 99),
                    "cpu_ms_per_submit": meter["scheduler_cpu_s"] / max(1, n) * 1000,
                    "others_cores": meter["others_cores"],
                    "all_assigned": ok and pok,
                    "limited_queues": self.limited_queues,
                }
            )
            self.progress(
                f"quota A/B block {i + 1} of {2 * a.ab_blocks} ({mode}): {n / wall:.0f} submits/s, "
                f"p99 @{a.rate:.0f}/s {pct(paced, 99):.1f} ms, others {meter['others_cores']:.2f} cores"
            )
        out: dict = {"blocks": blocks, "closed_per_block": n_closed, "paced_per_block": n_paced}
        for mode in blocks:
            closed, paced = sorted(pooled[mode]["closed"]), sorted(pooled[mode]["paced"])
            out[mode] = {
                "submits_per_s": len(closed) / walls[mode] if walls[mode] else math.nan,  # assigned ones
                "closed_p99_ms": pct(closed, 99),
                "p50_ms": pct(paced, 50),
                "p99_ms": pct(paced, 99),
                "cpu_ms_per_submit": statistics.median(b["cpu_ms_per_submit"] for b in blocks[mode]),
            }
        out["ratios"] = {k: out["quotas"][k] / out["no_quotas"][k] for k in out["quotas"]}
        out["pair_ratios"] = {
            k: sorted(b[k] / a_[k] for a_, b in zip(blocks["no_quotas"], blocks["quotas"]) if a_[k] > 0)
            for k in ("submits_per_s", "closed_p99_ms", "p50_ms", "p99_ms", "cpu_ms_per_submit")
        }
        self.results["phases"]["quota_ab"] = out

    async def phase_splice(self) -> None:
        """What the front on the gRPC port costs: the same closed-loop SubmitTask load, in
        alternating blocks, through the public port (the front splices to gRPC) and straight to
        the private loopback port gRPC listens on behind it, in the same scheduler at the same
        time, so that other work on the machine weighs on both alike."""
        a = self.args
        private = self.sched.private_port()
        if private is None:
            self.results["phases"]["splice"] = {"skipped": "no front (http_on_grpc_port off, or TLS)"}
            self.progress("splice: skipped, the scheduler runs no front")
            return
        targets = {"front": self.sched.target, "direct": f"127.0.0.1:{private}"}
        channels = {k: grpc.aio.insecure_channel(t) for k, t in targets.items()}
        stubs = {k: scheduler_pb2_grpc.SchedulerServiceStub(c) for k, c in channels.items()}
        blocks: dict[str, list[dict]] = {k: [] for k in targets}
        try:
            for k in targets:  # connect and warm up both
                self.submits = []
                await self.closed_loop(stubs[k], 200, a.concurrency)
            for i in range(2 * a.splice_blocks):
                k = ("front", "direct")[i % 2] if (i // 2) % 2 == 0 else ("direct", "front")[i % 2]  # ABBA
                self.submits = []
                t0 = time.monotonic()
                await self.closed_loop(stubs[k], a.splice_tasks, a.concurrency)
                wall = time.monotonic() - t0
                rpc = sorted((t1 - s0) * 1000 for _, s0, t1 in self.submits)
                blocks[k].append(
                    {"submits_per_s": len(self.submits) / wall, "rpc_p50_ms": pct(rpc, 50), "rpc_p99_ms": pct(rpc, 99)}
                )
        finally:
            for c in channels.values():
                await c.close()
        out = {"blocks": blocks, "tasks_per_block": a.splice_tasks, "concurrency": a.concurrency}
        for k, rows in blocks.items():
            for key in ("submits_per_s", "rpc_p50_ms", "rpc_p99_ms"):
                vals = sorted(r[key] for r in rows)
                out[f"{k}_{key}_median"] = vals[len(vals) // 2]
        out["submits_per_s_ratio"] = out["front_submits_per_s_median"] / out["direct_submits_per_s_median"]
        self.results["phases"]["splice"] = out
        self.progress(
            f"splice: front {out['front_submits_per_s_median']:.0f} submits/s (rpc p99 "
            f"{out['front_rpc_p99_ms_median']:.1f} ms), direct {out['direct_submits_per_s_median']:.0f} submits/s "
            f"(rpc p99 {out['direct_rpc_p99_ms_median']:.1f} ms), ratio {out['submits_per_s_ratio']:.3f}"
        )

    async def phase_deep_queue(self, stub) -> None:
        a = self.args
        slots = a.nodes * a.max_tasks
        await self.broadcast("hold", True)
        before = await self.total_assigns()
        self.submits = []
        await self.closed_loop(stub, slots, a.concurrency, gpu=False)  # CPU tasks fill every slot
        filled = await self.wait_assigns(before + slots, timeout=60 + slots / 20)
        await self.collect_assign_times()
        depth0 = await self.total_assigns()
        self.submits = []
        async with Meter(self) as m:
            await self.closed_loop(stub, a.backlog, a.concurrency)
        queued = await self.total_assigns() - depth0  # should be 0: nothing is free
        await asyncio.sleep(1.5)  # /metrics snapshot refresh
        depth = self.sched.metrics().get("opentinker_queue_depth", math.nan)
        backlog = list(self.submits)
        want = {t for t, _, _ in backlog}
        assigned: dict[str, float] = {}
        async with Meter(self) as d:
            await self.broadcast("release")
            deadline = time.monotonic() + 120 + a.backlog / 10
            while not want <= assigned.keys() and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
                assigned.update(await self.collect_assign_times())
        drained = want <= assigned.keys()
        waits = sorted(assigned[t] - d.t0 for t, _, _ in backlog if t in assigned)
        drain_wall = waits[-1] if waits else d.result["wall_s"]
        self.results["phases"]["deep_queue"] = {
            "fill": {"slots": slots, "filled": filled},
            "submit": {
                **m.result,
                "submitted": len(backlog),
                "submits_per_s": len(backlog) / m.result["wall_s"],
                "placed_while_full": queued,
                "queue_depth_after": depth,
            },
            "drain": {
                **d.result,
                "assigned": len(waits),
                "drain_s": drain_wall,
                "assigns_per_s": len(waits) / drain_wall if drain_wall else math.nan,
                "all_assigned": drained,
            },
        }
        self.progress(
            f"deep queue: {len(backlog) / m.result['wall_s']:.0f} submits/s into a queue {len(backlog)} deep; "
            f"drained at {len(waits) / drain_wall if drain_wall else math.nan:.0f} assigns/s"
        )

    async def phase_scale_signal(self, channel) -> None:
        """How fast the desired-trainers figure follows a burst of submits and its draining (see
        the module docstring, phase 5). Times are from samples: the RPC every 50 ms, /metrics
        every 100 ms, so each is late by up to that much."""
        from opentinker.scheduler.v1 import admin_pb2, admin_pb2_grpc

        a = self.args
        admin = admin_pb2_grpc.AdminServiceStub(channel)
        request = admin_pb2.GetDesiredTrainersRequest()

        async def by_rpc() -> int:
            resp = await admin.GetDesiredTrainers(request, metadata=self.admin_metadata, timeout=30)
            return sum(d.desired_trainers for d in resp.node_classes)

        async def by_metric() -> int:
            m = await asyncio.to_thread(self.sched.metrics)
            return int(sum(v for k, v in m.items() if k.startswith("opentinker_desired_trainers{")))

        samples: dict[str, list[tuple[float, int]]] = {"rpc": [], "metric": []}
        stop = asyncio.Event()

        async def poll(name: str, read, every: float) -> None:
            while not stop.is_set():
                t = time.monotonic()
                samples[name].append((t, await read()))
                await asyncio.sleep(max(0.0, every - (time.monotonic() - t)))

        def first(name: str, since: float, pred) -> float:
            """Seconds from ``since`` to the first sample at or after it that ``pred`` accepts."""
            return next((t - since for t, v in samples[name] if t >= since and pred(v)), math.nan)

        async def until(pred_rpc, pred_metric, timeout: float) -> bool:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                r, m = samples["rpc"][-1:], samples["metric"][-1:]
                if r and m and pred_rpc(r[0][1]) and pred_metric(m[0][1]):
                    return True
                await asyncio.sleep(0.05)
            return False

        await self.broadcast("hold", True)
        base_rpc, base_metric = await by_rpc(), await by_metric()
        settle = time.monotonic() + 10  # /metrics is a snapshot (about 1 s old): let it catch up first
        while base_metric != base_rpc and time.monotonic() < settle:
            await asyncio.sleep(0.1)
            base_rpc, base_metric = await by_rpc(), await by_metric()
        burst = a.scale_burst or 2 * a.nodes * a.max_tasks  # twice what the nodes hold at once
        spec = self.spec(1)  # one GPU each (a CPU task when the nodes have no GPUs)
        pollers = [
            asyncio.create_task(poll("rpc", by_rpc, 0.05)),
            asyncio.create_task(poll("metric", by_metric, 0.1)),
        ]
        before = await self.total_assigns()
        try:
            self.submits = []
            counter = iter(range(burst))

            async def lane() -> None:
                for _ in counter:
                    await self.submit_one(stub, spec)

            stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
            t0 = time.monotonic()
            await asyncio.gather(*(lane() for _ in range(a.concurrency)))
            t_end = time.monotonic()
            await asyncio.sleep(0.5)  # the figure of the whole burst, read once it is in
            peak = await by_rpc()
            reached = await until(lambda v: v == peak, lambda v: v == peak, 30)
            burst_wall = t_end - t0
            await self.broadcast("release")
            t_release = time.monotonic()
            drained = await self.wait_assigns(before + len(self.submits), timeout=60 + burst / 20)
            assigned = await self.collect_assign_times()
            t_drained = max((assigned[t] for t, _, _ in self.submits if t in assigned), default=t_release)
            back = await until(lambda v: v == base_rpc, lambda v: v == base_metric, 30)
        finally:
            stop.set()
            await asyncio.gather(*pollers, return_exceptions=True)
        out = {
            "burst_tasks": burst,
            "submitted": len(self.submits),
            "burst_wall_s": burst_wall,
            "desired_before": {"rpc": base_rpc, "metric": base_metric},
            "desired_at_burst": peak,
            "reached": reached,
            "drained": drained,
            "fell_back": back,
            "drain_s": t_drained - t_release,
            "samples": {k: len(v) for k, v in samples.items()},
            # (seconds from the first submit, value) at each change of each source
            "changes": {
                k: [(round(t - t0, 3), val) for i, (t, val) in enumerate(v) if i == 0 or val != v[i - 1][1]]
                for k, v in samples.items()
            },
            "release_s": t_release - t0,
            "drained_s": t_drained - t0,
        }
        for name, base in (("rpc", base_rpc), ("metric", base_metric)):
            out[f"{name}_change_from_first_submit_s"] = first(name, t0, lambda v, b=base: v != b)
            out[f"{name}_reach_from_first_submit_s"] = first(name, t0, lambda v: v == peak)
            out[f"{name}_reach_from_last_submit_s"] = first(name, t_end, lambda v: v == peak)
            out[f"{name}_fall_from_drained_s"] = first(name, t_drained, lambda v, b=base: v == b)
        self.results["phases"]["scale"] = out
        self.progress(f"scale signal: {scale_line(out)}")

    def progress(self, msg: str) -> None:
        print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)

    async def make_keys(self, admin_key_file: Path) -> str:
        """Sharing mode: a user key per owner (``owner-000`` ...) and a node key; returns the
        node key."""
        from opentinker.scheduler.v1 import admin_pb2, admin_pb2_grpc

        admin = self.admin_metadata = (("authorization", f"Bearer {admin_key_file.read_text().strip()}"),)
        async with grpc.aio.insecure_channel(self.sched.target) as channel:
            stub = admin_pb2_grpc.AdminServiceStub(channel)

            async def create(owner: str, role) -> str:
                req = admin_pb2.CreateApiKeyRequest(owner=owner, role=role)
                return (await stub.CreateApiKey(req, metadata=admin, timeout=60)).api_key

            keys = await asyncio.gather(
                *(create(f"owner-{o:03d}", admin_pb2.API_KEY_ROLE_USER) for o in range(self.args.owners))
            )
            self.owner_metadata = [(("authorization", f"Bearer {k}"),) for k in keys]
            return await create("bench-nodes", admin_pb2.API_KEY_ROLE_NODE)

    # --- run --------------------------------------------------------------------------------
    async def run(self) -> dict:
        a = self.args
        workdir = Path(tempfile.mkdtemp(prefix="opentinker-bench-"))
        self.results["workdir"] = str(workdir)
        self.sched = SchedulerProc(
            workdir,
            lease_s=a.lease,
            max_tasks=a.max_tasks,
            scheduler_path=a.scheduler_path,
            profile=a.profile,
            http_on_grpc_port=not a.no_http_on_grpc_port,
            extra_config=(sharing_config(a, self.queues) if a.owners else "") + self.store_config,
        )
        ctx = mp.get_context("spawn")
        ok = False
        try:
            self.sched.wait_healthy()
            self.results["store"] = self.sched.store()
            self.progress(
                f"scheduler pid {self.sched.pid} on {self.sched.target}, store {self.results['store']}; "
                f"log {self.sched.log_path}"
            )
            ids = [f"sim-node-{i:04d}" for i in range(a.nodes)]
            opts = {"gpus_per_node": a.gpus_per_node, "max_tasks": a.max_tasks}
            if a.owners:
                opts["api_key"] = await self.make_keys(workdir / "state" / "admin.key")
            for w in range(a.workers):
                parent, child = ctx.Pipe()
                p = ctx.Process(
                    target=worker_main, args=(child, self.sched.target, ids[w :: a.workers], opts), daemon=True
                )
                p.start()
                self.conns.append(parent)
                self.procs.append(p)
            deadline = time.monotonic() + 60 + a.nodes / 10
            while True:
                st = await self.worker_stats()
                reg, failed = sum(s["registered"] for s in st), sum(s["failed"] for s in st)
                if reg + failed >= a.nodes:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"only {reg} of {a.nodes} nodes registered")
                await asyncio.sleep(0.2)
            if failed:
                raise RuntimeError(f"{failed} node stream(s) failed: {[e for s in st for e in s['errors']]}")
            self.progress(f"{a.nodes} simulated nodes connected in {a.workers} worker process(es)")
            only = set(a.only.split(",")) if a.only else {"heartbeats", "throughput", "latency", "queue", "scale"}
            if "heartbeats" in only:
                await self.phase_heartbeats()
            else:
                await self.broadcast("hb", 1.0)
            channel = grpc.aio.insecure_channel(self.sched.target)
            stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
            if "throughput" in only and a.owners:  # sharing mode: no CPU yardstick (keys on)
                await self.phase_throughput(stub)
            elif "throughput" in only:
                await self.phase_unary(channel)
                await self.phase_throughput(stub)
                await self.phase_unary(channel, name="unary_after")
                self.cpu_ratio()
            if "latency" in only:
                await self.phase_latency(stub)
            if a.backlog and "queue" in only:
                await self.phase_deep_queue(stub)
            if "scale" in only:
                await self.phase_scale_signal(channel)
            if "splice" in only:
                await self.phase_splice()
            if "quota_ab" in only:
                await self.phase_quota_ab(stub)
            # Every task should end SUCCEEDED; /metrics counts refresh about once a second.
            deadline = time.monotonic() + 30
            while True:
                await asyncio.sleep(0.5)
                m = self.sched.metrics()
                if (
                    m.get('opentinker_tasks{state="succeeded"}', 0) >= self.total_submitted
                    or time.monotonic() > deadline
                ):
                    break
            self.results["final"] = {
                "submitted": self.total_submitted,
                "succeeded": m.get('opentinker_tasks{state="succeeded"}', math.nan),
                "not_finished": sum(
                    v for k, v in m.items() if k.startswith("opentinker_tasks{") and "succeeded" not in k
                ),
                "submit_errors": sum(self.submit_codes.values()),
                "submit_error_codes": dict(self.submit_codes),
                "refused_with_retry_info": self.refused_with_retry_info,
                "first_submit_errors": list({e.split(":")[0]: e for e in reversed(self.submit_errors)}.values())[::-1][
                    :5
                ],
                "reassigns": sum(s["reassigns"] for s in await self.worker_stats()),
                "node_errors": [e for s in await self.worker_stats() for e in s["errors"]],
            }
            await channel.close()
            ok = True
        finally:
            if self.conns:
                with_timeout = [asyncio.wait_for(self._ask(c, "stop"), 10) for c in self.conns]
                await asyncio.gather(*with_timeout, return_exceptions=True)
            for p in self.procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
            self.sched.stop()
            if ok and not a.keep:
                shutil.rmtree(workdir, ignore_errors=True)
                self.results["workdir"] = None
        return self.results


# ---------------------------------------------------------------------------------------------
# Report


def scale_line(sc: dict) -> str:
    """The scale phase in one line."""

    def ms(key: str) -> str:
        return f"{sc[key] * 1000:.0f}"

    return (
        f"burst of {sc['submitted']} in {sc['burst_wall_s']:.2f} s, desired trainers {sc['desired_before']['rpc']} -> "
        f"{sc['desired_at_burst']}; GetDesiredTrainers changed {ms('rpc_change_from_first_submit_s')} ms after the "
        f"first submit, reached it {ms('rpc_reach_from_last_submit_s')} ms after the last; /metrics "
        f"{ms('metric_change_from_first_submit_s')} / {ms('metric_reach_from_last_submit_s')} ms; drained "
        f"{sc['drain_s']:.2f} s after release, then back in {ms('rpc_fall_from_drained_s')} ms (RPC), "
        f"{ms('metric_fall_from_drained_s')} ms (/metrics)"
    )


def report(args, res: dict) -> str:
    def verdict(ok: bool) -> str:
        if args.quick:
            return "(quick run)"
        return "meets goal" if ok else "MISSES goal"

    P = res["phases"]
    ncpu = os.cpu_count()
    lines = [
        "",
        "OpenTinker scheduler scale benchmark",
        f"  date {dt.datetime.now().astimezone().isoformat(timespec='seconds')}; {platform.node()}; {ncpu} CPU(s) "
        f"({platform.processor() or platform.machine()}); Python "
        f"{platform.python_version()}; grpcio {grpc.__version__}",
        f"  {args.nodes} simulated nodes ({args.gpus_per_node} simulated GPUs, max_tasks {args.max_tasks} each) in "
        f"{args.workers} worker process(es); scheduler is a separate process",
        "",
    ]
    if not all(k in P for k in ("unary", "throughput", "latency", "steady", "flood")):
        return json.dumps(P, indent=1, default=str)  # a partial run (--only): raw figures
    tp, lt, st, fl = P["throughput"], P["latency"], P["steady"], P["flood"]
    hb_rate = fl["ingested_per_s"]
    hb_capped = fl["ingested_per_s"] >= 0.97 * fl["offered_per_s"]
    rows = [
        (
            "submits/s",
            f"{tp['submits_per_s']:.0f}",
            f">= {GOALS['submits_per_s']:.0f}",
            verdict(tp["submits_per_s"] >= GOALS["submits_per_s"]),
            f"{tp['submitted']} tasks, closed loop, {tp['concurrency']} in flight (differs by machine: compare "
            "the CPU ratio below)",
        ),
        (
            "CPU per submit / empty call",
            f"{tp['cpu_ratio_to_unary']:.2f}x",
            f"<= {GOALS['cpu_ratio']:.0f}x",
            verdict(tp["cpu_ratio_to_unary"] <= GOALS["cpu_ratio"]),
            f"scheduler CPU {tp['cpu_ms_per_submit']:.3f} ms per submit (the task's whole life) vs "
            f"{tp['cpu_ms_per_unary']:.3f} ms per Health/Check (before {P['unary']['cpu_ms_per_call']:.3f}, after "
            f"{P['unary_after']['cpu_ms_per_call']:.3f}), same run and concurrency, net of rest",
        ),
        (
            "submit->assign p50/p99",
            f"{lt['p50_ms']:.1f} / {lt['p99_ms']:.1f} ms",
            f"p99 < {GOALS['p99_ms']:.0f} ms",
            verdict(lt["p99_ms"] < GOALS["p99_ms"]),
            f"{lt['submitted']} tasks paced at {lt['offered_rate']:.0f}/s (achieved {lt['achieved_rate']:.0f}/s"
            + "".join(f"; {n} {c}" for c, n in sorted(lt.get("errors", {}).items()))
            + ")",
        ),
        (
            "heartbeats/s ingested",
            f"{hb_rate:.0f}" + (" (all offered)" if hb_capped else ""),
            f">= {GOALS['heartbeats_per_s']:.0f}",
            verdict(hb_rate >= GOALS["heartbeats_per_s"]),
            f"flood: {fl['offered_per_s']:.0f}/s offered by {args.nodes} streams; {fl['ingested_source']}",
        ),
        (
            "CPU s per 1000 heartbeats",
            f"{st['cpu_s_per_1000_hb']:.3f}",
            "(no goal)",
            "",
            f"steady 1/s per node, {st['ingested_per_s']:.0f}/s; {st['cpu_s_per_1000_hb_net']:.3f} net of idle; "
            f"flood {fl['cpu_s_per_1000_hb']:.3f}",
        ),
    ]
    w = [max(len(r[i]) for r in rows + [("figure", "measured", "goal", "", "")]) for i in range(4)]
    lines.append(f"  {'figure':<{w[0]}}  {'measured':<{w[1]}}  {'goal':<{w[2]}}  {'':<{w[3]}}  how")
    for r in rows:
        lines.append(f"  {r[0]:<{w[0]}}  {r[1]:<{w[1]}}  {r[2]:<{w[2]}}  {r[3]:<{w[3]}}  {r[4]}")
    lines += [
        "",
        "  more:",
        f"    submit->assign under the closed loop: p50 {tp['p50_ms']:.1f} "
        f"ms, p99 {tp['p99_ms']:.1f} ms, max {tp['max_ms']:.1f} ms"
        f" (SubmitTask RPC p50 {tp['rpc_p50_ms']:.1f} ms, p99 {tp['rpc_p99_ms']:.1f} ms)",
        f"    submit->assign at {lt['offered_rate']:.0f}/s: p90 {lt['p90_ms']:.1f} ms, max {lt['max_ms']:.1f} ms; "
        f"worst dispatch lag of the pacer {lt['worst_dispatch_lag_ms']:.1f} ms",
        f"    heartbeats: scheduler CPU idle {P['idle']['scheduler_cpu_frac']:.1%} "
        f"of a core, steady {st['scheduler_cpu_frac']:.1%}, "
        f"flood {fl['scheduler_cpu_frac']:.1%}; flood at 1000 ingested per {fl['cpu_s_per_1000_hb']:.3f} CPU s "
        f"= {1000 / fl['cpu_s_per_1000_hb']:.0f} heartbeats per CPU-second",
    ]
    if "deep_queue" in P:
        dq = P["deep_queue"]
        lines.append(
            f"    deep queue: {dq['submit']['submitted']} submits into "
            f"a full cluster at {dq['submit']['submits_per_s']:.0f}/s "
            f"(queue depth after: {dq['submit']['queue_depth_after']:.0f}, "
            f"placed while full: {dq['submit']['placed_while_full']}); "
            f"drained {dq['drain']['assigned']} at {dq['drain']['assigns_per_s']:.0f} assigns/s"
        )
    if "scale" in P:
        lines.append(f"    scale signal: {scale_line(P['scale'])}")
    fin = res.get("final", {})
    lines.append(
        f"    tasks: {fin.get('submitted')} submitted, {fin.get('succeeded', math.nan):.0f} succeeded, "
        f"{fin.get('not_finished', math.nan):.0f} in other states; submit errors {fin.get('submit_errors')} "
        f"{fin.get('submit_error_codes') or ''} ({fin.get('refused_with_retry_info')} refusals with RetryInfo); "
        f"re-assignments {fin.get('reassigns')}; node stream errors {len(fin.get('node_errors', []))}"
    )
    for err in fin.get("first_submit_errors", []) + fin.get("node_errors", [])[:3]:
        lines.append(f"      error: {err}")
    lines += [
        "",
        "  CPU per phase (cores busy; the machine may run other work):",
        f"    {'phase':<12} {'wall s':>7} {'scheduler':>9} "
        f"{'driver':>7} {'node sims':>14} {'others':>7} {'machine':>8}",
    ]
    sat = []
    phase_rows = [(k, P[k]) for k in ("idle", "steady", "flood", "unary", "throughput", "unary_after", "latency")]
    if "deep_queue" in P:
        phase_rows += [("queue-fill", P["deep_queue"]["submit"]), ("queue-drain", P["deep_queue"]["drain"])]
    for name, r in phase_rows:
        wk = "+".join(f"{x:.2f}" for x in r["worker_cpu_frac"])
        lines.append(
            f"    {name:<12} {r['wall_s']:>7.1f} {r['scheduler_cpu_frac']:>9.2f} {r['driver_cpu_frac']:>7.2f} {wk:>14} "
            f"{r['others_cores']:>7.2f} {r['machine_busy_cores']:>6.2f}/{ncpu}"
        )
        if max([r["driver_cpu_frac"], *r["worker_cpu_frac"]]) > 0.9:
            sat.append(f"{name}: a load-generator process used > 90% of a core, so it may have limited the figures")
        if r["machine_busy_cores"] > 0.95 * (ncpu or 1):
            sat.append(f"{name}: the machine was saturated ({r['machine_busy_cores']:.2f} of {ncpu} cores busy)")
    if args.quick:
        sat.insert(0, "--quick: tiny numbers for a smoke run; the figures are not comparable with the goals")
    if sat:
        lines += ["", "  caveats:"] + [f"    - {s}" for s in sat]
    lines.append("")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--nodes", type=int, default=200, help="simulated nodes, one Connect stream each (default 200, up to ~1000)"
    )
    p.add_argument("--tasks", type=int, default=10_000, help="tasks submitted in the throughput phase (default 10000)")
    p.add_argument("--quick", action="store_true", help="tiny numbers for a smoke run (a few seconds)")
    p.add_argument(
        "--workers", type=int, default=None, help="node simulator processes (default: 1 up to 50 nodes, else 2)"
    )
    p.add_argument("--gpus-per-node", type=int, default=2)
    p.add_argument("--max-tasks", type=int, default=4, help="max_tasks of every simulated node")
    p.add_argument("--concurrency", type=int, default=16, help="SubmitTask calls in flight in the closed-loop phases")
    p.add_argument(
        "--unary-calls",
        type=int,
        default=None,
        help="empty unary calls (Health/Check) measured as the CPU yardstick (default: --tasks)",
    )
    p.add_argument("--rate", type=float, default=None, help="offered submits/s of the latency phase (default: goal)")
    p.add_argument("--rate-tasks", type=int, default=None, help="tasks of the latency phase (default: 10 s at --rate)")
    p.add_argument(
        "--backlog", type=int, default=None, help="tasks queued behind a full cluster (default: --tasks; 0 skips)"
    )
    p.add_argument("--hb-seconds", type=float, default=10.0, help="length of the steady heartbeat phase")
    p.add_argument("--idle-seconds", type=float, default=3.0)
    p.add_argument("--flood-rate", type=float, default=5000.0, help="heartbeats/s offered in all during the flood")
    p.add_argument("--flood-seconds", type=float, default=5.0)
    p.add_argument("--lease", type=float, default=10.0, help="lease of the scheduler config (heartbeat_interval is 1)")
    p.add_argument(
        "--no-http-on-grpc-port",
        action="store_true",
        help="http_on_grpc_port: false (gRPC owns its port, no splicing front): to measure what the front costs",
    )
    p.add_argument(
        "--queues", type=int, default=0, help="sharing mode: quota queues of the run with quotas (with --owners)"
    )
    p.add_argument(
        "--owners",
        type=int,
        default=0,
        help="sharing mode: owners (API keys) submitting in turn; runs throughput and latency without and with "
        "--queues quota queues and reports the ratios",
    )
    p.add_argument(
        "--repeat", type=int, default=3, help="sharing and backends modes: runs of each configuration (medians)"
    )
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    p.add_argument("--keep", action="store_true", help="keep the scheduler's state folder and log")
    p.add_argument(
        "--scheduler-path", default=None, help="import opentinker_scheduler from this folder (to compare versions)"
    )
    p.add_argument(
        "--profile", type=Path, default=None, help="run the scheduler under cProfile, writing its stats here"
    )
    p.add_argument(
        "--only",
        default=None,
        help="comma-separated phases to run after the heartbeats: throughput,latency,queue,splice "
        "(splice: the front on the gRPC port against gRPC's private port, alternating blocks; only when named)",
    )
    p.add_argument(
        "--scale-burst",
        type=int,
        default=0,
        help="one-GPU tasks of the scale phase's burst (default: 2x the nodes' task slots)",
    )
    p.add_argument(
        "--ab-blocks",
        type=int,
        default=0,
        help="sharing mode: instead of fresh schedulers per configuration, one scheduler with the quota queues "
        "switched on and off between this many blocks each (ABBA; --tasks and --rate-tasks split over them)",
    )
    p.add_argument(
        "--backends",
        action="store_true",
        help="B1 on SQLite and on PostgreSQL (a fresh server on loopback) in one run, --repeat blocks each, "
        "ABBA; the latency phase at half SQLite's measured capacity unless --rate is given",
    )
    p.add_argument(
        "--pg-synchronous-commit",
        choices=["on", "off"],
        default="on",
        help="backends mode: store.synchronous_commit of the PostgreSQL scheduler (default %(default)s, the config's)",
    )
    p.add_argument("--splice-blocks", type=int, default=3, help="blocks per target in the splice phase")
    p.add_argument("--splice-tasks", type=int, default=2000, help="submits per block in the splice phase")
    a = p.parse_args(argv)
    a.rate_given = a.rate is not None  # backends mode: else half SQLite's measured capacity
    if a.rate is None:
        a.rate = GOALS["submits_per_s"]
    if a.quick:
        a.nodes = min(a.nodes, 8)
        a.tasks = min(a.tasks, 200)
        a.rate = min(a.rate, 100.0)
        a.rate_tasks = a.rate_tasks or 100
        a.backlog = 100 if a.backlog is None else min(a.backlog, 100)
        a.hb_seconds, a.idle_seconds, a.flood_seconds = 1.0, 0.3, 0.5
        a.flood_rate = min(a.flood_rate, 200.0)
        a.concurrency = min(a.concurrency, 8)
        a.splice_tasks, a.splice_blocks = min(a.splice_tasks, 100), min(a.splice_blocks, 1)
    if a.workers is None:
        a.workers = 1 if a.nodes <= 50 else 2
    a.workers = max(1, min(a.workers, a.nodes))
    if a.rate_tasks is None:
        a.rate_tasks = int(a.rate * 10)
    if a.unary_calls is None:
        a.unary_calls = a.tasks
    if a.backlog is None:
        a.backlog = a.tasks
    if a.idle_seconds >= a.lease - 1:
        p.error("--idle-seconds must be well under --lease (silent nodes would be lost)")
    return a


def sharing(args: argparse.Namespace) -> dict:
    """Sharing mode: the throughput and latency phases without and with quota queues."""
    if args.ab_blocks:
        return sharing_ab(args)
    args.only = args.only or "throughput,latency,scale"
    order = [("no_quotas", 0), ("quotas", args.queues)]
    blocks: dict[str, list[dict]] = {"no_quotas": [], "quotas": []}
    for rep in range(args.repeat):  # ABBA...: drift of a shared machine weighs on both alike
        for name, queues in order if rep % 2 == 0 else order[::-1]:
            bench = Bench(args, queues=queues)
            bench.progress(f"--- run {name} ({rep + 1} of {args.repeat}): {args.owners} owners, {queues} quota queues")
            blocks[name].append(asyncio.run(bench.run()))

    def median_phases(results: list[dict]) -> dict:
        out: dict = {}
        for phase in ("throughput", "latency"):
            rows = [r["phases"][phase] for r in results if phase in r["phases"]]
            if not rows:
                continue
            out[phase] = {
                k: sorted(row[k] for row in rows)[len(rows) // 2]
                for k in ("submits_per_s", "p50_ms", "p99_ms")
                if all(isinstance(row.get(k), (int, float)) for row in rows)
            }
        scale = [r["phases"]["scale"] for r in results if "scale" in r["phases"]]
        if scale:
            out["scale"] = {
                k: sorted(row[k] for row in scale)[len(scale) // 2]
                for k in scale[0]
                if k.endswith("_s") and all(isinstance(row.get(k), (int, float)) for row in scale)
            }
            out["scale"]["desired"] = [(row["desired_before"]["rpc"], row["desired_at_burst"]) for row in scale]
        return out

    runs = {
        name: {"phases": median_phases(rs), "blocks": rs, "final": rs[-1].get("final", {})}
        for name, rs in blocks.items()
    }
    P0, P1 = runs["no_quotas"]["phases"], runs["quotas"]["phases"]
    out = {"runs": runs, "ratios": {}, "pair_ratios": {}}
    r, pairs = out["ratios"], out["pair_ratios"]
    rows = (
        ("closed-loop submits/s", "throughput", "submits_per_s", "submits_per_s", ">= 0.9x"),
        ("  submit->assign p99 ms", "throughput", "p99_ms", "throughput_p99", ""),
        (f"submit->assign p99 ms @{args.rate:.0f}/s", "latency", "p99_ms", "latency_p99", "<= 1.2x"),
        ("  submit->assign p50 ms", "latency", "p50_ms", "latency_p50", ""),
    )
    for _, phase, key, name, _ in rows:
        if phase in P0 and phase in P1:
            r[name] = P1[phase][key] / P0[phase][key]
            # Run i of one configuration against run i of the other: the two ran back to back
            # (ABBA), so the load of a shared machine weighs on both sides of each ratio alike.
            pairs[name] = sorted(
                b["phases"][phase][key] / a["phases"][phase][key]
                for a, b in zip(blocks["no_quotas"], blocks["quotas"])
                if a["phases"][phase][key] > 0
            )
    lines = [
        "",
        f"OpenTinker scheduler, sharing mode: {args.owners} owners (API keys), {args.nodes} simulated nodes "
        f"({args.gpus_per_node} GPUs, max_tasks {args.max_tasks}); {os.cpu_count()} CPU(s); medians of "
        f"{args.repeat} run(s) each, ABBA order; 'pairs': the median (min-max) of the {args.repeat} ratios of "
        "back-to-back runs",
        f"  {'':<28}{'no quotas':>12}{f'{args.queues} queues':>12}{'ratio':>8}{'pairs':>8}  {'(min-max)':<14} goal",
    ]
    for label, phase, key, name, goal in rows:
        if name not in r:
            continue
        pr = pairs[name]
        spread = f"({pr[0]:.2f}-{pr[-1]:.2f})" if pr else ""
        lines.append(
            f"  {label:<28}{P0[phase][key]:>12.1f}{P1[phase][key]:>12.1f}{r[name]:>7.2f}x"
            f"{pr[len(pr) // 2] if pr else math.nan:>7.2f}x  {spread:<14} {goal}"
        )
    for name in runs:
        sc = runs[name]["phases"].get("scale")
        if sc:
            ms = {k: f"{v * 1000:.0f}" for k, v in sc.items() if k.endswith("_s")}
            lines.append(
                f"  scale signal, {name} (medians): desired trainers {sc['desired']}; GetDesiredTrainers changed "
                f"{ms['rpc_change_from_first_submit_s']} ms after the burst's first submit, reached the burst's "
                f"figure {ms['rpc_reach_from_last_submit_s']} ms after its last (burst {sc['burst_wall_s']:.2f} s); "
                f"/metrics {ms['metric_change_from_first_submit_s']} / {ms['metric_reach_from_last_submit_s']} ms; "
                f"fell back {ms['rpc_fall_from_drained_s']} ms (RPC) / {ms['metric_fall_from_drained_s']} ms "
                "(/metrics) after the last assignment"
            )
    for name in runs:
        errors = runs[name].get("final", {}).get("submit_error_codes")
        if errors:
            lines.append(f"  {name}: submit errors {errors}")
    out["report"] = "\n".join(lines)
    return out


def backends(args: argparse.Namespace) -> dict:
    """Backends mode (``--backends``): B1 on SQLite and on PostgreSQL in one run. A fresh
    PostgreSQL 15 on loopback (fsync on, as ``scripts/bench_ha.py``), the scheduler with
    ``store: {kind: postgres}`` and its defaults (synchronous_commit on, or
    ``--pg-synchronous-commit``). First one
    SQLite run of the throughput phase measures SQLite's closed-loop capacity; the latency phase
    then offers half of it (unless ``--rate`` is given), as the goal says. Then ``--repeat``
    blocks of each backend in ABBA order, each a fresh scheduler: heartbeats, throughput and
    latency (``--only`` to choose). Ratios are PostgreSQL over SQLite, of the medians and of back-to-back pairs.

    Goals (issue "several schedulers on PostgreSQL"): closed-loop submits/s >= 0.7x SQLite's,
    submit->assign p99 < 50 ms at half SQLite's capacity.

    Raises:
        SystemExit: PostgreSQL is not installed.
    """
    from tests.support import postgres as pgsupport  # REPO is on sys.path (above)

    bindir = pgsupport.find_bindir()
    if bindir is None:
        raise SystemExit("PostgreSQL is not installed (pg_config --bindir): apt-get install -y postgresql")
    pgsupport._SETTINGS.update({"fsync": "on", "full_page_writes": "on"})
    server = pgsupport.PostgresServer(bindir)
    try:
        if not args.rate_given:
            only, args.only = args.only, "throughput"
            calib = Bench(args)
            calib.progress("--- calibration: SQLite's closed-loop capacity")
            got = asyncio.run(calib.run())
            args.only = only
            args.rate = round(got["phases"]["throughput"]["submits_per_s"] / 2)
            args.rate_tasks = args.rate_tasks if args.quick else int(args.rate * 10)
        args.only = args.only or "heartbeats,throughput,latency"
        order = [("sqlite", ""), ("postgres", None)]
        blocks: dict[str, list[dict]] = {"sqlite": [], "postgres": []}
        for rep in range(args.repeat):
            for name, store in order if rep % 2 == 0 else order[::-1]:
                if store is None:
                    store = (
                        f'store:\n  kind: postgres\n  dsn: "{server.dsn()}"\n'
                        f"  schema: {server.new_schema('b1')}\n"
                        f"  synchronous_commit: {'true' if args.pg_synchronous_commit == 'on' else 'false'}\n"
                    )
                bench = Bench(args, store_config=store)
                bench.progress(f"--- run {name} ({rep + 1} of {args.repeat}), latency phase at {args.rate:.0f}/s")
                blocks[name].append(asyncio.run(bench.run()))
    finally:
        server.close()
    rows = (
        ("closed-loop submits/s", "throughput", "submits_per_s", ">= 0.7x"),
        ("  submit->assign p99 ms (saturated)", "throughput", "p99_ms", ""),
        (f"submit->assign p99 ms @{args.rate:.0f}/s", "latency", "p99_ms", "< 50 ms"),
        ("  submit->assign p50 ms", "latency", "p50_ms", ""),
        ("  achieved submits/s", "latency", "achieved_rate", ""),
        ("heartbeats/s ingested (flood)", "flood", "ingested_per_s", ""),
    )
    med = {
        name: {
            (phase, key): statistics.median(b["phases"][phase][key] for b in bs)
            for _, phase, key, _ in rows
            if all(phase in b["phases"] for b in bs)
        }
        for name, bs in blocks.items()
    }
    lines = [
        "",
        f"OpenTinker scheduler, SQLite against PostgreSQL (fsync on, synchronous_commit "
        f"{args.pg_synchronous_commit}): "
        f"{args.nodes} simulated nodes; {os.cpu_count()} CPU(s); medians of {args.repeat} run(s) each, ABBA; "
        f"'pairs': median (min-max) of the back-to-back ratios",
        f"  {'':<38}{'SQLite':>10}{'PostgreSQL':>12}{'ratio':>8}{'pairs':>8}  {'(min-max)':<14} goal",
    ]
    out: dict = {"rate": args.rate, "blocks": blocks, "ratios": {}, "pair_ratios": {}}
    for label, phase, key, goal in rows:
        if (phase, key) not in med["sqlite"] or (phase, key) not in med["postgres"]:
            continue
        a, b = med["sqlite"][(phase, key)], med["postgres"][(phase, key)]
        pairs = sorted(
            y["phases"][phase][key] / x["phases"][phase][key]
            for x, y in zip(blocks["sqlite"], blocks["postgres"])
            if x["phases"][phase][key] > 0
        )
        out["ratios"][f"{phase}.{key}"] = b / a if a else math.nan
        out["pair_ratios"][f"{phase}.{key}"] = pairs
        spread = f"({pairs[0]:.2f}-{pairs[-1]:.2f})" if pairs else ""
        lines.append(
            f"  {label:<38}{a:>10.1f}{b:>12.1f}{(b / a if a else math.nan):>7.2f}x"
            f"{pairs[len(pairs) // 2] if pairs else math.nan:>7.2f}x  {spread:<14} {goal}"
        )
    for name, bs in blocks.items():
        errors = [b.get("final", {}).get("submit_error_codes") for b in bs]
        if any(errors):
            lines.append(f"  {name}: submit errors {errors}")
    out["report"] = "\n".join(lines)
    return out


def sharing_ab(args: argparse.Namespace) -> dict:
    """Sharing mode with ``--ab-blocks``: quotas on and off in one scheduler, alternating blocks."""
    args.only = "quota_ab"
    res = asyncio.run(Bench(args, queues=0).run())
    q = res["phases"]["quota_ab"]
    off, on, r, pairs = q["no_quotas"], q["quotas"], q["ratios"], q["pair_ratios"]
    lines = [
        "",
        f"OpenTinker scheduler, sharing mode, quotas on/off in one scheduler: {args.owners} owners (API keys), "
        f"{args.queues} queues when on, {args.nodes} simulated nodes ({args.gpus_per_node} GPUs, max_tasks "
        f"{args.max_tasks}); {os.cpu_count()} CPU(s); {args.ab_blocks} blocks each, ABBA, each block "
        f"{q['closed_per_block']} closed-loop + {q['paced_per_block']} paced submits; figures over all blocks "
        "pooled, 'pairs': the median (min-max) of adjacent blocks' ratios",
        f"  {'':<28}{'no quotas':>12}{f'{args.queues} queues':>12}{'ratio':>8}{'pairs':>8}  {'(min-max)':<14} goal",
    ]
    for label, key, goal in (
        ("closed-loop submits/s", "submits_per_s", ">= 0.9x"),
        ("  submit->assign p99 ms", "closed_p99_ms", ""),
        (f"submit->assign p99 ms @{args.rate:.0f}/s", "p99_ms", "<= 1.2x"),
        ("  submit->assign p50 ms", "p50_ms", ""),
        ("scheduler CPU ms per submit", "cpu_ms_per_submit", ""),
    ):
        pr = pairs[key]
        spread = f"({pr[0]:.2f}-{pr[-1]:.2f})" if pr else ""
        lines.append(
            f"  {label:<28}{off[key]:>12.2f}{on[key]:>12.2f}{r[key]:>7.2f}x"
            f"{pr[len(pr) // 2] if pr else math.nan:>7.2f}x  {spread:<14} {goal}"
        )
    errors = res.get("final", {}).get("submit_error_codes")
    if errors:
        lines.append(f"  submit errors {errors}")
    return {"runs": {"ab": res}, "ratios": r, "pair_ratios": pairs, "report": "\n".join(lines)}


def write_sharing_result(args: argparse.Namespace, res: dict) -> None:
    """The sharing mode's row: quotas over none, closed-loop submits/s and p99 at ``--rate``."""
    r, pairs = res["ratios"], res["pair_ratios"]
    # sharing() names the paced p99 latency_p99; sharing_ab() names it p99_ms.
    p99 = "latency_p99" if "latency_p99" in r else "p99_ms"
    ratios = [
        {"label": "closed-loop submits/s, quotas / none", "value": r.get("submits_per_s")},
        {
            "label": f"submit->assign p99 at {args.rate:.0f}/s, quotas / none (lower is better)",
            "value": r.get(p99),
        },
    ]
    write_result(
        "scheduler-quotas",
        what=f"Submits/s and p99 with {args.queues} quota queues and {args.owners} owners",
        peer="no quotas, same run, ABBA order",
        ratios=[{**x, "value": None if x["value"] is None else round(x["value"], 2)} for x in ratios],
        goal="submits/s >= 0.9x; p99 <= 1.2x",
        settings=res["args"],
        make="make bench-sharing",
        details={"pair_ratios": {k: [round(x, 2) for x in v] for k, v in pairs.items() if k in ("submits_per_s", p99)}},
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    mode = backends if args.backends else sharing if args.owners else None
    if mode is not None:
        res = mode(args)
        res["args"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        print(res["report"], flush=True)
        if args.json:
            args.json.write_text(json.dumps(res, indent=2, default=str))
        closed = res.get("ratios", {}).get("throughput.submits_per_s")
        if mode is backends and closed is not None:
            pairs = res["pair_ratios"]["throughput.submits_per_s"]
            write_result(
                "scheduler-postgres-sqlite",
                what="B1: closed-loop submits/s with the task table on PostgreSQL (fsync and synchronous_commit on)",
                peer="the same on SQLite, same run, blocks in ABBA order",
                ratios=[{"label": "closed-loop submits/s, PostgreSQL / SQLite (medians)", "value": round(closed, 2)}],
                goal=">= 0.7x",
                settings=res["args"],
                make="make bench-backends BENCH_ARGS='--only throughput,latency --rate 442'",
                details={"pair_ratios": [round(x, 2) for x in pairs]},
            )
        if mode is sharing:
            write_sharing_result(args, res)
        return 0
    res = asyncio.run(Bench(args).run())
    res["args"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    res["goals"] = GOALS
    print(report(args, res), flush=True)
    if args.json:
        args.json.write_text(json.dumps(res, indent=2, default=str))
    tp = res["phases"].get("throughput", {})
    if "cpu_ratio_to_unary" in tp and not args.quick:
        write_result(
            "scheduler-submit-cpu",
            what="Scheduler CPU per submitted task (its whole life: call, placement, assignment, two reports)",
            peer="one empty unary gRPC call (grpc.health.v1.Health/Check), same loop and concurrency",
            ratios=[
                {
                    "label": "CPU per submit / per empty call (lower is better)",
                    "value": round(tp["cpu_ratio_to_unary"], 2),
                }
            ],
            goal=f"<= {GOALS['cpu_ratio']:.0f}x",
            settings=res["args"],
            make="make bench-scheduler",
            details={
                "submits_per_s": round(tp.get("submits_per_s", 0)),
                "cpu_ms_per_submit": tp.get("cpu_ms_per_submit"),
            },
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
