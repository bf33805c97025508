from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ArtifactFile(_message.Message):
    __slots__ = ("path", "size_bytes", "sha256")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    path: str
    size_bytes: int
    sha256: str
    def __init__(self, path: _Optional[str] = ..., size_bytes: _Optional[int] = ..., sha256: _Optional[str] = ...) -> None: ...

class ArtifactManifest(_message.Message):
    __slots__ = ("key", "files", "meta", "manifest_sha256", "total_bytes")
    class MetaEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    KEY_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    META_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_SHA256_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    key: str
    files: _containers.RepeatedCompositeFieldContainer[ArtifactFile]
    meta: _containers.ScalarMap[str, str]
    manifest_sha256: str
    total_bytes: int
    def __init__(self, key: _Optional[str] = ..., files: _Optional[_Iterable[_Union[ArtifactFile, _Mapping]]] = ..., meta: _Optional[_Mapping[str, str]] = ..., manifest_sha256: _Optional[str] = ..., total_bytes: _Optional[int] = ...) -> None: ...

class S3Location(_message.Message):
    __slots__ = ("endpoint", "bucket", "prefix", "region")
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    endpoint: str
    bucket: str
    prefix: str
    region: str
    def __init__(self, endpoint: _Optional[str] = ..., bucket: _Optional[str] = ..., prefix: _Optional[str] = ..., region: _Optional[str] = ...) -> None: ...

class DescribeStoreRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DescribeStoreResponse(_message.Message):
    __slots__ = ("backend", "s3", "checkpoint_retries", "max_failed_checkpoints")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    S3_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_RETRIES_FIELD_NUMBER: _ClassVar[int]
    MAX_FAILED_CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    backend: str
    s3: S3Location
    checkpoint_retries: int
    max_failed_checkpoints: int
    def __init__(self, backend: _Optional[str] = ..., s3: _Optional[_Union[S3Location, _Mapping]] = ..., checkpoint_retries: _Optional[int] = ..., max_failed_checkpoints: _Optional[int] = ...) -> None: ...

class BeginUploadRequest(_message.Message):
    __slots__ = ("manifest",)
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    manifest: ArtifactManifest
    def __init__(self, manifest: _Optional[_Union[ArtifactManifest, _Mapping]] = ...) -> None: ...

class PresignedRequest(_message.Message):
    __slots__ = ("file_index", "method", "url", "headers", "expires_unix_s", "offset")
    class HeadersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    FILE_INDEX_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    URL_FIELD_NUMBER: _ClassVar[int]
    HEADERS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    file_index: int
    method: str
    url: str
    headers: _containers.ScalarMap[str, str]
    expires_unix_s: int
    offset: int
    def __init__(self, file_index: _Optional[int] = ..., method: _Optional[str] = ..., url: _Optional[str] = ..., headers: _Optional[_Mapping[str, str]] = ..., expires_unix_s: _Optional[int] = ..., offset: _Optional[int] = ...) -> None: ...

class BeginUploadResponse(_message.Message):
    __slots__ = ("upload_id", "received_bytes", "committed", "puts")
    UPLOAD_ID_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    PUTS_FIELD_NUMBER: _ClassVar[int]
    upload_id: str
    received_bytes: _containers.RepeatedScalarFieldContainer[int]
    committed: bool
    puts: _containers.RepeatedCompositeFieldContainer[PresignedRequest]
    def __init__(self, upload_id: _Optional[str] = ..., received_bytes: _Optional[_Iterable[int]] = ..., committed: _Optional[bool] = ..., puts: _Optional[_Iterable[_Union[PresignedRequest, _Mapping]]] = ...) -> None: ...

class UploadChunksRequest(_message.Message):
    __slots__ = ("upload_id", "file_index", "offset", "data")
    UPLOAD_ID_FIELD_NUMBER: _ClassVar[int]
    FILE_INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    upload_id: str
    file_index: int
    offset: int
    data: bytes
    def __init__(self, upload_id: _Optional[str] = ..., file_index: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class UploadChunksResponse(_message.Message):
    __slots__ = ("received_bytes",)
    RECEIVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    received_bytes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, received_bytes: _Optional[_Iterable[int]] = ...) -> None: ...

class CommitUploadRequest(_message.Message):
    __slots__ = ("upload_id",)
    UPLOAD_ID_FIELD_NUMBER: _ClassVar[int]
    upload_id: str
    def __init__(self, upload_id: _Optional[str] = ...) -> None: ...

class CommitUploadResponse(_message.Message):
    __slots__ = ("manifest",)
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    manifest: ArtifactManifest
    def __init__(self, manifest: _Optional[_Union[ArtifactManifest, _Mapping]] = ...) -> None: ...

class StatArtifactRequest(_message.Message):
    __slots__ = ("key", "expect_manifest_sha256")
    KEY_FIELD_NUMBER: _ClassVar[int]
    EXPECT_MANIFEST_SHA256_FIELD_NUMBER: _ClassVar[int]
    key: str
    expect_manifest_sha256: str
    def __init__(self, key: _Optional[str] = ..., expect_manifest_sha256: _Optional[str] = ...) -> None: ...

class StatArtifactResponse(_message.Message):
    __slots__ = ("manifest",)
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    manifest: ArtifactManifest
    def __init__(self, manifest: _Optional[_Union[ArtifactManifest, _Mapping]] = ...) -> None: ...

class DownloadArtifactRequest(_message.Message):
    __slots__ = ("key", "expect_manifest_sha256")
    KEY_FIELD_NUMBER: _ClassVar[int]
    EXPECT_MANIFEST_SHA256_FIELD_NUMBER: _ClassVar[int]
    key: str
    expect_manifest_sha256: str
    def __init__(self, key: _Optional[str] = ..., expect_manifest_sha256: _Optional[str] = ...) -> None: ...

class ArtifactChunk(_message.Message):
    __slots__ = ("file_index", "offset", "data")
    FILE_INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    file_index: int
    offset: int
    data: bytes
    def __init__(self, file_index: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class DownloadArtifactResponse(_message.Message):
    __slots__ = ("manifest", "chunk")
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    manifest: ArtifactManifest
    chunk: ArtifactChunk
    def __init__(self, manifest: _Optional[_Union[ArtifactManifest, _Mapping]] = ..., chunk: _Optional[_Union[ArtifactChunk, _Mapping]] = ...) -> None: ...

class PresignDownloadRequest(_message.Message):
    __slots__ = ("key", "expect_manifest_sha256")
    KEY_FIELD_NUMBER: _ClassVar[int]
    EXPECT_MANIFEST_SHA256_FIELD_NUMBER: _ClassVar[int]
    key: str
    expect_manifest_sha256: str
    def __init__(self, key: _Optional[str] = ..., expect_manifest_sha256: _Optional[str] = ...) -> None: ...

class PresignDownloadResponse(_message.Message):
    __slots__ = ("manifest", "gets")
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    GETS_FIELD_NUMBER: _ClassVar[int]
    manifest: ArtifactManifest
    gets: _containers.RepeatedCompositeFieldContainer[PresignedRequest]
    def __init__(self, manifest: _Optional[_Union[ArtifactManifest, _Mapping]] = ..., gets: _Optional[_Iterable[_Union[PresignedRequest, _Mapping]]] = ...) -> None: ...

class ListArtifactsRequest(_message.Message):
    __slots__ = ("prefix",)
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    prefix: str
    def __init__(self, prefix: _Optional[str] = ...) -> None: ...

class ListArtifactsResponse(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, keys: _Optional[_Iterable[str]] = ...) -> None: ...
