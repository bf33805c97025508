"""API keys on calls: the ``authorization: Bearer <key>`` metadata entry, checked before it is
sent (:func:`clean_api_key`) and when it arrives (:func:`authorization_problem`)."""

from __future__ import annotations

__all__ = ["clean_api_key", "bearer_metadata", "authorization_problem"]

#: Schemes of the HTTP ``Authorization`` header (IANA registry and common ones) that a refusal
#: may name; anything else is described without being echoed (it may be a secret).
_KNOWN_SCHEMES = frozenset(
    s.lower()
    for s in (
        "Basic",
        "Bearer",
        "Digest",
        "DPoP",
        "HOBA",
        "Mutual",
        "Negotiate",
        "NTLM",
        "OAuth",
        "PrivateToken",
        "SCRAM-SHA-1",
        "SCRAM-SHA-256",
        "vapid",
        "Token",
        "ApiKey",
        "Api-Key",
        "Key",
        "AWS4-HMAC-SHA256",
    )
)


def clean_api_key(api_key: str | None, what: str = "api_key") -> str:
    """``api_key`` without surrounding whitespace (``open("admin.key").read()`` ends in a newline;
    so may ``--api-key "$K"``); ``None`` gives ``""`` (send no key).

    gRPC refuses metadata values with control characters (``INTERNAL: Invalid metadata``), so a
    key is checked here instead, before any call.

    Raises:
        ValueError: naming ``what``, when the key holds inner whitespace, control characters or
            non-ASCII characters. The message gives the position, never the key.
    """
    if api_key is None:
        return ""
    if not isinstance(api_key, str):
        raise ValueError(f"{what}: expected a string (otk_...), got {type(api_key).__name__}")
    key = api_key.strip()
    for i, ch in enumerate(key):
        if not 0x21 <= ord(ch) <= 0x7E:
            kind = (
                "whitespace"
                if ch.isspace()
                else ("a control character" if ord(ch) < 0x20 or ord(ch) == 0x7F else "a non-ASCII character")
            )
            raise ValueError(
                f"{what}: expected an API key of printable ASCII characters without spaces (otk_...), "
                f"got {len(key)} characters with {kind} at position {i} (the key is not shown)"
            )
    return key


def bearer_metadata(api_key: str) -> tuple[tuple[str, str], ...]:
    """The call metadata that carries ``api_key``: ``(("authorization", "Bearer <key>"),)``, or
    ``()`` for ``""`` (send no key). ``api_key`` should have passed :func:`clean_api_key`."""
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()


def authorization_problem(metadata, *, expected: str = "Bearer otk_...") -> str | None:
    """Why the ``authorization`` entry of call ``metadata`` is not ``Bearer <token>``, or None
    when it is well formed or absent (absent is "missing", which callers word themselves).

    The message names the scheme only when it is a known HTTP authentication scheme (``Basic``,
    ...); a bare value is described, never echoed, since it may be the secret itself::

        malformed authorization metadata: expected 'Bearer otk_...', got a 'Basic' value
    """
    for key, value in metadata or ():
        if key.lower() != "authorization":
            continue
        if isinstance(value, bytes):
            value = value.decode("latin-1")
        scheme, _, rest = str(value).strip().partition(" ")
        if scheme.lower() == "bearer" and rest.strip():
            return None
        if not scheme:
            got = "an empty value"
        elif scheme.lower() == "bearer":
            got = "a 'Bearer' value without a key"
        elif scheme.lower() in _KNOWN_SCHEMES:
            got = f"a '{scheme}' value"
        elif scheme.startswith("otk_"):
            got = "a bare key without the 'Bearer ' scheme"
        else:
            got = "a value without a known scheme"
        return f"malformed authorization metadata: expected '{expected}', got {got}"
    return None
