"""Assembles the scheduler process: gRPC (grpc.aio) with health and reflection, HTTP, the tick loop."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from dataclasses import dataclass

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from opentinker.artifact.v1 import artifact_pb2, artifact_pb2_grpc
from opentinker.node.v1 import node_pb2, node_pb2_grpc
from opentinker.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from opentinker.scheduler.v1 import admin_pb2, admin_pb2_grpc

from opentinker_scheduler.admission.load import SubmitGate
from opentinker_scheduler.security import tls_config as tls_listen
from opentinker_scheduler.api.admin import AdminService
from opentinker_scheduler.api.artifacts import ArtifactService
from opentinker_scheduler.data.artifact_store import Artifacts, Expiry, Retention, open_artifact_store
from opentinker_scheduler.security.bundle import Security, build_security

from opentinker_scheduler.config import SchedulerConfig
from opentinker_scheduler.errors import StoreUnavailable
from opentinker_scheduler.state.core import SchedulerCore
from opentinker_scheduler.state.scale_signal import desired_trainers
from opentinker_scheduler.api.dashboard import Dashboard
from opentinker_scheduler.api.front import PortFront
from opentinker_scheduler.api.rpc import abort_mapped
from opentinker_scheduler.api.http import HttpEndpoint, Snapshot
from opentinker_scheduler.api.service import NodeService, SchedulerService
from opentinker_scheduler.state.leadership import LeaseLeadership, StaticLeadership
from opentinker_scheduler.state.store import STATE_NAMES
from opentinker_scheduler.state.backends import open_store as open_state_store
from opentinker_common.net.grpc_options import server_options

log = structlog.get_logger("opentinker.scheduler")

#: Keepalive, agreed with the trainer and client channels: the server pings idle connections
#: every 30 s and accepts client pings no more often than every 10 s, with or without calls in
#: flight (trainers ping every 20 s), so an idle node is never dropped with `too_many_pings`.
SERVER_OPTIONS = server_options()
#: gRPC core keeps a call that grpc.aio has not taken yet (it takes one per event-loop turn) in a
#: queue, and past ``grpc.server.max_pending_requests`` (default 1000; all of them past the hard
#: limit, default 3000) drops calls at random with a bare CANCELLED the scheduler never sees: the
#: client cannot tell whether its task was made. Raised above what an overloaded scheduler that
#: refuses the excess queues (admission/load.py keeps the wait near limits.max_submit_wait: ~1500
#: calls at 3000/s taken up), so those calls reach it and get RESOURCE_EXHAUSTED with retry
#: advice; kept finite for a flood that even refusing cannot keep up with, so the wait there stays
#: bounded (~5000 calls) instead of growing to core's 30 s (grpc.server_max_unrequested_time_in_server).
PENDING_OPTIONS = [
    ("grpc.server.max_pending_requests", 5_000),
    ("grpc.server.max_pending_requests_hard_limit", 10_000),
]

SERVICE_NAMES = (
    scheduler_pb2.DESCRIPTOR.services_by_name["SchedulerService"].full_name,
    node_pb2.DESCRIPTOR.services_by_name["NodeService"].full_name,
    admin_pb2.DESCRIPTOR.services_by_name["AdminService"].full_name,
    artifact_pb2.DESCRIPTOR.services_by_name["ArtifactService"].full_name,
)


@dataclass
class RunningScheduler:
    server: grpc.aio.Server
    core: SchedulerCore
    http: HttpEndpoint | None
    port: int
    tick_task: asyncio.Task
    security: Security | None = None
    #: The mTLS node port (tls.client_ca with client_auth: nodes), else None.
    node_port: int | None = None
    #: The artifact store (checkpoints) and its settings.
    artifacts: Artifacts | None = None
    #: Checkpoint retention (keep_checkpoints), run after each recorded checkpoint.
    retention: Retention | None = None
    #: Deletes checkpoints whose expiry has come (SetCheckpointTtl).
    expiry_task: asyncio.Task | None = None
    #: The front on the public port (plaintext, http_on_grpc_port), else None.
    front: PortFront | None = None
    #: SubmitTask's gate (admission/load.py): closed first when stopping.
    submit_gate: SubmitGate | None = None
    #: Who leads (state/leadership.py): always this one on SQLite, the lease on PostgreSQL.
    leadership: StaticLeadership | LeaseLeadership | None = None

    async def stop(self, grace: float = 2.0) -> None:
        # No new task from here on (UNAVAILABLE, retry advice: the client retries at the next
        # scheduler); a submit that wrote its task is answered before the server stops, so no
        # accepted call is cancelled.
        if self.submit_gate is not None:
            self.submit_gate.drain()
            if not await self.submit_gate.wait_idle(grace):
                log.warning("submits still in progress at shutdown", in_flight=self.submit_gate.in_flight)
        for task in (self.tick_task, self.expiry_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        # End every node stream from our side first (a None in the outbox ends NodeService.Connect
        # normally), so stopping the server does not cancel those handlers mid-await, which
        # grpc.aio logs as an unhandled CancelledError. The nodes reconnect to the next scheduler.
        for node in list(self.core.ledger.nodes.values()):
            node.outbox.put_nowait(None)
        await asyncio.sleep(0)
        if self.front is not None:
            await self.front.stop()  # no new connections; spliced ones end with the server
        await self.server.stop(grace)
        self.core.flush()
        if self.leadership is not None:
            await self.leadership.stop()  # a leader hands its lease back: a follower takes over at once
        if self.http is not None:
            await self.http.stop()
        self.core.store.close()


def _snapshot(core: SchedulerCore, leadership=None) -> Snapshot:
    counts = {STATE_NAMES[s]: n for s, n in core.tasks.counts.items() if n}
    gpus = []
    hosts = []
    for node in core.ledger.nodes.values():
        if not node.connected:
            continue
        for t in node.telemetry:
            values = {
                k: float(getattr(t, k))
                for k in ("utilization_percent", "memory_used_bytes", "memory_total_bytes", "temperature_c", "power_w")
                if t.HasField(k)
            }
            gpus.append((node.node_id, str(t.index), t.simulated, values))
        if node.host is not None:
            h = node.host
            host_values = {
                k: float(getattr(h, k))
                for k in ("cpu_utilization_percent", "cpu_count", "memory_used_bytes", "memory_total_bytes")
                if h.HasField(k)
            }
            hosts.append((node.node_id, host_values))
    view = leadership.view() if leadership is not None else None
    sharing = _sharing(core) if core.leading else {}
    return Snapshot(
        **sharing,
        role=view.role if view else "leader",
        leader=view.leader if view else "",
        epoch=view.epoch if view else None,
        ha=view.ha if view else False,
        time=time.monotonic(),
        store_writable=leadership.store_ok() if leadership is not None else core.store.writable(),
        tasks_by_state=counts,
        queue_depth=counts.get("PENDING", 0),
        nodes_connected=sum(1 for n in core.ledger.nodes.values() if n.connected),
        nodes_known=len(core.ledger.nodes),
        gpus=tuple(gpus),
        hosts=tuple(hosts),
    )


#: Seconds between recomputations of the usage rollups exported on /metrics (a store query).
USAGE_EXPORT_INTERVAL_S = 5.0
_usage_cache: dict[int, tuple[float, tuple]] = {}


def _sharing(core: SchedulerCore) -> dict:
    """The Snapshot's quota queues, usage per owner (recomputed every USAGE_EXPORT_INTERVAL_S) and
    scale signal."""
    queues = tuple(
        (name, used[0], used[1], q.gpus if q else -1, q.cpu_tasks if q else -1, pending)
        for name, q, used, pending, _ in core.queues.rows(refresh=not core.leading)
    )
    now = time.monotonic()
    cached = _usage_cache.get(id(core))
    if cached is None or now - cached[0] > USAGE_EXPORT_INTERVAL_S:
        by_owner, _, owner_queue = core.usage.rollup(core.active.values())
        usage = tuple(
            (
                owner,
                owner_queue.get(owner, ""),
                u.gpu_seconds,
                u.cpu_task_seconds,
                u.tokens_generated,
                u.tokens_trained,
                u.env_steps,
                u.cost,
            )
            for owner, u in sorted(by_owner.items())
        )
        cached = _usage_cache[id(core)] = (now, usage)
    desired = tuple(
        (d.node_class, d.desired, d.connected)
        for d in desired_trainers(core.config, core.ledger, core.queue, core.queues.book)
    )
    return {"queues": queues, "usage": cached[1], "desired_trainers": desired}


async def _tick_loop(core: SchedulerCore, http: HttpEndpoint | None, interval_s: float, leadership=None) -> None:
    last_snapshot = 0.0
    published_view = None  # the leadership as last published: a change is published at once
    last_tick = time.monotonic()
    store_down = False  # the last tick failed for the state store: said once, not every tick
    while True:
        started = time.monotonic()
        # Time the loop could not run beyond its sleep (SIGSTOP, a blocked event loop): the core
        # gives nodes a grace when it is longer than the lease, for nobody could be heard meanwhile.
        stalled_s, last_tick = max(0.0, started - last_tick - interval_s), started
        try:
            if leadership is not None:
                leadership.check()  # first: a leader whose lease may have run out steps down
            core.tick(stalled_s=stalled_s)
            if http is not None:
                for latency in core.placement_latencies:
                    http.scheduling_latency.observe(latency)
            core.placement_latencies.clear()  # also without HTTP, or the list would only grow
            if http is not None:
                # /ready follows a change of leader at the next tick: the balancer's check sees it.
                view = leadership.view() if leadership is not None else None
                if time.monotonic() - last_snapshot > 1.0 or view != published_view:
                    http.publish(_snapshot(core, leadership))
                    last_snapshot, published_view = time.monotonic(), view
            if store_down:
                log.info("tick: state store reachable again")
                store_down = False
        except StoreUnavailable as exc:
            # A database restarting: one line when it starts, none per tick until it is back.
            if not store_down:
                log.warning("tick skipped: state store unavailable; retrying each tick", error=str(exc))
            store_down = True
        except Exception:  # noqa: BLE001 - keep scheduling; the error is logged
            log.exception("tick failed")
        await asyncio.sleep(interval_s)


async def start_scheduler(
    config: SchedulerConfig,
    *,
    host: str = "0.0.0.0",
    port: int = 8888,
    http_port: int | None = 8889,
    tick_interval_s: float = 0.5,
    advertise_address: str | None = None,
) -> RunningScheduler:
    """Start serving; returns a handle whose ``stop()`` shuts everything down.

    ``port=0`` / ``http_port=0`` pick free ports (see ``RunningScheduler.port`` / ``http.port``);
    ``http_port=None`` disables HTTP. ``advertise_address``: the ``host:port`` clients and
    trainers reach this scheduler at, which followers name as the leader's (default: this
    host's name, or ``host`` when it is not a wildcard, and the bound port).
    """
    if not config.state_dir.exists():  # readable by this user only (keys, datasets, the database)
        with contextlib.suppress(OSError):  # Store reports what is wrong with the folder
            config.state_dir.mkdir(mode=0o700, parents=True)
    store = open_state_store(config)  # SQLite: raises StateDirInUse when another scheduler holds the folder
    try:  # an s3 store that does not answer (or refuses the credentials) stops the start, naming it
        artifacts = Artifacts(await asyncio.to_thread(open_artifact_store, config), config.artifacts)
    except BaseException:
        store.close()
        raise
    http = None
    try:
        if http_port is not None:
            try:
                http = HttpEndpoint(  # http_tls: HTTPS (tls.py); http_metrics_token_file: the scrape token
                    host, http_port, tls=config.http_tls, scrape_token=config.http_metrics_token
                )
            except OSError as exc:
                raise OSError(f"cannot listen on HTTP port {host}:{http_port}: {exc.strerror or exc}") from None
        with store.exclusive("bootstrap"):  # schedulers started at once: one makes the bootstrap key
            security = build_security(config, store)  # before group commit: a bootstrap key commits at once
        # On PostgreSQL the lease decides who leads: a follower until elected (state/leadership.py).
        core = SchedulerCore(config, store, leading=store.kind != "postgres")
    except BaseException:
        if http is not None:
            await http.stop()
        store.close()
        raise
    core.worker_credentials = security.worker_credentials  # each assignment carries its attempt's credential
    core.enable_group_commit()
    security.interceptor.abort_refusal = abort_mapped  # its refusals carry RetryInfo, as the handlers' do
    most = security.limits.config.max_message_bytes
    options = [
        (k, most if k in ("grpc.max_send_message_length", "grpc.max_receive_message_length") else v)
        for k, v in SERVER_OPTIONS
    ] + PENDING_OPTIONS
    server = grpc.aio.server(options=options, interceptors=[security.interceptor])
    scheduler_service = SchedulerService(core, security=security)
    scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(scheduler_service, server)
    node_pb2_grpc.add_NodeServiceServicer_to_server(
        NodeService(core, security=security, scheduler_service=scheduler_service), server
    )
    admin_pb2_grpc.add_AdminServiceServicer_to_server(AdminService(security, durable=core.durable, core=core), server)
    artifact_pb2_grpc.add_ArtifactServiceServicer_to_server(
        ArtifactService(
            artifacts,
            security=security,
            durable=core.durable,
            require_leader=core.require_leader,
            attempt_refusal=core.api.attempt_refusal,
            task_owner=core.api.task_owner,
            dataset_visible=lambda dataset_id, owner: core.store.dataset_visible(dataset_id, owner),
        ),
        server,
    )
    scheduler_service.artifacts = artifacts  # DownloadCheckpoint reads the store
    # keep_checkpoints per task, after each recorded checkpoint; what it deletes is listed no more
    retention = Retention(artifacts, on_retired=core.checkpoints_retired)
    core.node_protocol.checkpoint_listeners.append(retention)
    expiry = Expiry(artifacts, expired=core.expired, on_deleted=core.checkpoint_deleted)
    health_servicer = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((*SERVICE_NAMES, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    # Plaintext: a front owns the public port and splices gRPC to a private loopback port, so
    # that curl http://host:PORT/health works there too (api/front.py). TLS: gRPC owns it.
    front = None
    if config.tls is None and config.http_on_grpc_port and http is not None:
        # The public port first: a private port taken first could be the very number asked for.
        front = PortFront(("127.0.0.1", 0), http.answer)
        try:
            bound, node_bound = await front.start(host, port), None
        except (OSError, OverflowError):
            bound, node_bound = 0, None
        private = tls_listen.bind(server, None, "127.0.0.1", 0)[0] if bound else 0
        front.upstream = ("127.0.0.1", private)
        bound = bound if private else 0
        security.interceptor.peer_of = front.peer_of
    else:
        bound, node_bound = tls_listen.bind(server, config.tls, host, port)
    if bound == 0 or node_bound == 0:
        await server.stop(None)
        if front is not None:
            await front.stop()
        if http is not None:
            await http.stop()
        store.close()
        which = f"{host}:{port}" if bound == 0 else f"{host}:{config.tls.node_port} (tls.node_port)"
        raise OSError(f"cannot listen on gRPC port {which} (in use, or not a valid port)")
    await server.start()
    address = advertise_address or f"{socket.gethostname() if host in ('0.0.0.0', '::', '') else host}:{bound}"
    if store.kind == "postgres":
        sc = config.store
        leadership = LeaseLeadership(
            core, store, address=address, lease_s=sc.leader_lease_s, renew_s=sc.renew_interval_s
        )
        if config.artifacts.backend == "local":
            log.warning(
                "several schedulers share this PostgreSQL store but checkpoints are in this one's state_dir "
                "(artifacts.backend local): after a failover the new leader cannot read them; use artifacts.backend s3",
                state_dir=str(config.state_dir),
            )
    else:
        leadership = StaticLeadership(core, address)
    await leadership.start()
    for name in ("", *SERVICE_NAMES):
        await _maybe_await(health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING))
    if http is not None:
        http.grpc_port = bound
        http.snapshot = _snapshot(core, leadership)
        http.node_messages = core.node_messages  # live counters, read by /metrics
        http.principal_of = security.keys.resolve if security.keys is not None else None
        http.submits_refused = scheduler_service.gate.refused
        http.audit_refusals = security.audit.refusals
        http.dashboard = Dashboard(core, security=security, artifacts=artifacts, secure=http.scheme == "https")
        http.start()
    tick = asyncio.create_task(_tick_loop(core, http, tick_interval_s, leadership))
    expiry_task = asyncio.create_task(expiry.run())
    log.info(
        "scheduler listening",
        grpc_port=bound,
        http_port=http.port if http else None,
        state_dir=str(config.state_dir),
        store=store.describe(),
        address=address,
        config=config.source,
        auth=security.enabled,
        tls=config.tls is not None,
        node_port=node_bound,
        artifacts=artifacts.store.describe(),
        http_on_grpc_port=front is not None,
        grpc_private_port=front.upstream[1] if front is not None else None,
    )
    return RunningScheduler(
        server=server,
        core=core,
        http=http,
        port=bound,
        tick_task=tick,
        security=security,
        node_port=node_bound,
        leadership=leadership,
        artifacts=artifacts,
        retention=retention,
        expiry_task=expiry_task,
        front=front,
        submit_gate=scheduler_service.gate,
    )


async def _maybe_await(value) -> None:
    if asyncio.iscoroutine(value):
        await value
