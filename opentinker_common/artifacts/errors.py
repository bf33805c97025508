"""Errors of an artifact store; every backend raises these and nothing else for a store fault.

The scheduler maps them to gRPC status codes (``opentinker_scheduler.errors``):
:class:`InvalidArtifact` INVALID_ARGUMENT, :class:`ArtifactNotFound` NOT_FOUND,
:class:`ArtifactCorrupt` DATA_LOSS, :class:`ArtifactExists` ALREADY_EXISTS, :class:`StoreFull` RESOURCE_EXHAUSTED,
:class:`StoreAuthError` PERMISSION_DENIED, :class:`StoreUnavailable` UNAVAILABLE.
Messages never contain a secret (no secret key, no session token).
"""

from __future__ import annotations

__all__ = [
    "ArtifactError",
    "InvalidArtifact",
    "ArtifactNotFound",
    "ArtifactCorrupt",
    "ArtifactExists",
    "StoreFull",
    "StoreAuthError",
    "StoreUnavailable",
]


class ArtifactError(Exception):
    """Base class of every artifact store error."""

    #: Whether trying the same call again later may succeed (a fault, not bad input).
    retryable = False


class InvalidArtifact(ArtifactError):
    """Bad input: a key or relative path that is not allowed, a folder that is not a folder,
    an upload that does not match what was announced."""


class ArtifactNotFound(ArtifactError):
    """No committed artifact under the key (never written, deleted, or only half uploaded)."""


class ArtifactCorrupt(ArtifactError):
    """Bytes in the store do not match the manifest (size or SHA-256), or the manifest does not
    match the reference's hash. The artifact is refused; nothing of it is used."""


class ArtifactExists(ArtifactError):
    """A committed artifact already holds the key with other content. Committed artifacts are
    immutable: nothing of the new one was stored, and the committed one stays as it was."""


class StoreFull(ArtifactError):
    """The store has no room (a local store's disk is full). Nothing of the write was recorded."""

    retryable = True


class StoreAuthError(ArtifactError):
    """The store refused the credentials (unknown access key, wrong secret, no permission)."""


class StoreUnavailable(ArtifactError):
    """The store cannot be reached (connection refused, timeout, DNS); the message names the
    endpoint."""

    retryable = True
