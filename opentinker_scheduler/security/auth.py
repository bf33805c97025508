"""Roles, the caller of each RPC, and the server interceptor that checks API keys on every call
(the key store itself is :mod:`opentinker_scheduler.security.keys`).

``auth:`` in ``scheduler_config.yaml``::

    auth:
      enabled: true                       # default false: every caller is "anonymous" with admin powers
      bootstrap_admin_key_file: admin.key # relative to state_dir; written (mode 0600) on the first start
      stream_recheck_interval: 5          # seconds: open streams re-check their key this often

**Keys** look like ``otk_<8 hex>_<43 url-safe characters>`` (256 random bits). The
``otk_<8 hex>`` prefix is stored in plain text to name the key in listings; the whole key is
stored only as its SHA-256 and compared with :func:`hmac.compare_digest`. A fast hash is enough
because the key itself is random, not a password. Keys live in the ``api_keys`` table of the
scheduler's SQLite database and are looked up on every call, so create, revoke and rotate take
effect at once, without a restart (``AdminService``, ``opentinker keys ...``). Streams already open
with a key (a node's ``Connect``, a ``WatchTask``, downloads) end with UNAUTHENTICATED when it is
revoked (at once) or expires (within ``stream_recheck_interval`` seconds):
:mod:`opentinker_scheduler.security.key_streams`.

**Roles** (:data:`ROLES`): ``admin`` may do everything; ``user`` may use SchedulerService on its
owner's own tasks (another owner's task is NOT_FOUND, never confirmed to exist; ``ListNodes``, which
names every owner's running tasks, is for admins: :data:`ADMIN_ONLY_METHODS`) and manage its own
keys; ``node`` may open its node's stream (``NodeService.Connect``) only: it reads no task,
dataset or artifact and writes none. A task worker calls with its attempt's credential
(``otw_...``, :mod:`opentinker_scheduler.state.worker_credentials`), role ``worker``: NodeService's
reads of its task's owner and ArtifactService, writing only under its attempt's prefix while that
attempt runs on its node (:mod:`opentinker_scheduler.api.artifacts`).

**Bootstrap**: on a start with ``enabled: true`` and no active admin key, the scheduler takes the
key in ``$OPENTINKER_BOOTSTRAP_ADMIN_KEY`` when set, else makes one and writes it to
``bootstrap_admin_key_file`` with mode 0600. Use it to create the real keys, then revoke it.

Status codes: no key, an ``authorization`` value that is not ``Bearer <key>`` ("malformed
authorization metadata: expected 'Bearer otk_...', got a 'Basic' value"; the value itself is never
echoed), or an unknown, revoked or expired key -> UNAUTHENTICATED; a valid key whose role may not
call the method -> PERMISSION_DENIED. ``grpc.health.v1.Health`` and server
reflection need no key. A request protobuf cannot parse (a ``Struct`` nested past protobuf's depth
limit) -> INVALID_ARGUMENT saying what to change (:func:`undecodable_message`), after the key check.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import inspect
from typing import Awaitable, Callable

import grpc
import structlog

from opentinker_common.net.bearer import authorization_problem

from opentinker_scheduler.config.auth import AuthConfig  # noqa: F401 - the auth: section, re-exported
from opentinker_scheduler.security import endpoint_tokens
from opentinker_scheduler.security.audit import AuditLog
from opentinker_scheduler.errors import DeadlineExceeded, SchedulerError
from opentinker_scheduler.security.key_streams import (
    DEFAULT_RECHECK_INTERVAL_S,
    KeyStreams,
    await_until_ended,
    until_ended,
)
from opentinker_scheduler.security.keys import (  # noqa: F401 - re-exported: the key store is part of this module's API
    _KEY_RE,
    BOOTSTRAP_ENV,
    ROLES,
    KeyRow,
    KeyStore,
    Principal,
    Unauthenticated,
    bootstrap_admin,
    hash_key,
    key_prefix,
)
from opentinker_scheduler.security.limits import (
    CHECKPOINT_UPLOADS,
    USER_UPLOADS,
    Limits,
    hold_rate_refusal,
    paced,
)
from opentinker_scheduler.state.worker_credentials import CREDENTIAL_PREFIX, InvalidCredential, WorkerCredentials

log = structlog.get_logger("opentinker.scheduler")

ANONYMOUS_OWNER = "anonymous"

SCHEDULER_SERVICE = "opentinker.scheduler.v1.SchedulerService"
NODE_SERVICE = "opentinker.node.v1.NodeService"
#: Trainers' uploads and downloads of checkpoints: the node role, like NodeService.
ARTIFACT_SERVICE = "opentinker.artifact.v1.ArtifactService"
ADMIN_SERVICE = "opentinker.scheduler.v1.AdminService"
#: Callable without a key: health (load balancers and orchestrators probe it) and reflection
#: (it describes the public API that the .proto files in the repository describe anyway, and
#: grpcurl needs it to call Health without proto files).
PUBLIC_SERVICES = frozenset(
    {"grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection", "grpc.reflection.v1.ServerReflection"}
)


# ------------------------------------------------------------------------------ the caller


ANONYMOUS = Principal(ANONYMOUS_OWNER, "admin")
_CALLER: contextvars.ContextVar[Principal] = contextvars.ContextVar("opentinker_caller", default=ANONYMOUS)


def caller() -> Principal:
    """The principal of the RPC being handled (set by :class:`AuthInterceptor`)."""
    return _CALLER.get()


def owner_scope() -> str | None:
    """The owner whose tasks the caller may see: ``None`` (all) for admins, else its owner (a task
    worker's is its task's owner)."""
    p = caller()
    return None if p.is_admin else p.owner


# ------------------------------------------------------------------------------ interceptor


#: SchedulerService methods for admins only: ``ListNodes`` names every trainer node, its notes and
#: the ids of every owner's tasks running there, while a user never learns that another owner's
#: task exists (a user's own task shows its node in ``GetTask``).
ADMIN_ONLY_METHODS = frozenset({f"/{SCHEDULER_SERVICE}/ListNodes"})

#: Reads of users and admins: each call (a stream when it opens) takes a token of its owner's
#: ``limits.read_rate`` bucket. Submits have ``limits.submit_rate``, uploads their slots.
READ_METHODS = frozenset(
    {
        *(
            f"/{SCHEDULER_SERVICE}/{name}"
            for name in (
                "GetTask",
                "ListTasks",
                "WatchTask",
                "GetMetrics",
                "DownloadDataset",
                "ListCheckpoints",
                "DownloadCheckpoint",
                "ListNodes",
                "GetUsage",
                "ListModelNames",
            )
        ),
        *(
            f"/{ADMIN_SERVICE}/{name}"
            for name in ("ListApiKeys", "ListAuditEvents", "ListQueues", "GetDesiredTrainers")
        ),
    }
)


def allowed_roles(method: str) -> frozenset[str]:
    """Roles that may call ``/package.Service/Method``."""
    if method in ADMIN_ONLY_METHODS:
        return frozenset({"admin"})
    service = method[1:].rsplit("/", 1)[0]
    if service == SCHEDULER_SERVICE:  # task workers read through NodeService (LookupTask, FetchDataset)
        return frozenset({"admin", "user"})
    if method == f"/{NODE_SERVICE}/Connect":
        return frozenset({"admin", "node"})
    if service == NODE_SERVICE:  # a worker's reads, with its attempt credential
        return frozenset({"admin", "worker"})
    if service == ARTIFACT_SERVICE:  # a node key is refused there, naming the artifact key
        return frozenset({"admin", "node", "worker"})
    if service == ADMIN_SERVICE:
        return frozenset({"admin", "user"})  # per-RPC owner checks in AdminService
    return frozenset(ROLES)  # any other service: any valid key


_ROLE_HINT = {
    "worker": "a task worker's credential may call NodeService's reads and ArtifactService only",
    "node": (
        "node keys may open their node's stream (NodeService.Connect) only; a task's worker reads tasks "
        "and datasets with the attempt credential of its assignment"
    ),
    "user": "user keys may not open a node stream or make task workers' reads (NodeService); trainers need a node key",
}


_ADMIN_ONLY_HINT = (
    "it lists every trainer node and the tasks of every owner running there, so it is for admin keys; "
    "GetTask shows the node of your own task"
)


#: The one RPC an endpoint token may call, and only endpoint tokens: trainer endpoints ask it.
AUTHORIZE_ENDPOINT = f"/{SCHEDULER_SERVICE}/AuthorizeEndpoint"


def _endpoint_refusal(principal: Principal, method: str) -> str:
    if method == AUTHORIZE_ENDPOINT:
        return (
            f"API key {principal.key_prefix} (role {principal.role}) may not call {method}: "
            "it takes the endpoint token (ote_...) that a trainer endpoint's caller sent"
        )
    return (
        f"an endpoint token (ote_..., of API key {principal.key_prefix}) may not call {method}: it opens the "
        f"endpoints of task {principal.endpoint_task} on trainer nodes only; call the scheduler with your API key"
    )


MISSING_KEY = (
    "missing API key: send metadata 'authorization: Bearer otk_...' "
    "(RLClient(api_key=...), --api-key or $OPENTINKER_API_KEY)"
)


async def _abort_plain(context, exc: SchedulerError) -> None:
    await hold_rate_refusal()
    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))


class _Refused(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


def bearer_token(metadata) -> str | None:
    """The key of ``authorization: Bearer <key>`` metadata, else None."""
    for key, value in metadata or ():
        if key.lower() == "authorization":
            if isinstance(value, bytes):
                value = value.decode(errors="replace")
            scheme, _, token = value.strip().partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
            return ""
    return None


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Checks every call (but health checks) and runs its handler with :func:`caller` set.

    * ``node_cert_required``: NodeService calls must come over a TLS connection whose client
      certificate the server verified against ``tls.client_ca`` (mTLS), else UNAUTHENTICATED.
    * ``keys``: ``None`` = authentication off, the caller is ``anonymous`` with admin powers.
    * Limits count per owner (:mod:`opentinker_scheduler.security.limits`): a read
      (:data:`READ_METHODS`) takes a ``limits.read_rate`` token; server streams of SchedulerService
      hold one of ``limits.max_streams_per_owner`` slots while open; uploads hold a slot of their
      pool (users' or checkpoints'); unary calls of SchedulerService and AdminService run as one of
      their owner's ``limits.max_calls_per_owner`` calls in progress, the others waiting their
      turn. Beyond them: RESOURCE_EXHAUSTED through :attr:`abort_refusal`.
    * Every stream admitted with a key (server, client or bidirectional) is registered in
      :attr:`streams` and ends with UNAUTHENTICATED once the key is revoked or expires
      (:mod:`opentinker_scheduler.security.key_streams`; ``stream_recheck_interval_s`` between re-checks).
    """

    def __init__(
        self,
        *,
        keys: KeyStore | None,
        limits: Limits,
        audit: AuditLog,
        node_cert_required: bool = False,
        stream_recheck_interval_s: float = DEFAULT_RECHECK_INTERVAL_S,
        worker_credentials: WorkerCredentials | None = None,
    ) -> None:
        self.keys = keys
        self.limits = limits
        self.audit = audit
        #: The client's address for the peer gRPC reports; the server sets it when a front on the
        #: public port splices connections (api/front.py), so audit records name the real client.
        self.peer_of: Callable[[str], str] = lambda peer: peer
        self.node_cert_required = node_cert_required
        #: Aborts a call with a refusal's status; the server sets the API's mapping
        #: (:func:`opentinker_scheduler.api.rpc.abort_mapped`: ``google.rpc.RetryInfo`` and kin).
        self.abort_refusal: Callable[[object, SchedulerError], Awaitable[None]] = _abort_plain
        #: Checks task workers' attempt credentials (None: only API keys are accepted).
        self.worker_credentials = worker_credentials
        #: Open streams by key (None with authentication off: there are no keys to revoke).
        self.streams: KeyStreams | None = (
            KeyStreams(keys.refusal, recheck_interval_s=stream_recheck_interval_s) if keys is not None else None
        )

    def admit(self, method: str, context) -> Principal:
        """The caller of ``method``, or :class:`_Refused`."""
        service = method[1:].rsplit("/", 1)[0]
        peer_cn, peer_dns = "", ()
        if self.node_cert_required and service in (NODE_SERVICE, ARTIFACT_SERVICE):
            ctx = context.auth_context() or {}
            if not ctx.get("x509_pem_cert"):
                raise _Refused(
                    grpc.StatusCode.UNAUTHENTICATED,
                    "NodeService needs a client certificate signed by the scheduler's tls.client_ca (mTLS); "
                    "connect to the node port with --tls-cert/--tls-key",
                )
            cn = ctx.get("x509_common_name") or [b""]
            peer_cn = cn[0].decode(errors="replace")
            peer_dns = tuple(n.decode(errors="replace") for n in ctx.get("peer_dns") or ())  # DNS subject alt names
        if self.keys is None:
            return dataclasses.replace(ANONYMOUS, peer_cn=peer_cn, peer_dns=peer_dns)
        metadata = context.invocation_metadata()
        token = bearer_token(metadata)
        if not token:
            # A header that is there but not `Bearer <key>` is "malformed", never "missing"; its
            # value is not echoed (it may be the key itself).
            raise _Refused(grpc.StatusCode.UNAUTHENTICATED, authorization_problem(metadata) or MISSING_KEY)
        try:
            principal = self._resolve(token)
        except Unauthenticated as exc:
            raise _Refused(grpc.StatusCode.UNAUTHENTICATED, str(exc)) from None
        if (principal.role == endpoint_tokens.ENDPOINT_ROLE) != (method == AUTHORIZE_ENDPOINT):
            raise _Refused(grpc.StatusCode.PERMISSION_DENIED, _endpoint_refusal(principal, method))
        if principal.role not in allowed_roles(method) and method != AUTHORIZE_ENDPOINT:
            hint = _ADMIN_ONLY_HINT if method in ADMIN_ONLY_METHODS else _ROLE_HINT.get(principal.role, "")
            raise _Refused(
                grpc.StatusCode.PERMISSION_DENIED,
                f"API key {principal.key_prefix} (role {principal.role}) may not call {method}"
                + (f": {hint}" if hint else ""),
            )
        return dataclasses.replace(principal, peer_cn=peer_cn, peer_dns=peer_dns)

    def _resolve(self, token: str) -> Principal:
        """The principal of an API key, an endpoint token or a task worker's attempt credential."""
        if token.startswith(endpoint_tokens.PREFIX):
            return endpoint_tokens.resolve(self.keys, token)
        if token.startswith(CREDENTIAL_PREFIX):
            if self.worker_credentials is None:
                raise Unauthenticated("unknown attempt credential: this scheduler issues none")
            try:
                scope = self.worker_credentials.verify(token)
            except InvalidCredential:
                raise Unauthenticated(
                    "unknown attempt credential (expected otw_... as the scheduler gave the task worker)"
                ) from None
            return Principal(scope.owner, "worker", attempt=scope)
        return self.keys.resolve(token)

    async def _gate(self, method: str, context) -> Principal:
        try:
            return self.admit(method, context)
        except _Refused as exc:
            token = bearer_token(context.invocation_metadata()) or ""
            m = _KEY_RE.match(token)
            self.audit.refused(
                method=method,
                reason=exc.message,
                outcome=exc.code.name,
                key_prefix=m.group(1) if m else "",
                peer=self.peer_of(context.peer()),
            )
            await context.abort(exc.code, exc.message)
            raise  # abort raises; this line is never reached

    def _watch(self, principal: Principal, method: str, context):
        """Register a stream admitted with a key (None when there is no key to watch)."""
        if self.streams is None or not principal.key_prefix:
            return None
        return self.streams.open(principal.key_prefix, method, self.peer_of(context.peer()))

    async def _end_revoked(self, stream, context) -> None:
        """End a stream whose key was revoked or expired: UNAUTHENTICATED with the reason."""
        self.audit.refused(
            method=stream.method,
            reason=f"open stream ended: {stream.reason}",
            outcome="UNAUTHENTICATED",
            key_prefix=stream.prefix,
            peer=stream.peer,
        )
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, stream.reason)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method[1:].rsplit("/", 1)[0] in PUBLIC_SERVICES:
            return handler
        service = method[1:].rsplit("/", 1)[0]
        stream_slot = handler.response_streaming and service == SCHEDULER_SERVICE
        # UploadDataset, ImportAdapter and ArtifactService.UploadChunks: an upload slot, timeouts.
        upload = handler.request_streaming and not handler.response_streaming and service in UPLOAD_POOLS
        return _wrap(handler, self, method, stream_slot, UPLOAD_POOLS[service] if upload else None)


