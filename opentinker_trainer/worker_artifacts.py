"""How a task worker uses the artifact store: the node-local cache, checkpoint publishing, resume.

* :func:`open_worker_store` asks the scheduler where artifacts live (``ArtifactService.DescribeStore``)
  and returns the store to use, :class:`~opentinker_common.artifacts.remote.RemoteArtifactStore`
  with the attempt's credential: the scheduler's ``local`` store over gRPC, or its ``s3`` bucket
  by the URLs the scheduler presigns (the worker holds no S3 credentials). None when the worker
  has no scheduler (a bare worker run).
* :class:`ArtifactCache` keeps downloaded artifacts under ``<work_dir>/artifact-cache`` keyed by their
  manifest SHA-256, bounded in bytes, least recently used out first. A checkpoint this node wrote is
  put in the cache as it is published, so a resume on the same node downloads nothing.
* :class:`CheckpointPublisher` puts every checkpoint folder into the store before it is reported
  (retries with backoff 1, 2, 4 ... s). A periodic checkpoint that cannot be stored is skipped
  (training goes on) until ``max_failed_checkpoints`` in a row failed; then, and for a final
  checkpoint that cannot be stored, the task fails with the reason.
* :func:`fetch_checkpoint` gets the folder of an ``AssignTask`` checkpoint: a corrupt or missing
  one falls back to the task's previous complete checkpoint in the store.
* :func:`fetch_dataset_artifact` gets an uploaded dataset from the ``s3`` store by presigned URLs
  (``datasets/<hex>``, where the scheduler puts every upload), through the same cache, its bytes
  checked against the dataset id's SHA-256 before they are cached.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import structlog

from opentinker.common.v1 import common_pb2
from opentinker_common.artifacts import (
    ArtifactCorrupt,
    ArtifactError,
    ArtifactNotFound,
    ArtifactRef,
    ArtifactStore,
    checkpoint_key,
)
from opentinker_common.artifacts.remote import RemoteArtifactStore
from opentinker_common.artifacts.checkpoint_lists import SAMPLER_PREFIX, STATE_PREFIX

__all__ = [
    "CACHE_ENV",
    "CACHE_BYTES_ENV",
    "DEFAULT_CACHE_BYTES",
    "ArtifactCache",
    "CheckpointPublisher",
    "StoreSettings",
    "fetch_checkpoint",
    "fetch_dataset_artifact",
    "open_worker_store",
]

log = structlog.get_logger("opentinker.worker")

#: Folder of the node-local cache (the agent sets it to ``<work_dir>/artifact-cache``).
CACHE_ENV = "OPENTINKER_ARTIFACT_CACHE"
#: Most bytes the cache holds (the agent's ``--artifact-cache-bytes``).
CACHE_BYTES_ENV = "OPENTINKER_ARTIFACT_CACHE_BYTES"
DEFAULT_CACHE_BYTES = 20 * 1024**3
_CKPT_KEY = re.compile(r"tasks/[^/]+/a(?P<attempt>\d+)/(?:step|final)_(?P<step>\d+)")


@dataclass(frozen=True)
class StoreSettings:
    """What the scheduler says about checkpoints (``DescribeStoreResponse``)."""

    backend: str = "local"
    checkpoint_retries: int = 3
    max_failed_checkpoints: int = 3


def open_worker_store(env=None) -> tuple[ArtifactStore | None, StoreSettings]:
    """The store this worker writes and reads checkpoints in, and the scheduler's settings.

    Returns ``(None, defaults)`` when no scheduler is configured (``OPENTINKER_SCHEDULER_URL``
    unset): checkpoints are then reported by path only, as before the store existed.

    Raises:
        ArtifactError: the scheduler or the s3 store cannot be used (StoreUnavailable naming it).
    """
    from opentinker_trainer.scheduler_link import scheduler_channel

    env = os.environ if env is None else env
    target = env.get("OPENTINKER_SCHEDULER_URL", "")
    if not target:
        return None, StoreSettings()
    channel, metadata = scheduler_channel(env=env)
    desc = RemoteArtifactStore(channel, metadata, target=target).describe_store()
    settings = StoreSettings(
        backend=desc.backend or "local",
        checkpoint_retries=desc.checkpoint_retries or 3,
        max_failed_checkpoints=desc.max_failed_checkpoints or 3,
    )
    s3 = desc.s3 if desc.backend == "s3" else None
    return RemoteArtifactStore(channel, metadata, target=target, s3=s3), settings


# ------------------------------------------------------------------------------------ the cache


class ArtifactCache:
    """Downloaded artifacts on this node: ``<root>/<manifest sha256>/`` (the folder), at most
    ``max_bytes`` bytes in all; the least recently used go first. One lock file serialises
    fetches and evictions of the node's workers."""

    def __init__(self, root: Path, max_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        self.root = Path(root)
        self.max_bytes = int(max_bytes)
        self.root.mkdir(parents=True, exist_ok=True)
        #: Artifacts this process took from the store (not from the cache), for logs and tests.
        self.downloads = 0

    @contextlib.contextmanager
    def _locked(self):
        with open(self.root / ".lock", "w") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def _entries(self) -> list[tuple[float, int, Path]]:
        out = []
        for d in self.root.iterdir():
            if d.name.startswith(".") or not d.is_dir():
                continue
            size = sum(p.stat().st_size for p in d.rglob("*") if p.is_file())
            stamp = d / ".used"
            used = stamp.stat().st_mtime if stamp.exists() else d.stat().st_mtime
            out.append((used, size, d))
        return sorted(out)

    def _touch(self, d: Path) -> None:
        (d / ".used").touch()

    def _evict(self, keep: Path) -> None:
        entries = self._entries()
        total = sum(size for _, size, _ in entries)
        for _, size, d in entries:
            if total <= self.max_bytes:
                break
            if d == keep:
                continue
            shutil.rmtree(d, ignore_errors=True)
            total -= size
            log.info("artifact cache: evicted", folder=d.name[:16], size_bytes=size)

    def fetch(self, store: ArtifactStore, ref: ArtifactRef, *, check: Callable[[Path], None] | None = None) -> Path:
        """The folder of ``ref``, from the cache or else the store (then cached).

        A ``ref`` without its manifest hash costs one manifest read (to find the cache entry).
        ``check(folder)`` runs on a downloaded folder before it enters the cache (every file
        already matches the manifest): it raises ``ArtifactCorrupt`` to refuse the download (a
        dataset whose bytes are not its id's hash, say), and nothing is cached.

        Raises:
            ArtifactNotFound, ArtifactCorrupt (nothing is cached), StoreUnavailable ...
        """
        if not ref.manifest_sha256:
            m = store.manifest(ref.key)
            ref = ArtifactRef(ref.key, m.sha256, m.total_bytes)
        d = self.root / ref.manifest_sha256
        with self._locked():
            if d.is_dir():
                self._touch(d)
                log.info("artifact cache: hit", key=ref.key)
                return d
            tmp = self.root / f".fetch-{uuid.uuid4().hex[:8]}"
            try:
                store.get_folder(ref.key, tmp, expect_sha256=ref.manifest_sha256)
                if check is not None:
                    check(tmp)
                os.rename(tmp, d)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            self.downloads += 1
            log.info("artifact cache: fetched", key=ref.key, total_bytes=ref.total_bytes, store=store.describe())
            self._touch(d)
            self._evict(keep=d)
        return d

    def adopt(self, folder: Path, ref: ArtifactRef) -> None:
        """Put a folder this node just stored (hard links where possible) into the cache."""
        d = self.root / ref.manifest_sha256
        with self._locked():
            if d.exists():
                self._touch(d)
                return
            tmp = self.root / f".adopt-{uuid.uuid4().hex[:8]}"
            try:
                shutil.copytree(folder, tmp, copy_function=_link_or_copy, symlinks=False)
                os.rename(tmp, d)
            except OSError as exc:
                log.warning("artifact cache: could not keep a copy", error=str(exc))
                return
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            self._touch(d)
            self._evict(keep=d)


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


# ------------------------------------------------------------------------------------ publishing


class CheckpointStoreFailed(Exception):
    """Checkpoints could not be stored (too many in a row, or the final one): the task fails."""


@dataclass
class CheckpointPublisher:
    """Puts checkpoint folders into ``store`` under ``tasks/<task>/a<attempt>/step_<n>``."""

    store: ArtifactStore
    task_id: str
    attempt: int
    settings: StoreSettings = field(default_factory=StoreSettings)
    cache: ArtifactCache | None = None
    sleep: Callable[[float], None] = time.sleep
    failed_in_a_row: int = 0
    last_stored_step: int | None = None
    #: Why the newest checkpoint that could not be stored failed, in words ("" when none did).
    last_error: str = ""

    def publish(self, step: int, folder: Path, *, final: bool, fmt: str) -> ArtifactRef | None:
        """The stored checkpoint's ref, or None when a periodic one could not be stored.

        Raises:
            CheckpointStoreFailed: the final checkpoint could not be stored, or
                ``max_failed_checkpoints`` in a row could not.
        """
        # A session's states and sampler saves are named (several at one step): keyed by name.
        named = folder.name.startswith((STATE_PREFIX, SAMPLER_PREFIX))
        key = checkpoint_key(self.task_id, self.attempt, step, final=final, name=folder.name if named else "")
        meta = {"format": fmt, "step": str(step), "final": "1" if final else "0"}
        last: ArtifactError | None = None
        for i in range(max(1, self.settings.checkpoint_retries)):
            if i:
                self.sleep(min(2.0 ** (i - 1), 30.0))
            try:
                started = time.monotonic()
                log.info("checkpoint upload", step=step, key=key, try_=i + 1)
                ref = self.store.put_folder(key, folder, meta=meta)
            except ArtifactError as exc:
                last = exc
                log.warning("checkpoint upload failed", step=step, key=key, try_=i + 1, error=str(exc))
                if not exc.retryable:
                    break
                continue
            log.info(
                "checkpoint stored",
                step=step,
                key=key,
                total_bytes=ref.total_bytes,
                seconds=round(time.monotonic() - started, 3),
                store=self.store.describe(),
            )
            self.failed_in_a_row = 0
            self.last_stored_step = step
            if self.cache is not None:
                self.cache.adopt(folder, ref)
            return ref
        self.failed_in_a_row += 1
        self.last_error = f"checkpoint at step {step} not stored after {i + 1} tries: {last}"
        kept = (
            f"the last complete checkpoint is step {self.last_stored_step}"
            if self.last_stored_step is not None
            else "the last complete checkpoint is the one this attempt resumed from, if any"
        )
        if final or self.failed_in_a_row >= self.settings.max_failed_checkpoints:
            which = "the final checkpoint" if final else f"{self.failed_in_a_row} checkpoints in a row"
            raise CheckpointStoreFailed(f"{which} could not be stored in the {self.store.describe()}: {last}; {kept}")
        return None


# ------------------------------------------------------------------------------------ resume


def _ref(ck: common_pb2.Checkpoint) -> ArtifactRef:
    return ArtifactRef(ck.artifact.key, ck.artifact.manifest_sha256, ck.artifact.total_bytes)


def _order(key: str) -> tuple[int, int]:
    m = _CKPT_KEY.fullmatch(key)
    return (int(m["step"]), int(m["attempt"])) if m else (-1, -1)


def fetch_checkpoint(
    store: ArtifactStore | None, cache: ArtifactCache | None, ck: common_pb2.Checkpoint, *, fallback: bool = True
) -> tuple[Path | None, common_pb2.Checkpoint | None]:
    """The local folder of the checkpoint ``ck`` (an ``AssignTask.resume_from`` or
    ``init_checkpoint``) and the checkpoint actually used.

    A checkpoint with an artifact comes from the cache or store; when it is corrupt or gone and
    ``fallback``, the task's newest older complete checkpoint in the store is used instead (None
    when there is none: a fresh start). A checkpoint without an artifact (an older trainer's)
    is its ``path``.

    Raises:
        ArtifactError: the store cannot be reached, or (``fallback=False``) the checkpoint is
            corrupt or missing.
    """
    if not ck.artifact.key or store is None or cache is None:
        return (Path(ck.path) if ck.path else None), ck
    try:
        return cache.fetch(store, _ref(ck)), ck
    except (ArtifactCorrupt, ArtifactNotFound) as exc:
        if not fallback:
            raise
        log.warning("checkpoint refused; trying the previous complete one", key=ck.artifact.key, error=str(exc))
    prefix = ck.artifact.key.rsplit("/", 2)[0] + "/"  # tasks/<task_id>/
    newest = _order(ck.artifact.key)
    for key in sorted(store.list(prefix), key=_order, reverse=True):
        if _order(key) >= newest:
            continue
        try:
            m = store.manifest(key)
            folder = cache.fetch(store, ArtifactRef(key, m.sha256, m.total_bytes))
        except (ArtifactCorrupt, ArtifactNotFound) as exc:
            log.warning("checkpoint refused", key=key, error=str(exc))
            continue
        used = common_pb2.Checkpoint()
        used.CopyFrom(ck)
        used.step = _order(key)[0]
        used.attempt = _order(key)[1]
        used.path = str(folder)
        used.format = m.meta.get("format", ck.format)
        used.artifact.key, used.artifact.manifest_sha256, used.artifact.total_bytes = key, m.sha256, m.total_bytes
        log.info("resuming from an older complete checkpoint", key=key, step=used.step)
        return folder, used
    log.warning("no complete checkpoint left in the store; starting afresh", task=prefix)
    return None, None


# ------------------------------------------------------------------------------------ datasets

#: The file of a dataset artifact ``datasets/<hex>`` (beside ``meta.json``), as the scheduler stores it.
DATASET_FILE = "data.jsonl"


def fetch_dataset_artifact(store: ArtifactStore, cache: ArtifactCache, dataset_id: str) -> Path | None:
    """The local file of the uploaded dataset ``dataset_id`` (``sha256:<hex>``), read from
    ``store`` (the artifact ``datasets/<hex>``) through the node-local ``cache``: a second task on
    this node reads the manifest only. A downloaded copy is checked file by file against its
    manifest and then its ``data.jsonl`` against the id's SHA-256 before it is cached.

    Returns:
        The file, or None when the store has no such artifact (a dataset uploaded before the
        scheduler used this store): the caller asks the scheduler instead.

    Raises:
        ArtifactCorrupt: the stored bytes do not match their manifest or do not hash to the id
            (refused; nothing is cached). StoreUnavailable, StoreAuthError: the store cannot be read.
    """
    hex_ = dataset_id.removeprefix("sha256:")
    key = f"datasets/{hex_}"

    def check(folder: Path) -> None:
        file = folder / DATASET_FILE
        if not file.is_file():
            raise ArtifactCorrupt(f"artifact {key}: no {DATASET_FILE}; refusing it as dataset {dataset_id}")
        digest = hashlib.sha256()
        with open(file, "rb") as f:
            while block := f.read(1024 * 1024):
                digest.update(block)
        if digest.hexdigest() != hex_:
            raise ArtifactCorrupt(
                f"artifact {key}: its {DATASET_FILE} hashes to sha256:{digest.hexdigest()[:16]}..., "
                f"not {dataset_id}; refusing it"
            )

    try:
        folder = cache.fetch(store, ArtifactRef(key, "", 0), check=check)
    except ArtifactNotFound:
        log.warning("dataset not in the artifact store", dataset_id=dataset_id, key=key, store=store.describe())
        return None
    log.info("dataset from the artifact store", dataset_id=dataset_id, key=key, store=store.describe())
    return folder / DATASET_FILE
