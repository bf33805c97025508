"""The trainer node's HTTP side port: ``GET /health``, ``GET /live`` and ``GET /metrics``.

* ``/health`` (readiness) -> 200 ``{"status": "ok"}`` only while the node's ``Connect`` stream
  to the scheduler is open and registered; otherwise 503 with ``status`` (``"unavailable"``,
  ``"draining"``) and a ``reason`` a person can act on ("not connected to scheduler at
  host:8888: connection refused").
* ``/live`` (liveness) -> 200 ``{"status": "alive"}`` while the agent's event loop turns; 503 when
  it has not turned for ``stall_after_s``. It stays 200 while the scheduler is away, so an
  orchestrator does not restart (and so kill the workers of) a node that is only waiting for
  its scheduler to come back.
* ``/metrics`` -> Prometheus text format from a registry of its own (prometheus-client):
  node state (connected, draining, running tasks, capacity), per-GPU telemetry read from NVML at
  scrape time (utilization %, memory bytes, temperature C, power W; simulated devices labelled
  ``simulated="true"``), and per running task the latest step, reward, loss, ``perf/*`` values
  and the step rate (steps per second over the last reports).

The server is uvicorn with Starlette on an event loop of its own, in a daemon thread, with the
bounds of :mod:`opentinker_common.net.bounded_http`: a request's head must arrive within
:attr:`TrainerHttp.head_timeout_s` seconds, at most 1024 connections at once, no request body.
So slow or half-sent requests hold no probe off, and a stalled agent loop still gets its 503 from
``/live``. The server never touches the agent loop's objects beyond reading flags and copying small
dicts; the agent pushes metric reports through :meth:`TrainerHttp.on_metric`, which takes a lock.

With ``--http-tls-cert``/``--http-tls-key`` (``$OPENTINKER_HTTP_TLS_CERT``/``_KEY``) the port speaks
HTTPS only; a handshake must end within the same deadline, so a client that never finishes it
blocks nobody; with ``--http-tls-client-ca`` too, only clients with a certificate that CA signed
get an answer (mTLS; probes included).

The per-task series name every owner's running task ids (with step, reward, loss), which the API
shows only to their owner. Two guards (docs/security.md): ``--http-metrics-token-file`` (a
scraper must send ``Authorization: Bearer <token>``; ``/health`` and ``/live`` stay open for
probes) and ``--http-no-task-labels`` (no per-task series at all; the node's counts stay).
"""

from __future__ import annotations

import asyncio
import json
import math
import ssl
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Mapping

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from opentinker_common.net.bounded_http import bounded_server, framing_refusal, listen
from opentinker_common.net.side_port import SCRAPE_CHALLENGE, scrape_refusal

if TYPE_CHECKING:  # pragma: no cover
    from opentinker_trainer.agent import NodeAgent

__all__ = ["StepRate", "TrainerHttp"]

#: (telemetry field, metric name, help) exported per GPU; names agree with the scheduler's /metrics.
GPU_FIELDS = (
    ("utilization_percent", "opentinker_gpu_utilization_percent", "GPU utilization (%)"),
    ("memory_used_bytes", "opentinker_gpu_memory_used_bytes", "GPU memory used (bytes)"),
    ("memory_total_bytes", "opentinker_gpu_memory_total_bytes", "GPU memory total (bytes)"),
    ("temperature_c", "opentinker_gpu_temperature_celsius", "GPU temperature (C)"),
    ("power_w", "opentinker_gpu_power_watts", "GPU power draw (W)"),
    ("sm_clock_mhz", "opentinker_gpu_sm_clock_mhz", "GPU SM clock (MHz)"),
    ("ecc_errors", "opentinker_gpu_ecc_errors", "GPU uncorrected volatile ECC errors"),
)


@dataclass
class StepRate:
    """Latest values and step rate of one task attempt, from its worker's metric reports.

    ``rate()`` is steps per second over the last ``window`` reports (worker wall-clock times),
    ``(step_last - step_first) / (time_last - time_first)``; with a single report it falls back
    to ``1 / perf/step_s`` when the worker reports that, else ``None``.
    """

    window: int = 20
    points: deque = field(default_factory=deque)  # (time_s, step)
    step: int = 0
    values: dict[str, float] = field(default_factory=dict)
    reports: int = 0

    def add(self, step: int, values: Mapping[str, float], time_s: float) -> None:
        self.points.append((float(time_s), int(step)))
        while len(self.points) > self.window:
            self.points.popleft()
        self.step = int(step)
        self.values = dict(values)
        self.reports += 1

    def rate(self) -> float | None:
        if len(self.points) >= 2:
            (t0, s0), (t1, s1) = self.points[0], self.points[-1]
            if t1 > t0 and s1 >= s0:
                return (s1 - s0) / (t1 - t0)
        step_s = self.values.get("perf/step_s")
        if step_s is not None and math.isfinite(step_s) and step_s > 0:
            return 1.0 / step_s
        return None


