"""HTTP side port: ``GET /health`` (``{"status": "ok"}``, as the seed promises), ``GET /ready``,
``GET /metrics`` (Prometheus text format, prometheus-client), and the web dashboard at ``/`` and
``/ui/...`` (:mod:`.dashboard`, whose store reads run on the event loop, not in these threads).

Several schedulers on one PostgreSQL (``store: {kind: postgres}``): ``/health`` also says who
leads, ``{"status": "ok", "role": "follower", "leader": "host-a:8888", "epoch": 7}``, on every
instance (``"degraded"``, 503, while the database cannot be reached); ``/ready`` answers 200 only
on the leader (a load balancer or a Kubernetes readiness probe sends traffic there). With SQLite
there is one scheduler, always the leader, and ``/health`` stays ``{"status": "ok"}``.

Runs in a daemon thread (wsgiref, a thread per connection with timeouts:
:class:`opentinker_common.net.side_port.SidePortServer`). It never touches the SQLite connection: the event
loop publishes a :class:`Snapshot` every tick and these threads only read it.

With ``http_tls:`` in the config (:class:`~opentinker_scheduler.security.tls_config.HttpTlsConfig`) the port speaks
HTTPS only; the TLS handshake runs in the connection's thread with a timeout, so a client that
never finishes it blocks nobody.
"""

from __future__ import annotations

import json
import ssl
import threading
import time
from dataclasses import dataclass, field
from wsgiref.simple_server import WSGIRequestHandler

from opentinker_common.net.side_port import (
    SCRAPE_CHALLENGE,
    SidePortServer,
    make_side_port_server,
    require_scrape_token,
    scrape_refusal,
)

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


@dataclass(frozen=True)
class Snapshot:
    """State published by the event loop for the HTTP thread."""

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
    def __init__(self, holder: "HttpEndpoint") -> None:
        self.holder = holder

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
        counted = CounterMetricFamily(
            "opentinker_audit_refusals",
            "Refused submits and adapter imports, counted instead of audited one record each",
            labels=["action", "owner", "code"],
        )
        for (action, owner, code), n in sorted(dict(self.holder.audit_refusals).items()):
            counted.add_metric([action, owner, code], n)
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
        yield from _sharing_families(snap)


def _sharing_families(snap: Snapshot):
    """Quota queues, accounted usage and the scale signal (docs/operations.md, "Sharing a cluster")."""
    q_fams = [
        GaugeMetricFamily("opentinker_queue_gpus_in_use", "GPUs a quota queue's tasks hold", labels=["queue"]),
        GaugeMetricFamily("opentinker_queue_cpu_tasks_in_use", "CPU tasks of a quota queue running", labels=["queue"]),
        GaugeMetricFamily("opentinker_queue_gpu_quota", "Nominal GPU quota of a queue", labels=["queue"]),
        GaugeMetricFamily("opentinker_queue_cpu_task_quota", "Nominal CPU-task quota of a queue", labels=["queue"]),
        GaugeMetricFamily("opentinker_queue_pending_tasks", "Pending tasks of a quota queue", labels=["queue"]),
    ]
    for queue, gpus, cpus, gpu_quota, cpu_quota, pending in snap.queues:
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
    u_fams = [
        CounterMetricFamily(f"opentinker_usage_{name}", help_text, labels=["owner", "queue"])
        for name, help_text in names
    ]
    for owner, queue, *values in snap.usage:
        for fam, value in zip(u_fams, values):
            fam.add_metric([owner, queue], value)
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


def _with_header(start_response, header: tuple[str, str]):
    def start(status, headers, exc_info=None):
        return start_response(status, [*headers, header], exc_info)

    return start


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, *args) -> None:  # access logs are noise here
        pass


