"""``opentinker.artifact.v1.ArtifactService``: a thin adapter over
:class:`~opentinker_scheduler.data.artifact_store.Artifacts`.

Blocking store calls run in threads; errors map to status codes in one table
(:func:`opentinker_scheduler.errors.status_code`).

Who may do what (roles: :mod:`opentinker_scheduler.security.auth`):

* ``admin``: everything.
* ``worker`` (a task worker's attempt credential): writes (BeginUpload, UploadChunks,
  CommitUpload) only keys under ``tasks/<task>/a<attempt>/`` of its own attempt, and only while
  that attempt is assigned to or running on its node, checked at every call (a fenced worker
  that heals after its attempt moved on lands nothing); reads (StatArtifact, DownloadArtifact,
  ListArtifacts, PresignDownload) only the tasks and datasets of its task's owner, and only while
  its attempt runs. A write elsewhere is PERMISSION_DENIED naming the key and the attempt; a read
  of another owner's artifact is NOT_FOUND, as a missing one.
* ``node`` (the agent's key): DescribeStore only; it neither writes nor reads artifacts (its
  workers, and a model host's tenants, hold their own credentials).

With the ``s3`` backend BeginUpload answers presigned PUT URLs and PresignDownload presigned GET
URLs: the same checks decide who gets one, and trainers hold no S3 credentials.

Committed artifacts are immutable for everyone (``ALREADY_EXISTS``; the same manifest again is a
success): :mod:`opentinker_common.artifacts.local`.
"""

from __future__ import annotations

import asyncio

import structlog

from opentinker.artifact.v1 import artifact_pb2, artifact_pb2_grpc

from opentinker_scheduler.api.rpc import Call, abort_mapped, rpc
from opentinker_scheduler.api.streams import read_ahead
from opentinker_scheduler.data.artifact_store import Artifacts
from opentinker_scheduler.errors import NotFound, PermissionDenied
from opentinker_scheduler.security.auth import Principal, caller
from opentinker_scheduler.security.bundle import Security
from opentinker_scheduler.state.worker_credentials import AttemptScope

log = structlog.get_logger("opentinker.scheduler")


