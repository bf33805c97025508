"""The ``s3`` artifact store: any S3-compatible object store (AWS S3, SeaweedFS, MinIO, Ceph).

Objects under the bucket's ``prefix``::

    <prefix><key>/.manifest.json     the commit point, written last
    <prefix><key>/.data/<path>       the files
    <prefix>.uploads/<upload id>/    a presigned upload: announce.json, files/<index> (staged)

Presigned uploads let a trainer without S3 credentials write: :meth:`S3ArtifactStore.begin_upload`
stores the announced manifest and signs one PUT URL per file, bound to a staging object, its size
and its SHA-256 (the store refuses other bytes); :meth:`~S3ArtifactStore.commit_upload` checks
each staged object's size and checksum (HEAD), copies it under the key and writes the manifest
last, conditional on none being there. Only the holder of these credentials (the scheduler)
signs and commits; a staged upload never committed is removed by the bucket's lifecycle rule on
``.uploads/``.

A file over ``multipart_part_bytes`` (at most 5 GiB, S3's limit of one PUT) goes in parts: the
store starts a multipart upload of its staging object and signs one PUT per part, bound to the
part's size; the commit checks every part's size, assembles them (CompleteMultipartUpload) and
copies the file in parts (UploadPartCopy; CopyObject stops at 5 GiB). The bucket cannot check
such a file's SHA-256, which every read does. An upload in parts that fails at commit, or that
nobody resumed for a while (:meth:`~S3ArtifactStore.abort_abandoned_uploads`), is aborted.

The store's own puts and gets move the files of a folder with one boto3 transfer manager (its
multipart uploads and parallel ranged GETs; a get takes a file up to 64 MiB by one GET); a put
hashes the files while they are sent, a get hashes each file in order as it is written
(read through a memory map of the bytes written so far) and checks it against the
manifest. A range that boto3 fetched again after a broken stream makes the get hash that file's
final bytes once more, so the check is always of the bytes left on disk.

Credentials come from the standard AWS chain (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``,
``AWS_PROFILE``, ``~/.aws/credentials``, instance roles), never from task specs or this
module's arguments, and no message ever contains a secret. boto3 is imported on first use, so
the client role does not need it.
"""

from __future__ import annotations

import base64
import hashlib
import heapq
import mmap
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping

from opentinker_common.artifacts.errors import (
    ArtifactCorrupt,
    ArtifactError,
    ArtifactExists,
    ArtifactNotFound,
    InvalidArtifact,
    StoreAuthError,
    StoreUnavailable,
)
from opentinker_common.artifacts.manifest import (
    CHUNK_BYTES,
    ArtifactRef,
    FileEntry,
    Manifest,
    check_key,
    check_rel_path,
    folder_files,
    scan_folder,
)
from opentinker_common.artifacts.store import ArtifactStore, verify

__all__ = ["S3Location", "S3ArtifactStore", "PresignedRequest", "S3UploadStatus"]

MANIFEST_NAME = ".manifest.json"
DATA_NAME = ".data"
UPLOADS_NAME = ".uploads"
#: The largest object one PUT or CopyObject can write, and the largest part (bytes): S3's limit.
MAX_PUT_BYTES = 5 * 1024**3
#: A get fetches a file of at most this many bytes (64 MiB) by one GET, a larger one by parallel
#: ranged GETs: one stream is the faster below.
ONE_GET_BYTES = 64 * 1024 * 1024
#: The smallest part of a multipart upload but its last (bytes): S3's limit.
MIN_PART_BYTES = 5 * 1024**2
#: The most parts of one multipart upload: S3's limit.
MAX_PARTS = 10_000
_AUTH_CODES = frozenset(
    {
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "AccessDenied",
        "InvalidToken",
        "ExpiredToken",
        "InvalidClientTokenId",
        "AuthorizationHeaderMalformed",
        "403",
    }
)
_NOT_FOUND_CODES = frozenset({"NoSuchKey", "404", "NotFound"})
#: CompleteMultipartUpload's refusals of the parts themselves: they are dropped and sent again.
_REFUSED_PARTS_CODES = frozenset({"InvalidPart", "InvalidPartOrder", "EntityTooSmall", "NoSuchUpload"})


@dataclass(frozen=True)
class S3Location:
    """Where an ``s3`` store is: ``endpoint`` (``http(s)://host:port``; empty = AWS), ``bucket``,
    ``prefix`` (``""`` or ending with ``/``), ``region``."""

    bucket: str
    endpoint: str = ""
    prefix: str = ""
    region: str = "us-east-1"

    def __post_init__(self) -> None:
        if not self.bucket:
            raise InvalidArtifact("s3.bucket: expected a bucket name, got ''")
        if self.prefix and not self.prefix.endswith("/"):
            object.__setattr__(self, "prefix", self.prefix + "/")
        if self.prefix:
            check_key(self.prefix.rstrip("/"))

    def describe(self) -> str:
        return f"s3://{self.bucket}/{self.prefix} at {self.endpoint or 'AWS'}"


