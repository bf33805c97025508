"""HTTP port: ``GET /health`` (``{"status": "ok"}``, as the seed promises), ``GET /ready``,
``GET /metrics`` (Prometheus text format, prometheus-client), and the web dashboard at ``/`` and
``/ui/...`` (:mod:`.dashboard`).

Several schedulers on one PostgreSQL (``store: {kind: postgres}``): ``/health`` also says who
leads, ``{"status": "ok", "role": "follower", "leader": "host-a:8888", "epoch": 7}``, on every
instance (``"degraded"``, 503, while the database cannot be reached); ``/ready`` answers 200 only
on the leader (a load balancer or a Kubernetes readiness probe sends traffic there). With SQLite
there is one scheduler, always the leader, and ``/health`` stays ``{"status": "ok"}``.

Served by uvicorn (h11) with Starlette on the scheduler's own event loop: no threads, and the
dashboard reads the store and the core directly. The event loop publishes a :class:`Snapshot`
every tick; ``/health`` and ``/metrics`` read only that. The bounds that keep any client from
holding the port are :mod:`opentinker_common.net.bounded_http`'s: a request head of at most 16 KiB,
a body of at most :data:`MAX_BODY_BYTES` (checked against ``Content-Length`` before anything is
read, and again while it streams), a deadline of :attr:`HttpEndpoint.head_timeout_s` on each
request's head and body, and at most 1024 connections at once.

``/metrics`` names owners (usage by owner, owners' own queues) only to an admin API key, to the
scrape token, or with auth off; anyone else sees totals.

With ``http_tls:`` in the config (:class:`~opentinker_scheduler.security.tls_config.HttpTlsConfig`) the port speaks
HTTPS only.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
import time
from dataclasses import dataclass, field
from typing import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from opentinker_common.net.bounded_http import bounded_server, framing_refusal, listen
from opentinker_common.net.side_port import SCRAPE_CHALLENGE, scrape_refusal

#: Most bytes of a request body; a dashboard form is a few hundred.
MAX_BODY_BYTES = 65536


@dataclass(frozen=True)
class Snapshot:
    """State published by the event loop for /health and /metrics."""

    time: float = 0.0  # monotonic seconds of the last tick
    store_writable: bool = False
    tasks_by_state: dict[str, int] = field(default_factory=dict)
    queue_depth: int = 0
    nodes_connected: int = 0
    nodes_known: int = 0
    gpus: tuple[tuple[str, str, bool, dict[str, float]], ...] = ()  # node, index, simulated, values
    hosts: tuple[tuple[str, dict[str, float]], ...] = ()  # node, host CPU/memory values
    role: str = "leader"  # leader | follower
    leader: str = ""  # host:port of the leader ("" unknown)
    epoch: int | None = None
    #: Several schedulers may share the store: /health shows role and leader.
    ha: bool = False
    #: Quota queues: (queue, GPUs in use, CPU tasks in use, GPU quota or -1, CPU-task quota or -1, pending).
    queues: tuple[tuple[str, int, int, int, int, int], ...] = ()
    #: Accounted usage per owner: (owner, queue, GPU-seconds, CPU-task seconds, tokens generated,
    #: tokens trained, env steps, cost).
    usage: tuple[tuple[str, str, float, float, float, float, float, float], ...] = ()
    #: The scale signal: (node class, desired trainers, connected trainers).
    desired_trainers: tuple[tuple[str, int, int], ...] = ()


class _Collector:
    """The scheduler's figures from the last snapshot; ``owners`` False: usage as totals and only
    configured queues (an owner's own queue is named after the owner)."""

    def __init__(self, holder: "HttpEndpoint", *, owners: bool) -> None:
        self.holder = holder
        self.owners = owners

    def collect(self):
        snap = self.holder.snapshot
        tasks = GaugeMetricFamily("opentinker_tasks", "Tasks by state", labels=["state"])
        for state, n in sorted(snap.tasks_by_state.items()):
            tasks.add_metric([state.lower()], n)
        yield tasks
        yield GaugeMetricFamily("opentinker_queue_depth", "Pending tasks", value=snap.queue_depth)
        nodes = GaugeMetricFamily("opentinker_nodes", "Trainer nodes", labels=["status"])
        nodes.add_metric(["connected"], snap.nodes_connected)
        nodes.add_metric(["disconnected"], snap.nodes_known - snap.nodes_connected)
        yield nodes
        yield GaugeMetricFamily(
            "opentinker_scheduler_leader", "1 when this scheduler leads, else 0", value=int(snap.role == "leader")
        )
        received = CounterMetricFamily("opentinker_node_messages", "Messages received on node streams", labels=["kind"])
        for kind, n in sorted(dict(self.holder.node_messages).items()):
            received.add_metric([kind], n)
        yield received
        refused = CounterMetricFamily(
            "opentinker_submits_refused",
            "SubmitTask calls refused before anything was done (OVERLOADED, SHUTTING_DOWN)",
            labels=["reason"],
        )
        for reason, n in sorted(dict(self.holder.submits_refused).items()):
            refused.add_metric([reason.lower()], n)
        yield refused
        # Per owner only for those who may see owners' names; others get each action's total.
        labels = ["action", "owner", "code"] if self.owners else ["action", "code"]
        counted = CounterMetricFamily(
            "opentinker_audit_refusals",
            "Refused submits and adapter imports, counted instead of audited one record each",
            labels=labels,
        )
        totals: dict[tuple[str, ...], int] = {}
        for (action, owner, code), n in sorted(dict(self.holder.audit_refusals).items()):
            key = (action, owner, code) if self.owners else (action, code)
            totals[key] = totals.get(key, 0) + n
        for key, n in totals.items():
            counted.add_metric(list(key), n)
        yield counted
        fams = {
            "utilization_percent": GaugeMetricFamily(
                "opentinker_gpu_utilization_percent", "GPU utilization (%)", labels=["node_id", "gpu", "simulated"]
            ),
            "memory_used_bytes": GaugeMetricFamily(
                "opentinker_gpu_memory_used_bytes", "GPU memory used (bytes)", labels=["node_id", "gpu", "simulated"]
            ),
            "memory_total_bytes": GaugeMetricFamily(
                "opentinker_gpu_memory_total_bytes", "GPU memory total (bytes)", labels=["node_id", "gpu", "simulated"]
            ),
            "temperature_c": GaugeMetricFamily(
                "opentinker_gpu_temperature_celsius", "GPU temperature (C)", labels=["node_id", "gpu", "simulated"]
            ),
            "power_w": GaugeMetricFamily(
                "opentinker_gpu_power_watts", "GPU power draw (W)", labels=["node_id", "gpu", "simulated"]
            ),
        }
        for node_id, index, simulated, values in snap.gpus:
            for key, fam in fams.items():
                if key in values:
                    fam.add_metric([node_id, index, str(simulated).lower()], values[key])
        yield from fams.values()
        host_fams = {
            "cpu_utilization_percent": GaugeMetricFamily(
                "opentinker_node_cpu_utilization_percent", "Host CPU busy, % of all cores", labels=["node_id"]
            ),
            "cpu_count": GaugeMetricFamily("opentinker_node_cpu_count", "Host logical CPUs", labels=["node_id"]),
            "memory_used_bytes": GaugeMetricFamily(
                "opentinker_node_memory_used_bytes", "Host memory in use (bytes)", labels=["node_id"]
            ),
            "memory_total_bytes": GaugeMetricFamily(
                "opentinker_node_memory_total_bytes", "Host memory total (bytes)", labels=["node_id"]
            ),
        }
        for node_id, values in snap.hosts:
            for key, fam in host_fams.items():
                if key in values:
                    fam.add_metric([node_id], values[key])
        yield from host_fams.values()
        yield from _sharing_families(snap, owners=self.owners)


def _sharing_families(snap: Snapshot, *, owners: bool):
    """Quota queues, accounted usage and the scale signal (docs/operations.md, "Sharing a cluster").
    ``owners`` False: no owner's name, so usage is summed and owners' own queues are left out."""
    q_fams = [
        GaugeMetricFamily("opentinker_queue_gpus_in_use", "GPUs a quota queue's tasks hold", labels=["queue"]),
        GaugeMetricFamily("opentinker_queue_cpu_tasks_in_use", "CPU tasks of a quota queue running", labels=["queue"]),
        GaugeMetricFamily("opentinker_queue_gpu_quota", "Nominal GPU quota of a queue", labels=["queue"]),
        GaugeMetricFamily("opentinker_queue_cpu_task_quota", "Nominal CPU-task quota of a queue", labels=["queue"]),
        GaugeMetricFamily("opentinker_queue_pending_tasks", "Pending tasks of a quota queue", labels=["queue"]),
    ]
    for queue, gpus, cpus, gpu_quota, cpu_quota, pending in snap.queues:
        if not owners and gpu_quota < 0:  # no quota: an owner's own queue, named after the owner
            continue
        q_fams[0].add_metric([queue], gpus)
        q_fams[1].add_metric([queue], cpus)
        if gpu_quota >= 0:
            q_fams[2].add_metric([queue], gpu_quota)
            q_fams[3].add_metric([queue], cpu_quota)
        q_fams[4].add_metric([queue], pending)
    yield from q_fams
    names = (
        ("gpu_seconds", "GPU-seconds used (per GPU, assignment to stop)"),
        ("cpu_task_seconds", "Seconds CPU tasks held a task slot"),
        ("tokens_generated", "Tokens sampled in rollouts"),
        ("tokens_trained", "Tokens trained on"),
        ("env_steps", "Environment steps taken"),
        ("cost", "Cost of GPU time at the configured price per GPU-hour of each node class"),
    )
    if owners:
        u_fams = [
            CounterMetricFamily(f"opentinker_usage_{name}", help_text, labels=["owner", "queue"])
            for name, help_text in names
        ]
        for owner, queue, *values in snap.usage:
            for fam, value in zip(u_fams, values):
                fam.add_metric([owner, queue], value)
    else:
        totals = [sum(row[2 + i] for row in snap.usage) for i in range(len(names))]
        u_fams = [
            CounterMetricFamily(f"opentinker_usage_{name}", f"{help_text}, all owners", value=total)
            for (name, help_text), total in zip(names, totals)
        ]
    yield from u_fams
    desired = GaugeMetricFamily(
        "opentinker_desired_trainers", "Trainers the pending and running work needs", labels=["node_class"]
    )
    connected = GaugeMetricFamily("opentinker_connected_trainers", "Trainers connected", labels=["node_class"])
    for node_class, want, have in snap.desired_trainers:
        desired.add_metric([node_class], want)
        connected.add_metric([node_class], have)
    yield desired
    yield connected


#: The header of every answer that names the scheduler's gRPC port (read by the client to say
#: "that is the scheduler's HTTP port; its gRPC port is ..." when it dials this port by mistake).
GRPC_PORT_HEADER = "X-OpenTinker-Grpc-Port"
_NOT_FOUND = b'{"error": "not found; try /health, /ready, /metrics or the dashboard at /"}'


class HttpEndpoint:
    """The scheduler's HTTP port. ``snapshot`` is replaced (not mutated) by the event loop.

    Args:
        host, port: where to listen (``port=0``: a free port, see :attr:`port`). Bound at once.
        stale_after_s: ``/health`` answers 503 when the loop has not published for this long.
        tls: HTTPS with this ``http_tls`` pair (:class:`~opentinker_scheduler.security.tls_config.HttpTlsConfig`),
            or an :class:`ssl.SSLContext`; None = plain HTTP.
        scrape_token: every path but ``/health``, ``/live`` and ``/ready`` answers only
            ``Authorization: Bearer <scrape_token>`` (401 otherwise), here and on the gRPC port's
            HTTP answers; None = open.

    Raises:
        OSError: the port cannot be bound, or a TLS file cannot be read.
        ssl.SSLError: the TLS key does not match its certificate.
    """

    #: Seconds a request's head and body may take to arrive, from the connection or the previous answer.
    head_timeout_s = 10.0

    def __init__(
        self, host: str, port: int, *, stale_after_s: float = 10.0, tls=None, scrape_token: str | None = None
    ) -> None:
        self.snapshot = Snapshot()
        self.scrape_token = scrape_token
        #: kind -> messages received on node streams; the event loop increments them.
        self.node_messages: dict[str, int] = {}
        self.submits_refused: dict[str, int] = {}
        #: (action, owner, code) -> refusals counted by the audit log (:attr:`AuditLog.refusals`).
        self.audit_refusals: dict[tuple[str, str, str], int] = {}
        self.stale_after_s = stale_after_s
        #: The scheduler's gRPC port, sent as the X-OpenTinker-Grpc-Port header once known.
        self.grpc_port: int | None = None
        #: API key -> principal (raises for an unusable key), set by the server; None: auth off.
        self.principal_of: Callable | None = None
        #: Everything, owners named: for admins, the scrape token, and with auth off.
        self.registry = CollectorRegistry()
        self.registry.register(_Collector(self, owners=True))
        #: The same figures without an owner's name, for everyone else.
        self.totals_registry = CollectorRegistry()
        self.totals_registry.register(_Collector(self, owners=False))
        self.scheduling_latency = Histogram(
            "opentinker_scheduling_latency_seconds",
            "Seconds from a task becoming pending to its assignment",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=self.registry,
        )
        self.totals_registry.register(self.scheduling_latency)
        context = tls if tls is None or isinstance(tls, ssl.SSLContext) else tls.server_context()
        self.scheme = "http" if context is None else "https"
        #: The web dashboard (``/``, ``/ui/...``: :mod:`.dashboard`), set by the server once its loop runs.
        self.dashboard = None
        self.app = Starlette(
            routes=[
                Route("/health", self._probe, methods=["GET", "HEAD"]),
                Route("/ready", self._probe, methods=["GET", "HEAD"]),
                Route("/metrics", self._metrics, methods=["GET", "HEAD"]),
                Route("/{path:path}", self._other, methods=["GET", "HEAD", "POST"]),
            ]
        )
        self._socket = listen(host, port)
        self.port = self._socket.getsockname()[1]
        self.server = bounded_server(self._guarded, self, ssl_context=context)
        self._task: asyncio.Task | None = None

    def publish(self, snapshot: Snapshot) -> None:
        """Replace the snapshot (the event loop, about once a second); the dashboard keeps its
        telemetry as the sparklines' history."""
        self.snapshot = snapshot
        if self.dashboard is not None:
            self.dashboard.history.add(snapshot.gpus, snapshot.hosts)

    def start(self) -> None:
        """Serve on the running event loop, as one of its tasks."""
        self._task = asyncio.get_running_loop().create_task(self.server.serve(sockets=[self._socket]), name="http")

    async def stop(self) -> None:
        """Stop serving: open connections are closed, answers in progress get a second to finish."""
        if self._task is None:
            self._socket.close()
            return
        self.server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    def health(self) -> tuple[bool, dict]:
        """``(healthy, body)`` of ``/health``: healthy while the loop runs and the store answers."""
        snap = self.snapshot
        role = {"role": snap.role, "leader": snap.leader or None, "epoch": snap.epoch} if snap.ha else {}
        if snap.time == 0.0:
            return False, {"status": "starting", **role}
        if time.monotonic() - snap.time > self.stale_after_s:
            return False, {"status": "unavailable", "reason": "scheduler loop stalled", **role}
        if not snap.store_writable:
            if snap.ha:
                return False, {"status": "degraded", "reason": "state store unavailable (retrying)", **role}
            return False, {"status": "unavailable", "reason": "state store not writable"}
        return True, {"status": "ok", **role}

    def ready(self) -> tuple[bool, dict]:
        """``(ready, body)`` of ``/ready``: healthy and the leader (the one that takes writes and
        node streams)."""
        ok, body = self.health()
        if ok and self.snapshot.role != "leader":
            return False, {**body, "status": "follower", "reason": "not the leader"}
        return ok, body

    def sees_owners(self, authorization: str) -> bool:
        """Whether a ``/metrics`` request with this ``Authorization`` header value may see owners'
        names: with a scrape token set (the request got past it), with auth off (every caller is
        the anonymous admin), or with an admin API key as its bearer token."""
        if self.scrape_token or self.principal_of is None:
            return True
        scheme, _, key = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return False
        try:
            return bool(self.principal_of(key.strip()).is_admin)
        except Exception:  # noqa: BLE001 - an unknown, revoked or malformed key sees totals
            return False

    def metrics_text(self, authorization: str) -> bytes:
        """The ``/metrics`` body for a request with this ``Authorization`` header value."""
        registry = self.registry if self.sees_owners(authorization) else self.totals_registry
        return generate_latest(registry)

    def answer(self, method: str, path: str, authorization: str = "") -> tuple[int, list[tuple[str, str]], bytes]:
        """``(status, headers, body)`` of ``GET path`` (with that ``Authorization`` header value):
        what the HTTP/1.1 answers on the gRPC port (:mod:`.front`) send, from the same handlers
        (and the same scrape token) as this port."""
        headers = [] if self.grpc_port is None else [(GRPC_PORT_HEADER, str(self.grpc_port))]
        refusal = scrape_refusal(self.scrape_token, path, authorization)
        if refusal is not None:
            return 401, [("Content-Type", "application/json"), SCRAPE_CHALLENGE, *headers], refusal
        if path in ("/health", "/ready"):
            ok, body = self.health() if path == "/health" else self.ready()
            return 200 if ok else 503, [("Content-Type", "application/json"), *headers], json.dumps(body).encode()
        if path == "/metrics":
            return 200, [("Content-Type", CONTENT_TYPE_LATEST), *headers], self.metrics_text(authorization)
        if self.dashboard is not None and self.dashboard.handles(path):
            page = (
                "<!doctype html><title>OpenTinker</title><p>This is the scheduler's gRPC port. The dashboard is on "
                f"its HTTP port, {self.port}: <code>{self.scheme}://&lt;this host&gt;:{self.port}/</code></p>"
            ).encode()
            return 200, [("Content-Type", "text/html; charset=utf-8"), *headers], page
        return 404, [("Content-Type", "application/json"), *headers], _NOT_FOUND

    # ------------------------------------------------------------------ ASGI
    async def _guarded(self, scope, receive, send) -> None:
        """The app behind the bounds every request meets first: ``Content-Length`` and the scrape
        token; every answer names the gRPC port."""
        if scope["type"] != "http":
            return
        refusal = framing_refusal(scope["headers"], MAX_BODY_BYTES)
        if refusal is None:
            authorization = next((v for k, v in scope["headers"] if k == b"authorization"), b"").decode("latin-1")
            body = scrape_refusal(self.scrape_token, scope["path"], authorization)
            if body is not None:
                refusal = Response(body, 401, headers=dict([SCRAPE_CHALLENGE]), media_type="application/json")
        grpc_port = self.grpc_port

        async def named(message) -> None:
            if message["type"] == "http.response.start" and grpc_port is not None:
                message = {**message, "headers": [*message["headers"], (b"x-opentinker-grpc-port", b"%d" % grpc_port)]}
            await send(message)

        await (refusal or self.app)(scope, receive, named)

    async def _probe(self, request: Request) -> Response:
        ok, body = self.health() if request.url.path == "/health" else self.ready()
        return Response(json.dumps(body).encode(), 200 if ok else 503, media_type="application/json")

    async def _metrics(self, request: Request) -> Response:
        text = self.metrics_text(request.headers.get("authorization", ""))
        return Response(text, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _other(self, request: Request) -> Response:
        if self.dashboard is not None and self.dashboard.handles(request.url.path):
            return await self.dashboard.serve(request, max_body_bytes=MAX_BODY_BYTES)
        return Response(_NOT_FOUND, 404, media_type="application/json")
