"""Who may call an inference server: the scheduler decides, asked with the caller's own key.

The inference server holds no key store. A call to ``InferenceService`` on the server of
inference task ``T`` is allowed when ``SchedulerService.GetTask(T)``, made with the caller's own
``authorization`` metadata, succeeds: the key is valid and its owner owns ``T`` (or it is an admin
key; with scheduler auth off everyone passes, exactly as on the scheduler). A request naming
adapter ``X`` must pass the same check for task ``X``, so a user serves only adapters of tasks
they can see; the server then loads it with the node's key (:mod:`.resolve`).

The scheduler's answer maps to the status the caller gets:

================================  =====================================================
scheduler (GetTask)               caller
================================  =====================================================
OK                                allowed
UNAUTHENTICATED                   UNAUTHENTICATED (the scheduler's message: missing,
                                  malformed (not ``Bearer <key>``) or unknown/revoked/expired
                                  key)
NOT_FOUND, PERMISSION_DENIED,     PERMISSION_DENIED ("API key otk_xxxx may not use
INVALID_ARGUMENT                  inference task <id>")
UNAVAILABLE, DEADLINE_EXCEEDED,   UNAVAILABLE (the scheduler cannot be asked now; not
anything else                     cached)
RESOURCE_EXHAUSTED                RESOURCE_EXHAUSTED (the key's limits on the scheduler)
================================  =====================================================

The ``authorization`` value goes to the scheduler as the caller sent it, so a malformed one
(``otk_...`` without ``Bearer``, ``Basic ...``) reads exactly as on the scheduler ("malformed
authorization metadata: expected 'Bearer otk_...', got a 'Basic' value", never "missing API
key"), and with scheduler auth off it passes there as here.

Decisions are cached per ``(sha256(authorization value), task id)`` for ``ttl`` seconds (default
:data:`DEFAULT_TTL_S`; both allowed and refused), so a stream of requests costs one scheduler
round trip per TTL, and concurrent first requests share one. Consequence: revoking a key, or a
task changing hands, takes effect on an inference server within ``ttl`` seconds. The key itself is
never stored or logged; only its hash (the cache key) and its public ``otk_<8 hex>`` prefix (in
refusal messages) are kept.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import time
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import grpc

from opentinker.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc

__all__ = ["AccessChecker", "AccessRefused", "DEFAULT_TTL_S", "TTL_ENV", "authorization_value", "key_prefix_of"]

#: Seconds a decision is reused (allowed and refused alike).
DEFAULT_TTL_S = 10.0
#: Environment variable the ``inference`` workload reads to override :data:`DEFAULT_TTL_S`.
TTL_ENV = "OPENTINKER_INFERENCE_AUTH_TTL_S"
_PREFIX_RE = re.compile(r"^(otk_[0-9a-f]{8})_")
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


def key_prefix_of(authorization: str) -> str:
    """``otk_<8 hex>`` of a ``Bearer otk_...`` value, else a neutral stand-in (never the secret)."""
    token = authorization.strip().partition(" ")[2].strip()
    m = _PREFIX_RE.match(token)
    return m.group(1) if m else ("(none)" if not token else "(not an OpenTinker key)")


@dataclass
class _Decision:
    expires: float
    refusal: AccessRefused | None


class AccessChecker:
    """Checks InferenceService callers against the scheduler (see the module docstring).

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
        self._cache: dict[tuple[str, str], _Decision] = {}
        self._inflight: dict[tuple[str, str], asyncio.Future] = {}
        self._channel: grpc.aio.Channel | None = None
        self._stub: scheduler_pb2_grpc.SchedulerServiceStub | None = None
        #: GetTask calls made (cache misses); for tests and benchmarks.
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

    async def check(self, metadata: Iterable[tuple[str, Any]] | None, task_id: str) -> None:
        """Return if the caller with ``metadata`` (its ``authorization`` entry) may use task
        ``task_id``; else raise :class:`AccessRefused` with UNAUTHENTICATED, PERMISSION_DENIED,
        RESOURCE_EXHAUSTED or UNAVAILABLE (see the module docstring)."""
        auth = authorization_value(metadata)
        key = (hashlib.sha256(auth.encode()).hexdigest(), task_id)
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
                refusal = await self._ask(auth, task_id)
            except BaseException as exc:  # noqa: BLE001 - cancellation: wake the waiters, then re-raise
                refusal = AccessRefused(
                    grpc.StatusCode.UNAVAILABLE, f"cannot check the API key with the scheduler: {exc!r}"
                )
                pending.set_result(refusal)
                self._inflight.pop(key, None)
                raise
            pending.set_result(refusal)
            self._inflight.pop(key, None)
            if refusal is None or refusal.code != grpc.StatusCode.UNAVAILABLE:
                self._remember(key, refusal)
        else:
            refusal = await asyncio.shield(pending)
        if refusal is not None:
            raise AccessRefused(refusal.code, refusal.message)

    def _remember(self, key: tuple[str, str], refusal: AccessRefused | None) -> None:
        now = self.clock()
        if len(self._cache) >= self.max_entries:
            for k in [k for k, d in self._cache.items() if d.expires <= now]:
                del self._cache[k]
            while len(self._cache) >= self.max_entries:
                del self._cache[next(iter(self._cache))]  # oldest insertion first
        self._cache.pop(key, None)
        self._cache[key] = _Decision(now + self.ttl, refusal)

    async def _ask(self, auth: str, task_id: str) -> AccessRefused | None:
        self.scheduler_calls += 1
        metadata = (("authorization", auth),) if auth else ()
        try:
            await self._scheduler().GetTask(
                scheduler_pb2.GetTaskRequest(task_id=task_id), timeout=self.timeout, metadata=metadata
            )
            return None
        except grpc.aio.AioRpcError as err:
            code = err.code()
            if code in _PASS:
                return AccessRefused(code, err.details() or code.name)
            if code in _DENY:
                return AccessRefused(
                    grpc.StatusCode.PERMISSION_DENIED,
                    f"API key {key_prefix_of(auth)} may not use {self.what} {task_id}",
                )
            return AccessRefused(
                grpc.StatusCode.UNAVAILABLE,
                f"cannot check the API key with the scheduler at {self.target} "
                f"({code.name}: {err.details()}); try again",
            )
