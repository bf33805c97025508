"""The web dashboard on the scheduler's HTTP port: ``/`` and ``/ui/...``, server-rendered HTML
with SVG charts drawn here (:mod:`.svg_chart`; no JavaScript framework, no CDN: it works offline).

Pages (all read-only but one form):

* ``/ui/cluster`` (``/`` redirects here): nodes, connected and not, with per-GPU and host CPU
  telemetry and a sparkline of its last minutes (:class:`TelemetryHistory`), and each node's
  model hosts (a base model shared by LoRA tenants) with their tenants.
* ``/ui/queue``: pending tasks in placement order with their position and why each waits; running
  tasks with progress (step of ``hyperparameters.steps``, or of PPO's updates) and an ETA from
  the pace so far.
* ``/ui/tasks``: the caller's tasks (an admin's: everyone's), ticked to compare.
* ``/ui/task/<id>``: the resolved spec, attempts, events, live reward/loss/KL/throughput curves
  (``/ui/task/<id>/charts`` is the fragment a few lines of JavaScript fetch every 2 s while the
  task runs), checkpoints with a download link (``/ui/task/<id>/checkpoint/<step>``: a tar of its
  files from the artifact store).
* ``/ui/compare?task=A&task=B&x=step|env_steps|tokens|time&smooth=0.6``: the tasks' curves on
  one chart per panel.
* ``POST /ui/task/<id>/cancel``: the only write, with the same owner check as ``CancelTask``
  (another owner's task is not found) and a CSRF token bound to the caller's key.

Authentication (``auth: {enabled: true}``): the same API keys as gRPC, from an
``Authorization: Bearer`` header or the ``otk_key`` cookie the login form (``/ui/login``) sets:
HttpOnly, SameSite=Strict, and Secure when the port speaks HTTPS. A user sees only their own tasks
(another's is "not found", as over gRPC), an admin every task; node keys are refused. With auth
off every visitor is the ``anonymous`` admin, as over gRPC.

The login form carries a CSRF token too: a double submit, the form's token derived from a random
``otk_login`` cookie (HttpOnly, SameSite=Strict), so another site can neither post it nor log a
visitor in with its own key (403). After login the visitor goes to ``next`` only when it is a local
dashboard path (``/`` or ``/ui/...``, printable ASCII, no ``//`` or backslash); else to ``/``.

Requests run on the scheduler's event loop (:mod:`.http`, uvicorn): store and core reads are plain
calls, as in the servicers; only a checkpoint download reads the artifact store in a thread.
Every server string is escaped (:func:`html.escape`) before it reaches a page.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import io
import json
import re
import secrets
import tarfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from html import escape
from typing import Any, Iterable, Iterator
from urllib.parse import parse_qs, quote

from google.protobuf.json_format import MessageToDict
from starlette.requests import Request as HttpRequest
from starlette.responses import Response, StreamingResponse

from opentinker.common.v1 import common_pb2
from opentinker_common import curves
from opentinker_common.attempts import attempts_text
from opentinker_common.spec import SpecError, env_kind, spec_from_proto

from opentinker_scheduler.api.rpc import record
from opentinker_scheduler.api.svg_chart import Curve, line_chart, sparkline
from opentinker_scheduler.data import checkpoints
from opentinker_scheduler.errors import SchedulerError
from opentinker_scheduler.security.auth import ANONYMOUS
from opentinker_scheduler.security.keys import Principal, Unauthenticated

__all__ = ["Dashboard", "TelemetryHistory", "COOKIE"]

#: The cookie that keeps a logged-in visitor's API key (HttpOnly: page scripts cannot read it).
COOKIE = "otk_key"
#: The cookie whose random value the login form's CSRF token is derived from.
LOGIN_COOKIE = "otk_login"
#: Most bytes of a form body read (a login or a cancel is a few hundred).
MAX_FORM_BYTES = 8192
#: A ``next`` path the login may redirect to: local, printable ASCII.
_LOCAL_PATH = re.compile(r"/(?:ui(?:/[!-~]*)?)?")
#: Telemetry samples kept per GPU and per host (one per snapshot, about one a second).
HISTORY_LEN = 180
#: Tasks the task list shows.
TASK_LIST_LIMIT = 200

S = common_pb2
STATE = {v: k.removeprefix("TASK_STATE_") for k, v in S.TaskState.items()}


class TelemetryHistory:
    """The last :data:`HISTORY_LEN` telemetry samples of every GPU and host, for sparklines.

    Fed from the tick loop's snapshot (:meth:`add`), read by pages (:meth:`gpu`,
    :meth:`host`): deques are appended under a lock and copied out."""

    def __init__(self, maxlen: int = HISTORY_LEN) -> None:
        self.maxlen = maxlen
        self._gpu: dict[tuple[str, str], deque] = {}
        self._host: dict[str, deque] = {}
        self._lock = threading.Lock()

    def add(self, gpus: Iterable[tuple[str, str, bool, dict]], hosts: Iterable[tuple[str, dict]]) -> None:
        with self._lock:
            for node_id, index, _sim, values in gpus:
                self._gpu.setdefault((node_id, index), deque(maxlen=self.maxlen)).append(dict(values))
            for node_id, values in hosts:
                self._host.setdefault(node_id, deque(maxlen=self.maxlen)).append(dict(values))

    def gpu(self, node_id: str, index: str, key: str) -> list[float]:
        with self._lock:
            return [v[key] for v in self._gpu.get((node_id, index), ()) if key in v]

    def host(self, node_id: str, key: str) -> list[float]:
        with self._lock:
            return [v[key] for v in self._host.get(node_id, ()) if key in v]


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, list[str]]
    form: dict[str, list[str]]
    token: str | None  # API key from the bearer header or the cookie
    secure: bool
    login_nonce: str = ""  # the otk_login cookie

    def arg(self, name: str, default: str = "") -> str:
        values = self.query.get(name) or self.form.get(name)
        return values[0] if values else default


@dataclass
class Answer:
    status: str
    body: bytes | Iterator[bytes]
    content_type: str = "text/html; charset=utf-8"
    headers: list[tuple[str, str]] = field(default_factory=list)


class _Refusal(Exception):
    def __init__(self, status: str, message: str) -> None:
        super().__init__(message)
        self.status = status


def h(value: Any) -> str:
    """Escape any server string for HTML text and attributes."""
    return escape(str(value), quote=True)


def _ago(t: float | None, now: float) -> str:
    if not t:
        return "-"
    s = max(0.0, now - t)
    return f"{s:.0f} s ago" if s < 120 else f"{s / 60:.0f} min ago" if s < 7200 else f"{s / 3600:.1f} h ago"


def _dur(s: float | None) -> str:
    if s is None:
        return "-"
    s = max(0.0, s)
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.1f} min" if s < 7200 else f"{s / 3600:.1f} h"


def _resolved(spec: common_pb2.TaskSpec) -> dict:
    """The spec as the worker sees it (defaults filled in), else as submitted."""
    try:
        return spec_from_proto(spec).to_dict()
    except (SpecError, Exception):  # noqa: BLE001 - an old spec a newer build no longer parses
        return MessageToDict(spec, preserving_proto_field_name=True)


def _total_steps(spec: common_pb2.TaskSpec) -> int | None:
    """Steps the whole run takes: ``hyperparameters.steps``, or PPO's updates
    (``total_timesteps // (num_envs * num_steps)``); None when the workload does not say."""
    try:
        hp = spec_from_proto(spec).hyperparameters
    except Exception:  # noqa: BLE001 - an old spec a newer build no longer parses
        return None
    total = getattr(hp, "num_updates", None) or getattr(hp, "steps", None)
    return int(total) if isinstance(total, (int, float)) and not isinstance(total, bool) and total > 0 else None


def _kind(spec: common_pb2.TaskSpec) -> str:
    try:
        return env_kind(spec_from_proto(spec).env)
    except Exception:  # noqa: BLE001 - as above
        return ""


def _step_span(steps: list[int]) -> str:
    """``"4-6"``: the first and last of ``steps``; ``"4"`` for one; ``"-"`` for none."""
    if not steps:
        return "-"
    return f"{min(steps)}-{max(steps)}" if len(steps) > 1 else str(steps[0])


def _points(store, task_id: str) -> list[curves.Point]:
    return [
        (p.step, p.time.ToNanoseconds() / 1e9 if p.HasField("time") else 0.0, dict(p.values))
        for p in store.metric_points(task_id)
    ]


class Dashboard:
    """Routes ``/`` and ``/ui/...`` of the HTTP port (:meth:`serve`).

    Args:
        core: the scheduler core (tasks, nodes, queue); read on the scheduler's event loop.
        security: keys (None inside = auth off) and the audit log for cancels.
        artifacts: the artifact store checkpoints are downloaded from (None: paths only).
        history: telemetry samples for sparklines.
        secure: the port speaks HTTPS (the login cookie is then marked Secure).
    """

    def __init__(
        self,
        core,
        *,
        security=None,
        artifacts=None,
        history: TelemetryHistory | None = None,
        secure: bool = False,
    ) -> None:
        self.core = core
        self.security = security
        self.artifacts = artifacts
        self.history = history or TelemetryHistory()
        self.secure = secure
        self._csrf_secret = secrets.token_bytes(32)

    # ------------------------------------------------------------------ HTTP, on the event loop
    def handles(self, path: str) -> bool:
        return path == "/" or path == "/ui" or path.startswith("/ui/")

    async def serve(self, request: HttpRequest, *, max_body_bytes: int = MAX_FORM_BYTES) -> Response:
        """Answer one request of ``/`` or ``/ui/...``."""
        try:
            req = await self._request(request, min(max_body_bytes, MAX_FORM_BYTES))
            answer = await self._answer(req)
        except _Refusal as exc:
            answer = Answer(exc.status, _page("Error", f'<p class="error">{h(exc)}</p>', None, ""))
        headers = {
            "Cache-Control": "no-store",
            "X-Content-Type-Options": "nosniff",
            "X-Frame-Options": "DENY",
            "Referrer-Policy": "same-origin",
            "Content-Security-Policy": (
                "default-src 'none'; img-src 'self' data:; style-src 'unsafe-inline'; "
                "script-src 'unsafe-inline'; connect-src 'self'; form-action 'self'; frame-ancestors 'none'"
            ),
        }
        status = int(answer.status.split(" ", 1)[0])
        if status == 413:  # the rest of the body is not read: the connection ends with this answer
            headers["Connection"] = "close"
        if isinstance(answer.body, bytes):
            out = Response(answer.body, status, headers=headers, media_type=answer.content_type)
        else:
            out = StreamingResponse(answer.body, status, headers=headers, media_type=answer.content_type)
        for name, value in answer.headers:
            out.headers.append(name, value)
        return out

    async def _request(self, request: HttpRequest, limit: int) -> Request:
        method = request.method.upper()
        form: dict[str, list[str]] = {}
        if method == "POST":
            body = bytearray()
            async for chunk in request.stream():  # Content-Length was checked; a chunked body is counted here
                body += chunk
                if len(body) > limit:
                    raise _Refusal("413 Content Too Large", f"form too large: at most {limit} bytes")
            form = parse_qs(body.decode("utf-8", "replace"))
        token = None
        scheme, _, value = request.headers.get("authorization", "").strip().partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            token = value.strip()
        elif request.cookies.get(COOKIE):
            token = request.cookies[COOKIE]
        return Request(
            method=method,
            path=request.url.path,
            query=parse_qs(request.url.query),
            form=form,
            token=token,
            secure=self.secure,
            login_nonce=request.cookies.get(LOGIN_COOKIE, ""),
        )

    def _who(self, req: Request) -> Principal | None:
        """The visitor: ANONYMOUS (admin) with auth off, the key's principal, or None (log in)."""
        keys = self.security.keys if self.security is not None else None
        if keys is None:
            return ANONYMOUS
        if not req.token:
            return None
        try:
            who = keys.resolve(req.token)
        except Unauthenticated:
            return None
        if who.role == "node":
            raise _Refusal("403 Forbidden", "node keys may not use the dashboard; log in with a user or admin key")
        return who

    def csrf_token(self, who: Principal) -> str:
        """The token a cancel form must carry: bound to the caller's key and this scheduler process."""
        return hmac.new(self._csrf_secret, f"{who.key_prefix}|{who.owner}".encode(), hashlib.sha256).hexdigest()[:40]

    async def _answer(self, req: Request) -> Answer:
        path = req.path.rstrip("/") or "/"
        if path == "/ui/login":
            return self._login(req)
        if path == "/ui/logout":
            return self._logout(req)
        who = self._who(req)
        if who is None:
            if req.token:
                return self._login_page(req, "that key was not accepted (unknown, revoked or expired)", req.path)
            return self._login_page(req, "", req.path)
        if path in ("/", "/ui"):
            return Answer("303 See Other", b"", headers=[("Location", "/ui/cluster")])
        if req.method == "POST":
            parts = path.split("/")
            if len(parts) == 5 and parts[:3] == ["", "ui", "task"] and parts[4] == "cancel":
                return await self._cancel(req, who, parts[3])
            raise _Refusal("405 Method Not Allowed", "the dashboard only changes anything by cancelling a task")
        scope = None if who.is_admin else who.owner
        nav = self._nav(who)
        if path == "/ui/cluster":
            return Answer("200 OK", self._cluster(who, nav))
        if path == "/ui/queue":
            return Answer("200 OK", self._queue(scope, nav))
        if path == "/ui/tasks":
            return Answer("200 OK", self._tasks(scope, nav))
        if path == "/ui/compare":
            return Answer("200 OK", self._compare(req, scope, nav))
        parts = path.split("/")
        if len(parts) >= 4 and parts[:3] == ["", "ui", "task"]:
            task_id = parts[3]
            if len(parts) == 4:
                return Answer("200 OK", self._task(task_id, scope, who, nav))
            if len(parts) == 5 and parts[4] == "charts":
                return Answer("200 OK", self._task_charts(task_id, scope).encode())
            if len(parts) == 6 and parts[4] == "checkpoint":
                return await self._download(task_id, parts[5], scope)
        raise _Refusal("404 Not Found", f"no page {req.path[:200]}; start at /ui/cluster")

    # ------------------------------------------------------------------ login and logout
    def _login(self, req: Request) -> Answer:
        if self.security is None or self.security.keys is None:
            return Answer("303 See Other", b"", headers=[("Location", "/ui/cluster")])
        nxt = local_path(req.arg("next", "/ui/cluster"))
        if req.method != "POST":
            return self._login_page(req, "", nxt)
        if not req.login_nonce or not hmac.compare_digest(req.arg("csrf"), self._login_token(req.login_nonce)):
            stale = "login refused: the form is stale or came from another site; log in again"
            return self._login_page(req, stale, nxt, status="403 Forbidden")
        key = req.arg("api_key").strip()
        keys = self.security.keys
        try:
            who = keys.resolve(key)
        except Unauthenticated as exc:
            return self._login_page(req, str(exc), nxt, status="401 Unauthorized")
        if who.role == "node":
            return self._login_page(
                req, "node keys may not use the dashboard; use a user or admin key", nxt, status="403 Forbidden"
            )
        cookie = f"{COOKIE}={key}; Path=/; HttpOnly; SameSite=Strict" + ("; Secure" if self.secure else "")
        return Answer("303 See Other", b"", headers=[("Location", nxt), ("Set-Cookie", cookie)])

    def _login_token(self, nonce: str) -> str:
        """The login form's CSRF token for the ``otk_login`` cookie's value ``nonce``."""
        return hmac.new(self._csrf_secret, f"login|{nonce}".encode(), hashlib.sha256).hexdigest()[:40]

    def _login_page(self, req: Request, message: str, next_path: str, *, status: str = "401 Unauthorized") -> Answer:
        """The login form with its CSRF token; sets the ``otk_login`` cookie when the visitor has none."""
        nonce = req.login_nonce if re.fullmatch(r"[0-9a-f]{32}", req.login_nonce) else ""
        headers = []
        if not nonce:
            nonce = secrets.token_hex(16)
            cookie = f"{LOGIN_COOKIE}={nonce}; Path=/ui/login; HttpOnly; SameSite=Strict"
            headers.append(("Set-Cookie", cookie + ("; Secure" if self.secure else "")))
        answer = _login_page(message, next_path, self._login_token(nonce), status=status)
        answer.headers.extend(headers)
        return answer

    def _logout(self, req: Request) -> Answer:
        cookie = f"{COOKIE}=; Path=/; Max-Age=0; HttpOnly; SameSite=Strict" + ("; Secure" if self.secure else "")
        return Answer("303 See Other", b"", headers=[("Location", "/ui/login"), ("Set-Cookie", cookie)])

    def _nav(self, who: Principal) -> str:
        auth_on = self.security is not None and self.security.keys is not None
        user = (
            f'<span class="who">{h(who.owner)} ({h(who.role)})</span>'
            '<form method="post" action="/ui/logout" class="inline"><button>log out</button></form>'
            if auth_on
            else '<span class="who">auth off</span>'
        )
        return (
            '<nav><a href="/ui/cluster">Cluster</a><a href="/ui/queue">Queue</a><a href="/ui/tasks">Tasks</a>'
            f'<a href="/ui/compare">Compare</a>{user}</nav>'
        )

    # ------------------------------------------------------------------ cluster
    def _cluster(self, who: Principal, nav: str) -> bytes:
        core = self.core

        def read():
            rows = []
            for n in sorted(core.ledger.nodes.values(), key=lambda n: n.node_id):
                cap = n.capacity()
                rows.append(
                    dict(
                        node_id=n.node_id,
                        connected=n.connected,
                        gpu_count=n.gpu_count,
                        gpus_free=len(cap.free_gpus),
                        max_tasks=n.max_tasks,
                        running=[(t, getattr(core.active.get(t), "owner", "")) for t in sorted(n.allocations)],
                        telemetry=[MessageToDict(t, preserving_proto_field_name=True) for t in n.telemetry],
                        host=MessageToDict(n.host, preserving_proto_field_name=True) if n.host is not None else {},
                        last=n.last_heartbeat_time,
                        version=n.register.version,
                        hostname=n.register.hostname,
                        notes=list(core.node_notes(n)),
                        model_hosts=[_model_host(core, n, mh) for mh in n.model_hosts],
                    )
                )
            return rows, dict(core.tasks.counts), core.leading

        rows, counts, leading = read()
        now = time.time()
        body = []
        if not leading:
            body.append(
                '<p class="note">This scheduler follows; nodes connect to the leader, whose dashboard shows them.</p>'
            )
        totals = ", ".join(f"{h(STATE.get(s, s).lower())} {n}" for s, n in sorted(counts.items()) if n)
        connected = sum(r["connected"] for r in rows)
        body.append(
            f'<p id="summary">{connected} node(s) connected, {len(rows) - connected} disconnected; '
            f"tasks: {totals or 'none'}</p>"
        )
        for r in rows:
            status = "connected" if r["connected"] else "disconnected"
            body.append(
                f'<section class="node {status}" data-node="{h(r["node_id"])}"><h2>{h(r["node_id"])} '
                f'<span class="badge {status}">{status}</span></h2>'
                f"<p>host {h(r['hostname'] or '-')} · version {h(r['version'] or '-')} · GPUs {r['gpus_free']} free of "
                f"{r['gpu_count']} · max tasks {r['max_tasks']} · last heartbeat {h(_ago(r['last'], now))}</p>"
            )
            if r["running"]:
                mine = [t for t, owner in r["running"] if who.is_admin or owner == who.owner]
                others = len(r["running"]) - len(mine)
                links = ", ".join(f'<a href="/ui/task/{quote(t)}">{h(t)}</a>' for t in mine)
                more = f"{', ' if mine else ''}{others} task(s) of other owners" if others else ""
                body.append(f"<p>running: {links}{more}</p>")
            for note in r["notes"]:
                body.append(f'<p class="note">{h(note)}</p>')
            if r["model_hosts"]:
                body.append(_model_hosts_table(r["model_hosts"], who))
            host = r["host"]
            if host:
                cpu = self.history.host(r["node_id"], "cpu_utilization_percent")
                mem = self.history.host(r["node_id"], "memory_used_bytes")
                body.append(
                    '<table class="telemetry"><tr><th>host</th><th>CPU</th><th></th><th>memory</th><th></th></tr>'
                    f"<tr><td>{h(host.get('cpu_count', '?'))} CPUs</td>"
                    f"<td>{float(host.get('cpu_utilization_percent', 0)):.0f}%</td>"
                    f"<td>{sparkline(cpu, lo=0, hi=100, label='CPU %')}</td>"
                    f"<td>{_gib(host.get('memory_used_bytes'))} / {_gib(host.get('memory_total_bytes'))} GiB</td>"
                    f"<td>{sparkline(mem, lo=0, hi=float(host.get('memory_total_bytes') or 0) or None, label='memory')}"
                    "</td></tr></table>"
                )
            if r["telemetry"]:
                body.append(
                    '<table class="telemetry"><tr><th>GPU</th><th>name</th><th>util</th><th></th><th>memory</th>'
                    "<th></th><th>temp</th><th>power</th></tr>"
                )
                for t in r["telemetry"]:
                    index = str(t.get("index", 0))
                    util = self.history.gpu(r["node_id"], index, "utilization_percent")
                    mem = self.history.gpu(r["node_id"], index, "memory_used_bytes")
                    sim = " (simulated)" if t.get("simulated") else ""
                    body.append(
                        f"<tr><td>{h(index)}</td><td>{h(t.get('name', ''))}{h(sim)}</td>"
                        f"<td>{float(t.get('utilization_percent', 0)):.0f}%</td>"
                        f"<td>{sparkline(util, lo=0, hi=100, label='utilization %')}</td>"
                        f"<td>{_gib(t.get('memory_used_bytes'))} / {_gib(t.get('memory_total_bytes'))} GiB</td>"
                        f"<td>{sparkline(mem, lo=0, hi=float(t.get('memory_total_bytes') or 0) or None, label='mem')}"
                        "</td>"
                        f"<td>{h(t.get('temperature_c', '-'))} C</td><td>{h(t.get('power_w', '-'))} W</td></tr>"
                    )
                body.append("</table>")
            body.append("</section>")
        if not rows:
            body.append("<p>No trainer node has connected yet.</p>")
        return _page("Cluster", "".join(body), nav, "cluster", refresh=5)

    # ------------------------------------------------------------------ queue
    def _queue(self, scope: str | None, nav: str) -> bytes:
        core = self.core

        def read():
            pending = []
            for position, t in enumerate(core.queue, start=1):
                if scope is None or t.owner == scope:
                    pending.append(
                        (position, t, core.reasons.reason(t.task_id) or "waiting for the next placement round")
                    )
            running = [t for t in core.active.values() if scope is None or t.owner == scope]
            return pending, sorted(running, key=lambda t: t.create_time), len(core.queue)

        pending, running, total = read()
        now = time.time()
        rows = "".join(
            f'<tr class="pending" data-task="{h(t.task_id)}"><td>{pos} of {total}</td>'
            f'<td><a href="/ui/task/{quote(t.task_id)}">{h(t.task_id)}</a></td><td>{h(t.spec.name)}</td>'
            f"<td>{h(t.owner)}</td><td>{h(t.workload_type)}</td><td>{t.priority}</td><td>{t.gpu_count}</td>"
            f'<td>{h(_ago(t.create_time, now))}</td><td class="reason">{h(reason)}</td></tr>'
            for pos, t, reason in pending
        )
        run_rows = []
        for t in running:
            total_steps = _total_steps(t.spec)
            progress, eta = f"step {t.latest_step}", "-"
            if total_steps:
                frac = min(1.0, t.latest_step / total_steps)
                progress = (
                    f'<progress max="{int(total_steps)}" value="{t.latest_step}"></progress> '
                    f"{t.latest_step}/{int(total_steps)}"
                )
                if t.start_time and t.latest_step:
                    eta = _dur((now - t.start_time) / frac * (1 - frac))
            run_rows.append(
                f'<tr class="running" data-task="{h(t.task_id)}">'
                f'<td><a href="/ui/task/{quote(t.task_id)}">{h(t.task_id)}</a></td>'
                f"<td>{h(t.spec.name)}</td><td>{h(t.owner)}</td><td>{h(STATE.get(t.state, t.state).lower())}</td>"
                f"<td>{h(t.node_id or '-')}</td><td>{progress}</td><td>{h(eta)}</td>"
                f"<td>{h(_dur(now - t.start_time) if t.start_time else '-')}</td></tr>"
            )
        body = (
            f"<h2>Pending ({len(pending)})</h2>"
            + (
                "<table><tr><th>position</th><th>task</th><th>name</th><th>owner</th><th>workload</th><th>priority</th>"
                f"<th>GPUs</th><th>submitted</th><th>why it waits</th></tr>{rows}</table>"
                if pending
                else "<p>Nothing is waiting.</p>"
            )
            + f"<h2>Running ({len(running)})</h2>"
            + (
                "<table><tr><th>task</th><th>name</th><th>owner</th><th>state</th><th>node</th><th>progress</th>"
                f"<th>ETA</th><th>running for</th></tr>{''.join(run_rows)}</table>"
                if running
                else "<p>Nothing is running.</p>"
            )
        )
        return _page("Queue", body, nav, "queue", refresh=5)

    # ------------------------------------------------------------------ task list
    def _tasks(self, scope: str | None, nav: str) -> bytes:
        store = self.core.store
        rows = store.list_tasks((), limit=TASK_LIST_LIMIT, owner=scope)
        now = time.time()
        body = [
            '<form method="get" action="/ui/compare"><table id="tasks"><tr><th>compare</th><th>task</th><th>name</th>'
            "<th>owner</th><th>workload</th><th>state</th><th>step</th><th>reward</th><th>submitted</th></tr>"
        ]
        for t in rows:
            reward = t.latest_metrics.get("reward")
            body.append(
                f'<tr data-task="{h(t.task_id)}"><td><input type="checkbox" name="task" value="{h(t.task_id)}"></td>'
                f'<td><a href="/ui/task/{quote(t.task_id)}">{h(t.task_id)}</a></td><td>{h(t.spec.name)}</td>'
                f"<td>{h(t.owner)}</td><td>{h(t.workload_type)}</td><td>{h(STATE.get(t.state, t.state).lower())}</td>"
                f"<td>{t.latest_step}</td><td>{'-' if reward is None else f'{reward:.4g}'}</td>"
                f"<td>{h(_ago(t.create_time, now))}</td></tr>"
            )
        body.append('</table><button id="compare-selected">compare selected</button></form>')
        if not rows:
            body.append("<p>No tasks yet.</p>")
        return _page("Tasks", "".join(body), nav, "tasks")

    # ------------------------------------------------------------------ one task
    def _get(self, task_id: str, scope: str | None):
        core = self.core
        try:
            return core.api.get(task_id, owner=scope)
        except SchedulerError as exc:
            raise _Refusal("404 Not Found", str(exc)) from None

    def _task(self, task_id: str, scope: str | None, who: Principal, nav: str) -> bytes:
        core = self.core

        def read():
            task = self._get(task_id, scope)
            events = core.store.events_after(task_id, 0, limit=5000)
            ckpts = checkpoints.list_checkpoints(core.store, task_id)
            reason = core.reasons.reason(task_id) if task.state == S.TASK_STATE_PENDING else ""
            # The steps of the charts each attempt ran (a step run again is its newest attempt's).
            charted: dict[int, list[int]] = {}
            for p in core.store.metric_points(task_id):
                charted.setdefault(p.attempt, []).append(p.step)
            return task, events, ckpts, reason, charted

        task, events, ckpts, reason, charted = read()
        now = time.time()
        state = STATE.get(task.state, str(task.state)).lower()
        attempts = attempts_text(task.attempt, task.spec.limits.max_attempts or task.max_attempts, task.handed_back)
        info = [
            f'<p>state <b id="state">{h(state)}</b> · attempt {h(attempts)} · owner '
            f"{h(task.owner)} · {h(task.workload_type)} · priority {task.priority} · node {h(task.node_id or '-')} · "
            f"step {task.latest_step} · submitted {h(_ago(task.create_time, now))}</p>"
        ]
        if reason:
            info.append(f'<p class="reason">pending: {h(reason)}</p>')
        if task.error:
            info.append(f'<p class="error">{h(task.error)}</p>')
        if not task.terminal:
            info.append(
                f'<form method="post" action="/ui/task/{quote(task_id)}/cancel" id="cancel-form">'
                f'<input type="hidden" name="csrf" value="{h(self.csrf_token(who))}">'
                '<input name="reason" placeholder="reason (optional)" maxlength="200">'
                '<button id="cancel">cancel task</button></form>'
            )
        charts = self._task_charts(task_id, scope)
        attempts: dict[int, dict] = {}
        rows = []
        for ev in events[-300:] if len(events) > 300 else events:
            kind = ev.WhichOneof("event")
            t = ev.time.ToNanoseconds() / 1e9
            if kind == "state_change":
                sc = ev.state_change
                a = attempts.setdefault(sc.attempt, {"start": t, "node": "", "end": "", "reason": ""})
                a["node"] = sc.node_id or a["node"]
                a["end"] = STATE.get(sc.to_state, "").lower()
                a["reason"] = sc.message or sc.reason
                what = f"{STATE.get(sc.from_state, '').lower()} → {STATE.get(sc.to_state, '').lower()} ({sc.reason})"
                detail = sc.message
            elif kind == "checkpoint":
                what, detail = f"checkpoint at step {ev.checkpoint.step}", ev.checkpoint.path
            elif kind == "phase":
                what, detail = f"{ev.phase.phase} (attempt {ev.phase.attempt})", ev.phase.detail
            elif kind == "checkpoint_failed":
                cf = ev.checkpoint_failed
                what, detail = f"checkpoint at step {cf.step} not stored", cf.error
            elif kind == "artifacts_deleted":
                ad = ev.artifacts_deleted
                if ad.by_retention:
                    what, detail = "older checkpoints retired", ", ".join(ad.keys)
                else:
                    what = "artifacts deleted"
                    detail = f"{ad.deleted_keys} key(s), {ad.deleted_bytes} bytes" + (
                        f", by {ad.deleted_by}" if ad.deleted_by else ""
                    )
                    detail += f": {', '.join(ad.keys)}" if ad.keys else ""
            elif kind == "checkpoint_expiry":
                ce = ev.checkpoint_expiry
                what = "checkpoint expiry"
                detail = ce.key + (f", at {ce.expire_time.ToJsonString()}" if ce.HasField("expire_time") else ", never")
            else:
                continue  # metric points are the charts
            rows.append(
                f"<tr><td>{ev.sequence}</td><td>{h(time.strftime('%H:%M:%S', time.localtime(t)))}</td>"
                f"<td>{h(what)}</td><td>{h(detail)}</td></tr>"
            )
        att = "".join(
            f"<tr><td>{n}</td><td>{h(time.strftime('%H:%M:%S', time.localtime(a['start'])))}</td>"
            f"<td>{h(a['node'] or '-')}</td>"
            f"<td>{h(a['end'])}</td><td>{h(a['reason'])}</td><td>{_step_span(charted.get(n, []))}</td></tr>"
            for n, a in sorted(attempts.items())
            if n
        )
        ck = "".join(
            f"<tr><td>{c.step}</td><td>{c.attempt}</td><td>{h(c.format)}</td><td>{'final' if c.final else ''}</td>"
            f"<td>{h(c.node_id)}</td><td>"
            + (
                f'<a class="download" href="/ui/task/{quote(task_id)}/checkpoint/{c.step}">download .tar</a>'
                if c.HasField("artifact") or c.path
                else "-"
            )
            + "</td></tr>"
            for c in ckpts
        )
        spec = json.dumps(_resolved(task.spec), indent=2, sort_keys=True, default=str)
        live = "" if task.terminal else _LIVE_JS.replace("TASK_URL", json.dumps(f"/ui/task/{quote(task_id)}/charts"))
        body = (
            "".join(info)
            + f'<div id="charts">{charts}</div>'
            + f'<p><a href="/ui/compare?task={quote(task_id)}">open in compare</a></p>'
            + "<h2>Checkpoints</h2>"
            + (
                '<table id="checkpoints"><tr><th>step</th><th>attempt</th><th>format</th><th></th><th>node</th>'
                f"<th></th></tr>{ck}</table>"
                if ckpts
                else "<p>None yet.</p>"
            )
            + "<h2>Attempts</h2>"
            + (
                '<table id="attempts"><tr><th>attempt</th><th>started</th><th>node</th><th>last state</th>'
                "<th>why</th><th>steps charted</th></tr>"
                f"{att}</table>"
                if att
                else ""
            )
            + '<h2>Events</h2><table id="events"><tr><th>#</th><th>time</th><th>what</th><th>detail</th></tr>'
            + f"{''.join(rows)}</table>"
            + f'<h2>Spec (resolved)</h2><pre id="spec">{h(spec)}</pre>'
            + live
        )
        return _page(f"Task {task_id}", body, nav, "task")

    def _task_charts(self, task_id: str, scope: str | None) -> str:
        core = self.core

        def read():
            task = self._get(task_id, scope)
            return task, _points(core.store, task_id)

        task, points = read()
        x = curves.default_x_axis(task.workload_type, _kind(task.spec))
        out = [
            f'<div class="charts" data-state="{h(STATE.get(task.state, "").lower())}" data-step="{task.latest_step}">'
        ]
        for panel in curves.PANELS:
            key = curves.panel_key(points, panel)
            if key is None:
                continue
            xs, ys = curves.series(points, key, x)
            band = None
            sxs, stds = curves.series(points, f"{key}_std", x)
            if stds and sxs == xs:
                lo, hi = curves.value_range(key)
                band = (
                    [max(y - s, lo) if lo is not None else y - s for y, s in zip(ys, stds)],
                    [min(y + s, hi) if hi is not None else y + s for y, s in zip(ys, stds)],
                )
            out.append(
                line_chart(
                    [Curve(key, xs, ys, band)],
                    title=key,
                    x_label=curves.X_AXES[x],
                    chart_id=f"chart-{panel}",
                    integer_x=x != "time",
                )
            )
        if len(out) == 1:
            out.append("<p>No metric points yet.</p>")
        out.append("</div>")
        return "".join(out)

    # ------------------------------------------------------------------ compare
    def _compare(self, req: Request, scope: str | None, nav: str) -> bytes:
        ids = [t for t in dict.fromkeys(req.query.get("task", [])) if t][:8]
        x = req.arg("x", "")
        try:
            weight = float(req.arg("smooth", "0") or 0)
            curves.smooth([], weight)
        except ValueError:
            raise _Refusal("400 Bad Request", "smooth: expected a number in [0, 1), e.g. 0.6") from None
        core = self.core

        def read():
            out = []
            for task_id in ids:
                task = self._get(task_id, scope)
                out.append((task, _points(core.store, task_id)))
            return out

        runs = read()
        if not x:
            x = curves.default_x_axis(runs[0][0].workload_type, _kind(runs[0][0].spec)) if runs else "step"
        if x not in curves.X_AXES:
            raise _Refusal("400 Bad Request", f"x: expected one of {', '.join(curves.X_AXES)}, got {x[:40]!r}")
        hidden = "".join(f'<input type="hidden" name="task" value="{h(t)}">' for t in ids)
        options = "".join(
            f'<option value="{k}"{" selected" if k == x else ""}>{h(v)}</option>' for k, v in curves.X_AXES.items()
        )
        form = (
            f'<form method="get" action="/ui/compare" id="compare-form">{hidden}'
            f'<label>x axis <select name="x" id="x-axis">{options}</select></label> '
            f'<label>smoothing <input name="smooth" id="smooth" type="number" min="0" max="0.99" step="0.05" '
            f'value="{weight:g}"></label> '
            "<button>draw</button></form>"
        )
        charts = []
        for panel in curves.PANELS:
            lines, keys = [], []
            for task, points in runs:
                key = curves.panel_key(points, panel)
                if key is None:
                    continue
                xs, ys = curves.series(points, key, x)
                label = f"{task.task_id} {task.spec.name}".strip()
                lines.append(Curve(label, xs, curves.smooth(ys, weight) if weight else ys))
                keys += [key] if key not in keys else []
            if lines:
                charts.append(
                    line_chart(
                        lines,
                        title=" / ".join(keys),
                        x_label=curves.X_AXES[x],
                        chart_id=f"compare-{panel}",
                        width=640,
                        height=260,
                        integer_x=x != "time",
                    )
                )
        legend = "".join(
            f'<li data-task="{h(t.task_id)}"><a href="/ui/task/{quote(t.task_id)}">{h(t.task_id)}</a> {h(t.spec.name)} '
            f"({h(STATE.get(t.state, '').lower())}, step {t.latest_step})</li>"
            for t, _ in runs
        )
        if not ids:
            body = '<p>Tick tasks on the <a href="/ui/tasks">task list</a> to compare them.</p>'
        else:
            body = (
                form
                + f"<ul>{legend}</ul>"
                + '<div id="charts">'
                + ("".join(charts) or "<p>No metric points yet.</p>")
                + "</div>"
            )
        return _page("Compare", body, nav, "compare")

    # ------------------------------------------------------------------ cancel, download
    async def _cancel(self, req: Request, who: Principal, task_id: str) -> Answer:
        if not hmac.compare_digest(req.arg("csrf"), self.csrf_token(who)):
            raise _Refusal(
                "403 Forbidden", "cancel refused: the form is stale or came from another site; reload the task page"
            )
        scope = None if who.is_admin else who.owner
        reason = req.arg("reason")[:200] or "cancelled from the dashboard"
        core = self.core

        def cancel():
            try:
                task = core.api.cancel(task_id, owner=scope, reason=reason)
            except SchedulerError as exc:
                record(self.security, "task.cancel", who, exc, task_id=task_id[:128], via="dashboard")
                raise _Refusal("404 Not Found", str(exc)) from None
            record(self.security, "task.cancel", who, None, task_id=task.task_id, reason=reason, via="dashboard")
            core.schedule()
            return task

        cancel()
        await core.durable()
        return Answer("303 See Other", b"", headers=[("Location", f"/ui/task/{quote(task_id)}")])

    async def _download(self, task_id: str, step_text: str, scope: str | None) -> Answer:
        try:
            step = int(step_text)
        except ValueError:
            raise _Refusal("400 Bad Request", f"step: expected a whole number, got {step_text[:40]!r}") from None
        core = self.core

        def pick():
            self._get(task_id, scope)
            try:
                return checkpoints.pick_checkpoint(core.store, task_id, step)
            except SchedulerError as exc:
                raise _Refusal("404 Not Found", str(exc)) from None

        ckpt = pick()
        store = self.artifacts.store if self.artifacts is not None else None
        try:
            manifest = await asyncio.to_thread(checkpoints.build_manifest, ckpt, store)  # blocking I/O
        except SchedulerError as exc:
            raise _Refusal("409 Conflict", str(exc)) from None
        name = f"{task_id}-step{ckpt.step}"
        return Answer(
            "200 OK",
            _tar_stream(manifest, name),
            content_type="application/x-tar",
            headers=[("Content-Disposition", f'attachment; filename="{name}.tar"')],
        )


def _tar_stream(manifest, prefix: str) -> Iterator[bytes]:
    """A tar of the checkpoint's files under ``prefix/``, made as it is sent."""
    files = manifest.message.files
    chunks = checkpoints.read_chunks(manifest)
    buf = io.BytesIO()
    tar = tarfile.open(fileobj=buf, mode="w|")
    pending = next(chunks, None)
    for index, entry in enumerate(files):
        data = bytearray()
        while pending is not None and pending.file_index == index:
            data += pending.data
            pending = next(chunks, None)
        info = tarfile.TarInfo(f"{prefix}/{entry.path}")
        info.size, info.mtime, info.mode = len(data), int(time.time()), 0o644
        tar.addfile(info, io.BytesIO(bytes(data)))
        yield buf.getvalue()
        buf.seek(0)
        buf.truncate()
    tar.close()
    yield buf.getvalue()


def _model_host(core, node, host: common_pb2.ModelHost) -> dict:
    """One of ``node``'s model hosts (a base model its LoRA tenants share) for the cluster page:
    its tenants as ``(task id, owner)`` and the scheduler's memory estimate, read on the loop."""
    needs = [m for m in (node.memory_of(t) for t in host.task_ids) if m is not None]
    return dict(
        model=host.model,
        dtype=host.dtype,
        devices=list(host.device_indices),
        max_tenants=host.max_tenants,
        tenants=[(t, getattr(core.active.get(t), "owner", "")) for t in host.task_ids],
        base_bytes=max((m.base_bytes for m in needs), default=0),
        tenant_bytes=sum(m.tenant_bytes for m in needs),
    )


def _model_hosts_table(hosts: list[dict], who: Principal) -> str:
    """A node's model hosts: base model, dtype, GPUs, tenants (``k of max``) and the memory
    estimate. A user sees links to its own tenants and only a count of other owners'; a host
    without any of its tenants shows neither its model nor its tasks (another owner's model
    folder or hub id is theirs), as ``ListNodes`` is for admin keys."""
    rows = []
    for mh in hosts:
        mine = [t for t, owner in mh["tenants"] if who.is_admin or owner == who.owner]
        others = len(mh["tenants"]) - len(mine)
        links = ", ".join(f'<a href="/ui/task/{quote(t)}">{h(t)}</a>' for t in mine)
        more = f"{', ' if mine else ''}{others} of other owners" if others else ""
        gpus = ", ".join(str(d) for d in mh["devices"]) or "CPU"
        count = f"{len(mh['tenants'])} of {mh['max_tenants'] or '?'}"
        if not mine:  # another owner's (or, with no tenant left, nobody's now): no model named
            what = "(another owner's model)" if others else "(no tenants)"
            rows.append(
                f'<tr class="model-host"><td>{what}</td><td>-</td><td>{h(gpus)}</td>'
                f"<td>{count}{': ' + more if more else ''}</td><td>-</td></tr>"
            )
            continue
        est = (
            f"base {_mib(mh['base_bytes'])} MiB + tenants {_mib(mh['tenant_bytes'])} MiB"
            if mh["base_bytes"] or mh["tenant_bytes"]
            else "-"
        )
        rows.append(
            f'<tr class="model-host" data-model="{h(mh["model"])}"><td>{h(mh["model"])}</td>'
            f"<td>{h(mh['dtype'] or 'auto')}</td><td>{h(gpus)}</td><td>{count}: {links}{more}</td>"
            f"<td>{h(est)}</td></tr>"
        )
    return (
        '<table class="model-hosts"><tr><th>model host</th><th>dtype</th><th>GPUs</th><th>LoRA tenants</th>'
        "<th>memory estimate</th></tr>" + "".join(rows) + "</table>"
    )


def _mib(v: int) -> str:
    return f"{v / 2**20:.1f}"


def _gib(v) -> str:
    try:
        return f"{float(v) / 2**30:.1f}"
    except (TypeError, ValueError):
        return "?"


_LIVE_JS = """<script>
(function () {
  var url = TASK_URL;
  function tick() {
    fetch(url, {credentials: "same-origin"}).then(function (r) { return r.ok ? r.text() : null; })
    .then(function (html) {
      if (html === null) return;
      document.getElementById("charts").innerHTML = html;
      var st = document.querySelector("#charts .charts");
      if (st && ["succeeded", "failed", "cancelled"].indexOf(st.dataset.state) >= 0) { location.reload(); return; }
      setTimeout(tick, 2000);
    }).catch(function () { setTimeout(tick, 5000); });
  }
  setTimeout(tick, 2000);
})();
</script>"""

_CSS = """body{font-family:system-ui,sans-serif;margin:0 1.5em 2em;color:#222}
nav{display:flex;gap:1em;align-items:center;padding:.6em 0;border-bottom:1px solid #ddd;margin-bottom:.8em}
nav a{text-decoration:none;color:#0550ae;font-weight:600}.who{margin-left:auto;color:#555}
table{border-collapse:collapse;margin:.4em 0 1em}td,th{border-bottom:1px solid #eee;padding:.25em .6em;text-align:left;
font-size:.9em;vertical-align:middle}th{background:#f6f8fa}.badge{font-size:.7em;padding:.1em .5em;border-radius:1em}
.badge.connected{background:#dafbe1}.badge.disconnected{background:#ffebe9}
.node{border:1px solid #ddd;border-radius:6px;padding:.2em 1em;margin:.8em 0}
.node.disconnected{opacity:.7}.note,.reason{color:#6e4b00}.error{color:#b00}
pre{background:#f6f8fa;padding:.8em;overflow:auto;max-height:30em}.charts{display:flex;flex-wrap:wrap;gap:.6em}
form.inline{display:inline}h1{font-size:1.3em}h2{font-size:1.1em}"""


def _page(title: str, body: str, nav: str | None, page: str, *, refresh: int = 0) -> bytes:
    meta = f'<meta http-equiv="refresh" content="{refresh}">' if refresh else ""
    return (
        f'<!doctype html><html lang="en"><head><meta charset="utf-8">{meta}<title>{h(title)} · OpenTinker</title>'
        f'<style>{_CSS}</style></head><body data-page="{h(page)}">{nav or ""}<h1>{h(title)}</h1>{body}</body></html>'
    ).encode()


def local_path(path: str) -> str:
    """``path`` when it is a local dashboard path (``/``, ``/ui`` or ``/ui/...``; printable ASCII,
    no ``//`` or backslash), else ``/``: the only redirects the login sends."""
    if _LOCAL_PATH.fullmatch(path) and "//" not in path and "\\" not in path:
        return path
    return "/"


def _login_page(message: str, next_path: str, csrf: str, *, status: str = "401 Unauthorized") -> Answer:
    nxt = local_path(next_path)
    body = (
        (f'<p class="error" id="login-error">{h(message)}</p>' if message else "")
        + '<form method="post" action="/ui/login" id="login"><label>API key '
        '<input type="password" name="api_key" id="api_key" autocomplete="off" size="60"></label>'
        f'<input type="hidden" name="next" value="{h(nxt)}"><input type="hidden" name="csrf" value="{h(csrf)}"> '
        '<button id="login-button">log in</button></form>'
        "<p>Use the key you give the CLI (<code>--api-key</code> or <code>$OPENTINKER_API_KEY</code>); "
        "it is kept in an HttpOnly cookie for this site only.</p>"
    )
    return Answer(status, _page("Log in", body, None, "login"))