#: Services whose client-streaming RPCs are uploads, and their pool (:meth:`Limits.acquire_upload`,
#: :func:`timed_uploads`).
UPLOAD_POOLS = {SCHEDULER_SERVICE: USER_UPLOADS, ARTIFACT_SERVICE: CHECKPOINT_UPLOADS}

#: The refusal of a node key's checkpoint upload, before it takes a slot of the pool.
_NODE_UPLOAD_REFUSAL = (
    "API key {prefix} (role node) may not upload checkpoints (ArtifactService.UploadChunks): a task's worker "
    "uploads with the attempt credential of its assignment"
)

#: protobuf's (upb's) limit on message nesting, which a deep ``google.protobuf.Struct`` reaches.
PROTOBUF_MAX_DEPTH = 100


class _Undecodable:
    """A request whose bytes protobuf refused (:func:`_safe_deserializer`); answered INVALID_ARGUMENT."""

    def __init__(self, message: str) -> None:
        self.message = message


def undecodable_message(method: str, exc: Exception) -> str:
    """What a person reads when the request of ``method`` cannot be parsed: for protobuf's depth
    limit (``Exceeded upb_DecodeOptions_MaxDepth``, a ``Struct`` nested too deep) which fields nest
    and how deep the spec allows; the exception's own name never."""
    name = method.rsplit("/", 1)[-1]
    if "MaxDepth" in str(exc) or "recursion" in str(exc).lower():
        return (
            f"request: expected a {name} request nested at most {PROTOBUF_MAX_DEPTH} levels deep (protobuf's "
            "limit), got a deeper one; a google.protobuf.Struct such as spec.env_config or spec.hyperparameters "
            "nests too deep: task options may nest lists and mappings at most 3 levels"
        )
    return f"request: expected a valid protobuf {name} request, got bytes that do not parse as one"


