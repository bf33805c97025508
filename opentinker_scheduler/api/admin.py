"""``opentinker.scheduler.v1.AdminService``: API keys, the audit log, quota queues and the scale
signal (see admin.proto for the contract). The :class:`~opentinker_scheduler.security.bundle.Security`
it serves is assembled by the server (:func:`~opentinker_scheduler.security.bundle.build_security`)."""

from __future__ import annotations

import json

from opentinker.scheduler.v1 import admin_pb2, admin_pb2_grpc

from opentinker_scheduler.api.rpc import Call, rpc
from opentinker_scheduler.config.queues import MAX_QUOTA, check_queue_name
from opentinker_scheduler.errors import FailedPrecondition, InvalidArgument, PermissionDenied
from opentinker_scheduler.policy.quota import QueueQuota
from opentinker_scheduler.security.audit import ACTIONS
from opentinker_scheduler.security.bundle import Security
from opentinker_scheduler.security.keys import KeyRow, KeyStore, Principal, key_prefix
from opentinker_scheduler.state.scale_signal import desired_trainers

_ROLE_TO_PB = {
    "admin": admin_pb2.API_KEY_ROLE_ADMIN,
    "user": admin_pb2.API_KEY_ROLE_USER,
    "node": admin_pb2.API_KEY_ROLE_NODE,
}
_PB_TO_ROLE = {v: k for k, v in _ROLE_TO_PB.items()}


def key_to_proto(row: KeyRow, now: float) -> admin_pb2.ApiKey:
    out = admin_pb2.ApiKey(
        prefix=row.prefix,
        owner=row.owner,
        role=_ROLE_TO_PB[row.role],
        description=row.description,
        active=row.active(now),
        replaced_by=row.replaced_by,
    )
    out.create_time.FromNanoseconds(int(row.create_time * 1e9))
    if row.revoke_time is not None:
        out.revoke_time.FromNanoseconds(int(row.revoke_time * 1e9))
    if row.expire_time is not None:
        out.expire_time.FromNanoseconds(int(row.expire_time * 1e9))
    return out


