"""Who may call a task's endpoints on this node: the scheduler decides, asked with the caller's
endpoint token.

Users' API keys stay with the scheduler. A caller of an endpoint (``InferenceService``, the
OpenAI-compatible HTTP API, a training session's ``TrainingService``) of task ``T`` sends an
endpoint token, ``authorization: Bearer ote_...``, that the scheduler issued for ``T``
(``SchedulerService.IssueEndpointToken``; ``opentinker endpoint-token T``; the Python client gets
and renews them itself). The node holds no key store: it asks
``SchedulerService.AuthorizeEndpoint(endpoint_task_id=T)`` with that token, which succeeds when the
token is valid, is for ``T``, its API key is active and its owner owns ``T`` (or it is an admin's;
with scheduler auth off everyone passes, exactly as on the scheduler). A request naming adapter
``X`` asks the same with ``task_id=X``, so a user serves only adapters of tasks they can see; the
server then loads it with the node's credentials (:mod:`.resolve`).

A value holding an API key (``Bearer otk_...``, or a key in any other form) is refused here,
UNAUTHENTICATED, and never sent on: the message says how to get an endpoint token.

The scheduler's answer maps to the status the caller gets:

================================  =====================================================
scheduler (AuthorizeEndpoint)     caller
================================  =====================================================
OK                                allowed
UNAUTHENTICATED                   UNAUTHENTICATED (the scheduler's message: missing,
                                  malformed (not ``Bearer <token>``), badly signed,
                                  expired, or its API key revoked)
NOT_FOUND, PERMISSION_DENIED,     PERMISSION_DENIED ("endpoint token of API key
INVALID_ARGUMENT                  otk_xxxx may not use inference task <id>"; also a
                                  token for another task)
UNAVAILABLE, DEADLINE_EXCEEDED,   UNAVAILABLE (the scheduler cannot be asked now; not
anything else                     cached)
RESOURCE_EXHAUSTED                RESOURCE_EXHAUSTED (the key's limits on the scheduler)
================================  =====================================================

The ``authorization`` value goes to the scheduler as the caller sent it, so a malformed one
(``ote_...`` without ``Bearer``, ``Basic ...``) reads exactly as on the scheduler, and with
scheduler auth off it passes there as here.

Decisions are cached per ``(sha256(authorization value), endpoint task, task)`` for ``ttl``
seconds (default :data:`DEFAULT_TTL_S`; both allowed and refused), and an allowed one never past
its token's expiry, so a stream of requests costs one scheduler round trip per TTL, and concurrent
first requests share one. Consequence: revoking a key, or a task changing hands, takes effect on a
node within ``ttl`` seconds. The token itself is never stored or logged; only its hash (the cache
key) and the public ``otk_<8 hex>`` prefix of its API key (in refusal messages) are kept.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
import re
import time
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import grpc

from opentinker.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc

__all__ = [
    "AccessChecker",
    "AccessRefused",
    "DEFAULT_TTL_S",
    "TTL_ENV",
    "authorization_value",
    "credential_of",
    "token_expiry",
]

#: Seconds a decision is reused (allowed and refused alike).
DEFAULT_TTL_S = 10.0
#: Environment variable the ``inference`` workload reads to override :data:`DEFAULT_TTL_S`.
TTL_ENV = "OPENTINKER_INFERENCE_AUTH_TTL_S"
_PREFIX_RE = re.compile(r"^(otk_[0-9a-f]{8})_")
_API_KEY_RE = re.compile(r"otk_[0-9a-f]{8}_")
_DENY = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.INVALID_ARGUMENT)
_PASS = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.RESOURCE_EXHAUSTED)


class AccessRefused(Exception):
    """A refused call; ``code`` is the :class:`grpc.StatusCode` to answer with, ``message`` its text."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


def authorization_value(metadata: Iterable[tuple[str, Any]] | None) -> str:
    """The first ``authorization`` metadata value (``""`` when there is none), as a string."""
    for key, value in metadata or ():
        if key.lower() == "authorization":
            return value.decode(errors="replace") if isinstance(value, bytes) else str(value)
    return ""


def _token(authorization: str) -> str:
    return authorization.strip().partition(" ")[2].strip()


