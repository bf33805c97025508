"""The scheduler's artifact store: opening it, what the ArtifactService does over it, retention.

Backends (``artifacts.backend`` in the config, :mod:`opentinker_scheduler.config.artifacts`):
``local`` keeps artifacts under ``<state_dir>/artifacts`` and receives trainers' uploads over
``opentinker.artifact.v1.ArtifactService``; ``s3`` names a bucket only the scheduler holds
credentials for: it presigns each trainer's PUTs and GETs after the ArtifactService's checks,
commits uploads itself, reads the bucket for client downloads and deletes from it (retention).

Retention (:func:`retention_plan`, run by :class:`Retention` after every checkpoint a trainer
reports, on both backends): per task, every final checkpoint and the newest
``keep_checkpoints`` others (latest attempt, then highest step) stay; the rest are deleted.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import shutil
import time
from pathlib import Path
from typing import Iterable, Iterator

import structlog
from opentinker.artifact.v1 import artifact_pb2

from opentinker_common.artifacts import (
    ArtifactCorrupt,
    ArtifactError,
    ArtifactNotFound,
    ArtifactStore,
    InvalidArtifact,
    LocalArtifactStore,
    S3ArtifactStore,
    S3Location,
)
from opentinker_common.artifacts.manifest import CHUNK_BYTES, MAX_KEY_CHARS
from opentinker_common.artifacts.remote import manifest_from_proto, manifest_to_proto
from opentinker_common.artifacts.s3 import PresignedRequest

from opentinker_scheduler.config import SchedulerConfig
from opentinker_scheduler.config.artifacts import ArtifactsConfig
from opentinker_scheduler.errors import FailedPrecondition, InvalidArgument, ResourceExhausted

__all__ = ["ArtifactStartError", "open_artifact_store", "Artifacts", "Expiry", "Retention", "retention_plan"]

log = structlog.get_logger("opentinker.scheduler")

_CKPT_KEY = re.compile(r"tasks/(?P<task>[^/]+)/a(?P<attempt>\d+)/(?P<kind>step|final)_(?P<step>\d+)")


class ArtifactStartError(OSError):
    """The configured artifact store cannot be used: the scheduler does not start."""


def open_artifact_store(config: SchedulerConfig) -> ArtifactStore:
    """The configured store, checked: an ``s3`` store must answer and accept the credentials.

    Raises:
        ArtifactStartError: naming the endpoint and what is wrong (never a secret).
    """
    cfg = config.artifacts
    try:
        if cfg.backend == "s3":
            assert cfg.s3 is not None
            store: ArtifactStore = S3ArtifactStore(
                S3Location(bucket=cfg.s3.bucket, endpoint=cfg.s3.endpoint, prefix=cfg.s3.prefix, region=cfg.s3.region),
                connect_timeout_s=5,
                max_attempts=2,
                multipart_part_bytes=cfg.s3.multipart_part_bytes,
            )
        else:
            store = LocalArtifactStore(Path(config.state_dir) / "artifacts")
        store.check()
    except ArtifactError as exc:
        raise ArtifactStartError(f"artifact store ({cfg.backend}) cannot be used: {exc}") from None
    return store


class Artifacts:
    """The store and its settings, as the ArtifactService and DownloadCheckpoint use them.
    Every method blocks (file or network I/O): call it in a thread."""

    def __init__(self, store: ArtifactStore, config: ArtifactsConfig) -> None:
        self.store = store
        self.config = config

    @property
    def local(self) -> LocalArtifactStore:
        if not isinstance(self.store, LocalArtifactStore):
            raise FailedPrecondition(
                f"the artifact store is {self.store.backend} ({self.store.describe()}): "
                "trainers PUT the files to the URLs BeginUpload presigns, not through the scheduler"
            )
        return self.store

    @property
    def presign_expires_s(self) -> int:
        return self.config.s3.presign_expires_s if self.config.s3 is not None else 900

    @property
    def upload_idle_s(self) -> float:
        """Seconds after which a presigned upload nobody resumed is abandoned: twice the life
        of its URLs, so no URL of it is valid any more."""
        return 2.0 * self.presign_expires_s

    def abort_abandoned_uploads(self) -> list[str]:
        """Drop the ``s3`` store's presigned uploads in parts idle for :attr:`upload_idle_s`
        (their parts aborted); the upload ids dropped. Nothing for the ``local`` store."""
        if not isinstance(self.store, S3ArtifactStore):
            return []
        return self.store.abort_abandoned_uploads(self.upload_idle_s)

    def describe(self) -> artifact_pb2.DescribeStoreResponse:
        resp = artifact_pb2.DescribeStoreResponse(
            backend=self.config.backend,
            checkpoint_retries=self.config.checkpoint_retries,
            max_failed_checkpoints=self.config.max_failed_checkpoints,
        )
        if self.config.s3 is not None:
            s3 = self.config.s3
            resp.s3.CopyFrom(
                artifact_pb2.S3Location(endpoint=s3.endpoint, bucket=s3.bucket, prefix=s3.prefix, region=s3.region)
            )
        return resp

    def begin_upload(
        self, request: artifact_pb2.BeginUploadRequest, *, min_free_bytes: int = 0
    ) -> artifact_pb2.BeginUploadResponse:
        """Announce a checkpoint upload (idempotent: a resumed one says what is held).

        Refused before any byte is sent when the bytes still to come would leave less than
        ``min_free_bytes`` (``limits.min_free_disk_bytes``) free on the store's disk, as a dataset
        upload is: a full disk mid-upload would fail it after the transfer.

        Raises:
            ResourceExhausted: ``manifest: 209715200 bytes still to upload would leave less than
                1073741824 bytes free on the scheduler's artifact disk (524288000 bytes free)
                (limits.min_free_disk_bytes)``. InvalidArtifact: a bad manifest.
        """
        m = manifest_from_proto(request.manifest)
        if isinstance(self.store, S3ArtifactStore):
            s3 = self.store.begin_upload(m, expires_s=self.presign_expires_s)
            return artifact_pb2.BeginUploadResponse(
                upload_id=s3.upload_id,
                received_bytes=s3.received_bytes,
                committed=s3.committed,
                puts=[_presigned(p) for p in s3.puts],
            )
        status = self.local.begin_upload(m)
        needed = sum(f.size_bytes for f in m.files) - sum(status.received_bytes)
        if not status.committed and needed > 0:
            free = shutil.disk_usage(self.local.root).free
            if free - needed < min_free_bytes:
                raise ResourceExhausted(
                    f"manifest: {needed} bytes still to upload would leave less than {min_free_bytes} bytes free "
                    f"on the scheduler's artifact disk ({free} bytes free) (limits.min_free_disk_bytes); "
                    f"{m.key} was not stored"
                )
        return artifact_pb2.BeginUploadResponse(
            upload_id=status.upload_id, received_bytes=status.received_bytes, committed=status.committed
        )

    def write_chunk(self, chunk: artifact_pb2.UploadChunksRequest) -> None:
        data = chunk.data  # each read of a bytes field copies it
        if len(data) > CHUNK_BYTES:
            raise InvalidArgument(f"data: expected at most {CHUNK_BYTES} bytes a chunk, got {len(data)}")
        self.local.write_chunk(chunk.upload_id, chunk.file_index, chunk.offset, data)

    def upload_key(self, upload_id: str) -> str:
        """The key an announced upload will commit (ArtifactNotFound: unknown upload)."""
        if isinstance(self.store, S3ArtifactStore):
            return self.store.upload_manifest(upload_id).key
        return self.local.upload_key(upload_id)

    def upload_status(self, upload_id: str) -> artifact_pb2.UploadChunksResponse:
        return artifact_pb2.UploadChunksResponse(received_bytes=self.local.upload_status(upload_id).received_bytes)

    def commit_upload(self, upload_id: str) -> artifact_pb2.CommitUploadResponse:
        if isinstance(self.store, S3ArtifactStore):
            ref = self.store.commit_upload(upload_id)
        else:
            ref = self.local.commit_upload(upload_id)
        return artifact_pb2.CommitUploadResponse(manifest=manifest_to_proto(self.store.manifest(ref.key)))

    def stat(self, key: str, expect_sha256: str = "") -> artifact_pb2.ArtifactManifest:
        return manifest_to_proto(self.store.manifest(key, expect_sha256=expect_sha256))

    def presign_download(self, key: str, expect_sha256: str = "") -> artifact_pb2.PresignDownloadResponse:
        """The manifest of ``key`` and a presigned GET for each of its files.

        Raises:
            FailedPrecondition: the store is not ``s3`` (DownloadArtifact streams it). ArtifactNotFound,
                ArtifactCorrupt: as :meth:`stat`.
        """
        if not isinstance(self.store, S3ArtifactStore):
            raise FailedPrecondition(
                f"the artifact store is {self.store.backend} ({self.store.describe()}): "
                "download through DownloadArtifact"
            )
        m = self.store.manifest(key, expect_sha256=expect_sha256)
        gets = self.store.presign_get(m, expires_s=self.presign_expires_s)
        return artifact_pb2.PresignDownloadResponse(manifest=manifest_to_proto(m), gets=[_presigned(g) for g in gets])

    def download(self, key: str, expect_sha256: str = "") -> Iterator[artifact_pb2.DownloadArtifactResponse]:
        """Manifest, then each file's bytes (blocking: iterate in a thread)."""
        m = self.store.manifest(key, expect_sha256=expect_sha256)
        yield artifact_pb2.DownloadArtifactResponse(manifest=manifest_to_proto(m))
        for index, entry in enumerate(m.files):
            offset = 0
            if entry.size_bytes == 0:
                yield artifact_pb2.DownloadArtifactResponse(chunk=artifact_pb2.ArtifactChunk(file_index=index))
            for data in self.store.read_chunks(m, entry):
                yield artifact_pb2.DownloadArtifactResponse(
                    chunk=artifact_pb2.ArtifactChunk(file_index=index, offset=offset, data=data)
                )
                offset += len(data)

    def list(self, prefix: str) -> list[str]:
        if len(prefix) > MAX_KEY_CHARS:
            raise InvalidArtifact(f"prefix: expected at most {MAX_KEY_CHARS} characters, got {len(prefix)}")
        return self.store.list(prefix)

    def apply_retention(self, task_id: str | None = None) -> list[str]:
        """Delete what :func:`retention_plan` says, for one task or all; returns the keys deleted."""
        keys = self.store.list(f"tasks/{task_id}/" if task_id else "tasks/")
        doomed = retention_plan(keys, self.config.keep_checkpoints)
        for key in doomed:
            self.store.delete(key)
        return doomed

    def delete_task(self, task_id: str) -> tuple[list[str], int]:
        """Delete every artifact of ``task_id`` (``DeleteTaskArtifacts``).

        Returns:
            The keys deleted (sorted) and their bytes, all files together.

        Raises:
            InvalidArgument: a task id that cannot be part of a key. StoreUnavailable,
                StoreAuthError: the store cannot be used (what was deleted so far stays deleted;
                a second call finishes the rest).
        """
        if not task_id or "/" in task_id or task_id.startswith("."):
            raise InvalidArgument(f"task_id: expected a task id, got {task_id[:80]!r}")
        keys = self.store.list(f"tasks/{task_id}/")
        total = 0
        for key in keys:
            with contextlib.suppress(ArtifactNotFound, ArtifactCorrupt):
                total += self.store.manifest(key).total_bytes
            self.store.delete(key)
        return keys, total

    def delete_checkpoint(self, key: str) -> int:
        """Delete the checkpoint artifact ``key`` (``DeleteCheckpoint``); returns its bytes, all
        files together (0 when its manifest cannot be read).

        Raises:
            StoreUnavailable, StoreAuthError: the store cannot be used.
        """
        size = 0
        with contextlib.suppress(ArtifactNotFound, ArtifactCorrupt):
            size = self.store.manifest(key).total_bytes
        self.store.delete(key)
        return size