class AdminService(admin_pb2_grpc.AdminServiceServicer):
    """``opentinker.scheduler.v1.AdminService`` (see admin.proto for the contract)."""

    def __init__(self, security: Security, durable=None, core=None) -> None:
        self.security = security
        self._durable = durable
        #: The scheduler core (quota queues, desired trainers); None where only keys are served.
        self.core = core

    async def durable(self) -> None:
        if self._durable is not None:
            await self._durable()

    @property
    def keys(self) -> KeyStore:
        if self.security.keys is None:
            raise FailedPrecondition("API keys are off on this scheduler (auth.enabled: false in its config)")
        return self.security.keys

    @staticmethod
    def _scope(who: Principal) -> str | None:
        return None if who.is_admin else who.owner

    def _check_role(self, who: Principal, prefix: str, verb: str) -> None:
        """A non-admin key may manage only keys of its own role: a user key may not rotate (and so
        obtain) or revoke its owner's admin or node keys.

        Raises:
            NotFound: no such key of the caller's owner. PermissionDenied: a key of another role.
        """
        if who.is_admin:
            return
        row = self.keys.get(prefix, owner=who.owner)
        if row.role != who.role:
            raise PermissionDenied(
                f"API key {who.key_prefix} (role {who.role}) may not {verb} {prefix}, a key of role {row.role}: "
                f"only admin keys manage keys of other roles"
            )

    def _end_streams(self, row: KeyRow) -> None:
        """End the open streams of a key that just stopped (revoked), or schedule a re-check at
        the end of its grace period (rotated with a grace)."""
        streams = self.security.interceptor.streams
        if streams is None:
            return
        now = self.keys.clock()
        reason = row.refusal(now)
        if reason is not None:
            streams.end_key(row.prefix, reason)
        elif row.expire_time is not None:
            streams.recheck_after(row.expire_time - now)

    @rpc(action="key.create")
    async def CreateApiKey(self, request, call: Call):
        who = call.who
        call.detail.update(for_owner=request.owner[:128])
        if not who.is_admin:
            raise PermissionDenied(f"API key {who.key_prefix} (role {who.role}) may not create keys: admin keys only")
        role = _PB_TO_ROLE.get(request.role)
        if role is None:
            raise InvalidArgument("role: expected API_KEY_ROLE_ADMIN, API_KEY_ROLE_USER or API_KEY_ROLE_NODE")
        row, api_key = self.keys.create(request.owner, role, request.description)
        call.detail.update(target=row.prefix, for_owner=row.owner, target_role=row.role)
        return admin_pb2.CreateApiKeyResponse(key=key_to_proto(row, self.keys.clock()), api_key=api_key)

    @rpc()
    async def ListApiKeys(self, request, call: Call):
        who = call.who
        owner = self._scope(who)
        if request.owner and owner is None:
            owner = request.owner
        elif request.owner and request.owner != owner:  # never silently answer with the caller's own keys
            raise PermissionDenied(
                f"API key {who.key_prefix} (role {who.role}) may not list the keys of another owner: "
                "user keys list their own owner's keys only (leave owner empty)"
            )
        rows = self.keys.list(owner=owner, include_inactive=request.include_inactive)
        now = self.keys.clock()
        return admin_pb2.ListApiKeysResponse(keys=[key_to_proto(r, now) for r in rows])

    @rpc(action="key.revoke")
    async def RevokeApiKey(self, request, call: Call):
        who = call.who
        prefix = key_prefix(request.prefix)
        call.detail.update(target=prefix)
        self._check_role(who, prefix, "revoke")
        row = self.keys.revoke(prefix, owner=self._scope(who))
        call.detail.update(for_owner=row.owner)
        self._end_streams(row)
        return admin_pb2.RevokeApiKeyResponse(key=key_to_proto(row, self.keys.clock()))

    @rpc(action="key.rotate")
    async def RotateApiKey(self, request, call: Call):
        who = call.who
        prefix = key_prefix(request.prefix)
        grace = request.grace.ToNanoseconds() / 1e9 if request.HasField("grace") else 0.0
        call.detail.update(target=prefix)
        self._check_role(who, prefix, "rotate")
        new, api_key, old = self.keys.rotate(prefix, grace_s=grace, owner=self._scope(who))
        call.detail.update(new_key=new.prefix, for_owner=new.owner, grace_s=grace)
        self._end_streams(old)
        now = self.keys.clock()
        return admin_pb2.RotateApiKeyResponse(
            key=key_to_proto(new, now), api_key=api_key, old_key=key_to_proto(old, now)
        )

    @rpc()
    async def ListAuditEvents(self, request, call: Call):
        who = call.who
        if not who.is_admin:
            raise PermissionDenied(
                f"API key {who.key_prefix} (role {who.role}) may not read the audit log: admin keys only"
            )
        size = request.page_size or 100
        if not 1 <= size <= 1000:
            raise InvalidArgument(f"page_size: expected 1..1000, got {request.page_size}")
        if request.action and request.action not in ACTIONS:
            raise InvalidArgument(f"action: expected one of {', '.join(ACTIONS)}, got {request.action[:40]!r}")
        out = []
        for rec in self.security.audit.list(limit=size, before_id=max(0, request.before_id), action=request.action):
            ev = admin_pb2.AuditEvent(
                id=rec.id,
                owner=rec.owner,
                role=rec.role,
                key_prefix=rec.key_prefix,
                action=rec.action,
                task_id=rec.task_id,
                outcome=rec.outcome,
                detail_json=json.dumps(rec.detail, sort_keys=True),
            )
            ev.time.FromNanoseconds(int(rec.time * 1e9))
            out.append(ev)
        return admin_pb2.ListAuditEventsResponse(events=out)

    # ------------------------------------------------------------------ quota queues
    def _core(self):
        if self.core is None:
            raise FailedPrecondition("quota queues are not served here")
        return self.core

    @staticmethod
    def _no_node(who: Principal, what: str) -> None:
        if who.role == "node":
            raise PermissionDenied(f"API key {who.key_prefix} (role node) may not {what}: admin and user keys only")

    @rpc()
    async def ListQueues(self, request, call: Call):
        self._no_node(call.who, "list queues")
        core = self._core()
        usage = core.usage.rollup(core.active.values())[1]
        queues = [queue_to_proto(core, row, usage.get(row[0])) for row in core.queues.rows(refresh=not core.leading)]
        if not call.who.is_admin:
            queues = [q for q in queues if _private_view(q, call.who.owner)]
        return admin_pb2.ListQueuesResponse(queues=queues)

    @rpc(action="queue.set")
    async def SetQueueQuota(self, request, call: Call):
        who = call.who
        q = request.queue
        call.detail.update(queue=q.name[:64])
        if not who.is_admin:
            raise PermissionDenied(
                f"API key {who.key_prefix} (role {who.role}) may not change quota queues: admin keys only"
            )
        quota = quota_from_proto(q)
        core = self._core()
        before = core.queues.set_queue(quota, by=who.owner)
        call.detail.update(
            gpus=quota.gpus,
            cpu_tasks=quota.cpu_tasks,
            borrowing_gpus=quota.borrowing_gpus,
            borrowing_cpu_tasks=quota.borrowing_cpu_tasks,
            owners=list(quota.owners),
            previous=None if before is None else {"gpus": before.gpus, "cpu_tasks": before.cpu_tasks},
        )
        rows = {row[0]: row for row in core.queues.rows(refresh=not core.leading)}
        out = admin_pb2.SetQueueQuotaResponse(
            queue=queue_to_proto(core, rows[quota.name], core.usage.rollup(core.active.values())[1].get(quota.name))
        )
        if before is not None:
            out.previous.CopyFrom(_quota_proto(before))
        return out

    @rpc(action="queue.reset")
    async def ResetQueueQuota(self, request, call: Call):
        who = call.who
        call.detail.update(queue=request.name[:64])
        if not who.is_admin:
            raise PermissionDenied(
                f"API key {who.key_prefix} (role {who.role}) may not change quota queues: admin keys only"
            )
        bad = check_queue_name(request.name)
        if bad:
            raise InvalidArgument(f"name: expected {bad}, got {request.name[:80]!r}")
        core = self._core()
        now, removed = core.queues.reset_queue(request.name)
        call.detail.update(
            removed=None
            if removed is None
            else {"gpus": removed.gpus, "cpu_tasks": removed.cpu_tasks, "owners": list(removed.owners)},
            now=None if now is None else {"gpus": now.gpus, "cpu_tasks": now.cpu_tasks, "owners": list(now.owners)},
        )
        out = admin_pb2.ResetQueueQuotaResponse()
        if removed is not None:
            out.removed.CopyFrom(
                _quota_proto(
                    QueueQuota(
                        removed.name,
                        removed.gpus,
                        removed.cpu_tasks,
                        removed.borrowing_gpus,
                        removed.borrowing_cpu_tasks,
                        removed.owners,
                    )  # fmt: skip
                )
            )
            out.removed.overridden = True
            _stamp(out.removed, removed)
        rows = {row[0]: row for row in core.queues.rows(refresh=not core.leading)}
        if now is not None and request.name in rows:
            out.queue.CopyFrom(
                queue_to_proto(core, rows[request.name], core.usage.rollup(core.active.values())[1].get(request.name))
            )
        return out

    @rpc()
    async def GetDesiredTrainers(self, request, call: Call):
        self._no_node(call.who, "read the scale signal")
        core = self._core()
        return admin_pb2.GetDesiredTrainersResponse(
            node_classes=[
                admin_pb2.NodeClassDemand(
                    node_class=d.node_class,
                    desired_trainers=d.desired,
                    connected_trainers=d.connected,
                    pending_gpus=d.pending_gpus,
                )
                for d in desired_trainers(core.config, core.ledger, core.queue, core.queues.book)
            ]
        )