def _claims(token: str) -> dict:
    """The unverified claims of an ``ote_<payload>.<signature>`` token ({} when it is not one)."""
    payload = token[4:].partition(".")[0] if token.startswith("ote_") and len(token) <= 512 else ""
    try:
        claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    except ValueError:
        return {}
    return claims if isinstance(claims, dict) else {}


def credential_of(authorization: str) -> str:
    """How a refusal names the caller's credential: ``endpoint token of API key otk_<8 hex>``
    (never the secret), or a neutral stand-in."""
    token = _token(authorization)
    prefix = _claims(token).get("k")
    if isinstance(prefix, str) and _PREFIX_RE.match(prefix + "_"):
        return f"endpoint token of API key {prefix}"
    return "(no endpoint token)" if not token else "(not an endpoint token)"


def token_expiry(authorization: str) -> float | None:
    """The expiry (unix seconds) an ``ote_`` token claims, else None. Unverified: it only
    shortens how long the scheduler's yes is reused."""
    expire = _claims(_token(authorization)).get("e")
    valid = isinstance(expire, int) and not isinstance(expire, bool) and 0 < expire < 2**53
    return float(expire) if valid else None


def _api_key_refusal(endpoint: str) -> AccessRefused:
    return AccessRefused(
        grpc.StatusCode.UNAUTHENTICATED,
        "this endpoint takes an endpoint token (Bearer ote_...), not an API key: API keys stay with the "
        f"scheduler. Get one with `opentinker endpoint-token {endpoint}` (SchedulerService.IssueEndpointToken); "
        "RLClient, InferenceClient(scheduler_url=..., task_id=...) and training sessions get them themselves",
    )


@dataclass
class _Decision:
    expires: float
    refusal: AccessRefused | None