def _safe_deserializer(deserialize, method: str):
    """``deserialize``, but bytes protobuf refuses become an :class:`_Undecodable` instead of an
    exception (which gRPC would answer UNKNOWN, naming ``DecodeError``)."""
    if deserialize is None:
        return None

    def safe(data: bytes):
        try:
            return deserialize(data)
        except Exception as exc:  # noqa: BLE001 - google.protobuf.message.DecodeError and kin
            return _Undecodable(undecodable_message(method, exc))

    return safe


async def _decoded(requests, context):
    """The messages of a client stream; an undecodable one aborts with INVALID_ARGUMENT."""
    async for req in requests:
        if isinstance(req, _Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, req.message)
        yield req


def payload_bytes(message) -> int:
    """File bytes an upload's message carries: ``chunk`` (UploadDataset), ``data``
    (ArtifactService.UploadChunks) or ``chunk.data`` (ImportAdapter); 0 for a header."""
    chunk = getattr(message, "chunk", None)
    if chunk is not None and not isinstance(chunk, bytes):
        chunk = getattr(chunk, "data", b"")
    return len(chunk if chunk is not None else getattr(message, "data", b""))


async def timed_uploads(requests, *, idle_timeout_s: float, deadline_s: float, clock=None):
    """The messages of an upload's client stream, refusing a stream that goes ``idle_timeout_s``
    seconds without a payload byte (:func:`payload_bytes`; messages without any, empty chunks
    included, do not count) or stays open ``deadline_s`` seconds in all (0 = no limit).

    Raises:
        DeadlineExceeded: either happened; the message names the limit and its config key. The
            handler's clean-up (a dataset upload's ``.part`` file) runs as for any failed upload.
    """
    loop = asyncio.get_running_loop()
    clock = clock or loop.time
    start = last_bytes = clock()
    it = requests.__aiter__()
    while True:
        waits = []
        if idle_timeout_s:
            waits.append((max(0.0, last_bytes + idle_timeout_s - clock()), "idle"))
        if deadline_s:
            waits.append((max(0.0, start + deadline_s - clock()), "deadline"))
        timeout, why = min(waits) if waits else (None, "")
        try:
            req = await asyncio.wait_for(it.__anext__(), timeout)
        except StopAsyncIteration:
            return
        except asyncio.TimeoutError:
            if why == "idle":
                raise DeadlineExceeded(
                    f"upload: no payload byte for {idle_timeout_s:g} s (limits.upload_idle_timeout); "
                    "the partial upload was dropped, send it again"
                ) from None
            raise DeadlineExceeded(
                f"upload: still open after {deadline_s:g} s (limits.upload_deadline); "
                "the partial upload was dropped, send it again (or ask for a longer limits.upload_deadline)"
            ) from None
        if payload_bytes(req):
            last_bytes = clock()
        yield req


