"""``opentinker.artifact.v1.ArtifactService``: a thin adapter over
:class:`~opentinker_scheduler.data.artifacts.Artifacts`.

Blocking store calls run in threads; errors map to status codes in one table
(:func:`opentinker_scheduler.errors.status_code`). The node role (or admin) only
(:mod:`opentinker_scheduler.security.auth`).
"""

from __future__ import annotations

import asyncio

import structlog

from opentinker.artifact.v1 import artifact_pb2, artifact_pb2_grpc

from opentinker_scheduler.api.rpc import Call, abort_mapped, rpc
from opentinker_scheduler.api.streams import read_ahead
from opentinker_scheduler.data.artifacts import Artifacts
from opentinker_scheduler.security.bundle import Security

log = structlog.get_logger("opentinker.scheduler")


class ArtifactService(artifact_pb2_grpc.ArtifactServiceServicer):
    def __init__(
        self, artifacts: Artifacts, *, security: Security | None = None, durable=None, require_leader=None
    ) -> None:
        self.artifacts = artifacts
        self.security = security
        self._durable = durable
        #: Raises NotLeader on a follower of several schedulers: uploads go to the leader.
        self._require_leader = require_leader or (lambda: None)

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
        return await asyncio.to_thread(self.artifacts.begin_upload, request, min_free_bytes=min_free)

    async def UploadChunks(self, request_iterator, context):
        upload_id = ""
        pending: asyncio.Future | None = None
        try:
            self._require_leader()
            # One chunk is written (appended and hashed, in a thread) while the next is received:
            # in order, at most one write in flight, a failed write ends the stream with its status.
            async for chunk in request_iterator:
                if pending is not None:
                    await pending
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
        resp = await asyncio.to_thread(self.artifacts.commit_upload, request.upload_id)
        # Retention follows the trainer's report of the checkpoint (data/artifacts.py Retention).
        log.info("artifact stored", key=resp.manifest.key, total_bytes=resp.manifest.total_bytes)
        return resp

    @rpc()
    async def StatArtifact(self, request, call: Call):
        manifest = await asyncio.to_thread(self.artifacts.stat, request.key, request.expect_manifest_sha256)
        return artifact_pb2.StatArtifactResponse(manifest=manifest)

    async def DownloadArtifact(self, request, context):
        try:
            items = iter(self.artifacts.download(request.key, request.expect_manifest_sha256))
            async for item in read_ahead(items):
                yield item
        except Exception as exc:  # noqa: BLE001 - mapped or re-raised
            await abort_mapped(context, exc)

    @rpc()
    async def ListArtifacts(self, request, call: Call):
        keys = await asyncio.to_thread(self.artifacts.list, request.prefix)
        return artifact_pb2.ListArtifactsResponse(keys=keys)