class HttpEndpoint:
    """The scheduler's HTTP port. ``snapshot`` is replaced (not mutated) by the event loop.

    Args:
        host, port: where to listen (``port=0``: a free port, see :attr:`port`).
        stale_after_s: ``/health`` answers 503 when the loop has not published for this long.
        tls: HTTPS with this ``http_tls`` pair (:class:`~opentinker_scheduler.security.tls_config.HttpTlsConfig`),
            or an :class:`ssl.SSLContext`; None = plain HTTP.
        scrape_token: ``/metrics`` answers only ``Authorization: Bearer <scrape_token>`` (401
            otherwise), here and on the gRPC port's HTTP answers; None = open.

    Raises:
        OSError: the port cannot be bound, or a TLS file cannot be read.
        ssl.SSLError: the TLS key does not match its certificate.
    """

    def __init__(
        self, host: str, port: int, *, stale_after_s: float = 10.0, tls=None, scrape_token: str | None = None
    ) -> None:
        self.snapshot = Snapshot()
        self.scrape_token = scrape_token
        #: kind -> messages received on node streams; the event loop increments, this thread reads.
        self.node_messages: dict[str, int] = {}
        self.submits_refused: dict[str, int] = {}
        #: (action, owner, code) -> refusals counted by the audit log (:attr:`AuditLog.refusals`).
        self.audit_refusals: dict[tuple[str, str, str], int] = {}
        self.stale_after_s = stale_after_s
        #: The scheduler's gRPC port, sent as the X-OpenTinker-Grpc-Port header once known.
        self.grpc_port: int | None = None
        self.registry = CollectorRegistry()
        self.registry.register(_Collector(self))
        self.scheduling_latency = Histogram(
            "opentinker_scheduling_latency_seconds",
            "Seconds from a task becoming pending to its assignment",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=self.registry,
        )
        self._metrics_app = make_wsgi_app(self.registry)
        context = tls if tls is None or isinstance(tls, ssl.SSLContext) else tls.server_context()
        self.scheme = "http" if context is None else "https"
        app = require_scrape_token(self._app, scrape_token)
        self.server: SidePortServer = make_side_port_server(host, port, app, _QuietHandler, ssl_context=context)
        self.port = self.server.server_port
        self._thread = threading.Thread(target=self.server.serve_forever, name="http", daemon=True)
        #: The web dashboard (``/``, ``/ui/...``: :mod:`.dashboard`), set by the server once its loop runs.
        self.dashboard = None

    def publish(self, snapshot: Snapshot) -> None:
        """Replace the snapshot (the event loop, about once a second); the dashboard keeps its
        telemetry as the sparklines' history."""
        self.snapshot = snapshot
        if self.dashboard is not None:
            self.dashboard.history.add(snapshot.gpus, snapshot.hosts)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        if self._thread.is_alive():  # shutdown() waits for serve_forever, which may never have run
            self.server.shutdown()
        self.server.server_close()

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
            return 200, [("Content-Type", CONTENT_TYPE_LATEST), *headers], generate_latest(self.registry)
        if self.dashboard is not None and self.dashboard.handles(path):
            page = (
                "<!doctype html><title>OpenTinker</title><p>This is the scheduler's gRPC port. The dashboard is on "
                f"its HTTP port, {self.port}: <code>{self.scheme}://&lt;this host&gt;:{self.port}/</code></p>"
            ).encode()
            return 200, [("Content-Type", "text/html; charset=utf-8"), *headers], page
        return 404, [("Content-Type", "application/json"), *headers], _NOT_FOUND

    def _app(self, environ, start_response):
        path = environ.get("PATH_INFO", "/")
        if self.grpc_port is not None:  # a gRPC client dialling this port by mistake is told where gRPC is
            start_response = _with_header(start_response, (GRPC_PORT_HEADER, str(self.grpc_port)))
        if path in ("/health", "/ready"):
            ok, body = self.health() if path == "/health" else self.ready()
            data = json.dumps(body).encode()
            start_response(
                "200 OK" if ok else "503 Service Unavailable",
                [("Content-Type", "application/json"), ("Content-Length", str(len(data)))],
            )
            return [data]
        if path == "/metrics":
            return self._metrics_app(environ, start_response)
        if self.dashboard is not None and self.dashboard.handles(path):
            return self.dashboard.wsgi(environ, start_response)
        start_response(
            "404 Not Found", [("Content-Type", "application/json"), ("Content-Length", str(len(_NOT_FOUND)))]
        )
        return [_NOT_FOUND]
