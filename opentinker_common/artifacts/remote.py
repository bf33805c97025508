"""The trainer's view of the scheduler's store, over ``opentinker.artifact.v1.ArtifactService``.

Uploads announce the manifest (``BeginUpload``: the server says how many bytes of each file it
holds), send the missing bytes and commit (``CommitUpload``: the server checks every SHA-256 and
writes the manifest last). With the ``local`` backend the bytes stream to the scheduler
(``UploadChunks``, client-streaming, 1 MiB chunks) and downloads stream back
(``DownloadArtifact``). With ``s3`` they go straight between this process and the bucket, by the
presigned PUT and GET URLs the scheduler answers (``BeginUpload``'s ``puts``,
``PresignDownload``): the trainer holds no S3 credentials. When a transfer breaks, the next try
continues with the files the store does not hold. Downloads check every file here too.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Iterator, Mapping

import grpc

from opentinker.artifact.v1 import artifact_pb2, artifact_pb2_grpc

from opentinker_common.artifacts.errors import (
    ArtifactCorrupt,
    ArtifactExists,
    ArtifactError,
    ArtifactNotFound,
    InvalidArtifact,
    StoreAuthError,
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
)
from opentinker_common.artifacts.store import ArtifactStore, WriteBehind, append_hashing, verify

__all__ = ["RemoteArtifactStore", "manifest_to_proto", "manifest_from_proto", "error_from_rpc"]


def manifest_to_proto(m: Manifest) -> artifact_pb2.ArtifactManifest:
    return artifact_pb2.ArtifactManifest(
        key=m.key,
        files=[artifact_pb2.ArtifactFile(path=f.path, size_bytes=f.size_bytes, sha256=f.sha256) for f in m.files],
        meta=dict(m.meta),
        manifest_sha256=m.sha256,
        total_bytes=m.total_bytes,
    )


def manifest_from_proto(msg: artifact_pb2.ArtifactManifest) -> Manifest:
    """Raises InvalidArtifact on a bad key, path, size or hash."""
    return Manifest(
        key=msg.key,
        files=tuple(FileEntry(f.path, int(f.size_bytes), f.sha256) for f in msg.files),
        meta=dict(msg.meta),
    )


_CODES: dict[grpc.StatusCode, type[ArtifactError]] = {
    grpc.StatusCode.NOT_FOUND: ArtifactNotFound,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArtifact,
    grpc.StatusCode.FAILED_PRECONDITION: InvalidArtifact,
    grpc.StatusCode.DATA_LOSS: ArtifactCorrupt,
    grpc.StatusCode.ALREADY_EXISTS: ArtifactExists,
    grpc.StatusCode.RESOURCE_EXHAUSTED: StoreFull,
    grpc.StatusCode.PERMISSION_DENIED: StoreAuthError,
    grpc.StatusCode.UNAUTHENTICATED: StoreAuthError,
}


def error_from_rpc(exc: grpc.RpcError, target: str) -> ArtifactError:
    """The store error for a failed ArtifactService call to ``target``."""
    code = exc.code() if hasattr(exc, "code") else None
    details = (exc.details() if hasattr(exc, "details") else "") or ""
    cls = _CODES.get(code)
    if cls is None:
        what = code.name if code else exc
        return StoreUnavailable(f"the scheduler's artifact store at {target} is unreachable ({what}: {details})")
    return cls(details)


class RemoteArtifactStore(ArtifactStore):
    """The scheduler's artifact store, reached over ``channel`` (blocking).

    Args:
        channel: to the scheduler. metadata: call metadata (the node's bearer key).
        target: the scheduler's address, for messages.
        timeout_s: deadline of each unary call; streams and presigned transfers get
            ``stream_timeout_s``.
        resumes: how often one put continues after a broken transfer before giving up.
        s3: where the scheduler's ``s3`` store is (``DescribeStore``): bytes then go by presigned
            URLs; None for the ``local`` store, whose bytes go through the scheduler.
    """

    backend = "remote"

    def __init__(
        self,
        channel: grpc.Channel,
        metadata: tuple[tuple[str, str], ...] = (),
        *,
        target: str = "",
        timeout_s: float = 30.0,
        stream_timeout_s: float = 3600.0,
        resumes: int = 3,
        s3: artifact_pb2.S3Location | None = None,
    ) -> None:
        self._stub = artifact_pb2_grpc.ArtifactServiceStub(channel)
        self._md = tuple(metadata)
        self.target = target or "the scheduler"
        self.timeout_s = timeout_s
        self.stream_timeout_s = stream_timeout_s
        self.resumes = resumes
        self.s3 = s3
        self._http = None
        if s3 is not None:
            import urllib3  # only a trainer of an s3 store needs it

            self.backend = "s3"
            # per socket operation, as the scheduler's own S3 client: a silent network fails the try
            self._http = urllib3.PoolManager(timeout=urllib3.Timeout(connect=10.0, read=60.0), retries=False)

    def describe(self) -> str:
        if self.s3 is not None:
            s3 = self.s3
            where = f"s3://{s3.bucket}/{s3.prefix} at {s3.endpoint or 'AWS'}"
            return f"S3 artifact store {where} (URLs presigned by the scheduler at {self.target})"
        return f"local artifact store of the scheduler at {self.target}"

    def _call(self, method, request, *, timeout: float | None = None):
        try:
            return method(request, timeout=timeout or self.timeout_s, metadata=self._md)
        except grpc.RpcError as exc:
            raise error_from_rpc(exc, self.target) from None

    def describe_store(self) -> artifact_pb2.DescribeStoreResponse:
        return self._call(self._stub.DescribeStore, artifact_pb2.DescribeStoreRequest())

    def check(self) -> None:
        self.describe_store()

    # ------------------------------------------------------------------ put
    def put_folder(self, key: str, folder: Path, *, meta: Mapping[str, str] | None = None) -> ArtifactRef:
        check_key(key)
        files = scan_folder(Path(folder))
        m = Manifest(key, tuple(e for _, e in files), meta or {})
        paths = {e.path: p for p, e in files}
        last: ArtifactError | None = None
        for attempt in range(self.resumes + 1):
            if attempt:
                time.sleep(min(0.2 * 2**attempt, 2.0))
            begun = self._call(self._stub.BeginUpload, artifact_pb2.BeginUploadRequest(manifest=manifest_to_proto(m)))
            if begun.committed:
                return m.ref()
            try:
                received = list(begun.received_bytes)
                if begun.puts:
                    self._put_presigned(m, paths, begun.puts)
                elif any(r < e.size_bytes for r, e in zip(received, m.files)):
                    chunks = _chunks(begun.upload_id, m, paths, received)
                    self._stub.UploadChunks(chunks, timeout=self.stream_timeout_s, metadata=self._md)
                commit = artifact_pb2.CommitUploadRequest(upload_id=begun.upload_id)
                self._stub.CommitUpload(commit, timeout=self.timeout_s, metadata=self._md)
                return m.ref()
            except grpc.RpcError as exc:
                last = error_from_rpc(exc, self.target)
                resumable = exc.code() in (
                    grpc.StatusCode.UNAVAILABLE,
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    grpc.StatusCode.FAILED_PRECONDITION,  # offset moved or a file incomplete: ask again
                    grpc.StatusCode.DATA_LOSS,  # a file was dropped: send it again
                    grpc.StatusCode.CANCELLED,
                )
                if not resumable:
                    raise last from None
            except StoreUnavailable as exc:  # a presigned PUT that failed: sign again, send the rest
                last = exc
        assert last is not None
        raise last

    def _send(self, req: artifact_pb2.PresignedRequest, what: str, body=None, *, stream: bool = False):
        """One presigned request; the response (its body unread when ``stream``).

        Raises:
            StoreUnavailable: the store cannot be reached, refused the URL (expired) or the bytes.
        """
        import urllib3

        assert self._http is not None
        where = self.describe()
        try:
            resp = self._http.request(
                req.method, req.url, body=body, headers=dict(req.headers), preload_content=not stream
            )
        except urllib3.exceptions.HTTPError as exc:
            raise self._unreachable(exc, what) from None
        if resp.status == 404:
            resp.release_conn()
            raise ArtifactNotFound(f"{what}: not found in the {where}")
        if resp.status >= 300:
            detail = resp.data[:300].decode(errors="replace") if not stream else ""
            resp.release_conn()
            raise StoreUnavailable(f"{where}: {what}: HTTP {resp.status} {detail}".rstrip())
        return resp

    def _unreachable(self, exc: Exception, what: str) -> StoreUnavailable:
        endpoint = (self.s3.endpoint if self.s3 is not None else "") or "AWS S3"
        return StoreUnavailable(
            f"S3 endpoint {endpoint} unreachable while {what} ({type(exc).__name__}); "
            f"is the store running, and does this node reach {endpoint}?"
        )

    def _put_presigned(self, m: Manifest, paths: Mapping[str, Path], puts) -> None:
        """Send each PUT: the file's bytes from its offset, as many as its Content-Length says
        (the whole file, or one part of a file the store takes in parts)."""
        for req in puts:
            entry = m.files[req.file_index]
            length = int(req.headers.get("Content-Length", entry.size_bytes))
            with open(paths[entry.path], "rb") as f:
                f.seek(req.offset)
                resp = self._send(req, f"writing {m.key}/{entry.path}", body=_Slice(f, length))
            resp.release_conn()

    # ------------------------------------------------------------------ get
    def manifest(self, key: str, *, expect_sha256: str = "") -> Manifest:
        check_key(key)
        resp = self._call(
            self._stub.StatArtifact, artifact_pb2.StatArtifactRequest(key=key, expect_manifest_sha256=expect_sha256)
        )
        return manifest_from_proto(resp.manifest)

    def _download(self, key: str, expect_sha256: str):
        try:
            yield from self._stub.DownloadArtifact(
                artifact_pb2.DownloadArtifactRequest(key=key, expect_manifest_sha256=expect_sha256),
                timeout=self.stream_timeout_s,
                metadata=self._md,
            )
        except grpc.RpcError as exc:
            raise error_from_rpc(exc, self.target) from None

    def _presigned_gets(self, key: str, expect_sha256: str) -> tuple[Manifest, list]:
        resp = self._call(
            self._stub.PresignDownload,
            artifact_pb2.PresignDownloadRequest(key=key, expect_manifest_sha256=expect_sha256),
        )
        m = manifest_from_proto(resp.manifest)
        if m.key != key or (expect_sha256 and m.sha256 != expect_sha256):
            raise ArtifactCorrupt(f"artifact {key}: the scheduler sent another manifest; refusing it")
        return m, list(resp.gets)

    def _get_chunks(self, req, what: str, offset: int = 0) -> Iterator[bytes]:
        import urllib3

        if offset:
            req = artifact_pb2.PresignedRequest(
                file_index=req.file_index, method=req.method, url=req.url, expires_unix_s=req.expires_unix_s
            )
            req.headers["Range"] = f"bytes={offset}-"
        resp = self._send(req, what, stream=True)
        try:
            yield from resp.stream(CHUNK_BYTES)
        except urllib3.exceptions.HTTPError as exc:
            raise self._unreachable(exc, what) from None
        finally:
            resp.release_conn()

    def read_chunks(self, manifest: Manifest, entry: FileEntry, *, offset: int = 0) -> Iterator[bytes]:
        if self.s3 is not None:
            if entry.size_bytes == 0 or offset >= entry.size_bytes:
                return
            _, gets = self._presigned_gets(manifest.key, manifest.sha256)
            index = [f.path for f in manifest.files].index(entry.path)
            yield from self._get_chunks(gets[index], f"reading {manifest.key}/{entry.path}", offset)
            return
        index = [f.path for f in manifest.files].index(entry.path)
        for msg in self._download(manifest.key, manifest.sha256):
            if msg.WhichOneof("item") == "chunk" and msg.chunk.file_index == index:
                data = msg.chunk.data
                start = msg.chunk.offset
                if start + len(data) > offset:
                    yield data[max(0, offset - start) :]

    def get_folder(self, key: str, dest: Path, *, expect_sha256: str = "") -> Manifest:
        dest = Path(dest)
        if dest.exists():
            raise InvalidArtifact(f"{dest}: already exists; get_folder writes a new folder")
        if self.s3 is not None:
            return self._get_folder_presigned(key, dest, expect_sha256)
        tmp = dest.with_name(f".{dest.name}.part-{uuid.uuid4().hex[:8]}")
        tmp.mkdir()
        m: Manifest | None = None
        state: dict = {}
        # chunks are hashed and written in a worker thread (in order) while the next arrives;
        # ``state`` is only touched there
        behind = WriteBehind()
        try:
            for msg in self._download(key, expect_sha256):
                if msg.WhichOneof("item") == "manifest":
                    m = manifest_from_proto(msg.manifest)
                    if m.key != key or (expect_sha256 and m.sha256 != expect_sha256):
                        raise ArtifactCorrupt(f"artifact {key}: the scheduler sent another manifest; refusing it")
                    continue
                if m is None:
                    raise ArtifactCorrupt(f"artifact {key}: data before the manifest")
                behind.submit(_write_chunk, tmp, m, msg.chunk, state)
            behind.wait()
            if m is None:
                raise ArtifactCorrupt(f"artifact {key}: the download ended before its manifest")
            _finish(tmp, m, state, upto=len(m.files))
            os.rename(tmp, dest)
        except BaseException:
            behind.close()
            _close(state)
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        behind.close()
        return m

    def _get_folder_presigned(self, key: str, dest: Path, expect_sha256: str) -> Manifest:
        m, gets = self._presigned_gets(key, expect_sha256)
        if [g.file_index for g in gets] != list(range(len(m.files))):
            raise ArtifactCorrupt(f"artifact {key}: the scheduler sent no URL for some of its files; refusing it")
        tmp = dest.with_name(f".{dest.name}.part-{uuid.uuid4().hex[:8]}")
        tmp.mkdir()
        behind = WriteBehind()
        try:
            for entry, req in zip(m.files, gets):
                target = tmp / entry.path
                target.parent.mkdir(parents=True, exist_ok=True)
                digest = hashlib.sha256()
                with open(target, "wb", buffering=0) as f:
                    if entry.size_bytes:
                        for chunk in self._get_chunks(req, f"reading {key}/{entry.path}"):
                            behind.submit(append_hashing, f, digest, chunk)
                        behind.wait()
                    size = f.tell()
                verify(m, entry, size, digest.hexdigest())
            os.rename(tmp, dest)
        except BaseException:
            behind.close()
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        behind.close()
        return m

    def list(self, prefix: str = "") -> list[str]:
        return list(self._call(self._stub.ListArtifacts, artifact_pb2.ListArtifactsRequest(prefix=prefix)).keys)

    def delete(self, key: str) -> bool:
        raise StoreAuthError("trainers do not delete artifacts; the scheduler's retention does")


class _Slice:
    """The next ``length`` bytes of an open file, as a request body read in CHUNK_BYTES."""

    def __init__(self, f, length: int) -> None:
        self._f = f
        self._left = length

    def read(self, n: int = -1) -> bytes:
        n = self._left if n is None or n < 0 else min(n, self._left)
        data = self._f.read(min(n, CHUNK_BYTES))
        self._left -= len(data)
        return data


def _chunks(upload_id: str, m: Manifest, paths: Mapping[str, Path], received: list[int]):
    for index, entry in enumerate(m.files):
        start = received[index]
        if start >= entry.size_bytes:
            continue
        with open(paths[entry.path], "rb") as f:
            f.seek(start)
            offset = start
            while offset < entry.size_bytes:
                data = f.read(min(CHUNK_BYTES, entry.size_bytes - offset))
                if not data:
                    break  # the file shrank: the commit's hash check refuses it
                yield artifact_pb2.UploadChunksRequest(upload_id=upload_id, file_index=index, offset=offset, data=data)
                offset += len(data)


def _write_chunk(tmp: Path, m: Manifest, chunk, state: dict) -> None:
    index = chunk.file_index
    if not 0 <= index < len(m.files):
        raise ArtifactCorrupt(f"artifact {m.key}: chunk of file {index}, which the manifest does not have")
    cur = state.get("index")
    if cur is None or index != cur:
        _finish(tmp, m, state, upto=index)
        entry = m.files[index]
        target = tmp / entry.path
        target.parent.mkdir(parents=True, exist_ok=True)
        state.update(index=index, f=open(target, "wb", buffering=0), digest=hashlib.sha256(), size=0)
    if chunk.offset != state["size"]:
        raise ArtifactCorrupt(f"artifact {m.key}: chunk at offset {chunk.offset}, expected {state['size']}")
    data = chunk.data
    append_hashing(state["f"], state["digest"], data)
    state["size"] += len(data)


def _finish(tmp: Path, m: Manifest, state: dict, *, upto: int) -> None:
    """Close and verify the open file; files before ``upto`` not sent at all must be empty."""
    cur = state.get("index")
    if cur is not None:
        state["f"].close()
        verify(m, m.files[cur], state["size"], state["digest"].hexdigest())
        state["done"] = cur
        state["index"] = None
    start = state.get("done", -1) + 1
    for i in range(start, upto):
        entry = m.files[i]
        target = tmp / entry.path
        if target.exists():
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        target.touch()
        verify(m, entry, 0, hashlib.sha256().hexdigest())
        state["done"] = i


def _close(state: dict) -> None:
    f = state.get("f")
    if f is not None and not f.closed:
        f.close()