def _presigned(p: PresignedRequest) -> artifact_pb2.PresignedRequest:
    return artifact_pb2.PresignedRequest(
        file_index=p.file_index,
        method=p.method,
        url=p.url,
        headers=p.headers,
        expires_unix_s=p.expires_unix_s,
        offset=p.offset,
    )


class Retention:
    """Applies retention to a task after each of its checkpoints is recorded (a listener of
    :attr:`~opentinker_scheduler.state.node_protocol.NodeProtocol.checkpoint_listeners`), on
    either backend: the store's listing and deletes run in a thread, never on the event loop. A
    store that cannot be reached is logged and left as it is; the next checkpoint tries again."""

    def __init__(self, artifacts: Artifacts, on_retired=None) -> None:
        self.artifacts = artifacts
        #: ``on_retired(task_id, keys)``, on the event loop after a run deleted ``keys`` (the core
        #: records them, so the task's checkpoint list leaves them out).
        self.on_retired = on_retired
        self._jobs: set[asyncio.Task] = set()
        #: Keys deleted so far, for logs and tests.
        self.retired = 0

    def __call__(self, task_id: str, checkpoint=None) -> None:
        job = asyncio.get_running_loop().create_task(self._run(task_id))
        self._jobs.add(job)
        job.add_done_callback(self._jobs.discard)

    async def _run(self, task_id: str) -> None:
        try:
            doomed = await asyncio.to_thread(self.artifacts.apply_retention, task_id)
        except ArtifactError as exc:
            log.warning("checkpoint retention failed; the next checkpoint tries again", task_id=task_id, error=str(exc))
            return
        if doomed:
            self.retired += len(doomed)
            log.info("checkpoints retired", task_id=task_id, keys=doomed, store=self.artifacts.store.describe())
            if self.on_retired is not None:
                try:
                    self.on_retired(task_id, doomed)
                except Exception as exc:  # noqa: BLE001 - the store's state write; the keys are gone anyway
                    log.warning("retired checkpoints not recorded", task_id=task_id, error=str(exc))

    async def drain(self) -> None:
        """Wait for the retention runs started so far."""
        while self._jobs:
            await asyncio.gather(*list(self._jobs), return_exceptions=True)


