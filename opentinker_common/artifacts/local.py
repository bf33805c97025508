"""The ``local`` artifact store: a folder (on the scheduler, under its state dir).

Layout under ``root``::

    <key>/.manifest.json      the commit point, written last (temp name, fsync, rename)
    <key>/.data/<path>        the files
    .staging/<id>/            a put or a finished upload being committed
    .uploads/<upload id>/     a resumable upload: announce.json (the announced manifest), files/<index>
    .trash/                   what a delete moves away before removing it

Key segments never start with ``.``, so no key collides with these names. A committed artifact
is immutable: a put or commit of other content under its key is :class:`ArtifactExists`, the
same content again is a success. A process killed at any point leaves the artifact committed
or not there at all, never a mix; leftovers in
``.staging``/``.trash`` are removed by the next :class:`LocalArtifactStore` on that root.

Resumable uploads (the scheduler's ArtifactService uses them for trainers):
:meth:`LocalArtifactStore.begin_upload` announces key and files and says how many bytes of each
file are already held; :meth:`~LocalArtifactStore.write_chunk` appends at exactly that offset;
:meth:`~LocalArtifactStore.commit_upload` checks every file's size and SHA-256 and commits.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping

from opentinker_common.artifacts.errors import (
    ArtifactCorrupt,
    ArtifactError,
    ArtifactExists,
    ArtifactNotFound,
    InvalidArtifact,
    StoreFull,
    StoreUnavailable,
)
from opentinker_common.artifacts.manifest import (
    CHUNK_BYTES,
    ArtifactRef,
    FileEntry,
    Manifest,
    check_key,
    scan_folder,
    sha256_file,
)
from opentinker_common.artifacts.store import ArtifactStore

__all__ = ["LocalArtifactStore", "UploadStatus", "UploadOffsetMismatch", "UploadIncomplete"]

MANIFEST_NAME = ".manifest.json"
DATA_NAME = ".data"
#: An upload untouched this long (seconds) is removed by :meth:`LocalArtifactStore.prune_uploads`.
UPLOAD_TTL_S = 24 * 3600.0


class UploadOffsetMismatch(ArtifactError):
    """A chunk's offset is not the number of bytes the store holds of that file; ``held`` says
    where to continue."""

    def __init__(self, message: str, held: int) -> None:
        super().__init__(message)
        self.held = held


class UploadIncomplete(InvalidArtifact):
    """A commit of an upload whose files are not all there; the message names the file."""


@dataclass(frozen=True)
class UploadStatus:
    """An announced upload: its id, the bytes held of each announced file (manifest order), and
    whether the artifact is already committed with exactly this content (nothing to send)."""

    upload_id: str
    received_bytes: tuple[int, ...]
    committed: bool = False


def _is_enospc(exc: OSError) -> bool:
    return exc.errno in (errno.ENOSPC, errno.EDQUOT)


class LocalArtifactStore(ArtifactStore):
    """Artifacts in the folder ``root`` (created, mode 700). Safe for one process at a time per
    root (the scheduler, which holds its state dir's lock)."""

    backend = "local"

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        try:
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            for name in (".staging", ".uploads", ".trash"):
                (self.root / name).mkdir(mode=0o700, exist_ok=True)
        except OSError as exc:
            why = exc.strerror or exc
            raise StoreUnavailable(f"local artifact store {self.root}: cannot create it: {why}") from None
        for name in (".staging", ".trash"):
            for leftover in (self.root / name).iterdir():
                shutil.rmtree(leftover, ignore_errors=True)
        #: SHA-256 of each upload file's bytes as they arrived: ``(upload_id, file index) ->
        #: (bytes hashed, hash)``, so a commit need not read the file again (a file whose bytes
        #: did not all arrive through this object, e.g. before a restart, is hashed at commit).
        self._digests: dict[tuple[str, int], tuple[int, object]] = {}
        self._digests_lock = threading.Lock()
        #: Held from the check that a key is free to its commit, so two commits of one key
        #: cannot both find it free.
        self._commit_lock = threading.Lock()

    def describe(self) -> str:
        return f"local artifact store {self.root}"

    def check(self) -> None:
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise StoreUnavailable(f"{self.describe()}: not writable")

    # ------------------------------------------------------------------ paths
    def _dir(self, key: str) -> Path:
        return self.root / check_key(key)

    def _full(self, exc: OSError, key: str) -> StoreFull:
        try:
            free = shutil.disk_usage(self.root).free
        except OSError:
            free = -1
        return StoreFull(
            f"{self.describe()}: disk full ({exc.strerror or exc}; {free} bytes free) while writing {key}; "
            "nothing was recorded"
        )

    # ------------------------------------------------------------------ the contract
    def put_folder(self, key: str, folder: Path, *, meta: Mapping[str, str] | None = None) -> ArtifactRef:
        check_key(key)
        files = scan_folder(Path(folder))
        staging = self.root / ".staging" / uuid.uuid4().hex
        try:
            staging.mkdir()
            entries = []
            for src, entry in files:
                dst = staging / entry.path
                dst.parent.mkdir(parents=True, exist_ok=True)
                size, sha = _copy_hashing(src, dst)
                if size != entry.size_bytes or sha != entry.sha256:
                    raise InvalidArtifact(f"{src}: changed while it was being stored; try again")
                entries.append(entry)
            m = Manifest(key, tuple(entries), meta or {})
            self._commit(m, staging)
        except OSError as exc:
            shutil.rmtree(staging, ignore_errors=True)
            if _is_enospc(exc):
                raise self._full(exc, key) from None
            raise StoreUnavailable(f"{self.describe()}: cannot write {key}: {exc.strerror or exc}") from None
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return m.ref()

    def _committed(self, m: Manifest) -> bool:
        """Whether ``m.key`` holds exactly ``m`` already.

        Raises:
            ArtifactExists: it holds another manifest (committed artifacts are immutable).
        """
        try:
            held = self.manifest(m.key)
        except (ArtifactNotFound, ArtifactCorrupt):
            # A manifest that does not parse is not a committed artifact: it is written over.
            return False
        if held.sha256 == m.sha256:
            return True
        raise ArtifactExists(
            f"artifact {m.key} is already committed with other content (manifest sha256 {held.sha256[:16]}...); "
            "committed artifacts are immutable: store it under a new key"
        )

    def _commit(self, m: Manifest, data: Path) -> None:
        """Make ``data`` (a folder of ``m``'s files) the artifact ``m.key``: manifest written to a
        temporary name, data moved into place, manifest renamed into place (the commit point).
        The same manifest committed already is a success (``data`` is removed).

        Raises:
            ArtifactExists: another manifest is committed under the key.
        """
        target = self._dir(m.key)
        with self._commit_lock:
            if self._committed(m):
                shutil.rmtree(data, ignore_errors=True)
                return
            target.mkdir(parents=True, exist_ok=True)
            new_manifest = target / f"{MANIFEST_NAME}.new-{uuid.uuid4().hex[:8]}"
            try:
                with open(new_manifest, "wb") as f:
                    f.write(m.to_json())
                    f.flush()
                    os.fsync(f.fileno())
            except BaseException:
                new_manifest.unlink(missing_ok=True)
                raise
            if (target / DATA_NAME).exists():  # the data of a commit killed before its manifest
                trash = self.root / ".trash" / uuid.uuid4().hex
                os.rename(target / DATA_NAME, trash)
                shutil.rmtree(trash, ignore_errors=True)
            os.rename(data, target / DATA_NAME)
            os.replace(new_manifest, target / MANIFEST_NAME)  # the commit point
            _fsync_dir(target)

    def manifest(self, key: str, *, expect_sha256: str = "") -> Manifest:
        path = self._dir(key) / MANIFEST_NAME
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise ArtifactNotFound(f"artifact {key} not found in the {self.describe()}") from None
        except OSError as exc:
            raise StoreUnavailable(f"{self.describe()}: cannot read {key}: {exc.strerror or exc}") from None
        return Manifest.from_json(data, key=key, expect_sha256=expect_sha256)

    def read_chunks(self, manifest: Manifest, entry: FileEntry, *, offset: int = 0) -> Iterator[bytes]:
        path = self._dir(manifest.key) / DATA_NAME / entry.path
        try:
            f = open(path, "rb")
        except FileNotFoundError:
            raise ArtifactNotFound(f"artifact {manifest.key}: file {entry.path} is gone") from None
        with f:
            f.seek(offset)
            while block := f.read(CHUNK_BYTES):
                yield block

    def list(self, prefix: str = "") -> list[str]:
        keys = []
        for dirpath, dirnames, filenames in os.walk(self.root):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            if MANIFEST_NAME in filenames:
                key = Path(dirpath).relative_to(self.root).as_posix()
                if key.startswith(prefix):
                    keys.append(key)
        return sorted(keys)

    def delete(self, key: str) -> bool:
        target = self._dir(key)
        manifest = target / MANIFEST_NAME
        existed = manifest.exists()
        manifest.unlink(missing_ok=True)
        if (target / DATA_NAME).exists():
            trash = self.root / ".trash" / uuid.uuid4().hex
            os.rename(target / DATA_NAME, trash)
            shutil.rmtree(trash, ignore_errors=True)
            existed = True
        p = target
        while p != self.root:  # empty folders of the key, bottom up
            try:
                p.rmdir()
            except OSError:
                break
            p = p.parent
        return existed

    # ------------------------------------------------------------------ resumable uploads
    def _upload_dir(self, upload_id: str) -> Path:
        if not (len(upload_id) == 32 and all(c in "0123456789abcdef" for c in upload_id)):
            raise InvalidArtifact(f"upload_id: expected 32 hex digits, got {upload_id[:40]!r}")
        return self.root / ".uploads" / upload_id

    def begin_upload(self, m: Manifest) -> UploadStatus:
        """Announce the artifact ``m`` (key, files with sizes and SHA-256). Idempotent: the same
        announcement gets the same upload id and says how many bytes of each file are held.

        Raises:
            InvalidArtifact: bad key or files (raised when ``m`` is built). ArtifactExists: the key
                holds another committed artifact (nothing is sent). StoreFull.
        """
        upload_id = hashlib.sha256(m.to_json()).hexdigest()[:32]
        if self._committed(m):
            return UploadStatus(upload_id, tuple(f.size_bytes for f in m.files), committed=True)
        d = self._upload_dir(upload_id)
        try:
            (d / "files").mkdir(parents=True, exist_ok=True)
            announce = d / "announce.json"
            if not announce.exists():
                tmp = d / f"announce.json.{uuid.uuid4().hex[:8]}"
                tmp.write_bytes(m.to_json())
                os.replace(tmp, announce)
            os.utime(d)
        except OSError as exc:
            if _is_enospc(exc):
                raise self._full(exc, m.key) from None
            why = exc.strerror or exc
            raise StoreUnavailable(f"{self.describe()}: cannot start upload of {m.key}: {why}") from None
        return UploadStatus(upload_id, self._held(d, m))

    def _announced(self, upload_id: str) -> tuple[Path, Manifest]:
        d = self._upload_dir(upload_id)
        try:
            data = (d / "announce.json").read_bytes()
        except FileNotFoundError:
            raise ArtifactNotFound(
                f"upload {upload_id} is unknown (finished, expired or never begun); begin it again"
            ) from None
        return d, Manifest.from_json(data)

    def _held(self, d: Path, m: Manifest) -> tuple[int, ...]:
        held = []
        for i, entry in enumerate(m.files):
            part = d / "files" / str(i)
            size = part.stat().st_size if part.exists() else 0
            if size > entry.size_bytes:  # cannot be: start that file over
                part.unlink()
                size = 0
            held.append(size)
        return tuple(held)

    def upload_key(self, upload_id: str) -> str:
        """The key an announced upload will commit.

        Raises:
            ArtifactNotFound: unknown upload id. InvalidArtifact: not an upload id.
        """
        return self._announced(upload_id)[1].key

    def upload_status(self, upload_id: str) -> UploadStatus:
        """Bytes held of each file of an announced upload.

        Raises:
            ArtifactNotFound: unknown upload id.
        """
        d, m = self._announced(upload_id)
        return UploadStatus(upload_id, self._held(d, m))

    def write_chunk(self, upload_id: str, file_index: int, offset: int, data: bytes) -> int:
        """Append ``data`` to file ``file_index`` of the upload at byte ``offset``.

        Returns:
            Bytes of that file now held.

        Raises:
            ArtifactNotFound: unknown upload. InvalidArtifact: bad index, or more bytes than the
                file's announced size. UploadOffsetMismatch: ``offset`` is not the held size (its
                ``held`` says where to continue). StoreFull: disk full (the chunk is not kept).
        """
        d, m = self._announced(upload_id)
        if not 0 <= file_index < len(m.files):
            raise InvalidArtifact(f"file_index: expected 0 to {len(m.files) - 1}, got {file_index}")
        entry = m.files[file_index]
        part = d / "files" / str(file_index)
        held = part.stat().st_size if part.exists() else 0
        if offset != held:
            raise UploadOffsetMismatch(
                f"upload {upload_id}: file {entry.path}: chunk at offset {offset}, but {held} bytes are held; "
                f"continue at {held}",
                held,
            )
        if held + len(data) > entry.size_bytes:
            raise InvalidArtifact(
                f"upload {upload_id}: file {entry.path}: {held + len(data)} bytes is more than its announced "
                f"size of {entry.size_bytes}"
            )
        try:
            with open(part, "ab") as f:
                f.write(data)
                f.flush()
        except OSError as exc:
            with self._digests_lock:
                self._digests.pop((upload_id, file_index), None)
            with _suppress_os():
                os.truncate(part, held)
            if _is_enospc(exc):
                raise self._full(exc, m.key) from None
            why = exc.strerror or exc
            raise StoreUnavailable(f"{self.describe()}: cannot write upload of {m.key}: {why}") from None
        with self._digests_lock:
            hashed, digest = self._digests.get((upload_id, file_index), (0, None))
            if held == 0:  # the file starts here: hash it from its first byte
                hashed, digest = 0, hashlib.sha256()
            if digest is not None and hashed == held:
                digest.update(data)  # type: ignore[attr-defined]
                self._digests[(upload_id, file_index)] = (held + len(data), digest)
            else:
                self._digests.pop((upload_id, file_index), None)
        return held + len(data)

    def _sha256_of_part(self, upload_id: str, index: int, part: Path, size: int) -> str:
        """The SHA-256 of an upload file: as hashed on arrival when every byte came through
        :meth:`write_chunk` here, else read from disk."""
        with self._digests_lock:
            hashed, digest = self._digests.pop((upload_id, index), (0, None))
        if digest is not None and hashed == size:
            return digest.hexdigest()  # type: ignore[attr-defined]
        return sha256_file(part)[1]

    def commit_upload(self, upload_id: str) -> ArtifactRef:
        """Check every file of the upload (size, SHA-256) and commit the artifact.

        Raises:
            ArtifactNotFound: unknown upload. InvalidArtifact: a file is not complete (the message
                names it and the bytes held). ArtifactCorrupt: a file's SHA-256 is not the announced
                one (that file is dropped: send it again). ArtifactExists: the key holds another
                committed artifact (the upload is dropped; the committed one stays). StoreFull.
        """
        d, m = self._announced(upload_id)
        try:
            if self._committed(m):
                shutil.rmtree(d, ignore_errors=True)
                return m.ref()
        except ArtifactExists:
            shutil.rmtree(d, ignore_errors=True)
            raise
        for i, entry in enumerate(m.files):
            part = d / "files" / str(i)
            if not part.exists() and entry.size_bytes == 0:
                part.touch()
            held = part.stat().st_size if part.exists() else 0
            if held != entry.size_bytes:
                raise UploadIncomplete(
                    f"upload {upload_id}: file {entry.path} holds {held} of {entry.size_bytes} bytes; send the rest"
                )
            sha = self._sha256_of_part(upload_id, i, part, held)
            if sha != entry.sha256:
                part.unlink()
                raise ArtifactCorrupt(
                    f"upload of {m.key}: file {entry.path} has SHA-256 {sha[:16]}..., "
                    f"announced {entry.sha256[:16]}...; "
                    "dropped it, send it again"
                )
        staging = self.root / ".staging" / uuid.uuid4().hex
        try:
            staging.mkdir()
            for i, entry in enumerate(m.files):
                dst = staging / entry.path
                dst.parent.mkdir(parents=True, exist_ok=True)
                os.rename(d / "files" / str(i), dst)
            self._commit(m, staging)
        except ArtifactExists:  # committed by another call since the check above
            shutil.rmtree(staging, ignore_errors=True)
            shutil.rmtree(d, ignore_errors=True)
            raise
        except OSError as exc:
            # put the files back, so the upload can be committed again
            for i, entry in enumerate(m.files):
                with _suppress_os():
                    os.rename(staging / entry.path, d / "files" / str(i))
            shutil.rmtree(staging, ignore_errors=True)
            if _is_enospc(exc):
                raise self._full(exc, m.key) from None
            raise StoreUnavailable(f"{self.describe()}: cannot commit {m.key}: {exc.strerror or exc}") from None
        shutil.rmtree(d, ignore_errors=True)
        return m.ref()

    def prune_uploads(self, max_age_s: float = UPLOAD_TTL_S) -> int:
        """Remove uploads not touched for ``max_age_s`` seconds; returns how many."""
        n = 0
        cutoff = time.time() - max_age_s
        for d in (self.root / ".uploads").iterdir():
            with _suppress_os():
                if d.stat().st_mtime < cutoff:
                    shutil.rmtree(d, ignore_errors=True)
                    n += 1
        return n


def _copy_hashing(src: Path, dst: Path) -> tuple[int, str]:
    digest = hashlib.sha256()
    size = 0
    with open(src, "rb") as fi, open(dst, "wb") as fo:
        while block := fi.read(CHUNK_BYTES):
            digest.update(block)
            size += len(block)
            fo.write(block)
        fo.flush()
        os.fsync(fo.fileno())
    return size, digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    with _suppress_os():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class _suppress_os:
    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        return exc_type is not None and issubclass(exc_type, OSError)