def _wrap(handler, interceptor: AuthInterceptor, method: str, stream_slot: bool, upload: str | None = None):
    if handler.request_streaming and handler.response_streaming:
        inner, factory = handler.stream_stream, grpc.stream_stream_rpc_method_handler
    elif handler.request_streaming:
        inner, factory = handler.stream_unary, grpc.stream_unary_rpc_method_handler
    elif handler.response_streaming:
        inner, factory = handler.unary_stream, grpc.unary_stream_rpc_method_handler
    else:
        inner, factory = handler.unary_unary, grpc.unary_unary_rpc_method_handler
    read = method in READ_METHODS
    #: Unary calls of users and admins take one of their owner's turns (Limits.acquire_turn).
    turns = method[1:].rsplit("/", 1)[0] in (SCHEDULER_SERVICE, ADMIN_SERVICE)

    if handler.response_streaming:

        async def behavior(request, context):
            principal = await interceptor._gate(method, context)
            if isinstance(request, _Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
            if handler.request_streaming:  # bidirectional (a node's Connect)
                request = _decoded(request, context)
            owner = principal.owner
            _CALLER.set(principal)
            try:
                if read:
                    await paced(lambda: interceptor.limits.take_read(owner, method))
                if stream_slot:
                    interceptor.limits.acquire_stream(owner)
            except SchedulerError as exc:
                await interceptor.abort_refusal(context, exc)
            watched = interceptor._watch(principal, method, context)
            try:
                result = inner(request, context)
                if hasattr(result, "__aiter__"):
                    source = result if watched is None else until_ended(result, watched)
                    async for item in source:
                        yield item
                elif inspect.isawaitable(result):
                    await result
                if watched is not None and watched.ended.is_set():
                    await interceptor._end_revoked(watched, context)
            finally:
                if watched is not None:
                    interceptor.streams.close(watched)
                if stream_slot:
                    interceptor.limits.release_stream(owner)

    elif handler.request_streaming:

        async def behavior(request, context):
            principal = await interceptor._gate(method, context)
            _CALLER.set(principal)
            requests = _decoded(request, context)
            if upload:
                if upload == CHECKPOINT_UPLOADS and principal.role == "node":  # refused before it holds a slot
                    await context.abort(
                        grpc.StatusCode.PERMISSION_DENIED, _NODE_UPLOAD_REFUSAL.format(prefix=principal.key_prefix)
                    )
                try:
                    interceptor.limits.acquire_upload(principal.owner, upload, attempt=principal.attempt)
                except SchedulerError as exc:
                    await interceptor.abort_refusal(context, exc)
                cfg = interceptor.limits.config
                requests = timed_uploads(
                    requests, idle_timeout_s=cfg.upload_idle_timeout or 0, deadline_s=cfg.upload_deadline or 0
                )
            watched = interceptor._watch(principal, method, context)
            try:
                result = inner(requests, context)
                if watched is None or not inspect.isawaitable(result):
                    return (await result) if inspect.isawaitable(result) else result
                finished, value = await await_until_ended(result, watched)
                if not finished:
                    await interceptor._end_revoked(watched, context)
                return value
            finally:
                if watched is not None:
                    interceptor.streams.close(watched)
                if upload:
                    interceptor.limits.release_upload(principal.owner, upload, attempt=principal.attempt)

    else:

        async def behavior(request, context):
            principal = await interceptor._gate(method, context)
            if isinstance(request, _Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
            _CALLER.set(principal)
            owner, turn = principal.owner, False
            try:
                if read:
                    await paced(lambda: interceptor.limits.take_read(owner, method))
                if turns:
                    turn = await interceptor.limits.acquire_turn(owner)
            except SchedulerError as exc:
                await interceptor.abort_refusal(context, exc)
            try:
                result = inner(request, context)
                if inspect.isawaitable(result):
                    result = await result
            finally:
                if turn:
                    interceptor.limits.release_turn(owner)
            if read and result is not None:
                interceptor.limits.charge_read(owner, result.ByteSize())
            return result

    return factory(
        behavior,
        request_deserializer=_safe_deserializer(handler.request_deserializer, method),
        response_serializer=handler.response_serializer,
    )
