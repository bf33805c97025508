"""TLS shared by the client, the CLI, trainer node agents, the servers and the HTTP side ports.
The credentials that travel on calls are in :mod:`opentinker_common.net.bearer`.

gRPC channel credentials (:func:`channel_credentials`). Files are PEM. Each argument left ``None``
is read from its environment variable:

* ``root_certificates`` — ``$OPENTINKER_TLS_CA``: the CA that signed the scheduler's certificate.
  Setting it turns TLS on. An ``https://`` / ``grpcs://`` scheduler URL (``tls=True``) turns TLS
  on without one: the server is then checked against the system's trusted roots.
* ``client_cert`` / ``client_key`` — ``$OPENTINKER_TLS_CERT`` / ``$OPENTINKER_TLS_KEY``: this side's
  certificate and key for mTLS (trainer nodes; clients too when the scheduler has
  ``tls.client_auth: all``).

Every PEM file (here, in the scheduler's ``tls:`` and ``http_tls:``, and the trainer's TLS flags)
must be a regular file of at most :data:`MAX_PEM_BYTES` (:func:`check_pem_path`,
:func:`read_pem_file`): ``/dev/zero`` or a FIFO is refused before it is opened for reading.
"""

from __future__ import annotations

import os
import ssl
import stat

import grpc

ENV_CA, ENV_CERT, ENV_KEY = "OPENTINKER_TLS_CA", "OPENTINKER_TLS_CERT", "OPENTINKER_TLS_KEY"


_PEM_CERT = b"-----BEGIN CERTIFICATE-----"

#: Largest PEM file read (bytes): a long certificate chain is a few tens of KiB.
MAX_PEM_BYTES = 1024 * 1024


def _too_big(path, what: str, size: int) -> ValueError:
    return ValueError(
        f"{what}: {os.fspath(path)!r} is {size} bytes, more than the {MAX_PEM_BYTES} bytes (1 MiB) a PEM file may hold"
    )


def check_pem_path(path: str | os.PathLike, what: str) -> None:
    """Check, without opening it, that ``path`` is a regular file of at most
    :data:`MAX_PEM_BYTES` bytes (so ``/dev/zero`` is not read without bound, nor a FIFO waited on).

    Raises:
        ValueError: naming ``what``: the file cannot be stat'ed, is not a regular file
            (``"root_certificates: '/dev/zero' is not a regular file"``) or is too large.
    """
    try:
        st = os.stat(path)
    except OSError as exc:
        raise ValueError(f"{what}: cannot read {os.fspath(path)!r}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{what}: {os.fspath(path)!r} is not a regular file")
    if st.st_size > MAX_PEM_BYTES:
        raise _too_big(path, what, st.st_size)


