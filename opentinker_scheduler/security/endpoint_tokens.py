"""Endpoint tokens: what a caller sends to a task's endpoints on trainer nodes instead of an API key.

A trainer node serves an inference task's ``InferenceService`` and OpenAI-compatible HTTP API, and
a ``lora_session`` task's ``TrainingService``. A node is less trusted than the scheduler: if API
keys reached it, one compromised node would collect working keys of every user it served. So
these endpoints take an endpoint token instead, issued by ``SchedulerService.IssueEndpointToken``:

``ote_<payload>.<signature>``, where the payload is base64url JSON ``{"k": key prefix, "t": task
id, "e": expiry in unix seconds}`` and the signature is HMAC-SHA256 of the payload, keyed with the
stored hash of the API key that asked for it. The hash never leaves the scheduler's database, so
only a scheduler can sign; every scheduler on the same database checks the same tokens, also
after a failover. No token is stored.

A token works only while all of these hold:

* it is not past its expiry (at most :data:`MAX_TTL_S` after it was issued);
* the API key that asked for it is active: revoking the key (or its rotation ending) ends its
  tokens at once on the scheduler, and on an endpoint within its decision cache's TTL;
* that key's owner still owns the task (an admin's token: any task).

On the scheduler a token is good for ``AuthorizeEndpoint`` only, and only for its own task:
every other RPC is PERMISSION_DENIED (:mod:`opentinker_scheduler.security.auth`).
"""

from __future__ import annotations

import hmac
import math
import re

from opentinker_common.signed_claims import decode_claims, encode_claims, signature
from opentinker_scheduler.errors import InvalidArgument
from opentinker_scheduler.security.keys import KeyStore, Principal, Unauthenticated

__all__ = ["DEFAULT_TTL_S", "ENDPOINT_ROLE", "MAX_TTL_S", "MIN_TTL_S", "PREFIX", "issue", "resolve"]

PREFIX = "ote_"
#: The role of a caller that sent an endpoint token.
ENDPOINT_ROLE = "endpoint"
DEFAULT_TTL_S = 3600.0
MIN_TTL_S = 1.0
MAX_TTL_S = 86400.0
#: Longest token accepted (characters); a longer one is refused before any decoding.
MAX_TOKEN_LENGTH = 512
_CONTEXT = b"opentinker endpoint token v1\n"
_TOKEN_RE = re.compile(r"^ote_([A-Za-z0-9_-]+)\.([A-Za-z0-9_-]{43})$")
_KEY_PREFIX_RE = re.compile(r"^otk_[0-9a-f]{8}$")
_BAD = "malformed endpoint token (expected ote_<payload>.<signature> as issued by IssueEndpointToken)"


def _signature(key_hash: str, payload: str) -> str:
    return signature(key_hash.encode(), payload, context=_CONTEXT)


def ttl_seconds(ttl_s: float) -> float:
    """The TTL to issue with: ``ttl_s``, or :data:`DEFAULT_TTL_S` for 0.

    Raises:
        InvalidArgument: outside [:data:`MIN_TTL_S`, :data:`MAX_TTL_S`] (field ``ttl``).
    """
    if ttl_s == 0:
        return DEFAULT_TTL_S
    if not MIN_TTL_S <= ttl_s <= MAX_TTL_S:
        raise InvalidArgument(f"ttl: expected {MIN_TTL_S:g} s to {MAX_TTL_S:g} s (24 h), got {ttl_s:g} s")
    return ttl_s


def issue(keys: KeyStore, who: Principal, task_id: str, ttl_s: float) -> tuple[str, float]:
    """A token of ``who`` (a caller with an API key) for task ``task_id``; returns it and its
    expiry in unix seconds. The caller checks first that ``who`` may use the task."""
    row = keys.get(who.key_prefix)
    expire = math.ceil(keys.clock() + ttl_seconds(ttl_s))
    payload = encode_claims({"k": row.prefix, "t": task_id, "e": expire})
    return f"{PREFIX}{payload}.{_signature(row.key_hash, payload)}", float(expire)


def resolve(keys: KeyStore, token: str) -> Principal:
    """The principal of an endpoint token: role :data:`ENDPOINT_ROLE`, the owner and prefix of the
    key that asked for it, ``endpoint_task`` its task, ``endpoint_admin`` whether that key is an
    admin's.

    Raises:
        Unauthenticated: malformed, badly signed, expired, or its API key is revoked or expired.
    """
    m = _TOKEN_RE.match(token) if len(token) <= MAX_TOKEN_LENGTH else None
    if m is None:
        raise Unauthenticated(_BAD)
    try:
        claims = decode_claims(m.group(1))
        prefix, task_id, expire = claims["k"], claims["t"], claims["e"]
    except (ValueError, TypeError, KeyError):
        raise Unauthenticated(_BAD) from None
    if not (isinstance(prefix, str) and _KEY_PREFIX_RE.match(prefix) and isinstance(task_id, str)):
        raise Unauthenticated(_BAD)
    if not isinstance(expire, int) or isinstance(expire, bool):
        raise Unauthenticated(_BAD)
    row = keys.find(prefix)
    if row is None or not hmac.compare_digest(_signature(row.key_hash, m.group(1)), m.group(2)):
        raise Unauthenticated("unknown endpoint token (its signature does not match; get a new one)")
    if keys.clock() >= expire:
        raise Unauthenticated(
            f"endpoint token for task {task_id} expired; get a new one (`opentinker endpoint-token {task_id}`)"
        )
    refusal = keys.refusal(prefix)
    if refusal is not None:
        raise Unauthenticated(f"endpoint token for task {task_id} no longer works: {refusal}")
    return Principal(row.owner, ENDPOINT_ROLE, row.prefix, endpoint_task=task_id, endpoint_admin=row.role == "admin")
