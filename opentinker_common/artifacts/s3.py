"""The ``s3`` artifact store: any S3-compatible object store (AWS S3, SeaweedFS, MinIO, Ceph).

Objects under the bucket's ``prefix``::

    <prefix><key>/.manifest.json     the commit point, written last
    <prefix><key>/.data/<path>       the files (multipart above 64 MiB), each with metadata sha256

Credentials come from the standard AWS chain (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``,
``AWS_PROFILE``, ``~/.aws/credentials``, instance roles), never from task specs or this
module's arguments, and no message ever contains a secret. boto3 is imported on first use, so
the client role does not need it.
"""

from __future__ import annotations

import hashlib
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
    scan_folder,
)
from opentinker_common.artifacts.store import ArtifactStore

__all__ = ["S3Location", "S3ArtifactStore"]

MANIFEST_NAME = ".manifest.json"
DATA_NAME = ".data"
#: Files larger than this (bytes) are uploaded in parts of :data:`PART_BYTES`.
MULTIPART_THRESHOLD = 64 * 1024 * 1024
PART_BYTES = 16 * 1024 * 1024
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


class S3ArtifactStore(ArtifactStore):
    """Artifacts in an S3 bucket. Thread-safe (one boto3 client, which is).

    Args:
        location: bucket, prefix, endpoint, region.
        connect_timeout_s, read_timeout_s: per request (seconds).
        max_attempts: boto3's own retries of one request (standard mode).
    """

    backend = "s3"

    def __init__(
        self,
        location: S3Location,
        *,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float = 60.0,
        max_attempts: int = 3,
    ) -> None:
        import boto3
        from botocore.config import Config

        self.location = location
        self._client = boto3.session.Session().client(
            "s3",
            endpoint_url=location.endpoint or None,
            region_name=location.region or None,
            config=Config(
                connect_timeout=connect_timeout_s,
                read_timeout=read_timeout_s,
                retries={"max_attempts": max_attempts, "mode": "standard"},
                s3={"addressing_style": "path"},
                # SeaweedFS and other S3-compatible stores differ on the newer integrity headers
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required",
            ),
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

    def _data_objects(self, key: str) -> list[str]:
        out = []
        paginator = self._client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.location.bucket, Prefix=self._obj(key, DATA_NAME) + "/"):
            out.extend(o["Key"] for o in page.get("Contents", ()))
        return out

    def put_folder(self, key: str, folder: Path, *, meta: Mapping[str, str] | None = None) -> ArtifactRef:
        from boto3.s3.transfer import TransferConfig

        check_key(key)
        files = scan_folder(Path(folder))
        m = Manifest(key, tuple(e for _, e in files), meta or {})
        transfer = TransferConfig(multipart_threshold=MULTIPART_THRESHOLD, multipart_chunksize=PART_BYTES)
        bucket = self.location.bucket
        try:
            held = self._held_manifest(key)
        except ArtifactCorrupt:
            held = None  # a manifest that does not parse commits nothing: it is written over
        if held is not None:
            if held.sha256 == m.sha256:
                return m.ref()
            raise ArtifactExists(
                f"artifact {key} is already committed with other content (manifest sha256 {held.sha256[:16]}...); "
                "committed artifacts are immutable: store it under a new key"
            )
        try:
            old = set(self._data_objects(key))  # of a put that failed before its manifest
            for src, entry in files:
                self._client.upload_file(
                    str(src),
                    bucket,
                    self._obj(key, DATA_NAME, entry.path),
                    ExtraArgs={"Metadata": {"sha256": entry.sha256}},
                    Config=transfer,
                )
            for _, entry in files:  # every file is there with its size before the manifest is
                head = self._client.head_object(Bucket=bucket, Key=self._obj(key, DATA_NAME, entry.path))
                if int(head["ContentLength"]) != entry.size_bytes:
                    raise StoreUnavailable(
                        f"{self.describe()}: {key}/{entry.path} holds {head['ContentLength']} bytes after upload, "
                        f"not {entry.size_bytes}; nothing was committed"
                    )
            self._client.put_object(
                Bucket=bucket, Key=self._obj(key, MANIFEST_NAME), Body=m.to_json(), ContentType="application/json"
            )
            stale = old - {self._obj(key, DATA_NAME, e.path) for e in m.files}
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

    def get_folder(self, key: str, dest: Path, *, expect_sha256: str = "") -> Manifest:
        return super().get_folder(key, dest, expect_sha256=expect_sha256)

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
            data = self._data_objects(key)
            self._delete_objects(data)
        except Exception as exc:  # noqa: BLE001 - mapped
            raise self._error(exc, f"deleting {key}") from None
        return existed or bool(data)


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
