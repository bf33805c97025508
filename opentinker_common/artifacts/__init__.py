"""Artifact stores: where checkpoints, datasets and exported policies live (torch-free).

One interface (:class:`ArtifactStore`: put a folder, get a folder, list, delete, manifest) and
its backends: :class:`LocalArtifactStore` (a folder; the scheduler's embedded default),
:class:`S3ArtifactStore` (any S3-compatible store, boto3; the scheduler's, which presigns
trainers' transfers) and :class:`RemoteArtifactStore` (the scheduler's store as trainers reach it:
``local`` over gRPC, ``s3`` by presigned URLs). Errors: :mod:`.errors`.
"""

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
from opentinker_common.artifacts.deleted import deleted_words
from opentinker_common.artifacts.local import LocalArtifactStore
from opentinker_common.artifacts.manifest import (
    ArtifactRef,
    FileEntry,
    Manifest,
    check_key,
    checkpoint_key,
    task_prefix,
)
from opentinker_common.artifacts.s3 import S3ArtifactStore, S3Location
from opentinker_common.artifacts.store import ArtifactStore

__all__ = [
    "ArtifactCorrupt",
    "ArtifactExists",
    "ArtifactError",
    "ArtifactNotFound",
    "ArtifactRef",
    "ArtifactStore",
    "FileEntry",
    "InvalidArtifact",
    "LocalArtifactStore",
    "Manifest",
    "S3ArtifactStore",
    "S3Location",
    "StoreAuthError",
    "StoreFull",
    "StoreUnavailable",
    "check_key",
    "checkpoint_key",
    "deleted_words",
    "task_prefix",
]