@dataclass(frozen=True)
class PresignedRequest:
    """One signed HTTP request: ``method`` ``url`` with exactly ``headers``, for file
    ``file_index`` of a manifest, refused by the store after ``expires_unix_s``. A PUT sends the
    file's bytes from ``offset``, as many as its ``Content-Length`` header says: the whole file,
    or one part of it."""

    file_index: int
    method: str
    url: str
    headers: dict[str, str]
    expires_unix_s: int
    offset: int = 0


@dataclass(frozen=True)
class S3UploadStatus:
    """An announced presigned upload: its id, the bytes staged of each file (manifest order),
    whether the key already holds exactly this manifest, and a PUT for each file still to send."""

    upload_id: str
    received_bytes: tuple[int, ...]
    committed: bool = False
    puts: tuple[PresignedRequest, ...] = ()


def _checksum(sha256_hex: str) -> str:
    """The ``x-amz-checksum-sha256`` value (base64) of a hex SHA-256."""
    return base64.b64encode(bytes.fromhex(sha256_hex)).decode()


class S3ArtifactStore(ArtifactStore):
    """Artifacts in an S3 bucket. Thread-safe (one boto3 client, which is).

    Args:
        location: bucket, prefix, endpoint, region.
        connect_timeout_s, read_timeout_s: per request (seconds).
        max_attempts: boto3's own retries of one request (standard mode).
        multipart_part_bytes: a presigned upload sends a file larger than this in parts of this
            size, which the store assembles at commit; smaller files go in one PUT, whose bytes
            the bucket checks against the file's SHA-256. 5 MiB to 5 GiB.

    Raises:
        InvalidArtifact: ``multipart_part_bytes`` out of range.
    """

    backend = "s3"

    def __init__(
        self,
        location: S3Location,
        *,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float = 60.0,
        max_attempts: int = 3,
        multipart_part_bytes: int = MAX_PUT_BYTES,
    ) -> None:
        import boto3
        from botocore.config import Config

        if not MIN_PART_BYTES <= multipart_part_bytes <= MAX_PUT_BYTES:
            raise InvalidArtifact(
                f"multipart_part_bytes: expected {MIN_PART_BYTES} to {MAX_PUT_BYTES} bytes, got {multipart_part_bytes}"
            )
        self.location = location
        self.multipart_part_bytes = multipart_part_bytes
        #: Held from the check that a key is free to its manifest's write, so two commits of
        #: one key in this process cannot both copy their files under it.
        self._commit_lock = threading.Lock()
        session = boto3.session.Session()
        config = Config(
            connect_timeout=connect_timeout_s,
            read_timeout=read_timeout_s,
            retries={"max_attempts": max_attempts, "mode": "standard"},
            s3={"addressing_style": "path"},
            # SeaweedFS and other S3-compatible stores differ on the newer integrity headers
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        where = {"endpoint_url": location.endpoint or None, "region_name": location.region or None}
        self._client = session.client("s3", config=config, **where)
        #: The client of :meth:`get_folder`'s transfers. With responses checked "when_supported",
        #: as at boto3's defaults, the transfer manager asks an object's size first (HEAD) and
        #: fetches all its ranges at once; "when_required" makes it fetch the first range alone.
        self._reader = session.client(
            "s3", config=config.merge(Config(response_checksum_validation="when_supported")), **where
        )

    # ------------------------------------------------------------------ helpers
    def describe(self) -> str:
        return f"S3 artifact store {self.location.describe()}"

    def _obj(self, key: str, *rest: str) -> str:
        return self.location.prefix + "/".join((check_key(key), *rest))

    def _error(self, exc: Exception, what: str) -> ArtifactError:
        """A store error for a botocore/boto3 exception, in words without secrets."""
        from botocore import exceptions as bx

        from boto3.exceptions import S3UploadFailedError

        endpoint = self.location.endpoint or "AWS S3"
        if isinstance(exc, ArtifactError):
            return exc
        if isinstance(exc, S3UploadFailedError) and isinstance(exc.__context__, bx.ClientError):
            # upload_file wraps the store's refusal (a 500 on a part, a 403) in its own error
            return self._error(exc.__context__, what)
        if isinstance(exc, bx.NoCredentialsError):
            return StoreAuthError(
                f"{self.describe()}: no credentials found while {what}; set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE, ~/.aws/credentials) for this process"
            )
        if isinstance(exc, bx.ClientError):
            code = str(exc.response.get("Error", {}).get("Code", ""))
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code in _AUTH_CODES or status == 403:
                return StoreAuthError(
                    f"{self.describe()}: the store refused the credentials while {what} ({code or status}); "
                    f"check the access key {self._key_hint()} and its secret in this process's AWS environment"
                )
            if code == "NoSuchBucket":
                return StoreUnavailable(f"{self.describe()}: bucket {self.location.bucket!r} does not exist")
            if code in _NOT_FOUND_CODES or status == 404:
                return ArtifactNotFound(f"{what}: not found in the {self.describe()}")
            return StoreUnavailable(f"{self.describe()}: S3 error {code or status} while {what}")
        if isinstance(exc, (bx.EndpointConnectionError, bx.ConnectTimeoutError, bx.ReadTimeoutError)) or isinstance(
            exc, (bx.ConnectionError, bx.HTTPClientError, OSError)
        ):
            return StoreUnavailable(
                f"S3 endpoint {endpoint} unreachable while {what} ({type(exc).__name__}); "
                f"is the store running and is {endpoint} the right address?"
            )
        if isinstance(exc, bx.BotoCoreError):
            return StoreUnavailable(f"{self.describe()}: {type(exc).__name__} while {what}")
        raise exc

    def _key_hint(self) -> str:
        try:
            creds = self._client._request_signer._credentials  # noqa: SLF001 - only the access key id's start
            akid = creds.access_key if creds is not None else ""
        except AttributeError:
            akid = ""
        return f"{akid[:4]}..." if akid else "(none)"

    # ------------------------------------------------------------------ the contract
    def check(self) -> None:
        try:
            # a listing, not HEAD: its error body names the reason (SignatureDoesNotMatch ...)
            self._client.list_objects_v2(Bucket=self.location.bucket, Prefix=self.location.prefix, MaxKeys=1)
        except Exception as exc:  # noqa: BLE001 - mapped
            err = self._error(exc, f"checking bucket {self.location.bucket!r}")
            if isinstance(err, ArtifactNotFound):
                err = StoreUnavailable(f"{self.describe()}: bucket {self.location.bucket!r} does not exist")
            raise err from None

    def _data_objects(self, key: str) -> dict[str, int]:
        """The data objects under ``key`` and their sizes (bytes)."""
        out = {}
        paginator = self._client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.location.bucket, Prefix=self._obj(key, DATA_NAME) + "/"):
            out.update((o["Key"], int(o["Size"])) for o in page.get("Contents", ()))
        return out

    def _transfers(self, client=None):
        """A boto3 transfer manager over ``client`` (this store's): parts and threads as boto3's
        ``upload_file`` and ``download_file`` use them, for every file of one put or get."""
        from boto3.s3.transfer import TransferConfig, create_transfer_manager

        return create_transfer_manager(client or self._client, TransferConfig())

    def put_folder(self, key: str, folder: Path, *, meta: Mapping[str, str] | None = None) -> ArtifactRef:
        """Upload the files and hash them at the same time; the manifest follows both.

        A key that holds a manifest already is hashed first and nothing is sent: the same
        content returns its ref, other content raises ArtifactExists.
        """
        check_key(key)
        folder = Path(folder)
        found = folder_files(folder)
        names = [check_rel_path(p.relative_to(folder).as_posix()) for p in found]
        try:
            held = self._held_manifest(key)
        except ArtifactCorrupt:
            held = None  # a manifest that does not parse commits nothing: it is written over
        if held is not None:
            m = Manifest(key, tuple(e for _, e in scan_folder(folder, found)), meta or {})
            if held.sha256 == m.sha256:
                return m.ref()
            raise ArtifactExists(
                f"artifact {key} is already committed with other content (manifest sha256 {held.sha256[:16]}...); "
                "committed artifacts are immutable: store it under a new key"
            )
        bucket = self.location.bucket
        try:
            with self._transfers() as transfers:
                sent = [transfers.upload(str(p), bucket, self._obj(key, DATA_NAME, n)) for p, n in zip(found, names)]
                files = scan_folder(folder, found)  # while the transfer threads send
                for future in sent:
                    future.result()
            m = Manifest(key, tuple(e for _, e in files), meta or {})
            held_objects = self._data_objects(key)  # every file is there with its size before the manifest is
            for entry in m.files:
                size = held_objects.get(self._obj(key, DATA_NAME, entry.path))
                if size != entry.size_bytes:
                    raise StoreUnavailable(
                        f"{self.describe()}: {key}/{entry.path} holds {size} bytes after upload, "
                        f"not {entry.size_bytes}; nothing was committed"
                    )
            self._client.put_object(
                Bucket=bucket, Key=self._obj(key, MANIFEST_NAME), Body=m.to_json(), ContentType="application/json"
            )
            stale = set(held_objects) - {self._obj(key, DATA_NAME, e.path) for e in m.files}  # of a failed put
            self._delete_objects(sorted(stale))
        except Exception as exc:  # noqa: BLE001 - mapped
            raise self._error(exc, f"writing {key}") from None
        return m.ref()

    def _held_manifest(self, key: str) -> Manifest | None:
        try:
            return self.manifest(key)
        except ArtifactNotFound:
            return None

    def manifest(self, key: str, *, expect_sha256: str = "") -> Manifest:
        try:
            resp = self._client.get_object(Bucket=self.location.bucket, Key=self._obj(key, MANIFEST_NAME))
            data = resp["Body"].read()
        except Exception as exc:  # noqa: BLE001 - mapped
            err = self._error(exc, f"reading artifact {key}")
            if isinstance(err, ArtifactNotFound):
                err = ArtifactNotFound(f"artifact {key} not found in the {self.describe()}")
            raise err from None
        return Manifest.from_json(data, key=key, expect_sha256=expect_sha256)

    def read_chunks(self, manifest: Manifest, entry: FileEntry, *, offset: int = 0) -> Iterator[bytes]:
        if entry.size_bytes == 0 or offset >= entry.size_bytes:
            return
        try:
            resp = self._client.get_object(
                Bucket=self.location.bucket,
                Key=self._obj(manifest.key, DATA_NAME, entry.path),
                Range=f"bytes={offset}-",
            )
            body = resp["Body"]
            yield from body.iter_chunks(CHUNK_BYTES)
        except Exception as exc:  # noqa: BLE001 - mapped
            raise self._error(exc, f"reading {manifest.key}/{entry.path}") from None

    def _fetch_files(self, key: str, m: Manifest, folder: Path) -> None:
        """Download the files and check each against the manifest. A file over
        :data:`ONE_GET_BYTES` comes by boto3's parallel ranged GETs (:class:`_RangeFile`) while
        this thread hashes its bytes in order as they are written; a smaller one by one GET
        (:meth:`_fetch_file`), hashed as it streams. The smaller ones come first, while the large
        ones go on, so the last hash of a large file is the last work of the get."""
        changed = threading.Condition()
        files = [_RangeFile(folder / entry.path, entry.size_bytes, changed) for entry in m.files]
        try:
            try:
                with self._transfers(self._reader) as transfers:
                    got = [
                        transfers.download(
                            self.location.bucket, self._obj(key, DATA_NAME, entry.path), f, subscribers=[f]
                        )
                        if entry.size_bytes > ONE_GET_BYTES
                        else None
                        for entry, f in zip(m.files, files)
                    ]
                    one_get = {
                        i: self._fetch_file(m, entry, f.path)
                        for i, (entry, f, future) in enumerate(zip(m.files, files, got))
                        if future is None
                    }
                    hashed = [
                        one_get[i] if future is None else f.hash_as_written(future)
                        for i, (f, future) in enumerate(zip(files, got))
                    ]
                    for future in got:
                        if future is not None:
                            future.result()
            except Exception as exc:  # noqa: BLE001 - mapped
                raise self._error(exc, f"reading {key}") from None
        except BaseException:
            for f in files:
                f.close()
            raise
        for entry, (size, sha256) in zip(m.files, hashed):
            verify(m, entry, size, sha256)

    def list(self, prefix: str = "") -> list[str]:
        keys = []
        suffix = "/" + MANIFEST_NAME
        try:
            paginator = self._client.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=self.location.bucket, Prefix=self.location.prefix + prefix):
                for o in page.get("Contents", ()):
                    k = o["Key"]
                    if k.endswith(suffix):
                        keys.append(k[len(self.location.prefix) : -len(suffix)])
        except Exception as exc:  # noqa: BLE001 - mapped
            raise self._error(exc, f"listing {prefix or 'all artifacts'}") from None
        return sorted(keys)

    def _delete_objects(self, names: list[str]) -> None:
        for i in range(0, len(names), 1000):
            batch = names[i : i + 1000]
            self._client.delete_objects(
                Bucket=self.location.bucket, Delete={"Objects": [{"Key": n} for n in batch], "Quiet": True}
            )

    def delete(self, key: str) -> bool:
        try:
            try:
                self._client.head_object(Bucket=self.location.bucket, Key=self._obj(key, MANIFEST_NAME))
                existed = True
            except Exception as exc:  # noqa: BLE001 - mapped
                if not isinstance(self._error(exc, f"deleting {key}"), ArtifactNotFound):
                    raise
                existed = False
            self._client.delete_object(Bucket=self.location.bucket, Key=self._obj(key, MANIFEST_NAME))
            data = sorted(self._data_objects(key))
            self._delete_objects(data)
        except Exception as exc:  # noqa: BLE001 - mapped
            raise self._error(exc, f"deleting {key}") from None
        return existed or bool(data)

    # ------------------------------------------------------------------ presigned uploads
    def _staged(self, upload_id: str, *rest: str) -> str:
        if not (len(upload_id) == 32 and all(c in "0123456789abcdef" for c in upload_id)):
            raise InvalidArtifact(f"upload_id: expected 32 hex digits, got {upload_id[:40]!r}")
        return self.location.prefix + "/".join((UPLOADS_NAME, upload_id, *rest))

    def _head(self, name: str) -> dict | None:
        """HEAD of ``name`` with its checksum, or None when there is no such object."""
        try:
            return self._client.head_object(Bucket=self.location.bucket, Key=name, ChecksumMode="ENABLED")
        except Exception as exc:  # noqa: BLE001 - mapped
            if isinstance(self._error(exc, f"reading {name}"), ArtifactNotFound):
                return None
            raise

    def _staged_size(self, name: str, f: FileEntry) -> int:
        """Bytes of the staged object ``name`` when it holds file ``f`` whole, else 0. A file sent
        in one PUT must carry its SHA-256 checksum; one assembled from parts carries none."""
        head = self._head(name)
        if head is None or int(head["ContentLength"]) != f.size_bytes:
            return 0
        if not self._in_parts(f) and head.get("ChecksumSHA256") != _checksum(f.sha256):
            return 0
        return f.size_bytes

    def _in_parts(self, f: FileEntry) -> bool:
        return f.size_bytes > self.multipart_part_bytes

    def _part_sizes(self, f: FileEntry) -> list[int]:
        """Bytes of each part of file ``f`` (part ``n`` is item ``n - 1``)."""
        step = self.multipart_part_bytes
        return [min(step, f.size_bytes - start) for start in range(0, f.size_bytes, step)]

    def _multipart_uploads(self, prefix: str) -> list[dict]:
        """The unfinished multipart uploads of objects starting with ``prefix``, oldest first."""
        out: list[dict] = []
        paginator = self._client.get_paginator("list_multipart_uploads")
        for page in paginator.paginate(Bucket=self.location.bucket, Prefix=prefix):
            out.extend(page.get("Uploads", ()))
        return sorted(out, key=lambda u: u["Initiated"])

    def _parts_held(self, name: str, s3_upload_id: str, f: FileEntry) -> dict[int, dict]:
        """The parts of file ``f`` the multipart upload holds with their size, by part number
        (the newest where a store lists a part number twice)."""
        want = self._part_sizes(f)
        held: dict[int, dict] = {}
        paginator = self._client.get_paginator("list_parts")
        for page in paginator.paginate(Bucket=self.location.bucket, Key=name, UploadId=s3_upload_id):
            for part in page.get("Parts", ()):
                n = int(part["PartNumber"])
                if not 1 <= n <= len(want) or int(part["Size"]) != want[n - 1]:
                    continue
                if n not in held or part["LastModified"] >= held[n]["LastModified"]:
                    held[n] = part
        return held

    def begin_upload(self, m: Manifest, *, expires_s: int) -> S3UploadStatus:
        """Announce ``m`` and sign, valid ``expires_s`` seconds, a PUT for each file not staged
        yet, or for a file over ``multipart_part_bytes`` a PUT for each of its parts not staged
        yet (a multipart upload this store starts). Idempotent: the same manifest gets the same
        upload id and its multipart uploads.

        Raises:
            InvalidArtifact: a file that needs more than 10000 parts. ArtifactExists: the key holds
                another committed manifest. StoreUnavailable, StoreAuthError.
        """
        for f in m.files:
            if len(self._part_sizes(f)) > MAX_PARTS:
                raise InvalidArtifact(
                    f"file {f.path!r}: {f.size_bytes} bytes is over the {MAX_PARTS} parts of "
                    f"{self.multipart_part_bytes} bytes one upload to the s3 store can write "
                    "(artifacts.s3.multipart_part_bytes); split it"
                )
        upload_id = hashlib.sha256(m.to_json()).hexdigest()[:32]
        try:
            if self._committed(m):
                return S3UploadStatus(upload_id, tuple(f.size_bytes for f in m.files), committed=True)
            self._client.put_object(
                Bucket=self.location.bucket,
                Key=self._staged(upload_id, "announce.json"),
                Body=m.to_json(),
                ContentType="application/json",
            )
            received, puts = [], []
            expires = int(time.time()) + expires_s
            for i, f in enumerate(m.files):
                name = self._staged(upload_id, "files", str(i))
                held = self._staged_size(name, f)
                if held == f.size_bytes and f.size_bytes > 0:
                    received.append(held)
                    continue
                if self._in_parts(f):
                    s3_upload_id = self._multipart_upload(name)
                    parts = self._parts_held(name, s3_upload_id, f)
                    received.append(sum(int(p["Size"]) for p in parts.values()))
                    for n, size in enumerate(self._part_sizes(f), start=1):
                        if n in parts:
                            continue
                        url = self._client.generate_presigned_url(
                            "upload_part",
                            Params={
                                "Bucket": self.location.bucket,
                                "Key": name,
                                "UploadId": s3_upload_id,
                                "PartNumber": n,
                                "ContentLength": size,
                            },
                            ExpiresIn=expires_s,
                        )
                        offset = (n - 1) * self.multipart_part_bytes
                        puts.append(PresignedRequest(i, "PUT", url, {"Content-Length": str(size)}, expires, offset))
                    continue
                received.append(0)
                checksum = _checksum(f.sha256)
                url = self._client.generate_presigned_url(
                    "put_object",
                    Params={
                        "Bucket": self.location.bucket,
                        "Key": name,
                        "ContentLength": f.size_bytes,
                        "ChecksumSHA256": checksum,
                    },
                    ExpiresIn=expires_s,
                )
                headers = {"Content-Length": str(f.size_bytes), "x-amz-checksum-sha256": checksum}
                puts.append(PresignedRequest(i, "PUT", url, headers, expires))
        except Exception as exc:  # noqa: BLE001 - mapped
            raise self._error(exc, f"starting the upload of {m.key}") from None
        return S3UploadStatus(upload_id, tuple(received), puts=tuple(puts))

    def _multipart_upload(self, name: str) -> str:
        """The S3 upload id of the multipart upload of the staged object ``name``, started here
        when there is none (the oldest, when a race started two)."""
        for upload in self._multipart_uploads(name):
            if upload["Key"] == name:
                return upload["UploadId"]
        return self._client.create_multipart_upload(Bucket=self.location.bucket, Key=name)["UploadId"]

    def _committed(self, m: Manifest) -> bool:
        """Whether ``m.key`` holds exactly ``m`` (ArtifactExists: it holds another manifest)."""
        try:
            held = self._held_manifest(m.key)
        except ArtifactCorrupt:
            return False  # a manifest that does not parse commits nothing: it is written over
        if held is None:
            return False
        if held.sha256 == m.sha256:
            return True
        raise ArtifactExists(
            f"artifact {m.key} is already committed with other content (manifest sha256 {held.sha256[:16]}...); "
            "committed artifacts are immutable: store it under a new key"
        )

    def upload_manifest(self, upload_id: str) -> Manifest:
        """The manifest announced for ``upload_id``.

        Raises:
            ArtifactNotFound: unknown upload id. InvalidArtifact: not an upload id.
        """
        name = self._staged(upload_id, "announce.json")
        try:
            data = self._client.get_object(Bucket=self.location.bucket, Key=name)["Body"].read()
        except Exception as exc:  # noqa: BLE001 - mapped
            err = self._error(exc, f"reading upload {upload_id}")
            if isinstance(err, ArtifactNotFound):
                err = ArtifactNotFound(
                    f"upload {upload_id} is unknown (finished, expired or never begun); begin it again"
                )
            raise err from None
        return Manifest.from_json(data)

    def _check_staged(self, upload_id: str, i: int, m: Manifest) -> None:
        """Check the staged file ``i`` of the upload: a file sent in one PUT by size and SHA-256
        (HEAD); a file sent in parts by every part's size, then assembled (CompleteMultipartUpload).

        Raises:
            UploadIncomplete: bytes missing. ArtifactCorrupt: other bytes than announced, or parts
                the store refused to assemble (dropped: send them again).
        """
        from opentinker_common.artifacts.local import UploadIncomplete

        f = m.files[i]
        name = self._staged(upload_id, "files", str(i))
        if self._in_parts(f):
            if self._staged_size(name, f) == f.size_bytes:
                return  # assembled by a commit that failed later
            s3_upload_id = next((u["UploadId"] for u in self._multipart_uploads(name) if u["Key"] == name), None)
            if s3_upload_id is None:
                raise UploadIncomplete(f"upload {upload_id}: file {f.path} holds 0 of {f.size_bytes} bytes; send it")
            parts = self._parts_held(name, s3_upload_id, f)
            if len(parts) < len(self._part_sizes(f)):
                held = sum(int(p["Size"]) for p in parts.values())
                raise UploadIncomplete(
                    f"upload {upload_id}: file {f.path} holds {held} of {f.size_bytes} bytes "
                    f"({len(parts)} of {len(self._part_sizes(f))} parts); send the rest"
                )
            listed = [{"PartNumber": n, "ETag": parts[n]["ETag"]} for n in sorted(parts)]
            try:
                self._client.complete_multipart_upload(
                    Bucket=self.location.bucket, Key=name, UploadId=s3_upload_id, MultipartUpload={"Parts": listed}
                )
            except Exception as exc:  # noqa: BLE001 - mapped
                code = str(getattr(exc, "response", {}).get("Error", {}).get("Code", ""))
                if code not in _REFUSED_PARTS_CODES:
                    raise
                self._abort(name, s3_upload_id)
                raise ArtifactCorrupt(
                    f"upload of {m.key}: the store refused to assemble the parts of file {f.path} ({code}); "
                    "dropped them, send it again"
                ) from None
            if self._staged_size(name, f) != f.size_bytes:
                raise UploadIncomplete(f"upload {upload_id}: file {f.path} was not assembled whole; send it again")
            return
        head = self._head(name)
        if head is None:
            raise UploadIncomplete(f"upload {upload_id}: file {f.path} holds 0 of {f.size_bytes} bytes; send it")
        if int(head["ContentLength"]) != f.size_bytes:
            raise UploadIncomplete(
                f"upload {upload_id}: file {f.path} holds {head['ContentLength']} of {f.size_bytes} bytes; "
                "send it again"
            )
        if head.get("ChecksumSHA256") != _checksum(f.sha256):
            self._client.delete_object(Bucket=self.location.bucket, Key=name)
            raise ArtifactCorrupt(
                f"upload of {m.key}: file {f.path} was staged without the announced SHA-256 "
                f"{f.sha256[:16]}...; dropped it, send it again"
            )

    def commit_upload(self, upload_id: str) -> ArtifactRef:
        """Check every staged file of the upload (:meth:`_check_staged`), copy each under the key
        (in parts above ``multipart_part_bytes``: CopyObject stops at 5 GiB) and write the
        manifest last, only where none is (``If-None-Match: *``).

        Raises:
            ArtifactNotFound: unknown upload. UploadIncomplete: a file is not staged with its size.
            ArtifactCorrupt: a staged file's checksum is not the announced one (it is deleted: send
            it again). ArtifactExists: the key holds another committed manifest (the upload is
            dropped). StoreUnavailable, StoreAuthError.
        """
        m = self.upload_manifest(upload_id)
        bucket = self.location.bucket
        with self._commit_lock:
            try:
                if self._committed(m):
                    self._drop_upload(upload_id)
                    return m.ref()
            except ArtifactExists:
                self._drop_upload(upload_id)
                raise
            try:
                for i in range(len(m.files)):
                    self._check_staged(upload_id, i, m)
                old = set(self._data_objects(m.key))
                with self._copies() as copies:
                    copied = [
                        copies.copy(
                            {"Bucket": bucket, "Key": self._staged(upload_id, "files", str(i))},
                            bucket,
                            self._obj(m.key, DATA_NAME, f.path),
                            subscribers=[_KnownSize(f.size_bytes)],
                        )
                        for i, f in enumerate(m.files)
                    ]
                    for future in copied:
                        future.result()
                try:
                    self._client.put_object(
                        Bucket=bucket,
                        Key=self._obj(m.key, MANIFEST_NAME),
                        Body=m.to_json(),
                        ContentType="application/json",
                        IfNoneMatch="*",
                    )
                except Exception as exc:  # noqa: BLE001 - mapped
                    code = str(getattr(exc, "response", {}).get("Error", {}).get("Code", ""))
                    if code != "PreconditionFailed" or not self._committed(m):
                        raise
                stale = old - {self._obj(m.key, DATA_NAME, f.path) for f in m.files}
                self._delete_objects(sorted(stale))
            except Exception as exc:  # noqa: BLE001 - mapped
                raise self._error(exc, f"committing {m.key}") from None
        self._drop_upload(upload_id)
        return m.ref()

    def _copies(self):
        """A boto3 transfer manager that copies inside the bucket: CopyObject up to
        ``multipart_part_bytes``, UploadPartCopy in parts of that size above."""
        from boto3.s3.transfer import TransferConfig, create_transfer_manager

        step = self.multipart_part_bytes
        return create_transfer_manager(
            self._client, TransferConfig(multipart_threshold=step + 1, multipart_chunksize=step)
        )

    def _abort(self, name: str, s3_upload_id: str) -> None:
        try:
            self._client.abort_multipart_upload(Bucket=self.location.bucket, Key=name, UploadId=s3_upload_id)
        except Exception as exc:  # noqa: BLE001 - mapped
            if not isinstance(self._error(exc, f"aborting the upload of {name}"), ArtifactNotFound):
                raise

    def _drop_upload(self, upload_id: str) -> None:
        """Remove the staged upload: its multipart uploads (aborted) and its objects."""
        prefix = self._staged(upload_id) + "/"
        for upload in self._multipart_uploads(prefix):
            self._abort(upload["Key"], upload["UploadId"])
        names = []
        paginator = self._client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.location.bucket, Prefix=prefix):
            names.extend(o["Key"] for o in page.get("Contents", ()))
        self._delete_objects(names)

    def abort_abandoned_uploads(self, idle_s: float) -> list[str]:
        """Drop each staged upload with a multipart upload that has been idle ``idle_s`` seconds:
        not begun again (its announce rewritten) and no part received since. Its parts are
        aborted, so the bucket keeps no bytes of it.

        Returns:
            The upload ids dropped.
        """
        root = self.location.prefix + UPLOADS_NAME + "/"
        try:
            last: dict[str, float] = {}
            for upload in self._multipart_uploads(root):
                upload_id = upload["Key"][len(root) :].split("/", 1)[0]
                when = [upload["Initiated"].timestamp()]
                paginator = self._client.get_paginator("list_parts")
                for page in paginator.paginate(
                    Bucket=self.location.bucket, Key=upload["Key"], UploadId=upload["UploadId"]
                ):
                    when.extend(p["LastModified"].timestamp() for p in page.get("Parts", ()))
                last[upload_id] = max(last.get(upload_id, 0.0), *when)
            dropped = []
            now = time.time()
            for upload_id, at in sorted(last.items()):
                announce = self._head(self._staged(upload_id, "announce.json"))
                if announce is not None:
                    at = max(at, announce["LastModified"].timestamp())
                if now - at > idle_s:
                    self._drop_upload(upload_id)
                    dropped.append(upload_id)
        except Exception as exc:  # noqa: BLE001 - mapped
            raise self._error(exc, "dropping abandoned uploads") from None
        return dropped

    def presign_get(self, m: Manifest, *, expires_s: int) -> list[PresignedRequest]:
        """A GET, valid ``expires_s`` seconds, for each file of the committed ``m``, in its order."""
        expires = int(time.time()) + expires_s
        out = []
        for i, f in enumerate(m.files):
            url = self._client.generate_presigned_url(
                "get_object",
                Params={"Bucket": self.location.bucket, "Key": self._obj(m.key, DATA_NAME, f.path)},
                ExpiresIn=expires_s,
            )
            out.append(PresignedRequest(i, "GET", url, {}, expires))
        return out