class _Collector:
    def __init__(self, http: "TrainerHttp") -> None:
        self.http = http

    def collect(self) -> Iterable:
        http = self.http
        agent = http.agent
        node = agent.config.node_id
        workers = dict(agent.workers)  # a copy: the event loop mutates the dict
        inv = agent.monitor.inventory

        yield GaugeMetricFamily(
            "opentinker_trainer_connected",
            "1 while the Connect stream to the scheduler is open and registered",
            value=1.0 if agent.connected.is_set() else 0.0,
        )
        yield GaugeMetricFamily(
            "opentinker_trainer_draining",
            "1 once the node is draining (SIGTERM or the scheduler asked)",
            value=1.0 if agent.draining else 0.0,
        )
        yield GaugeMetricFamily(
            "opentinker_trainer_running_tasks", "Worker processes running on this node", value=len(workers)
        )
        yield GaugeMetricFamily(
            "opentinker_trainer_max_tasks", "Tasks this node runs at once", value=agent.config.max_tasks
        )
        gpus = GaugeMetricFamily("opentinker_trainer_gpus", "GPUs this node offers", labels=["simulated"])
        gpus.add_metric([str(inv.simulated).lower()], len(inv.devices))
        yield gpus
        reports = CounterMetricFamily(
            "opentinker_trainer_metric_reports", "Metric reports received from this node's workers"
        )
        reports.add_metric([], http.metric_reports)
        yield reports

        fams = {
            key: GaugeMetricFamily(name, text, labels=["node_id", "gpu", "simulated"]) for key, name, text in GPU_FIELDS
        }
        unavailable = GaugeMetricFamily(
            "opentinker_gpu_field_unavailable",
            "1 for each telemetry field NVML could not give, with the reason",
            labels=["node_id", "gpu", "field", "reason"],
        )
        for t in http.read_telemetry():
            labels = [node, str(t.index), str(bool(t.simulated)).lower()]
            for key, fam in fams.items():
                if t.HasField(key):
                    fam.add_metric(labels, float(getattr(t, key)))
            for name, reason in sorted(t.unavailable.items()):
                unavailable.add_metric([node, str(t.index), name, reason], 1.0)
        yield from fams.values()
        yield unavailable

        if not http.task_labels:  # --http-no-task-labels: nothing names a task
            return
        running = {(w.task_id, w.attempt) for w in workers.values()}
        with http.lock:
            for key in [k for k in http.rates if k not in running]:
                del http.rates[key]  # the attempt ended: forget it
            rates = [(k, r.step, dict(r.values), r.rate()) for k, r in http.rates.items()]
        labels = ["task_id", "attempt"]
        step = GaugeMetricFamily("opentinker_task_step", "Newest step a running task reported", labels=labels)
        rate = GaugeMetricFamily(
            "opentinker_task_steps_per_second",
            "Steps per second of a running task over its last reports",
            labels=labels,
        )
        reward = GaugeMetricFamily(
            "opentinker_task_reward", "Mean reward of a running task's newest step", labels=labels
        )
        loss = GaugeMetricFamily("opentinker_task_loss", "Loss of a running task's newest step", labels=labels)
        perf = GaugeMetricFamily(
            "opentinker_task_perf",
            "perf/* values of a running task's newest step (key without the prefix)",
            labels=[*labels, "key"],
        )
        for (task_id, attempt), s, values, r in sorted(rates):
            lv = [task_id, str(attempt)]
            step.add_metric(lv, s)
            if r is not None:
                rate.add_metric(lv, r)
            if "reward" in values:
                reward.add_metric(lv, values["reward"])
            if "loss" in values:
                loss.add_metric(lv, values["loss"])
            for k, v in sorted(values.items()):
                if k.startswith("perf/"):
                    perf.add_metric([*lv, k[len("perf/") :]], v)
        yield from (step, rate, reward, loss, perf)