class ArtifactService(artifact_pb2_grpc.ArtifactServiceServicer):
    def __init__(
        self,
        artifacts: Artifacts,
        *,
        security: Security | None = None,
        durable=None,
        require_leader=None,
        attempt_refusal=None,
        task_owner=None,
        dataset_visible=None,
    ) -> None:
        self.artifacts = artifacts
        self.security = security
        self._durable = durable
        #: Raises NotLeader on a follower of several schedulers: uploads go to the leader.
        self._require_leader = require_leader or (lambda: None)
        #: ``attempt_refusal(scope)``: why a worker's attempt may not write now, or None.
        self._attempt_refusal = attempt_refusal or (lambda scope: None)
        #: ``task_owner(task_id)``: the task's owner, or None when there is no such task.
        self._task_owner = task_owner or (lambda task_id: None)
        #: ``dataset_visible(dataset_id, owner)``: whether ``owner`` may use that dataset.
        self._dataset_visible = dataset_visible or (lambda dataset_id, owner: False)

    def _may_write(self, key: str) -> None:
        """Refuse a write of ``key`` by a caller that may not write it now.

        Raises:
            PermissionDenied: a node key, or a worker's key outside its attempt's prefix, or an
                attempt that ended or moved on (the message names the key and the attempt).
        """
        who = caller()
        if who.role == "node":
            raise PermissionDenied(
                f"{key}: API key {who.key_prefix} (role node) may not write artifacts; a task's worker writes "
                "its attempt's checkpoints with the attempt credential of its assignment"
            )
        scope = who.attempt
        if scope is None:
            return
        if not key.startswith(scope.artifact_prefix):
            raise PermissionDenied(
                f"{key}: the credential of {scope.describe()} may write only keys under {scope.artifact_prefix}"
            )
        refusal = self._attempt_refusal(scope)
        if refusal is not None:
            raise PermissionDenied(f"{key}: {refusal}; only the current attempt on its node writes its checkpoints")

    def _readable(self, key: str, who: Principal) -> bool:
        """Whether ``who`` may read ``key``: a worker reads the tasks and datasets (``datasets/<hex>``)
        of its task's owner."""
        scope: AttemptScope | None = who.attempt
        if scope is None:
            return True
        parts = key.split("/")
        if len(parts) == 2 and parts[0] == "datasets":
            return self._dataset_visible(f"sha256:{parts[1]}", scope.owner)
        return len(parts) > 1 and parts[0] == "tasks" and self._task_owner(parts[1]) == scope.owner

    def _may_read(self, key: str) -> None:
        """Refuse a read of ``key`` by a caller that may not read it.

        Raises:
            PermissionDenied: a node key (its workers read with their own credentials).
            NotFound: as for a missing artifact, another owner's artifact read by a worker.
        """
        who = caller()
        if who.role == "node":
            raise PermissionDenied(
                f"{key}: API key {who.key_prefix} (role node) may not read artifacts; a task's worker reads "
                "them with the attempt credential of its assignment"
            )
        self._attempt_live(who)
        if not self._readable(key, who):
            raise NotFound(f"artifact {key} not found")

    def _attempt_live(self, who: Principal) -> None:
        """Raises PermissionDenied when ``who`` is a task worker whose attempt has ended or moved on."""
        refusal = self._attempt_refusal(who.attempt) if who.attempt is not None else None
        if refusal is not None:
            raise PermissionDenied(f"{refusal}; its credential reads nothing more")

    async def durable(self) -> None:
        if self._durable is not None:
            await self._durable()

    @rpc()
    async def DescribeStore(self, request, call: Call):
        return self.artifacts.describe()

    @rpc()
    async def BeginUpload(self, request, call: Call):
        self._require_leader()
        cfg = self.security.limits.config if self.security is not None else None
        min_free = (cfg.min_free_disk_bytes or 0) if cfg is not None else 0
        self._may_write(request.manifest.key)
        return await asyncio.to_thread(self.artifacts.begin_upload, request, min_free_bytes=min_free)

    async def UploadChunks(self, request_iterator, context):
        upload_id, key = "", ""
        pending: asyncio.Future | None = None
        try:
            self._require_leader()
            # One chunk is written (appended and hashed, in a thread) while the next is received:
            # in order, at most one write in flight, a failed write ends the stream with its status.
            async for chunk in request_iterator:
                if pending is not None:
                    await pending
                if chunk.upload_id != upload_id:
                    key = await asyncio.to_thread(self.artifacts.upload_key, chunk.upload_id)
                self._may_write(key)  # every chunk: an attempt fenced mid-stream sends no more bytes
                upload_id = chunk.upload_id
                pending = asyncio.ensure_future(asyncio.to_thread(self.artifacts.write_chunk, chunk))
            if pending is not None:
                await pending
                pending = None
            if not upload_id:
                return artifact_pb2.UploadChunksResponse()
            return await asyncio.to_thread(self.artifacts.upload_status, upload_id)
        except Exception as exc:  # noqa: BLE001 - mapped or re-raised
            await abort_mapped(context, exc)
        finally:
            if pending is not None and not pending.done():
                # the stream broke while a chunk was being written: let that write finish, so
                # the next stream of this upload sees the bytes held when it asks
                await asyncio.gather(pending, return_exceptions=True)

    @rpc()
    async def CommitUpload(self, request, call: Call):
        self._require_leader()
        self._may_write(await asyncio.to_thread(self.artifacts.upload_key, request.upload_id))
        resp = await asyncio.to_thread(self.artifacts.commit_upload, request.upload_id)
        # Retention follows the trainer's report of the checkpoint (data/artifacts.py Retention).
        log.info("artifact stored", key=resp.manifest.key, total_bytes=resp.manifest.total_bytes)
        return resp

    @rpc()
    async def StatArtifact(self, request, call: Call):
        self._may_read(request.key)
        manifest = await asyncio.to_thread(self.artifacts.stat, request.key, request.expect_manifest_sha256)
        return artifact_pb2.StatArtifactResponse(manifest=manifest)

    @rpc()
    async def PresignDownload(self, request, call: Call):
        self._may_read(request.key)
        return await asyncio.to_thread(self.artifacts.presign_download, request.key, request.expect_manifest_sha256)

    async def DownloadArtifact(self, request, context):
        try:
            self._may_read(request.key)
            items = iter(self.artifacts.download(request.key, request.expect_manifest_sha256))
            async for item in read_ahead(items):
                yield item
        except Exception as exc:  # noqa: BLE001 - mapped or re-raised
            await abort_mapped(context, exc)

    @rpc()
    async def ListArtifacts(self, request, call: Call):
        if call.who.role == "node":
            self._may_read(request.prefix)  # refused
        self._attempt_live(call.who)
        keys = await asyncio.to_thread(self.artifacts.list, request.prefix)
        keys = [k for k in keys if self._readable(k, call.who)]
        return artifact_pb2.ListArtifactsResponse(keys=keys)