class AccessChecker:
    """Checks endpoint callers against the scheduler (see the module docstring).

    Args:
        target: the scheduler's ``host:port``; default ``$OPENTINKER_SCHEDULER_URL``.
        env: where to read the scheduler link's TLS settings (``OPENTINKER_TLS_CA`` /
            ``OPENTINKER_TLS_CERT`` / ``OPENTINKER_TLS_KEY`` / ``OPENTINKER_SCHEDULER_TLS``, the
            node's, which the agent hands to its workers; see
            :func:`~opentinker_trainer.scheduler_link.scheduler_credentials`); default
            ``os.environ``. The node's API key is *not* used.
        ttl: seconds a decision is cached (> 0).
        timeout: seconds per GetTask call.
        max_entries: cached decisions kept at most (expired ones go first, then the oldest).
        what: how a refusal names the task (``"inference task"``; a training session's server
            says ``"training session"``).

    Raises:
        ValueError: no scheduler address, a bad ``ttl``, or a TLS file that cannot be read.

    Uses one ``grpc.aio`` channel, opened on first use in the running event loop (the server's);
    call :meth:`close` from that loop.
    """

    def __init__(
        self,
        target: str | None = None,
        *,
        env: Mapping[str, str] | None = None,
        ttl: float = DEFAULT_TTL_S,
        timeout: float = 5.0,
        max_entries: int = 10_000,
        clock=time.monotonic,
        what: str = "inference task",
    ) -> None:
        env = os.environ if env is None else env
        # Several schedulers (the node's list, the leader first): GetTask is answered by any of
        # them, so the first is asked.
        self.target = (target or env.get("OPENTINKER_SCHEDULER_URL", "")).split(",")[0].strip()
        if not self.target:
            raise ValueError("the scheduler's address is unknown (OPENTINKER_SCHEDULER_URL is not set)")
        if not (isinstance(ttl, (int, float)) and ttl > 0):
            raise ValueError(f"ttl: expected seconds > 0, got {ttl!r}")
        from opentinker_trainer.scheduler_link import scheduler_credentials

        self._creds = scheduler_credentials(env)  # the node's choice: its CA, https:// (system roots), mTLS pair
        self.ttl = float(ttl)
        self.timeout = float(timeout)
        self.max_entries = int(max_entries)
        self.clock = clock
        self.what = what
        self._cache: dict[tuple[str, str, str], _Decision] = {}
        self._inflight: dict[tuple[str, str, str], asyncio.Future] = {}
        self._channel: grpc.aio.Channel | None = None
        self._stub: scheduler_pb2_grpc.SchedulerServiceStub | None = None
        #: AuthorizeEndpoint calls made (cache misses); for tests and benchmarks.
        self.scheduler_calls = 0

    def _scheduler(self) -> scheduler_pb2_grpc.SchedulerServiceStub:
        if self._stub is None:
            if self._creds is None:
                self._channel = grpc.aio.insecure_channel(self.target)
            else:
                self._channel = grpc.aio.secure_channel(self.target, self._creds)
            self._stub = scheduler_pb2_grpc.SchedulerServiceStub(self._channel)
        return self._stub

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = self._stub = None

    async def check(self, metadata: Iterable[tuple[str, Any]] | None, task_id: str, endpoint: str = "") -> None:
        """Return if the caller with ``metadata`` (its ``authorization`` entry) may use the endpoint
        of task ``endpoint`` (default ``task_id``) and, there, task ``task_id`` (an adapter or a
        policy); else raise :class:`AccessRefused` with UNAUTHENTICATED, PERMISSION_DENIED,
        RESOURCE_EXHAUSTED or UNAVAILABLE (see the module docstring)."""
        endpoint = endpoint or task_id
        auth = authorization_value(metadata)
        if _API_KEY_RE.search(auth):  # an API key, in any form: refused here, never sent on
            raise _api_key_refusal(endpoint)
        key = (hashlib.sha256(auth.encode()).hexdigest(), endpoint, task_id)
        now = self.clock()
        hit = self._cache.get(key)
        if hit is not None and hit.expires > now:
            if hit.refusal is not None:
                raise AccessRefused(hit.refusal.code, hit.refusal.message)
            return
        pending = self._inflight.get(key)
        if pending is None:
            pending = asyncio.get_running_loop().create_future()
            self._inflight[key] = pending
            try:
                refusal = await self._ask(auth, endpoint, task_id)
            except BaseException as exc:  # noqa: BLE001 - cancellation: wake the waiters, then re-raise
                refusal = AccessRefused(
                    grpc.StatusCode.UNAVAILABLE, f"cannot check the endpoint token with the scheduler: {exc!r}"
                )
                pending.set_result(refusal)
                self._inflight.pop(key, None)
                raise
            pending.set_result(refusal)
            self._inflight.pop(key, None)
            if refusal is None or refusal.code != grpc.StatusCode.UNAVAILABLE:
                self._remember(key, refusal, token_expiry(auth) if refusal is None else None)
        else:
            refusal = await asyncio.shield(pending)
        if refusal is not None:
            raise AccessRefused(refusal.code, refusal.message)

    def _remember(self, key: tuple[str, str, str], refusal: AccessRefused | None, expiry: float | None) -> None:
        """Cache a decision for ``ttl`` seconds, and an allowed one no later than the token's
        ``expiry`` (unix seconds)."""
        now = self.clock()
        until = now + self.ttl
        if expiry is not None:
            until = min(until, now + expiry - time.time())
        if len(self._cache) >= self.max_entries:
            for k in [k for k, d in self._cache.items() if d.expires <= now]:
                del self._cache[k]
            while len(self._cache) >= self.max_entries:
                del self._cache[next(iter(self._cache))]  # oldest insertion first
        self._cache.pop(key, None)
        self._cache[key] = _Decision(until, refusal)

    async def _ask(self, auth: str, endpoint: str, task_id: str) -> AccessRefused | None:
        self.scheduler_calls += 1
        metadata = (("authorization", auth),) if auth else ()
        request = scheduler_pb2.AuthorizeEndpointRequest(endpoint_task_id=endpoint, task_id=task_id)
        try:
            await self._scheduler().AuthorizeEndpoint(request, timeout=self.timeout, metadata=metadata)
            return None
        except grpc.aio.AioRpcError as err:
            code = err.code()
            if code == grpc.StatusCode.UNAUTHENTICATED and not auth:
                return AccessRefused(
                    code,
                    "missing endpoint token: send 'authorization: Bearer ote_...' "
                    f"(`opentinker endpoint-token {endpoint}` prints one)",
                )
            if code in _PASS:
                return AccessRefused(code, err.details() or code.name)
            if code in _DENY:
                return AccessRefused(
                    grpc.StatusCode.PERMISSION_DENIED, f"{credential_of(auth)} may not use {self.what} {task_id}"
                )
            return AccessRefused(
                grpc.StatusCode.UNAVAILABLE,
                f"cannot check the endpoint token with the scheduler at {self.target} "
                f"({code.name}: {err.details()}); try again",
            )
