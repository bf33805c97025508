"""Download URLs of a checkpoint's files that any gateway instance serves.

A URL needs no key. Its token holds what it stands for: the API key that asked for it, the run,
the checkpoint's artifact key and when it expires. The token is sealed with AES-GCM under a
secret the gateway instances share (``--download-url-secret-file``), so any instance can open it
and no one else can read the key in it or change what it names. A gateway given no secret makes
a random one: its URLs work on that instance only, until it restarts.

The key inside stays the scheduler's to judge: a URL whose key was revoked downloads nothing.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from opentinker_gateway.errors import ApiError

__all__ = ["Download", "DownloadUrls", "MIN_SECRET_BYTES"]

#: Fewest bytes a shared secret file holds (surrounding whitespace not counted).
MIN_SECRET_BYTES = 32
#: Binds a token to this use of the secret.
_PURPOSE = b"opentinker gateway download url v1"
_NONCE_BYTES = 12
#: Longest token opened, in characters: a key, a run id and an artifact key with room to spare.
_MAX_TOKEN_CHARS = 4096


@dataclass(frozen=True)
class Download:
    """What a download URL's token stands for."""

    #: The OpenTinker API key that asked for the URL; the file is read with it.
    key: str
    run_id: str
    artifact_key: str
    #: Unix time, seconds, after which the URL is refused.
    expires: float


class DownloadUrls:
    """Seals and opens download URL tokens under one secret."""

    def __init__(self, secret: bytes) -> None:
        self._aead = AESGCM(hashlib.sha256(_PURPOSE + secret).digest())

    @classmethod
    def from_file(cls, path: Path) -> DownloadUrls:
        """The sealer of the secret in file ``path``.

        Raises:
            ValueError: the file cannot be read or holds fewer than :data:`MIN_SECRET_BYTES` bytes.
        """
        try:
            secret = Path(path).read_bytes().strip()
        except OSError as exc:
            raise ValueError(f"--download-url-secret-file: cannot read {path}: {exc.strerror}") from None
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(
                f"--download-url-secret-file: expected at least {MIN_SECRET_BYTES} bytes of secret in {path}, "
                f"got {len(secret)}"
            )
        return cls(secret)

    @classmethod
    def random(cls) -> DownloadUrls:
        """A sealer whose secret no other instance has."""
        return cls(os.urandom(32))

    def seal(self, download: Download) -> str:
        """The URL-safe token of ``download``."""
        payload = json.dumps(
            {"k": download.key, "r": download.run_id, "a": download.artifact_key, "e": download.expires},
            separators=(",", ":"),
        ).encode()
        nonce = os.urandom(_NONCE_BYTES)
        sealed = nonce + self._aead.encrypt(nonce, payload, _PURPOSE)
        return base64.urlsafe_b64encode(sealed).decode().rstrip("=")

    def open(self, token: str, now: float | None = None) -> Download:
        """What ``token`` stands for.

        Raises:
            ApiError: 404 for a token this secret did not seal, a changed one, or one expired at
                ``now`` (Unix seconds; default the current time).
        """
        refused = ApiError("token: no such download URL, or it expired; ask for new URLs", status=404)
        if len(token) > _MAX_TOKEN_CHARS:
            raise refused
        try:
            sealed = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
            payload = json.loads(self._aead.decrypt(sealed[:_NONCE_BYTES], sealed[_NONCE_BYTES:], _PURPOSE))
            download = Download(str(payload["k"]), str(payload["r"]), str(payload["a"]), float(payload["e"]))
        except (binascii.Error, InvalidTag, ValueError, KeyError, TypeError):
            raise refused from None
        if download.expires <= (time.time() if now is None else now):
            raise refused
        return download
