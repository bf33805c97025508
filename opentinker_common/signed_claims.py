"""Claims signed with HMAC-SHA256 (RFC 2104): the text ``<payload>.<signature>`` of the scheduler's
attempt credentials and endpoint tokens.

The payload is compact JSON in unpadded URL-safe base64 (RFC 4648, section 5); the signature is
the HMAC-SHA256 of the payload text, in the same base64.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import re

__all__ = ["decode_claims", "encode_claims", "signature"]

_B64 = re.compile(r"^[A-Za-z0-9_-]*$")


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def encode_claims(claims: dict) -> str:
    """The payload of ``claims``: compact JSON in unpadded URL-safe base64."""
    return _b64(json.dumps(claims, separators=(",", ":")).encode())


def decode_claims(payload: str) -> object:
    """The JSON value of a payload, not yet trusted.

    Raises:
        ValueError: not URL-safe base64, or not JSON.
    """
    if not _B64.match(payload):
        raise ValueError("not URL-safe base64")
    return json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))


def signature(secret: bytes, payload: str, *, context: bytes = b"") -> str:
    """HMAC-SHA256 of ``context`` then ``payload`` under ``secret``, in unpadded URL-safe base64
    (``context`` keeps one kind of signed text from passing for another under the same secret).
    Compare it with :func:`hmac.compare_digest`."""
    return _b64(hmac.new(secret, context + payload.encode(), hashlib.sha256).digest())
