"""API key management over ``opentinker.scheduler.v1.AdminService`` (``RLClient.keys``).

::

    with RLClient(api_key=admin_key) as client:
        info, key = client.keys.create("alice", "user", description="alice's laptop")
        print(key)                       # otk_1a2b3c4d_...: shown once, give it to alice
        new, new_key, old = client.keys.rotate(info.prefix, grace=3600)   # old works one more hour
        client.keys.revoke(new.prefix)

Roles: ``admin`` (everything), ``user`` (its own tasks and keys), ``node`` (trainer nodes).
A user key may list, rotate and revoke its own owner's keys; creating keys needs an admin key.
Errors are the client's typed exceptions (``PermissionDeniedError``, ``NotFoundError`` ...).
"""

from __future__ import annotations

import datetime as _dt
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from opentinker.scheduler.v1 import admin_pb2
from opentinker_client._convert import timestamp_to_datetime
from opentinker_client.errors import InvalidArgumentError

if TYPE_CHECKING:
    from opentinker_client.connection import SchedulerConnection

__all__ = ["KeyAdmin", "ApiKeyInfo", "AuditRecord", "ROLES"]

ROLES = ("admin", "user", "node")
_ROLE_PB = {
    "admin": admin_pb2.API_KEY_ROLE_ADMIN,
    "user": admin_pb2.API_KEY_ROLE_USER,
    "node": admin_pb2.API_KEY_ROLE_NODE,
}
_PB_ROLE = {v: k for k, v in _ROLE_PB.items()}


@dataclass(frozen=True)
class ApiKeyInfo:
    """An API key's public record (never its secret)."""

    prefix: str
    owner: str
    role: str
    description: str
    active: bool
    create_time: _dt.datetime | None
    revoke_time: _dt.datetime | None
    expire_time: _dt.datetime | None
    replaced_by: str

    @classmethod
    def from_proto(cls, k: admin_pb2.ApiKey) -> "ApiKeyInfo":
        return cls(
            prefix=k.prefix,
            owner=k.owner,
            role=_PB_ROLE.get(k.role, "unspecified"),
            description=k.description,
            active=k.active,
            create_time=timestamp_to_datetime(k.create_time),
            revoke_time=timestamp_to_datetime(k.revoke_time),
            expire_time=timestamp_to_datetime(k.expire_time),
            replaced_by=k.replaced_by,
        )


@dataclass(frozen=True)
class AuditRecord:
    id: int
    time: _dt.datetime | None
    owner: str
    role: str
    key_prefix: str
    action: str
    task_id: str
    outcome: str
    detail: dict[str, Any]


class KeyAdmin:
    """Calls AdminService through the client's connection (its API key, the leader among
    several schedulers, an unreachable address explained as for every other call)."""

    def __init__(self, connection: SchedulerConnection) -> None:
        self._connection = connection

    def _call(self, name: str, request):
        # Creating or rotating a key is not idempotent: never sent twice.
        retry = name not in ("CreateApiKey", "RotateApiKey")
        return self._connection.unary(name, request, service="admin", retry=retry)

    def create(self, owner: str, role: str, *, description: str = "") -> tuple[ApiKeyInfo, str]:
        """A new key for ``owner`` with ``role``; returns (record, full key). Admin keys only."""
        if role not in _ROLE_PB:
            raise InvalidArgumentError(f"role: expected one of {', '.join(ROLES)}, got {role!r}", field="role")
        resp = self._call(
            "CreateApiKey", admin_pb2.CreateApiKeyRequest(owner=owner, role=_ROLE_PB[role], description=description)
        )
        return ApiKeyInfo.from_proto(resp.key), resp.api_key

    def list(self, *, owner: str = "", include_inactive: bool = False) -> list[ApiKeyInfo]:
        """Keys by prefix, oldest first (a user key sees its own owner's only)."""
        resp = self._call("ListApiKeys", admin_pb2.ListApiKeysRequest(owner=owner, include_inactive=include_inactive))
        return [ApiKeyInfo.from_proto(k) for k in resp.keys]

    def revoke(self, prefix: str) -> ApiKeyInfo:
        """Revoke now (idempotent). ``prefix`` may be a whole key."""
        return ApiKeyInfo.from_proto(self._call("RevokeApiKey", admin_pb2.RevokeApiKeyRequest(prefix=prefix)).key)

    def rotate(self, prefix: str, *, grace: float = 0.0) -> tuple[ApiKeyInfo, str, ApiKeyInfo]:
        """Replace a key; the old one works ``grace`` seconds more. Returns (new, new full key, old)."""
        req = admin_pb2.RotateApiKeyRequest(prefix=prefix)
        if grace:
            req.grace.FromNanoseconds(int(grace * 1e9))
        resp = self._call("RotateApiKey", req)
        return ApiKeyInfo.from_proto(resp.key), resp.api_key, ApiKeyInfo.from_proto(resp.old_key)

    def audit(self, *, limit: int = 100, action: str = "", before_id: int = 0) -> list[AuditRecord]:
        """Audit records, newest first. Admin keys only."""
        resp = self._call(
            "ListAuditEvents", admin_pb2.ListAuditEventsRequest(page_size=limit, action=action, before_id=before_id)
        )
        return [
            AuditRecord(
                e.id,
                timestamp_to_datetime(e.time),
                e.owner,
                e.role,
                e.key_prefix,
                e.action,
                e.task_id,
                e.outcome,
                json.loads(e.detail_json or "{}"),
            )
            for e in resp.events
        ]
