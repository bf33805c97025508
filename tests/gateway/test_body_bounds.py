"""The gateway's bounds on what a request may make it read: the routes that take no API key
(``client/config``, ``telemetry``) hold only small bodies, decompressed size counted. A real
gateway process; no scheduler behind it, as none of these requests reaches one."""

from __future__ import annotations

import httpx
import pytest
import zstandard
from tinker._version import __version__ as sdk_version

from tests.support.gateway import Gateway


@pytest.fixture(scope="module")
def http(tmp_path_factory):
    gateway = Gateway(tmp_path_factory.mktemp("gateway-bounds"), "127.0.0.1:1", "--max-body-mb", "64")
    try:
        with httpx.Client(base_url=gateway.url, timeout=60) as client:
            yield client
    finally:
        gateway.close()


@pytest.mark.parametrize("route", ["telemetry", "client/config"])
def test_a_route_without_a_key_refuses_a_large_body(http, route) -> None:
    r = http.post(f"/api/v1/{route}", content=b"x" * (1024 * 1024))
    assert r.status_code == 413 and r.json()["category"] == "user", r.text
    assert r.json()["detail"].startswith("body: at most 65536 bytes")


def test_a_route_without_a_key_refuses_a_small_body_that_decompresses_large(http) -> None:
    bomb = zstandard.ZstdCompressor().compress(b"\0" * (8 * 1024 * 1024))
    assert len(bomb) < 65536
    r = http.post("/api/v1/telemetry", content=bomb, headers={"Content-Encoding": "zstd"})
    assert r.status_code == 413 and "once decompressed" in r.json()["detail"], r.text


def test_a_small_body_still_passes(http) -> None:
    r = http.post("/api/v1/client/config", json={"sdk_version": sdk_version})
    assert r.status_code == 200, r.text
    r = http.post("/api/v1/telemetry", json={"events": [{"name": "x"}]})
    assert r.status_code == 200, r.text
