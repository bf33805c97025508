"""Checkpoints for clients: list a task's checkpoints and stream a checkpoint folder.

A checkpoint is a folder (for LoRA: ``adapter_config.json``, ``adapter_model.safetensors``,
``trainer_state.pt``). A download is a manifest (each file's relative path, size and SHA-256)
followed by each file's bytes in chunks of at most :data:`CHUNK_BYTES`, so no message comes near
gRPC's size limits whatever the checkpoint's size. A checkpoint with an ``artifact`` is read from
the artifact store (local or s3, :mod:`opentinker_scheduler.data.artifact_store`), with the hashes of
its stored manifest; one without (written by an older trainer) from its ``path`` on the
scheduler's own filesystem, where a folder the scheduler cannot see fails with FAILED_PRECONDITION.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from opentinker.common.v1 import common_pb2
from opentinker.scheduler.v1 import scheduler_pb2
from opentinker_common.artifacts.checkpoint_lists import SAMPLER_PREFIX, STATE_PREFIX, at_step, steps_text
from opentinker_common.artifacts.deleted import deleted_words

from opentinker_scheduler.errors import FailedPrecondition, InvalidArgument, NotFound

__all__ = [
    "CHUNK_BYTES",
    "list_checkpoints",
    "pick_checkpoint",
    "checkpoint_with_key",
    "build_manifest",
    "read_chunks",
    "Manifest",
]

#: Largest chunk of file data in one message (1 MiB).
CHUNK_BYTES = 1024 * 1024
#: Most files in one checkpoint folder that a download accepts.
MAX_FILES = 10_000


def list_checkpoints(store, task_id: str) -> list[common_pb2.Checkpoint]:
    """Checkpoints the task recorded, oldest first; a step written twice (a resumed attempt)
    appears once, as its newest record, and a training session's named saves once each per name
    (several may share a step); none from before its artifacts were deleted.

    Raises:
        InvalidArgument: empty id. NotFound: no such task.
    """
    if not task_id:
        raise InvalidArgument("task_id: expected a task id, got ''")
    if store.get_task(task_id) is None:
        raise NotFound(f"task {task_id[:80]!r}{'...' if len(task_id) > 80 else ''} not found")
    newest: dict[tuple[int, str], common_pb2.Checkpoint] = {}
    for ck in store.checkpoints(task_id):
        folder = Path(ck.path).name
        which = (ck.step, folder if folder.startswith((STATE_PREFIX, SAMPLER_PREFIX)) else "")
        newest.pop(which, None)
        newest[which] = ck
    return list(newest.values())


def pick_checkpoint(store, task_id: str, step: int) -> common_pb2.Checkpoint:
    """The task's checkpoint at ``step`` (0 = its newest).

    Raises:
        InvalidArgument: empty id or negative step. NotFound: no such task, no checkpoint (the
            message says when its artifacts were deleted, if they were), or none at ``step`` (the
            message lists the steps there are).
    """
    if step < 0:
        raise InvalidArgument(f"step: expected 0 (the newest) or a step >= 1, got {step}")
    task = store.get_task(task_id) if task_id else None
    cks = list_checkpoints(store, task_id)
    if not cks:
        deleted = store.artifacts_deleted(task_id)
        raise NotFound(f"task {task_id!r} has no checkpoint" + (f": {deleted_words(deleted)}" if deleted else ""))
    if step == 0:
        if task is not None and task.latest_checkpoint is not None and task.latest_checkpoint.path:
            return task.latest_checkpoint
        return cks[-1]
    found = at_step(cks, step)
    if found is not None:
        return found
    raise NotFound(f"task {task_id!r} has no checkpoint at step {step}; steps with one: {steps_text(cks)}")


def checkpoint_with_key(store, task_id: str, key: str) -> common_pb2.Checkpoint:
    """The task's listed checkpoint stored as artifact ``key``.

    Raises:
        InvalidArgument: empty id. NotFound: no such task, or no such checkpoint listed (deleted,
            or never saved).
    """
    for ck in list_checkpoints(store, task_id):
        if ck.artifact.key == key:
            return ck
    raise NotFound(f"artifact_key: task {task_id!r} has no checkpoint {key[:256]!r} (deleted, or never saved)")


@dataclass(frozen=True)
class Manifest:
    message: scheduler_pb2.CheckpointManifest
    paths: tuple[Path, ...]  # absolute, in manifest order (a folder on this filesystem)
    #: Bytes of file ``i`` from the artifact store, in chunks (None: read ``paths``).
    reader: Callable[[int], Iterator[bytes]] | None = None


def build_manifest(ckpt: common_pb2.Checkpoint, store=None) -> Manifest:
    """The checkpoint's files: from the artifact ``store`` when the checkpoint has an
    ``artifact`` (its stored manifest, checked against the recorded hash), else by walking and
    hashing its folder (blocking I/O: run in a thread).

    Raises:
        FailedPrecondition: the folder does not exist or is unreadable here, or holds too many files.
        ArtifactNotFound (NOT_FOUND), ArtifactCorrupt (DATA_LOSS), StoreUnavailable (UNAVAILABLE).
    """
    if ckpt.artifact.key and store is not None:
        m = store.manifest(ckpt.artifact.key, expect_sha256=ckpt.artifact.manifest_sha256)
        entries = [scheduler_pb2.CheckpointFile(path=f.path, size_bytes=f.size_bytes, sha256=f.sha256) for f in m.files]
        msg = scheduler_pb2.CheckpointManifest(checkpoint=ckpt, files=entries, total_bytes=m.total_bytes)
        return Manifest(msg, (), reader=lambda i: store.read_chunks(m, m.files[i]))
    root = Path(ckpt.path)
    if not root.is_dir():
        raise FailedPrecondition(
            f"checkpoint folder {ckpt.path} (step {ckpt.step}, written on node {ckpt.node_id or '?'}) is not readable "
            "from the scheduler; downloads need checkpoints on a filesystem the scheduler shares with the nodes"
        )
    files = []
    try:
        for p in sorted(root.rglob("*")):
            if p.is_symlink() or not p.is_file():
                continue
            files.append(p)
            if len(files) > MAX_FILES:
                raise FailedPrecondition(f"checkpoint folder {ckpt.path} holds more than {MAX_FILES} files")
        entries = []
        total = 0
        for p in files:
            digest = hashlib.sha256()
            size = 0
            with open(p, "rb") as f:
                while block := f.read(CHUNK_BYTES):
                    digest.update(block)
                    size += len(block)
            total += size
            entries.append(
                scheduler_pb2.CheckpointFile(
                    path=p.relative_to(root).as_posix(), size_bytes=size, sha256=digest.hexdigest()
                )
            )
    except OSError as exc:
        raise FailedPrecondition(
            f"checkpoint folder {ckpt.path} cannot be read by the scheduler: {exc.strerror or exc}"
        ) from None
    msg = scheduler_pb2.CheckpointManifest(checkpoint=ckpt, files=entries, total_bytes=total)
    return Manifest(msg, tuple(files))


def read_chunks(manifest: Manifest, *, chunk_bytes: int = CHUNK_BYTES) -> Iterator[scheduler_pb2.CheckpointChunk]:
    """Each file's bytes in manifest order, ``chunk_bytes`` at most per chunk (an empty file
    gives one empty chunk). Blocking reads: iterate in a thread.

    Raises:
        FailedPrecondition: a file changed size since the manifest was made.
    """
    if manifest.reader is not None:
        yield from _store_chunks(manifest, chunk_bytes)
        return
    for index, (path, entry) in enumerate(zip(manifest.paths, manifest.message.files)):
        offset = 0
        try:
            with open(path, "rb") as f:
                if entry.size_bytes == 0:
                    yield scheduler_pb2.CheckpointChunk(file_index=index, offset=0, data=b"")
                while offset < entry.size_bytes:
                    data = f.read(min(chunk_bytes, entry.size_bytes - offset))
                    if not data:
                        break
                    yield scheduler_pb2.CheckpointChunk(file_index=index, offset=offset, data=data)
                    offset += len(data)
        except OSError as exc:
            raise FailedPrecondition(f"checkpoint file {path} cannot be read: {exc.strerror or exc}") from None
        if offset != entry.size_bytes:
            raise FailedPrecondition(f"checkpoint file {path} changed while it was being downloaded; retry")


def _store_chunks(manifest: Manifest, chunk_bytes: int) -> Iterator[scheduler_pb2.CheckpointChunk]:
    assert manifest.reader is not None
    for index, entry in enumerate(manifest.message.files):
        offset = 0
        if entry.size_bytes == 0:
            yield scheduler_pb2.CheckpointChunk(file_index=index, offset=0, data=b"")
        for block in manifest.reader(index):
            for start in range(0, len(block), chunk_bytes):
                data = block[start : start + chunk_bytes]
                yield scheduler_pb2.CheckpointChunk(file_index=index, offset=offset, data=data)
                offset += len(data)
        if offset != entry.size_bytes:
            raise FailedPrecondition(f"checkpoint file {entry.path} changed in the artifact store while downloading")
