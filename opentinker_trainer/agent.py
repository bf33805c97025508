"""The node agent: one ``NodeService.Connect`` stream to the scheduler, worker processes per task.

* Registers its devices (NVML, or simulated) and the tasks it still runs, then heartbeats
  telemetry every ``heartbeat_interval`` the scheduler gives.
* Each assignment runs in a fresh worker process (``python -m opentinker_trainer.worker``,
  never a fork of this process, which holds a gRPC channel) in its own process group with
  ``CUDA_VISIBLE_DEVICES`` set to the GPUs' NVML UUIDs (``CUDA_DEVICE_ORDER=PCI_BUS_ID``); the
  worker's JSON-line reports become ``TaskReport`` messages.
* Cancel = SIGTERM to the worker's process group, then SIGKILL after a grace period; the
  cancel is reported only once the process is gone. A worker still storing its exit checkpoint
  when the grace ends (its ``storing exit checkpoint`` phase, until the ``checkpoint`` line) is
  waited for, so a large checkpoint or a slow store does not lose it.
* A broken stream is retried with exponential backoff and full jitter, at most
  ``FAILOVER_BACKOFF_MAX_S`` apart for :data:`FAILOVER_WINDOW_S` after a registered session broke
  (a scheduler failover: the new leader is about a second away); running workers keep going
  and are re-announced on reconnect. Final reports of recent attempts travel in every
  ``Register`` (the scheduler applies each once), so an attempt that ended while the scheduler
  was down is not lost.
* SIGTERM to the agent = drain: workers are asked to checkpoint and stop, are handed back to
  the scheduler, then the agent says goodbye and exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import random
import signal
import socket
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import structlog

from opentinker.common.v1 import common_pb2
from opentinker.node.v1 import node_pb2, node_pb2_grpc

from opentinker_trainer.context import STORING_PHASE
from opentinker_trainer.process_env import HOST, WORKER, process_env
from opentinker_trainer.scheduler_link import worker_env
from opentinker_trainer.tracking import writable_loggers
from opentinker_trainer.devices import DeviceMonitor, cuda_visible_devices
from opentinker_trainer.inference.address import default_advertise_host
from opentinker_common.net.grpc_options import message_limits, node_keepalive
from opentinker_common.net.leader import FAILOVER_BACKOFF_MAX_S, SchedulerTargets, not_leader

log = structlog.get_logger("opentinker.trainer")

VERSION = "0.1.0"
#: Keepalive agreed with the scheduler (which accepts pings every 10 s or slower, without calls).
CHANNEL_OPTIONS = [*node_keepalive(), *message_limits()]

_ENDED = (common_pb2.TASK_STATE_SUCCEEDED, common_pb2.TASK_STATE_FAILED, common_pb2.TASK_STATE_CANCELLED)
#: Seconds after a registered session broke during which reconnections come at most
#: ``FAILOVER_BACKOFF_MAX_S`` apart (a failover through a balancer shows as ``Socket closed``
#: and refused connections, not as a follower naming the leader).
FAILOVER_WINDOW_S = 15.0

_FATAL = {grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAUTHENTICATED}


@dataclass(frozen=True)
class AgentConfig:
    """Node agent settings. Times in seconds."""

    target: str  # host:port of the scheduler (the first of ``targets``)
    node_id: str
    max_tasks: int = 4
    work_dir: Path = Path("runs")
    simulate_gpus: int = 0
    simulate_gpu_memory_bytes: int = 80 * 1024**3  # each simulated GPU's (--simulate-gpu-memory)
    kill_grace_s: float = 10.0
    reconnect_initial_s: float = 0.5
    reconnect_max_s: float = 15.0
    outbox_limit: int = 10_000
    #: Most task reports kept for resending until the scheduler acknowledges them; past it the
    #: oldest metrics-only report is dropped (with a warning), never a checkpoint or an end.
    unacked_limit: int = 50_000
    #: Host name servers of this node's workers (inference) advertise; "" = 127.0.0.1 when the
    #: scheduler is on loopback, else this machine's host name.
    advertise_host: str = ""
    #: API key with the ``node`` role, sent as ``authorization: Bearer ...`` ("" = none: auth off).
    api_key: str = ""
    #: PEM files: the scheduler's CA (turns TLS on), and this node's certificate and key (mTLS).
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    #: The scheduler URL was https:// or grpcs://: TLS even without ``tls_ca`` (the system roots).
    scheduler_tls: bool = False
    #: PEM certificate and key of this node's inference servers ("" = plaintext); handed to
    #: workers as OPENTINKER_SERVE_TLS_CERT / OPENTINKER_SERVE_TLS_KEY.
    serve_tls_cert: str = ""
    serve_tls_key: str = ""
    #: Every scheduler address given (``SCHEDULER_URL=host-a:8888,host-b:8888``): the node
    #: connects to the leader among them (a follower's refusal names it); () = ``target`` only.
    targets: tuple[str, ...] = ()
    #: The node's class, for the scheduler's prices and scale signal ("" = its default class).
    node_class: str = ""
    #: Most tenants of one model host: shareable LoRA tasks (:func:`opentinker_trainer.host.shareable`)
    #: on the same base model, GPUs and dtype run in one host process holding one copy of the
    #: base (:mod:`opentinker_trainer.host`); 0 = off, every task gets a worker process.
    tenants_per_host: int = 0
    #: Seconds a model host with no tenants left waits for a new one before it is told to exit.
    host_idle_s: float = 30.0

    def channel(self, target: str | None = None) -> grpc.aio.Channel:
        """A channel to the scheduler at ``target`` (default ``target``): TLS when ``tls_ca`` or
        ``scheduler_tls`` is set, else plaintext.

        Raises:
            ValueError: a TLS file cannot be read or is not PEM.
        """
        target = target or self.target
        from opentinker_common.net.tls import channel_credentials

        creds = (
            channel_credentials(self.tls_ca, self.tls_cert, self.tls_key, tls=self.scheduler_tls)
            if self.tls_ca or self.scheduler_tls
            else None
        )
        if creds is None:
            return grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
        return grpc.aio.secure_channel(target, creds, options=CHANNEL_OPTIONS)


@dataclass
class _Worker:
    task_id: str
    attempt: int
    proc: asyncio.subprocess.Process
    devices: tuple[int, ...]
    cancel_reason: str | None = None
    outcome: dict | None = None
    watcher: asyncio.Future | None = None
    killer: asyncio.Task | None = None
    #: The model host this attempt is a tenant of; None for a worker process of its own.
    host: "_Host | None" = None
    #: Step of the checkpoint this attempt resumed from (0: none, it started from scratch).
    resume_step: int = 0
    #: Step of the newest checkpoint this attempt reported, and whether it came after the stop
    #: request (drain, preemption): what the hand-back message says was saved.
    checkpoint_step: int | None = None
    checkpointed_after_stop: bool = False
    #: Set when the stop was asked (``_terminate``); set ``killed`` when the grace ran out.
    stop_asked: bool = False
    killed: bool = False
    #: Between the attempt's ``storing exit checkpoint`` phase and that checkpoint's
    #: ``checkpoint`` or ``checkpoint_failed`` line: the grace waits for it.
    storing: bool = False


@dataclass
class _Host:
    """A model host process (``python -m opentinker_trainer.host``) and its tenants."""

    key: tuple[str, tuple[int, ...], str]  # (base model, device indices, dtype)
    proc: asyncio.subprocess.Process
    tenants: dict[tuple[str, int], _Worker] = field(default_factory=dict)
    #: Told to exit (idle, drain): takes no new tenants.
    closing: bool = False
    #: Why the host could not load its base model ("" = it did, or has not said yet).
    failed: str = ""
    failed_retryable: bool = True
    watcher: asyncio.Task | None = None
    idle: asyncio.Task | None = None

    def send(self, **msg) -> None:
        """One JSON line to the host's stdin (lost with a host that is gone: its watcher reports)."""
        if self.proc.stdin is None or self.proc.stdin.is_closing():
            return
        with contextlib.suppress(ConnectionError, RuntimeError):
            self.proc.stdin.write((json.dumps(msg) + "\n").encode())


