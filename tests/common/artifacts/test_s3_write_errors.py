"""An S3 store that refuses writes mid-upload: the error is a store error, never boto3's own.

SeaweedFS cannot be made to fail one request, so a stand-in S3 endpoint on loopback (a real HTTP
server) answers listings and deletes as an empty bucket does and refuses every PUT with the
status S3 itself sends: 500 ``InternalError`` (a store in trouble) or 403 ``AccessDenied``.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from opentinker_common.artifacts import S3ArtifactStore, S3Location, StoreAuthError, StoreUnavailable

_EMPTY_LISTING = (
    b'<?xml version="1.0" encoding="UTF-8"?>'
    b'<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/"><Name>b</Name><Prefix></Prefix>'
    b"<KeyCount>0</KeyCount><MaxKeys>1000</MaxKeys><IsTruncated>false</IsTruncated></ListBucketResult>"
)


def _refusing_endpoint(refusal: dict):
    """``refusal["status"]`` and ``refusal["code"]``: what every PUT gets (read per request)."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # answers boto3's "Expect: 100-continue" at once

        def log_message(self, *args) -> None:
            pass

        def _send(self, status: int, body: bytes = b"") -> None:
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Content-Type", "application/xml")
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            self._send(200, _EMPTY_LISTING)

        def do_DELETE(self) -> None:
            self._send(204)

        def do_PUT(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            body = f"<Error><Code>{refusal['code']}</Code><Message>refused by the test</Message></Error>"
            self._send(refusal["status"], body.encode())

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_a_refused_file_upload_is_a_store_error(monkeypatch, tmp_path):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test-access")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test-secret-never-shown")
    refusal: dict = {}
    server = _refusing_endpoint(refusal)
    try:
        endpoint = f"http://127.0.0.1:{server.server_address[1]}"
        store = S3ArtifactStore(S3Location(bucket="b", endpoint=endpoint), max_attempts=1)
        (tmp_path / "src").mkdir()
        (tmp_path / "src" / "weights.bin").write_bytes(b"w" * 1000)
        for status, code, error, words in [
            (500, "InternalError", StoreUnavailable, "S3 error InternalError while writing k/x"),
            (403, "AccessDenied", StoreAuthError, "refused the credentials while writing k/x (AccessDenied)"),
        ]:
            refusal.update(status=status, code=code)
            with pytest.raises(error) as err:
                store.put_folder("k/x", tmp_path / "src")
            assert words in str(err.value)
            assert "test-secret-never-shown" not in str(err.value)
    finally:
        server.shutdown()
        server.server_close()