def quota_from_proto(q: admin_pb2.Queue) -> QueueQuota:
    """A queue's quota from a request, checked field by field.

    Raises:
        InvalidArgument: naming the field (``queue.name``, ``queue.gpu_quota`` ...).
    """
    bad = check_queue_name(q.name)
    if bad:
        raise InvalidArgument(f"queue.name: expected {bad}, got {q.name[:80]!r}")
    for name in ("gpu_quota", "cpu_task_quota", "gpu_borrowing_limit", "cpu_task_borrowing_limit"):
        value = getattr(q, name)
        if not 0 <= value <= MAX_QUOTA:
            raise InvalidArgument(f"queue.{name}: expected 0..{MAX_QUOTA}, got {value}")
    for i, owner in enumerate(q.owners):
        if not owner or len(owner) > 128:
            raise InvalidArgument(f"queue.owners[{i}]: expected an owner of 1 to 128 characters")
    return QueueQuota(
        q.name,
        q.gpu_quota,
        q.cpu_task_quota,
        q.gpu_borrowing_limit if q.HasField("gpu_borrowing_limit") else None,
        q.cpu_task_borrowing_limit if q.HasField("cpu_task_borrowing_limit") else None,
        tuple(dict.fromkeys(q.owners)),
    )


def _private_view(queue: admin_pb2.Queue, owner: str) -> admin_pb2.Queue | None:
    """``queue`` as a user key ``owner`` may see it: configured queues with their totals, other
    owners' names removed (owners, who set an override); an owner's own queue only when it is
    ``owner``'s (it is named after its owner). None: not shown."""
    if not queue.limited and queue.name != owner:
        return None
    for q in (queue, queue.configured):
        kept = [o for o in q.owners if o == owner]
        del q.owners[:]
        q.owners.extend(kept)
    if queue.override_by != owner:
        queue.ClearField("override_by")
    return queue