class TrainerHttp:
    """HTTP side port of a :class:`~opentinker_trainer.agent.NodeAgent`.

    Args:
        agent: the node agent whose state is served.
        host, port: where to listen; ``port=0`` picks a free port (see :attr:`port`).
        stall_after_s: ``/live`` answers 503 when the event loop has not turned for this long.
        ssl_context: serve HTTPS with it (:func:`opentinker_common.net.tls.server_ssl_context`);
            None = plain HTTP.
        scrape_token: answer ``/metrics`` only with ``Authorization: Bearer <scrape_token>``
            (401 otherwise; :func:`~opentinker_common.net.side_port.scrape_refusal`); None = open.
        task_labels: export the per-task series (``opentinker_task_*`` with ``task_id``); False
            drops them, the node-level series stay.

    Raises:
        OSError: the port cannot be bound (in use, no permission).
    """

    #: Seconds a request's head may take to arrive, from the connection or the previous answer;
    #: also the bound on a TLS handshake.
    head_timeout_s = 10.0

    def __init__(
        self,
        agent: "NodeAgent",
        host: str = "0.0.0.0",
        port: int = 0,
        *,
        stall_after_s: float = 30.0,
        ssl_context: ssl.SSLContext | None = None,
        scrape_token: str | None = None,
        task_labels: bool = True,
    ) -> None:
        self.agent = agent
        self.task_labels = task_labels
        self.stall_after_s = stall_after_s
        self.lock = threading.Lock()
        self.rates: dict[tuple[str, int], StepRate] = {}
        self.metric_reports = 0
        self.loop_tick = time.monotonic()
        self.registry = CollectorRegistry()
        self.registry.register(_Collector(self))
        self.scrape_token = scrape_token
        self.scheme = "http" if ssl_context is None else "https"
        self.app = Starlette(
            routes=[
                Route("/health", self._probe, methods=["GET", "HEAD"]),
                Route("/live", self._probe, methods=["GET", "HEAD"]),
                Route("/metrics", self._metrics, methods=["GET", "HEAD"]),
                Route("/{path:path}", self._not_found, methods=["GET", "HEAD", "POST", "PUT", "DELETE"]),
            ]
        )
        self._socket = listen(host, port)
        self.port = self._socket.getsockname()[1]
        self.server = bounded_server(self._guarded, self, ssl_context=ssl_context)
        self._thread = threading.Thread(target=self._serve, name="trainer-http", daemon=True)
        self._ticker: asyncio.Task | None = None
        agent.metric_listeners.append(self.on_metric)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Serve in a daemon thread; call from the agent's event loop (starts the /live ticker)."""
        self._ticker = asyncio.get_running_loop().create_task(self._tick())
        self._thread.start()

    def stop(self) -> None:
        """Stop serving: open connections are closed, answers in progress get a second to finish."""
        if self._ticker is not None:
            self._ticker.cancel()
        self.server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)
        self._socket.close()
        if self.on_metric in self.agent.metric_listeners:
            self.agent.metric_listeners.remove(self.on_metric)

    def _serve(self) -> None:
        asyncio.run(self.server.serve(sockets=[self._socket]))

    async def _tick(self) -> None:
        while True:
            self.loop_tick = time.monotonic()
            await asyncio.sleep(1.0)

    # ------------------------------------------------------------------ inputs
    def on_metric(self, task_id: str, attempt: int, step: int, values: Mapping[str, float], time_s: float) -> None:
        """A worker reported ``values`` for ``step`` at wall-clock ``time_s`` (seconds)."""
        with self.lock:
            self.rates.setdefault((task_id, attempt), StepRate()).add(step, values, time_s)
            self.metric_reports += 1

    def read_telemetry(self) -> list:
        """Current per-GPU telemetry (NVML read now; thread-safe). Empty on a CPU node."""
        try:
            return list(self.agent.monitor.telemetry())
        except Exception:  # noqa: BLE001 - a scrape must not fail because NVML hiccuped
            return []

    # ------------------------------------------------------------------ answers
    def health(self) -> tuple[bool, dict[str, Any]]:
        """Readiness: ``(True, {"status": "ok"})`` only while connected and registered."""
        agent = self.agent
        if agent.draining:
            return False, {
                "status": "draining",
                "reason": f"node {agent.config.node_id} is draining; it takes no new tasks",
            }
        if agent.connected.is_set():
            return True, {"status": "ok"}
        reason = f"not connected to scheduler at {agent.targets.current}"
        if agent.last_error:
            reason += f": {agent.last_error}"
        else:
            reason += " (connecting)"
        return False, {"status": "unavailable", "reason": reason}

    def live(self) -> tuple[bool, dict[str, Any]]:
        """Liveness: the agent's event loop turned within ``stall_after_s``."""
        idle = time.monotonic() - self.loop_tick
        if idle > self.stall_after_s:
            return False, {"status": "stalled", "reason": f"agent event loop has not run for {idle:.0f} s"}
        return True, {"status": "alive"}

    async def _guarded(self, scope, receive, send) -> None:
        """The app behind the bounds every request meets first: no body, and the scrape token."""
        if scope["type"] != "http":
            return
        refusal = framing_refusal(scope["headers"], 0)
        if refusal is None:
            authorization = next((v for k, v in scope["headers"] if k == b"authorization"), b"").decode("latin-1")
            body = scrape_refusal(self.scrape_token, scope["path"], authorization)
            if body is not None:
                refusal = Response(body, 401, headers=dict([SCRAPE_CHALLENGE]), media_type="application/json")
        await (refusal or self.app)(scope, receive, send)

    async def _probe(self, request: Request) -> Response:
        ok, body = self.health() if request.url.path == "/health" else self.live()
        return Response(json.dumps(body).encode(), 200 if ok else 503, media_type="application/json")

    def _metrics(self, request: Request) -> Response:
        """A sync endpoint: Starlette runs it in a worker thread, so a slow NVML read holds no probe."""
        return Response(generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _not_found(self, request: Request) -> Response:
        body = json.dumps({"error": "not found; try /health, /live or /metrics"}).encode()
        return Response(body, 404, media_type="application/json")