class Expiry:
    """Deletes what has expired, in a thread each:

    * checkpoints whose expiry has come (``SetCheckpointTtl``), checked every ``interval_s``:
      ``expired(now)`` names them (``[(task id, key)]``, none on a follower), the store deletes
      each, and ``on_deleted(task_id, key, size_bytes=..., by="ttl")`` records it;
    * presigned uploads in parts that were abandoned (:meth:`Artifacts.abort_abandoned_uploads`),
      every ``min(60, presign_expires_s)`` seconds: the bucket keeps none of their parts.

    A store that cannot be reached is logged; the next round tries again."""

    def __init__(self, artifacts: Artifacts, expired, on_deleted, *, interval_s: float = 0.5) -> None:
        self.artifacts = artifacts
        self.expired = expired
        self.on_deleted = on_deleted
        self.interval_s = interval_s
        self.uploads_interval_s = min(60.0, float(artifacts.presign_expires_s))

    async def run(self) -> None:
        next_uploads = time.monotonic() + self.uploads_interval_s
        while True:
            try:
                for task_id, key in self.expired(time.time()):
                    size = await asyncio.to_thread(self.artifacts.delete_checkpoint, key)
                    self.on_deleted(task_id, key, size_bytes=size, by="ttl")
                    log.info("checkpoint expired and deleted", task_id=task_id, key=key, bytes=size)
                if time.monotonic() >= next_uploads:
                    next_uploads = time.monotonic() + self.uploads_interval_s
                    dropped = await asyncio.to_thread(self.artifacts.abort_abandoned_uploads)
                    if dropped:
                        log.info("abandoned uploads dropped, their parts aborted", upload_ids=dropped)
            except ArtifactError as exc:
                log.warning("expired artifact or upload not deleted; the next round tries again", error=str(exc))
            except Exception:  # noqa: BLE001 - keep sweeping; the error is logged
                log.exception("checkpoint expiry failed")
            await asyncio.sleep(self.interval_s)


def retention_plan(keys: Iterable[str], keep: int) -> list[str]:
    """Checkpoint keys to delete: per task, all but its final checkpoints and its ``keep``
    newest others. Newest means the latest attempt, then the highest step: a later attempt
    resumed from an earlier one's checkpoint, so its checkpoints came after all of that
    attempt's (even at lower steps, when it resumed from an older one). Keys of another shape
    are never deleted."""
    per_task: dict[str, list[tuple[int, int, str]]] = {}
    for key in keys:
        m = _CKPT_KEY.fullmatch(key)
        if m is None or m["kind"] == "final":
            continue
        per_task.setdefault(m["task"], []).append((int(m["attempt"]), int(m["step"]), key))
    doomed: list[str] = []
    for items in per_task.values():
        items.sort()
        doomed.extend(key for _, _, key in items[: max(0, len(items) - keep)])
    return sorted(doomed)
