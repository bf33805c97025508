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

from opentinker.node.v1 import node_pb2, node_pb2_grpc
from opentinker.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from opentinker.scheduler.v1 import admin_pb2, admin_pb2_grpc

from opentinker_scheduler.security import tls_config as tls_listen
from opentinker_scheduler.api.admin import AdminService
from opentinker_scheduler.security.bundle import Security, build_security

from opentinker_scheduler.config import SchedulerConfig
from opentinker_scheduler.state.core import STATE_NAMES, SchedulerCore
from opentinker_scheduler.api.http import HttpEndpoint, Snapshot
from opentinker_scheduler.api.service import NodeService, SchedulerService
from opentinker_scheduler.state.leadership import LeaseLeadership, StaticLeadership
from opentinker_scheduler.state.store import open_store
from opentinker_common.net.grpc_options import server_options

log = structlog.get_logger("opentinker.scheduler")

#: Keepalive, agreed with the trainer and client channels: the server pings idle connections
#: every 30 s and accepts client pings no more often than every 10 s, with or without calls in
#: flight (trainers ping every 20 s), so an idle node is never dropped with `too_many_pings`.
SERVER_OPTIONS = server_options()

SERVICE_NAMES = (
    scheduler_pb2.DESCRIPTOR.services_by_name["SchedulerService"].full_name,
    node_pb2.DESCRIPTOR.services_by_name["NodeService"].full_name,
    admin_pb2.DESCRIPTOR.services_by_name["AdminService"].full_name,
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
    #: Who leads (state/leadership.py): always this one on SQLite, the lease on PostgreSQL.
    leadership: StaticLeadership | LeaseLeadership | None = None

    async def stop(self, grace: float = 2.0) -> None:
        self.tick_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.tick_task
        # End every node stream from our side first (a None in the outbox ends NodeService.Connect
        # normally), so stopping the server does not cancel those handlers mid-await, which
        # grpc.aio logs as an unhandled CancelledError. The nodes reconnect to the next scheduler.
        for node in list(self.core.nodes.values()):
            node.outbox.put_nowait(None)
        await asyncio.sleep(0)
        await self.server.stop(grace)
        self.core.flush()
        if self.leadership is not None:
            await self.leadership.stop()  # a leader hands its lease back: a follower takes over at once
        if self.http is not None:
            self.http.stop()
        self.core.store.close()


def _snapshot(core: SchedulerCore, leadership=None) -> Snapshot:
    counts = {STATE_NAMES[s]: n for s, n in core.state_counts.items() if n}
    gpus = []
    for node in core.nodes.values():
        if not node.connected:
            continue
        for t in node.telemetry:
            values = {
                k: float(getattr(t, k))
                for k in ("utilization_percent", "memory_used_bytes", "memory_total_bytes", "temperature_c", "power_w")
                if t.HasField(k)
            }
            gpus.append((node.node_id, str(t.index), t.simulated, values))
    view = leadership.view() if leadership is not None else None
    return Snapshot(
        role=view.role if view else "leader",
        leader=view.leader if view else "",
        epoch=view.epoch if view else None,
        ha=view.ha if view else False,
        time=time.monotonic(),
        store_writable=leadership.store_ok() if leadership is not None else core.store.writable(),
        tasks_by_state=counts,
        queue_depth=counts.get("PENDING", 0),
        nodes_connected=sum(1 for n in core.nodes.values() if n.connected),
        nodes_known=len(core.nodes),
        gpus=tuple(gpus),
    )


async def _tick_loop(core: SchedulerCore, http: HttpEndpoint | None, interval_s: float, leadership=None) -> None:
    last_snapshot = 0.0
    last_tick = time.monotonic()
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
                if time.monotonic() - last_snapshot > 1.0:
                    http.snapshot = _snapshot(core, leadership)
                    last_snapshot = time.monotonic()
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
    store = open_store(config)  # SQLite: raises StateDirInUse when another scheduler holds the folder
    http = None
    try:
        if http_port is not None:
            try:
                http = HttpEndpoint(host, http_port, tls=config.http_tls)  # http_tls: HTTPS (tls.py)
            except OSError as exc:
                raise OSError(f"cannot listen on HTTP port {host}:{http_port}: {exc.strerror or exc}") from None
        with store.exclusive("bootstrap"):  # schedulers started at once: one makes the bootstrap key
            security = build_security(config, store)  # before group commit: a bootstrap key commits at once
        # On PostgreSQL the lease decides who leads: a follower until elected (state/leadership.py).
        core = SchedulerCore(config, store, leading=store.kind != "postgres")
    except BaseException:
        store.close()
        raise
    core.enable_group_commit()
    most = security.limits.config.max_message_bytes
    options = [
        (k, most if k in ("grpc.max_send_message_length", "grpc.max_receive_message_length") else v)
        for k, v in SERVER_OPTIONS
    ]
    server = grpc.aio.server(options=options, interceptors=[security.interceptor])
    scheduler_service = SchedulerService(core, security=security)
    scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(scheduler_service, server)
    node_pb2_grpc.add_NodeServiceServicer_to_server(
        NodeService(core, security=security, scheduler_service=scheduler_service), server
    )
    admin_pb2_grpc.add_AdminServiceServicer_to_server(AdminService(security, durable=core.durable), server)
    health_servicer = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((*SERVICE_NAMES, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    bound, node_bound = tls_listen.bind(server, config.tls, host, port)
    if bound == 0 or node_bound == 0:
        await server.stop(None)
        if http is not None:
            http.stop()
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
    else:
        leadership = StaticLeadership(core, address)
    await leadership.start()
    for name in ("", *SERVICE_NAMES):
        await _maybe_await(health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING))
    if http is not None:
        http.snapshot = _snapshot(core, leadership)
        http.node_messages = core.node_messages  # live counters; the HTTP thread only reads them
        http.start()
    tick = asyncio.create_task(_tick_loop(core, http, tick_interval_s, leadership))
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
    )


async def _maybe_await(value) -> None:
    if asyncio.iscoroutine(value):
        await value