def read_pem_file(path: str | os.PathLike, what: str) -> bytes:
    """The bytes of ``path`` after :func:`check_pem_path`; opened without blocking and checked
    again on the open file, reading at most :data:`MAX_PEM_BYTES` (+1 to notice more), so a
    file swapped for a FIFO or a device between the checks is refused too.

    Raises:
        ValueError: as :func:`check_pem_path`, naming ``what``; also when reading fails.
    """
    check_pem_path(path, what)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise ValueError(f"{what}: cannot read {os.fspath(path)!r}: {exc.strerror or exc}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{what}: {os.fspath(path)!r} is not a regular file")
        chunks, size = [], 0
        while size <= MAX_PEM_BYTES:
            chunk = os.read(fd, MAX_PEM_BYTES + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as exc:
        raise ValueError(f"{what}: cannot read {os.fspath(path)!r}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if size > MAX_PEM_BYTES:
        raise _too_big(path, what, size)
    return b"".join(chunks)


def _read(path: str | os.PathLike | None, what: str) -> bytes | None:
    """The PEM bytes of ``path`` (None when not given), checked for what ``what`` must hold:
    ``root_certificates`` a ``CERTIFICATE`` block and no private key, ``client_cert`` a
    ``CERTIFICATE`` block, ``client_key`` a ``PRIVATE KEY`` block. A wrong file fails here,
    naming the argument, instead of as ``Failed to create security handshaker`` on a call."""
    if path is None or str(path) == "":
        return None
    data = read_pem_file(path, what)
    if b"-----BEGIN " not in data:
        raise ValueError(f"{what}: {str(path)!r} is not a PEM file")
    if what == "client_key":
        if b"PRIVATE KEY-----" not in data:
            raise ValueError(
                f"{what}: {str(path)!r} holds no PRIVATE KEY block (expected the PEM private key of client_cert)"
            )
        return data
    if what == "root_certificates" and b"PRIVATE KEY-----" in data:
        raise ValueError(f"{what}: {str(path)!r} holds a private key, not a CA certificate")
    if _PEM_CERT not in data:
        raise ValueError(f"{what}: {str(path)!r} holds no {_PEM_CERT.decode()} block (expected a PEM certificate)")
    return data


def channel_credentials(
    root_certificates: str | os.PathLike | None = None,
    client_cert: str | os.PathLike | None = None,
    client_key: str | os.PathLike | None = None,
    *,
    tls: bool = False,
) -> grpc.ChannelCredentials | None:
    """Credentials for a TLS channel, or ``None`` for plaintext.

    TLS when a CA is given (argument or environment), or when ``tls`` is true (the scheduler URL
    was ``https://`` or ``grpcs://``; see :func:`~opentinker_common.net.url.parse_scheduler_address`);
    then without a CA the server's certificate is checked against the system roots
    (``grpc.ssl_channel_credentials()``), and a server whose certificate they do not vouch for
    fails the handshake (UNAVAILABLE, ``CERTIFICATE_VERIFY_FAILED``).

    Raises:
        ValueError: a file that cannot be read, is not a regular file, is larger than 1 MiB
            (:data:`MAX_PEM_BYTES`) or is not PEM, a CA file that holds a private key
            or no certificate, a client certificate file without a certificate or a key file
            without a private key, a certificate without its key (or the reverse), or a client
            certificate with neither a CA nor ``tls``; naming the argument.
    """
    ca = _read(root_certificates if root_certificates is not None else os.environ.get(ENV_CA), "root_certificates")
    cert = _read(client_cert if client_cert is not None else os.environ.get(ENV_CERT), "client_cert")
    key = _read(client_key if client_key is not None else os.environ.get(ENV_KEY), "client_key")
    if (cert is None) != (key is None):
        raise ValueError("client_cert and client_key: expected both (mTLS) or neither")
    if ca is None and not tls:
        if cert is not None:
            raise ValueError(
                "root_certificates: expected the CA of the scheduler's certificate when a client certificate is given "
                "(or an https:// scheduler URL to trust the system roots)"
            )
        return None
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


# ------------------------------------------------------------------------------ server certificates


def _no_password() -> bytes:
    # An encrypted key must fail, not make OpenSSL prompt for a pass phrase on the terminal
    # (gRPC cannot use an encrypted key either).
    raise ValueError("encrypted private key")


def server_ssl_context(
    cert: str | os.PathLike, key: str | os.PathLike, *, names: tuple[str, str] = ("cert", "key")
) -> ssl.SSLContext:
    """A TLS server context (TLS 1.2 or newer) for an HTTPS port, from PEM files; also used to
    check a gRPC server's certificate/key pair at start.

    Args:
        names: how to call the two files in a :class:`ValueError` (flags or config keys).

    Raises:
        ValueError: a file is not a regular file or larger than 1 MiB (:func:`check_pem_path`),
            or the key is encrypted.
        ssl.SSLError: the key does not match the certificate (reason ``KEY_VALUES_MISMATCH``), or
            a file is not PEM.
        OSError: a file cannot be read.
    """
    check_pem_path(cert, names[0])
    check_pem_path(key, names[1])
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(certfile=str(cert), keyfile=str(key), password=_no_password)
    except ValueError:  # from _no_password
        raise ValueError(
            f"{names[1]}: {os.fspath(key)!r} is an encrypted private key; expected an unencrypted PEM key"
        ) from None
    if _is_ca_certificate(read_pem_file(cert, names[0])):
        raise ValueError(
            f"{names[0]}: expected the server's own certificate (signed by a CA), got {os.fspath(cert)!r}, "
            "a CA certificate (basicConstraints CA:TRUE): clients would fail hostname verification"
        )
    return ctx


def _is_ca_certificate(pem: bytes) -> bool:
    """Whether the first certificate in ``pem`` is a CA's (basicConstraints CA:TRUE). Needs
    ``cryptography``; without it (a minimal install) the check is skipped and returns False."""
    try:
        from cryptography import x509
    except ImportError:  # pragma: no cover - cryptography is present wherever the tests run
        return False
    try:
        cert = x509.load_pem_x509_certificate(pem)
        return bool(cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca)
    except (ValueError, x509.ExtensionNotFound):
        return False


def check_key_pair(
    cert: str | os.PathLike, key: str | os.PathLike, *, names: tuple[str, str] = ("cert", "key")
) -> None:
    """Check that PEM ``key`` is the private key of the certificate in PEM ``cert``.

    Raises:
        ValueError: one line naming ``names``: a file that is not a regular file, too large,
            unreadable, a ``cert`` without a ``CERTIFICATE`` block, a ``key`` without a
            ``PRIVATE KEY`` block, an encrypted key, or a key of another certificate
            (``"key: expected the private key of cert, got 'other.key' (KEY_VALUES_MISMATCH)"``).
    """
    if _PEM_CERT not in read_pem_file(cert, names[0]):
        raise ValueError(
            f"{names[0]}: {os.fspath(cert)!r} holds no {_PEM_CERT.decode()} block (expected a PEM certificate)"
        )
    if b"PRIVATE KEY-----" not in read_pem_file(key, names[1]):
        raise ValueError(
            f"{names[1]}: {os.fspath(key)!r} holds no PRIVATE KEY block (expected the PEM private key of {names[0]})"
        )
    try:
        server_ssl_context(cert, key, names=names)
    except ssl.SSLError as exc:
        reason = getattr(exc, "reason", None) or str(exc)
        raise ValueError(
            f"{names[1]}: expected the private key of {names[0]} ({os.fspath(cert)!r}), got {os.fspath(key)!r} "
            f"({reason})"
        ) from None
    except OSError as exc:
        raise ValueError(
            f"{names[0]}/{names[1]}: cannot read {os.fspath(cert)!r} or {os.fspath(key)!r}: {exc.strerror or exc}"
        ) from None