#: Logged once per streak of failed connections when the scheduler closes a TLS connection.
TLS_REFUSAL_HINT = (
    "the scheduler closed the connection during the TLS handshake; check that --tls-cert is signed by the "
    "scheduler's tls.client_ca and --tls-ca is the CA of the scheduler's certificate, and that this node dials "
    "the scheduler's node_port (the mTLS port)"
)


def host_command(model: str, device: str, dtype: str) -> list[str]:
    """The command line of a model host process (:mod:`opentinker_trainer.host`) for base
    ``model`` on ``device`` (``cpu`` or ``cuda``) in ``dtype``."""
    return [sys.executable, "-m", "opentinker_trainer.host", "--model", model, "--device", device, "--dtype", dtype]


def _resume_step(a: node_pb2.AssignTask) -> int:
    """Step of the checkpoint an attempt resumes from; 0 when it starts from scratch."""
    return int(a.resume_from.step) if a.HasField("resume_from") and a.resume_from.path else 0


class FatalRegistrationError(RuntimeError):
    """The scheduler refused this node for good (wrong node id, bad request)."""


class NodeAgent:
    def __init__(self, config: AgentConfig, monitor: DeviceMonitor | None = None) -> None:
        self.config = config
        #: The scheduler addresses and the one in use (the leader, as far as known).
        self.targets = SchedulerTargets(config.targets or (config.target,))
        self.monitor = monitor or DeviceMonitor(
            simulate_gpus=config.simulate_gpus, simulated_memory_bytes=config.simulate_gpu_memory_bytes
        )
        self.workers: dict[str, _Worker] = {}
        #: Model hosts by (base model, devices, dtype) (:mod:`opentinker_trainer.host`), oldest first.
        self.hosts: dict[tuple[str, tuple[int, ...], str], list[_Host]] = {}
        self.draining = False
        self.connected = asyncio.Event()
        self._outbox: asyncio.Queue[node_pb2.ConnectRequest] = asyncio.Queue()
        #: Reports sent but not yet acknowledged (``ReportAck``), by ``seq``: resent in
        #: ``Register.pending`` on every reconnect until the scheduler has committed them.
        self._unacked: OrderedDict[int, node_pb2.TaskReport] = OrderedDict()
        self._report_seq = 0
        #: Metrics-only reports dropped because ``unacked_limit`` was reached.
        self.dropped_reports = 0
        self._stop = asyncio.Event()
        self._heartbeat_interval = 2.0
        #: Why the last session with the scheduler ended ("" before any); read by /health (http.py).
        self.last_error = ""
        #: Called as fn(task_id, attempt, step, values, time_s) for each worker metric report (http.py).
        self.metric_listeners: list = []
        self.log = log.bind(node_id=config.node_id)

    # ------------------------------------------------------------------ lifecycle
    async def run(self) -> None:
        """Connect, serve, reconnect with backoff until drained or stopped."""
        inv = self.monitor.inventory
        self.log.info(
            "node agent starting",
            scheduler=",".join(self.targets.given),
            gpus=len(inv.devices),
            simulated=inv.simulated,
            note=inv.note or None,
            max_tasks=self.config.max_tasks,
        )
        if not inv.devices:
            self.log.warning("no GPU found; registering as a CPU node", reason=inv.note)
        failures = 0
        session_lost_at = -math.inf  # monotonic time the last registered session broke
        while not self._stop.is_set():
            started = time.monotonic()
            follower = False  # the scheduler answered: it is not the leader
            try:
                await self._session()
            except FatalRegistrationError:
                raise
            except (grpc.aio.AioRpcError, ConnectionError, OSError) as exc:
                code = exc.code() if isinstance(exc, grpc.aio.AioRpcError) else None
                if code in _FATAL:
                    raise FatalRegistrationError(f"{code.name}: {exc.details()}") from None
                was = self.targets.current
                if code == grpc.StatusCode.UNAVAILABLE:
                    follower = not_leader(exc) is not None
                    self.targets.moved(exc)  # to the leader it names, or the next address
                elif self.targets.several:
                    self.targets.advance()
                if self.targets.current != was:
                    self.log.info("following the scheduler leader", previous=was, now=self.targets.current)
                if code == grpc.StatusCode.ALREADY_EXISTS:
                    self.log.error("scheduler refused this node id for now", error=exc.details())
                self.log.warning(
                    "stream to scheduler broken",
                    error=(exc.details() if code else repr(exc)),
                    code=code.name if code else None,
                )
                self._hint_tls_refusal(exc.details() if code else str(exc))
                self.last_error = f"{code.name}: {exc.details()}" if code else (str(exc) or type(exc).__name__)
            if self.connected.is_set():
                self._tls_hinted = False  # registered: a new streak of failures may hint again
                session_lost_at, failures = time.monotonic(), 0
            self.connected.clear()
            if self._stop.is_set():
                break
            if time.monotonic() - started > 30:
                failures = 0
            if follower:
                # A live scheduler that is not the leader: go where it pointed (or ask it again)
                # soon; no growing backoff, the leader is at most one election away.
                failures = 0
                delay = random.uniform(0.1, 0.5)
            else:
                failures += 1
                longest = min(self.config.reconnect_max_s, self.config.reconnect_initial_s * 2 ** (failures - 1))
                if time.monotonic() - session_lost_at < FAILOVER_WINDOW_S:
                    longest = min(longest, FAILOVER_BACKOFF_MAX_S)
                delay = random.uniform(0, longest)
            self.log.info("reconnecting", in_s=round(delay, 2), attempt=failures)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stop.wait(), timeout=delay)

    def _hint_tls_refusal(self, details: str | None) -> None:
        """Once per streak of failed connections: on a TLS channel, a connection closed during the
        handshake (``Socket closed``, a handshake error) is most likely the scheduler refusing
        this node's client certificate (or a port without mTLS); say what to check."""
        from opentinker_common.net.transport import closed_by_peer, tls_handshake_failed

        tls = bool(self.config.tls_ca or self.config.scheduler_tls)
        if (
            getattr(self, "_tls_hinted", False)
            or not tls
            or not (closed_by_peer(details) or tls_handshake_failed(details))
        ):
            return
        self._tls_hinted = True
        self.log.warning(
            "hint: " + TLS_REFUSAL_HINT,
            scheduler=self.config.target,
            tls_cert=self.config.tls_cert or None,
            tls_ca=self.config.tls_ca or None,
        )

    async def drain(self, reason: str = "SIGTERM") -> None:
        """Stop taking tasks, checkpoint and hand back running ones, say goodbye, stop."""
        if self.draining:
            return
        self.draining = True
        self.log.info("draining", reason=reason, running=len(self.workers))
        self._send(node_pb2.ConnectRequest(heartbeat=self._heartbeat()))
        for w in list(self.workers.values()):
            self._terminate(w, None)
        if self.workers:
            await asyncio.gather(*(w.watcher for w in self.workers.values() if w.watcher), return_exceptions=True)
        self._close_hosts(kill=False)
        # Stop first, so the end of the stream that the goodbye causes is not "reconnected".
        self._stop.set()
        if self.connected.is_set():
            self._send(node_pb2.ConnectRequest(goodbye=node_pb2.Goodbye(reason=f"drained ({reason})")))
        self._outbox.put_nowait(None)  # type: ignore[arg-type] - ends the request stream after the goodbye

    async def stop_now(self) -> None:
        """Kill all workers (tests and hard shutdown)."""
        self._stop.set()
        for w in list(self.workers.values()):
            self._terminate(w, "agent stopped")
        self._close_hosts(kill=True)
        await asyncio.gather(*(w.watcher for w in self.workers.values() if w.watcher), return_exceptions=True)
        self._outbox.put_nowait(None)  # type: ignore[arg-type]

    # ------------------------------------------------------------------ the stream
    async def _session(self) -> None:
        async with self.config.channel(self.targets.current) as channel:
            stub = node_pb2_grpc.NodeServiceStub(channel)
            register = node_pb2.ConnectRequest(
                register=node_pb2.Register(
                    node_id=self.config.node_id,
                    version=VERSION,
                    devices=self.monitor.inventory.devices,
                    max_tasks=self.config.max_tasks,
                    tenants_per_host=self.config.tenants_per_host,
                    tracking_loggers=writable_loggers(),
                    tracking_reported=True,
                    running=[node_pb2.RunningTask(task_id=w.task_id, attempt=w.attempt) for w in self.workers.values()],
                    hostname=socket.gethostname(),
                    cpu_count=os.cpu_count() or 1,
                    # One line: the scheduler refuses control characters (an NVML error's newline too).
                    gpu_note=" ".join(self.monitor.inventory.note.split()),
                    node_class=self.config.node_class,
                    # Finals among them also in `finished`, for a scheduler that predates `pending`.
                    finished=[r for r in self._unacked.values() if r.state in _ENDED],
                    pending=list(self._unacked.values()),
                )
            )
            # Each session reads its own queue, made here with the register's snapshot (no await
            # between): what is written from now on goes to this session only. The request stream
            # of a refused or broken call may still be waiting on its queue; sharing one queue, it
            # took the next messages (two metric points lost in a failover). Reports are safe in
            # any case: they stay in `_unacked` until acknowledged and go in the next register.
            queue: asyncio.Queue[node_pb2.ConnectRequest | None] = asyncio.Queue()
            self._outbox = queue
            metadata = (("authorization", f"Bearer {self.config.api_key}"),) if self.config.api_key else None
            try:
                await self._stream(stub.Connect(self._requests(register, queue, self._report_seq), metadata=metadata))
            finally:
                queue.put_nowait(None)  # ends this session's request stream if it still waits

    async def _stream(self, call) -> None:
        """Read one session's commands until the scheduler ends the stream."""
        first = await call.read()
        if first is grpc.aio.EOF or first.WhichOneof("command") != "registered":
            raise ConnectionError("scheduler closed the stream before registering")
        reg = first.registered
        self._acknowledged(reg.report_ack)
        self._heartbeat_interval = max(0.05, reg.heartbeat_interval.ToNanoseconds() / 1e9 or 2.0)
        self.log.info(
            "registered with scheduler",
            gpu_count=reg.gpu_count,
            max_tasks=reg.max_tasks,
            heartbeat_s=self._heartbeat_interval,
            stale=len(reg.stale),
        )
        self.connected.set()
        for s in reg.stale:
            w = self.workers.get(s.task_id)
            if w is not None and w.attempt == s.attempt:
                self._terminate(w, "scheduler no longer runs this attempt here")
        heartbeats = asyncio.create_task(self._heartbeats())
        try:
            while True:
                command = await call.read()
                if command is grpc.aio.EOF:
                    break
                await self._handle(command)
        finally:
            heartbeats.cancel()
            self.connected.clear()

    async def _requests(self, register: node_pb2.ConnectRequest, queue: asyncio.Queue, resent_upto: int):
        """One session's request stream: ``register``, then what is written to ``queue``, minus
        reports up to ``resent_upto`` (they went in the register's ``pending``) and reports
        acknowledged meanwhile; ends at ``None``."""
        yield register
        while True:
            msg = await queue.get()
            if msg is None:
                return
            if msg.WhichOneof("message") == "task_report":
                seq = msg.task_report.seq
                if seq <= resent_upto or seq not in self._unacked:
                    continue  # went out in this session's register.pending, or is acknowledged already
            yield msg

    def _send_report(self, report: node_pb2.TaskReport) -> None:
        """Number ``report``, keep it until acknowledged, and queue it for the stream."""
        self._report_seq += 1
        report.seq = self._report_seq
        self._unacked[report.seq] = report
        if len(self._unacked) > self.config.unacked_limit:
            self._drop_oldest_metrics()
        self._outbox.put_nowait(node_pb2.ConnectRequest(task_report=report))

    def _drop_oldest_metrics(self) -> None:
        for seq, old in self._unacked.items():
            if old.state == common_pb2.TASK_STATE_UNSPECIFIED and not old.HasField("checkpoint") and not old.endpoint:
                del self._unacked[seq]
                self.dropped_reports += 1
                if self.dropped_reports == 1 or self.dropped_reports % 1000 == 0:
                    self.log.warning(
                        "scheduler has not acknowledged reports for long; dropping the oldest metric points",
                        unacked_limit=self.config.unacked_limit,
                        dropped=self.dropped_reports,
                    )
                return

    def _acknowledged(self, seq: int) -> None:
        """The scheduler committed every report up to ``seq``: forget them."""
        while self._unacked:
            first = next(iter(self._unacked))
            if first > seq:
                break
            del self._unacked[first]

    @property
    def unacked_reports(self) -> int:
        """Reports sent and not yet acknowledged by the scheduler."""
        return len(self._unacked)

    def _send(self, msg: node_pb2.ConnectRequest) -> None:
        if self._outbox.qsize() >= self.config.outbox_limit and msg.WhichOneof("message") != "task_report":
            return
        self._outbox.put_nowait(msg)

    async def _heartbeats(self) -> None:
        while True:
            telemetry = await asyncio.to_thread(self.monitor.telemetry)
            host = await asyncio.to_thread(self.monitor.host_telemetry)
            self._send(node_pb2.ConnectRequest(heartbeat=self._heartbeat(telemetry, host)))
            await asyncio.sleep(self._heartbeat_interval)

    def _heartbeat(self, telemetry: list | None = None, host=None) -> node_pb2.Heartbeat:
        hb = node_pb2.Heartbeat(
            devices=telemetry or [],
            host=host,
            running=[node_pb2.RunningTask(task_id=w.task_id, attempt=w.attempt) for w in self.workers.values()],
            draining=self.draining,
            model_hosts=[
                common_pb2.ModelHost(
                    model=h.key[0],
                    device_indices=h.key[1],
                    dtype=h.key[2],
                    task_ids=sorted(t for t, _ in h.tenants),
                    pid=h.proc.pid,
                    max_tenants=self.config.tenants_per_host,
                )
                for hosts in self.hosts.values()
                for h in hosts
                if h.proc.returncode is None
            ],
        )
        hb.time.GetCurrentTime()
        return hb

    async def _handle(self, command: node_pb2.ConnectResponse) -> None:
        kind = command.WhichOneof("command")
        if kind == "assign_task":
            await self._start(command.assign_task)
        elif kind == "cancel_task":
            c = command.cancel_task
            w = self.workers.get(c.task_id)
            if w is not None and (c.attempt == 0 or c.attempt == w.attempt):
                self._terminate(w, c.reason or "cancelled")
        elif kind == "drain":
            asyncio.create_task(self.drain(command.drain.reason or "scheduler asked"))
        elif kind == "report_ack":
            self._acknowledged(command.report_ack.seq)

    # ------------------------------------------------------------------ workers
    async def _start(self, a: node_pb2.AssignTask) -> None:
        bound = self.log.bind(task_id=a.task_id, attempt=a.attempt)
        existing = self.workers.get(a.task_id)
        if existing is not None:
            if existing.attempt == a.attempt:
                return  # duplicate delivery
            self._terminate(existing, "superseded by a newer attempt")
        if self.draining:
            self._report_final(
                node_pb2.TaskReport(
                    task_id=a.task_id,
                    attempt=a.attempt,
                    state=common_pb2.TASK_STATE_CANCELLED,
                    error="node is draining",
                    retryable=True,
                )
            )
            return
        attempt_dir = self.config.work_dir / a.task_id / f"attempt-{a.attempt}"
        attempt_dir.mkdir(parents=True, exist_ok=True)
        assignment = attempt_dir / "assignment.pb"
        assignment.write_bytes(a.SerializeToString())
        simulated = self.monitor.inventory.simulated
        checkpoints = self.config.work_dir / a.task_id / "checkpoints"
        key = self._host_key(a)
        env = self._child_env(a.device_indices, HOST if key is not None else WORKER)
        if key is not None:
            await self._start_tenant(a, key, env, assignment, checkpoints)
            return
        if a.worker_credential:
            # The worker calls the scheduler with its attempt's credential, never the node's key.
            env["OPENTINKER_API_KEY"] = a.worker_credential
        cmd = [
            sys.executable,
            "-m",
            "opentinker_trainer.worker",
            str(assignment),
            "--checkpoint-dir",
            str(checkpoints),
        ]
        if simulated or not a.device_indices:
            cmd += ["--device", "cpu"]
        try:
            proc = await asyncio.create_subprocess_exec(
                *cmd,
                stdout=asyncio.subprocess.PIPE,
                stderr=None,
                env=env,
                start_new_session=True,
                limit=16 * 1024 * 1024,
            )
        except OSError as exc:
            bound.error("worker failed to start", error=str(exc))
            self._start_failed(a, f"worker failed to start: {exc}")
            return
        w = _Worker(a.task_id, a.attempt, proc, tuple(a.device_indices), resume_step=_resume_step(a))
        self.workers[a.task_id] = w
        bound.info(
            "Task started",
            pid=proc.pid,
            workload_type=a.spec.workload_type,
            model=a.spec.model,
            devices=list(a.device_indices) or "cpu",
            simulated_gpus=simulated or None,
            resume_from=a.resume_from.path or None,
        )
        w.watcher = asyncio.create_task(self._watch(w))

    def _start_failed(self, a: node_pb2.AssignTask, error: str) -> None:
        self._report_final(
            node_pb2.TaskReport(
                task_id=a.task_id, attempt=a.attempt, state=common_pb2.TASK_STATE_FAILED, error=error, retryable=True
            )
        )

    def _child_env(self, device_indices, role: str) -> dict[str, str]:
        """The environment of a worker or model host (``role``, :mod:`~opentinker_trainer.process_env`)
        on ``device_indices``."""
        simulated = self.monitor.inventory.simulated
        env = process_env(os.environ, role=role, max_tasks=self.config.max_tasks)
        # GPUs by NVML UUID, numbers (if any) in PCI bus order as NVML counts them.
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        env["CUDA_VISIBLE_DEVICES"] = (
            "" if simulated else cuda_visible_devices(self.monitor.inventory.devices, device_indices)
        )
        env["OPENTINKER_AGENT_PID"] = str(os.getpid())  # the worker dies with the agent
        env["OPENTINKER_NODE_ID"] = self.config.node_id  # bound into the worker's log lines
        # Workers reach the scheduler as their node does (address, TLS) but never with the node's
        # key: each attempt calls with its own credential (AssignTask.worker_credential).
        env.pop("OPENTINKER_API_KEY", None)
        env.update(
            worker_env(
                # Several schedulers: all of them, the leader first (the worker follows it as well).
                ",".join(dict.fromkeys((self.targets.current, *self.targets.given))),
                tls_ca=self.config.tls_ca,
                tls_cert=self.config.tls_cert,
                tls_key=self.config.tls_key,
                serve_tls_cert=self.config.serve_tls_cert,
                serve_tls_key=self.config.serve_tls_key,
                scheduler_tls=self.config.scheduler_tls,
            )
        )
        env["OPENTINKER_DATASET_CACHE"] = str(self.config.work_dir / "datasets")  # shared by this node's tasks
        env.setdefault("OPENTINKER_ARTIFACT_CACHE", str(self.config.work_dir / "artifact-cache"))  # checkpoints
        env["OPENTINKER_WORK_DIR"] = str(
            self.config.work_dir.resolve()
        )  # specs may not name paths in it (local_paths.py)
        env["OPENTINKER_ADVERTISE_HOST"] = self.config.advertise_host or default_advertise_host(
            self.targets.current
        )  # inference servers
        return env

    # ------------------------------------------------------------------ model hosts
    def _host_key(self, a: node_pb2.AssignTask) -> tuple[str, tuple[int, ...], str] | None:
        """The model host key of a shareable attempt when model hosts are on, else None."""
        if self.config.tenants_per_host <= 0:
            return None
        from opentinker_trainer.host import shareable  # torch-free

        return shareable(a)

    async def _start_tenant(
        self, a: node_pb2.AssignTask, key, env: dict[str, str], assignment: Path, checkpoints: Path
    ) -> None:
        """Hand ``a`` to the running host for ``key`` with room, else to a new one."""
        bound = self.log.bind(task_id=a.task_id, attempt=a.attempt)
        host = next(
            (
                h
                for h in self.hosts.get(key, [])
                if not h.closing and h.proc.returncode is None and len(h.tenants) < self.config.tenants_per_host
            ),
            None,
        )
        warm = host is not None
        if host is None:
            model, devices, dtype = key
            simulated = self.monitor.inventory.simulated
            device = "cpu" if simulated or not devices else "cuda"
            cmd = host_command(model, device, dtype)
            try:
                proc = await asyncio.create_subprocess_exec(
                    *cmd,
                    stdin=asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.PIPE,
                    stderr=None,
                    env=env,
                    start_new_session=True,
                    limit=16 * 1024 * 1024,
                )
            except OSError as exc:
                bound.error("model host failed to start", error=str(exc))
                self._start_failed(a, f"model host failed to start: {exc}")
                return
            host = _Host(key, proc)
            self.hosts.setdefault(key, []).append(host)
            host.watcher = asyncio.create_task(self._watch_host(host))
            self.log.info("model host started", pid=proc.pid, model=model, devices=list(devices) or "cpu")
        if host.idle is not None:
            host.idle.cancel()
            host.idle = None
        w = _Worker(a.task_id, a.attempt, host.proc, tuple(a.device_indices), host=host, resume_step=_resume_step(a))
        w.watcher = asyncio.get_running_loop().create_future()
        self.workers[a.task_id] = w
        host.tenants[(a.task_id, a.attempt)] = w
        host.send(op="add", assignment=str(assignment), checkpoint_dir=str(checkpoints))
        bound.info(
            "Task started",
            pid=host.proc.pid,
            model_host=True,
            warm_host=warm,
            tenants=len(host.tenants),
            workload_type=a.spec.workload_type,
            model=a.spec.model,
            devices=list(a.device_indices) or "cpu",
            simulated_gpus=self.monitor.inventory.simulated or None,
            resume_from=a.resume_from.path or None,
        )

    async def _watch_host(self, host: _Host) -> None:
        """Turn a host's lines into its tenants' reports; when it is gone, end every tenant left."""
        assert host.proc.stdout is not None
        while True:
            line = await host.proc.stdout.readline()
            if not line:
                break
            try:
                msg = json.loads(line)
                kind = msg["type"]
            except (ValueError, KeyError, TypeError):
                self.log.warning("unreadable line from model host", line=line[:200].decode(errors="replace"))
                continue
            if kind == "host_failed":
                host.failed = str(msg.get("error", "model host failed"))
                host.failed_retryable = bool(msg.get("retryable", True))
                continue
            if kind == "host_ready" or "task_id" not in msg:
                continue
            w = host.tenants.get((str(msg["task_id"]), int(msg.get("attempt", 0))))
            if w is None:
                continue  # an attempt this agent already ended (cancel past its grace): fenced off
            if kind == "released":
                self._end_tenant(w, "model host released the tenant without a result")
            else:
                self._on_line(w, kind, msg)
        rc = await host.proc.wait()
        host.closing = True
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(host.proc.pid, signal.SIGKILL)
        if host.idle is not None:
            host.idle.cancel()
        left = self.hosts.get(host.key, [])
        if host in left:
            left.remove(host)
            if not left:
                del self.hosts[host.key]
        how = f"killed by signal {-rc}" if rc < 0 else f"exited with code {rc}"
        self.log.info("model host ended", pid=host.proc.pid, returncode=rc, tenants_lost=len(host.tenants))
        for w in list(host.tenants.values()):
            if host.failed:
                w.outcome = w.outcome or {"type": "failed", "error": host.failed, "retryable": host.failed_retryable}
            self._end_tenant(w, f"model host process {how} without a result")

    def _end_tenant(self, w: _Worker, failure: str) -> None:
        host = w.host
        assert host is not None
        if host.tenants.get((w.task_id, w.attempt)) is not w:
            return
        del host.tenants[(w.task_id, w.attempt)]
        if w.killer is not None:
            w.killer.cancel()
        self._finish(w, failure, None)
        if w.watcher is not None and not w.watcher.done():
            w.watcher.set_result(None)
        if not host.tenants and not host.closing and host.proc.returncode is None:
            host.idle = asyncio.create_task(self._idle_exit(host))

    async def _idle_exit(self, host: _Host) -> None:
        """Tell a host with no tenants to exit after ``host_idle_s`` unless one joins first."""
        if not self.draining and not self._stop.is_set():
            await asyncio.sleep(self.config.host_idle_s)
        if host.tenants or host.closing:
            return
        host.closing = True
        self.log.info("model host idle: telling it to exit", pid=host.proc.pid, idle_s=self.config.host_idle_s)
        if host.proc.stdin is not None:
            host.proc.stdin.close()

    # ------------------------------------------------------------------ workers
    async def _watch(self, w: _Worker) -> None:
        bound = self.log.bind(task_id=w.task_id, attempt=w.attempt)
        assert w.proc.stdout is not None
        while True:
            line = await w.proc.stdout.readline()
            if not line:
                break
            try:
                msg = json.loads(line)
                kind = msg["type"]
            except (ValueError, KeyError, TypeError):
                bound.warning("unreadable line from worker", line=line[:200].decode(errors="replace"))
                continue
            self._on_line(w, kind, msg)
        rc = await w.proc.wait()
        if w.killer is not None:
            w.killer.cancel()
        # The worker is gone; make sure nothing it started lingers in its process group.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(w.proc.pid, signal.SIGKILL)
        how = f"killed by signal {-rc}" if rc < 0 else f"exited with code {rc}"
        self._finish(w, f"worker process {how} without a result", rc)

    def _on_line(self, w: _Worker, kind: str, msg: dict) -> None:
        """One report line of an attempt's worker (or host tenant) as a ``TaskReport``."""
        report = node_pb2.TaskReport(task_id=w.task_id, attempt=w.attempt)
        if kind == "started":
            report.state = common_pb2.TASK_STATE_RUNNING
        elif kind == "metric":
            point = report.metrics.add(step=int(msg["step"]), values={k: float(v) for k, v in msg["values"].items()})
            point.time.FromNanoseconds(int(msg["time"] * 1e9))
            for listener in self.metric_listeners:
                listener(w.task_id, w.attempt, point.step, dict(point.values), float(msg["time"]))
        elif kind == "checkpoint":
            report.checkpoint.step = int(msg["step"])
            report.checkpoint.path = str(Path(msg["path"]).resolve())
            report.checkpoint.final = bool(msg.get("final"))
            report.checkpoint.format = str(msg.get("format", ""))
            report.checkpoint.create_time.FromNanoseconds(int(msg["time"] * 1e9))
            report.checkpoint.node_id = self.config.node_id
            w.checkpoint_step = report.checkpoint.step
            w.checkpointed_after_stop = w.stop_asked
            w.storing = False
            if msg.get("artifact"):  # in the artifact store: readable from every node
                art = msg["artifact"]
                report.checkpoint.artifact.key = str(art["key"])
                report.checkpoint.artifact.manifest_sha256 = str(art["manifest_sha256"])
                report.checkpoint.artifact.total_bytes = int(art.get("total_bytes", 0))
                report.checkpoint.artifact.backend = str(art.get("backend", ""))
        elif kind == "checkpoint_failed":  # not stored after its retries: a task event
            failed = report.checkpoint_failed
            failed.step = int(msg.get("step", 0))
            failed.error = str(msg.get("error", ""))[:4000]
            failed.fatal = bool(msg.get("fatal"))
            failed.failures_in_a_row = int(msg.get("failures_in_a_row", 0))
            failed.node_id = self.config.node_id
            w.storing = False
        elif kind == "endpoint":
            report.endpoint = str(msg.get("address", ""))
            report.openai_endpoint = str(msg.get("openai_endpoint", ""))
        elif kind == "phase":
            report.phase.attempt = w.attempt
            report.phase.phase = str(msg.get("phase", ""))[:100]
            report.phase.detail = str(msg.get("detail", ""))[:1000]
            w.storing = w.storing or report.phase.phase == STORING_PHASE
        elif kind in ("succeeded", "failed", "stopped"):
            w.outcome = msg
            return
        else:
            return
        if w.cancel_reason is None or kind != "started":
            self._send_report(report)

    def _finish(self, w: _Worker, failure: str, rc: int | None) -> None:
        """Report how the attempt of ``w`` ended; ``failure`` is the error when it said nothing."""
        bound = self.log.bind(task_id=w.task_id, attempt=w.attempt)
        final = node_pb2.TaskReport(task_id=w.task_id, attempt=w.attempt)
        outcome = w.outcome or {}
        if w.cancel_reason is not None:
            final.state = common_pb2.TASK_STATE_CANCELLED
            final.error = w.cancel_reason
            if (killed := self._killed_before_exit_checkpoint(w)) is not None:
                self._send_report(killed)  # before the final report: the scheduler records it while the task stops
        elif outcome.get("type") == "succeeded":
            final.state = common_pb2.TASK_STATE_SUCCEEDED
        elif outcome.get("type") == "failed":
            final.state = common_pb2.TASK_STATE_FAILED
            final.error = str(outcome.get("error", "worker failed"))
            final.retryable = bool(outcome.get("retryable", True))
        elif outcome.get("type") == "stopped" or self.draining:
            final.state = common_pb2.TASK_STATE_CANCELLED
            final.error = self._handed_back(w)
            final.retryable = True
        else:
            final.state = common_pb2.TASK_STATE_FAILED
            final.error = failure
            final.retryable = True
        if self.workers.get(w.task_id) is w:
            del self.workers[w.task_id]
        bound.info(
            "Task ended",
            state=common_pb2.TaskState.Name(final.state),
            returncode=rc,
            model_host=w.host is not None or None,
            error=final.error or None,
        )
        self._report_final(final)

    def _handed_back(self, w: _Worker) -> str:
        """What a drained attempt saved, for its hand-back report (the task event and the log):
        ``"node n1 drained; checkpointed at step 12 and handed back"``, or, when the worker wrote
        no checkpoint after the stop (killed at ``--kill-grace``, or it stopped without one),
        which checkpoint the task still has from this attempt or the one it resumed from, or that
        there is none. The scheduler's requeue event adds where the next attempt resumes."""
        node = f"node {self.config.node_id} drained"
        if w.checkpointed_after_stop and w.checkpoint_step is not None:
            return f"{node}; checkpointed at step {w.checkpoint_step} and handed back"
        if w.killed:
            grace = f"--kill-grace ({self.config.kill_grace_s:g} s)"
            how = f"the worker was killed after {grace} before it wrote a checkpoint"
        else:
            how = "the worker stopped without writing a checkpoint"
        return f"{node}; {how}; handed back ({self._checkpoint_kept(w)})"

    @staticmethod
    def _checkpoint_kept(w: _Worker) -> str:
        """Which checkpoint the task has from this attempt or the one it resumed from."""
        if w.checkpoint_step is not None:
            return f"the newest checkpoint is this attempt's step {w.checkpoint_step}"
        if w.resume_step:
            return f"the newest checkpoint is step {w.resume_step}, which this attempt resumed from"
        return "no checkpoint was written"

    def _killed_before_exit_checkpoint(self, w: _Worker) -> node_pb2.TaskReport | None:
        """For a cancelled (or timed-out) worker that ``--kill-grace`` ended before it wrote its
        exit checkpoint, a ``killed`` phase report saying so and which checkpoint the task has:
        the scheduler adds it to the ended task's events (after the CANCELLED one), so ``watch``
        and ``logs`` tell the user the last steps were not saved. None otherwise."""
        if not w.killed or w.checkpointed_after_stop:
            return None
        grace = f"--kill-grace ({self.config.kill_grace_s:g} s)"
        detail = f"after {grace}, before its exit checkpoint; {self._checkpoint_kept(w)}"
        report = node_pb2.TaskReport(task_id=w.task_id, attempt=w.attempt)
        report.phase.attempt, report.phase.phase, report.phase.detail = w.attempt, "killed", detail
        return report

    def _report_final(self, report: node_pb2.TaskReport) -> None:
        self._send_report(report)

    def _terminate(self, w: _Worker, reason: str | None) -> None:
        """SIGTERM the worker's process group; SIGKILL after the grace period. A model host's
        tenant is asked to stop instead; past the grace period it is reported ended and fenced
        off (its host stops it at its next step boundary and frees its adapter).

        ``reason`` None means drain (the worker checkpoints and is handed back)."""
        if w.cancel_reason is None and reason is not None:
            w.cancel_reason = reason
        if w.killer is not None:
            return
        w.stop_asked = True
        self.log.info("stopping worker", task_id=w.task_id, attempt=w.attempt, reason=reason or "drain")
        host = w.host
        if host is not None:
            host.send(op="stop", task_id=w.task_id, attempt=w.attempt)

            async def give_up_later() -> None:
                await asyncio.sleep(self.config.kill_grace_s)
                await self._exit_checkpoint_stored(w)
                w.killed = True
                self._end_tenant(w, "tenant did not stop within the grace period")

            w.killer = asyncio.create_task(give_up_later())
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(w.proc.pid, signal.SIGTERM)

        async def kill_later() -> None:
            await asyncio.sleep(self.config.kill_grace_s)
            await self._exit_checkpoint_stored(w)
            w.killed = w.proc.returncode is None
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(w.proc.pid, signal.SIGKILL)

        w.killer = asyncio.create_task(kill_later())

    async def _exit_checkpoint_stored(self, w: _Worker) -> None:
        """Past the grace, wait while the stopped attempt writes and stores its exit checkpoint
        (:data:`~opentinker_trainer.context.STORING_PHASE` until its ``checkpoint`` line), then
        up to the grace again for it to exit. The store's own deadlines and retries bound the
        upload; a large checkpoint is then stored, not cut off."""
        if not w.storing:
            return
        self.log.info("grace over, exit checkpoint still being stored: waiting", task_id=w.task_id, attempt=w.attempt)
        while w.storing and not self._ended(w):
            await asyncio.sleep(0.1)
        deadline = time.monotonic() + self.config.kill_grace_s
        while not self._ended(w) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    @staticmethod
    def _ended(w: _Worker) -> bool:
        """The attempt's process exited (a tenant: its host released it or ended)."""
        if w.host is not None:
            return w.outcome is not None
        return w.proc.returncode is not None

    def _close_hosts(self, *, kill: bool) -> None:
        """Tell every model host to exit (close its stdin), or SIGKILL them (``kill``)."""
        for hosts in list(self.hosts.values()):
            for h in hosts:
                h.closing = True
                if kill:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(h.proc.pid, signal.SIGKILL)
                elif h.proc.stdin is not None and not h.proc.stdin.is_closing():
                    h.proc.stdin.close()
