"""The scrape token of the side ports (the trainer's ``/metrics``, the scheduler's HTTP port): read
from a file (:func:`read_scrape_token`) and checked on every path but the health probes
(:func:`scrape_refusal`). Both ports serve through :mod:`opentinker_common.net.bounded_http`."""

from __future__ import annotations

import hmac
import json
import os
import stat

__all__ = [
    "OPEN_PATHS",
    "SCRAPE_CHALLENGE",
    "read_scrape_token",
    "scrape_refusal",
]

#: Paths a scrape token does not guard: health probes (orchestrators and load balancers send no
#: token; the answers carry no task, owner or node detail beyond a reason).
OPEN_PATHS = frozenset({"/health", "/live", "/ready"})
#: Bounds on a scrape token file: at least 16 characters (a guessable token is no guard), at most 4 KiB.
MIN_TOKEN_CHARS, MAX_TOKEN_BYTES = 16, 4096


def read_scrape_token(path: str | os.PathLike, name: str) -> str:
    """The bearer token in the file at ``path`` (one line; surrounding whitespace dropped), as
    Prometheus reads ``authorization: {credentials_file: ...}``.

    Args:
        name: how to call the file in errors (the flag or config key).

    Raises:
        ValueError: ``<name>: expected ...`` for a missing, unreadable, non-regular, oversized file,
            or a token shorter than 16 characters or with spaces or control characters in it.
    """
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{name}: expected a regular file holding the scrape token, got {os.fspath(path)!r}")
        if st.st_size > MAX_TOKEN_BYTES:
            raise ValueError(f"{name}: expected a token file of at most {MAX_TOKEN_BYTES} bytes, got {st.st_size}")
        with open(path, encoding="utf-8") as fh:
            token = fh.read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        why = getattr(exc, "strerror", None) or exc
        raise ValueError(f"{name}: expected a readable token file, got {os.fspath(path)!r} ({why})") from None
    if len(token) < MIN_TOKEN_CHARS or any(c.isspace() or not c.isprintable() for c in token):
        raise ValueError(
            f"{name}: expected a token of at least {MIN_TOKEN_CHARS} printable characters without spaces "
            f"(e.g. `openssl rand -hex 32`), got {len(token)} characters in {os.fspath(path)!r}"
        )
    return token


#: The header a 401 of a guarded side port carries.
SCRAPE_CHALLENGE = ("WWW-Authenticate", 'Bearer realm="opentinker-metrics"')


def scrape_refusal(token: str | None, path: str, authorization: str, *, open_paths=OPEN_PATHS) -> bytes | None:
    """None when a request for ``path`` with this ``Authorization`` header value may be answered
    (no token set, an open path, or ``Bearer <token>``, compared in constant time); else the JSON
    body of its 401, which never echoes what was sent."""
    if not token or path in open_paths:
        return None
    if hmac.compare_digest(authorization.encode("latin-1", "replace"), f"Bearer {token}".encode()):
        return None
    why = "wrong bearer token" if authorization else "missing bearer token"
    return json.dumps({"error": f"{why}: send 'Authorization: Bearer <scrape token>' (see docs/security.md)"}).encode()
