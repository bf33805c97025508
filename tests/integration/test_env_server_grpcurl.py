"""A client-hosted environment server answers grpcurl (the real binary) through reflection:
the service is listed and ``Describe`` answers with the bearer token, no .proto files needed."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from opentinker_client.hosting.server import EnvironmentServer

from tests.support.environments import Corridor


def test_grpcurl_lists_and_describes_without_proto_files() -> None:
    grpcurl = shutil.which("grpcurl") or str(Path(sys.executable).parent / "grpcurl")
    if not Path(grpcurl).exists():
        pytest.skip("grpcurl is not installed (make install puts it in .venv/bin)")
    server = EnvironmentServer(Corridor()).start()
    try:
        _grpcurl_list_and_describe(grpcurl, server)
    finally:
        server.stop(grace=0)


def _grpcurl_list_and_describe(grpcurl: str, server: EnvironmentServer) -> None:
    listed = subprocess.run(
        [grpcurl, "-plaintext", server.endpoint, "list"], capture_output=True, text=True, timeout=30, check=True
    )
    assert "opentinker.environment.v1.EnvironmentService" in listed.stdout.split()
    out = subprocess.run(
        [grpcurl, "-plaintext", "-H", f"authorization: Bearer {server.token}", server.endpoint,
         "opentinker.environment.v1.EnvironmentService/Describe"],
        capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    assert '"name": "Corridor"' in out.stdout and '"left"' in out.stdout