def _quota_proto(quota: QueueQuota) -> admin_pb2.Queue:
    out = admin_pb2.Queue(
        name=quota.name,
        gpu_quota=quota.gpus,
        cpu_task_quota=quota.cpu_tasks,
        owners=list(quota.owners),
        limited=True,
    )
    if quota.borrowing_gpus is not None:
        out.gpu_borrowing_limit = quota.borrowing_gpus
    if quota.borrowing_cpu_tasks is not None:
        out.cpu_task_borrowing_limit = quota.borrowing_cpu_tasks
    return out


def _stamp(out: admin_pb2.Queue, override) -> None:
    """When and by whom a runtime override (``QueueOverride``) was set."""
    out.override_time.FromNanoseconds(int(override.set_time * 1e9))
    out.override_by = override.set_by


def queue_to_proto(core, row, usage=None) -> admin_pb2.Queue:
    """One row of :meth:`~opentinker_scheduler.state.quota_queues.QuotaQueues.rows` as a ``Queue``,
    with the per-owner limits, the accounted usage, the config's values and the runtime override
    (when and by whom)."""
    name, quota, (gpus, cpu_tasks), pending, share = row
    out = _quota_proto(quota) if quota is not None else admin_pb2.Queue(name=name, limited=False)
    out.gpus_in_use, out.cpu_tasks_in_use, out.pending_tasks = gpus, cpu_tasks, pending
    out.dominant_share = share if share != float("inf") else 1e9
    limits = core.config.limits.resolved(auth_enabled=core.config.auth.enabled)
    own = next((q for q in core.config.queues if q.name == name), None)  # queues[i].limits override them

    def pick(key: str, default):
        mine = getattr(own, key) if own is not None else None
        return default if mine is None else mine

    if own is not None:
        out.configured.CopyFrom(
            _quota_proto(
                QueueQuota(own.name, own.gpus, own.cpu_tasks, own.borrowing_gpus, own.borrowing_cpu_tasks, own.owners)
            )
        )
    override = core.queues.override(name)
    if override is not None:
        out.overridden = True
        _stamp(out, override)
    out.max_pending_per_owner = pick("max_pending_per_owner", limits.max_pending_per_owner) or 0
    out.submit_rate = pick("submit_rate", limits.submit_rate) or 0.0
    out.submit_burst = pick("submit_burst", limits.submit_burst) or 0
    if usage is not None:
        out.usage.CopyFrom(usage)
    return out
