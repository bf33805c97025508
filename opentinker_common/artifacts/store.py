"""The artifact store interface: put a folder, get a folder, list, delete, read a manifest.

Every backend (:class:`~.local.LocalArtifactStore`, :class:`~.s3.S3ArtifactStore`,
:class:`~.remote.RemoteArtifactStore`) implements the same contract, checked by one test suite
(``tests/common/artifacts/test_store_contract.py``):

* ``put_folder(key, folder)`` stores every regular file under ``folder`` and then its manifest,
  last: until the manifest is written nothing of the put is visible (``manifest``, ``list`` and
  ``get_folder`` do not see it). A committed artifact is immutable: putting other content
  under its key raises :class:`~.errors.ArtifactExists` and leaves it as it was; the same
  content again (same manifest SHA-256, a retried put) returns its ref.
* ``get_folder(key, dest)`` writes the files into a new folder ``dest``, checking each file's
  size and SHA-256 against the manifest (and the manifest against ``expect_sha256``); on a
  mismatch it raises :class:`~.errors.ArtifactCorrupt` and leaves no ``dest`` behind.
* ``list(prefix)`` gives committed keys, sorted; ``delete(key)`` removes one, idempotently.
"""

from __future__ import annotations

import abc
import hashlib
import os
import shutil
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterator, Mapping

from opentinker_common.artifacts.errors import ArtifactCorrupt, InvalidArtifact
from opentinker_common.artifacts.manifest import ArtifactRef, FileEntry, Manifest, check_key

__all__ = ["ArtifactStore", "WriteBehind", "append_hashing"]


class ArtifactStore(abc.ABC):
    """One place artifacts live. Blocking calls (file and network I/O): from asyncio code, run
    them in a thread."""

    #: ``local``, ``s3`` or ``remote``.
    backend: str = ""

    @abc.abstractmethod
    def describe(self) -> str:
        """Where the store is, for messages and logs (never a secret)."""

    @abc.abstractmethod
    def check(self) -> None:
        """Raise :class:`~.errors.StoreUnavailable` (naming the endpoint) or
        :class:`~.errors.StoreAuthError` when the store cannot be used now; return when it can."""

    @abc.abstractmethod
    def put_folder(self, key: str, folder: Path, *, meta: Mapping[str, str] | None = None) -> ArtifactRef:
        """Store every regular file under ``folder`` (symlinks skipped) as the artifact ``key``.

        Returns:
            The committed artifact's reference (key, manifest SHA-256, total bytes).

        Raises:
            InvalidArtifact: bad key, ``folder`` not a folder. StoreFull, StoreUnavailable,
                StoreAuthError: nothing was committed (a former artifact under ``key`` may be gone).
        """

    @abc.abstractmethod
    def manifest(self, key: str, *, expect_sha256: str = "") -> Manifest:
        """The committed manifest of ``key``.

        Raises:
            ArtifactNotFound: nothing committed under ``key``. ArtifactCorrupt: the manifest's
                hash is not ``expect_sha256`` (when given) or it cannot be read.
        """

    @abc.abstractmethod
    def read_chunks(self, manifest: Manifest, entry: FileEntry, *, offset: int = 0) -> Iterator[bytes]:
        """The bytes of one file of a committed artifact from ``offset``, in chunks of at most
        1 MiB (unverified: callers hash what they read).

        Raises:
            ArtifactNotFound: the file is gone (deleted meanwhile).
        """

    @abc.abstractmethod
    def list(self, prefix: str = "") -> list[str]:
        """Keys of committed artifacts that start with ``prefix``, sorted."""

    @abc.abstractmethod
    def delete(self, key: str) -> bool:
        """Remove ``key`` (its manifest first, so it is never half visible). Idempotent.

        Returns:
            Whether there was something to remove.
        """

    # ------------------------------------------------------------------ shared implementation
    def get_folder(self, key: str, dest: Path, *, expect_sha256: str = "") -> Manifest:
        """Write the committed artifact ``key`` into the new folder ``dest`` (its parent must
        exist), every file verified; see the module docstring.

        Raises:
            ArtifactNotFound, ArtifactCorrupt (``dest`` is not created), InvalidArtifact (``dest``
            exists), StoreUnavailable, StoreAuthError.
        """
        dest = Path(dest)
        if dest.exists():
            raise InvalidArtifact(f"{dest}: already exists; get_folder writes a new folder")
        m = self.manifest(key, expect_sha256=expect_sha256)
        tmp = dest.with_name(f".{dest.name}.part-{uuid.uuid4().hex[:8]}")
        tmp.mkdir()
        try:
            self._fetch_files(key, m, tmp)
            os.rename(tmp, dest)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return m

    def _fetch_files(self, key: str, m: Manifest, folder: Path) -> None:
        """Write every file of ``m`` under ``folder``, each verified against the manifest."""
        for entry in m.files:
            verify(m, entry, *self._fetch_file(m, entry, folder / entry.path))

    def _fetch_file(self, m: Manifest, entry: FileEntry, path: Path) -> tuple[int, str]:
        """Write file ``entry`` to ``path`` from :meth:`read_chunks`, each chunk hashed and written
        in a worker thread while the next arrives; its size and SHA-256 (hex)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        digest = hashlib.sha256()
        behind = WriteBehind()
        try:
            with open(path, "wb", buffering=0) as f:
                for chunk in self.read_chunks(m, entry):
                    behind.submit(append_hashing, f, digest, chunk)
                behind.wait()
                return f.tell(), digest.hexdigest()
        finally:
            behind.close()


class WriteBehind:
    """Runs calls one after another in one worker thread, one at a time and in order, so the
    caller receives the next chunk while the last is hashed and written (both release the GIL).
    :meth:`submit` waits for the call before (raising its error); :meth:`wait` for the last."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._pending: Future | None = None

    def submit(self, fn: Callable[..., object], *args: object) -> None:
        self.wait()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="artifact-write")
        self._pending = self._pool.submit(fn, *args)

    def wait(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        """Wait for the call in flight (its error dropped: the caller is failing already or has
        waited) and stop the thread."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.exception()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def append_hashing(f, digest, chunk: bytes) -> None:
    digest.update(chunk)
    view = memoryview(chunk)
    while view:  # a raw file may write less than asked
        view = view[f.write(view) :]


def verify(m: Manifest, entry: FileEntry, size: int, sha256: str) -> None:
    """Raise :class:`ArtifactCorrupt` when ``size``/``sha256`` are not ``entry``'s."""
    if size != entry.size_bytes or sha256 != entry.sha256:
        raise ArtifactCorrupt(
            f"artifact {m.key}: file {entry.path} is {size} bytes with SHA-256 {sha256[:16]}..., "
            f"the manifest says {entry.size_bytes} bytes with {entry.sha256[:16]}...; refusing the artifact"
        )


def checked_key(key: str) -> str:
    return check_key(key)