class _KnownSize:
    """A boto3 transfer subscriber that gives the transfer the object's size (bytes), which
    the manifest holds, so boto3 does not ask the store (HEAD) for it."""

    def __init__(self, size_bytes: int) -> None:
        self.size_bytes = size_bytes

    def on_queued(self, future, **kwargs) -> None:
        future.meta.provide_transfer_size(self.size_bytes)

    def on_progress(self, future, bytes_transferred, **kwargs) -> None:
        pass

    def on_done(self, future, **kwargs) -> None:
        pass


#: The hashing thread of a get is woken each time this many more bytes of a file are written in
#: order (and at its last byte): few thread switches, and the bytes are still in the page cache.
_WAKE_BYTES = 4 * 1024 * 1024


class _RangeFile:
    """Where a download of one file goes. boto3 writes its ranges, in whatever order they
    arrive, at their offsets (``seek`` then ``write``, from its one I/O thread); ``written``
    counts the bytes from the start with no gap, and :meth:`hash_as_written` hashes those in
    order from another thread, through a memory map of the file (the page cache), so no range
    waits in memory and hashing runs beside the transfer. ``received`` counts every byte
    written: when it exceeds ``written`` some bytes were written twice, and the hash is taken
    again over the file's final bytes. Also the transfer's subscriber: its end wakes the hashing
    thread. The file is created at the first write and closed after its last byte, so a get of
    many files holds open only those in flight."""

    def __init__(self, path: Path, size_bytes: int, changed: threading.Condition) -> None:
        self.path = path
        self.size_bytes = size_bytes
        self.written = 0
        #: Bytes written in all, counted again where a range came twice.
        self.received = 0
        #: ``written`` when the hashing thread was last woken.
        self._told = 0
        self._changed = changed
        self._fd: int | None = None
        self._offset = 0
        #: Written ranges past ``written``: a heap of (start, end).
        self._ahead: list[tuple[int, int]] = []

    # ---- the file object boto3 writes to
    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        if whence != os.SEEK_SET:
            raise OSError("a download file seeks to absolute offsets only")
        self._offset = offset
        return offset

    def tell(self) -> int:
        return self._offset

    def write(self, data: bytes) -> int:
        start, end = self._offset, self._offset + len(data)
        self._offset = end
        if self._fd is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
        view = memoryview(data)
        at = start
        while view:
            n = os.pwrite(self._fd, view, at)
            view, at = view[n:], at + n
        with self._changed:
            self.received += len(data)
            before = self.written
            if end > self.written:
                heapq.heappush(self._ahead, (start, end))
            while self._ahead and self._ahead[0][0] <= self.written:
                self.written = max(self.written, heapq.heappop(self._ahead)[1])
            if self.written - self._told >= _WAKE_BYTES or (self.written >= self.size_bytes > before):
                self._told = self.written
                self._changed.notify_all()
        if self.written >= self.size_bytes:
            self.close()
        return len(data)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    # ---- the transfer's subscriber
    def on_queued(self, future, **kwargs) -> None:
        pass

    def on_progress(self, future, bytes_transferred, **kwargs) -> None:
        pass

    def on_done(self, future, **kwargs) -> None:
        with self._changed:
            self._changed.notify_all()

    # ---- the hashing thread
    def hash_as_written(self, future) -> tuple[int, str]:
        """Hash the file's bytes in order as they are written, until ``future`` (its transfer)
        is done and every byte written is hashed. Each pass hashes all the bytes written since
        the last through one memory map of the file, in one call that releases the GIL. When
        the whole file came and some bytes were written twice (a retried range), it is hashed
        again from the start, so the hash is that of the file as it is left. A transfer that
        failed leaves the hash short, and its partial file is not read again.

        Returns:
            The bytes hashed (the file's size when all came) and their SHA-256 (hex).
        """
        digest = hashlib.sha256()
        hashed = 0
        fd: int | None = None
        try:
            while True:
                with self._changed:
                    while self.written <= hashed and not future.done():
                        self._changed.wait(1.0)
                    upto, finished, received = self.written, future.done(), self.received
                if upto > hashed:
                    if fd is None:
                        fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
                    _hash_mapped(digest, fd, hashed, upto)
                    hashed = upto
                elif finished:
                    break
            if hashed == self.size_bytes and received > hashed:
                digest = hashlib.sha256()
                if hashed:
                    assert fd is not None
                    _hash_mapped(digest, fd, 0, hashed)
            return hashed, digest.hexdigest()
        finally:
            if fd is not None:
                os.close(fd)


def _hash_mapped(digest, fd: int, start: int, end: int) -> None:
    """Add bytes ``start`` to ``end`` of the file ``fd`` to ``digest``, read through a memory map
    of them: no copy out of the page cache, and its pages are mapped in one call.

    A read error or a truncation of the file under the map would raise SIGBUS, not OSError. The
    file is a private temporary one this get created and owns, and only bytes already written to
    it are mapped, so neither happens short of a failing disk."""
    base = start - start % mmap.ALLOCATIONGRANULARITY
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    with mmap.mmap(fd, end - base, flags=flags, prot=mmap.PROT_READ, offset=base) as mapped:
        with memoryview(mapped) as view, view[start - base :] as part:
            digest.update(part)


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
